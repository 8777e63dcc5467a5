//! Portable fp32 microkernels on the `wide` crate.
//!
//! ```text
//!   wide::f32x8 (two xmm on a baseline x86-64 build, one ymm with AVX,
//!   two q registers on aarch64). Main tile: MV=2, NR=3
//!
//!            b0   b1   b2
//!   A0 f32x8 [c0 ][c2 ][c4 ]      6 accumulators
//!   A1 f32x8 [c1 ][c3 ][c5 ]
//! ```
//!
//! Grid (MV: max NR): 1: 6, 2: 3 (sized for 16 xmm registers). `wide` picks its
//! implementation at compile time, so this kernel is as fast as the build's
//! target features allow and runs on any CPU the build runs on. A partial
//! last vector goes through a stack buffer: m edges only.

use super::{tile_table, IsaKernels};
use crate::batch::BatchSrc;
use crate::simd::{fma_chains, SimdF32};
use crate::tile::{tile, TileCall, TileFn};
use wide::f32x8;

#[derive(Clone, Copy)]
pub(crate) struct Portable;

impl SimdF32 for Portable {
    const LANES: usize = 8;
    type V = f32x8;
    type M = usize;
    #[inline(always)]
    unsafe fn mask(rows: usize) -> usize {
        rows
    }
    #[inline(always)]
    unsafe fn zero() -> f32x8 {
        f32x8::ZERO
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32x8 {
        f32x8::splat(x)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32x8 {
        f32x8::from(core::ptr::read_unaligned(p as *const [f32; 8]))
    }
    #[inline(always)]
    unsafe fn load_m(p: *const f32, rows: usize) -> f32x8 {
        let mut t = [0.0f32; 8];
        core::ptr::copy_nonoverlapping(p, t.as_mut_ptr(), rows);
        f32x8::from(t)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32x8) {
        core::ptr::write_unaligned(p as *mut [f32; 8], v.to_array())
    }
    #[inline(always)]
    unsafe fn store_m(p: *mut f32, v: f32x8, rows: usize) {
        let t = v.to_array();
        core::ptr::copy_nonoverlapping(t.as_ptr(), p, rows);
    }
    #[inline(always)]
    unsafe fn fma(a: f32x8, b: f32x8, c: f32x8) -> f32x8 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn add(a: f32x8, b: f32x8) -> f32x8 {
        a + b
    }
    #[inline(always)]
    unsafe fn relu(a: f32x8) -> f32x8 {
        // a < 0 is false for NaN, which keeps the NaN.
        let zero = f32x8::splat(0.0);
        a.simd_lt(zero).select(zero, a)
    }
    #[inline(always)]
    unsafe fn sum(a: f32x8) -> f32 {
        a.to_array().iter().sum()
    }
}

/// # Safety
/// See [`tile`].
unsafe fn entry<B: BatchSrc<f32>, const MV: usize, const NR: usize, const MASKED: bool>(
    t: &TileCall,
    src: &B,
    m0: usize,
    n0: usize,
    last_rows: usize,
) {
    tile::<Portable, B, MV, NR, MASKED, false>(t, src, m0, n0, last_rows)
}

pub(crate) struct Kernels;

impl IsaKernels for Kernels {
    const LANES: usize = 8;
    const GRID: &'static [usize] = &[6, 3];
    const ALWAYS_MASK: bool = false;
    const PROBE_FMAS_PER_ITER: u64 = 8 * 8;

    fn pick<B: BatchSrc<f32>, const MASKED: bool>(mv: usize, nr: usize) -> Option<TileFn<B>> {
        tile_table!(entry, B, MASKED, mv, nr;
            1 => [1 2 3 4 5 6],
            2 => [1 2 3],
        )
    }

    unsafe fn fma_probe(iters: u64) -> f32 {
        fma_chains::<Portable, 8>(iters)
    }
}
