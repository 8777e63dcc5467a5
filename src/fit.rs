//! One training loop for every layer graph ([`brgemm_nn::Graph`]): the CNN of
//! `train_cnn`, the small ResNet, the MLP of `train_mpi`, or a network of
//! the user's own, on any labelled data that can fill a minibatch
//! ([`Samples`]).
//!
//! An epoch is a new seeded shuffle; each minibatch is forward, softmax
//! cross-entropy, backward and the optimizer step. A short last minibatch
//! trains on its rows only (the rest of the graph's minibatch is padding
//! with no loss and no gradient), unless [`FitConfig::whole_batches`] leaves
//! it out, as batch normalisation needs.

use crate::data::{Dataset, ImageSet};
use crate::train::EpochReport;
use brgemm_nn::{Error, Graph, Result, Tensor};
use brgemm_primitives::guard;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::Pool;

/// Labelled samples a graph reads: `features()` values per sample, in the
/// graph input's NCHW order (channels, rows, columns).
pub trait Samples {
    /// Number of samples.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Values per sample.
    fn features(&self) -> usize;
    /// Number of classes (labels are below it).
    fn classes(&self) -> usize;
    /// Writes samples `idx` into the first rows of `x` (`features()` values
    /// each; the rows after them are zeroed) and returns their labels.
    fn fill(&self, idx: &[usize], x: &mut [f32]) -> Vec<usize>;
}

impl Samples for Dataset {
    fn len(&self) -> usize {
        Dataset::len(self)
    }
    fn features(&self) -> usize {
        self.features
    }
    fn classes(&self) -> usize {
        self.classes
    }
    fn fill(&self, idx: &[usize], x: &mut [f32]) -> Vec<usize> {
        let f = self.features;
        x.fill(0.0);
        for (row, &i) in idx.iter().enumerate() {
            x[row * f..][..f].copy_from_slice(&self.x[i * f..][..f]);
        }
        idx.iter().map(|&i| self.y[i]).collect()
    }
}

/// The counts of a wrapper around a [`Dataset`] in `self.data`.
macro_rules! counts_of_data {
    () => {
        fn len(&self) -> usize {
            self.data.len()
        }
        fn features(&self) -> usize {
            self.data.features
        }
        fn classes(&self) -> usize {
            self.data.classes
        }
    };
}

impl Samples for ImageSet {
    counts_of_data!();
    fn fill(&self, idx: &[usize], x: &mut [f32]) -> Vec<usize> {
        self.data.fill(idx, x)
    }
}

/// Images (or any rows of `steps x features` values) read as sequences:
/// row t of a sample is step t. Fills the recurrent layers' input
/// `(n, features, steps, 1)`, a transpose of each sample.
#[derive(Debug, Clone, Copy)]
pub struct RowSequences<'a> {
    /// The samples, `steps * features` values each, row by row.
    pub data: &'a Dataset,
    /// Rows per sample.
    pub steps: usize,
}

impl Samples for RowSequences<'_> {
    counts_of_data!();
    fn fill(&self, idx: &[usize], x: &mut [f32]) -> Vec<usize> {
        let (t, all) = (self.steps.max(1), self.data.features);
        let f = all / t;
        x.fill(0.0);
        for (row, &i) in idx.iter().enumerate() {
            let img = &self.data.x[i * all..][..all];
            let out = &mut x[row * all..][..all];
            for (s, step) in img.chunks_exact(f).enumerate() {
                for (c, v) in step.iter().enumerate() {
                    out[c * t + s] = *v;
                }
            }
        }
        idx.iter().map(|&i| self.data.y[i]).collect()
    }
}

/// How to train.
#[derive(Debug, Clone)]
pub struct FitConfig {
    /// Passes over the training set.
    pub epochs: usize,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Seed of the shuffles.
    pub seed: u64,
    /// Leave out a short last minibatch (batch normalisation's statistics
    /// need full ones).
    pub whole_batches: bool,
    /// Stop with [`brgemm_primitives::Error::NonFinite`] when a step's loss
    /// or gradient norm is not finite, before the optimizer runs (default);
    /// `false` lets an experiment watch a divergence.
    pub check_finite: bool,
    /// Step the layers that can inside backward ([`Graph::set_fused_update`]:
    /// the linear layers' weights (f32 or bf16), block by block from L1, their
    /// gradients never stored whole). Off by default; it needs
    /// `check_finite` off, since that check reads every gradient before the
    /// optimizer runs.
    pub fused_update: bool,
}

