//! LSTM and RNN layers against a naive f64 implementation in plain layout:
//! outputs, and every gradient (the reference gradients are f64 central
//! differences of the f64 forward, which is exact to ~1e-9 here), plus a
//! finite-difference check through time of the f32 layer itself.

use brgemm_primitives::rnn::{RnnBf16, RnnBf16Weights};
use brgemm_primitives::PassConfig;
use brgemm_primitives::{Blocked, CellKind, Pool, Rnn, RnnTuning};
use proptest::prelude::*;

mod common;
use common::data_f64 as data;

#[derive(Clone, Copy, Debug)]
struct Dims {
    kind: CellKind,
    t: usize,
    n: usize,
    c: usize,
    k: usize,
}

/// All parameters and inputs, plain: x [T][N][C], w [G][K][C], r [G][K][K],
/// b [G][K], h0 [N][K], c0 [N][K]; one flat vector with these offsets.
struct Params {
    d: Dims,
    v: Vec<f64>,
}

impl Params {
    fn g(&self) -> usize {
        self.d.kind.gates()
    }
    fn sizes(&self) -> [usize; 6] {
        let Dims { t, n, c, k, .. } = self.d;
        let g = self.g();
        [t * n * c, g * k * c, g * k * k, g * k, n * k, n * k]
    }
    fn part(&self, i: usize) -> std::ops::Range<usize> {
        let s = self.sizes();
        let lo: usize = s[..i].iter().sum();
        lo..lo + s[i]
    }
    fn new(d: Dims, seed: u64) -> Params {
        let mut p = Params { d, v: vec![] };
        let total: usize = p.sizes().iter().sum();
        p.v = data(total, seed, 1.0);
        p
    }
    fn get(&self, i: usize) -> &[f64] {
        &self.v[self.part(i)]
    }
}

fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// h_1..h_T as [T][N][K] and c_T.
fn naive_forward(p: &Params) -> (Vec<f64>, Vec<f64>) {
    naive_forward_q(p, |v| v)
}

/// As [`naive_forward`] with the operands of every product (x, W, R and
/// each h_(t-1)) passed through `q` first (bf16 rounding: what the bf16
/// kernels read).
fn naive_forward_q(p: &Params, q: fn(f64) -> f64) -> (Vec<f64>, Vec<f64>) {
    let Dims { kind, t, n, c, k } = p.d;
    let g = p.g();
    let qv = |v: &[f64]| v.iter().map(|x| q(*x)).collect::<Vec<f64>>();
    let (x, w, r, b) = (qv(p.get(0)), qv(p.get(1)), qv(p.get(2)), p.get(3));
    let mut h = qv(p.get(4));
    let mut cs = p.get(5).to_vec();
    let mut out = vec![];
    for ti in 0..t {
        let mut hn = vec![0.0; n * k];
        for ni in 0..n {
            let mut z = vec![0.0; g * k];
            for gi in 0..g {
                for ki in 0..k {
                    let mut s = b[gi * k + ki];
                    for ci in 0..c {
                        s += w[(gi * k + ki) * c + ci] * x[(ti * n + ni) * c + ci];
                    }
                    for j in 0..k {
                        s += r[(gi * k + ki) * k + j] * h[ni * k + j];
                    }
                    z[gi * k + ki] = s;
                }
            }
            for ki in 0..k {
                hn[ni * k + ki] = match kind {
                    CellKind::Rnn => z[ki].tanh(),
                    CellKind::Lstm => {
                        let (i_, f_, c_, o_) = (
                            sig(z[ki]),
                            sig(z[k + ki]),
                            z[2 * k + ki].tanh(),
                            sig(z[3 * k + ki]),
                        );
                        let cn = f_ * cs[ni * k + ki] + i_ * c_;
                        cs[ni * k + ki] = cn;
                        o_ * cn.tanh()
                    }
                };
            }
        }
        out.extend_from_slice(&hn);
        h = qv(&hn);
    }
    (out, cs)
}

/// The layer's outputs and gradients for the loss sum(dh * h), plain.
struct Got {
    h: Vec<f32>,
    dx: Vec<f32>,
    dw: Vec<Vec<f32>>,
    dr: Vec<Vec<f32>>,
    db: Vec<f32>,
    dh0: Vec<f32>,
    dc0: Vec<f32>,
}

fn run_layer(p: &Params, t: RnnTuning, dh_plain: &[f64], threads: usize) -> Got {
    run_layer_as(p, t, dh_plain, threads, false)
}

