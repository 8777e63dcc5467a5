//! GPU FC passes against an f64 reference, and GPU MLP training steps
//! against the CPU primitives, on OpenCL (CI) and on CUDA when present.

mod common;
use brgemm::Activation;
use brgemm_gpu::{Device, GpuDataset, GpuDtype, GpuFc, GpuMlp};
use brgemm_nn::models::{mlp, LayerSpec};
use brgemm_nn::{Linear, Tensor};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::Pool;
use common::*;

fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g as f64 - w).abs() <= tol * scale,
            "{what}[{i}] = {g}, want {w} (tol {tol} x {scale})"
        );
    }
}

fn fc_passes(dev: &Device, dt: GpuDtype, act: Activation) {
    // c = 320 and n = 288 reduce over two blocks each; k = 45 is no
    // multiple of anything.
    let (c, k, n) = (320, 45, 288);
    let mut r = Lcg(5);
    let x: Vec<f32> = (0..c * n).map(|_| round(dt, r.f32())).collect();
    let w: Vec<f32> = (0..k * c).map(|_| round(dt, r.f32() * 0.1)).collect();
    let b: Vec<f32> = (0..k).map(|_| r.f32()).collect();
    let dy: Vec<f32> = (0..k * n).map(|_| r.f32()).collect();
    let mut fc = GpuFc::new(dev, c, k, n, act, dt).unwrap();
    let (xb, wb, bb, dyb) = (
        dev.upload(&x).unwrap(),
        dev.upload(&w).unwrap(),
        dev.upload(&b).unwrap(),
        dev.upload(&dy).unwrap(),
    );
    let mut y = dev.alloc(k * n * 4).unwrap();
    let mut dx = dev.alloc(c * n * 4).unwrap();
    let mut dw = dev.alloc(k * c * 4).unwrap();
    let mut db = dev.alloc(k * 4).unwrap();
    fc.forward(dev, &xb, &wb, &bb, &mut y).unwrap();
    fc.backward(dev, &dyb, &y, &wb, Some(&mut dx)).unwrap();
    fc.update(dev, &xb, &mut dw, &mut db).unwrap();
    let y: Vec<f32> = dev.download(&y, k * n).unwrap();
    // f64 reference (column-major: x(cc, j) at cc + j*c, w(kk, cc) at kk + cc*k).
    let mut yr = vec![0.0f64; k * n];
    for j in 0..n {
        for kk in 0..k {
            let s: f64 = (0..c)
                .map(|cc| w[kk + cc * k] as f64 * x[cc + j * c] as f64)
                .sum();
            yr[kk + j * k] = act64(act, s + b[kk] as f64);
        }
    }
    let tol = if dt == GpuDtype::F32 { 1e-5 } else { 2e-2 };
    close(&format!("{dt:?} {act:?} y"), &y, &yr, tol);
    // Backward from the device's y (what the layer differentiates).
    let dz: Vec<f64> = (0..k * n)
        .map(|i| {
            let yi = y[i] as f64;
            let d = match act {
                Activation::Relu => (yi > 0.0) as u8 as f64,
                Activation::Sigmoid => yi * (1.0 - yi),
                Activation::Tanh => 1.0 - yi * yi,
                _ => 1.0,
            };
            dy[i] as f64 * d
        })
        .collect();
    let dzr: Vec<f64> = dz.iter().map(|&v| round(dt, v as f32) as f64).collect();
    let mut dxr = vec![0.0f64; c * n];
    for j in 0..n {
        for cc in 0..c {
            dxr[cc + j * c] = (0..k)
                .map(|kk| w[kk + cc * k] as f64 * dzr[kk + j * k])
                .sum();
        }
    }
    close(
        &format!("{dt:?} {act:?} dx"),
        &dev.download(&dx, c * n).unwrap(),
        &dxr,
        tol,
    );
    let mut dwr = vec![0.0f64; k * c];
    for cc in 0..c {
        for kk in 0..k {
            dwr[kk + cc * k] = (0..n).map(|j| dzr[kk + j * k] * x[cc + j * c] as f64).sum();
        }
    }
    close(
        &format!("{dt:?} {act:?} dw"),
        &dev.download(&dw, k * c).unwrap(),
        &dwr,
        tol,
    );
    let dbr: Vec<f64> = (0..k)
        .map(|kk| (0..n).map(|j| dz[kk + j * k]).sum())
        .collect();
    close(
        &format!("{dt:?} {act:?} db"),
        &dev.download(&db, k).unwrap(),
        &dbr,
        1e-5,
    );
}

