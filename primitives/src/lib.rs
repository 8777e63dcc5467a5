//! # brgemm-primitives
//!
//! Deep-learning primitives as thin loop nests around the one BRGEMM kernel
//! (crate `brgemm`), after Georganas et al. (arXiv 1906.06440).
//!
//! The crate is laid out by concern:
//!
//! - [`engine`]: what every layer runs on.
//!   [`loops`]: PARLOOPER-style loop nests ([`LoopNest`], [`LoopDef`]): a
//!   spec string gives nesting order, blocking levels and parallel loops;
//!   tuning a primitive's loop order needs no code change. [`threads`]: the
//!   [`Pool`] the nests run on (the caller plus pinned rayon workers;
//!   passes too small to pay for a hand-off stay on the caller).
//!   [`layout`], [`tensor`]: [`Blocked`] matrices, [`Tensor4`] activations
//!   and [`Filter`]s, owning their storage, with plain conversions.
//!   [`PassConfig`]: a pass's loop order and blocking. [`progress`]: the
//!   hook the nests call between kernel calls (non-blocking communication
//!   progresses there).
//! - [`layers`]: the layers, forward and backward. [`fc`]: [`Fc`] and its
//!   [`FcTuning`]; [`fc_bf16`]: its bf16-operand passes; [`conv`]: [`Conv`];
//!   [`rnn`]: LSTM and tanh-RNN layers ([`Rnn`]) over whole sequences;
//!   [`pool2d`], [`norm`], [`eltwise`]: pooling, batch normalisation, ReLU,
//!   dropout and flattening into the FC layout.
//! - [`train`]: [`loss`], [`optim`] (SGD with momentum, Adam), [`init`],
//!   the non-finite [`guard`] and the [`tuning`] files of `examples/tune`.
//!
//! Networks built from these (the layer graph, ResNets, and the fixed
//! MLP, CNN and sequence-classifier templates with their model files) live
//! one crate up, in `brgemm-nn`.
//!
//! Every CPU-dependent plan-time choice comes from one table,
//! [`brgemm::policy()`]; settings from the environment are read in one
//! place each ([`threads`] for the pool, [`brgemm::policy()`] for the CPU
//! row), never by a layer's constructor.
#![deny(missing_docs)]

pub mod engine;
pub mod error;
pub mod layers;
pub mod train;

// The modules under their flat names too (the paths the API has always had).
pub(crate) use engine::view;
pub use engine::{layout, loops, progress, tensor, threads};
pub(crate) use engine::{math, pass};
pub(crate) use layers::act;
pub use layers::{conv, eltwise, fc, fc_bf16, norm, pool2d, rnn};
pub use train::{guard, init, loss, optim, tuning};

pub use brgemm::Activation;

/// The CPU policy every plan-time heuristic reads ([`brgemm::policy()`]);
/// an unknown `BRGEMM_CPU_POLICY` is reported by the plans
/// ([`check_policy`]) and falls back to the default row here.
pub(crate) fn policy() -> &'static brgemm::Policy {
    brgemm::policy().unwrap_or(&brgemm::Policy::DEFAULT)
}

/// An error for an unknown `BRGEMM_CPU_POLICY`; every plan calls it.
pub(crate) fn check_policy() -> Result<()> {
    brgemm::policy().map(|_| ()).map_err(Error::from)
}
pub use conv::{Conv, ConvParams, ConvTuning};
pub use error::{Error, Result};
pub use fc::{Fc, FcTuning};
pub use layout::{Blocked, Inner};
pub use loops::{LoopDef, LoopNest, Schedule};
pub use norm::BatchNorm;
pub use optim::Optimizer;
pub use pass::PassConfig;
pub use pool2d::{Pool2d, PoolKind};
pub use rnn::{CellKind, Rnn, RnnGrads, RnnState, RnnTuning};
pub use tensor::{Filter, Tensor4};
pub use threads::Pool;