/// [`run_layer`], on the bf16 passes ([`RnnBf16`]) when `bf16`.
fn run_layer_as(p: &Params, t: RnnTuning, dh_plain: &[f64], threads: usize, bf16: bool) -> Got {
    let Dims {
        kind,
        t: steps,
        n,
        c,
        k,
    } = p.d;
    let g = kind.gates();
    let rnn = Rnn::with_tuning(kind, steps, n, c, k, t).unwrap();
    let pool = Pool::new(threads).unwrap().always_parallel();
    let f = |v: &[f64]| v.iter().map(|x| *x as f32).collect::<Vec<f32>>();
    let mut x = rnn.x_layout();
    rnn.set_sequence(&mut x, &f(p.get(0))).unwrap();
    let (mut w, mut r) = (rnn.w_layout(), rnn.r_layout());
    let mut bias = vec![0.0f32; rnn.bias_len()];
    let kp = rnn.padded_k();
    for gi in 0..g {
        rnn.set_gate_weights(&mut w, gi, &f(&p.get(1)[gi * k * c..][..k * c]))
            .unwrap();
        rnn.set_gate_weights(&mut r, gi, &f(&p.get(2)[gi * k * k..][..k * k]))
            .unwrap();
        bias[gi * kp..gi * kp + k].copy_from_slice(&f(&p.get(3)[gi * k..][..k]));
    }
    let state = |v: &[f64]| {
        let mut s = rnn.state_layout();
        for ni in 0..n {
            for ki in 0..k {
                let i = s.index(ni, ki);
                s.data_mut()[i] = v[ni * k + ki] as f32;
            }
        }
        s
    };
    let (h0, c0) = (state(p.get(4)), state(p.get(5)));
    let mut st = rnn.state();
    let mixed = bf16.then(|| {
        let m = RnnBf16::new(&rnn).unwrap();
        let mut packed = RnnBf16Weights::default();
        m.pack_weights(&pool, &w, &r, &mut packed).unwrap();
        (m, packed)
    });
    match &mixed {
        Some((m, pw)) => m
            .forward(&pool, &rnn, &x, pw, &bias, Some(&h0), Some(&c0), &mut st)
            .unwrap(),
        None => rnn
            .forward(&pool, &x, &w, &r, &bias, Some(&h0), Some(&c0), &mut st)
            .unwrap(),
    }
    // Hidden padding columns of h stay zero on their own.
    for r in 0..st.h().rows() {
        for c in k..rnn.padded_k() {
            assert_eq!(
                st.h().data()[st.h().index(r, c)],
                0.0,
                "h padding [{r}][{c}]"
            );
        }
    }
    let mut dh = rnn.h_layout();
    rnn.set_sequence(&mut dh, &f(dh_plain)).unwrap();
    let mut gr = rnn.grads();
    match &mixed {
        Some((m, pw)) => m
            .backward_from_state(&pool, &rnn, &dh, None, &x, pw, &st, &mut gr)
            .unwrap(),
        None => rnn.backward(&pool, &dh, &x, &w, &r, &st, &mut gr).unwrap(),
    }
    let plain_state = |s: &Blocked| {
        (0..n * k)
            .map(|i| s.data()[s.index(i / k, i % k)])
            .collect::<Vec<f32>>()
    };
    Got {
        h: rnn.sequence(st.h()).unwrap(),
        dx: rnn.sequence(gr.dx()).unwrap(),
        dw: (0..g).map(|gi| rnn.gate_weights(gr.dw(), gi)).collect(),
        dr: (0..g).map(|gi| rnn.gate_weights(gr.dr(), gi)).collect(),
        db: (0..g)
            .flat_map(|gi| gr.db()[gi * kp..gi * kp + k].to_vec())
            .collect(),
        dh0: plain_state(gr.dh0()),
        dc0: plain_state(gr.dc0()),
    }
}

fn close(what: &str, got: &[f32], want: &[f64]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} vs {}", got.len(), want.len()));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if (*g as f64 - w).abs() > 2e-4 * (1.0 + w.abs()) {
            return Err(format!("{what}[{i}]: got {g}, want {w}"));
        }
    }
    Ok(())
}

