//! AVX-512F fp32 microkernels: the hand-tuned ones.
//!
//! Two families of register tiles. The generic intrinsic tiles (`tile.rs`)
//! cover the whole grid; the generated, software-pipelined assembly tiles
//! (`build.rs`) cover MV = 2..4 and are what plans use by default.
//!
//! ```text
//!   Pipelined main tile for 64x64: MV=2, NR=12, 32 zmm registers
//!
//!   acc  zmm0-23    24 accumulators (2 vectors x 12 columns)
//!   A    zmm24-25   this k step's column of A
//!        zmm26-27   the next k step's column, loaded a whole step ahead
//!   B    zmm28-31   ring of 4 broadcasts, each loaded 3 columns (6 FMAs)
//!                   before the FMAs that read it
//!
//!   Intrinsic main tile for 64x64: MV=2, NR=14
//!   acc  zmm0-27, A zmm28-29, B: 14 broadcasts folded into the FMAs as
//!   vfmadd231ps zmm, zmm, dword ptr [..]{1to16}
//!
//!   Both: the last A vector is loaded with the row mask (all ones unless m
//!   tail; a masked load costs the same as a plain one, so every tile masks).
//! ```
//!
//! Why pipelining: this VM shares each core with a neighbour, and whenever
//! the neighbour is busy an FMA that must wait for a load issued in the same
//! uop (or just before it) slows the whole loop down, while the register-only
//! FMA probe does not move. Measured in an `asm!` harness, L1-resident
//! operands, medians of 31 interleaved rounds: 2x14 with folded broadcasts
//! 100-109 GFLOP/s, the same with A reloaded but B from a register 118-132,
//! pipelined 2x12 105-114, 3x8 109-119, 4x5 107-115; all of them 134-139
//! when the neighbour is quiet. In the library, alternating plans with and
//! without pipelined tiles in one process (`BRGEMM_PIPELINE=0` turns them
//! off): BRGEMM 64x64x64 x1.22-1.27, FC passes x1.07-1.25, LSTM x1.12-1.21
//! on the large shapes, conv passes x0.99-1.19.
//!
//! Intrinsic grid (MV: max NR): 1: 16 (load bound beyond), 2: 14, 3: 9, 4: 6.
//! Pipelined grid: 2: 12, 3: 8, 4: 5 (two A sets and a ring of at least two
//! broadcasts must fit beside the accumulators; 2: 11 for the prefetching
//! ones, short of general registers at 2x12); MV = 1 stays intrinsic, where
//! a separate broadcast per FMA costs more uops than it saves (0.8x).
//!
//! Software prefetch of A_{i+1}/B_{i+1} during the k loop of A_i (one line
//! of A per vector and one B line per k step, prefetcht0, and the same B
//! line of B_{i+4} with prefetcht1; see `tile.rs`) is a
//! second set of instances, chosen by `Descriptor::prefetch`. Measured
//! alternating with the plain kernel in one process: +5-35% when the batch
//! streams from L3 (16 MiB workloads; FC weights larger than L2), -5-19% when
//! it sits in L2, where the hardware prefetchers follow the column walk and
//! the extra loads only compete with the kernel's own. The pipelined family
//! has prefetching instances too (A_{i+1} and the ahead region, no B line: the
//! B panels these plans stream are the L2-resident ones): on FC (64, 4096,
//! 4096) fwd/bwd they run x1.17-1.19 against the intrinsic prefetching tiles
//! and x1.2-1.3 against pipelined tiles without prefetch.

use super::{tile_table, IsaKernels, TileFamily};
use crate::batch::BatchSrc;
use crate::simd::SimdF32;
use crate::tile::{store_tile, tile, TileCall, TileFn};
use core::arch::x86_64::*;

include!(concat!(env!("OUT_DIR"), "/avx512_pipe.rs"));

