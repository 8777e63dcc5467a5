//! The device LSTM (and plain RNN) classifier against the CPU graph it was
//! built from:
//! three SGD steps (the last a partial minibatch) give the same losses and
//! the same LSTM weights in f32, and losses within bf16 rounding in bf16.
//! On OpenCL (PoCL in CI) and, when there is one, a CUDA device.

mod common;
use brgemm_gpu::{Device, GpuDtype, GpuSeqNet};
use brgemm_nn::models::SeqSpec;
use brgemm_nn::{Recurrent, Tensor};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{CellKind, Pool};
use common::*;

fn spec(head: Vec<usize>) -> SeqSpec {
    cell_spec(CellKind::Lstm, head)
}

fn cell_spec(kind: CellKind, head: Vec<usize>) -> SeqSpec {
    SeqSpec {
        kind,
        steps: 5,
        features: 6,
        hidden: 12,
        layers: 1,
        bidirectional: false,
        head,
        classes: 4,
    }
}

fn steps(dev: &Device, dt: GpuDtype, head: Vec<usize>) {
    cell_steps(dev, dt, CellKind::Lstm, head)
}

fn cell_steps(dev: &Device, dt: GpuDtype, kind: CellKind, head: Vec<usize>) {
    let (batch, len) = (8, 30);
    let spec = cell_spec(kind, head);
    let (t, f) = (spec.steps, spec.features);
    let mut cpu = spec.graph(batch, 11).unwrap();
    let mut gpu = GpuSeqNet::from_cpu(dev, &cpu, &spec, dt).unwrap();
    let mut r = Lcg(5);
    let x: Vec<f32> = (0..len * t * f).map(|_| round(dt, r.f32())).collect();
    let y: Vec<usize> = (0..len).map(|_| r.below(4)).collect();
    let data = gpu.dataset(dev, &x, &y).unwrap();
    let opt = Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
    };
    let mut want = Vec::new();
    for s in 0..3 {
        let rows = if s == 2 { 3 } else { batch };
        let idx: Vec<usize> = (0..rows).map(|_| r.below(len)).collect();
        // The CPU graph reads (n, features, steps, 1).
        let mut xs = vec![0.0f32; batch * t * f];
        for (row, &i) in idx.iter().enumerate() {
            for st in 0..t {
                for c in 0..f {
                    xs[row * t * f + c * t + st] = x[i * t * f + st * f + c];
                }
            }
        }
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
    assert_eq!(got.len(), 3);
    let tol = if dt == GpuDtype::F32 { 1e-4 } else { 3e-2 };
    for (s, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{dt:?} step {s}: loss gpu {g} cpu {w}"
        );
    }
    if dt == GpuDtype::F32 {
        let cw = cpu.layers_of::<Recurrent>()[0].weights();
        let gw = gpu.lstm_parameters(dev).unwrap();
        for (name, (g, c)) in ["W", "R", "b"].iter().zip(gw.iter().zip(&cw)) {
            for (j, (a, b)) in g.iter().zip(c).enumerate() {
                assert!((a - b).abs() <= 1e-4, "{name}[{j}] gpu {a} cpu {b}");
            }
        }
    }
    let p = gpu
        .predict_on(dev, &data, &(0..batch).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(p.len(), batch);
}

fn all(dev: &Device) {
    steps(dev, GpuDtype::F32, vec![]);
    steps(dev, GpuDtype::F32, vec![7]);
    steps(dev, GpuDtype::Bf16, vec![]);
    cell_steps(dev, GpuDtype::F32, CellKind::Rnn, vec![7]);
    cell_steps(dev, GpuDtype::Bf16, CellKind::Rnn, vec![]);
}

on_devices!(all: lstm_steps_match_the_cpu_graph_on_opencl, lstm_steps_match_the_cpu_graph_on_cuda);

#[test]
fn stacks_are_refused_by_name() {
    let Some(dev) = opencl() else { return };
    let mut s = spec(vec![]);
    s.layers = 2;
    let cpu = s.graph(4, 1).unwrap();
    let e = GpuSeqNet::from_cpu(dev, &cpu, &s, GpuDtype::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("recurrent layers = 2"), "{e}");
}
