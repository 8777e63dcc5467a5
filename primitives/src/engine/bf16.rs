//! What the bf16 passes share: rounding f32 to bf16, and packing f32 weight
//! blocks into the VNNI layout the bf16 kernel reads for A, for a pass and
//! for its transposed twin (forward and backward-data) in one sweep.

use crate::layout::{transpose_block, SyncPtr};
use crate::threads::Pool;
use brgemm::bf16::bf16;
use brgemm::AlignedVec;

/// f32 -> bf16, round to nearest even, branch-free so loops vectorise
/// (`half`'s conversion branches on NaN). NaN stays a quiet NaN; infinities
/// and overflow to infinity come out as IEEE rounding gives them.
#[inline(always)]
pub fn round_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    bf16::from_bits(if nan {
        ((b >> 16) | 0x40) as u16
    } else {
        rounded as u16
    })
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for brgemm::bf16::bf16 {}
}

/// An activation element that a pass reads as f32: f32 itself, or bf16
/// widened (exactly: the bf16 bits are the top half of the f32's). A pass
/// generic over it reads a tensor in either precision with the same
/// arithmetic (e.g. [`crate::BatchNorm::forward_train_to`] on a bf16
/// convolution's output).
pub trait Widen: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The value as f32.
    fn f32(self) -> f32;
}

impl Widen for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Widen for bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// Rounds `src` to bf16 (nearest even) into `dst`, split over the pool.
/// `dst` is 64-byte aligned so that the bf16 kernels' tile rows are whole
/// cache lines (x1.4 on AMX against the 16-byte offset a `Vec` gets).
pub fn to_bf16(pool: &Pool, src: &[f32], dst: &mut AlignedVec<bf16>) {
    dst.resize(src.len(), bf16::ZERO);
    pool.for_slices(dst, |lo, out| round_slice(out, &src[lo..]));
}

crate::math::widest! {
    /// Rounds `src` into `dst` (nearest even), as far as the shorter
    /// reaches; compiled for the kernels' ISA. Built for baseline x86-64
    /// the loop stayed scalar: 28% of a bf16 3x3 convolution's forward
    /// (64 channels, 56x56), in the padded copy that rounds its input.
    pub(crate) fn round_slice / round_slice_plain(dst: &mut [bf16], src: &[f32]) {
        for (o, v) in dst.iter_mut().zip(src) {
            *o = round_bf16(*v);
        }
    }
}

crate::math::widest! {
    /// `dst[2i] = bf16(a[i])`, `dst[2i + 1] = bf16(b[i])`: two rows rounded
    /// into VNNI pairs (the reduction dimension interleaved by two); and
    /// `sum[i] += a[i] + b[i]` (a bias gradient in the same read).
    pub(crate) fn interleave_round / interleave_round_plain(
        dst: &mut [bf16],
        a: &[f32],
        b: &[f32],
        sum: &mut [f32],
    ) {
        for (((o, a), b), s) in dst.chunks_exact_mut(2).zip(a).zip(b).zip(sum) {
            o[0] = round_bf16(*a);
            o[1] = round_bf16(*b);
            *s += a + b;
        }
    }
}

/// The bf16 copy of a pass's f32 output that the pass writes as it goes,
/// element for element in the output's layout: the next layer's bf16
/// operand without a rounding sweep of its own (mixed precision keeps
/// activations and gradients in bf16 between layers). Pieces are rounded
/// while the pass still holds them in L1 ([`Twin::PIECE`]).
#[derive(Clone, Copy)]
pub(crate) struct Twin<'a>(
    Option<(SyncPtr<bf16>, usize)>,
    std::marker::PhantomData<&'a mut [bf16]>,
);

impl<'a> Twin<'a> {
    /// Values of f32 output a pass computes before rounding them (16 KiB).
    pub(crate) const PIECE: usize = 4096;

