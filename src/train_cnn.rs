//! The CNN training loop shared by `examples/train_cnn` and the tests.

use crate::data::ImageSet;
use crate::train::EpochReport;
use brgemm_nn::models::{Cnn, CnnSpec, StageSpec, Trainable};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Pool, Result, Tensor4};

/// What to train, and how.
#[derive(Debug, Clone)]
pub struct CnnConfig {
    /// Convolution stages.
    pub stages: Vec<StageSpec>,
    /// Hidden FC widths (ReLU); the output layer is added.
    pub hidden: Vec<usize>,
    /// Dropout before the FC head.
    pub dropout: f32,
    /// Minibatch.
    pub batch: usize,
    /// Passes over the training set.
    pub epochs: usize,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Seed of the weights, shuffles and dropout masks.
    pub seed: u64,
    /// Stop when a step's loss or gradient norm is not finite (default;
    /// see [`crate::train::TrainConfig::check_finite`]).
    pub check_finite: bool,
}

impl Default for CnnConfig {
    /// Two stages of 3x3 conv + ReLU + 2x2 max pooling (32 and 64
    /// channels), FC 128 + ReLU, FC to the classes; Adam 1e-3, minibatch 64.
    fn default() -> Self {
        let stage = |channels| StageSpec {
            channels,
            kernel: 3,
            batchnorm: false,
            pool: 2,
        };
        CnnConfig {
            stages: vec![stage(32), stage(64)],
            hidden: vec![128],
            dropout: 0.0,
            batch: 64,
            epochs: 3,
            optimizer: Optimizer::adam(1e-3),
            seed: 1,
            check_finite: true,
        }
    }
}

/// Plans the network of `cfg` for images like `data`'s.
pub fn build(cfg: &CnnConfig, data: &ImageSet) -> Result<Cnn> {
    Cnn::new(
        &CnnSpec {
            input: data.dims,
            stages: cfg.stages.clone(),
            hidden: cfg.hidden.clone(),
            classes: data.data.classes,
            dropout: cfg.dropout,
        },
        cfg.batch,
        cfg.seed,
    )
}

/// Writes images `idx` into the first images of `x` (the rest zeroed) and
/// returns their labels.
pub fn fill_images(set: &ImageSet, idx: &[usize], x: &mut Tensor4) -> Vec<usize> {
    let f = set.data.features;
    x.data_mut().fill(0.0);
    for (r, &i) in idx.iter().enumerate() {
        let img = &set.data.x[i * f..][..f];
        for c in 0..x.c() {
            for p in 0..x.h() * x.w() {
                let at = x.index(r, c, p / x.w(), p % x.w());
                x.data_mut()[at] = img[c * x.h() * x.w() + p];
            }
        }
    }
    idx.iter().map(|&i| set.data.y[i]).collect()
}

/// Accuracy of `model` on `set` (inference mode), in minibatches.
pub fn accuracy(model: &mut Cnn, pool: &Pool, set: &ImageSet) -> Result<f64> {
    let mut x = model.input_tensor();
    let batch = model.batch();
    crate::train::accuracy_in_batches(model, set.data.len(), batch, |m, chunk| {
        let labels = fill_images(set, chunk, &mut x);
        Ok((m.predict(pool, &x, chunk.len())?, labels))
    })
}

/// Trains on `train`, evaluating on `test` after each epoch; `report` sees
/// every epoch. Each epoch is a new shuffle in whole minibatches (the last
/// partial one is left out: batch-norm statistics need a full batch).
pub fn train(
    cfg: &CnnConfig,
    pool: &Pool,
    train: &ImageSet,
    test: &ImageSet,
    report: impl FnMut(&EpochReport),
) -> Result<Cnn> {
    cfg.optimizer.validate()?;
    let model = build(cfg, train)?;
    train_model(cfg, pool, model, train, test, report)
}

/// An error unless `model` reads `data`'s images and predicts its classes.
pub fn check_fits(model: &Cnn, data: &ImageSet) -> Result<()> {
    let s = model.spec();
    crate::train::check_widths(
        (format!("{:?}", s.input), s.classes),
        (format!("{:?}", data.dims), data.data.classes),
    )
}

/// [`train`] from a given model (e.g. one loaded to resume): its input
/// geometry and classes must match the data; `cfg`'s architecture fields
/// are not used.
pub fn train_model(
    cfg: &CnnConfig,
    pool: &Pool,
    mut model: Cnn,
    train: &ImageSet,
    test: &ImageSet,
    mut report: impl FnMut(&EpochReport),
) -> Result<Cnn> {
    cfg.optimizer.validate()?;
    check_fits(&model, train)?;
    let mut x = model.input_tensor();
    let plan = crate::train::EpochPlan {
        epochs: cfg.epochs,
        len: train.data.len(),
        batch: cfg.batch,
        whole_batches: true,
        seed: cfg.seed ^ 0xc22,
    };
    crate::train::run_epochs(
        &mut model,
        plan,
        |m, chunk, index| {
            let labels = fill_images(train, chunk, &mut x);
            let check = cfg.check_finite.then_some(index);
            m.checked_step(pool, &x, &labels, &cfg.optimizer, check)
        },
        |m| accuracy(m, pool, test),
        &mut report,
    )?;
    Ok(model)
}
