//! The MLP training loop on a GPU (or any OpenCL device): the same data,
//! split, shuffles, initial weights and epoch report as [`crate::train`],
//! with forward, loss, backward and optimizer on the device. The training
//! and test sets are uploaded once; a step sends only its minibatch's
//! indices, and the host reads the losses every
//! [`GpuMlp::LOSS_WINDOW`] steps and at each epoch's end (so a non-finite
//! loss stops the run within that many steps). [`train_cnn`] does the same
//! for the CNN of [`crate::train_cnn`].

use crate::data::{Dataset, ImageSet};
use crate::train::{run_epochs, EpochPlan, EpochReport, TrainConfig};
use brgemm_gpu::{Backend, Device, GpuCnn, GpuDataset, GpuDtype, GpuMlp, Result};
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
    device_epochs(
        &mut model,
        plan,
        cfg.check_finite,
        |m, chunk| m.train_step_on(&dev, &train_d, chunk, &cfg.optimizer),
        |m| m.losses(&dev),
        |m| accuracy_on(m, &dev, test, &test_d),
        &mut report,
    )?;
    Ok((model, dev))
}

/// The epoch loop of a device model: `step` runs a minibatch and leaves
/// its loss on the device; `losses` reads them (one blocking copy) every
/// [`GpuMlp::LOSS_WINDOW`] steps and at each epoch's end, and the loop
/// hands [`run_epochs`] their sum (its mean then counts every step). With
/// `check_finite`, a non-finite loss stops the run, naming its step.
fn device_epochs<M>(
    model: &mut M,
    plan: EpochPlan,
    check_finite: bool,
    mut step: impl FnMut(&mut M, &[usize]) -> Result<()>,
    mut losses: impl FnMut(&mut M) -> Result<Vec<f32>>,
    evaluate: impl FnMut(&mut M) -> Result<f64>,
    report: &mut dyn FnMut(&EpochReport),
) -> Result<()> {
    let b = plan.batch.max(1);
    let steps = if plan.whole_batches {
        plan.len / b
    } else {
        plan.len.div_ceil(b)
    };
    let steps_per_epoch = steps.max(1) as u64;
    run_epochs(
        model,
        plan,
        |m, chunk, index| {
            step(m, chunk)?;
            let done = index + 1;
            if done % GpuMlp::LOSS_WINDOW as u64 != 0 && done % steps_per_epoch != 0 {
                return Ok(0.0);
            }
            let ls = losses(m)?;
            if check_finite {
                if let Some((i, l)) = ls.iter().enumerate().find(|(_, l)| !l.is_finite()) {
                    return Err(brgemm_gpu::Error::Invalid {
                        what: format!("loss at step {}", done - ls.len() as u64 + i as u64),
                        value: l.to_string(),
                        why: "not finite: training stopped".into(),
                    });
                }
            }
            Ok(ls.iter().sum())
        },
        evaluate,
        report,
    )
}

/// Trains the CNN of `cfg` ([`crate::train_cnn::build`]'s network, from
/// its seeded weights) on the device `backend` opens, GEMM inputs in
/// `dtype`, evaluating on `test` after every epoch. Batch norm and dropout
/// are not on the device yet (refused by name).
pub fn train_cnn(
    cfg: &crate::train_cnn::CnnConfig,
    backend: Backend,
    dtype: GpuDtype,
    train: &ImageSet,
    test: &ImageSet,
    mut report: impl FnMut(&EpochReport),
) -> Result<(GpuCnn, Device)> {
    let dev = Device::open(backend)?;
    let spec = crate::train_cnn::spec(cfg, train);
    let cpu = spec
        .graph(cfg.batch, cfg.seed)
        .map_err(|e| brgemm_gpu::Error::Invalid {
            what: "model".into(),
            value: format!("{:?}", cfg.stages),
            why: e.to_string(),
        })?;
    let mut model = GpuCnn::from_cpu(&dev, &cpu, &spec, dtype)?;
    let train_d = model.dataset(&dev, &train.data.x, &train.data.y)?;
    let test_d = model.dataset(&dev, &test.data.x, &test.data.y)?;
    // The CPU CNN's loop: its shuffle seed, whole minibatches only.
    let plan = EpochPlan {
        epochs: cfg.epochs,
        len: train.data.len(),
        batch: cfg.batch,
        whole_batches: true,
        seed: cfg.seed ^ 0xc22,
    };
    let batch = model.batch();
    device_epochs(
        &mut model,
        plan,
        cfg.check_finite,
        |m, chunk| m.train_step_on(&dev, &train_d, chunk, &cfg.optimizer),
        |m| m.losses(&dev),
        |m| {
            accuracy_in_batches(m, test.data.len(), batch, |m, chunk| {
                let labels = chunk.iter().map(|&i| test.data.y[i]).collect();
                Ok((m.predict_on(&dev, &test_d, chunk)?, labels))
            })
        },
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
