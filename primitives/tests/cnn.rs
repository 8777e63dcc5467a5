//! Pooling, batch norm and element-wise steps: references in
//! plain NCHW and finite-difference gradient checks.

use brgemm_primitives::eltwise::{self, Dropout};
use brgemm_primitives::{
    Activation, BatchNorm, Blocked, Conv, ConvParams, Inner, Pool, Pool2d, PoolKind, Tensor4,
};

mod common;
use common::{data, fd_check};

/// sum(g * y) in f64.
fn dot(g: &[f32], y: &[f32]) -> f64 {
    g.iter().zip(y).map(|(a, b)| *a as f64 * *b as f64).sum()
}

fn naive_pool(
    kind: PoolKind,
    x: &[f32],
    (n, c, h, w): (usize, usize, usize, usize),
    win: usize,
    st: usize,
    pad: usize,
) -> Vec<f32> {
    let (p, q) = ((h + 2 * pad - win) / st + 1, (w + 2 * pad - win) / st + 1);
    let mut out = vec![0.0; n * c * p * q];
    for (pl, o) in out.chunks_mut(p * q).enumerate() {
        for oy in 0..p {
            for ox in 0..q {
                let (mut m, mut s, mut cnt) = (f32::NEG_INFINITY, 0.0f64, 0);
                for dy in 0..win {
                    for dx in 0..win {
                        let (y, xx) = (
                            (oy * st + dy) as isize - pad as isize,
                            (ox * st + dx) as isize - pad as isize,
                        );
                        if y >= 0 && xx >= 0 && (y as usize) < h && (xx as usize) < w {
                            let v = x[pl * h * w + y as usize * w + xx as usize];
                            m = m.max(v);
                            s += v as f64;
                            cnt += 1;
                        }
                    }
                }
                o[oy * q + ox] = match kind {
                    PoolKind::Max => m,
                    PoolKind::Avg => (s / cnt as f64) as f32,
                };
            }
        }
    }
    out
}

#[test]
fn pooling_matches_reference_and_finite_differences() {
    let pool = Pool::new(2).unwrap().always_parallel();
    for (kind, (n, c, h, w), bc, win, st, pad) in [
        (PoolKind::Max, (2, 5, 8, 8), 4, 2, 2, 0),
        (PoolKind::Max, (1, 3, 7, 9), 3, 3, 2, 1),
        (PoolKind::Avg, (2, 6, 7, 7), 4, 3, 1, 1),
        (PoolKind::Avg, (1, 2, 5, 6), 2, 2, 2, 0),
    ] {
        let xs = data(n * c * h * w, 5);
        let x = Tensor4::from_nchw(&xs, n, c, h, w, bc).unwrap();
        let pl = Pool2d::new(kind, &x, win, st, pad).unwrap();
        let mut y = pl.output();
        let mut am = vec![0u32; y.data().len()];
        pl.forward(&pool, &x, &mut y, Some(&mut am)).unwrap();
        // Inference (no arg-max) takes its own loop: same output.
        let mut y_inf = pl.output();
        pl.forward(&pool, &x, &mut y_inf, None).unwrap();
        assert_eq!(y_inf.data(), y.data(), "{kind:?}: forward without arg-max");
        let want = naive_pool(kind, &xs, (n, c, h, w), win, st, pad);
        assert_eq!(y.to_nchw().len(), want.len());
        for (a, b) in y.to_nchw().iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{kind:?}: {a} vs {b}");
        }
        let gs = data(want.len(), 6);
        let g = Tensor4::from_nchw(&gs, n, c, y.h(), y.w(), bc).unwrap();
        let mut dx = x.clone();
        pl.backward(&pool, &g, Some(&am), &mut dx).unwrap();
        let grad = dx.to_nchw();
        let mut xp = xs.clone();
        fd_check(
            &format!("{kind:?} pool dx {:?}", (n, c, h, w, win, st, pad)),
            &mut xp,
            &grad,
            1e-5,
            1e-2,
            |v| dot(&gs, &naive_pool(kind, v, (n, c, h, w), win, st, pad)),
        );
    }
    // Global average pooling.
    let x = Tensor4::from_nchw(&data(2 * 3 * 4 * 5, 9), 2, 3, 4, 5, 2).unwrap();
    let gp = Pool2d::global_avg(&x).unwrap();
    let mut y = gp.output();
    gp.forward(&pool, &x, &mut y, None).unwrap();
    let xs = x.to_nchw();
    for (i, v) in y.to_nchw().iter().enumerate() {
        let m: f32 = xs[i * 20..][..20].iter().sum::<f32>() / 20.0;
        assert!((v - m).abs() < 1e-5);
    }
    let e = Pool2d::new(PoolKind::Max, &x, 2, 0, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("stride = 0"), "{e}");
    let e = gp.backward(&pool, &y, None, &mut x.clone()).map(|_| ());
    assert!(e.is_ok());
    let mp = Pool2d::new(PoolKind::Max, &x, 2, 2, 0).unwrap();
    let e = mp
        .backward(&pool, &mp.output(), None, &mut x.clone())
        .unwrap_err()
        .to_string();
    assert!(e.contains("argmax"), "{e}");
}

