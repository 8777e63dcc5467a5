//! The GPU convolution's three passes against convolutions written out in
//! f64 on plain NHWC layouts, over odd filter sizes (1, 3, 5 and 3x5),
//! channel counts that are not vector multiples, one and several images,
//! each activation and each GEMM type, on OpenCL (PoCL in CI) and, when
//! there is one, a CUDA device.

mod common;
use brgemm::Activation;
use brgemm_gpu::{ConvShape, Device, GpuConv2d, GpuDtype};
use common::*;

struct Case {
    sh: ConvShape,
    act: Activation,
    dt: GpuDtype,
}

/// x (NHWC), w (tap-major, k x c column-major taps), b, dy.
fn inputs(sh: &ConvShape, dt: GpuDtype, seed: u64) -> [Vec<f32>; 4] {
    let mut r = Lcg(seed);
    let taps = sh.r * sh.s;
    let mut v = |n: usize| (0..n).map(|_| round(dt, r.f32())).collect::<Vec<f32>>();
    [
        v(sh.pixels() * sh.c),
        v(taps * sh.k * sh.c),
        v(sh.k),
        v(sh.out_pixels() * sh.k),
    ]
}

/// The input pixel tap (r, s) of output (img, y, x) reads, if inside.
fn at(sh: &ConvShape, img: usize, y: usize, x: usize, r: usize, s: usize) -> Option<usize> {
    let yy = (y * sh.stride) as isize + r as isize - (sh.r / 2) as isize;
    let xx = (x * sh.stride) as isize + s as isize - (sh.s / 2) as isize;
    (yy >= 0 && xx >= 0 && (yy as usize) < sh.h && (xx as usize) < sh.w)
        .then(|| (img * sh.h + yy as usize) * sh.w + xx as usize)
}

fn check(c: &Case, dev: &Device, seed: u64) {
    let sh = c.sh;
    let [x, w, b, dy] = inputs(&sh, c.dt, seed);
    let (k, ch, taps) = (sh.k, sh.c, sh.r * sh.s);
    // f64 reference: forward, dZ, dX, dW, db.
    let (oh, ow) = sh.out_hw();
    let mut y = vec![0.0f64; sh.out_pixels() * k];
    for img in 0..sh.n {
        for yy in 0..oh {
            for xx in 0..ow {
                let o = (img * oh + yy) * ow + xx;
                for ko in 0..k {
                    let mut acc = b[ko] as f64;
                    for t in 0..taps {
                        if let Some(p) = at(&sh, img, yy, xx, t / sh.s, t % sh.s) {
                            for ci in 0..ch {
                                acc += w[t * k * ch + ko + ci * k] as f64 * x[p * ch + ci] as f64;
                            }
                        }
                    }
                    y[o * k + ko] = act64(c.act, acc);
                }
            }
        }
    }
    let dz: Vec<f64> = y
        .iter()
        .zip(&dy)
        .map(|(&yv, &g)| {
            let g = g as f64;
            match c.act {
                Activation::Relu => {
                    if yv > 0.0 {
                        g
                    } else {
                        0.0
                    }
                }
                Activation::Sigmoid => g * yv * (1.0 - yv),
                Activation::Tanh => g * (1.0 - yv * yv),
                _ => g,
            }
        })
        .collect();
    let mut dx = vec![0.0f64; sh.pixels() * ch];
    let mut dw = vec![0.0f64; taps * k * ch];
    let mut db = vec![0.0f64; k];
    for img in 0..sh.n {
        for yy in 0..oh {
            for xx in 0..ow {
                let o = (img * oh + yy) * ow + xx;
                for ko in 0..k {
                    db[ko] += dz[o * k + ko];
                }
                for t in 0..taps {
                    if let Some(p) = at(&sh, img, yy, xx, t / sh.s, t % sh.s) {
                        for ko in 0..k {
                            for ci in 0..ch {
                                let wi = t * k * ch + ko + ci * k;
                                dx[p * ch + ci] += w[wi] as f64 * dz[o * k + ko];
                                dw[wi] += dz[o * k + ko] * x[p * ch + ci] as f64;
                            }
                        }
                    }
                }
            }
        }
    }
    let mut conv = GpuConv2d::new(dev, sh, c.act, c.dt).unwrap();
    let up = |v: &[f32]| dev.upload(v).unwrap();
    let (xb, wb, bb, dyb) = (up(&x), up(&w), up(&b), up(&dy));
    let mut yb = dev.alloc(sh.out_pixels() * k * 4).unwrap();
    let mut dxb = dev.alloc(sh.pixels() * ch * 4).unwrap();
    let mut dwb = dev.alloc(taps * k * ch * 4).unwrap();
    let mut dbb = dev.alloc(k * 4).unwrap();
    conv.forward(dev, &xb, &wb, &bb, &mut yb).unwrap();
    let yg: Vec<f32> = dev.download(&yb, y.len()).unwrap();
    // bf16 rounds dZ (and nothing else: the inputs are bf16 already).
    let tol = if c.dt == GpuDtype::F32 { 1e-4 } else { 2e-2 };
    let what = format!("{sh:?} {:?} {:?}", c.act, c.dt);
    let close = |name: &str, got: &[f32], want: &[f64], scale: f64| {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= tol * (scale + w.abs()),
                "{what}: {name}[{i}] = {g}, want {w}"
            );
        }
    };
    close("y", &yg, &y, (taps * ch) as f64 * 0.1);
    conv.backward(dev, &dyb, &yb, &wb, Some(&mut dxb)).unwrap();
    conv.update(dev, &mut dwb, &mut dbb).unwrap();
    let n_terms = |n: usize| n as f64 * 0.1;
    close(
        "dx",
        &dev.download(&dxb, dx.len()).unwrap(),
        &dx,
        n_terms(taps * k),
    );
    close(
        "dw",
        &dev.download(&dwb, dw.len()).unwrap(),
        &dw,
        n_terms(sh.pixels()),
    );
    close(
        "db",
        &dev.download(&dbb, k).unwrap(),
        &db,
        n_terms(sh.pixels()),
    );
}

