//! FC passes against a naive f64 reference in plain layout; every valid spec
//! gives the same result; bad input gives errors that name the value.

use brgemm_primitives::init::Rng;
use brgemm_primitives::PassConfig;
use brgemm_primitives::{Activation, Blocked, Fc, FcTuning, Inner, Pool};
use proptest::prelude::*;

mod common;

fn rand_vec(r: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| 2.0 * r.uniform() - 1.0).collect()
}

fn act64(a: Activation, x: f64) -> f64 {
    a.apply(x as f32) as f64 // the definition; f32 rounding is within tolerance
}

/// d act / d z at the pre-activation `z`, in f64 from the definitions
/// (GELU: the tanh form the kernels use).
fn dact64(a: Activation, z: f64) -> f64 {
    match a {
        Activation::Relu => (z > 0.0) as u8 as f64,
        Activation::Sigmoid => {
            let s = 1.0 / (1.0 + (-z).exp());
            s * (1.0 - s)
        }
        Activation::Tanh => 1.0 - z.tanh().powi(2),
        Activation::Gelu => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let t = (c * (z + 0.044715 * z.powi(3))).tanh();
            0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * z * z)
        }
        _ => 1.0,
    }
}

struct Problem {
    n: usize,
    c: usize,
    k: usize,
    act: Activation,
    x: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
    dy: Vec<f32>,
}

impl Problem {
    fn new(n: usize, c: usize, k: usize, act: Activation, seed: u64) -> Problem {
        let mut r = Rng::new(seed);
        Problem {
            n,
            c,
            k,
            act,
            x: rand_vec(&mut r, n * c),
            w: rand_vec(&mut r, k * c),
            b: rand_vec(&mut r, k),
            dy: rand_vec(&mut r, n * k),
        }
    }

    /// (y, dx, dw, db) in f64, plain row-major.
    fn reference(&self) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (n, c, k) = (self.n, self.c, self.k);
        let mut z = vec![0.0f64; n * k];
        let mut y = vec![0.0f64; n * k];
        for i in 0..n {
            for j in 0..k {
                let mut s = self.b[j] as f64;
                for p in 0..c {
                    s += self.x[i * c + p] as f64 * self.w[j * c + p] as f64;
                }
                z[i * k + j] = s;
                y[i * k + j] = act64(self.act, s);
            }
        }
        let dz: Vec<f64> = (0..n * k)
            .map(|i| self.dy[i] as f64 * dact64(self.act, z[i]))
            .collect();
        let mut dx = vec![0.0f64; n * c];
        let mut dw = vec![0.0f64; k * c];
        let mut db = vec![0.0f64; k];
        for i in 0..n {
            for j in 0..k {
                db[j] += dz[i * k + j];
                for p in 0..c {
                    dx[i * c + p] += dz[i * k + j] * self.w[j * c + p] as f64;
                    dw[j * c + p] += dz[i * k + j] * self.x[i * c + p] as f64;
                }
            }
        }
        (y, dx, dw, db)
    }

    /// Runs the three passes through the blocked primitive.
    fn run(&self, fc: &Fc, pool: &Pool) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let t = fc.tuning();
        let x = Blocked::from_plain(&self.x, self.n, self.c, t.bn, t.bc, Inner::RowMajor).unwrap();
        let mut w = fc.w_layout();
        w.set_plain(&self.w).unwrap();
        let mut b = vec![0.0; fc.padded_k()];
        b[..self.k].copy_from_slice(&self.b);
        let mut y = fc.y_layout();
        let mut z = fc.y_layout();
        fc.forward(pool, &x, &w, &b, &mut y, Some(&mut z)).unwrap();
        let mut dy = fc.y_layout();
        dy.set_plain(&self.dy).unwrap();
        let mut dz = fc.y_layout();
        fc.activation_backward(pool, &dy, &y, Some(&z), &mut dz, None)
            .unwrap();
        let mut dzt = fc.dzt_layout();
        let mut dx = fc.x_layout();
        fc.backward_data(pool, &dz, &w, &mut dzt, &mut dx).unwrap();
        // The transposed-weights path computes the same dX.
        let mut wt = fc.wt_layout();
        fc.transpose_weights(pool, &w, &mut wt).unwrap();
        let mut dx_wt = fc.x_layout();
        fc.backward_data_wt(pool, &dz, &wt, &mut dx_wt).unwrap();
        for (a, b) in dx.data().iter().zip(dx_wt.data()) {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                "dX {a} vs {b} (Wt path)"
            );
        }
        let mut dw = fc.w_layout();
        let mut db = vec![f32::NAN; fc.padded_k()]; // every entry must be written
        fc.backward_weights(pool, &dz, &x, &mut dw, &mut db)
            .unwrap();
        // Padding must stay zero (the next layer and the optimizer rely on it).
        let pad_ok = |b: &Blocked| {
            let mut live = vec![false; b.data().len()];
            for r in 0..b.rows() {
                for c in 0..b.cols() {
                    live[b.index(r, c)] = true;
                }
            }
            b.data().iter().zip(&live).all(|(v, l)| *l || *v == 0.0)
        };
        assert!(pad_ok(&dx) && pad_ok(&dw), "gradient padding written");
        assert!(
            db[self.k..].iter().all(|&v| v == 0.0),
            "bias-gradient padding written"
        );
        (
            y.to_plain(),
            dx.to_plain(),
            dw.to_plain(),
            db[..self.k].to_vec(),
        )
    }
}