fn check(d: Dims, t: RnnTuning, seed: u64, threads: usize) -> Result<(), String> {
    let p = Params::new(d, seed);
    let dh = data(d.t * d.n * d.k, seed + 1, 1.0);
    let got = run_layer(&p, t, &dh, threads);
    let (want_h, _) = naive_forward(&p);
    close("h", &got.h, &want_h)?;
    // Reference gradients: central differences of the f64 forward.
    let loss = |v: &[f64]| -> f64 {
        let q = Params { d, v: v.to_vec() };
        naive_forward(&q)
            .0
            .iter()
            .zip(&dh)
            .map(|(a, b)| a * b)
            .sum()
    };
    let mut v = p.v.clone();
    let mut grad = vec![0.0; v.len()];
    for i in 0..v.len() {
        let keep = v[i];
        v[i] = keep + 1e-6;
        let up = loss(&v);
        v[i] = keep - 1e-6;
        let down = loss(&v);
        v[i] = keep;
        grad[i] = (up - down) / 2e-6;
    }
    let part = |i: usize| &grad[p.part(i)];
    let (k, c) = (d.k, d.c);
    close("dx", &got.dx, part(0))?;
    for gi in 0..d.kind.gates() {
        close(
            &format!("dW gate {gi}"),
            &got.dw[gi],
            &part(1)[gi * k * c..][..k * c],
        )?;
        close(
            &format!("dR gate {gi}"),
            &got.dr[gi],
            &part(2)[gi * k * k..][..k * k],
        )?;
    }
    close("db", &got.db, part(3))?;
    close("dh0", &got.dh0, part(4))?;
    if d.kind == CellKind::Lstm {
        close("dc0", &got.dc0, part(5))?;
    }
    Ok(())
}

fn tuning(d: &Dims, bn: usize, bc: usize, bk: usize) -> RnnTuning {
    RnnTuning {
        bn,
        bc,
        bk,
        ..RnnTuning::heuristic(d.n, d.c, d.k)
    }
}

fn round(v: f64) -> f64 {
    brgemm_primitives::fc_bf16::round_bf16(v as f32).to_f32() as f64
}

/// |a - b| / |a| over a whole gradient.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let n = a.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
    let d = a
        .iter()
        .zip(b)
        .map(|(p, q)| (*p as f64 - *q as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    d / n.max(1e-12)
}

/// The bf16 LSTM and RNN: h against the f64 reference whose products read
/// bf16-rounded x, W, R and h_(t-1) (as the kernels do; the f32 sums may
/// round an h the other way, hence a few bf16 ulps of tolerance), and every
/// gradient within bf16 rounding of the f32 layer's (blocks of 32 for AMX,
/// 8 and 6 for the other kernels, with tails).
#[test]
fn bf16_layers_match_the_rounded_reference_and_the_f32_gradients() {
    for kind in [CellKind::Lstm, CellKind::Rnn] {
        for (t, n, c, k, bn, bc, bk) in [
            (4, 5, 64, 64, 8, 32, 32),
            (3, 7, 20, 13, 4, 8, 6),
            (5, 3, 33, 40, 3, 32, 32),
        ] {
            let d = Dims { kind, t, n, c, k };
            let tn = tuning(&d, bn, bc, bk);
            let p = Params::new(d, 3);
            let dh = data(t * n * k, 4, 1.0);
            let b = run_layer_as(&p, tn.clone(), &dh, 2, true);
            let f = run_layer_as(&p, tn, &dh, 2, false);
            let (want, _) = naive_forward_q(&p, round);
            for (i, (g, w)) in b.h.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - w).abs() <= 2e-2 * (1.0 + w.abs()),
                    "{d:?} bf16 h[{i}]: got {g}, want {w}"
                );
            }
            let mut grads = vec![
                ("dx", &b.dx, &f.dx),
                ("db", &b.db, &f.db),
                ("dh0", &b.dh0, &f.dh0),
            ];
            for gi in 0..kind.gates() {
                grads.push(("dW", &b.dw[gi], &f.dw[gi]));
                grads.push(("dR", &b.dr[gi], &f.dr[gi]));
            }
            for (what, g16, g32) in grads {
                let e = rel(g32, g16);
                assert!(e <= 3e-2, "{d:?} {what}: relative difference {e}");
            }
        }
    }
}

#[test]
fn lstm_and_rnn_match_the_reference() {
    for kind in [CellKind::Lstm, CellKind::Rnn] {
        for (t, n, c, k, bn, bc, bk) in [
            (3, 4, 5, 6, 2, 3, 4),
            (1, 1, 1, 1, 1, 1, 1),
            (4, 3, 7, 5, 2, 4, 2),
            (2, 5, 3, 8, 4, 2, 8),
        ] {
            let d = Dims { kind, t, n, c, k };
            for threads in [1, 2] {
                check(d, tuning(&d, bn, bc, bk), 5, threads)
                    .unwrap_or_else(|e| panic!("{d:?}: {e}"));
            }
        }
    }
}