fn bn_loss(
    xs: &[f32],
    gs: &[f32],
    dims: (usize, usize, usize, usize),
    bc: usize,
    gamma: &[f32],
    beta: &[f32],
) -> f64 {
    let (n, c, h, w) = dims;
    let pool = Pool::new(1).unwrap();
    let x = Tensor4::from_nchw(xs, n, c, h, w, bc).unwrap();
    let mut bn = BatchNorm::new(c, bc).unwrap();
    bn.gamma_mut().copy_from_slice(gamma);
    bn.beta_mut().copy_from_slice(beta);
    let mut y = x.clone();
    bn.forward_train(&pool, &x, &mut y).unwrap();
    dot(gs, &y.to_nchw())
}

/// Mean and (biased) variance of channel `ch` over images and pixels, in f64.
fn channel_stats(y: &Tensor4, ch: usize) -> (f64, f64) {
    let (n, c, h, w, _) = y.dims();
    let yc = y.to_nchw();
    let v: Vec<f64> = (0..n)
        .flat_map(|i| {
            yc[(i * c + ch) * h * w..][..h * w]
                .iter()
                .map(|v| *v as f64)
        })
        .collect();
    let m = v.iter().sum::<f64>() / v.len() as f64;
    (
        m,
        v.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / v.len() as f64,
    )
}

#[test]
fn batch_norm_statistics_and_gradients() {
    let pool = Pool::new(2).unwrap().always_parallel();
    let (n, c, h, w, bc) = (3, 5, 4, 3, 4);
    let xs: Vec<f32> = data(n * c * h * w, 21)
        .iter()
        .map(|v| 2.0 * v + 0.3)
        .collect();
    let x = Tensor4::from_nchw(&xs, n, c, h, w, bc).unwrap();
    let mut bn = BatchNorm::new(c, bc).unwrap();
    let pc = bn.gamma().len();
    for (i, g) in bn.gamma_mut().iter_mut().take(c).enumerate() {
        *g = 0.5 + 0.25 * i as f32;
    }
    for (i, b) in bn.beta_mut().iter_mut().take(c).enumerate() {
        *b = 0.1 * i as f32 - 0.2;
    }
    let mut y = x.clone();
    bn.forward_train(&pool, &x, &mut y).unwrap();
    // Per channel, the output has mean beta and standard deviation gamma.
    for ch in 0..c {
        let (m, var) = channel_stats(&y, ch);
        let sd = var.sqrt();
        assert!((m - bn.beta()[ch] as f64).abs() < 1e-4, "mean {m}");
        assert!((sd - bn.gamma()[ch] as f64).abs() < 1e-3, "sd {sd}");
    }
    assert!(y
        .data()
        .iter()
        .enumerate()
        .all(|(i, v)| (i % bc) + (i / (h * w * bc) % 2) * bc < c || *v == 0.0));
    assert!(bn.running_mean()[..c].iter().any(|m| *m != 0.0));
    // Inference with running statistics equal to the batch's reproduces training.
    let gs = data(n * c * h * w, 22);
    let g = Tensor4::from_nchw(&gs, n, c, h, w, bc).unwrap();
    let mut dx = x.clone();
    let (mut dgamma, mut dbeta) = (vec![0.0; pc], vec![0.0; pc]);
    bn.backward(&pool, &x, &g, &mut dx, &mut dgamma, &mut dbeta)
        .unwrap();
    let (gamma, beta) = (bn.gamma().to_vec(), bn.beta().to_vec());
    let dims = (n, c, h, w);
    let grad = dx.to_nchw();
    fd_check("bn dx", &mut xs.clone(), &grad, 1e-2, 2e-2, |v| {
        bn_loss(v, &gs, dims, bc, &gamma, &beta)
    });
    fd_check(
        "bn dgamma",
        &mut gamma.clone()[..c].to_vec(),
        &dgamma[..c],
        1e-2,
        2e-2,
        |v| {
            let mut gm = gamma.to_vec();
            gm[..c].copy_from_slice(v);
            bn_loss(&xs, &gs, dims, bc, &gm, &beta)
        },
    );
    fd_check(
        "bn dbeta",
        &mut beta.clone()[..c].to_vec(),
        &dbeta[..c],
        1e-2,
        2e-2,
        |v| {
            let mut bt = beta.to_vec();
            bt[..c].copy_from_slice(v);
            bn_loss(&xs, &gs, dims, bc, &gamma, &bt)
        },
    );
    // Inference mode uses the running statistics.
    let mut bn2 = BatchNorm::new(c, bc).unwrap();
    bn2.momentum = 1.0;
    let mut y2 = x.clone();
    bn2.forward_train(&pool, &x, &mut y2).unwrap();
    let mut y3 = x.clone();
    bn2.forward_infer(&pool, &x, &mut y3).unwrap();
    let count = (n * h * w) as f32;
    let fix = ((count - 1.0) / count).sqrt();
    for (a, b) in y2.data().iter().zip(y3.data().iter()) {
        // Running variance is unbiased: inference output = training output * sqrt((M-1)/M).
        assert!((a * fix - b).abs() < 1e-3, "{a} vs {b}");
    }
    let e = bn
        .forward_train(&pool, &Tensor4::zeros(1, 4, 2, 2, 4).unwrap(), &mut y)
        .unwrap_err()
        .to_string();
    assert!(e.contains("c=4"), "{e}");
}

