//! The sequence-classifier training loop shared by `examples/train_lstm` and
//! the tests: images read row by row (one row per step).

use crate::data::Dataset;
use crate::train::EpochReport;
use brgemm_nn::models::{SeqClassifier, SeqSpec, Trainable};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Blocked, CellKind, Pool, Result};

/// What to train, and how.
#[derive(Debug, Clone)]
pub struct SeqConfig {
    /// LSTM or RNN.
    pub kind: CellKind,
    /// Steps per sequence (image rows).
    pub steps: usize,
    /// Hidden units per direction.
    pub hidden: usize,
    /// Stacked layers.
    pub layers: usize,
    /// Both directions in every layer.
    pub bidirectional: bool,
    /// Hidden FC layers of the head.
    pub head: Vec<usize>,
    /// Minibatch.
    pub batch: usize,
    /// Passes over the training set.
    pub epochs: usize,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Seed of the weights and the shuffles.
    pub seed: u64,
    /// Stop when a step's loss or gradient norm is not finite (default;
    /// see [`crate::train::TrainConfig::check_finite`]).
    pub check_finite: bool,
}

impl SeqConfig {
    /// One LSTM layer of 128 units, FC head to the classes, Adam 2e-3,
    /// minibatch 64, for images of `steps` rows.
    pub fn lstm(steps: usize) -> SeqConfig {
        SeqConfig {
            kind: CellKind::Lstm,
            steps,
            hidden: 128,
            layers: 1,
            bidirectional: false,
            head: vec![],
            batch: 64,
            epochs: 4,
            optimizer: Optimizer::adam(2e-3),
            seed: 1,
            check_finite: true,
        }
    }
}

/// Plans the classifier of `cfg` for `data` (whose features are `steps`
/// rows of equal length).
pub fn build(cfg: &SeqConfig, data: &Dataset) -> Result<SeqClassifier> {
    if cfg.steps == 0 || !data.features.is_multiple_of(cfg.steps) {
        return Err(brgemm_primitives::Error::Shape {
            what: "steps".into(),
            value: cfg.steps.to_string(),
            reason: format!("must divide the {} features of an image", data.features),
        });
    }
    SeqClassifier::new(
        &SeqSpec {
            kind: cfg.kind,
            steps: cfg.steps,
            features: data.features / cfg.steps,
            hidden: cfg.hidden,
            layers: cfg.layers,
            bidirectional: cfg.bidirectional,
            head: cfg.head.clone(),
            classes: data.classes,
        },
        cfg.batch,
        cfg.seed,
    )
}

/// Writes images `idx` (row t = step t) into `x`; returns their labels.
pub fn fill_sequences(
    model: &SeqClassifier,
    data: &Dataset,
    idx: &[usize],
    plain: &mut Vec<f32>,
    x: &mut Blocked,
) -> Result<Vec<usize>> {
    let (t, f, n) = (model.spec().steps, model.spec().features, model.batch());
    plain.clear();
    plain.resize(t * n * f, 0.0);
    for (r, &i) in idx.iter().enumerate() {
        let img = &data.x[i * data.features..][..data.features];
        for s in 0..t {
            plain[(s * n + r) * f..][..f].copy_from_slice(&img[s * f..][..f]);
        }
    }
    model.set_input(x, plain)?;
    Ok(idx.iter().map(|&i| data.y[i]).collect())
}

/// Accuracy of `model` on `data`, in minibatches.
pub fn accuracy(model: &mut SeqClassifier, pool: &Pool, data: &Dataset) -> Result<f64> {
    let mut x = model.input_layout();
    let mut plain = vec![];
    let batch = model.batch();
    crate::train::accuracy_in_batches(model, data.len(), batch, |m, chunk| {
        let labels = fill_sequences(m, data, chunk, &mut plain, &mut x)?;
        Ok((m.predict(pool, &x, chunk.len())?, labels))
    })
}

/// Trains on `train`, evaluating on `test` after each epoch; `report` sees
/// every epoch (`samples_per_s` counts sequences).
pub fn train(
    cfg: &SeqConfig,
    pool: &Pool,
    train: &Dataset,
    test: &Dataset,
    report: impl FnMut(&EpochReport),
) -> Result<SeqClassifier> {
    cfg.optimizer.validate()?;
    let model = build(cfg, train)?;
    train_model(cfg, pool, model, train, test, report)
}

/// An error unless `model` reads `data`'s features (as its steps x
/// features) and predicts its classes.
pub fn check_fits(model: &SeqClassifier, data: &Dataset) -> Result<()> {
    let s = model.spec();
    crate::train::check_widths(
        (format!("{} features", s.steps * s.features), s.classes),
        (format!("{} features", data.features), data.classes),
    )
}

/// [`train`] from a given model (e.g. one loaded to resume): its input
/// width and classes must match the data; `cfg`'s architecture fields are
/// not used.
pub fn train_model(
    cfg: &SeqConfig,
    pool: &Pool,
    mut model: SeqClassifier,
    train: &Dataset,
    test: &Dataset,
    mut report: impl FnMut(&EpochReport),
) -> Result<SeqClassifier> {
    cfg.optimizer.validate()?;
    check_fits(&model, train)?;
    let mut x = model.input_layout();
    let mut plain = vec![];
    let plan = crate::train::EpochPlan {
        epochs: cfg.epochs,
        len: train.len(),
        batch: cfg.batch,
        whole_batches: false,
        seed: cfg.seed ^ 0x157,
    };
    crate::train::run_epochs(
        &mut model,
        plan,
        |m, chunk, index| {
            let labels = fill_sequences(m, train, chunk, &mut plain, &mut x)?;
            let check = cfg.check_finite.then_some(index);
            m.checked_step(pool, &x, &labels, &cfg.optimizer, check)
        },
        |m| accuracy(m, pool, test),
        &mut report,
    )?;
    Ok(model)
}
