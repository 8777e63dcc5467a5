//! # brgemm-dl
//!
//! Deep-learning training primitives in Rust built on one hand-tuned kernel,
//! the batch-reduce GEMM (see the [`brgemm`] crate, re-exported here as
//! [`kernel`]).
//!
//! Cargo features: `mpi` (multi-node data parallelism) and `cuda` (run-time
//! generated GPU kernels) come with their crates.
#![deny(missing_docs)]

pub use brgemm as kernel;