fn close(what: &str, got: &[f32], want: &[f64], terms: usize) -> Result<(), String> {
    let tol = 1e-5 * (terms as f64).sqrt().max(1.0) * 4.0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (*g as f64 - w).abs();
        // NaN must fail too.
        if d.is_nan() || d > tol * (1.0 + w.abs()) {
            return Err(format!("{what}[{i}] = {g}, want {w} (tol {tol:e})"));
        }
    }
    Ok(())
}

fn check(p: &Problem, fc: &Fc, pool: &Pool) -> Result<(), String> {
    let (y, dx, dw, db) = p.run(fc, pool);
    let (ry, rdx, rdw, rdb) = p.reference();
    close("Y", &y, &ry, p.c)?;
    close("dX", &dx, &rdx, p.k)?;
    close("dW", &dw, &rdw, p.n)?;
    close("db", &db, &rdb, p.n)
}

fn act_strategy() -> impl Strategy<Value = Activation> {
    prop_oneof![
        Just(Activation::Identity),
        Just(Activation::Relu),
        Just(Activation::Sigmoid),
        Just(Activation::Tanh),
        Just(Activation::Gelu)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48)))]

    /// Shapes that are not multiples of the blocks, random blockings, both
    /// thread counts, chunked and whole reductions.
    #[test]
    fn fc_passes_match_f64_reference(
        n in 1usize..=70, c in 1usize..=70, k in 1usize..=70,
        bn in prop_oneof![Just(8usize), Just(16), Just(13), Just(64)],
        bc in prop_oneof![Just(8usize), Just(16), Just(7), Just(64)],
        bk in prop_oneof![Just(16usize), Just(32), Just(10), Just(64)],
        chunk in 0usize..=3,
        threads in 1usize..=2,
        act in act_strategy(),
        seed in any::<u64>(),
    ) {
        let pass = |spec: &str| PassConfig { chunk, ..PassConfig::spec(spec) };
        let t = FcTuning { bn, bc, bk, fwd: pass("ABc"), bwd: pass("ACb"), upd: pass("BCa") };
        let fc = Fc::with_tuning(n, c, k, act, t).unwrap();
        let pool = Pool::new(threads).unwrap().always_parallel();
        let p = Problem::new(n, c, k, act, seed);
        check(&p, &fc, &pool).map_err(TestCaseError::fail)?;
    }
}