#[test]
fn conv_gradients_match_finite_differences() {
    let pool = Pool::new(2).unwrap().always_parallel();
    for p in [
        ConvParams::new(2, 3, 4, 6, 5, 3, 3).pad(1),
        ConvParams::new(1, 4, 3, 7, 7, 3, 3).stride(2).pad(1),
    ] {
        let conv = Conv::new(p, Activation::Tanh).unwrap();
        let t = conv.tuning().clone();
        let xs = data(p.n * p.c * p.h * p.w, 1);
        let ws = data(p.k * p.c * p.r * p.s, 2);
        let gs = data(p.n * p.k * p.p() * p.q(), 3);
        let run = |xs: &[f32], ws: &[f32]| -> f64 {
            let x = Tensor4::from_nchw(xs, p.n, p.c, p.h, p.w, t.bc).unwrap();
            let w =
                brgemm_primitives::Filter::from_kcrs(ws, (p.k, p.c, p.r, p.s), t.bk, t.bc).unwrap();
            let mut y = conv.y_tensor();
            conv.forward(&pool, &x, &w, &vec![0.1; conv.padded_k()], &mut y)
                .unwrap();
            dot(&gs, &y.to_nchw())
        };
        let x = Tensor4::from_nchw(&xs, p.n, p.c, p.h, p.w, t.bc).unwrap();
        let w =
            brgemm_primitives::Filter::from_kcrs(&ws, (p.k, p.c, p.r, p.s), t.bk, t.bc).unwrap();
        let mut y = conv.y_tensor();
        conv.forward(&pool, &x, &w, &vec![0.1; conv.padded_k()], &mut y)
            .unwrap();
        let g = Tensor4::from_nchw(&gs, p.n, p.k, p.p(), p.q(), t.bk).unwrap();
        let mut dz = conv.y_tensor();
        conv.activation_backward(&pool, &g, &y, &mut dz).unwrap();
        let mut wt = conv.filter_t();
        conv.transpose_filter(&pool, &w, &mut wt).unwrap();
        let mut dx = conv.x_tensor();
        conv.backward_data(&pool, &dz, &wt, &mut dx).unwrap();
        let mut dw = conv.filter();
        let mut db = vec![0.0; conv.padded_k()];
        conv.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
            .unwrap();
        fd_check("conv dx", &mut xs.clone(), &dx.to_nchw(), 1e-2, 1e-2, |v| {
            run(v, &ws)
        });
        fd_check("conv dw", &mut ws.clone(), &dw.to_kcrs(), 1e-2, 1e-2, |v| {
            run(&xs, v)
        });
    }
}