fn mlp_steps(dev: &Device, dt: GpuDtype, opt: Optimizer) {
    let (inputs, batch) = (64, 32);
    let specs = LayerSpec::classifier(&[40, 24], 10);
    let mut cpu = mlp(inputs, batch, &specs, 3).unwrap();
    let mut gpu = GpuMlp::from_cpu(dev, &cpu, &specs, dt).unwrap();
    let pool = Pool::global();
    let mut r = Lcg(9);
    for step in 0..3 {
        // The last step is a partial minibatch (rows < batch).
        let rows = if step == 2 { 19 } else { batch };
        let x: Vec<f32> = (0..rows * inputs).map(|_| r.f32()).collect();
        let labels: Vec<usize> = (0..rows).map(|_| r.below(10)).collect();
        let mut padded = x.clone();
        padded.resize(batch * inputs, 0.0);
        let xb = Tensor::from_vec(cpu.input_shape(), padded).unwrap();
        let lc = cpu
            .compute_gradients_with(pool, &xb, &labels, &mut |_, _| {})
            .unwrap();
        cpu.step(&opt).unwrap();
        let lg = gpu.train_step(dev, &x, &labels, &opt).unwrap();
        let tol = if dt == GpuDtype::F32 { 1e-4 } else { 3e-2 };
        assert!(
            (lc - lg).abs() <= tol * lc.abs().max(1.0),
            "{dt:?} step {step}: loss cpu {lc} gpu {lg}"
        );
    }
    if dt == GpuDtype::F32 {
        for (i, l) in cpu.layers_of::<Linear>().into_iter().enumerate() {
            let (wc, bc) = (l.weights(), l.bias());
            let (wg, bg) = gpu.parameters(dev, i).unwrap();
            let wc: Vec<f64> = wc.iter().map(|&v| v as f64).collect();
            let bc: Vec<f64> = bc.iter().map(|&v| v as f64).collect();
            close(&format!("layer {i} w after 3 steps"), &wg, &wc, 1e-4);
            close(&format!("layer {i} b after 3 steps"), &bg, &bc, 1e-4);
        }
    }
}

/// Every layer's dW and db from one device backward pass against the CPU
/// CPU graph's (`nn::models::mlp`), hidden layers sigmoid and tanh.
fn mlp_gradients(dev: &Device) {
    let (inputs, batch) = (37, 24);
    let specs = [
        LayerSpec {
            out: 29,
            act: Activation::Sigmoid,
        },
        LayerSpec {
            out: 18,
            act: Activation::Tanh,
        },
        LayerSpec {
            out: 7,
            act: Activation::Identity,
        },
    ];
    let mut cpu = mlp(inputs, batch, &specs, 11).unwrap();
    let mut gpu = GpuMlp::from_cpu(dev, &cpu, &specs, GpuDtype::F32).unwrap();
    let mut r = Lcg(4);
    let rows = 21;
    let x: Vec<f32> = (0..rows * inputs).map(|_| r.f32()).collect();
    let labels: Vec<usize> = (0..rows).map(|_| r.below(7)).collect();
    let mut padded = x.clone();
    padded.resize(batch * inputs, 0.0);
    let xb = Tensor::from_vec(cpu.input_shape(), padded).unwrap();
    let lc = cpu
        .compute_gradients_with(Pool::global(), &xb, &labels, &mut |_, _| {})
        .unwrap();
    let lg = gpu.compute_gradients(dev, &x, &labels).unwrap();
    assert!(
        (lc - lg).abs() <= 1e-5 * lc.abs().max(1.0),
        "loss cpu {lc} gpu {lg}"
    );
    for (i, l) in cpu.layers_of::<Linear>().into_iter().enumerate() {
        let (wc, bc) = l.gradients();
        let (wg, bg) = gpu.gradients(dev, i).unwrap();
        let f = |v: Vec<f32>| v.into_iter().map(|x| x as f64).collect::<Vec<f64>>();
        close(&format!("layer {i} dW"), &wg, &f(wc), 1e-4);
        close(&format!("layer {i} db"), &bg, &f(bc), 1e-4);
    }
}