#[test]
fn default_tuning_matches_reference_on_typical_shapes() {
    let pool = Pool::new(2).unwrap().always_parallel();
    for (n, c, k) in [(64, 64, 10), (100, 64, 128), (32, 200, 96), (1, 1, 1)] {
        for act in [Activation::Relu, Activation::Gelu] {
            let fc = Fc::new(n, c, k, act).unwrap();
            check(&Problem::new(n, c, k, act, 9), &fc, &pool)
                .unwrap_or_else(|e| panic!("{n}x{c}x{k}: {e}"));
        }
    }
}

/// Reductions longer than the heuristic's chunk: the defaults split them and
/// run the chunk loop outermost (fwd over 10 C blocks and upd over 10 N
/// blocks here, bwd over 18 K blocks in the second shape), padded tails too.
#[test]
fn default_tuning_with_chunked_reductions_matches_reference() {
    let pool = Pool::new(2).unwrap().always_parallel();
    // Where kernels prefetch from L2, upd (K blocks < C blocks) stays whole.
    let split_upd = brgemm::policy().unwrap().stream_prefetch == brgemm::StreamPrefetch::BeyondL2;
    for (n, c, k, chunked) in [
        (600, 640, 96, [true, false, split_upd]),
        (130, 48, 1100, [false, true, false]),
    ] {
        let fc = Fc::new(n, c, k, Activation::Relu).unwrap();
        let t = fc.tuning();
        // Chunks of 8, the reduction loop (c, b, a) outermost.
        let got = [(&t.fwd, 'c'), (&t.bwd, 'b'), (&t.upd, 'a')]
            .map(|(p, red)| p.chunk == 8 && p.spec.starts_with(red));
        assert_eq!(got, chunked, "{n}x{c}x{k}: {t:?}");
        check(&Problem::new(n, c, k, Activation::Relu, 5), &fc, &pool)
            .unwrap_or_else(|e| panic!("{n}x{c}x{k}: {e}"));
    }
}

/// Weights that stream (one N block, over 32 reduction blocks): where the
/// policy prefetches from L2 (`BeyondL1`), forward reads them in chunks (one block per
/// call under 32 rows, `stream_chunk` from 32), backward-data whole (it does
/// not prefetch the next call's blocks); padded tails, against the reference.
/// Their 64-row blocks take the policy's FC tile where it names one (4 x 4 on
/// Zen 4: forward over 16 and 32 rows, backward-weights over 64 columns).
#[test]
fn default_tuning_for_streamed_weights_matches_reference() {
    let pool = Pool::new(2).unwrap().always_parallel();
    let pol = brgemm::policy().unwrap();
    let streams = pol.stream_prefetch == brgemm::StreamPrefetch::BeyondL1;
    for (n, c, k, fwd_chunk) in [
        (16, 2112, 130, pol.stream_chunk_narrow),
        (32, 2112, 130, pol.stream_chunk),
        (16, 130, 2112, 0),
    ] {
        let fc = Fc::new(n, c, k, Activation::Relu).unwrap();
        let t = fc.tuning();
        // Elsewhere long reductions are split (the test above).
        if streams {
            assert_eq!(t.fwd.chunk, fwd_chunk, "{n}x{c}x{k}: {t:?}");
            assert_eq!(t.bwd.chunk, 0, "{n}x{c}x{k}: {t:?}");
        }
        check(&Problem::new(n, c, k, Activation::Relu, 7), &fc, &pool)
            .unwrap_or_else(|e| panic!("{n}x{c}x{k}: {e}"));
    }
}