    /// The copy `to` of an output of `len` values (none without `to`); an
    /// error names a length that differs.
    pub(crate) fn new(what: &str, to: Option<&'a mut [bf16]>, len: usize) -> crate::Result<Self> {
        let to = match to {
            None => None,
            Some(t) => {
                crate::error::check_buf(what, t.len(), len)?;
                Some((SyncPtr(t.as_mut_ptr()), len))
            }
        };
        Ok(Twin(to, std::marker::PhantomData))
    }

    /// Rounds `out`, the output's values from element `at` on, into the
    /// copy (nothing without one).
    ///
    /// # Safety
    /// `at + out.len()` is at most the output's length (`out` is a part of
    /// the output whose length [`Twin::new`] checked the copy against), and
    /// no other thread writes those elements of the copy meanwhile (each
    /// thread rounds the part of the output it computed).
    pub(crate) unsafe fn round(self, at: usize, out: &[f32]) {
        if let Some((p, len)) = self.0 {
            debug_assert!(at + out.len() <= len, "twin range past its end");
            // SAFETY: in bounds and this thread's alone (the contract).
            let dst = unsafe { std::slice::from_raw_parts_mut(p.get().add(at), out.len()) };
            round_slice(dst, out);
        }
    }
}

/// Rounds `n` pixels of `c` channels, `step` pixels apart in `src` (1:
/// the row-major `n x c` block), into `c` rows of `n` values, `ld` apart,
/// in `dst` (channel-major): on AVX-512 in registers, 16 x 16 at a time
/// ([`transpose_round_avx512`]), else [`transpose_round_generic`].
/// Element by element (strided loads) it took 25% of a bf16 3x3
/// convolution's backward-weights (64 channels, 56x56).
pub(crate) fn transpose_round(
    dst: &mut [bf16],
    ld: usize,
    src: &[f32],
    c: usize,
    n: usize,
    step: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    // Every pixel read and every row written lies inside the slices: the
    // fast path's raw accesses rely on these, checked once per call.
    assert!(src.len() >= ((n - 1) * step + 1) * c && dst.len() >= (c - 1) * ld + n);
    #[cfg(target_arch = "x86_64")]
    if brgemm::Isa::selected() == Ok(brgemm::Isa::Avx512) {
        // SAFETY: `selected` returns only ISAs this CPU has (AVX-512F);
        // the bounds are checked above.
        unsafe { transpose_round_avx512(dst.as_mut_ptr(), ld, src.as_ptr(), c, n, step) };
        return;
    }
    transpose_round_generic(dst, ld, src, c, n, step);
}

/// [`transpose_round`] 16 pixels at a time: the 16 x c tile transposed
/// ([`transpose_block`]; strided pixels gathered first), rounded in one
/// vector sweep, its rows copied as runs of 16 (element by element above
/// 64 channels).
fn transpose_round_generic(
    dst: &mut [bf16],
    ld: usize,
    src: &[f32],
    c: usize,
    n: usize,
    step: usize,
) {
    const W: usize = 16;
    const MAX_C: usize = 64;
    let px = |p: usize| &src[p * step * c..][..c];
    if c > MAX_C {
        for p in 0..n {
            for (j, v) in px(p).iter().enumerate() {
                dst[j * ld + p] = round_bf16(*v);
            }
        }
        return;
    }
    let (mut f, mut h) = ([0.0f32; W * MAX_C], [bf16::ZERO; W * MAX_C]);
    let mut g = [0.0f32; W * MAX_C];
    let mut p0 = 0;
    while p0 < n {
        let w = (n - p0).min(W);
        let tile = if step == 1 {
            &src[p0 * c..][..w * c]
        } else {
            for (i, d) in g[..w * c].chunks_exact_mut(c).enumerate() {
                d.copy_from_slice(px(p0 + i));
            }
            &g[..w * c]
        };
        transpose_block(tile, &mut f, w, c);
        round_slice(&mut h[..w * c], &f[..w * c]);
        for (j, row) in h[..w * c].chunks_exact(w).enumerate() {
            dst[j * ld + p0..][..w].copy_from_slice(row);
        }
        p0 += w;
    }
}

