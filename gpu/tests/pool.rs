//! Pooling and the residual join against loops written out on plain NHWC:
//! max pooling (ResNet's 3x3 stride-2 padding-1 stem pool, overlapping and
//! disjoint windows, odd sizes) forward and backward, global average
//! pooling, and the add with and without ReLU. On OpenCL (PoCL in CI) and,
//! when there is one, a CUDA device.

mod common;
use brgemm_gpu::pool::{self, PoolShape};
use brgemm_gpu::Device;
use common::*;

fn maxpool(dev: &Device, sh: PoolShape, seed: u64) {
    let mut r = Lcg(seed);
    let (oh, ow) = sh.out_hw();
    let (inp, out) = (sh.n * sh.h * sh.w * sh.c, sh.n * oh * ow * sh.c);
    let x: Vec<f32> = (0..inp).map(|_| r.f32()).collect();
    let dy: Vec<f32> = (0..out).map(|_| r.f32()).collect();
    let mut y = vec![f32::NEG_INFINITY; out];
    let mut dx = vec![0.0f64; inp];
    for img in 0..sh.n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ch in 0..sh.c {
                    let o = ((img * oh + oy) * ow + ox) * sh.c + ch;
                    let mut at = None;
                    for wy in 0..sh.win {
                        for wx in 0..sh.win {
                            let (yy, xx) = (
                                (oy * sh.stride + wy) as isize - sh.pad as isize,
                                (ox * sh.stride + wx) as isize - sh.pad as isize,
                            );
                            if yy < 0 || xx < 0 || yy as usize >= sh.h || xx as usize >= sh.w {
                                continue;
                            }
                            let j = ((img * sh.h + yy as usize) * sh.w + xx as usize) * sh.c + ch;
                            if at.is_none() || x[j] > y[o] {
                                y[o] = x[j];
                                at = Some(j);
                            }
                        }
                    }
                    dx[at.expect("a window inside the image")] += dy[o] as f64;
                }
            }
        }
    }
    let (xb, dyb) = (dev.upload(&x).unwrap(), dev.upload(&dy).unwrap());
    let (yb, ab, dxb) = (
        dev.alloc(out * 4).unwrap(),
        dev.alloc(out * 4).unwrap(),
        dev.alloc(inp * 4).unwrap(),
    );
    pool::maxpool_forward(dev, &sh, &xb, &yb, &ab).unwrap();
    pool::maxpool_backward(dev, &sh, &dyb, &ab, &dxb).unwrap();
    assert_eq!(dev.download::<f32>(&yb, out).unwrap(), y, "{sh:?}");
    let got: Vec<f32> = dev.download(&dxb, inp).unwrap();
    for (i, (g, w)) in got.iter().zip(&dx).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= 1e-5,
            "{sh:?}: dx[{i}] = {g}, want {w}"
        );
    }
}

