//! The MLP training loop on a GPU (or any OpenCL device): the same data,
//! split, shuffles, initial weights and epoch report as [`crate::train`],
//! with forward, loss, backward and optimizer on the device.

use crate::data::Dataset;
use crate::train::{run_epochs, EpochPlan, EpochReport, TrainConfig};
use brgemm_gpu::{Backend, Device, GpuDtype, GpuMlp, Result};
use brgemm_nn::models::LayerSpec;

/// Rows `idx` of `data`, row-major, and their labels.
fn gather(data: &Dataset, idx: &[usize]) -> (Vec<f32>, Vec<usize>) {
    let f = data.features;
    let mut x = Vec::with_capacity(idx.len() * f);
    for &i in idx {
        x.extend_from_slice(&data.x[i * f..(i + 1) * f]);
    }
    (x, idx.iter().map(|&i| data.y[i]).collect())
}

/// Accuracy of `model` on `data`.
pub fn accuracy(model: &mut GpuMlp, dev: &Device, data: &Dataset) -> Result<f64> {
    let batch = model.batch();
    accuracy_in_batches(model, data.len(), batch, |m, chunk| {
        let (x, labels) = gather(data, chunk);
        Ok((m.predict(dev, &x, chunk.len())?, labels))
    })
}

/// Trains on `train` on the device `backend` opens, GEMM inputs in
/// `dtype`, evaluating on `test` after every epoch. The weights start from
/// the CPU model's seeded initialisation ([`crate::train::build`]).
pub fn train(
    cfg: &TrainConfig,
    backend: Backend,
    dtype: GpuDtype,
    train: &Dataset,
    test: &Dataset,
    mut report: impl FnMut(&EpochReport),
) -> Result<(GpuMlp, Device)> {
    let dev = Device::open(backend)?;
    let mut cpu_cfg = cfg.clone();
    cpu_cfg.bf16 = false;
    let cpu = crate::train::build(&cpu_cfg, train).map_err(|e| brgemm_gpu::Error::Invalid {
        what: "model".into(),
        value: format!("{:?}", cfg.hidden),
        why: e.to_string(),
    })?;
    let specs = LayerSpec::classifier(&cfg.hidden, train.classes);
    let mut model = GpuMlp::from_cpu(&dev, &cpu, &specs, dtype)?;
    let plan = EpochPlan {
        epochs: cfg.epochs,
        len: train.len(),
        batch: cfg.batch,
        whole_batches: false,
        seed: cfg.seed ^ 0x5eed,
    };
    run_epochs(
        &mut model,
        plan,
        |m, chunk, index| {
            let (x, labels) = gather(train, chunk);
            let loss = m.train_step(&dev, &x, &labels, &cfg.optimizer)?;
            // The gradients stay on the device: the loss is what is checked
            // (a non-finite gradient makes the next step's loss non-finite).
            if cfg.check_finite && !loss.is_finite() {
                return Err(brgemm_gpu::Error::Invalid {
                    what: format!("loss at step {index}"),
                    value: loss.to_string(),
                    why: "not finite: training stopped".into(),
                });
            }
            Ok(loss)
        },
        |m| accuracy(m, &dev, test),
        &mut report,
    )?;
    Ok((model, dev))
}

/// Share of right predictions over `len` items in chunks of `batch`;
/// `predict(model, chunk)` returns the predictions and the labels.
fn accuracy_in_batches<M, E>(
    model: &mut M,
    len: usize,
    batch: usize,
    mut predict: impl FnMut(&mut M, &[usize]) -> std::result::Result<(Vec<usize>, Vec<usize>), E>,
) -> std::result::Result<f64, E> {
    let idx: Vec<usize> = (0..len).collect();
    let mut right = 0usize;
    for chunk in idx.chunks(batch) {
        let (pred, labels) = predict(model, chunk)?;
        right += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(right as f64 / len.max(1) as f64)
}