/// [`transpose_round`] on AVX-512F: 16 pixels x 16 channels per step,
/// loaded as 16 vectors (the pixels' channel runs, masked at a channel
/// tail, zero past a pixel tail), transposed in registers, rounded as
/// [`round_bf16`] rounds, and each channel's 16 values narrowed and stored
/// in one masked `vpmovdw`: 0.26 ns per value from L1 against the generic
/// path's 0.79 (which stages strided pixels, transposes 8x8 tiles, rounds
/// and copies rows). From memory, as the convolution update reads X, both
/// wait on the loads (1.1 against 1.4 ns per value, Zen 4).
///
/// # Safety
/// The CPU has AVX-512F; `src` holds `((n - 1) * step + 1) * c` values
/// and `dst` `(c - 1) * ld + n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_round_avx512(
    dst: *mut bf16,
    ld: usize,
    src: *const f32,
    c: usize,
    n: usize,
    step: usize,
) {
    use std::arch::x86_64::*;
    let lanes = |k: usize| if k >= 16 { 0xFFFFu16 } else { (1u16 << k) - 1 };
    for p0 in (0..n).step_by(16) {
        let w = (n - p0).min(16);
        for j0 in (0..c).step_by(16) {
            let cw = (c - j0).min(16);
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, v) in r.iter_mut().enumerate().take(w) {
                *v = _mm512_maskz_loadu_ps(lanes(cw), src.add(((p0 + i) * step) * c + j0));
            }
            let t = transpose16(r);
            for (j, v) in t.iter().enumerate().take(cw) {
                let b = _mm512_castps_si512(*v);
                let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
                let bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
                let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
                let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFF_FFFF));
                let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
                let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
                let out = _mm512_mask_blend_epi32(nan, rounded, quiet);
                let at = dst.add((j0 + j) * ld + p0) as *mut i16;
                _mm512_mask_cvtepi32_storeu_epi16(at, lanes(w), out);
            }
        }
    }
}

/// The 16 x 16 transpose of 16 vectors: lane j of the result's vector i
/// is lane i of input vector j.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16(mut r: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // Pairs of rows interleaved by lanes, then by lane pairs (within
    // 128-bit quarters), then the quarters exchanged in two rounds.
    let mut t = [_mm512_setzero_ps(); 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
    }
    let mut u = [_mm512_setzero_ps(); 16];
    for k in 0..4 {
        let (a, b) = (4 * k, 4 * k + 2);
        u[4 * k] = _mm512_shuffle_ps::<0x44>(t[a], t[b]);
        u[4 * k + 1] = _mm512_shuffle_ps::<0xEE>(t[a], t[b]);
        u[4 * k + 2] = _mm512_shuffle_ps::<0x44>(t[a + 1], t[b + 1]);
        u[4 * k + 3] = _mm512_shuffle_ps::<0xEE>(t[a + 1], t[b + 1]);
    }
    for h in 0..2 {
        for k in 0..4 {
            let (a, b) = (8 * h + k, 8 * h + k + 4);
            t[8 * h + k] = _mm512_shuffle_f32x4::<0x88>(u[a], u[b]);
            t[8 * h + k + 4] = _mm512_shuffle_f32x4::<0xDD>(u[a], u[b]);
        }
    }
    for k in 0..8 {
        r[k] = _mm512_shuffle_f32x4::<0x88>(t[k], t[k + 8]);
        r[k + 8] = _mm512_shuffle_f32x4::<0xDD>(t[k], t[k + 8]);
    }
    r
}

/// The block grid of a weight tensor to pack: `outer x inner` block pairs
/// (K blocks x C blocks) of `taps` blocks each, every block `bi` rows of
/// `bo` values (`[bi][bo]`: the column-major `bo x bi` A of the pass that
/// maps `bi` inputs to `bo` outputs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WeightGrid {
    pub(crate) outer: usize,
    pub(crate) inner: usize,
    pub(crate) taps: usize,
    pub(crate) bi: usize,
    pub(crate) bo: usize,
}