/// 64-row blocks (and a padded tail block), whose recurrent calls take the
/// CPU policy's whole-column tile where it names one (Zen 4: 4x4): h
/// against the f64 reference, every gradient against the layer planned
/// with 8-row blocks (the blocking model's tiles; finite differences over
/// this many parameters would take minutes).
#[test]
fn sixty_four_row_blocks_match_the_reference_and_small_blocks() {
    for kind in [CellKind::Lstm, CellKind::Rnn] {
        let d = Dims {
            kind,
            t: 3,
            n: 8,
            c: 16,
            k: 70,
        };
        let p = Params::new(d, 9);
        let dh = data(d.t * d.n * d.k, 10, 1.0);
        let big = run_layer(&p, tuning(&d, 8, 16, 64), &dh, 2);
        let small = run_layer(&p, tuning(&d, 8, 16, 8), &dh, 2);
        let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let mut pairs = vec![
            ("h", &big.h, naive_forward(&p).0),
            ("dx", &big.dx, wide(&small.dx)),
            ("db", &big.db, wide(&small.db)),
            ("dh0", &big.dh0, wide(&small.dh0)),
        ];
        for g in 0..kind.gates() {
            pairs.push(("dW", &big.dw[g], wide(&small.dw[g])));
            pairs.push(("dR", &big.dr[g], wide(&small.dr[g])));
        }
        if kind == CellKind::Lstm {
            pairs.push(("dc0", &big.dc0, wide(&small.dc0)));
        }
        for (what, got, want) in pairs {
            close(what, got, &want).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        }
    }
}

#[test]
fn every_valid_spec_gives_the_same_result() {
    let d = Dims {
        kind: CellKind::Lstm,
        t: 3,
        n: 4,
        c: 3,
        k: 6,
    };
    // The spec is the whole nest: c (steps) and, in backward, d (phases)
    // must enclose the parallel loops; a serial N loop may enclose them.
    for spec in ["cAB", "cBA", "cab", "cAb", "caB", "cBAA", "acB"] {
        let mut t = tuning(&d, 2, 3, 2);
        t.fwd = PassConfig {
            blocks_b: vec![2],
            ..PassConfig::spec(spec)
        };
        t.bwd = PassConfig {
            spec: spec.replacen('c', "cd", 1),
            ..t.fwd.clone()
        };
        if spec == "cBAA" {
            t.fwd.blocks_a = vec![1];
            t.bwd.blocks_a = vec![1];
        }
        check(d, t, 9, 2).unwrap_or_else(|e| panic!("{spec}: {e}"));
    }
}

#[test]
fn bad_shapes_and_specs_are_errors() {
    let e = Rnn::new(CellKind::Lstm, 0, 4, 4, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("t = 0"), "{e}");
    let mut t = RnnTuning::heuristic(4, 4, 4);
    t.fwd = PassConfig::spec("ABc");
    let e = Rnn::with_tuning(CellKind::Lstm, 2, 4, 4, 4, t)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rnn fwd"), "{e}");
    let mut t = RnnTuning::heuristic(4, 4, 4);
    t.bwd = PassConfig::spec("dcAB");
    let e = Rnn::with_tuning(CellKind::Lstm, 2, 4, 4, 4, t)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rnn bwd") && e.contains("loop 'd' (phases) must be inside loop 'c' (steps)"),
        "{e}"
    );
    let rnn = Rnn::new(CellKind::Lstm, 2, 4, 4, 4).unwrap();
    let pool = Pool::new(1).unwrap();
    let wrong = Rnn::new(CellKind::Lstm, 3, 4, 4, 4).unwrap().x_layout();
    let mut st = rnn.state();
    let e = rnn
        .forward(
            &pool,
            &wrong,
            &rnn.w_layout(),
            &rnn.r_layout(),
            &vec![0.0; rnn.bias_len()],
            None,
            None,
            &mut st,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("X") && e.contains("12x4"), "{e}");
    let e = rnn
        .forward(
            &pool,
            &rnn.x_layout(),
            &rnn.w_layout(),
            &rnn.r_layout(),
            &[0.0; 3],
            None,
            None,
            &mut st,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("bias"), "{e}");
    let e = rnn
        .set_gate_weights(&mut rnn.w_layout(), 4, &[0.0; 16])
        .unwrap_err()
        .to_string();
    assert!(e.contains("gate = 4"), "{e}");
}

