//! Mixed-precision FC passes against an f64 reference computed from the
//! same bf16-rounded operands.

use brgemm::bf16::bf16;
use brgemm_primitives::fc_bf16::{to_bf16, FcBf16};
use brgemm_primitives::{Activation, Fc, FcTuning, Pool};

mod common;
use common::data;

fn round(v: &[f32]) -> Vec<f64> {
    v.iter()
        .map(|x| bf16::from_f32(*x).to_f32() as f64)
        .collect()
}

#[test]
fn forward_and_backward_passes_match_the_rounded_reference() {
    let pool = Pool::new(2).unwrap().always_parallel();
    // (n, c, k, blocks): AMX-sized blocks, AVX512-BF16 tails, small blocks.
    for (n, c, k, b) in [
        (64, 128, 64, 64),
        (40, 70, 30, 16),
        (8, 6, 10, 0),
        (33, 64, 96, 32),
        // Y longer than a rounding piece of the copies.
        (130, 40, 200, 0),
        // Weights that stream (one N block, over 32 reduction blocks): on
        // cores that prefetch from L2, calls of one block under 32 rows,
        // of 16 blocks (and a last one of 1) from 32.
        (16, 2112, 130, 0),
        (16, 130, 2112, 0),
        (40, 2100, 70, 0),
    ] {
        let mut t = FcTuning::heuristic(n, c, k);
        if b > 0 {
            (t.bn, t.bc, t.bk) = (b, b, b);
        }
        for act in [Activation::Identity, Activation::Relu, Activation::Sigmoid] {
            let fc = Fc::with_tuning(n, c, k, act, t.clone()).unwrap();
            let fb = FcBf16::new(&fc).unwrap();
            let (xs, ws, bs, gs) = (data(n * c, 1), data(k * c, 2), data(k, 3), data(n * k, 4));
            let mut x = fc.x_layout();
            x.set_plain(&xs).unwrap();
            let mut w = fc.w_layout();
            w.set_plain(&ws).unwrap();
            let mut bias = vec![0.0; fc.padded_k()];
            bias[..k].copy_from_slice(&bs);
            let new = || brgemm::AlignedVec::new(brgemm::buffer::ALIGN);
            let (mut wv, mut wtv, mut xb) = (new(), new(), new());
            fb.pack_weights(&pool, &w, &mut wv, &mut wtv).unwrap();
            to_bf16(&pool, x.data(), &mut xb);
            let mut y = fc.y_layout();
            fb.forward(&pool, &xb, &wv, &bias, &mut y, None).unwrap();
            let (xr, wr) = (round(&xs), round(&ws));
            let got = y.to_plain();
            for r in 0..n {
                for j in 0..k {
                    let s: f64 =
                        (0..c).map(|i| xr[r * c + i] * wr[j * c + i]).sum::<f64>() + bs[j] as f64;
                    let want = act.apply(s as f32) as f64;
                    let g = got[r * k + j] as f64;
                    assert!(
                        (g - want).abs() < 1e-4 * (1.0 + c as f64 * 0.05),
                        "{n}x{c}x{k} {act:?} Y[{r}][{j}]: {g} vs {want}"
                    );
                }
            }
            // Output-feature padding stays zero.
            let rows = n.div_ceil(fc.tuning().bn) * fc.tuning().bn;
            for r in 0..rows {
                for j in k..fc.padded_k() {
                    assert_eq!(y.data()[y.index(r, j)], 0.0, "Y padding [{r}][{j}]");
                }
            }
            // Y also in bf16 for the next layer: the same Y, and the copy
            // what rounding it gives (padding included).
            let mut y2 = fc.y_layout();
            let mut yb = vec![bf16::ZERO; y.data().len()];
            fb.forward(&pool, &xb, &wv, &bias, &mut y2, Some(&mut yb))
                .unwrap();
            assert_eq!(y.data(), y2.data(), "{n}x{c}x{k} {act:?}: Y with a copy");
            let mut want_b = brgemm::AlignedVec::new(brgemm::buffer::ALIGN);
            to_bf16(&pool, y.data(), &mut want_b);
            assert_eq!(&yb[..], &want_b[..], "{n}x{c}x{k} {act:?}: bf16 Y");
            let e = fb.forward(&pool, &xb, &wv, &bias, &mut y2, Some(&mut yb[1..]));
            assert!(e.unwrap_err().to_string().contains("bf16 Y"));
            // dZ = dY * act'(Y), rounded in the same pass.
            let mut dyb = fc.y_layout();
            dyb.set_plain(&data(n * k, 5)).unwrap();
            let (mut dz1, mut dz2) = (fc.y_layout(), fc.y_layout());
            let mut dzr = vec![bf16::ZERO; dz1.data().len()];
            fc.activation_backward(&pool, &dyb, &y, None, &mut dz1, None)
                .unwrap();
            fc.activation_backward(&pool, &dyb, &y, None, &mut dz2, Some(&mut dzr))
                .unwrap();
            assert_eq!(dz1.data(), dz2.data(), "{act:?}: dZ with a copy");
            to_bf16(&pool, dz1.data(), &mut want_b);
            assert_eq!(&dzr[..], &want_b[..], "{act:?}: bf16 dZ");
            let mut dz = fc.y_layout();
            dz.set_plain(&gs).unwrap();
            let mut dzb = brgemm::AlignedVec::new(brgemm::buffer::ALIGN);
            to_bf16(&pool, dz.data(), &mut dzb);
            let mut dx = fc.x_layout();
            fb.backward_data(&pool, &dzb, &wtv, &mut dx).unwrap();
            let gr = round(&gs);
            let got = dx.to_plain();
            for r in 0..n {
                for i in 0..c {
                    let want: f64 = (0..k).map(|j| gr[r * k + j] * wr[j * c + i]).sum();
                    let g = got[r * c + i] as f64;
                    assert!(
                        (g - want).abs() < 1e-4 * (1.0 + k as f64 * 0.05),
                        "{n}x{c}x{k} dX[{r}][{i}]: {g} vs {want}"
                    );
                }
            }
            // Backward-weights from the f32 dZ and X (rounded by the pass;
            // db from the f32 dZ), every element written.
            let mut dw = fc.w_layout();
            dw.data_mut().fill(f32::NAN);
            let mut db = vec![f32::NAN; fc.padded_k()];
            fb.backward_weights(&pool, &fc, &dz, &x, &mut dw, &mut db)
                .unwrap();
            assert!(
                dw.data().iter().all(|v| v.is_finite()),
                "dW not all written"
            );
            let got = dw.to_plain();
            // The f32 pass where the plan found bf16 not paying here (the
            // operands as given, unrounded).
            let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
            let (gu, xu) = match fb.upd_isa() {
                Some(_) => (gr.clone(), xr.clone()),
                None => (wide(&gs), wide(&xs)),
            };
            for j in 0..k {
                for i in 0..c {
                    let want: f64 = (0..n).map(|r| gu[r * k + j] * xu[r * c + i]).sum();
                    let g = got[j * c + i] as f64;
                    assert!(
                        (g - want).abs() < 1e-4 * (1.0 + n as f64 * 0.05),
                        "{n}x{c}x{k} dW[{j}][{i}]: {g} vs {want}"
                    );
                }
                let want: f64 = (0..n).map(|r| gs[r * k + j] as f64).sum();
                assert!(
                    (db[j] as f64 - want).abs() < 1e-4 * (1.0 + n as f64 * 0.05),
                    "{n}x{c}x{k} db[{j}]: {} vs {want}",
                    db[j]
                );
            }
            assert!(db[k..].iter().all(|v| *v == 0.0), "db padding");
        }
    }
}

