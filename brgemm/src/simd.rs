//! The handful of vector operations a microkernel needs, one impl per ISA.
//!
//! Every method is `#[inline(always)]` in its impl so that, once inlined into an
//! ISA's `#[target_feature]` entry point, the intrinsics compile with that
//! feature set (the always-inliner runs before the ordinary inliner).

/// f32 vector operations of one ISA.
pub(crate) trait SimdF32: Copy {
    /// f32 lanes per register.
    const LANES: usize;
    /// One vector register.
    type V: Copy;
    /// A row mask for the last, partial vector of a tile.
    type M: Copy;

    /// Mask that keeps the first `rows` lanes (1..=LANES).
    ///
    /// # Safety
    /// See [`SimdF32::zero`].
    unsafe fn mask(rows: usize) -> Self::M;
    /// # Safety
    /// The ISA must be available; the same holds for every method below.
    unsafe fn zero() -> Self::V;
    /// # Safety
    /// See [`SimdF32::zero`].
    unsafe fn splat(x: f32) -> Self::V;
    /// # Safety
    /// `p` valid for `LANES` reads.
    unsafe fn load(p: *const f32) -> Self::V;
    /// # Safety
    /// `p` valid for the masked lanes; the others are read as zero and never touched.
    unsafe fn load_m(p: *const f32, m: Self::M) -> Self::V;
    /// # Safety
    /// `p` valid for `LANES` writes.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// # Safety
    /// `p` valid for the masked lanes; the others are not written.
    unsafe fn store_m(p: *mut f32, v: Self::V, m: Self::M);
    /// `a * b + c`, fused where the ISA has FMA.
    ///
    /// # Safety
    /// See [`SimdF32::zero`].
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// # Safety
    /// See [`SimdF32::zero`].
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// ReLU that propagates NaN: `a < 0 ? 0 : a` per lane (a NaN input stays
    /// NaN, so a diverged layer is seen downstream instead of hidden as 0).
    ///
    /// # Safety
    /// See [`SimdF32::zero`].
    unsafe fn relu(a: Self::V) -> Self::V;
    /// Horizontal sum (used by the peak probe only).
    ///
    /// # Safety
    /// See [`SimdF32::zero`].
    unsafe fn sum(a: Self::V) -> f32;
    /// Prefetch the cache line at `p`; a no-op where unsupported.
    ///
    /// # Safety
    /// Never faults; `p` need not be valid.
    #[inline(always)]
    unsafe fn prefetch(_p: *const f32) {}
    /// Prefetch the cache line at `p` into L2 only; a no-op where
    /// unsupported.
    ///
    /// # Safety
    /// Never faults; `p` need not be valid.
    #[inline(always)]
    unsafe fn prefetch_l2(_p: *const f32) {}
}

/// ACC independent FMA chains, `iters` steps each: the peak probe's loop.
///
/// # Safety
/// The ISA of `S` must be available.
#[inline(always)]
pub(crate) unsafe fn fma_chains<S: SimdF32, const ACC: usize>(iters: u64) -> f32 {
    let mut acc = [S::splat(1.0); ACC];
    // x slightly below 1 and a small y keep the values bounded and normal.
    let x = S::splat(std::hint::black_box(0.999_999));
    let y = S::splat(std::hint::black_box(1e-7));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = S::fma(*a, x, y);
        }
    }
    let mut s = 0.0;
    for a in acc {
        s += S::sum(a);
    }
    s
}
