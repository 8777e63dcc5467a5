//! The sequence classifier of `examples/train_lstm` on the layer graph
//! ([`SeqSpec::graph`]): images read row by row (one row per step), trained
//! by [`crate::fit`].

use crate::data::Dataset;
pub use crate::fit::RowSequences;
use crate::fit::{fit, fit_config_of};
use crate::train::EpochReport;
use brgemm_nn::models::SeqSpec;
use brgemm_nn::Graph;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{CellKind, Pool};

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
    /// Fused optimizer steps ([`crate::fit::FitConfig::fused_update`];
    /// needs `check_finite` off).
    pub fused_update: bool,
    /// Mixed precision: bf16 operands in the recurrent and linear layers
    /// where bf16 beats f32 on this CPU ([`Graph::set_bf16`]), f32 master
    /// weights, cell arithmetic, optimizer and loss.
    pub bf16: bool,
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
            fused_update: false,
            bf16: false,
        }
    }
}

/// Plans the classifier of `cfg` for `data` (whose features are `steps`
/// rows of equal length) as a layer graph ([`SeqSpec::graph`]).
pub fn build(cfg: &SeqConfig, data: &Dataset) -> brgemm_nn::Result<Graph> {
    spec(cfg, data)?.graph(cfg.batch, cfg.seed)
}

/// The classifier of `cfg` for `data` (whose features are `steps` rows of
/// equal length).
pub fn spec(cfg: &SeqConfig, data: &Dataset) -> brgemm_nn::Result<SeqSpec> {
    if cfg.steps == 0 || !data.features.is_multiple_of(cfg.steps) {
        return Err(brgemm_nn::Error::Graph(format!(
            "steps {}: must divide the {} features of an image",
            cfg.steps, data.features
        )));
    }
    Ok(SeqSpec {
        kind: cfg.kind,
        steps: cfg.steps,
        features: data.features / cfg.steps,
        hidden: cfg.hidden,
        layers: cfg.layers,
        bidirectional: cfg.bidirectional,
        head: cfg.head.clone(),
        classes: data.classes,
    })
}

/// `data`'s images as sequences for `g`: row t of an image is step t
/// ([`RowSequences`], as many steps as the graph's input has).
pub fn sequences<'a>(g: &Graph, data: &'a Dataset) -> RowSequences<'a> {
    RowSequences {
        data,
        steps: g.input_shape().h,
    }
}

/// Accuracy of `g` on `data` read row by row.
pub fn accuracy(g: &mut Graph, pool: &Pool, data: &Dataset) -> brgemm_nn::Result<f64> {
    let seqs = sequences(g, data);
    crate::fit::accuracy(g, pool, &seqs)
}

/// An error unless `g` reads `data`'s images row by row and predicts its
/// classes.
pub fn check_fits(g: &Graph, data: &Dataset) -> brgemm_nn::Result<()> {
    crate::fit::check_fits(g, &sequences(g, data))
}

/// Trains on `train`, evaluating on `test` after each epoch; `report` sees
/// every epoch (`samples_per_s` counts sequences).
pub fn train(
    cfg: &SeqConfig,
    pool: &Pool,
    train: &Dataset,
    test: &Dataset,
    report: impl FnMut(&EpochReport),
) -> brgemm_nn::Result<Graph> {
    cfg.optimizer.validate()?;
    let model = build(cfg, train)?;
    train_model(cfg, pool, model, train, test, report)
}

/// [`train`] from a given graph (e.g. one with loaded values, to resume):
/// [`crate::fit::fit`] with `cfg`'s epochs, optimizer, seed and guard;
/// `cfg`'s architecture fields are not used; the model's precision follows
/// `cfg.bf16`.
pub fn train_model(
    cfg: &SeqConfig,
    pool: &Pool,
    mut model: Graph,
    train: &Dataset,
    test: &Dataset,
    report: impl FnMut(&EpochReport),
) -> brgemm_nn::Result<Graph> {
    model.set_bf16(cfg.bf16)?;
    let fit_cfg = fit_config_of!(cfg, 0x157, whole_batches: false);
    let (tr, te) = (sequences(&model, train), sequences(&model, test));
    fit(&mut model, pool, &fit_cfg, &tr, &te, report)?;
    Ok(model)
}