/// Sizes a packed weight copy to `len` elements. A buffer that must grow is
/// made anew on huge pages where large ([`brgemm::buffer::aligned_vec_huge`],
/// as the f32 weights are): the copies live as long as the layer and every
/// pass streams them; grown by `resize` they sat on 4 KiB pages
/// (docs/tuning-notes.md, huge pages).
pub(crate) fn fit_weights(buf: &mut AlignedVec<bf16>, len: usize) {
    if buf.capacity() < len {
        *buf = brgemm::buffer::aligned_vec_huge(len, bf16::ZERO);
    } else {
        buf.resize(len, bf16::ZERO);
    }
}

/// Rounds the f32 weights `src` (blocks `[outer][inner][taps][bi][bo]`) and
/// packs them into VNNI A operands: `fwd` in the same block order, pairs
/// along `bi`; `bwd` the transposed pass's, blocks `[inner][outer][taps]`
/// of `bo` rows of `bi`, pairs along `bo`. Both even.
pub(crate) fn pack_vnni(
    pool: &Pool,
    src: &[f32],
    g: WeightGrid,
    fwd: &mut AlignedVec<bf16>,
    bwd: &mut AlignedVec<bf16>,
) {
    let (bi, bo, blk) = (g.bi, g.bo, g.bi * g.bo);
    let len = g.outer * g.inner * g.taps * blk;
    fit_weights(fwd, len);
    fit_weights(bwd, len);
    let (pv, pt) = (SyncPtr(fwd.as_mut_ptr()), SyncPtr(bwd.as_mut_ptr()));
    pool.for_each(g.outer * g.inner, |b| {
        let (o, i) = (b / g.inner, b % g.inner);
        for t in 0..g.taps {
            let from = (b * g.taps + t) * blk;
            let to_t = ((i * g.outer + o) * g.taps + t) * blk;
            // SAFETY: block (o, i, t) of `fwd` and (i, o, t) of `bwd` are
            // written by this thread only; both hold `len` elements, and
            // `bwd`'s block starts a multiple of blk (even) elements into
            // a 64-byte aligned buffer.
            unsafe {
                let dv = std::slice::from_raw_parts_mut(pv.get().add(from), blk);
                let dt = std::slice::from_raw_parts_mut(pt.get().add(to_t), blk);
                pack_block(&src[from..][..blk], bi, bo, dv, dt);
            }
        }
    });
}