#[test]
fn backward_weights_refuses_another_layer() {
    let fc = Fc::new(32, 64, 64, Activation::Identity).unwrap();
    let other = Fc::new(32, 64, 128, Activation::Identity).unwrap();
    let fb = FcBf16::new(&fc).unwrap();
    let pool = Pool::new(1).unwrap();
    let (dz, x, mut dw) = (fc.y_layout(), fc.x_layout(), fc.w_layout());
    let mut db = vec![0.0; fc.padded_k()];
    let e = fb
        .backward_weights(&pool, &other, &dz, &x, &mut dw, &mut db)
        .unwrap_err()
        .to_string();
    assert!(e.contains("128") && e.contains("(32, 64, 64"), "{e}");
}

#[test]
fn odd_blocks_and_gelu_are_refused() {
    let t = FcTuning {
        bc: 7,
        ..FcTuning::heuristic(8, 7, 8)
    };
    let fc = Fc::with_tuning(8, 7, 8, Activation::Relu, t).unwrap();
    let e = FcBf16::new(&fc).err().unwrap().to_string();
    assert!(e.contains("bc = 7") && e.contains("even"), "{e}");
    let fc = Fc::new(8, 8, 8, Activation::Gelu).unwrap();
    assert!(FcBf16::new(&fc).err().unwrap().to_string().contains("Gelu"));
}

