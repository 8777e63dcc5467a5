//! The sequence-classifier training loop shared by `examples/train_lstm` and
//! the tests: images read row by row (one row per step).

use crate::data::Dataset;
use crate::train::EpochReport;
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Blocked, CellKind, Pool, Result, SeqClassifier, SeqSpec};
use std::time::Instant;

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
    let mut right = 0usize;
    let idx: Vec<usize> = (0..data.len()).collect();
    for chunk in idx.chunks(model.batch()) {
        let labels = fill_sequences(model, data, chunk, &mut plain, &mut x)?;
        let pred = model.predict(pool, &x, chunk.len())?;
        right += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(right as f64 / data.len().max(1) as f64)
}

/// Trains on `train`, evaluating on `test` after each epoch; `report` sees
/// every epoch (`samples_per_s` counts sequences).
pub fn train(
    cfg: &SeqConfig,
    pool: &Pool,
    train: &Dataset,
    test: &Dataset,
    mut report: impl FnMut(&EpochReport),
) -> Result<SeqClassifier> {
    let mut model = build(cfg, train)?;
    let mut rng = Rng::new(cfg.seed ^ 0x157);
    let mut x = model.input_layout();
    let mut plain = vec![];
    let mut order: Vec<usize> = (0..train.len()).collect();
    for epoch in 1..=cfg.epochs {
        rng.shuffle(&mut order);
        let (mut loss_sum, mut steps, mut seen) = (0.0f64, 0usize, 0usize);
        let t = Instant::now();
        for chunk in order.chunks(cfg.batch) {
            let labels = fill_sequences(&model, train, chunk, &mut plain, &mut x)?;
            loss_sum += model.train_step(pool, &x, &labels, &cfg.optimizer)? as f64;
            steps += 1;
            seen += chunk.len();
        }
        let secs = t.elapsed().as_secs_f64();
        let test_accuracy = accuracy(&mut model, pool, test)?;
        report(&EpochReport {
            epoch,
            loss: (loss_sum / steps.max(1) as f64) as f32,
            test_accuracy,
            samples_per_s: seen as f64 / secs,
        });
    }
    Ok(model)
}
