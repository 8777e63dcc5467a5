//! Microkernels, one file per ISA and dtype (`<isa>_<dtype>.rs`), and the
//! one table ([`TABLE`]) through which every kernel of this build, f32 and
//! bf16, says whether this CPU runs it.
//!
//! Each SIMD file implements [`crate::simd::SimdF32`] for its ISA, wraps the
//! generic [`crate::tile::tile`] in a `#[target_feature]` entry point, and lists
//! its grid of register tiles: for each `MV` (vectors of rows) the largest `NR`
//! (columns) whose `MV*NR` accumulators, `MV` A vectors and one broadcast fit in
//! the register file. Every smaller `NR` is instantiated too, so an n edge runs
//! a smaller fully unrolled tile rather than masked or scalar code.

use crate::batch::BatchSrc;
use crate::desc::DataType;
use crate::tile::TileFn;

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx_bf16;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_f32;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_f32;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512bf16_bf16;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon_f32;
pub(crate) mod portable_f32;
pub(crate) mod reference_bf16;
pub(crate) mod reference_f32;

/// One kernel family of this build: its name (as `BRGEMM_ISA` or
/// `BRGEMM_BF16_ISA` takes it), the inputs it reads, and whether this CPU
/// and OS can run it.
pub(crate) struct Entry {
    pub(crate) name: &'static str,
    pub(crate) dtype: DataType,
    pub(crate) available: fn() -> bool,
}

#[cfg(target_arch = "x86_64")]
fn x86_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}
#[cfg(target_arch = "x86_64")]
fn x86_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}
#[cfg(target_arch = "aarch64")]
fn arm_neon() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}
fn always() -> bool {
    true
}

/// Every kernel of this build, f32 tiles (generated per ISA) and bf16
/// kernels alike, strongest first within a dtype.
pub(crate) const TABLE: &[Entry] = &[
    #[cfg(target_arch = "x86_64")]
    Entry {
        name: "avx512",
        dtype: DataType::F32,
        available: x86_avx512,
    },
    #[cfg(target_arch = "x86_64")]
    Entry {
        name: "avx2",
        dtype: DataType::F32,
        available: x86_avx2,
    },
    #[cfg(target_arch = "aarch64")]
    Entry {
        name: "neon",
        dtype: DataType::F32,
        available: arm_neon,
    },
    Entry {
        name: "portable",
        dtype: DataType::F32,
        available: always,
    },
    Entry {
        name: "reference",
        dtype: DataType::F32,
        available: always,
    },
    #[cfg(target_arch = "x86_64")]
    Entry {
        name: "amx",
        dtype: DataType::Bf16,
        available: amx_bf16::available,
    },
    #[cfg(target_arch = "x86_64")]
    Entry {
        name: "avx512bf16",
        dtype: DataType::Bf16,
        available: avx512bf16_bf16::available,
    },
    // The widening kernel runs the f32 tiles of the selected ISA.
    Entry {
        name: "fp32",
        dtype: DataType::Bf16,
        available: always,
    },
    Entry {
        name: "reference",
        dtype: DataType::Bf16,
        available: always,
    },
];

/// Whether the kernel `name` for `dtype` is in this build and runs here.
pub(crate) fn available(name: &str, dtype: DataType) -> bool {
    TABLE
        .iter()
        .any(|e| e.dtype == dtype && e.name == name && (e.available)())
}

/// What the planner needs to know of one ISA's microkernels.
pub(crate) trait IsaKernels {
    /// f32 lanes per vector.
    const LANES: usize;
    /// `GRID[mv - 1]` = largest NR instantiated for that MV.
    const GRID: &'static [usize];
    /// Whether every tile masks its last vector (free on AVX-512), so no
    /// unmasked variants exist.
    const ALWAYS_MASK: bool;
    /// The `(mv, nr)` tile instance with the given masking (from [`tile_table`]).
    fn pick<B: BatchSrc<f32>, const MASKED: bool>(mv: usize, nr: usize) -> Option<TileFn<B>>;
    /// The grid the tile chooser searches for plans of `family`. ISAs with
    /// pipelined tiles search those when `family.pipelined`; a tile
    /// forced through `KernelOptions` may be anything in [`Self::GRID`].
    fn choice_grid(family: TileFamily) -> &'static [usize] {
        let _ = family;
        Self::GRID
    }
    /// The tile kernel for `(mv, nr)`, masked or not, for batch form `B`, of
    /// `family` where the ISA has it and the plain instance otherwise:
    /// prefetching instances exist only on AVX-512 (measured a loss on
    /// AVX2), pipelined ones only there and only up to its pipelined grid.
    /// ISAs with `ALWAYS_MASK` override it so no unmasked instance is built.
    fn tile_fn<B: BatchSrc<f32>>(
        mv: usize,
        nr: usize,
        masked: bool,
        family: TileFamily,
    ) -> Option<TileFn<B>> {
        let _ = family;
        if masked {
            Self::pick::<B, true>(mv, nr)
        } else {
            Self::pick::<B, false>(mv, nr)
        }
    }
    /// Runs the peak probe loop for `iters` steps.
    ///
    /// # Safety
    /// The ISA must be available.
    unsafe fn fma_probe(iters: u64) -> f32;
    /// FMAs per probe step (accumulators x lanes).
    const PROBE_FMAS_PER_ITER: u64;
}

/// Which instances of the tiles a plan asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TileFamily {
    /// Instances that prefetch the next pair and the call's ahead region
    /// (`Prefetch::NextPair`).
    pub prefetch: bool,
    /// The generated, software-pipelined assembly tiles where the ISA has
    /// them (AVX-512, MV >= 2); the intrinsic ones elsewhere.
    pub pipelined: bool,
    /// With `prefetch` and `pipelined`: the instances whose last pair walks
    /// the next call's first B, given in `TileCall::ahead` in place of an
    /// ahead region ([`crate::Kernel::execute_raw_then`]). Tiles without
    /// such an instance (MV = 1, the intrinsic ones) are the prefetching
    /// ones, which then see an empty ahead region.
    pub then: bool,
}

/// Expands to a `match (mv, nr)` over a grid, picking `$entry::<B, MV, NR, MASKED>`.
macro_rules! tile_table {
    ($entry:ident, $B:ty, $masked:ident, $mv:expr, $nr:expr;
     $($m:literal => [$($n:literal)*]),* $(,)?) => {
        match ($mv, $nr) {
            $($( ($m, $n) => Some($entry::<$B, $m, $n, $masked> as TileFn<$B>), )*)*
            _ => None,
        }
    };
}
pub(crate) use tile_table;