fn all(dev: &Device) {
    let sh = |n, h, w, c, win, stride, pad| PoolShape {
        n,
        h,
        w,
        c,
        win,
        stride,
        pad,
    };
    for (i, s) in [
        sh(2, 8, 8, 3, 3, 2, 1),
        sh(1, 7, 9, 5, 3, 2, 1),
        sh(2, 6, 7, 4, 2, 2, 0),
        sh(1, 5, 5, 2, 3, 1, 1),
        sh(3, 4, 4, 1, 1, 1, 0),
    ]
    .into_iter()
    .enumerate()
    {
        maxpool(dev, s, 40 + i as u64);
    }
    // Global average pooling and the residual join.
    let (n, hw, c) = (3, 10, 7);
    let mut r = Lcg(9);
    let x: Vec<f32> = (0..n * hw * c).map(|_| r.f32()).collect();
    let dy: Vec<f32> = (0..n * c).map(|_| r.f32()).collect();
    let (xb, dyb) = (dev.upload(&x).unwrap(), dev.upload(&dy).unwrap());
    let (yb, dxb) = (
        dev.alloc(n * c * 4).unwrap(),
        dev.alloc(n * hw * c * 4).unwrap(),
    );
    pool::global_avgpool_forward(dev, (n, hw, c), &xb, &yb).unwrap();
    pool::global_avgpool_backward(dev, (n, hw, c), &dyb, &dxb).unwrap();
    let y: Vec<f32> = dev.download(&yb, n * c).unwrap();
    let dx: Vec<f32> = dev.download(&dxb, n * hw * c).unwrap();
    for img in 0..n {
        for ch in 0..c {
            let want: f64 = (0..hw)
                .map(|p| x[(img * hw + p) * c + ch] as f64)
                .sum::<f64>()
                / hw as f64;
            assert!(
                (y[img * c + ch] as f64 - want).abs() < 1e-6,
                "gavg y[{img}][{ch}]"
            );
            for p in 0..hw {
                let want = dy[img * c + ch] as f64 / hw as f64;
                assert!(
                    (dx[(img * hw + p) * c + ch] as f64 - want).abs() < 1e-7,
                    "gavg dx"
                );
            }
        }
    }
    let b: Vec<f32> = (0..n * hw * c).map(|_| r.f32()).collect();
    let bb = dev.upload(&b).unwrap();
    let sb = dev.alloc(x.len() * 4).unwrap();
    for relu in [false, true] {
        pool::add(dev, &xb, &bb, &sb, x.len(), relu).unwrap();
        let s: Vec<f32> = dev.download(&sb, x.len()).unwrap();
        for i in 0..x.len() {
            let v = x[i] + b[i];
            assert_eq!(
                s[i],
                if relu { v.max(0.0) } else { v },
                "add relu {relu} [{i}]"
            );
        }
    }
}

/// Dropout draws the CPU layer's masks: the same seed gives the same
/// outputs element for element over two steps, and backward scales by the
/// mask.
fn dropout(dev: &Device) {
    use brgemm_primitives::eltwise::Dropout;
    use brgemm_primitives::init::Rng;
    let n = 10_000;
    let mut r = Lcg(3);
    let x: Vec<f32> = (0..n).map(|_| r.f32()).collect();
    let (p, seed) = (0.3, 77);
    let mut cpu = Dropout::new(p, seed).unwrap();
    let mut keys = Rng::new(seed);
    let (xb, yb, mb, db) = (
        dev.upload(&x).unwrap(),
        dev.alloc(n * 4).unwrap(),
        dev.alloc(n * 4).unwrap(),
        dev.alloc(n * 4).unwrap(),
    );
    for _ in 0..2 {
        let mut want = vec![0.0f32; n];
        cpu.forward_train(brgemm_primitives::Pool::global(), &x, &mut want)
            .unwrap();
        pool::dropout_forward(dev, &xb, &yb, &mb, n, p, keys.next_u64()).unwrap();
        assert_eq!(dev.download::<f32>(&yb, n).unwrap(), want);
    }
    pool::dropout_backward(dev, &xb, &mb, &db, n).unwrap();
    let mut want = vec![0.0f32; n];
    cpu.backward(brgemm_primitives::Pool::global(), &x, &mut want)
        .unwrap();
    assert_eq!(dev.download::<f32>(&db, n).unwrap(), want);
    let e = pool::dropout_forward(dev, &xb, &yb, &mb, n, 1.0, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dropout p = 1"), "{e}");
}

on_devices!(dropout: dropout_matches_the_cpu_masks_on_opencl, dropout_matches_the_cpu_masks_on_cuda);

on_devices!(all: pooling_and_add_match_loops_on_opencl, pooling_and_add_match_loops_on_cuda);

#[test]
fn bad_windows_are_refused_by_name() {
    let Some(dev) = opencl() else { return };
    let sh = PoolShape {
        n: 1,
        h: 4,
        w: 4,
        c: 1,
        win: 2,
        stride: 2,
        pad: 2,
    };
    let b = dev.alloc(64).unwrap();
    let e = pool::maxpool_forward(dev, &sh, &b, &b, &b)
        .unwrap_err()
        .to_string();
    assert!(e.contains("padding 2"), "{e}");
    let sh = PoolShape {
        stride: 0,
        pad: 0,
        ..sh
    };
    let e = pool::maxpool_forward(dev, &sh, &b, &b, &b)
        .unwrap_err()
        .to_string();
    assert!(e.contains("stride = 0"), "{e}");
}