impl Default for FitConfig {
    fn default() -> Self {
        FitConfig {
            epochs: 10,
            optimizer: Optimizer::adam(1e-3),
            seed: 1,
            whole_batches: false,
            check_finite: true,
            fused_update: false,
        }
    }
}

/// The [`FitConfig`] of an example configuration ([`crate::train::TrainConfig`],
/// [`crate::train_cnn::CnnConfig`], [`crate::train_lstm::SeqConfig`]): the
/// run settings they all carry under the same names, the shuffles seeded by
/// the configuration's seed xor `$salt` (its weights take the seed itself).
macro_rules! fit_config_of {
    ($cfg:expr, $salt:expr, whole_batches: $whole:expr) => {
        $crate::fit::FitConfig {
            epochs: $cfg.epochs,
            optimizer: $cfg.optimizer,
            seed: $cfg.seed ^ $salt,
            whole_batches: $whole,
            check_finite: $cfg.check_finite,
            fused_update: $cfg.fused_update,
        }
    };
}
pub(crate) use fit_config_of;

/// An error unless `g` reads `data`'s samples and predicts its classes.
pub fn check_fits(g: &Graph, data: &impl Samples) -> Result<()> {
    let (i, o) = (g.input_shape(), g.output_shape());
    if i.features() != data.features() || o.features() != data.classes() {
        return Err(Error::Graph(format!(
            "the graph maps {} values per sample to {} classes; the data have {} values and {} classes",
            i.features(),
            o.features(),
            data.features(),
            data.classes()
        )));
    }
    Ok(())
}

/// Accuracy of `g` on `data` (inference mode), in the graph's minibatches
/// (the last one padded; its padding is not counted).
pub fn accuracy(g: &mut Graph, pool: &Pool, data: &impl Samples) -> Result<f64> {
    check_fits(g, data)?;
    let shape = g.input_shape();
    let mut x = Tensor::zeros(shape);
    let all: Vec<usize> = (0..data.len()).collect();
    let mut right = 0usize;
    for idx in all.chunks(shape.n) {
        let labels = data.fill(idx, x.data_mut());
        let pred = g.predict(pool, &x)?;
        right += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    Ok(right as f64 / data.len().max(1) as f64)
}

/// One step on samples `idx` written into `x`: gradients, the non-finite
/// guard as step `index` when `check`, the optimizer. Returns the loss.
fn step(
    g: &mut Graph,
    pool: &Pool,
    x: &Tensor,
    labels: &[usize],
    opt: &Optimizer,
    check: Option<u64>,
) -> Result<f32> {
    let loss = g.compute_gradients_with(pool, x, labels, &mut |_, _| {})?;
    if let Some(index) = check {
        let norm = guard::norm(g.params().iter().map(|p| &*p.grad));
        guard::check_step(index, loss, norm)?;
    }
    g.step_with(pool, opt)?;
    Ok(loss)
}

/// Trains `g` on `train` for `cfg.epochs`, evaluating on `test` after each
/// epoch; `report` sees every epoch.
pub fn fit(
    g: &mut Graph,
    pool: &Pool,
    cfg: &FitConfig,
    train: &impl Samples,
    test: &impl Samples,
    mut report: impl FnMut(&EpochReport),
) -> Result<()> {
    cfg.optimizer.validate()?;
    if cfg.fused_update && cfg.check_finite {
        return Err(Error::Graph(
            "a fused update cannot wait for the finite check, which reads every gradient \
             before the optimizer runs: turn the check off (--no-finite-check) to fuse"
                .into(),
        ));
    }
    g.set_fused_update(cfg.fused_update)?;
    check_fits(g, train)?;
    check_fits(g, test)?;
    let mut x = Tensor::zeros(g.input_shape());
    let plan = crate::train::EpochPlan {
        epochs: cfg.epochs,
        len: train.len(),
        batch: g.input_shape().n,
        whole_batches: cfg.whole_batches,
        seed: cfg.seed,
    };
    crate::train::run_epochs(
        g,
        plan,
        |g, idx, index| {
            let labels = train.fill(idx, x.data_mut());
            if cfg.fused_update {
                return g.train_step_rows(pool, &x, &labels, &cfg.optimizer);
            }
            let check = cfg.check_finite.then_some(index);
            step(g, pool, &x, &labels, &cfg.optimizer, check)
        },
        |g| accuracy(g, pool, test),
        &mut report,
    )
}
