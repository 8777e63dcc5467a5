//! The element type of a GPU BRGEMM's A and B operands: the CPU
//! descriptor's [`brgemm::DataType`] (`Bf16` and `F16` on tensor cores,
//! `F32` with scalar FMAs and no tf32 rounding). Accumulation and C are
//! always f32.

pub use brgemm::DataType as GpuDtype;

/// Elements in one 16-byte vector (what `cp.async` copies).
pub(crate) fn vec16(d: GpuDtype) -> usize {
    16 / d.size()
}