#[test]
fn dropout_is_inverted_and_thread_independent() {
    let x = vec![1.0f32; 10_000];
    let mut outs = vec![];
    for threads in [1, 2] {
        let pool = Pool::new(threads).unwrap().always_parallel();
        let mut d = Dropout::new(0.25, 7).unwrap();
        let mut y = vec![0.0; x.len()];
        d.forward_train(&pool, &x, &mut y).unwrap();
        let kept = y.iter().filter(|v| **v != 0.0).count() as f64 / x.len() as f64;
        assert!((kept - 0.75).abs() < 0.03, "kept {kept}");
        assert!(y
            .iter()
            .all(|v| *v == 0.0 || (*v - 1.0 / 0.75).abs() < 1e-6));
        let mut dx = vec![0.0; x.len()];
        d.backward(&pool, &x, &mut dx).unwrap();
        assert_eq!(dx, y);
        outs.push(y);
    }
    assert_eq!(outs[0], outs[1]);
    assert!(Dropout::new(1.0, 1)
        .unwrap_err()
        .to_string()
        .contains("dropout p"));
}

#[test]
fn flatten_round_trips_in_nchw_order() {
    let pool = Pool::new(2).unwrap().always_parallel();
    let (n, c, h, w) = (3, 5, 2, 3);
    let xs = data(n * c * h * w, 4);
    let x = Tensor4::from_nchw(&xs, n, c, h, w, 4).unwrap();
    let mut f = Blocked::zeros(n, c * h * w, 2, 8, Inner::RowMajor).unwrap();
    eltwise::flatten(&pool, &x, &mut f).unwrap();
    assert_eq!(f.to_plain(), xs);
    let mut back = Tensor4::zeros(n, c, h, w, 4).unwrap();
    back.data_mut().fill(9.0);
    eltwise::unflatten(&pool, &f, &mut back).unwrap();
    assert_eq!(back, x);
}

#[test]
fn batch_norm_with_fused_relu_matches_batch_norm_then_relu() {
    // Large planes (more than one 64-pixel run) with a large mean: the
    // shifted one-pass variance must keep its precision.
    let pool = Pool::new(2).unwrap().always_parallel();
    let (n, c, h, w, bc) = (3, 6, 11, 13, 4);
    let xs: Vec<f32> = data(n * c * h * w, 31)
        .iter()
        .map(|v| 3.0 * v + 50.0)
        .collect();
    let x = Tensor4::from_nchw(&xs, n, c, h, w, bc).unwrap();
    let g = Tensor4::from_nchw(&data(n * c * h * w, 32), n, c, h, w, bc).unwrap();
    let (mut plain, mut fused) = (
        BatchNorm::new(c, bc).unwrap(),
        BatchNorm::new(c, bc).unwrap(),
    );
    fused.relu = true;
    for bn in [&mut plain, &mut fused] {
        for (i, v) in bn.beta_mut().iter_mut().take(c).enumerate() {
            *v = 0.2 * i as f32 - 0.5;
        }
    }
    let (mut y, mut yf) = (x.clone(), x.clone());
    plain.forward_train(&pool, &x, &mut y).unwrap();
    fused.forward_train(&pool, &x, &mut yf).unwrap();
    // The plain output has unit variance per channel around beta.
    for ch in 0..c {
        let (_, var) = channel_stats(&y, ch);
        assert!((var - 1.0).abs() < 1e-3, "channel {ch}: variance {var}");
    }
    let relu: Vec<f32> = y.data().iter().map(|v| v.max(0.0)).collect();
    assert_eq!(yf.data(), &relu[..]);
    // Backward through the ReLU = plain backward of the masked gradient.
    let masked: Vec<f32> = g
        .data()
        .iter()
        .zip(y.data())
        .map(|(g, y)| if *y > 0.0 { *g } else { 0.0 })
        .collect();
    let mut gm = g.clone();
    gm.data_mut().copy_from_slice(&masked);
    let pc = plain.gamma().len();
    let (mut dx, mut dxf) = (x.clone(), x.clone());
    let (mut dg, mut db, mut dgf, mut dbf) =
        (vec![0.0; pc], vec![0.0; pc], vec![0.0; pc], vec![0.0; pc]);
    plain
        .backward(&pool, &x, &gm, &mut dx, &mut dg, &mut db)
        .unwrap();
    let e = fused
        .backward(&pool, &x, &g, &mut dxf, &mut dgf, &mut dbf)
        .unwrap_err();
    assert!(e.to_string().contains("backward_relu"), "{e}");
    fused
        .backward_relu(&pool, &x, &yf, &g, &mut dxf, &mut dgf, &mut dbf)
        .unwrap();
    for (a, b) in dx
        .data()
        .iter()
        .zip(dxf.data())
        .chain(dg.iter().zip(&dgf))
        .chain(db.iter().zip(&dbf))
    {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
    }
}

