//! # brgemm-dl
//!
//! Deep-learning training primitives in Rust built on one hand-tuned kernel,
//! the batch-reduce GEMM (BRGEMM) of Georganas et al. (arXiv 1906.06440).
//!
//! - [`kernel`] (crate `brgemm`): the kernel, planned once and called many
//!   times, with AVX-512, AVX2, NEON, portable and reference microkernels.
//! - [`primitives`] (crate `brgemm-primitives`): loop nests, blocked layouts,
//!   the FC layer, losses, optimizers and the [`primitives::Mlp`] model.
//! - [`data`], [`idx`]: the embedded UCI digits, Fashion-MNIST from its IDX
//!   files, and the data-set types.
//! - [`train`], [`train_cnn`], [`train_lstm`]: the MLP, CNN and sequence
//!   (LSTM/RNN) training loops the examples use.
//!
//! Cargo feature `mpi`: [`distributed`] (crate `brgemm-distributed`),
//! data-parallel training over MPI (needs OpenMPI). The `cuda` feature
//! arrives with its crate.
#![deny(missing_docs)]

pub use brgemm as kernel;
#[cfg(feature = "mpi")]
pub use brgemm_distributed as distributed;
pub use brgemm_primitives as primitives;

pub mod data;
pub mod idx;
pub mod train;
pub mod train_cnn;
pub mod train_lstm;