fn cases() -> Vec<Case> {
    let sh = |n, h, w, c, k, r, s, stride| ConvShape {
        n,
        h,
        w,
        c,
        k,
        r,
        s,
        stride,
    };
    let mut v = Vec::new();
    for (i, shape) in [
        sh(1, 5, 7, 1, 4, 3, 3, 1),
        sh(2, 6, 5, 3, 8, 3, 3, 1),
        sh(2, 4, 4, 16, 8, 1, 1, 1),
        sh(1, 7, 6, 5, 3, 5, 5, 1),
        sh(3, 5, 8, 8, 16, 3, 5, 1),
        // Strided, as ResNet's downsampling: 3x3, 1x1 and the 7x7 stem,
        // odd and even sizes.
        sh(2, 7, 6, 4, 8, 3, 3, 2),
        sh(2, 8, 8, 16, 8, 1, 1, 2),
        sh(1, 9, 10, 3, 4, 7, 7, 2),
        sh(1, 7, 7, 2, 3, 3, 3, 3),
    ]
    .into_iter()
    .enumerate()
    {
        for dt in [GpuDtype::F32, GpuDtype::Bf16] {
            let act = [
                Activation::Identity,
                Activation::Relu,
                Activation::Tanh,
                Activation::Sigmoid,
            ][(i + v.len()) % 4];
            v.push(Case { sh: shape, act, dt });
        }
    }
    v
}

fn all(dev: &Device) {
    for (i, c) in cases().iter().enumerate() {
        check(c, dev, 100 + i as u64);
    }
}

on_devices!(all: conv_passes_match_f64_on_opencl, conv_passes_match_f64_on_cuda);

#[test]
fn bad_shapes_are_refused_by_name() {
    let Some(dev) = opencl() else { return };
    let sh = ConvShape {
        n: 1,
        h: 4,
        w: 4,
        c: 2,
        k: 2,
        r: 2,
        s: 3,
        stride: 1,
    };
    let e = GpuConv2d::new(dev, sh, Activation::Relu, GpuDtype::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("r = 2") && e.contains("odd"), "{e}");
    let sh = ConvShape { c: 0, r: 3, ..sh };
    let e = GpuConv2d::new(dev, sh, Activation::Relu, GpuDtype::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("c = 0"), "{e}");
    let e = GpuConv2d::new(
        dev,
        ConvShape {
            c: 2,
            stride: 0,
            ..sh
        },
        Activation::Relu,
        GpuDtype::F32,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("stride = 0"), "{e}");
    let sh = ConvShape { c: 2, ..sh };
    let e = GpuConv2d::new(dev, sh, Activation::Gelu, GpuDtype::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("Gelu"), "{e}");
}