#[test]
fn batch_norm_with_a_residual_is_batch_norm_then_the_add() {
    let pool = Pool::new(2).unwrap().always_parallel();
    // Six channels in blocks of 4: a padded block, whose lanes stay zero.
    let (n, c, h, w, bc) = (2, 6, 5, 7, 4);
    let x = Tensor4::from_nchw(&data(n * c * h * w, 41), n, c, h, w, bc).unwrap();
    let r = Tensor4::from_nchw(&data(n * c * h * w, 42), n, c, h, w, bc).unwrap();
    for relu in [false, true] {
        let (mut a, mut b) = (
            BatchNorm::new(c, bc).unwrap(),
            BatchNorm::new(c, bc).unwrap(),
        );
        let (mut y, mut ya) = (x.clone(), x.clone());
        a.forward_train(&pool, &x, &mut y).unwrap();
        b.forward_train_add(&pool, &x, &r, relu, &mut ya).unwrap();
        let want: Vec<f32> = (y.data().iter().zip(r.data()))
            .map(|(u, v)| if relu { (u + v).max(0.0) } else { u + v })
            .collect();
        assert_eq!(ya.data(), &want[..], "train, relu {relu}");
        assert_eq!(a.running_mean(), b.running_mean());
        a.forward_infer(&pool, &x, &mut y).unwrap();
        b.forward_infer_add(&pool, &x, &r, relu, &mut ya).unwrap();
        let want: Vec<f32> = (y.data().iter().zip(r.data()))
            .map(|(u, v)| if relu { (u + v).max(0.0) } else { u + v })
            .collect();
        assert_eq!(ya.data(), &want[..], "inference, relu {relu}");
    }
    // A ReLU of its own would come before the add; a residual of other
    // dims cannot join.
    let mut bn = BatchNorm::new(c, bc).unwrap();
    let mut y = x.clone();
    let small = Tensor4::zeros(n, c, h, w - 1, bc).unwrap();
    let e = bn
        .forward_train_add(&pool, &x, &small, true, &mut y)
        .unwrap_err();
    assert!(e.to_string().contains("residual"), "{e}");
    bn.relu = true;
    let e = bn
        .forward_train_add(&pool, &x, &r, true, &mut y)
        .unwrap_err();
    assert!(e.to_string().contains("ReLU"), "{e}");
}

