//! The element type of a GPU BRGEMM's A and B operands.

/// Element type of A and B. Accumulation and C are always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GpuDtype {
    /// bfloat16 (`half::bf16`): tensor cores (`mma.sync ... bf16`) on CUDA.
    #[default]
    Bf16,
    /// IEEE binary16 (`half::f16`): tensor cores (`mma.sync ... f16`) on CUDA.
    F16,
    /// binary32: the same tiling with scalar FMAs (no tf32 rounding).
    F32,
}

impl GpuDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            GpuDtype::Bf16 | GpuDtype::F16 => 2,
            GpuDtype::F32 => 4,
        }
    }
    /// Elements per 16-byte vector (one `cp.async` of the aligned path).
    pub fn vec(self) -> usize {
        16 / self.size()
    }
    /// Lower-case name used in kernel names and bench lines.
    pub fn name(self) -> &'static str {
        match self {
            GpuDtype::Bf16 => "bf16",
            GpuDtype::F16 => "f16",
            GpuDtype::F32 => "f32",
        }
    }
}
