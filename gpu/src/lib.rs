//! # brgemm-gpu: the batch-reduce GEMM generated at run time for GPUs
//!
//! The CPU crate hand-tunes one kernel; here the kernel is *written* for
//! each descriptor at run time (the PyCUDA idea): [`GpuDescriptor`] fixes
//! m, n, k, leading dimensions, batch form, alpha/beta, the fused bias and
//! activation, the input type (bf16, f16 or f32; f32 accumulation) and a
//! block [`Tiling`]; [`codegen`] turns it into source and the device
//! compiles and caches it on first use.
//!
//! * **CUDA** ([`Backend::Cuda`]): NVRTC compiles for the device's
//!   architecture (sm_80+); tensor cores through header-free inline PTX —
//!   `cp.async` stage ring with zero-fill at the edges, `ldmatrix`,
//!   `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}`. One block owns a C
//!   tile for the whole batch x k loop and stores it once through the
//!   epilogue. Launched with cudarc's launch builder. The driver and NVRTC
//!   are loaded dynamically and probed first: without them you get
//!   [`Error::NoCuda`], never a panic.
//! * **OpenCL** ([`Backend::OpenCl`]): the same generator emits OpenCL C
//!   with the same tiling and per-thread fragment ownership, only the
//!   innermost multiply-accumulate being scalar. CI runs it on PoCL, so the
//!   generated addressing, edge tiles and epilogue are executed for real on
//!   every run; it is also the path for non-NVIDIA GPUs.
//!
//! On top: [`GpuFc`] (forward with fused bias + activation, backward-data,
//! backward-weights) and [`GpuMlp`] (a training step on the device).
//!
//! ```no_run
//! use brgemm_gpu::{Backend, Device, GpuBrgemm, GpuDescriptor, GpuDtype};
//! # fn main() -> brgemm_gpu::Result<()> {
//! let dev = Device::open(Backend::OpenCl)?;
//! let d = GpuDescriptor::new(64, 48, 32).dtype(GpuDtype::F32);
//! let k = GpuBrgemm::new(&d)?;
//! let a = dev.upload(&vec![1.0f32; 64 * 32 * 4])?;
//! let b = dev.upload(&vec![1.0f32; 32 * 48 * 4])?;
//! let mut c = dev.alloc(64 * 48 * 4)?;
//! k.execute(&dev, &a, &b, &mut c, None, None, 4)?;
//! let c: Vec<f32> = dev.download(&c, 64 * 48)?;
//! assert_eq!(c[0], 128.0);
//! # Ok(()) }
//! ```

#![deny(missing_docs)]
pub mod codegen;
mod conv;
mod cuda;
mod desc;
mod device;
mod dtype;
mod error;
mod fc;
mod graph;
pub mod hopper;

mod kernel;
mod lstm;
mod mlp;
mod nhwc;
mod norm;

mod opencl;
pub mod pool;
pub mod ptxas;
mod tiling;

pub use codegen::{ElementwiseKernel, Target};
pub use conv::{ConvShape, GpuConv2d};
pub use cuda::{
    arch_name, compile_cubin, compile_ptx, driver_available, nvrtc_available, CudaBackend,
};
pub use desc::{GpuBatch, GpuDescriptor, GpuDtype};
pub use device::{Backend, Buffer, Device};
pub use error::{Error, Result};
pub use fc::GpuFc;
pub use graph::GpuGraph;
pub use hopper::{GpuPath, HopperTiling};

pub use kernel::{BatchTable, GpuBrgemm};
pub use lstm::GpuSeqNet;
pub use mlp::{GpuDataset, GpuMlp};
pub use norm::GpuBatchNorm;

pub use opencl::OpenClBackend;
pub use tiling::{
    Tiling, MIN_OVERHEAD, MMA_CANDIDATES, REGISTER_OVERHEAD, SHARED_LIMIT, SHARED_MAX,
    SHARED_OPTIN_LIMIT,
};