/// The `_to` passes write their output (forward) and dx (backward) also
/// rounded to bf16, for a bf16 layer after them: the f32 results the bits
/// of the plain passes, the copies those rounded to nearest even, over
/// planes of several rounding pieces, a padded channel block, the fused
/// ReLU and the residual join; a copy of the wrong length is refused.
#[test]
fn batch_norm_writes_bf16_copies_in_its_own_pass() {
    use brgemm::bf16::bf16;
    use brgemm_primitives::fc_bf16::round_bf16;
    let pool = Pool::new(2).unwrap().always_parallel();
    let (n, c, h, w, bc) = (2, 70, 9, 37, 64);
    let x = Tensor4::from_nchw(&data(n * c * h * w, 51), n, c, h, w, bc).unwrap();
    let r = Tensor4::from_nchw(&data(n * c * h * w, 52), n, c, h, w, bc).unwrap();
    let g = Tensor4::from_nchw(&data(n * c * h * w, 53), n, c, h, w, bc).unwrap();
    let len = x.data().len();
    let rounded = |t: &Tensor4| -> Vec<bf16> { t.data().iter().map(|v| round_bf16(*v)).collect() };
    let bits = |t: &Tensor4| -> Vec<u32> { t.data().iter().map(|v| v.to_bits()).collect() };
    for (relu, res) in [(false, None), (true, None), (false, Some((&r, true)))] {
        let what = format!("relu {relu}, residual {}", res.is_some());
        let (mut a, mut b) = (
            BatchNorm::new(c, bc).unwrap(),
            BatchNorm::new(c, bc).unwrap(),
        );
        (a.relu, b.relu) = (relu, relu);
        let (mut y, mut yt) = (x.clone(), x.clone());
        let mut yb = vec![bf16::ZERO; len];
        match res {
            None => a.forward_train(&pool, &x, &mut y).unwrap(),
            Some((r, j)) => a.forward_train_add(&pool, &x, r, j, &mut y).unwrap(),
        }
        b.forward_train_to(&pool, &x, res, &mut yt, Some(&mut yb))
            .unwrap();
        assert_eq!(bits(&y), bits(&yt), "train y, {what}");
        assert_eq!(yb, rounded(&y), "train copy, {what}");
        a.forward_infer_to(&pool, &x, res, &mut y, None).unwrap();
        b.forward_infer_to(&pool, &x, res, &mut yt, Some(&mut yb))
            .unwrap();
        assert_eq!(bits(&y), bits(&yt), "inference y, {what}");
        assert_eq!(yb, rounded(&y), "inference copy, {what}");
        // Backward after a training forward, through the fused ReLU.
        a.forward_train(&pool, &x, &mut y).ok();
        b.forward_train(&pool, &x, &mut yt).ok();
        if res.is_some() {
            continue;
        }
        let pc = a.gamma().len();
        let (mut dx, mut dxt) = (x.clone(), x.clone());
        let mut dxb = vec![bf16::ZERO; len];
        let mut sums = [vec![0.0; pc], vec![0.0; pc], vec![0.0; pc], vec![0.0; pc]];
        let [dg, db, dg2, db2] = &mut sums;
        let yy = relu.then_some(&y);
        a.backward_to(&pool, &x, yy, &g, (&mut dx, None), dg, db)
            .unwrap();
        b.backward_to(&pool, &x, yy, &g, (&mut dxt, Some(&mut dxb)), dg2, db2)
            .unwrap();
        assert_eq!(bits(&dx), bits(&dxt), "dx, {what}");
        assert_eq!(dxb, rounded(&dx), "dx copy, {what}");
        let mut short = vec![bf16::ZERO; len - 1];
        let e = b
            .backward_to(&pool, &x, yy, &g, (&mut dxt, Some(&mut short)), dg2, db2)
            .unwrap_err();
        assert!(e.to_string().contains("bf16 dx"), "{e}");
        let e = b
            .forward_train_to(&pool, &x, None, &mut yt, Some(&mut short))
            .unwrap_err();
        assert!(e.to_string().contains("bf16 y"), "{e}");
    }
}

