//! The small ResNet (stem, three basic blocks with strided projections,
//! global average pooling, linear head) on the device against its CPU
//! graph: the same losses and convolution weights after SGD steps, and the
//! same predictions with the running statistics. On OpenCL (PoCL in CI)
//! and, when there is one, a CUDA device.

mod common;
use brgemm_gpu::{Device, GpuDtype, GpuGraph};
use brgemm_nn::models::small_resnet;
use brgemm_nn::{Conv2d, Mode, Tensor};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::Pool;
use common::*;

fn steps(dev: &Device) {
    let (batch, len, classes) = (4, 12, 5);
    let mut cpu = small_resnet(batch, classes, 3).unwrap();
    let mut gpu = GpuGraph::from_cpu(dev, &cpu, GpuDtype::F32).unwrap();
    let feats = 28 * 28;
    let mut r = Lcg(17);
    let x: Vec<f32> = (0..len * feats).map(|_| r.f32()).collect();
    let y: Vec<usize> = (0..len).map(|_| r.below(classes)).collect();
    let data = gpu.dataset(dev, &x, &y).unwrap();
    let opt = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let mut want = Vec::new();
    for _ in 0..3 {
        let idx: Vec<usize> = (0..batch).map(|_| r.below(len)).collect();
        let xs: Vec<f32> = idx
            .iter()
            .flat_map(|&i| x[i * feats..(i + 1) * feats].iter().copied())
            .collect();
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
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-3 * w.abs().max(1.0),
            "step {s}: loss gpu {g} cpu {w}"
        );
    }
    for (i, c) in cpu.layers_of::<Conv2d>().into_iter().enumerate() {
        let (gw, gb) = gpu.conv_parameters(dev, i).unwrap();
        for (name, g, c) in [("w", gw, c.weights()), ("b", gb, c.bias())] {
            for (j, (a, b)) in g.iter().zip(&c).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-3,
                    "conv {i} {name}[{j}] gpu {a} cpu {b}"
                );
            }
        }
    }
    // Inference with the running statistics: the CPU graph's predictions.
    let idx: Vec<usize> = (0..batch).collect();
    let xs: Vec<f32> = x[..batch * feats].to_vec();
    let xb = Tensor::from_vec(cpu.input_shape(), xs).unwrap();
    let logits = cpu
        .forward(Pool::global(), &xb, Mode::Eval)
        .unwrap()
        .data()
        .to_vec();
    let want: Vec<usize> = logits
        .chunks(classes)
        .map(|z| (0..classes).fold(0, |b, j| if z[j] > z[b] { j } else { b }))
        .collect();
    assert_eq!(gpu.predict_on(dev, &data, &idx).unwrap(), want);
}

on_devices!(steps: small_resnet_matches_the_cpu_graph_on_opencl, small_resnet_matches_the_cpu_graph_on_cuda);

/// ResNet-50 (at 32x32, one image) is a graph the device runs: every node
/// (the 7x7 stride-2 stem, the 3x3 stride-2 padded max pool, bottlenecks
/// with strided 3x3 and projection shortcuts) is planned without refusal.
#[test]
fn resnet50_is_planned_on_the_device() {
    let Some(dev) = opencl() else { return };
    let cpu = brgemm_nn::models::resnet50(1, 32, 10, 1).unwrap();
    let gpu = GpuGraph::from_cpu(dev, &cpu, GpuDtype::F32).unwrap();
    assert_eq!(gpu.batch(), 1);
    assert!(gpu.conv_parameters(dev, 52).is_ok() && gpu.conv_parameters(dev, 53).is_err());
}
