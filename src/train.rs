//! The MLP training loop shared by `examples/train_mlp` and the tests.

use crate::data::Dataset;
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Activation, LayerSpec, Mlp, Pool, Result};
use std::time::Instant;

/// What to train, and how.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Hidden layer widths (ReLU); the output layer is added.
    pub hidden: Vec<usize>,
    /// Minibatch.
    pub batch: usize,
    /// Passes over the training set.
    pub epochs: usize,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Seed of the weights and the shuffles.
    pub seed: u64,
    /// Mixed precision: bf16 operands in forward and backward-data, f32
    /// master weights, optimizer and loss ([`Mlp::set_bf16`]).
    pub bf16: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            hidden: vec![128, 64],
            batch: 64,
            epochs: 30,
            optimizer: Optimizer::adam(3e-3),
            seed: 1,
            bf16: false,
        }
    }
}

/// One epoch's figures.
#[derive(Debug, Clone, Copy)]
pub struct EpochReport {
    /// 1-based epoch.
    pub epoch: usize,
    /// Mean training loss.
    pub loss: f32,
    /// Accuracy on the test set.
    pub test_accuracy: f64,
    /// Training samples per second (forward + backward + update).
    pub samples_per_s: f64,
}

/// Builds the model for `cfg` and a data set's shape.
pub fn build(cfg: &TrainConfig, data: &Dataset) -> Result<Mlp> {
    let mut specs: Vec<LayerSpec> = cfg
        .hidden
        .iter()
        .map(|&out| LayerSpec {
            out,
            act: Activation::Relu,
        })
        .collect();
    specs.push(LayerSpec {
        out: data.classes,
        act: Activation::Identity,
    });
    let mut m = Mlp::new(data.features, cfg.batch, &specs, cfg.seed)?;
    m.set_bf16(cfg.bf16)?;
    Ok(m)
}

/// Accuracy of `model` on `data`, in minibatches.
pub fn accuracy(model: &mut Mlp, pool: &Pool, data: &Dataset) -> Result<f64> {
    let mut x = model.input_layout();
    let mut right = 0usize;
    let idx: Vec<usize> = (0..data.len()).collect();
    for chunk in idx.chunks(model.batch()) {
        let labels = data.fill_batch(chunk, &mut x);
        let pred = model.predict(pool, &x, chunk.len())?;
        right += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(right as f64 / data.len().max(1) as f64)
}

/// Trains on `train`, evaluating on `test` after each epoch; `report` sees
/// every epoch. Returns the trained model.
pub fn train(
    cfg: &TrainConfig,
    pool: &Pool,
    train: &Dataset,
    test: &Dataset,
    mut report: impl FnMut(&EpochReport),
) -> Result<Mlp> {
    let mut model = build(cfg, train)?;
    let mut rng = Rng::new(cfg.seed ^ 0x5eed);
    let mut x = model.input_layout();
    let mut order: Vec<usize> = (0..train.len()).collect();
    for epoch in 1..=cfg.epochs {
        rng.shuffle(&mut order);
        let (mut loss_sum, mut steps) = (0.0f64, 0usize);
        let t = Instant::now();
        for chunk in order.chunks(cfg.batch) {
            let labels = train.fill_batch(chunk, &mut x);
            loss_sum += model.train_step(pool, &x, &labels, &cfg.optimizer)? as f64;
            steps += 1;
        }
        let secs = t.elapsed().as_secs_f64();
        let test_accuracy = accuracy(&mut model, pool, test)?;
        report(&EpochReport {
            epoch,
            loss: (loss_sum / steps.max(1) as f64) as f32,
            test_accuracy,
            samples_per_s: train.len() as f64 / secs,
        });
    }
    Ok(model)
}