/// Where backward-weights stores a dW too large to stay in cache (over 16
/// MiB here), the policy may keep that pass f32 while the fused step, which
/// stores no dW, runs bf16: the step's kernel is bf16 wherever the pass's
/// is, and its SGD step (no momentum) matches W - lr dW with dW from the
/// f64 reference on the operands its kernel reads (rounded to bf16 when it
/// runs bf16); the packed copies are those of the stepped W.
#[test]
fn fused_step_on_a_gradient_that_would_stream() {
    let (n, c, k) = (32, 2048, 2112);
    let fc = Fc::new(n, c, k, Activation::Relu).unwrap();
    let fb = FcBf16::new(&fc).unwrap();
    assert!(fb.upd_isa().is_none() || fb.step_isa().is_some());
    let (xp, dzp, w0) = (data(n * c, 1), data(n * k, 4), data(k * c, 2));
    let (mut x, mut dz, mut w) = (fc.x_layout(), fc.y_layout(), fc.w_layout());
    x.set_plain(&xp).unwrap();
    dz.set_plain(&dzp).unwrap();
    w.set_plain(&w0).unwrap();
    let pool = Pool::new(2).unwrap().always_parallel();
    let lr = 0.5;
    let opt = brgemm_primitives::Optimizer::Sgd { lr, momentum: 0.0 };
    let mut state = brgemm_primitives::optim::OptState::default();
    let new = || brgemm::AlignedVec::new(brgemm::buffer::ALIGN);
    let (mut wv, mut wtv) = (new(), new());
    let mut db = vec![0.0; fc.padded_k()];
    fb.backward_weights_step(
        &pool,
        &fc,
        &dz,
        &x,
        &mut w,
        &mut db,
        &opt,
        &mut state,
        (&mut wv, &mut wtv),
    )
    .unwrap();
    let bf16_step = fb.step_isa().is_some();
    let (xr, dzr) = if bf16_step {
        (round(&xp), round(&dzp))
    } else {
        let wide = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<_>>();
        (wide(&xp), wide(&dzp))
    };
    let got = w.to_plain();
    for (kk, row) in got.chunks(c).enumerate().step_by(97) {
        for (cc, &g) in row.iter().enumerate() {
            let dw: f64 = (0..n).map(|i| dzr[i * k + kk] * xr[i * c + cc]).sum();
            let want = w0[kk * c + cc] as f64 - lr as f64 * dw;
            assert!(
                (g as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "W[{kk}][{cc}] {g} vs {want} (bf16 step: {bf16_step})"
            );
        }
    }
    let (mut wv2, mut wtv2) = (new(), new());
    fb.pack_weights(&pool, &w, &mut wv2, &mut wtv2).unwrap();
    assert!(wv[..] == wv2[..] && wtv[..] == wtv2[..]);
}

/// The bf16 heuristic plans any shape the bf16 passes take: odd feature
/// blocks grow by one, even ones are the f32 heuristic's.
#[test]
fn the_bf16_heuristic_plans_odd_widths() {
    for (n, c, k) in [(8, 7, 5), (3, 1, 1), (16, 63, 10), (64, 1024, 1024)] {
        let t = FcTuning::heuristic_bf16(n, c, k);
        assert!(
            t.bc.is_multiple_of(2) && t.bk.is_multiple_of(2),
            "{c}x{k}: {t:?}"
        );
        let fc = Fc::with_tuning(n, c, k, Activation::Relu, t.clone()).unwrap();
        assert!(FcBf16::new(&fc).is_ok(), "{c}x{k}");
        let f32t = FcTuning::heuristic(n, c, k);
        if f32t.bc.is_multiple_of(2) && f32t.bk.is_multiple_of(2) {
            assert_eq!(t, f32t);
        }
    }
}

#[test]
fn branch_free_rounding_matches_half() {
    use brgemm_primitives::fc_bf16::round_bf16;
    let mut x = 0x0000_0001u32;
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        -1.5,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::INFINITY,
        f32::NEG_INFINITY,
        3.3895314e38,
    ];
    for v in specials {
        assert_eq!(round_bf16(v).to_bits(), bf16::from_f32(v).to_bits(), "{v}");
    }
    assert!(round_bf16(f32::NAN).is_nan());
    for _ in 0..2_000_000 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let v = f32::from_bits(x);
        if v.is_nan() {
            assert!(round_bf16(v).is_nan());
        } else {
            assert_eq!(
                round_bf16(v).to_bits(),
                bf16::from_f32(v).to_bits(),
                "{v:e} ({x:#x})"
            );
        }
    }
}

