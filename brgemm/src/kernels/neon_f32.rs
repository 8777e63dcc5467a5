//! AArch64 NEON fp32 microkernels.
//!
//! ```text
//!   32 q registers, 4 f32 lanes each. Main tile: MV=4, NR=6
//!
//!            b0   b1   b2   b3   b4   b5     (ld1r / fmla by element)
//!   A0 q    [c0 ][c4 ][c8 ][c12][c16][c20]
//!   A1 q    [c1 ][c5 ][c9 ][c13][c17][c21]    24 accumulators
//!   A2 q    [c2 ][c6 ][c10][c14][c18][c22]     4 A vectors
//!   A3 q    [c3 ][c7 ][c11][c15][c19][c23]     NR broadcasts
//! ```
//!
//! Grid (MV: max NR): 1: 12, 2: 12, 3: 8, 4: 6. NEON has no masked loads, so
//! the partial last vector of an m-edge tile goes through a stack buffer.

use super::{tile_table, IsaKernels};
use crate::batch::BatchSrc;
use crate::simd::{fma_chains, SimdF32};
use crate::tile::{tile, TileCall, TileFn};
use core::arch::aarch64::*;

#[derive(Clone, Copy)]
pub(crate) struct Neon;

impl SimdF32 for Neon {
    const LANES: usize = 4;
    type V = float32x4_t;
    type M = usize;
    #[inline(always)]
    unsafe fn mask(rows: usize) -> usize {
        rows
    }
    #[inline(always)]
    unsafe fn zero() -> float32x4_t {
        vdupq_n_f32(0.0)
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> float32x4_t {
        vdupq_n_f32(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> float32x4_t {
        vld1q_f32(p)
    }
    #[inline(always)]
    unsafe fn load_m(p: *const f32, rows: usize) -> float32x4_t {
        let mut t = [0.0f32; 4];
        core::ptr::copy_nonoverlapping(p, t.as_mut_ptr(), rows);
        vld1q_f32(t.as_ptr())
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: float32x4_t) {
        vst1q_f32(p, v)
    }
    #[inline(always)]
    unsafe fn store_m(p: *mut f32, v: float32x4_t, rows: usize) {
        let mut t = [0.0f32; 4];
        vst1q_f32(t.as_mut_ptr(), v);
        core::ptr::copy_nonoverlapping(t.as_ptr(), p, rows);
    }
    #[inline(always)]
    unsafe fn fma(a: float32x4_t, b: float32x4_t, c: float32x4_t) -> float32x4_t {
        vfmaq_f32(c, a, b)
    }
    #[inline(always)]
    unsafe fn add(a: float32x4_t, b: float32x4_t) -> float32x4_t {
        vaddq_f32(a, b)
    }
    #[inline(always)]
    unsafe fn relu(a: float32x4_t) -> float32x4_t {
        // FMAX returns NaN when either operand is NaN.
        vmaxq_f32(a, vdupq_n_f32(0.0))
    }
    #[inline(always)]
    unsafe fn sum(a: float32x4_t) -> f32 {
        vaddvq_f32(a)
    }
}

/// # Safety
/// NEON available; see [`tile`].
#[target_feature(enable = "neon")]
unsafe fn entry<B: BatchSrc<f32>, const MV: usize, const NR: usize, const MASKED: bool>(
    t: &TileCall,
    src: &B,
    m0: usize,
    n0: usize,
    last_rows: usize,
) {
    tile::<Neon, B, MV, NR, MASKED, false>(t, src, m0, n0, last_rows)
}

#[target_feature(enable = "neon")]
unsafe fn probe(iters: u64) -> f32 {
    fma_chains::<Neon, 24>(iters)
}

pub(crate) struct Kernels;

impl IsaKernels for Kernels {
    const LANES: usize = 4;
    const GRID: &'static [usize] = &[12, 12, 8, 6];
    const ALWAYS_MASK: bool = false;
    const PROBE_FMAS_PER_ITER: u64 = 24 * 4;

    fn pick<B: BatchSrc<f32>, const MASKED: bool>(mv: usize, nr: usize) -> Option<TileFn<B>> {
        tile_table!(entry, B, MASKED, mv, nr;
            1 => [1 2 3 4 5 6 7 8 9 10 11 12],
            2 => [1 2 3 4 5 6 7 8 9 10 11 12],
            3 => [1 2 3 4 5 6 7 8],
            4 => [1 2 3 4 5 6],
        )
    }

    unsafe fn fma_probe(iters: u64) -> f32 {
        probe(iters)
    }
}
