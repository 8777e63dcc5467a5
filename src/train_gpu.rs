//! The MLP training loop on a GPU (or any OpenCL device): the same data,
//! split, shuffles, initial weights and epoch report as [`crate::train`],
//! with forward, loss, backward and optimizer on the device. The training
//! and test sets are uploaded once; a step sends only its minibatch's
//! indices, and the host reads the losses every
//! [`GpuMlp::LOSS_WINDOW`] steps and at each epoch's end (so a non-finite
//! loss stops the run within that many steps).

use crate::data::Dataset;
use crate::train::{run_epochs, EpochPlan, EpochReport, TrainConfig};
use brgemm_gpu::{Backend, Device, GpuDataset, GpuDtype, GpuMlp, Result};
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

/// Accuracy of `model` on `data` (uploaded to the device as `on_dev`).
fn accuracy_on(
    model: &mut GpuMlp,
    dev: &Device,
    data: &Dataset,
    on_dev: &GpuDataset,
) -> Result<f64> {
    let batch = model.batch();
    accuracy_in_batches(model, data.len(), batch, |m, chunk| {
        let labels = chunk.iter().map(|&i| data.y[i]).collect();
        Ok((m.predict_on(dev, on_dev, chunk)?, labels))
    })
}

/// Accuracy of `model` on `data`, uploaded minibatch by minibatch.
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
    let (train_d, test_d) = (
        GpuDataset::upload(&dev, &train.x, &train.y, train.features)?,
        GpuDataset::upload(&dev, &test.x, &test.y, test.features)?,
    );
    let steps_per_epoch = train.len().div_ceil(cfg.batch.max(1)) as u64;
    run_epochs(
        &mut model,
        plan,
        |m, chunk, index| {
            m.train_step_on(&dev, &train_d, chunk, &cfg.optimizer)?;
            // The losses wait on the device: read them (one blocking copy)
            // every LOSS_WINDOW steps and at the epoch's end, and hand the
            // epoch loop their sum (its mean then counts every step).
            let done = index + 1;
            if done % GpuMlp::LOSS_WINDOW as u64 != 0 && done % steps_per_epoch != 0 {
                return Ok(0.0);
            }
            let losses = m.losses(&dev)?;
            if cfg.check_finite {
                if let Some((i, l)) = losses.iter().enumerate().find(|(_, l)| !l.is_finite()) {
                    return Err(brgemm_gpu::Error::Invalid {
                        what: format!("loss at step {}", done - losses.len() as u64 + i as u64),
                        value: l.to_string(),
                        why: "not finite: training stopped".into(),
                    });
                }
            }
            Ok(losses.iter().sum())
        },
        |m| accuracy_on(m, &dev, test, &test_d),
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
