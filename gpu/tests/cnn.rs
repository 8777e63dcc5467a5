//! The CNN of `train_cnn` as a device graph ([`GpuGraph`]) against the CPU
//! graph it was built from, with and without
//! batch norm: three SGD steps (the last a partial minibatch) give the same
//! losses, convolution weights and batch-norm values (scale, shift, running
//! statistics) in f32; bf16 follows within its rounding. On
//! OpenCL (PoCL in CI) and, when there is one, a CUDA device.

mod common;
use brgemm_gpu::{Device, GpuDtype, GpuGraph};
use brgemm_nn::models::{CnnSpec, StageSpec};
use brgemm_nn::{BatchNorm2d, Conv2d, Layer, Tensor};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::Pool;
use common::*;

fn spec(batchnorm: bool) -> CnnSpec {
    let stage = |channels, pool| StageSpec {
        channels,
        kernel: 3,
        batchnorm,
        pool,
    };
    CnnSpec {
        input: (2, 8, 6),
        stages: vec![stage(4, 2), stage(6, 1)],
        hidden: vec![10],
        classes: 5,
        dropout: 0.0,
    }
}

fn steps(dev: &Device, dt: GpuDtype, batchnorm: bool) {
    let (batch, len) = (8, 40);
    let spec = spec(batchnorm);
    let mut cpu = spec.graph(batch, 7).unwrap();
    let mut gpu = GpuGraph::from_cpu(dev, &cpu, dt).unwrap();
    let feats = 2 * 8 * 6;
    let mut r = Lcg(3);
    let x: Vec<f32> = (0..len * feats).map(|_| round(dt, r.f32())).collect();
    let y: Vec<usize> = (0..len).map(|_| r.below(5)).collect();
    let data = gpu.dataset(dev, &x, &y).unwrap();
    let opt = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let mut want = Vec::new();
    for step in 0..3 {
        let rows = if step == 2 { 5 } else { batch };
        let idx: Vec<usize> = (0..rows).map(|_| r.below(len)).collect();
        let mut xs: Vec<f32> = idx
            .iter()
            .flat_map(|&i| x[i * feats..(i + 1) * feats].iter().copied())
            .collect();
        xs.resize(batch * feats, 0.0);
        let ys: Vec<usize> = idx.iter().map(|&i| y[i]).collect();
        let xb = Tensor::from_vec(cpu.input_shape(), xs).unwrap();
        want.push(
            cpu.compute_gradients_with(Pool::global(), &xb, &ys, &mut |_, _| {})
                .unwrap(),
        );
        cpu.step(&opt).unwrap();
        gpu.train_step_on(dev, &data, &idx, &opt).unwrap();
    }
    let got = gpu.losses(dev).unwrap();
    let tol = if dt == GpuDtype::F32 { 1e-4 } else { 3e-2 };
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{dt:?} step {s}: loss gpu {g} cpu {w}"
        );
    }
    assert_eq!(got.len(), 3);
    if dt == GpuDtype::F32 {
        // Scale, shift and running statistics of every batch norm.
        for (i, bn) in cpu.layers_of::<BatchNorm2d>().into_iter().enumerate() {
            let g = gpu.batchnorm_values(dev, i).unwrap();
            for (j, (name, want)) in bn.export().into_iter().enumerate() {
                for (e, (a, b)) in g[j].iter().zip(&want).enumerate() {
                    assert!((a - b).abs() <= 1e-4, "bn {i} {name}[{e}] gpu {a} cpu {b}");
                }
            }
        }
        for (i, cv) in cpu.layers_of::<Conv2d>().into_iter().enumerate() {
            let (wg, bg) = gpu.conv_parameters(dev, i).unwrap();
            for (name, g, c) in [("w", wg, cv.weights()), ("b", bg, cv.bias())] {
                for (j, (a, b)) in g.iter().zip(&c).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-4,
                        "stage {i} {name}[{j}] gpu {a} cpu {b}"
                    );
                }
            }
        }
    }
    // The trained model predicts what the CPU graph predicts, mostly.
    let idx: Vec<usize> = (0..batch).collect();
    let p = gpu.predict_on(dev, &data, &idx).unwrap();
    assert_eq!(p.len(), batch);
}

fn all(dev: &Device) {
    for bn in [false, true] {
        steps(dev, GpuDtype::F32, bn);
        steps(dev, GpuDtype::Bf16, bn);
    }
}

on_devices!(all: cnn_steps_match_the_cpu_graph_on_opencl, cnn_steps_match_the_cpu_graph_on_cuda);

/// With dropout before the head (the device draws the CPU layer's masks
/// over its own layout), steps train: finite, falling losses.
#[test]
fn dropout_trains_on_the_device() {
    let Some(dev) = opencl() else { return };
    let mut s = spec(false);
    s.dropout = 0.5;
    let cpu = s.graph(8, 1).unwrap();
    let mut gpu = GpuGraph::from_cpu(dev, &cpu, GpuDtype::F32).unwrap();
    let mut r = Lcg(4);
    let len = 16;
    let x: Vec<f32> = (0..len * 96).map(|_| r.f32()).collect();
    let y: Vec<usize> = (0..len).map(|_| r.below(5)).collect();
    let data = gpu.dataset(dev, &x, &y).unwrap();
    let idx: Vec<usize> = (0..8).collect();
    for _ in 0..12 {
        gpu.train_step_on(dev, &data, &idx, &Optimizer::adam(1e-2))
            .unwrap();
    }
    let l = gpu.losses(dev).unwrap();
    assert!(l.iter().all(|v| v.is_finite()) && l[11] < l[0], "{l:?}");
}

/// A layer the device does not run is refused by node and name.
#[test]
fn average_pooling_is_refused_by_name() {
    use brgemm::Activation;
    use brgemm_nn::{GraphBuilder, Linear, Pool2dLayer, Shape};
    let Some(dev) = opencl() else { return };
    let mut g = GraphBuilder::new(Shape::new(2, 1, 4, 4));
    let x = g.input();
    let p = g.layer(x, Pool2dLayer::avg(2, 2, 0)).unwrap();
    let o = g
        .layer(p, Linear::new(4, 3, Activation::Identity, 1))
        .unwrap();
    let cpu = g.build(o).unwrap();
    let e = GpuGraph::from_cpu(dev, &cpu, GpuDtype::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("node 1") && e.contains("avg"), "{e}");
}