/// One f32 weight block (`bi` rows of `bo`) of [`pack_vnni`], rounded into
/// its forward VNNI block `dv` and its transposed pass's block `dt` (both
/// `bi * bo`, `bi` and `bo` even), through an L1 copy of the rounded block.
/// Also what a fused optimizer step calls on each block it has just updated.
///
/// # Safety
/// `dt` is 4-byte aligned (it is read and written as 32-bit words).
pub(crate) unsafe fn pack_block(
    src: &[f32],
    bi: usize,
    bo: usize,
    dv: &mut [bf16],
    dt: &mut [bf16],
) {
    thread_local! {
        static ROUNDED: std::cell::RefCell<AlignedVec<bf16>> =
            std::cell::RefCell::new(AlignedVec::new(brgemm::buffer::ALIGN));
    }
    let blk = bi * bo;
    debug_assert!(src.len() == blk && dv.len() == blk && dt.len() == blk);
    debug_assert_eq!(dt.as_ptr() as usize % 4, 0);
    ROUNDED.with_borrow_mut(|r| {
        r.resize(blk, bf16::ZERO);
        round_slice(r, src);
        // Forward A (m = bo, k = bi): rows i, i+1 interleaved.
        for (ip, out) in dv.chunks_exact_mut(2 * bo).enumerate() {
            let (r0, r1) = (&r[2 * ip * bo..][..bo], &r[(2 * ip + 1) * bo..][..bo]);
            for ((o, a), b) in out.chunks_exact_mut(2).zip(r0).zip(r1) {
                o[0] = *a;
                o[1] = *b;
            }
        }
        // Transposed A (m = bi, k = bo): the pair (j, j+1) of row i goes
        // to k-pair row j/2 at column i, so read as 32-bit words r is a
        // bi x bo/2 matrix and the block its transpose. Moved as f32 bit
        // patterns, never computed on.
        // SAFETY: r is 64-byte aligned, dt 4-byte aligned (the caller's
        // contract); each holds blk bf16 = blk/2 words.
        let (words, dst) = unsafe {
            (
                std::slice::from_raw_parts(r.as_ptr() as *const f32, blk / 2),
                std::slice::from_raw_parts_mut(dt.as_mut_ptr() as *mut f32, blk / 2),
            )
        };
        crate::layout::transpose_block(words, dst, bi, bo / 2);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values with ties, NaN, infinities, denormals and signed zeros.
    fn values(n: usize) -> Vec<f32> {
        let special = [
            f32::NAN,
            f32::INFINITY,
            -f32::INFINITY,
            1e-40,
            -1e-40,
            -0.0,
            0.0,
            f32::from_bits(0x3F80_8000), // a tie: rounds to even
            f32::from_bits(0x3F81_8000),
        ];
        (0..n)
            .map(|i| {
                special
                    .get(i % 23)
                    .copied()
                    .unwrap_or((i as f32 * 0.37).sin() * 1e3)
            })
            .collect()
    }

    #[test]
    fn rounding_loops_compiled_for_the_isa_equal_the_plain_ones() {
        let src = values(1000);
        let (mut a, mut b) = (vec![bf16::ZERO; 1000], vec![bf16::ZERO; 1000]);
        round_slice(&mut a, &src);
        round_slice_plain(&mut b, &src);
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
        assert_eq!(a[7].to_bits(), 0x3F80);
        assert_eq!(a[8].to_bits(), 0x3F82);
        let (mut a, mut b) = (vec![bf16::ZERO; 1000], vec![bf16::ZERO; 1000]);
        let (mut sa, mut sb) = (vec![1.0f32; 500], vec![1.0f32; 500]);
        interleave_round(&mut a, &src[..500], &src[500..], &mut sa);
        interleave_round_plain(&mut b, &src[..500], &src[500..], &mut sb);
        assert_eq!(bits(&a), bits(&b));
        let fbits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(fbits(&sa), fbits(&sb));
        assert_eq!(sa[30], 1.0 + src[30] + src[530]);
        assert_eq!(a[1].to_bits(), round_bf16(src[500]).to_bits());
    }

    #[test]
    fn transpose_round_writes_channel_rows_for_every_width_and_tail() {
        for (c, n, ld) in [
            (64, 56, 60),
            (32, 28, 30),
            (8, 3, 3),
            (16, 16, 16),
            (6, 21, 25),
            (72, 5, 9),
        ] {
            // Pixels side by side, and every second or third one (the
            // phases of a strided convolution).
            for step in 1..=3 {
                let src = values(((n - 1) * step + 1) * c);
                // The path this CPU takes, and the generic one everywhere.
                let mut paths: Vec<(&str, Vec<bf16>)> = Vec::new();
                let mut dst = vec![bf16::from_f32(7.0); c * ld];
                transpose_round(&mut dst, ld, &src, c, n, step);
                paths.push(("dispatched", dst));
                let mut dst = vec![bf16::from_f32(7.0); c * ld];
                transpose_round_generic(&mut dst, ld, &src, c, n, step);
                paths.push(("generic", dst));
                for (path, dst) in &paths {
                    for j in 0..c {
                        for p in 0..ld {
                            let want = if p < n {
                                round_bf16(src[p * step * c + j]).to_bits()
                            } else {
                                bf16::from_f32(7.0).to_bits()
                            };
                            let at = format!("{path}: c {c} n {n} step {step} j {j} p {p}");
                            assert_eq!(dst[j * ld + p].to_bits(), want, "{at}");
                        }
                    }
                }
            }
        }
    }
}
