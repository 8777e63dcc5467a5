//! The MLP of `examples/train_mlp` on the layer graph, its settings, and the
//! epoch machinery every training loop here shares ([`EpochReport`]).

use crate::data::Dataset;
pub use crate::fit::{accuracy, check_fits};
use crate::fit::{fit, fit_config_of};
use brgemm_nn::models::{mlp_with_tunings, LayerSpec};
use brgemm_nn::Graph;
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{FcTuning, Pool};
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
    /// master weights, optimizer and loss ([`Graph::set_bf16`]).
    pub bf16: bool,
    /// Stop with [`Error::NonFinite`](brgemm_primitives::Error::NonFinite)
    /// when a step's loss or gradient norm is not finite (default); `false`
    /// lets an experiment watch a divergence.
    pub check_finite: bool,
    /// Fused optimizer steps ([`crate::fit::FitConfig::fused_update`];
    /// needs `check_finite` off).
    pub fused_update: bool,
    /// A tuning file of `examples/tune --save`: layers whose shape it holds
    /// are planned with its blocking and loop orders (the examples set it
    /// from `BRGEMM_TUNING`).
    pub tuning_file: Option<std::path::PathBuf>,
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
            check_finite: true,
            fused_update: false,
            tuning_file: None,
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

/// Builds the MLP graph for `cfg` and a data set's shape
/// ([`brgemm_nn::models::mlp`]), with the tuning file's blocking for the
/// layers it holds, in mixed precision when `cfg.bf16`.
pub fn build(cfg: &TrainConfig, data: &Dataset) -> brgemm_nn::Result<Graph> {
    let specs = LayerSpec::classifier(&cfg.hidden, data.classes);
    let mut tunings = Vec::new();
    if let Some(path) = &cfg.tuning_file {
        let mut c = data.features;
        for s in &specs {
            let t = brgemm_primitives::tuning::load(path, cfg.batch, c, s.out)?;
            tunings.push(t.unwrap_or_else(|| FcTuning::heuristic(cfg.batch, c, s.out)));
            c = s.out;
        }
    }
    let mut g = mlp_with_tunings(data.features, cfg.batch, &specs, cfg.seed, &tunings)?;
    g.set_bf16(cfg.bf16)?;
    Ok(g)
}

/// How the epochs of a training run walk the training set.
pub(crate) struct EpochPlan {
    pub epochs: usize,
    /// Training items.
    pub len: usize,
    pub batch: usize,
    /// Leave out the last partial minibatch (batch norm needs full ones).
    pub whole_batches: bool,
    /// Seed of the shuffles.
    pub seed: u64,
}

/// The epoch loop the training loops share: a new shuffle per epoch,
/// `step(model, minibatch, step_index)` (returns its loss; the index counts
/// the run's steps from 0), then `evaluate(model)`, then `report` with the
/// epoch's mean loss, test accuracy and items/s.
pub(crate) fn run_epochs<M, E>(
    model: &mut M,
    plan: EpochPlan,
    mut step: impl FnMut(&mut M, &[usize], u64) -> std::result::Result<f32, E>,
    mut evaluate: impl FnMut(&mut M) -> std::result::Result<f64, E>,
    report: &mut dyn FnMut(&EpochReport),
) -> std::result::Result<(), E> {
    let mut rng = Rng::new(plan.seed);
    let mut order: Vec<usize> = (0..plan.len).collect();
    let mut index = 0u64;
    for epoch in 1..=plan.epochs {
        rng.shuffle(&mut order);
        let (mut loss_sum, mut steps, mut seen) = (0.0f64, 0usize, 0usize);
        let t = Instant::now();
        for chunk in order.chunks(plan.batch) {
            if plan.whole_batches && chunk.len() < plan.batch {
                continue;
            }
            loss_sum += step(model, chunk, index)? as f64;
            index += 1;
            steps += 1;
            seen += chunk.len();
        }
        let secs = t.elapsed().as_secs_f64();
        let test_accuracy = evaluate(model)?;
        report(&EpochReport {
            epoch,
            loss: (loss_sum / steps.max(1) as f64) as f32,
            test_accuracy,
            samples_per_s: seen as f64 / secs,
        });
    }
    Ok(())
}

/// Trains on `train`, evaluating on `test` after each epoch; `report` sees
/// every epoch. Returns the trained model.
pub fn train(
    cfg: &TrainConfig,
    pool: &Pool,
    train: &Dataset,
    test: &Dataset,
    report: impl FnMut(&EpochReport),
) -> brgemm_nn::Result<Graph> {
    let model = build(cfg, train)?;
    train_model(cfg, pool, model, train, test, report)
}

/// [`train`] from a given model (e.g. one with values loaded by
/// [`Graph::load`], to resume): [`crate::fit::fit`] with `cfg`'s epochs,
/// optimizer, seed and guard, every sample each epoch (the last minibatch
/// may be partial); the model's precision follows `cfg.bf16`.
pub fn train_model(
    cfg: &TrainConfig,
    pool: &Pool,
    mut model: Graph,
    train: &Dataset,
    test: &Dataset,
    report: impl FnMut(&EpochReport),
) -> brgemm_nn::Result<Graph> {
    model.set_bf16(cfg.bf16)?;
    let fit_cfg = fit_config_of!(cfg, 0x5eed, whole_batches: false);
    fit(&mut model, pool, &fit_cfg, train, test, report)?;
    Ok(model)
}