/// Every valid spec (orders, parallel choices, blocking levels, chunks) of
/// every pass gives the default spec's result.
#[test]
fn every_valid_spec_gives_the_same_result() {
    let pool = Pool::new(2).unwrap().always_parallel();
    // 6 N blocks, 4 C blocks, 4 K blocks: blocking levels of 2 divide every loop.
    let (n, c, k) = (48, 32, 48);
    let base = FcTuning {
        bn: 8,
        bc: 8,
        bk: 12,
        ..FcTuning::heuristic(n, c, k)
    };
    let p = Problem::new(n, c, k, Activation::Tanh, 3);
    let want = p.run(
        &Fc::with_tuning(n, c, k, Activation::Tanh, base.clone()).unwrap(),
        &pool,
    );
    // Per pass: every order with each output loop serial or parallel (the
    // reduction stays serial), and blocked and chunked specs. The letters
    // are the same in every pass: a = N, b = K, c = C blocks.
    let mut specs = Vec::new();
    for (pass, red) in [(0, 'c'), (1, 'b'), (2, 'a')] {
        for order in ["abc", "acb", "bac", "bca", "cab", "cba"] {
            for mask in 0..4u8 {
                let mut outs = ['a', 'b', 'c'].into_iter().filter(|&l| l != red);
                let (o1, o2) = (outs.next().unwrap(), outs.next().unwrap());
                let s: String = order
                    .chars()
                    .map(|ch| {
                        let up = (ch == o1 && mask & 1 != 0) || (ch == o2 && mask & 2 != 0);
                        if up {
                            ch.to_ascii_uppercase()
                        } else {
                            ch
                        }
                    })
                    .collect();
                specs.push((pass, s, 0usize, vec![], vec![]));
            }
        }
    }
    specs.push((0, "aABc".into(), 0, vec![2], vec![]));
    specs.push((0, "AbBc".into(), 2, vec![], vec![2]));
    specs.push((0, "bAcB".into(), 1, vec![], vec![2]));
    specs.push((0, "cAB".into(), 3, vec![], vec![]));
    specs.push((1, "aACb".into(), 0, vec![2], vec![]));
    specs.push((1, "bAC".into(), 3, vec![], vec![]));
    specs.push((2, "bBCa".into(), 0, vec![], vec![2]));
    specs.push((2, "aCB".into(), 4, vec![], vec![]));
    let mut ran = 0;
    for (pass, spec, chunk, ba, bb) in specs {
        let pc = PassConfig {
            spec: spec.clone(),
            chunk,
            blocks_a: ba,
            blocks_b: bb,
        };
        let mut t = base.clone();
        *[&mut t.fwd, &mut t.bwd, &mut t.upd][pass] = pc;
        let fc = match Fc::with_tuning(n, c, k, Activation::Tanh, t) {
            Ok(f) => f,
            Err(e) => {
                // Non-adjacent parallel loops are refused, by design.
                assert!(e.to_string().contains("adjacent"), "{spec}: {e}");
                continue;
            }
        };
        let got = p.run(&fc, &pool);
        let same = |a: &[f32], b: &[f32]| {
            a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
        };
        assert!(
            same(&got.0, &want.0)
                && same(&got.1, &want.1)
                && same(&got.2, &want.2)
                && same(&got.3, &want.3),
            "pass {pass} spec {spec} chunk {chunk} differs"
        );
        ran += 1;
    }
    assert!(ran >= 60, "only {ran} specs ran");
}