/// The fused bf16 update (`FcBf16::backward_weights_step`) leaves W, the
/// optimizer's moments, db and both packed weight copies bit for bit as
/// `backward_weights`, a separate step and `pack_weights` do, over two
/// steps (moments carried), for SGD with momentum and Adam, one and two
/// threads, on AMX-sized blocks, tails, small blocks, and a minibatch
/// short enough that the CPU policy may send backward-weights to the f32
/// pass (then the f32 fused step packs each block it steps), also with
/// that pass's reduction split over calls (each block packed after the
/// whole step).
#[test]
fn fused_step_and_packing_equal_the_separate_passes() {
    use brgemm_primitives::optim::{OptState, Optimizer};
    let opts = common::step_rules();
    for (n, c, k, b, upd_chunk) in [
        (64, 128, 64, 64, None),
        (40, 70, 30, 16, None),
        (8, 6, 10, 0, None),
        (16, 64, 64, 0, None),
        (24, 36, 20, 8, Some(1)),
        (48, 256, 192, 64, None),
    ] {
        let mut t = FcTuning::heuristic(n, c, k);
        if b > 0 {
            (t.bn, t.bc, t.bk) = (b, b, b);
        }
        if let Some(chunk) = upd_chunk {
            t.upd.chunk = chunk;
        }
        let fc = Fc::with_tuning(n, c, k, Activation::Relu, t.clone()).unwrap();
        let fb = FcBf16::new(&fc).unwrap();
        let mut x = fc.x_layout();
        x.set_plain(&data(n * c, 1)).unwrap();
        let mut dz = fc.y_layout();
        dz.set_plain(&data(n * k, 4)).unwrap();
        for threads in [1, 2] {
            let pool = Pool::new(threads).unwrap().always_parallel();
            for opt in opts {
                let mut w_sep = fc.w_layout();
                w_sep.set_plain(&data(k * c, 2)).unwrap();
                let (mut w_fused, w0) = (w_sep.clone(), w_sep.clone());
                let (mut s_sep, mut s_fused) = (OptState::default(), OptState::default());
                let mut dw = fc.w_layout();
                let (mut db_sep, mut db_fused) =
                    (vec![0.0; fc.padded_k()], vec![f32::NAN; fc.padded_k()]);
                let new = || brgemm::AlignedVec::new(brgemm::buffer::ALIGN);
                let (mut wv, mut wtv, mut wv2, mut wtv2) = (new(), new(), new(), new());
                for step in 0..2 {
                    fb.backward_weights(&pool, &fc, &dz, &x, &mut dw, &mut db_sep)
                        .unwrap();
                    s_sep.step(&opt, w_sep.data_mut(), dw.data());
                    fb.pack_weights(&pool, &w_sep, &mut wv, &mut wtv).unwrap();
                    fb.backward_weights_step(
                        &pool,
                        &fc,
                        &dz,
                        &x,
                        &mut w_fused,
                        &mut db_fused,
                        &opt,
                        &mut s_fused,
                        (&mut wv2, &mut wtv2),
                    )
                    .unwrap();
                    let what = format!(
                        "{n}x{c}x{k} blocks {b}, upd {:?}, {threads}t, {opt:?}, step {step}",
                        fb.upd_isa()
                    );
                    assert_eq!(w_fused.data(), w_sep.data(), "W: {what}");
                    assert_eq!(s_fused, s_sep, "moments: {what}");
                    assert_eq!(db_fused, db_sep, "db: {what}");
                    assert!(wv2[..] == wv[..], "forward packing: {what}");
                    assert!(wtv2[..] == wtv[..], "transposed packing: {what}");
                }
                assert_ne!(w_fused.data(), w0.data(), "W moved");
            }
        }
    }
    // Another layer's plan, and a W of another layout, are refused.
    let fc = Fc::new(8, 32, 32, Activation::Relu).unwrap();
    let other = Fc::new(8, 32, 48, Activation::Relu).unwrap();
    let fb = FcBf16::new(&fc).unwrap();
    let pool = Pool::new(1).unwrap();
    let (x, dz, mut db) = (fc.x_layout(), fc.y_layout(), vec![0.0; fc.padded_k()]);
    let mut state = OptState::default();
    let new = || brgemm::AlignedVec::new(brgemm::buffer::ALIGN);
    let (mut wv, mut wtv) = (new(), new());
    let opt = Optimizer::adam(1e-3);
    for (layer, mut w) in [(&other, fc.w_layout()), (&fc, other.w_layout())] {
        let e = fb
            .backward_weights_step(
                &pool,
                layer,
                &dz,
                &x,
                &mut w,
                &mut db,
                &opt,
                &mut state,
                (&mut wv, &mut wtv),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("48"), "{e}");
    }
}
