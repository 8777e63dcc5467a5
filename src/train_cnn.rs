//! The CNN of `examples/train_cnn` on the layer graph, and its settings;
//! it trains with [`crate::fit`], the loop of every graph.

use crate::data::ImageSet;
pub use crate::fit::{accuracy, check_fits};
use crate::fit::{fit, fit_config_of};
use crate::train::EpochReport;
use brgemm_nn::models::{CnnSpec, StageSpec};
use brgemm_nn::{Graph, Result};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::Pool;

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
    /// Fused optimizer steps ([`crate::fit::FitConfig::fused_update`];
    /// needs `check_finite` off).
    pub fused_update: bool,
    /// Mixed precision: bf16 operands in forward and backward-data of the
    /// layers where bf16 beats f32 on this CPU ([`Graph::set_bf16`]), f32
    /// master weights, optimizer and loss.
    pub bf16: bool,
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
            fused_update: false,
            bf16: false,
        }
    }
}

/// The network of `cfg` for images like `data`'s.
pub fn spec(cfg: &CnnConfig, data: &ImageSet) -> CnnSpec {
    CnnSpec {
        input: data.dims,
        stages: cfg.stages.clone(),
        hidden: cfg.hidden.clone(),
        classes: data.data.classes,
        dropout: cfg.dropout,
    }
}

/// Plans the network of `cfg` for images like `data`'s ([`CnnSpec::graph`]).
pub fn build(cfg: &CnnConfig, data: &ImageSet) -> Result<Graph> {
    spec(cfg, data).graph(cfg.batch, cfg.seed)
}

/// Trains on `train`, evaluating on `test` after each epoch; `report` sees
/// every epoch. Returns the trained network.
pub fn train(
    cfg: &CnnConfig,
    pool: &Pool,
    train: &ImageSet,
    test: &ImageSet,
    report: impl FnMut(&EpochReport),
) -> Result<Graph> {
    cfg.optimizer.validate()?;
    let model = build(cfg, train)?;
    train_model(cfg, pool, model, train, test, report)
}

/// [`train`] from a given network (e.g. one with loaded values, to resume):
/// [`crate::fit::fit`] with `cfg`'s epochs, optimizer, seed and guard, in
/// whole minibatches (the last partial one is left out: batch-norm
/// statistics need a full batch); `cfg`'s architecture fields are not used;
/// the model's precision follows `cfg.bf16`.
pub fn train_model(
    cfg: &CnnConfig,
    pool: &Pool,
    mut model: Graph,
    train: &ImageSet,
    test: &ImageSet,
    report: impl FnMut(&EpochReport),
) -> Result<Graph> {
    model.set_bf16(cfg.bf16)?;
    let fit_cfg = fit_config_of!(cfg, 0xc22, whole_batches: true);
    fit(&mut model, pool, &fit_cfg, train, test, report)?;
    Ok(model)
}
