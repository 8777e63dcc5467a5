//! # brgemm-primitives
//!
//! Deep-learning primitives as thin loop nests around the one BRGEMM kernel
//! (crate `brgemm`), after Georganas et al. (arXiv 1906.06440).
//!
//! - [`loops`]: PARLOOPER-style loop nests ([`LoopNest`], [`LoopDef`]): a spec
//!   string gives nesting order, blocking levels and parallel loops; tuning a
//!   primitive's loop order needs no code change.
//! - [`threads`]: the [`Pool`] the nests run on: the caller plus pinned rayon
//!   workers (`BRGEMM_NUM_THREADS`);
//!   passes too small to pay for a hand-off stay on the caller
//!   (`BRGEMM_MIN_PARALLEL_FLOPS`).
//! - [`layout`]: [`Blocked`] layouts and conversions from and to plain ones.
//! - [`fc`]: the fully-connected layer [`Fc`] (forward with fused bias and
//!   activation, backward-data, backward-weights) and its [`FcTuning`];
//!   [`fc_bf16`]: its mixed-precision (bf16 operand) forward and backward-data.
//! - [`guard`]: non-finite detection (loss, gradient norm) for training
//!   loops.
//! - [`loss`], [`optim`], [`init`]: softmax cross-entropy, SGD with momentum,
//!   Adam, Kaiming/Xavier initialisation from a seeded RNG.
//! - [`tensor`], [`conv`]: blocked 4-D tensors ([`Tensor4`], [`Filter`]) and
//!   the convolution layer [`Conv`] (forward, backward-data, backward-weights).
//! - [`pool2d`], [`norm`], [`eltwise`]: max/average/global pooling, batch
//!   normalisation, ReLU, dropout and flattening into the FC layout.
//! - [`rnn`]: LSTM and tanh-RNN layers ([`Rnn`]) over whole sequences,
//!   forward and backward through time.
//! - [`seqnet`]: [`SeqClassifier`], stacked/bidirectional recurrent layers
//!   with an MLP head.
//! - [`cnn`]: [`Cnn`], convolution stages and an MLP head trained end to end.
//! - [`model`]: [`Mlp`], a sequence of FC layers owning blocked weights,
//!   gradients and optimizer state. [`Mlp`], [`Cnn`] and [`SeqClassifier`]
//!   save and load through [`ModelFile`], one checked, atomically written
//!   [`modelfile`] format.
#![deny(missing_docs)]

mod act;
pub mod cnn;
pub mod conv;
pub mod eltwise;
pub mod error;
pub mod fc;
pub mod fc_bf16;
pub mod guard;
pub mod init;
pub mod layout;
pub mod loops;
pub mod loss;
pub mod math;
pub mod model;
pub mod modelfile;
pub mod norm;
pub mod optim;
mod pass;
pub mod pool2d;
pub mod rnn;
mod rnn_cell;
pub mod seqnet;
pub mod tensor;
pub mod threads;
pub mod tuning;

pub use brgemm::Activation;

/// The CPU policy every plan-time heuristic reads ([`brgemm::policy`]);
/// an unknown `BRGEMM_CPU_POLICY` is reported by the plans
/// ([`check_policy`]) and falls back to the default row here.
pub(crate) fn policy() -> &'static brgemm::Policy {
    brgemm::policy().unwrap_or(&brgemm::Policy::DEFAULT)
}

/// An error for an unknown `BRGEMM_CPU_POLICY`; every plan calls it.
pub(crate) fn check_policy() -> Result<()> {
    brgemm::policy().map(|_| ()).map_err(Error::from)
}
pub use cnn::{Cnn, CnnSpec, StageSpec};
pub use conv::{Conv, ConvParams, ConvTuning};
pub use error::{Error, Result};
pub use fc::{Fc, FcTuning};
pub use layout::{Blocked, Inner};
pub use loops::{LoopDef, LoopNest, Schedule};
pub use model::{LayerSpec, Mlp};
pub use modelfile::ModelFile;
pub use norm::BatchNorm;
pub use optim::Optimizer;
pub use pass::PassConfig;
pub use pool2d::{Pool2d, PoolKind};
pub use rnn::{CellKind, Rnn, RnnGrads, RnnState, RnnTuning};
pub use seqnet::{SeqClassifier, SeqSpec};
pub use tensor::{Filter, Tensor4};
pub use threads::Pool;