#[test]
fn bad_specs_shapes_and_buffers_name_the_value() {
    let t = |spec: &str| FcTuning {
        upd: PassConfig::spec(spec),
        ..FcTuning::heuristic(64, 64, 64)
    };
    let e = Fc::with_tuning(64, 64, 64, Activation::Relu, t("ABC"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("upd") && e.contains("cannot run in parallel"),
        "{e}"
    );
    let e = Fc::with_tuning(64, 64, 64, Activation::Relu, t("BCz"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown loop letter 'z'"), "{e}");
    // Two C blocks: loop c cannot be left out (a loop of one block can).
    let t2 = FcTuning {
        upd: PassConfig::spec("Ba"),
        ..FcTuning::heuristic(64, 128, 64)
    };
    let e = Fc::with_tuning(64, 128, 64, Activation::Relu, t2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("loop 'c' (C blocks) is missing"), "{e}");
    assert!(Fc::with_tuning(64, 64, 64, Activation::Relu, t("Ba")).is_ok());
    let blk = FcTuning {
        fwd: PassConfig {
            blocks_a: vec![3],
            ..PassConfig::spec("aABc")
        },
        ..FcTuning::heuristic(64, 64, 64)
    };
    let blk = FcTuning { bn: 16, ..blk };
    let e = Fc::with_tuning(64, 64, 64, Activation::Relu, blk)
        .unwrap_err()
        .to_string();
    assert!(e.contains("block 3 does not divide the range 4"), "{e}");
    let e = Fc::new(0, 64, 64, Activation::Relu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("n = 0"), "{e}");

    let fc = Fc::new(8, 8, 8, Activation::Relu).unwrap();
    let pool = Pool::new(1).unwrap();
    let (x, w) = (fc.x_layout(), fc.w_layout());
    let mut y = fc.y_layout();
    let e = fc
        .forward(&pool, &x, &w, &[0.0; 3], &mut y, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bias") && e.contains("expected 8") && e.contains("got 3"),
        "{e}"
    );
    let wrong = Blocked::zeros(8, 9, 8, 8, Inner::RowMajor).unwrap();
    let e = fc
        .forward(&pool, &wrong, &w, &[0.0; 8], &mut y, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("X") && e.contains("8x9"), "{e}");
    assert!(Pool::new(0).is_err());
}

/// The fused update (`backward_weights_step`) leaves W and the optimizer's
/// moments bit for bit as `backward_weights` and a separate step do, over
/// two steps (moments carried), for SGD with momentum and Adam, on padded
/// and one-element shapes, one and two threads, and with a chunked
/// reduction (the path that forms dW whole first).
#[test]
fn fused_update_equals_backward_weights_then_step() {
    use brgemm_primitives::optim::OptState;
    let opts = common::step_rules();
    for (n, c, k, chunk) in [
        (16, 64, 64, 0),
        (33, 70, 19, 0),
        (1, 1, 1, 0),
        (200, 48, 40, 1),
    ] {
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap().always_parallel();
            let mut t = FcTuning::heuristic(n, c, k);
            if chunk > 0 {
                t.bn = 16;
                t.upd = PassConfig {
                    chunk,
                    ..PassConfig::spec("aBC")
                };
            }
            let fc = Fc::with_tuning(n, c, k, Activation::Relu, t.clone()).unwrap();
            let p = Problem::new(n, c, k, Activation::Relu, 17);
            let x = Blocked::from_plain(&p.x, n, c, t.bn, t.bc, Inner::RowMajor).unwrap();
            let mut dz = fc.y_layout();
            dz.set_plain(&p.dy).unwrap();
            for opt in opts {
                let mut w_sep = fc.w_layout();
                w_sep.set_plain(&p.w).unwrap();
                let (mut w_fused, w0) = (w_sep.clone(), w_sep.clone());
                let (mut s_sep, mut s_fused) = (OptState::default(), OptState::default());
                let mut dw = fc.w_layout();
                let (mut db_sep, mut db_fused) =
                    (vec![0.0; fc.padded_k()], vec![f32::NAN; fc.padded_k()]);
                for step in 0..2 {
                    fc.backward_weights(&pool, &dz, &x, &mut dw, &mut db_sep)
                        .unwrap();
                    s_sep.step(&opt, w_sep.data_mut(), dw.data());
                    fc.backward_weights_step(
                        &pool,
                        &dz,
                        &x,
                        &mut w_fused,
                        &mut db_fused,
                        &opt,
                        &mut s_fused,
                    )
                    .unwrap();
                    let what =
                        format!("{n}x{c}x{k} chunk {chunk}, {threads}t, {opt:?}, step {step}");
                    assert_eq!(w_fused.data(), w_sep.data(), "W: {what}");
                    assert_eq!(s_fused, s_sep, "moments: {what}");
                    assert_eq!(db_fused, db_sep, "db: {what}");
                }
                assert_ne!(w_fused.data(), w0.data(), "W moved");
            }
        }
    }
}
