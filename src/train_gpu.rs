//! The training loops on a GPU (or any OpenCL device) for the MLP
//! ([`train`]), the CNN ([`train_cnn`]) and the sequence classifier
//! ([`train_lstm`]): the same data, split, shuffles, initial weights and
//! epoch report as their CPU loops, with forward, loss, backward and
//! optimizer on the device. The training and test sets are uploaded once; a
//! step sends only its minibatch's indices, and the host reads the losses
//! every [`GpuMlp::LOSS_WINDOW`] steps and at each epoch's end (so a
//! non-finite loss stops the run within that many steps).

use crate::data::{Dataset, ImageSet};
use crate::train::{run_epochs, EpochPlan, EpochReport, TrainConfig};
use brgemm_gpu::{Backend, Device, GpuDataset, GpuDtype, GpuGraph, GpuMlp, GpuSeqNet, Result};
use brgemm_nn::models::LayerSpec;
use brgemm_primitives::optim::Optimizer;

/// What the device loop needs of a model.
trait DeviceModel {
    fn batch(&self) -> usize;
    fn step_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
        opt: &Optimizer,
    ) -> Result<()>;
    fn read_losses(&mut self, dev: &Device) -> Result<Vec<f32>>;
    fn predict(&mut self, dev: &Device, data: &GpuDataset, idx: &[usize]) -> Result<Vec<usize>>;
}

macro_rules! device_model {
    ($t:ty) => {
        impl DeviceModel for $t {
            fn batch(&self) -> usize {
                <$t>::batch(self)
            }
            fn step_on(
                &mut self,
                dev: &Device,
                data: &GpuDataset,
                idx: &[usize],
                opt: &Optimizer,
            ) -> Result<()> {
                self.train_step_on(dev, data, idx, opt)
            }
            fn read_losses(&mut self, dev: &Device) -> Result<Vec<f32>> {
                self.losses(dev)
            }
            fn predict(
                &mut self,
                dev: &Device,
                data: &GpuDataset,
                idx: &[usize],
            ) -> Result<Vec<usize>> {
                self.predict_on(dev, data, idx)
            }
        }
    };
}
device_model!(GpuMlp);
device_model!(GpuGraph);
device_model!(GpuSeqNet);

/// Accuracy of `model` on the device data set `on_dev`, whose labels are
/// `labels`.
fn accuracy_on(
    model: &mut impl DeviceModel,
    dev: &Device,
    labels: &[usize],
    on_dev: &GpuDataset,
) -> Result<f64> {
    let batch = model.batch();
    accuracy_in_batches(model, labels.len(), batch, |m, chunk| {
        let want = chunk.iter().map(|&i| labels[i]).collect();
        Ok((m.predict(dev, on_dev, chunk)?, want))
    })
}

/// The epoch loop of a device model over the device data sets: each step
/// leaves its loss on the device; the losses are read (one blocking copy)
/// every [`GpuMlp::LOSS_WINDOW`] steps and at each epoch's end, and their
/// sum goes to [`run_epochs`] (its mean then counts every step). With
/// `check_finite`, a non-finite loss stops the run, naming its step.
#[allow(clippy::too_many_arguments)]
fn fit_on_device(
    model: &mut impl DeviceModel,
    dev: &Device,
    train: &GpuDataset,
    test: (&GpuDataset, &[usize]),
    plan: EpochPlan,
    opt: &Optimizer,
    check_finite: bool,
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
            m.step_on(dev, train, chunk, opt)?;
            let done = index + 1;
            if done % GpuMlp::LOSS_WINDOW as u64 != 0 && done % steps_per_epoch != 0 {
                return Ok(0.0);
            }
            let ls = m.read_losses(dev)?;
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
        |m| accuracy_on(m, dev, test.1, test.0),
        report,
    )
}

/// [`fit_on_device`] over the uploaded (train, test) `data`, `labels`
/// being the test set's, with the optimizer and the finite-loss check of
/// `guard`: the tail every model's `train_*` shares.
fn fit_model(
    model: &mut impl DeviceModel,
    dev: &Device,
    data: (GpuDataset, GpuDataset),
    labels: &[usize],
    plan: EpochPlan,
    (opt, check_finite): (&Optimizer, bool),
    report: &mut dyn FnMut(&EpochReport),
) -> Result<()> {
    let test = (&data.1, labels);
    fit_on_device(model, dev, &data.0, test, plan, opt, check_finite, report)
}

