//! # brgemm-dl
//!
//! Deep-learning training primitives in Rust built on one hand-tuned kernel,
//! the batch-reduce GEMM (BRGEMM) of Georganas et al. (arXiv 1906.06440).
//!
//! - [`kernel`] (crate `brgemm`): the kernel, planned once and called many
//!   times, with AVX-512, AVX2, NEON, portable and reference microkernels.
//! - [`primitives`] (crate `brgemm-primitives`): loop nests, blocked layouts,
//!   the FC, convolution, LSTM/RNN, pooling and normalisation passes,
//!   losses and optimizers.
//! - [`nn`] (crate `brgemm-nn`): networks as graphs of layers (a `Layer`
//!   trait over the primitives, residual joins, shape checks when a graph
//!   is built, versioned files; the MLP, CNN, stacked bidirectional
//!   LSTM/RNN classifier and ResNets as graph builders).
//! - [`checkpoint`]: a graph's values, optimizer state and place in a run,
//!   to resume it (`train_mpi --checkpoint/--resume`).
//! - [`data`], [`idx`]: the embedded UCI digits, Fashion-MNIST from its IDX
//!   files, and the data-set types.
//! - [`scaling`]: the cost model of a data-parallel step (ring all-reduce
//!   on a link, buckets under backward), for projections and for checking
//!   measured multi-node steps.
//! - [`fit`]: the one training loop of every layer graph, on any
//!   [`fit::Samples`]; [`train`], [`train_cnn`] and [`train_lstm`] are the
//!   MLP, CNN and sequence examples' networks on it.
//!
//! Cargo feature `mpi`: [`distributed`] (crate `brgemm-distributed`),
//! data-parallel training over MPI (needs OpenMPI). Cargo features `cuda`
//! and `opencl` (either enables the other's code too; neither needs a GPU
//! or CUDA to build): [`gpu`] (crate `brgemm-gpu`), the BRGEMM generated at
//! run time for CUDA tensor cores and OpenCL, and [`train_gpu`], the digits
//! MLP trained on the device.
#![deny(missing_docs)]

pub use brgemm as kernel;
#[cfg(feature = "mpi")]
pub use brgemm_distributed as distributed;
#[cfg(feature = "gpu")]
pub use brgemm_gpu as gpu;
pub use brgemm_nn as nn;
pub use brgemm_primitives as primitives;

pub mod checkpoint;
pub mod data;
mod error;
pub mod fit;
pub mod idx;
pub mod scaling;
pub mod train;
pub mod train_cnn;
#[cfg(feature = "gpu")]
pub mod train_gpu;
pub mod train_lstm;