/// Batch norm reading its input in bf16 (a bf16 convolution's output),
/// and in backward its output gradient (a bf16 convolution's dX), gives
/// the bits it gives on them widened to f32: statistics, y, the running
/// statistics, dx and the parameter gradients, with and without the fused
/// ReLU and the residual join.
#[test]
fn batch_norm_reads_a_bf16_input_as_its_widened_values() {
    let pool = Pool::new(2).unwrap().always_parallel();
    let (n, c, h, w, bc) = (2, 70, 9, 37, 64);
    let x32 = Tensor4::from_nchw(&data(n * c * h * w, 61), n, c, h, w, bc).unwrap();
    let xb = Tensor4::rounded(&pool, &x32);
    let x = xb.widened();
    assert_ne!(x.data(), x32.data(), "the rounding must change values");
    let r = Tensor4::from_nchw(&data(n * c * h * w, 62), n, c, h, w, bc).unwrap();
    let g = Tensor4::from_nchw(&data(n * c * h * w, 63), n, c, h, w, bc).unwrap();
    let bits = |t: &Tensor4| -> Vec<u32> { t.data().iter().map(|v| v.to_bits()).collect() };
    for (relu, res) in [(false, None), (true, None), (false, Some((&r, true)))] {
        let what = format!("relu {relu}, residual {}", res.is_some());
        let mut a = BatchNorm::new(c, bc).unwrap();
        a.relu = relu;
        let mut b = a.clone();
        let (mut y, mut yt) = (x.clone(), x.clone());
        a.forward_train_to(&pool, &x, res, &mut y, None).unwrap();
        b.forward_train_to(&pool, &xb, res, &mut yt, None).unwrap();
        assert_eq!(bits(&y), bits(&yt), "train y, {what}");
        assert_eq!(a.running_mean(), b.running_mean(), "{what}");
        assert_eq!(a.running_var(), b.running_var(), "{what}");
        a.forward_infer_to(&pool, &x, res, &mut y, None).unwrap();
        b.forward_infer_to(&pool, &xb, res, &mut yt, None).unwrap();
        assert_eq!(bits(&y), bits(&yt), "inference y, {what}");
        // y in bf16 alone: the f32 y's bits rounded, inference and training.
        let mut ya = Tensor4::rounded(&pool, &y);
        b.forward_infer_bf16(&pool, &xb, res, &mut ya).unwrap();
        let want = |y: &Tensor4| bits(&Tensor4::rounded(&pool, y).widened());
        assert_eq!(bits(&ya.widened()), want(&y), "inference y alone, {what}");
        a.forward_train_to(&pool, &x, res, &mut y, None).unwrap();
        b.forward_train_bf16(&pool, &xb, res, &mut ya).unwrap();
        assert_eq!(bits(&ya.widened()), want(&y), "train y alone, {what}");
        // Backward without y after a fused ReLU (its mask from x): the
        // gradient through the ReLU.
        if relu {
            let pc = a.gamma().len();
            let (mut d1, mut d2) = (x.clone(), x.clone());
            let mut s = [vec![0.0; pc], vec![0.0; pc], vec![0.0; pc], vec![0.0; pc]];
            let [g1, b1, g2, b2] = &mut s;
            a.backward_to(&pool, &x, Some(&y), &g, (&mut d1, None), g1, b1)
                .unwrap();
            b.backward_to(&pool, &xb, None, &g, (&mut d2, None), g2, b2)
                .unwrap();
            assert_eq!(bits(&d1), bits(&d2), "dx without y, {what}");
        }
        a.forward_train_to(&pool, &x, res, &mut y, None).unwrap();
        b.forward_train_to(&pool, &xb, res, &mut yt, None).unwrap();
        let pc = a.gamma().len();
        let (mut dx, mut dxt) = (x.clone(), x.clone());
        let mut sums = [vec![0.0; pc], vec![0.0; pc], vec![0.0; pc], vec![0.0; pc]];
        let [dg, db, dg2, db2] = &mut sums;
        let yy = relu.then_some(&y);
        a.backward_to(&pool, &x, yy, &g, (&mut dx, None), dg, db)
            .unwrap();
        b.backward_to(&pool, &xb, yy, &g, (&mut dxt, None), dg2, db2)
            .unwrap();
        assert_eq!(bits(&dx), bits(&dxt), "dx, {what}");
        assert_eq!((&dg, &db), (&dg2, &db2), "dgamma, dbeta, {what}");
        // dy in bf16 too (a bf16 convolution's dX): the widened dy's bits.
        let gb = Tensor4::rounded(&pool, &g);
        a.backward_to(&pool, &x, yy, &gb.widened(), (&mut dx, None), dg, db)
            .unwrap();
        b.backward_to(&pool, &xb, yy, &gb, (&mut dxt, None), dg2, db2)
            .unwrap();
        assert_eq!(bits(&dx), bits(&dxt), "dx from bf16 dy, {what}");
        assert_eq!(
            (&dg, &db),
            (&dg2, &db2),
            "dgamma, dbeta from bf16 dy, {what}"
        );
        // dx in bf16 alone: the f32 dx's bits rounded.
        let mut dxa = Tensor4::rounded(&pool, &dx);
        dxa.data_mut().fill(brgemm::bf16::bf16::NAN);
        b.backward_to_bf16(&pool, &xb, yy, &gb, &mut dxa, dg2, db2)
            .unwrap();
        let want = Tensor4::rounded(&pool, &dx).widened();
        assert_eq!(bits(&dxa.widened()), bits(&want), "dx alone, {what}");
        assert_eq!((&dg, &db), (&dg2, &db2), "dgamma, dbeta, dx alone, {what}");
        // A bf16 input of other dims is an error naming it.
        let other = Tensor4::rounded(&pool, &Tensor4::zeros(n, c, h + 1, w, bc).unwrap());
        let e = b
            .backward_to(&pool, &other, yy, &g, (&mut dxt, None), dg2, db2)
            .unwrap_err();
        assert!(e.to_string().contains("must match x"), "{e}");
    }
}