/// The chooser's grid for pipelined plans: the generated tiles for MV >= 2
/// (see `PIPE_GRID`), the intrinsic 1x16 for MV = 1, where a separate
/// broadcast per FMA costs more uops than it saves (measured 0.8x).
const PIPE_CHOICE_GRID: [usize; 4] = [16, PIPE_GRID[0], PIPE_GRID[1], PIPE_GRID[2]];
/// As `PIPE_CHOICE_GRID`, for prefetching plans.
const PIPE_PF_CHOICE_GRID: [usize; 4] = [16, PIPE_PF_GRID[0], PIPE_PF_GRID[1], PIPE_PF_GRID[2]];

#[derive(Clone, Copy)]
pub(crate) struct Avx512;

impl SimdF32 for Avx512 {
    const LANES: usize = 16;
    type V = __m512;
    type M = __mmask16;
    #[inline(always)]
    unsafe fn mask(rows: usize) -> __mmask16 {
        (((1u32 << rows) - 1) & 0xffff) as u16
    }
    #[inline(always)]
    unsafe fn zero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_m(p: *const f32, m: __mmask16) -> __m512 {
        _mm512_maskz_loadu_ps(m, p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        _mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn store_m(p: *mut f32, v: __m512, m: __mmask16) {
        _mm512_mask_storeu_ps(p, m, v)
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn relu(a: __m512) -> __m512 {
        // vmaxps returns its second operand when either is NaN.
        _mm512_max_ps(_mm512_setzero_ps(), a)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const f32) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    }
    #[inline(always)]
    unsafe fn prefetch_l2(p: *const f32) {
        _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
    }
    #[inline(always)]
    unsafe fn sum(a: __m512) -> f32 {
        _mm512_reduce_add_ps(a)
    }
}

/// # Safety
/// AVX-512F available; see [`tile`].
#[target_feature(enable = "avx512f")]
unsafe fn entry<B: BatchSrc<f32>, const MV: usize, const NR: usize, const MASKED: bool>(
    t: &TileCall,
    src: &B,
    m0: usize,
    n0: usize,
    last_rows: usize,
) {
    tile::<Avx512, B, MV, NR, MASKED, false>(t, src, m0, n0, last_rows)
}

/// As [`entry`], prefetching the next pair (`Prefetch::NextPair`).
///
/// # Safety
/// AVX-512F available; see [`tile`].
#[target_feature(enable = "avx512f")]
unsafe fn entry_pf<B: BatchSrc<f32>, const MV: usize, const NR: usize, const MASKED: bool>(
    t: &TileCall,
    src: &B,
    m0: usize,
    n0: usize,
    last_rows: usize,
) {
    tile::<Avx512, B, MV, NR, MASKED, true>(t, src, m0, n0, last_rows)
}

/// 24 independent zmm FMA chains in asm: the compiler cannot reorder,
/// spill or merge them, so the loop measures the FMA ports and nothing else.
#[target_feature(enable = "avx512f")]
unsafe fn probe(iters: u64) -> f32 {
    let mut out = 0.0f32;
    core::arch::asm!(
        "vbroadcastss zmm30, xmm0",
        "vxorps zmm31, zmm31, zmm31",
        "vmovaps zmm0, zmm30", "vmovaps zmm1, zmm30", "vmovaps zmm2, zmm30", "vmovaps zmm3, zmm30",
        "vmovaps zmm4, zmm30", "vmovaps zmm5, zmm30", "vmovaps zmm6, zmm30", "vmovaps zmm7, zmm30",
        "vmovaps zmm8, zmm30", "vmovaps zmm9, zmm30", "vmovaps zmm10, zmm30", "vmovaps zmm11, zmm30",
        "vmovaps zmm12, zmm30", "vmovaps zmm13, zmm30", "vmovaps zmm14, zmm30", "vmovaps zmm15, zmm30",
        "vmovaps zmm16, zmm30", "vmovaps zmm17, zmm30", "vmovaps zmm18, zmm30", "vmovaps zmm19, zmm30",
        "vmovaps zmm20, zmm30", "vmovaps zmm21, zmm30", "vmovaps zmm22, zmm30", "vmovaps zmm23, zmm30",
        "2:",
        "vfmadd231ps zmm0, zmm30, zmm31", "vfmadd231ps zmm1, zmm30, zmm31",
        "vfmadd231ps zmm2, zmm30, zmm31", "vfmadd231ps zmm3, zmm30, zmm31",
        "vfmadd231ps zmm4, zmm30, zmm31", "vfmadd231ps zmm5, zmm30, zmm31",
        "vfmadd231ps zmm6, zmm30, zmm31", "vfmadd231ps zmm7, zmm30, zmm31",
        "vfmadd231ps zmm8, zmm30, zmm31", "vfmadd231ps zmm9, zmm30, zmm31",
        "vfmadd231ps zmm10, zmm30, zmm31", "vfmadd231ps zmm11, zmm30, zmm31",
        "vfmadd231ps zmm12, zmm30, zmm31", "vfmadd231ps zmm13, zmm30, zmm31",
        "vfmadd231ps zmm14, zmm30, zmm31", "vfmadd231ps zmm15, zmm30, zmm31",
        "vfmadd231ps zmm16, zmm30, zmm31", "vfmadd231ps zmm17, zmm30, zmm31",
        "vfmadd231ps zmm18, zmm30, zmm31", "vfmadd231ps zmm19, zmm30, zmm31",
        "vfmadd231ps zmm20, zmm30, zmm31", "vfmadd231ps zmm21, zmm30, zmm31",
        "vfmadd231ps zmm22, zmm30, zmm31", "vfmadd231ps zmm23, zmm30, zmm31",
        "dec {n}",
        "jnz 2b",
        "vaddps zmm0, zmm0, zmm23",
        n = inout(reg) iters.max(1) => _,
        inout("xmm0") 1.0f32 => out,
        out("zmm1") _, out("zmm2") _, out("zmm3") _, out("zmm4") _, out("zmm5") _,
        out("zmm6") _, out("zmm7") _, out("zmm8") _, out("zmm9") _, out("zmm10") _,
        out("zmm11") _, out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
        out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _, out("zmm20") _,
        out("zmm21") _, out("zmm22") _, out("zmm23") _, out("zmm30") _, out("zmm31") _,
        options(nostack),
    );
    out
}

pub(crate) struct Kernels;

impl IsaKernels for Kernels {
    const LANES: usize = 16;
    const GRID: &'static [usize] = &[16, 14, 9, 6];
    const ALWAYS_MASK: bool = true;
    const PROBE_FMAS_PER_ITER: u64 = 24 * 16;

    fn pick<B: BatchSrc<f32>, const MASKED: bool>(mv: usize, nr: usize) -> Option<TileFn<B>> {
        tile_table!(entry, B, MASKED, mv, nr;
            1 => [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16],
            2 => [1 2 3 4 5 6 7 8 9 10 11 12 13 14],
            3 => [1 2 3 4 5 6 7 8 9],
            4 => [1 2 3 4 5 6],
        )
    }

    fn choice_grid(family: TileFamily) -> &'static [usize] {
        if family.pipelined && family.prefetch {
            &PIPE_PF_CHOICE_GRID
        } else if family.pipelined {
            &PIPE_CHOICE_GRID
        } else {
            Self::GRID
        }
    }

    fn tile_fn<B: BatchSrc<f32>>(
        mv: usize,
        nr: usize,
        _masked: bool,
        family: TileFamily,
    ) -> Option<TileFn<B>> {
        const MASKED: bool = true;
        if family.pipelined {
            if let Some(f) = pipe_tile::<B>(mv, nr, family.prefetch, family.prefetch && family.then)
            {
                return Some(f);
            }
        }
        if family.prefetch {
            tile_table!(entry_pf, B, MASKED, mv, nr;
                1 => [1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16],
                2 => [1 2 3 4 5 6 7 8 9 10 11 12 13 14],
                3 => [1 2 3 4 5 6 7 8 9],
                4 => [1 2 3 4 5 6],
            )
        } else {
            Self::pick::<B, MASKED>(mv, nr)
        }
    }

    unsafe fn fma_probe(iters: u64) -> f32 {
        probe(iters)
    }
}
