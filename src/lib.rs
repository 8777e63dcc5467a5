//! # brgemm-dl
//!
//! Deep-learning training primitives in Rust built on one hand-tuned kernel,
//! the batch-reduce GEMM (BRGEMM) of Georganas et al. (arXiv 1906.06440).
//!
//! - [`kernel`] (crate `brgemm`): the kernel, planned once and called many
//!   times, with AVX-512, AVX2, NEON, portable and reference microkernels.
//! - [`primitives`] (crate `brgemm-primitives`): loop nests, blocked layouts,
//!   the FC layer, losses, optimizers and the [`primitives::Mlp`] model.
//! - [`data`]: the embedded UCI digits and the data-set type.
//! - [`train`]: the MLP training loop the examples use.
//!
//! Cargo features `mpi` (multi-node data parallelism) and `cuda` (run-time
//! generated GPU kernels) arrive with their crates.
#![deny(missing_docs)]

pub use brgemm as kernel;
pub use brgemm_primitives as primitives;

pub mod data;
pub mod train;