fn model_error(value: String) -> impl FnOnce(brgemm_nn::Error) -> brgemm_gpu::Error {
    move |e| brgemm_gpu::Error::Invalid {
        what: "model".into(),
        value,
        why: e.to_string(),
    }
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
    let cpu =
        crate::train::build(&cpu_cfg, train).map_err(model_error(format!("{:?}", cfg.hidden)))?;
    let specs = LayerSpec::classifier(&cfg.hidden, train.classes);
    let mut model = GpuMlp::from_cpu(&dev, &cpu, &specs, dtype)?;
    let plan = EpochPlan {
        epochs: cfg.epochs,
        len: train.len(),
        batch: cfg.batch,
        whole_batches: false,
        seed: cfg.seed ^ 0x5eed,
    };
    let data = (
        GpuDataset::upload(&dev, &train.x, &train.y, train.features)?,
        GpuDataset::upload(&dev, &test.x, &test.y, test.features)?,
    );
    let guard = (&cfg.optimizer, cfg.check_finite);
    fit_model(&mut model, &dev, data, &test.y, plan, guard, &mut report)?;
    Ok((model, dev))
}

/// Trains the CNN of `cfg` ([`crate::train_cnn::build`]'s network, from
/// its seeded weights) on the device `backend` opens, GEMM inputs in
/// `dtype`, walking the data as the CPU loop does (its shuffle seed, whole
/// minibatches), evaluating on `test` after every epoch (batch norm with
/// its running statistics; dropout draws the CPU layer's masks over the
/// device's NHWC layout).
pub fn train_cnn(
    cfg: &crate::train_cnn::CnnConfig,
    backend: Backend,
    dtype: GpuDtype,
    train: &ImageSet,
    test: &ImageSet,
    mut report: impl FnMut(&EpochReport),
) -> Result<(GpuGraph, Device)> {
    let dev = Device::open(backend)?;
    let spec = crate::train_cnn::spec(cfg, train);
    let cpu = spec
        .graph(cfg.batch, cfg.seed)
        .map_err(model_error(format!("{:?}", cfg.stages)))?;
    let mut model = GpuGraph::from_cpu(&dev, &cpu, dtype)?;
    let data = (
        model.dataset(&dev, &train.data.x, &train.data.y)?,
        model.dataset(&dev, &test.data.x, &test.data.y)?,
    );
    let plan = EpochPlan {
        epochs: cfg.epochs,
        len: train.data.len(),
        batch: cfg.batch,
        whole_batches: true,
        seed: cfg.seed ^ 0xc22,
    };
    let guard = (&cfg.optimizer, cfg.check_finite);
    fit_model(
        &mut model,
        &dev,
        data,
        &test.data.y,
        plan,
        guard,
        &mut report,
    )?;
    Ok((model, dev))
}

/// Trains the sequence classifier of `cfg` ([`crate::train_lstm::build`]'s
/// network, from its seeded weights; one unidirectional LSTM or RNN layer) on the
/// device `backend` opens, reading images row by row, GEMM inputs in
/// `dtype`, walking the data as the CPU loop does, evaluating on `test`
/// after every epoch.
pub fn train_lstm(
    cfg: &crate::train_lstm::SeqConfig,
    backend: Backend,
    dtype: GpuDtype,
    train: &Dataset,
    test: &Dataset,
    mut report: impl FnMut(&EpochReport),
) -> Result<(GpuSeqNet, Device)> {
    let dev = Device::open(backend)?;
    let what = format!("{:?} x {}", cfg.kind, cfg.hidden);
    let spec = crate::train_lstm::spec(cfg, train).map_err(model_error(what.clone()))?;
    let cpu = spec.graph(cfg.batch, cfg.seed).map_err(model_error(what))?;
    let mut model = GpuSeqNet::from_cpu(&dev, &cpu, &spec, dtype)?;
    let data = (
        model.dataset(&dev, &train.x, &train.y)?,
        model.dataset(&dev, &test.x, &test.y)?,
    );
    let plan = EpochPlan {
        epochs: cfg.epochs,
        len: train.len(),
        batch: cfg.batch,
        whole_batches: false,
        seed: cfg.seed ^ 0x157,
    };
    let guard = (&cfg.optimizer, cfg.check_finite);
    fit_model(&mut model, &dev, data, &test.y, plan, guard, &mut report)?;
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
