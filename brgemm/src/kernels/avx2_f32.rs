//! AVX2 + FMA fp32 microkernels.
//!
//! ```text
//!   16 ymm registers, 8 f32 lanes each. Main tile: MV=2, NR=6
//!
//!            b0   b1   b2   b3   b4   b5     (vbroadcastss from memory)
//!   A0 ymm  [c0 ][c2 ][c4 ][c6 ][c8 ][c10]    12 accumulators
//!   A1 ymm  [c1 ][c3 ][c5 ][c7 ][c9 ][c11]     2 A vectors, 1 broadcast
//! ```
//!
//! Grid (MV: max NR): 1: 12, 2: 6, 3: 4. A masked load (vmaskmovps) costs more
//! than a plain one here, so m-edge tiles are separate `MASKED` instances.

use super::{tile_table, IsaKernels};
use crate::batch::BatchSrc;
use crate::simd::SimdF32;
use crate::tile::{tile, TileCall, TileFn};
use core::arch::x86_64::*;

#[derive(Clone, Copy)]
pub(crate) struct Avx2;

/// Eight -1 then eight 0: the mask for `rows` lanes starts at `8 - rows`.
static MASK_TABLE: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

impl SimdF32 for Avx2 {
    const LANES: usize = 8;
    type V = __m256;
    type M = __m256i;
    #[inline(always)]
    unsafe fn mask(rows: usize) -> __m256i {
        _mm256_loadu_si256(MASK_TABLE.as_ptr().add(8 - rows) as *const __m256i)
    }
    #[inline(always)]
    unsafe fn zero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn load_m(p: *const f32, m: __m256i) -> __m256 {
        _mm256_maskload_ps(p, m)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        _mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn store_m(p: *mut f32, v: __m256, m: __m256i) {
        _mm256_maskstore_ps(p, m, v)
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(a, b)
    }
    #[inline(always)]
    unsafe fn relu(a: __m256) -> __m256 {
        // maxps returns its second operand when either is NaN.
        _mm256_max_ps(_mm256_setzero_ps(), a)
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const f32) {
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    }
    #[inline(always)]
    unsafe fn sum(a: __m256) -> f32 {
        let mut t = [0.0f32; 8];
        _mm256_storeu_ps(t.as_mut_ptr(), a);
        t.iter().sum()
    }
}

/// # Safety
/// AVX2 and FMA available; see [`tile`].
#[target_feature(enable = "avx2,fma")]
unsafe fn entry<B: BatchSrc<f32>, const MV: usize, const NR: usize, const MASKED: bool>(
    t: &TileCall,
    src: &B,
    m0: usize,
    n0: usize,
    last_rows: usize,
) {
    tile::<Avx2, B, MV, NR, MASKED, false>(t, src, m0, n0, last_rows)
}

/// 12 independent ymm FMA chains in asm (see the AVX-512 probe).
#[target_feature(enable = "avx2,fma")]
unsafe fn probe(iters: u64) -> f32 {
    let mut out = 0.0f32;
    core::arch::asm!(
        "vbroadcastss ymm14, xmm0",
        "vxorps ymm15, ymm15, ymm15",
        "vmovaps ymm0, ymm14", "vmovaps ymm1, ymm14", "vmovaps ymm2, ymm14", "vmovaps ymm3, ymm14",
        "vmovaps ymm4, ymm14", "vmovaps ymm5, ymm14", "vmovaps ymm6, ymm14", "vmovaps ymm7, ymm14",
        "vmovaps ymm8, ymm14", "vmovaps ymm9, ymm14", "vmovaps ymm10, ymm14", "vmovaps ymm11, ymm14",
        "2:",
        "vfmadd231ps ymm0, ymm14, ymm15", "vfmadd231ps ymm1, ymm14, ymm15",
        "vfmadd231ps ymm2, ymm14, ymm15", "vfmadd231ps ymm3, ymm14, ymm15",
        "vfmadd231ps ymm4, ymm14, ymm15", "vfmadd231ps ymm5, ymm14, ymm15",
        "vfmadd231ps ymm6, ymm14, ymm15", "vfmadd231ps ymm7, ymm14, ymm15",
        "vfmadd231ps ymm8, ymm14, ymm15", "vfmadd231ps ymm9, ymm14, ymm15",
        "vfmadd231ps ymm10, ymm14, ymm15", "vfmadd231ps ymm11, ymm14, ymm15",
        "dec {n}",
        "jnz 2b",
        "vaddps ymm0, ymm0, ymm11",
        "vzeroupper",
        n = inout(reg) iters.max(1) => _,
        inout("xmm0") 1.0f32 => out,
        out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
        out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _,
        out("ymm11") _, out("ymm14") _, out("ymm15") _,
        options(nostack),
    );
    out
}

pub(crate) struct Kernels;

impl IsaKernels for Kernels {
    const LANES: usize = 8;
    const GRID: &'static [usize] = &[12, 6, 4];
    const ALWAYS_MASK: bool = false;
    const PROBE_FMAS_PER_ITER: u64 = 12 * 8;

    fn pick<B: BatchSrc<f32>, const MASKED: bool>(mv: usize, nr: usize) -> Option<TileFn<B>> {
        tile_table!(entry, B, MASKED, mv, nr;
            1 => [1 2 3 4 5 6 7 8 9 10 11 12],
            2 => [1 2 3 4 5 6],
            3 => [1 2 3 4],
        )
    }

    unsafe fn fma_probe(iters: u64) -> f32 {
        probe(iters)
    }
}
