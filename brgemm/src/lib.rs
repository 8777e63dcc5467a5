//! # brgemm: the batch-reduce GEMM kernel
//!
//! One kernel, `C = beta*C + alpha * sum_{i<batch} A_i * B_i`, on which the
//! primitives of `brgemm-dl` (fully-connected, convolution, LSTM) are built
//! (Georganas et al., "High-Performance Deep Learning via a Single Building
//! Block", arXiv 1906.06440). Matrices are column-major, as in BLAS and LIBXSMM.
//!
//! - [`Descriptor`]: the problem (shape, leading dimensions, [`BatchForm`],
//!   alpha, [`Beta`], fused [`Epilogue`]).
//! - [`Kernel`]: a descriptor planned once (validated, dispatched to an
//!   [`Isa`] and a [`RegisterTile`]) and called many times: [`Kernel::execute`]
//!   on checked slices, [`Kernel::execute_raw`] on raw pointers.
//! - [`dispatch`]: a process-wide, descriptor-keyed cache of kernels.
//! - [`Batch`] / [`RawBatch`] / [`Offsets`]: the three batch forms at call time.
//! - [`peak::fma_peak_gflops`]: this core's measured FMA peak, for "% of peak".
//! - [`policy()`]: this core's row of the per-microarchitecture policy,
//!   every CPU-dependent plan-time choice the primitives make.
//! - [`AlignedVec`]: 64-byte aligned buffers, the fast path for the kernels
//!   (whole cache lines per vector or tile row).
//! - [`peak::TileCeiling`]: the main register tile's throughput on L1-resident
//!   operands, measured the same way (what the machine allows a kernel that loads).
//!
//! Microkernels exist for AVX-512 (the tuned one), AVX2+FMA, NEON, a portable
//! one on `wide`, and a scalar reference with the same contract. The best one
//! the CPU supports is chosen at run time; `BRGEMM_ISA=avx512|avx2|neon|portable|reference`
//! forces one (planning fails if the CPU lacks it).
//!
//! ```
//! use brgemm::{Batch, Descriptor, Kernel};
//! // C (4x3) = sum over 2 pairs of A_i (4x5) * B_i (5x3), packed back to back.
//! let k = Kernel::new(&Descriptor::new(4, 3, 5))?;
//! let a = vec![1.0f32; 2 * 4 * 5];
//! let b = vec![0.5f32; 2 * 5 * 3];
//! let mut c = vec![0.0f32; 4 * 3];
//! k.execute(Batch::Stride { a: &a, b: &b, count: 2 }, &mut c, None)?;
//! assert!(c.iter().all(|&x| x == 5.0));
//! # Ok::<(), brgemm::Error>(())
//! ```
#![deny(missing_docs)]

mod batch;
pub mod bf16;
mod blocking;
pub mod buffer;
mod cpu;
mod desc;
pub mod env;
mod error;
mod isa;
mod kernel;
mod kernels;
pub mod peak;
mod plan;
pub mod policy;
mod simd;
mod tile;

pub use batch::{Batch, Offsets, RawBatch};
pub use blocking::RegisterTile;
pub use buffer::{aligned_vec, AlignedVec};
pub use desc::{Activation, BatchForm, Beta, DataType, Descriptor, Epilogue, Prefetch};
pub use error::{Error, Result};
pub use isa::Isa;
pub use kernel::{Element, Kernel};
pub use plan::{dispatch, dispatch_with, KernelOptions};
pub use policy::{policy, Bf16UpdRule, Policy, StreamPrefetch};