/// The f32 layer's own gradients against finite differences of its own
/// forward, through several steps.
#[test]
fn gradients_through_time_match_finite_differences() {
    let d = Dims {
        kind: CellKind::Lstm,
        t: 5,
        n: 2,
        c: 3,
        k: 4,
    };
    let p = Params::new(d, 21);
    let dh = data(d.t * d.n * d.k, 22, 1.0);
    let t = tuning(&d, 2, 3, 4);
    let got = run_layer(&p, t.clone(), &dh, 2);
    let loss = |v: &[f64]| -> f64 {
        let q = Params { d, v: v.to_vec() };
        let h = run_layer(&q, t.clone(), &dh, 1).h;
        h.iter().zip(&dh).map(|(a, b)| *a as f64 * b).sum()
    };
    let mut v = p.v.clone();
    // A sample of W, R and x entries (the earliest steps' inputs reach the
    // loss through the whole recurrence).
    let wr = p.part(1).start;
    for i in [
        0,
        1,
        7,
        wr,
        wr + 5,
        p.part(2).start + 3,
        p.part(4).start + 1,
    ] {
        let keep = v[i];
        v[i] = keep + 1e-2;
        let up = loss(&v);
        v[i] = keep - 1e-2;
        let down = loss(&v);
        v[i] = keep;
        let fd = (up - down) / 2e-2;
        let an = if i < wr {
            got.dx[i] as f64
        } else if i < p.part(2).start {
            let j = i - wr;
            got.dw[j / (d.k * d.c)][j % (d.k * d.c)] as f64
        } else if i < p.part(3).start {
            let j = i - p.part(2).start;
            got.dr[j / (d.k * d.k)][j % (d.k * d.k)] as f64
        } else {
            got.dh0[i - p.part(4).start] as f64
        };
        assert!(
            (fd - an).abs() < 2e-2 * (1.0 + an.abs()),
            "param {i}: fd {fd} vs backward {an}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(32)))]
    #[test]
    fn any_shape_matches_the_reference(
        lstm in any::<bool>(),
        t in 1usize..4,
        n in 1usize..5,
        c in 1usize..6,
        k in 1usize..6,
        bn in 1usize..4,
        bc in 1usize..4,
        bk in 1usize..4,
        seed in 0u64..100,
    ) {
        let kind = if lstm { CellKind::Lstm } else { CellKind::Rnn };
        let d = Dims { kind, t, n, c, k };
        check(d, tuning(&d, bn, bc, bk), seed, 2).map_err(TestCaseError::fail)?;
    }
}

#[test]
fn reading_the_cell_states_as_a_sequence_is_an_error() {
    // c_0..c_T has one step more than a sequence: reading it with
    // `sequence` used to return the wrong T rows silently.
    let rnn = Rnn::new(CellKind::Lstm, 3, 2, 4, 5).unwrap();
    let st = rnn.state();
    let e = rnn.sequence(st.c()).unwrap_err().to_string();
    assert!(e.contains("sequence rows") && e.contains("3 steps"), "{e}");
    assert_eq!(rnn.sequence(st.h()).unwrap().len(), 3 * 2 * 5);
}

/// The bf16 passes refuse a layer other than the one they were planned
/// for, and packed weights of the wrong size, by name.
#[test]
fn bf16_passes_refuse_another_layer_and_short_weights() {
    let pool = Pool::new(1).unwrap();
    let a = Rnn::new(CellKind::Lstm, 3, 4, 32, 32).unwrap();
    let b = Rnn::new(CellKind::Lstm, 3, 4, 32, 64).unwrap();
    let m = RnnBf16::new(&a).unwrap();
    let mut pw = RnnBf16Weights::default();
    let (x, bias) = (a.x_layout(), vec![0.0; a.bias_len()]);
    let mut st = a.state();
    let e = m
        .forward(&pool, &a, &x, &pw, &bias, None, None, &mut st)
        .unwrap_err()
        .to_string();
    assert!(e.contains("packed R"), "{e}");
    m.pack_weights(&pool, &a.w_layout(), &a.r_layout(), &mut pw)
        .unwrap();
    m.forward(&pool, &a, &x, &pw, &bias, None, None, &mut st)
        .unwrap();
    let mut st_b = b.state();
    let e = m
        .forward(
            &pool,
            &b,
            &b.x_layout(),
            &pw,
            &vec![0.0; b.bias_len()],
            None,
            None,
            &mut st_b,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("not the layer"), "{e}");
}