/// Steps on a device data set (indices only, losses read once after 20
/// steps, past the 16-step ring) give the same losses and weights, bit for
/// bit, as the same steps with host-uploaded minibatches; bad indices,
/// widths and labels are refused by name.
fn device_data_steps(dev: &Device) {
    let (inputs, batch, len) = (64, 32, 300);
    let specs = LayerSpec::classifier(&[40], 10);
    let cpu = mlp(inputs, batch, &specs, 5).unwrap();
    let mut host = GpuMlp::from_cpu(dev, &cpu, &specs, GpuDtype::Bf16).unwrap();
    let mut on = GpuMlp::from_cpu(dev, &cpu, &specs, GpuDtype::Bf16).unwrap();
    let mut r = Lcg(21);
    let x: Vec<f32> = (0..len * inputs).map(|_| r.f32()).collect();
    let y: Vec<usize> = (0..len).map(|_| r.below(10)).collect();
    let data = GpuDataset::upload(dev, &x, &y, inputs).unwrap();
    let opt = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let mut want = Vec::new();
    for step in 0..20 {
        let rows = if step % 7 == 6 { 13 } else { batch };
        let idx: Vec<usize> = (0..rows).map(|_| r.below(len)).collect();
        let xs: Vec<f32> = idx
            .iter()
            .flat_map(|&i| x[i * inputs..(i + 1) * inputs].iter().copied())
            .collect();
        let ys: Vec<usize> = idx.iter().map(|&i| y[i]).collect();
        want.push(host.train_step(dev, &xs, &ys, &opt).unwrap());
        on.train_step_on(dev, &data, &idx, &opt).unwrap();
    }
    assert_eq!(on.losses(dev).unwrap(), want);
    assert!(on.losses(dev).unwrap().is_empty(), "taken once");
    for i in 0..2 {
        assert_eq!(
            on.parameters(dev, i).unwrap(),
            host.parameters(dev, i).unwrap()
        );
    }
    let idx: Vec<usize> = (0..batch).collect();
    assert_eq!(
        on.predict_on(dev, &data, &idx).unwrap(),
        host.predict(dev, &x[..batch * inputs], batch).unwrap()
    );
    let e = |r: brgemm_gpu::Result<()>| r.unwrap_err().to_string();
    let s = e(on.train_step_on(dev, &data, &[0, 300], &opt));
    assert!(
        s.contains("idx[1] = 300") && s.contains("300 samples"),
        "{s}"
    );
    assert!(e(on.train_step_on(dev, &data, &[], &opt)).contains("minibatch = 0"));
    let narrow = GpuDataset::upload(dev, &x[..10 * 8], &y[..10], 8).unwrap();
    assert!(e(on.train_step_on(dev, &narrow, &[0], &opt)).contains("features = 8"));
    let labels11 = GpuDataset::upload(dev, &x[..inputs], &[11], inputs).unwrap();
    assert!(e(on.train_step_on(dev, &labels11, &[0], &opt)).contains("labels = 11"));
    let s = GpuDataset::upload(dev, &x[..5], &y[..1], inputs)
        .err()
        .unwrap()
        .to_string();
    assert!(s.contains("5 values, 1 labels"), "{s}");
}

fn all(dev: &Device) {
    mlp_gradients(dev);
    device_data_steps(dev);
    for dt in [GpuDtype::F32, GpuDtype::Bf16, GpuDtype::F16] {
        for act in [
            Activation::Identity,
            Activation::Relu,
            Activation::Sigmoid,
            Activation::Tanh,
        ] {
            fc_passes(dev, dt, act);
        }
    }
    let sgd = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    mlp_steps(dev, GpuDtype::F32, sgd);
    mlp_steps(dev, GpuDtype::Bf16, sgd);
    // Adam's first steps are sign-like for tiny gradients, so the weights
    // are compared under SGD; Adam is checked through the losses.
    mlp_steps(dev, GpuDtype::F32, Optimizer::adam(1e-3));
}

on_devices!(all: fc_and_mlp_on_opencl, fc_and_mlp_on_cuda);

#[test]
fn gelu_is_refused_with_its_name() {
    let Some(dev) = opencl() else { return };
    let e = GpuFc::new(dev, 8, 8, 8, Activation::Gelu, GpuDtype::F32)
        .err()
        .unwrap();
    assert!(e.to_string().contains("activation = Gelu"), "{e}");
}
