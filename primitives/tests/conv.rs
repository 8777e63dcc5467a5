//! Convolution passes against a naive f64 convolution in plain NCHW/KCRS.

use brgemm::bf16::{bf16, Bf16Isa};
use brgemm::AlignedVec;
use brgemm_primitives::conv::{AddResidual, ConvBf16, Operand};
use brgemm_primitives::fc_bf16::round_bf16;
use brgemm_primitives::PassConfig;
use brgemm_primitives::{Activation, Conv, ConvParams, ConvTuning, Filter, Pool, Tensor4};
use proptest::prelude::*;

mod common;
use common::data;

/// (input row, input column) a tap reads, or None in the padding.
fn src(p: &ConvParams, o: (usize, usize), t: (usize, usize)) -> Option<(usize, usize)> {
    let y = (o.0 * p.stride_h + t.0 * p.dil_h) as isize - p.pad_h as isize;
    let x = (o.1 * p.stride_w + t.1 * p.dil_w) as isize - p.pad_w as isize;
    (y >= 0 && x >= 0 && (y as usize) < p.h && (x as usize) < p.w)
        .then_some((y as usize, x as usize))
}

/// Visits every (n, k, c, p, q, r, s, h, w) term of the convolution sum.
fn terms(p: &ConvParams, mut f: impl FnMut([usize; 9])) {
    for n in 0..p.n {
        for k in 0..p.k {
            for c in 0..p.c {
                for oy in 0..p.p() {
                    for ox in 0..p.q() {
                        for r in 0..p.r {
                            for s in 0..p.s {
                                if let Some((y, x)) = src(p, (oy, ox), (r, s)) {
                                    f([n, k, c, oy, ox, r, s, y, x]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

struct Naive {
    y: Vec<f64>,
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
}

/// Pre-activation forward, backward-data and backward-weights for the
/// output gradient `dy`, all in f64.
fn naive(p: &ConvParams, x: &[f32], w: &[f32], b: &[f32], dy: &[f32]) -> Naive {
    let (pp, q) = (p.p(), p.q());
    let mut y = vec![0f64; p.n * p.k * pp * q];
    for n in 0..p.n {
        for k in 0..p.k {
            for i in 0..pp * q {
                y[(n * p.k + k) * pp * q + i] = b[k] as f64;
            }
        }
    }
    let mut dx = vec![0f64; x.len()];
    let mut dw = vec![0f64; w.len()];
    terms(p, |[n, k, c, oy, ox, r, s, iy, ix]| {
        let yi = ((n * p.k + k) * pp + oy) * q + ox;
        let xi = ((n * p.c + c) * p.h + iy) * p.w + ix;
        let wi = ((k * p.c + c) * p.r + r) * p.s + s;
        y[yi] += x[xi] as f64 * w[wi] as f64;
        dx[xi] += dy[yi] as f64 * w[wi] as f64;
        dw[wi] += dy[yi] as f64 * x[xi] as f64;
    });
    let mut db = vec![0f64; p.k];
    for n in 0..p.n {
        for (k, d) in db.iter_mut().enumerate() {
            *d += dy[(n * p.k + k) * pp * q..][..pp * q]
                .iter()
                .map(|v| *v as f64)
                .sum::<f64>();
        }
    }
    Naive { y, dx, dw, db }
}

fn close(what: &str, got: &[f32], want: &[f64], scale: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-4 * scale.max(1.0) + 1e-4 * w.abs();
        assert!(
            (*g as f64 - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tol {tol})"
        );
    }
}

/// Runs all three passes of `conv` and compares them with the reference.
fn check(p: ConvParams, t: ConvTuning, act: Activation, seed: u64) {
    let conv = Conv::with_tuning(p, act, t).unwrap();
    let pool = Pool::new(2).unwrap().always_parallel();
    let xs = data(p.n * p.c * p.h * p.w, seed);
    let ws = data(p.k * p.c * p.r * p.s, seed + 1);
    let bs = data(p.k, seed + 2);
    let dys = data(p.n * p.k * p.p() * p.q(), seed + 3);
    let tn = conv.tuning().clone();
    let x = Tensor4::from_nchw(&xs, p.n, p.c, p.h, p.w, tn.bc).unwrap();
    let w = Filter::from_kcrs(&ws, (p.k, p.c, p.r, p.s), tn.bk, tn.bc).unwrap();
    let mut bias = vec![0.0; conv.padded_k()];
    bias[..p.k].copy_from_slice(&bs);
    let mut y = conv.y_tensor();
    conv.forward(&pool, &x, &w, &bias, &mut y).unwrap();
    let want = naive(&p, &xs, &ws, &bs, &dys);
    let scale = (p.c * p.r * p.s) as f64;
    let act_want: Vec<f64> = want.y.iter().map(|v| act.apply(*v as f32) as f64).collect();
    close("Y", &y.to_nchw(), &act_want, scale);
    // Channel padding stays zero.
    let yc = y.to_nchw();
    let mut y_again = Tensor4::from_nchw(&yc, p.n, p.k, p.p(), p.q(), tn.bk).unwrap();
    y_again
        .data_mut()
        .iter_mut()
        .zip(y.data().iter())
        .for_each(|(a, b)| *a -= b);
    assert!(
        y_again.data().iter().all(|v| *v == 0.0),
        "padding of Y not zero"
    );

    // Backward with dZ = dY (the activation's derivative is tested apart).
    let dz = Tensor4::from_nchw(&dys, p.n, p.k, p.p(), p.q(), tn.bk).unwrap();
    let mut wt = conv.filter_t();
    conv.transpose_filter(&pool, &w, &mut wt).unwrap();
    let mut dx = conv.x_tensor();
    dx.data_mut().fill(f32::NAN);
    conv.backward_data(&pool, &dz, &wt, &mut dx).unwrap();
    close("dX", &dx.to_nchw(), &want.dx, (p.k * p.r * p.s) as f64);
    let mut dw = conv.filter();
    dw.data_mut().fill(f32::NAN);
    let mut db = vec![f32::NAN; conv.padded_k()];
    conv.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
        .unwrap();
    close("dW", &dw.to_kcrs(), &want.dw, (p.n * p.p() * p.q()) as f64);
    close("db", &db[..p.k], &want.db, (p.n * p.p() * p.q()) as f64);
    assert!(
        dw.data().iter().all(|v| v.is_finite()),
        "dW padding not written"
    );
}

#[test]
fn resnet_like_shapes() {
    for (p, act) in [
        (
            ConvParams::new(2, 8, 16, 9, 9, 3, 3).pad(1),
            Activation::Relu,
        ),
        (ConvParams::new(2, 16, 8, 7, 7, 1, 1), Activation::Identity),
        // 64-channel blocks, rows of 8 and 4 pixels: the policy's gather
        // tile where it names one, for calls of 9 and 4 pairs.
        (
            ConvParams::new(1, 64, 64, 8, 8, 3, 3).pad(1),
            Activation::Relu,
        ),
        (
            ConvParams::new(1, 128, 64, 8, 8, 3, 3).stride(2).pad(1),
            Activation::Identity,
        ),
        (
            ConvParams::new(1, 3, 8, 15, 15, 7, 7).stride(2).pad(3),
            Activation::Relu,
        ),
        (
            ConvParams::new(2, 5, 7, 6, 5, 3, 3).stride(2).pad(1),
            Activation::Sigmoid,
        ),
        (
            ConvParams::new(1, 4, 4, 10, 10, 3, 3).dilation(2).pad(2),
            Activation::Tanh,
        ),
        (
            ConvParams::new(3, 16, 16, 8, 8, 1, 1).stride(2),
            Activation::Identity,
        ),
        (
            ConvParams::new(2, 4, 6, 5, 5, 1, 1).pad(1),
            Activation::Identity,
        ),
    ] {
        check(p, ConvTuning::heuristic(&p), act, 7);
    }
}

/// 1x1 layers with one 64-channel input block: single-pair calls, which on
/// some cores run a forced tile of whole output columns (forward here, and
/// backward-data of the second, whose dY has one block); a pixel run with
/// a tail and channel padding too.
#[test]
fn single_block_pointwise_layers() {
    for (p, bq) in [
        (ConvParams::new(2, 64, 128, 6, 11, 1, 1), 0),
        (ConvParams::new(1, 128, 64, 5, 9, 1, 1), 0),
        (ConvParams::new(1, 40, 70, 7, 7, 1, 1), 10),
    ] {
        let mut t = ConvTuning::heuristic(&p);
        if bq > 0 {
            t.bq = bq;
        }
        check(p, t, Activation::Relu, 21);
    }
}

#[test]
fn channels_not_multiples_of_the_block() {
    let p = ConvParams::new(2, 10, 13, 6, 7, 3, 3).pad(1);
    let mut t = ConvTuning::heuristic(&p);
    t.bc = 4;
    t.bk = 8;
    t.bq = 4;
    check(p, t, Activation::Sigmoid, 3);
}

/// Few dW blocks (9 here) on two threads: backward-weights splits the row
/// chunks between the threads into partial sums, then adds them (odd and
/// even chunk counts, chunks of 1 to 3 rows, db riding along).
#[test]
fn update_with_few_blocks_splits_rows_between_threads() {
    for chunk in [1, 2, 3] {
        let p = ConvParams::new(3, 5, 7, 9, 8, 3, 3).pad(1);
        let mut t = ConvTuning::heuristic(&p);
        t.upd.chunk = chunk;
        check(p, t, Activation::Relu, 11 + chunk as u64);
    }
}

#[test]
fn every_valid_spec_gives_the_same_result() {
    let p = ConvParams::new(2, 8, 8, 6, 6, 3, 3).pad(1);
    let p2 = ConvParams::new(2, 8, 8, 7, 7, 3, 3).stride(2).pad(1);
    let base = |p: &ConvParams| {
        let mut t = ConvTuning::heuristic(p);
        t.bc = 4;
        t.bk = 4;
        t.bq = 4;
        t
    };
    // The layer's letters in every pass: a images, b K, c C blocks, d rows,
    // e pixel blocks, f, g filter taps. Gather backward-data reduces over b
    // where forward reduces over c: its specs are forward's with b and c
    // swapped.
    let swap_bc = |s: &str| -> String {
        s.chars()
            .map(|ch| match ch {
                'b' => 'c',
                'c' => 'b',
                'B' => 'C',
                'C' => 'B',
                x => x,
            })
            .collect()
    };
    // At stride 2 each phase of backward-data runs the same nest.
    for spec in [
        "ABdec", "BAdec", "Acdeb", "abdec", "ABDEc", "cabde", "AAbdec",
    ] {
        for (q, seed) in [(p, 11), (p2, 12)] {
            let mut t = base(&q);
            t.fwd = PassConfig {
                chunk: 1,
                blocks_a: vec![1],
                ..PassConfig::spec(spec)
            };
            t.bwd = PassConfig {
                spec: swap_bc(spec),
                ..t.fwd.clone()
            };
            check(q, t.clone(), Activation::Relu, seed);
            // bf16: a forward whose output is bf16 alone keeps a block's
            // sums where the nest comes back to them (c outermost too).
            check_bf16(q, t, Activation::Relu, seed);
        }
    }
    // Backward-data's reduction (b) blocked, its inner loop innermost: the
    // nest comes back to a dX block after the others, so a bf16 dX keeps
    // its sums in f32 of dX's size, not in L1.
    for (q, seed) in [(p, 15), (p2, 16)] {
        let mut t = base(&q);
        t.bwd = PassConfig {
            chunk: 1,
            blocks_b: vec![1],
            ..PassConfig::spec("bACDEb")
        };
        check(q, t.clone(), Activation::Relu, seed);
        check_bf16(q, t, Activation::Relu, seed);
    }
    for (spec, chunk) in [
        ("aBCFG", 3),
        ("BCFGa", 1),
        ("abcfg", 5),
        ("fgaBC", 0),
        ("CBFGa", 2),
        ("deaBCFG", 2),
    ] {
        for (q, seed) in [(p, 13), (p2, 14)] {
            let mut t = base(&q);
            t.upd = PassConfig {
                chunk,
                ..PassConfig::spec(spec)
            };
            check(q, t, Activation::Identity, seed);
        }
    }
}

#[test]
fn bad_shapes_and_buffers_are_errors() {
    let e = Conv::new(
        ConvParams::new(1, 3, 4, 4, 4, 7, 7).pad(1),
        Activation::Relu,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("r = 7") && e.contains("padded input height 6"),
        "{e}"
    );
    let e = Conv::new(
        ConvParams::new(1, 3, 4, 8, 8, 3, 3).strides(1, 0),
        Activation::Relu,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("stride_w = 0"), "{e}");
    let e = Conv::new(ConvParams::new(1, 0, 4, 8, 8, 3, 3), Activation::Relu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("c = 0"), "{e}");
    let p = ConvParams::new(2, 4, 4, 8, 8, 3, 3).pad(1);
    let conv = Conv::new(p, Activation::Relu).unwrap();
    let pool = Pool::new(1).unwrap();
    let x = Tensor4::zeros(2, 4, 8, 9, 4).unwrap();
    let mut y = conv.y_tensor();
    let e = conv
        .forward(&pool, &x, &conv.filter(), &[0.0; 4], &mut y)
        .unwrap_err()
        .to_string();
    assert!(e.contains("X") && e.contains("(2, 4, 8, 9, 4)"), "{e}");
    let e = conv
        .forward(&pool, &conv.x_tensor(), &conv.filter(), &[0.0; 3], &mut y)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bias") && e.contains("expected 4"), "{e}");
    let e = conv
        .forward(&pool, &conv.x_tensor(), &conv.filter_t(), &[0.0; 4], &mut y)
        .map(|_| ())
        .err();
    // A 4x4 filter transposed has the same dims: not an error here.
    assert!(e.is_none());
    let mut t = ConvTuning::heuristic(&p);
    t.upd = PassConfig::spec("Abcfg");
    let e = Conv::with_tuning(p, Activation::Relu, t)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("conv upd") && e.contains("Abcfg") && e.contains("pairs"),
        "{e}"
    );
    let e = Conv::new(p, Activation::Gelu).unwrap_err().to_string();
    assert!(e.contains("Gelu"), "{e}");
}

/// Equal bit for bit (NaN included).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| round_bf16(*x).to_f32()).collect()
}

/// The bf16 forward and backward-data of `conv` against the f64 reference
/// on the bf16-rounded operands; returns the kernel they ran on.
fn check_bf16(p: ConvParams, t: ConvTuning, act: Activation, seed: u64) -> Bf16Isa {
    let conv = Conv::with_tuning(p, act, t).unwrap();
    let cb = ConvBf16::new(&conv).unwrap();
    let pool = Pool::new(2).unwrap().always_parallel();
    let xs = data(p.n * p.c * p.h * p.w, seed);
    let ws = data(p.k * p.c * p.r * p.s, seed + 1);
    let bs = data(p.k, seed + 2);
    let dys = data(p.n * p.k * p.p() * p.q(), seed + 3);
    let tn = conv.tuning().clone();
    let buf = || AlignedVec::<bf16>::new(brgemm::buffer::ALIGN);
    let (mut wv, mut wtv) = (buf(), buf());
    let x = Tensor4::from_nchw(&xs, p.n, p.c, p.h, p.w, tn.bc).unwrap();
    let w = Filter::from_kcrs(&ws, (p.k, p.c, p.r, p.s), tn.bk, tn.bc).unwrap();
    cb.pack_filter(&pool, &w, &mut wv, &mut wtv).unwrap();
    let mut bias = vec![0.0; conv.padded_k()];
    bias[..p.k].copy_from_slice(&bs);
    let mut y = conv.y_tensor();
    y.data_mut().fill(f32::NAN);
    cb.forward(&pool, &conv, &x, &wv, &bias, &mut y).unwrap();
    let want = naive(&p, &rounded(&xs), &rounded(&ws), &bs, &rounded(&dys));
    let act_want: Vec<f64> = want.y.iter().map(|v| act.apply(*v as f32) as f64).collect();
    let isa = cb.isa();
    let what = format!("bf16 Y ({isa:?}, {p:?})");
    close(&what, &y.to_nchw(), &act_want, (p.c * p.r * p.s) as f64);
    // X handed over in bf16 by the layer before: the same bits.
    let to_bf16 = |t: &Tensor4| -> Vec<bf16> { t.data().iter().map(|v| round_bf16(*v)).collect() };
    let mut y2 = conv.y_tensor();
    y2.data_mut().fill(f32::NAN);
    let xb = to_bf16(&x);
    cb.forward(
        &pool,
        &conv,
        Operand::F32(&x, Some(&xb)),
        &wv,
        &bias,
        &mut y2,
    )
    .unwrap();
    assert!(same_bits(y.data(), y2.data()), "{what}: from bf16 X");
    let e = cb.forward(
        &pool,
        &conv,
        Operand::F32(&x, Some(&xb[1..])),
        &wv,
        &bias,
        &mut y2,
    );
    assert!(e.unwrap_err().to_string().contains("bf16 X"));
    // The output in bf16 alone, from f32 or bf16 X: the f32 output's bits
    // rounded, whether each block's reduction is one call or several.
    // X in bf16 alone (a batch norm's output): the same bits.
    let x_alone = Tensor4::rounded(&pool, &x);
    y2.data_mut().fill(f32::NAN);
    cb.forward(&pool, &conv, &x_alone, &wv, &bias, &mut y2)
        .unwrap();
    assert!(
        same_bits(y.data(), y2.data()),
        "{what}: from X in bf16 alone"
    );
    for x in [
        Operand::from(&x),
        Operand::F32(&x, Some(&xb)),
        Operand::from(&x_alone),
    ] {
        let mut yb = Tensor4::zeros_bf16(p.n, p.k, p.p(), p.q(), tn.bk).unwrap();
        yb.data_mut().fill(bf16::NAN);
        cb.forward_bf16(&pool, &conv, x, &wv, &bias, &mut yb)
            .unwrap();
        let got = yb.widened();
        assert!(
            same_bits(got.data(), &rounded(y.data())),
            "{what}: bf16 output (chunk {})",
            tn.fwd.chunk
        );
    }
    let mut short = Tensor4::zeros_bf16(p.n, p.k + 1, p.p(), p.q(), tn.bk).unwrap();
    let e = cb.forward_bf16(&pool, &conv, &x, &wv, &bias, &mut short);
    assert!(e.unwrap_err().to_string().contains("Y"));
    let dz = Tensor4::from_nchw(&dys, p.n, p.k, p.p(), p.q(), tn.bk).unwrap();
    let mut dx = conv.x_tensor();
    dx.data_mut().fill(f32::NAN);
    cb.backward_data(&pool, &conv, &dz, &wtv, &mut dx).unwrap();
    close(
        &format!("bf16 dX ({isa:?}, {p:?})"),
        &dx.to_nchw(),
        &want.dx,
        (p.k * p.r * p.s) as f64,
    );
    let mut dx2 = conv.x_tensor();
    dx2.data_mut().fill(f32::NAN);
    let dzb = to_bf16(&dz);
    let dz_copy = Operand::F32(&dz, Some(&dzb));
    cb.backward_data(&pool, &conv, dz_copy, &wtv, &mut dx2)
        .unwrap();
    assert!(
        same_bits(dx.data(), dx2.data()),
        "bf16 dX ({p:?}): from bf16 dZ"
    );
    // dZ in bf16 alone (a batch norm's dx): the same bits.
    let dz_alone = Tensor4::rounded(&pool, &dz);
    dx2.data_mut().fill(f32::NAN);
    cb.backward_data(&pool, &conv, &dz_alone, &wtv, &mut dx2)
        .unwrap();
    assert!(
        same_bits(dx.data(), dx2.data()),
        "bf16 dX ({p:?}): from dZ in bf16 alone"
    );
    // dX in bf16 alone, from f32 dZ, its copy or dZ in bf16 alone: the f32
    // dX's bits rounded, where backward-data is one dense phase (stride 1);
    // else an error.
    for dz in [Operand::from(&dz), dz_copy, Operand::from(&dz_alone)] {
        let mut dxb = Tensor4::zeros_bf16(p.n, p.c, p.h, p.w, tn.bc).unwrap();
        dxb.data_mut().fill(bf16::NAN);
        let r = cb.backward_data_bf16(&pool, &conv, dz, &wtv, &mut dxb);
        match cb.writes_dx_bf16() {
            true => {
                r.unwrap();
                assert!(
                    same_bits(dxb.widened().data(), &rounded(dx.data())),
                    "bf16 dX alone ({p:?}, chunk {})",
                    tn.bwd.chunk
                );
            }
            false => assert!(r.unwrap_err().to_string().contains("stride"), "{p:?}"),
        }
    }
    assert_eq!(
        cb.writes_dx_bf16(),
        p.stride_h == 1 && p.stride_w == 1,
        "{p:?}"
    );
    // In place where no border is padded: forward, a layer without one;
    // backward-data, at least a 1x1 layer without one.
    let (fwd, bwd) = cb.reads_in_place();
    assert_eq!(fwd, p.pad_h == 0 && p.pad_w == 0, "{p:?}");
    assert!(bwd || p.r * p.s > 1 || p.pad_h + p.pad_w > 0, "{p:?}");
    let mut dw = conv.filter();
    dw.data_mut().fill(f32::NAN);
    let mut db = vec![f32::NAN; conv.padded_k()];
    cb.backward_weights(&pool, &conv, &dz, &x, &mut dw, &mut db)
        .unwrap();
    let scale = (p.n * p.p() * p.q()) as f64;
    // The f32 pass, on the operands as given, where the plan found bf16
    // not paying on this CPU.
    let want_dw = match cb.upd_isa() {
        Some(_) => want.dw.clone(),
        None => naive(&p, &xs, &ws, &bs, &dys).dw,
    };
    close(
        &format!("bf16 dW ({:?}, {p:?})", cb.upd_isa()),
        &dw.to_kcrs(),
        &want_dw,
        scale,
    );
    let exact = naive(&p, &xs, &ws, &bs, &dys);
    close("bf16 db (of the f32 dY)", &db[..p.k], &exact.db, scale);
    assert!(
        dw.data().iter().all(|v| v.is_finite()),
        "dW padding not written"
    );
    // dZ in bf16 alone: the bf16 pass reads the same pairs (dW the same
    // bits), db sums the rounded values; the f32 pass widens it.
    let mut dw2 = conv.filter();
    let mut db2 = vec![f32::NAN; conv.padded_k()];
    cb.backward_weights(&pool, &conv, &dz_alone, &x, &mut dw2, &mut db2)
        .unwrap();
    let want_db = naive(&p, &xs, &ws, &bs, &rounded(&dys)).db;
    close(
        "bf16 db (of dY in bf16 alone)",
        &db2[..p.k],
        &want_db,
        scale,
    );
    // X in bf16 alone too (a batch norm's output): the bf16 pass transposes
    // the same values it rounded before (dW the same bits).
    let mut dw3 = conv.filter();
    let mut db3 = vec![f32::NAN; conv.padded_k()];
    cb.backward_weights(&pool, &conv, &dz_alone, &x_alone, &mut dw3, &mut db3)
        .unwrap();
    assert!(same_bits(&db2, &db3), "db ({p:?})");
    match cb.upd_isa() {
        Some(_) => assert!(same_bits(dw.data(), dw3.data()), "dW from X alone ({p:?})"),
        None => close(
            "f32 dW (of dY and X in bf16 alone)",
            &dw3.to_kcrs(),
            &naive(&p, &rounded(&xs), &ws, &bs, &rounded(&dys)).dw,
            scale,
        ),
    }
    match cb.upd_isa() {
        Some(_) => assert!(same_bits(dw.data(), dw2.data()), "dW from dZ alone ({p:?})"),
        None => close(
            "f32 dW (of dY in bf16 alone)",
            &dw2.to_kcrs(),
            &naive(&p, &xs, &ws, &bs, &rounded(&dys)).dw,
            scale,
        ),
    }
    isa
}

/// bf16 passes on ResNet-like layers with 32-channel blocks (AMX where the
/// CPU has it: pixel runs of 7, 14 and 28 are the kernel's column tails),
/// padding, strides, dilation and a channel count off the block.
#[test]
fn bf16_passes_match_the_reference_on_rounded_operands() {
    for (p, act) in [
        (
            ConvParams::new(2, 64, 64, 14, 14, 3, 3).pad(1),
            Activation::Relu,
        ),
        (ConvParams::new(2, 64, 96, 7, 7, 1, 1), Activation::Identity),
        (
            ConvParams::new(1, 32, 64, 28, 28, 3, 3).stride(2).pad(1),
            Activation::Relu,
        ),
        (
            ConvParams::new(1, 32, 32, 9, 12, 3, 3).dilation(2).pad(2),
            Activation::Sigmoid,
        ),
        // A projection shortcut (one phase of four read) and a filter
        // whose taps fall on every phase of unequal strides.
        (
            ConvParams::new(2, 64, 64, 14, 14, 1, 1).stride(2),
            Activation::Identity,
        ),
        (
            ConvParams::new(1, 32, 32, 11, 13, 3, 3)
                .strides(2, 3)
                .pads(1, 2)
                .dilations(2, 1),
            Activation::Relu,
        ),
        (
            ConvParams::new(2, 40, 50, 6, 5, 3, 3).pad(1),
            Activation::Tanh,
        ),
        // Images whose dY and X planes together pass 1 MiB: backward-
        // weights calls the kernel per image (the shapes above batch them),
        // two images per work item (four items of 32-channel blocks).
        (
            ConvParams::new(2, 64, 64, 64, 64, 3, 3).pad(1),
            Activation::Identity,
        ),
        // Per image too, the larger operand's planes made in each work
        // unit: dY's (three K blocks, one C block; the images split
        // between the threads), and X's four phase planes at stride 2.
        (
            ConvParams::new(3, 32, 96, 64, 64, 1, 1),
            Activation::Identity,
        ),
        (
            ConvParams::new(3, 96, 32, 96, 96, 3, 3).stride(2).pad(1),
            Activation::Relu,
        ),
    ] {
        let mut t = ConvTuning::heuristic(&p);
        t.bc = 32;
        t.bk = 32;
        let isa = check_bf16(p, t, act, 5);
        if Bf16Isa::Amx.is_supported() && std::env::var_os("BRGEMM_BF16_ISA").is_none() {
            assert_eq!(isa, Bf16Isa::Amx, "{p:?}");
        }
    }
    // The heuristic's own blocking on small images (the nn tests' shapes).
    for p in [
        ConvParams::new(4, 32, 64, 8, 8, 3, 3).pad(1),
        ConvParams::new(4, 64, 64, 8, 8, 3, 3).pad(1),
    ] {
        check_bf16(p, ConvTuning::heuristic(&p), Activation::Relu, 9);
    }
    // Odd channel blocks cannot pair: an error naming the block.
    let p = ConvParams::new(1, 6, 6, 5, 5, 3, 3);
    let mut t = ConvTuning::heuristic(&p);
    t.bc = 3;
    let e = ConvBf16::new(&Conv::with_tuning(p, Activation::Relu, t).unwrap())
        .err()
        .expect("odd bc refused")
        .to_string();
    assert!(e.contains("bc") && e.contains('3'), "{e}");
}

/// Any geometry, each axis with its own filter size, stride, padding and
/// dilation.
fn arb_params() -> impl Strategy<Value = ConvParams> {
    let taps = || prop::sample::select(vec![1usize, 2, 3, 5]);
    (
        (1usize..3, 1usize..10, 1usize..10, 1usize..10, 1usize..10),
        (taps(), taps(), 1usize..4, 1usize..4),
        (0usize..3, 0usize..3, 1usize..3, 1usize..3),
    )
        .prop_filter_map(
            "filter larger than the padded input",
            |((n, c, k, h, w), (r, s, sh, sw), (ph, pw, dh, dw))| {
                let p = ConvParams::new(n, c, k, h, w, r, s)
                    .strides(sh, sw)
                    .pads(ph, pw)
                    .dilations(dh, dw);
                p.validate().ok().map(|_| p)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)))]
    #[test]
    fn any_shape_matches_the_reference(
        p in arb_params(),
        bc in 1usize..6,
        bk in 1usize..6,
        bq in 1usize..9,
        upd_chunk in 0usize..5,
        seed in 0u64..1000,
    ) {
        let mut t = ConvTuning::heuristic(&p);
        t.bc = bc;
        t.bk = bk;
        t.bq = bq;
        // Backward-weights' (image, row) pairs per call (0: the
        // heuristic's): chunks that cross images and rows that a filter row
        // reaches only in the padding.
        t.upd.chunk = upd_chunk;
        check(p, t, Activation::Relu, seed);
    }

    /// bf16 passes, any geometry, small even blocks (kernels other than
    /// AMX) and tails.
    #[test]
    fn bf16_any_shape_matches_the_reference(
        p in arb_params(),
        bc in 1usize..4,
        bk in 1usize..4,
        bq in 1usize..9,
        fwd_chunk in 0usize..3,
        seed in 0u64..1000,
    ) {
        let mut t = ConvTuning::heuristic(&p);
        t.bc = 2 * bc;
        t.bk = 2 * bk;
        t.bq = bq;
        // C (K) blocks per forward (backward-data) call (0: all): a bf16
        // output's blocks then sum over several calls.
        t.fwd.chunk = fwd_chunk;
        t.bwd.chunk = fwd_chunk;
        check_bf16(p, t, Activation::Relu, seed);
    }
}

/// A forward that adds a residual (then a ReLU) gives the bits of the
/// forward followed by the addition, f32 and bf16: 3x3 with padding, a
/// pointwise layer (one long row), stride 2, and a K off the block.
#[test]
fn forward_with_a_residual_is_the_forward_then_the_add() {
    let pool = Pool::new(2).unwrap().always_parallel();
    for (p, act) in [
        (
            ConvParams::new(2, 32, 64, 9, 9, 3, 3).pad(1),
            Activation::Identity,
        ),
        (ConvParams::new(2, 64, 32, 7, 7, 1, 1), Activation::Relu),
        (
            ConvParams::new(1, 32, 32, 9, 8, 3, 3).stride(2).pad(1),
            Activation::Identity,
        ),
        (
            ConvParams::new(2, 6, 10, 5, 5, 3, 3).pad(1),
            Activation::Sigmoid,
        ),
    ] {
        let mut t = ConvTuning::heuristic(&p);
        t.bq = 5;
        if p.k % 32 == 0 {
            (t.bc, t.bk) = (32, 32);
        } else {
            (t.bc, t.bk) = (2, 4);
        }
        let conv = Conv::with_tuning(p, act, t.clone()).unwrap();
        let x =
            Tensor4::from_nchw(&data(p.n * p.c * p.h * p.w, 61), p.n, p.c, p.h, p.w, t.bc).unwrap();
        let ws = data(p.k * p.c * p.r * p.s, 62);
        let w = Filter::from_kcrs(&ws, (p.k, p.c, p.r, p.s), t.bk, t.bc).unwrap();
        let rs = data(p.n * p.k * p.p() * p.q(), 63);
        let r = Tensor4::from_nchw(&rs, p.n, p.k, p.p(), p.q(), t.bk).unwrap();
        let bias = vec![0.25; conv.padded_k()];
        let cb = ConvBf16::new(&conv).unwrap();
        let buf = || AlignedVec::<bf16>::new(brgemm::buffer::ALIGN);
        let (mut wv, mut wtv) = (buf(), buf());
        cb.pack_filter(&pool, &w, &mut wv, &mut wtv).unwrap();
        for relu in [false, true] {
            let add = AddResidual { r: &r, relu };
            let joined = |y: &Tensor4| -> Vec<f32> {
                (y.data().iter().zip(r.data()))
                    .map(|(u, v)| if relu { (u + v).max(0.0) } else { u + v })
                    .collect()
            };
            let (mut y, mut ya) = (conv.y_tensor(), conv.y_tensor());
            ya.data_mut().fill(f32::NAN);
            conv.forward(&pool, &x, &w, &bias, &mut y).unwrap();
            conv.forward_add(&pool, &x, &w, &bias, add, &mut ya)
                .unwrap();
            assert_eq!(ya.data(), &joined(&y)[..], "f32 {p:?} relu {relu}");
            ya.data_mut().fill(f32::NAN);
            cb.forward(&pool, &conv, &x, &wv, &bias, &mut y).unwrap();
            cb.forward_add(&pool, &conv, &x, &wv, &bias, add, &mut ya)
                .unwrap();
            assert_eq!(ya.data(), &joined(&y)[..], "bf16 {p:?} relu {relu}");
            let xb: Vec<bf16> = x.data().iter().map(|v| round_bf16(*v)).collect();
            ya.data_mut().fill(f32::NAN);
            cb.forward_add(
                &pool,
                &conv,
                Operand::F32(&x, Some(&xb)),
                &wv,
                &bias,
                add,
                &mut ya,
            )
            .unwrap();
            assert_eq!(ya.data(), &joined(&y)[..], "bf16 X {p:?} relu {relu}");
        }
        // A residual of other dims is refused, naming it.
        let small = Tensor4::zeros(p.n, p.k, p.p(), p.q() - 1, t.bk).unwrap();
        let mut y = conv.y_tensor();
        let add = AddResidual {
            r: &small,
            relu: true,
        };
        let e = conv
            .forward_add(&pool, &x, &w, &bias, add, &mut y)
            .unwrap_err();
        assert!(e.to_string().contains("residual"), "{e}");
    }
}

/// Forward flops per input and output element (what decides whether a
/// layer's bf16 passes pay on AVX512-BF16), counted by hand for ResNet-50
/// layers: a 1x1 64 -> 64 layer, a 3x3 one, and the stride-2 projection.
#[test]
fn flops_per_activation_counts_input_and_output_elements() {
    let per = |p: ConvParams| p.flops_per_activation();
    assert_eq!(per(ConvParams::new(16, 64, 64, 56, 56, 1, 1)), 64.0);
    assert_eq!(per(ConvParams::new(2, 64, 64, 56, 56, 3, 3).pad(1)), 576.0);
    let proj = ConvParams::new(1, 256, 512, 56, 56, 1, 1).stride(2);
    let want = 2.0 * 256.0 * 512.0 * 784.0 / (256.0 * 3136.0 + 512.0 * 784.0);
    assert!((per(proj) - want).abs() < 1e-9, "{}", per(proj));
}

/// Backward-data with dX's pixels in the vector lanes (3 input channels,
/// 7x7 at stride 2: the stem; 5x5 and 3x3 too, whose column phases have
/// other tap counts) over two K blocks and two images, rows of odd width;
/// then one image (its rows split into bands over the threads), K in three
/// chunks with the last block's padding channels, and dilated taps.
#[test]
fn stem_backward_data_with_pixels_in_the_lanes() {
    for (r, pad) in [(7, 3), (5, 2), (3, 1)] {
        let p = ConvParams::new(2, 3, 24, 29, 31, r, r).stride(2).pad(pad);
        let mut t = ConvTuning::heuristic(&p);
        t.bq = 6;
        t.bk = 16;
        check(p, t, Activation::Relu, 33);
    }
    for p in [
        ConvParams::new(1, 3, 40, 17, 19, 5, 5).stride(2).pad(2),
        ConvParams::new(1, 2, 20, 12, 13, 3, 3).dilation(2).pad(2),
    ] {
        let mut t = ConvTuning::heuristic(&p);
        t.bk = 16;
        check(p, t, Activation::Relu, 34);
    }
}
