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
    /// Zero.
    const ZERO: Self;
    /// The value as f32.
    fn f32(self) -> f32;
    /// `dst[2i] = bf16(a[i])`, `dst[2i + 1] = bf16(b[i])` and `sum[i] +=
    /// a[i] + b[i]`: [`interleave_round`] for f32 rows; bf16 rows are
    /// copied as they are.
    #[doc(hidden)]
    fn interleave(dst: &mut [bf16], a: &[Self], b: &[Self], sum: &mut [f32]);
    /// [`transpose_round`] for f32 values; bf16 values are moved as they
    /// are.
    #[doc(hidden)]
    fn transpose(dst: &mut [bf16], ld: usize, src: &[Self], c: usize, n: usize, step: usize);
}

impl Widen for f32 {
    const ZERO: f32 = 0.0;
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    fn interleave(dst: &mut [bf16], a: &[f32], b: &[f32], sum: &mut [f32]) {
        interleave_round(dst, a, b, sum)
    }
    fn transpose(dst: &mut [bf16], ld: usize, src: &[f32], c: usize, n: usize, step: usize) {
        transpose_round(dst, ld, src, c, n, step)
    }
}

impl Widen for bf16 {
    const ZERO: bf16 = bf16::ZERO;
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    fn interleave(dst: &mut [bf16], a: &[bf16], b: &[bf16], sum: &mut [f32]) {
        interleave_bf16(dst, a, b, sum)
    }
    fn transpose(dst: &mut [bf16], ld: usize, src: &[bf16], c: usize, n: usize, step: usize) {
        transpose_bf16(dst, ld, src, c, n, step)
    }
}

crate::math::widest! {
    /// [`Widen::interleave`] of bf16 rows: the values copied into pairs,
    /// their widened sums added.
    fn interleave_bf16 / interleave_bf16_plain(
        dst: &mut [bf16],
        a: &[bf16],
        b: &[bf16],
        sum: &mut [f32],
    ) {
        for (((o, a), b), s) in dst.chunks_exact_mut(2).zip(a).zip(b).zip(sum) {
            o[0] = *a;
            o[1] = *b;
            *s += a.f32() + b.f32();
        }
    }
}

/// Rounds `src` to bf16 (nearest even) into `dst`, split over the pool.
/// `dst` is 64-byte aligned so that the bf16 kernels' tile rows are whole
/// cache lines (x1.4 on AMX against the 16-byte offset a `Vec` gets).
pub fn to_bf16(pool: &Pool, src: &[f32], dst: &mut AlignedVec<bf16>) {
    dst.resize(src.len(), bf16::ZERO);
    pool.for_slices(dst, |lo, out| round_slice(out, &src[lo..]));
}

/// Rounds `src` into `dst` (nearest even, as [`round_bf16`]), as far as the
/// shorter reaches: with the AVX512-BF16 conversion where the CPU has it
/// ([`brgemm::bf16::converts_in_hardware`]; 3.9x the compiled loop on
/// L1-resident values, 2x from L2, 1.2x from memory, Zen 4), else the loop
/// compiled for the kernels' ISA.
pub(crate) fn round_slice(dst: &mut [bf16], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if brgemm::bf16::converts_in_hardware() {
        // SAFETY: the CPU has the features `hw` is compiled for.
        return unsafe { hw::round_slice(dst, src) };
    }
    round_slice_vec(dst, src)
}

crate::math::widest! {
    /// [`round_slice`] without the conversion instruction, compiled for
    /// the kernels' ISA. Built for baseline x86-64 the loop stayed scalar:
    /// 28% of a bf16 3x3 convolution's forward (64 channels, 56x56), in the
    /// padded copy that rounds its input.
    pub(crate) fn round_slice_vec / round_slice_plain(dst: &mut [bf16], src: &[f32]) {
        for (o, v) in dst.iter_mut().zip(src) {
            *o = round_bf16(*v);
        }
    }
}

/// `dst[2i] = bf16(a[i])`, `dst[2i + 1] = bf16(b[i])`: two rows rounded
/// into VNNI pairs (the reduction dimension interleaved by two); and
/// `sum[i] += a[i] + b[i]` (a bias gradient in the same read). With the
/// AVX512-BF16 conversion where the CPU has it, as [`round_slice`].
pub(crate) fn interleave_round(dst: &mut [bf16], a: &[f32], b: &[f32], sum: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if brgemm::bf16::converts_in_hardware() {
        // SAFETY: the CPU has the features `hw` is compiled for.
        return unsafe { hw::interleave_round(dst, a, b, sum) };
    }
    interleave_round_vec(dst, a, b, sum)
}

crate::math::widest! {
    /// [`interleave_round`] without the conversion instruction.
    pub(crate) fn interleave_round_vec / interleave_round_plain(
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

type Scratch<T> = std::cell::RefCell<AlignedVec<T>>;

thread_local! {
    static SCRATCH: Scratch<f32> = Scratch::new(AlignedVec::new(brgemm::buffer::ALIGN));
    static SCRATCH_BF16: Scratch<bf16> = Scratch::new(AlignedVec::new(brgemm::buffer::ALIGN));
}

/// The thread's buffer `key` grown to at least `len` values.
fn grown<T: Copy>(key: &'static std::thread::LocalKey<Scratch<T>>, len: usize, zero: T) -> *mut T {
    key.with_borrow_mut(|b| {
        if b.len() < len {
            b.resize(len, zero);
        }
        b.as_mut_ptr()
    })
}

/// A thread's f32 scratch of at least `len` values (64-byte aligned, grown
/// on demand and kept for the thread's life): where a pass forms a block of
/// f32 output in L1 before rounding it into an output in bf16 alone, with
/// no allocation per block. Forming the pointer is safe; it stays valid
/// for reads and writes of `len` values on this thread until the thread
/// calls this again, which a pass must not do while it uses the block.
pub(crate) fn thread_scratch(len: usize) -> *mut f32 {
    grown(&SCRATCH, len, 0.0)
}

/// [`thread_scratch`] for bf16 values, a buffer of its own: where a pass
/// relays out an operand plane into L2 just before the kernel calls that
/// read it. The same contract: valid for `len` values on this thread until
/// its next call.
pub(crate) fn thread_scratch_bf16(len: usize) -> *mut bf16 {
    grown(&SCRATCH_BF16, len, bf16::ZERO)
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
    if brgemm::bf16::converts_in_hardware() {
        // SAFETY: the CPU has the features the function is compiled for;
        // the bounds are checked above.
        unsafe { transpose_round_hw(dst.as_mut_ptr(), ld, src.as_ptr(), c, n, step) };
        return;
    }
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

/// [`transpose_round`] on AVX-512: 16 pixels x 16 channels per step,
/// loaded as 16 vectors (the pixels' channel runs, masked at a channel
/// tail, zero past a pixel tail), transposed in registers, each channel's
/// 16 values rounded as [`round_bf16`] rounds and stored in one masked
/// store by `$store`: `transpose_round_avx512` narrows with `vpmovdw`
/// (0.26 ns per value from L1 against the generic path's 0.79, which stages
/// strided pixels, transposes 8x8 tiles, rounds and copies rows; from
/// memory, as the convolution update reads X, both wait on the loads: 1.1
/// against 1.4 ns per value, Zen 4), `transpose_round_hw` converts with
/// AVX512-BF16.
///
/// # Safety
/// The CPU has `$features`; `src` holds `((n - 1) * step + 1) * c` values
/// and `dst` `(c - 1) * ld + n`.
macro_rules! transpose_round_x86 {
    ($name:ident, $features:literal, $store:path) => {
        transpose_round_x86!($name, $features, $store, f32, _mm512_maskz_loadu_ps);
    };
    ($name:ident, $features:literal, $store:path, $src:ty, $load:path) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(
            dst: *mut bf16,
            ld: usize,
            src: *const $src,
            c: usize,
            n: usize,
            step: usize,
        ) {
            use std::arch::x86_64::*;
            let lanes = |k: usize| if k >= 16 { 0xFFFFu16 } else { (1u16 << k) - 1 };
            // The next 16 pixels' lines are prefetched while this block is
            // transposed: a block of 16 pixels of 64 f32 channels is one
            // 4 KiB page, which the hardware's stream prefetch does not
            // cross, so every block would start with a miss per line
            // (Sapphire Rapids, bf16 1x1 256->64 backward-weights from f32
            // X: 10.2-10.6 -> 7.3-7.8 ms on 2 threads, 19.9-20.7 -> 14.0-15.9
            // on one). Only for blocks of a page up to 16 KiB (L1 holds the
            // next one beside this one): with half-page blocks (64 bf16
            // channels) it measured level on 2 threads and 5-11% slower on
            // one.
            let size = src.wrapping_add(1) as usize - src as usize;
            let line = 64 / size;
            let ahead = if (256..=1024).contains(&(c * size)) {
                32
            } else {
                16
            };
            for p0 in (0..n).step_by(16) {
                let w = (n - p0).min(16);
                for i in p0 + 16..(p0 + ahead).min(n) {
                    let at = src.wrapping_add(i * step * c);
                    for l in (0..c).step_by(line) {
                        _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(l) as *const i8);
                    }
                }
                for j0 in (0..c).step_by(16) {
                    let cw = (c - j0).min(16);
                    let mut r = [_mm512_setzero_ps(); 16];
                    for (i, v) in r.iter_mut().enumerate().take(w) {
                        let at = src.add(((p0 + i) * step) * c + j0);
                        *v = $load(lanes(cw), at);
                    }
                    let t = transpose16(r);
                    for (j, v) in t.iter().enumerate().take(cw) {
                        $store(*v, dst.add((j0 + j) * ld + p0), lanes(w));
                    }
                }
            }
        }
    };
}
transpose_round_x86!(transpose_round_avx512, "avx512f", hw::store_narrowed);
transpose_round_x86!(
    transpose_round_hw,
    "avx512f,avx512bf16,avx512bw,avx512vl,avx512dq",
    hw::store_converted
);
transpose_round_x86!(
    transpose_bf16_avx512,
    "avx512f,avx512bw,avx512vl",
    hw::store_high_halves,
    bf16,
    hw::load_widened
);

/// [`transpose_round`] of bf16 values (exact: no rounding), for operands
/// that arrive in bf16 alone: 16 x 16 tiles widened into f32 lanes,
/// transposed and narrowed as the f32 path does, where the CPU has
/// AVX-512 BW and VL; else element by element.
pub(crate) fn transpose_bf16(
    dst: &mut [bf16],
    ld: usize,
    src: &[bf16],
    c: usize,
    n: usize,
    step: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    assert!(src.len() >= ((n - 1) * step + 1) * c && dst.len() >= (c - 1) * ld + n);
    #[cfg(target_arch = "x86_64")]
    if brgemm::Isa::selected() == Ok(brgemm::Isa::Avx512)
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
    {
        // SAFETY: the CPU has the features the function is compiled for;
        // the bounds are checked above.
        unsafe { transpose_bf16_avx512(dst.as_mut_ptr(), ld, src.as_ptr(), c, n, step) };
        return;
    }
    for p in 0..n {
        let px = &src[p * step * c..][..c];
        for (j, v) in px.iter().enumerate() {
            dst[j * ld + p] = *v;
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

/// The rounding loops on x86 vectors: [`round_bf16`]'s integer rounding on
/// 16 lanes (AVX-512F), and the AVX512-BF16 conversion, which rounds to
/// nearest even as [`round_bf16`] does except that it flushes subnormal
/// inputs to zero: a vector with a subnormal lane (`vfpclassps`, rare)
/// takes the integer rounding, so every path gives the same bits.
#[cfg(target_arch = "x86_64")]
mod hw {
    use super::{bf16, round_bf16};
    use std::arch::x86_64::*;

    /// [`round_bf16`] on 16 lanes, each result in its lane's low half.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn round_bits(b: __m512i) -> __m512i {
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
        let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
        _mm512_mask_blend_epi32(nan, rounded, quiet)
    }

    /// The lanes of `mask` of 16 bf16 values at `at` widened to f32 (zero
    /// elsewhere).
    ///
    /// # Safety
    /// The masked lanes of `at` are readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn load_widened(mask: u16, at: *const bf16) -> __m512 {
        // SAFETY: the masked lanes are readable (the contract).
        let h = unsafe { _mm256_maskz_loadu_epi16(mask, at as *const i16) };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// Stores the high halves of `v`'s lanes of `mask` at `at`: widened
    /// bf16 values back as they were (no rounding to do).
    ///
    /// # Safety
    /// The masked lanes of `at` are writable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn store_high_halves(v: __m512, at: *mut bf16, mask: u16) {
        let out = _mm512_srli_epi32::<16>(_mm512_castps_si512(v));
        // SAFETY: the masked lanes are writable (the contract).
        unsafe { _mm512_mask_cvtepi32_storeu_epi16(at as *mut i16, mask, out) };
    }

    /// Rounds `v` and stores the lanes of `mask` at `at` (`vpmovdw`).
    ///
    /// # Safety
    /// The masked lanes of `at` are writable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn store_narrowed(v: __m512, at: *mut bf16, mask: u16) {
        let out = round_bits(_mm512_castps_si512(v));
        // SAFETY: the masked lanes are writable (the contract).
        unsafe { _mm512_mask_cvtepi32_storeu_epi16(at as *mut i16, mask, out) };
    }

    /// 16 values rounded as [`round_bf16`] rounds.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl,avx512dq")]
    fn round16(v: __m512) -> __m256i {
        if _mm512_fpclass_ps_mask::<0x20>(v) == 0 {
            // SAFETY: both are 256 bits of plain data.
            unsafe { std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v)) }
        } else {
            _mm512_cvtepi32_epi16(round_bits(_mm512_castps_si512(v)))
        }
    }

    /// 32 values, `lo` then `hi`, rounded as [`round_bf16`] rounds.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl,avx512dq")]
    fn round32(lo: __m512, hi: __m512) -> __m512i {
        let sub = _mm512_fpclass_ps_mask::<0x20>(lo) | _mm512_fpclass_ps_mask::<0x20>(hi);
        if sub == 0 {
            // SAFETY: both are 512 bits of plain data.
            unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
        } else {
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(round16(lo)), round16(hi))
        }
    }

    /// Rounds `v` and stores the lanes of `mask` at `at`.
    ///
    /// # Safety
    /// The masked lanes of `at` are writable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl,avx512dq")]
    pub(super) unsafe fn store_converted(v: __m512, at: *mut bf16, mask: u16) {
        // SAFETY: the masked lanes are writable (the contract).
        unsafe { _mm256_mask_storeu_epi16(at as *mut i16, mask, round16(v)) };
    }

    /// [`super::round_slice`], 32 values per step.
    ///
    /// # Safety
    /// The CPU has the features this is compiled for.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl,avx512dq")]
    pub(super) unsafe fn round_slice(dst: &mut [bf16], src: &[f32]) {
        let n = dst.len().min(src.len());
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 <= n, the length of both.
            unsafe {
                let out = round32(_mm512_loadu_ps(s.add(i)), _mm512_loadu_ps(s.add(i + 16)));
                _mm512_storeu_si512(d.add(i) as *mut __m512i, out);
            }
            i += 32;
        }
        for (o, v) in dst[i..n].iter_mut().zip(&src[i..n]) {
            *o = round_bf16(*v);
        }
    }

    /// [`super::interleave_round`], 16 pairs per step: the two rows'
    /// values converted side by side, then interleaved by `vpermw`.
    ///
    /// # Safety
    /// The CPU has the features this is compiled for.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw,avx512vl,avx512dq")]
    pub(super) unsafe fn interleave_round(dst: &mut [bf16], a: &[f32], b: &[f32], sum: &mut [f32]) {
        let n = (dst.len() / 2).min(a.len()).min(b.len()).min(sum.len());
        let (d, pa, pb, ps) = (dst.as_mut_ptr(), a.as_ptr(), b.as_ptr(), sum.as_mut_ptr());
        // Word i of the result: a's value i / 2 (words 0-15), or b's (16-31).
        let pairs = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n: within a, b and sum, and 2 (i + 16)
            // within dst.
            unsafe {
                let (va, vb) = (_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)));
                let both = round32(va, vb);
                let out = _mm512_permutexvar_epi16(pairs, both);
                _mm512_storeu_si512(d.add(2 * i) as *mut __m512i, out);
                let s = _mm512_add_ps(_mm512_loadu_ps(ps.add(i)), _mm512_add_ps(va, vb));
                _mm512_storeu_ps(ps.add(i), s);
            }
            i += 16;
        }
        super::interleave_round_plain(&mut dst[2 * i..], &a[i..], &b[i..], &mut sum[i..]);
    }
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

    /// [`values`], and the same with its subnormals kept only at 3 and
    /// 700: the hardware conversion's vectors with and without one.
    fn value_sets(n: usize) -> [Vec<f32>; 2] {
        let all = values(n);
        let mut few = all.clone();
        for (i, v) in few.iter_mut().enumerate() {
            if v.is_subnormal() && i != 3 && i != 700 {
                *v = 0.5;
            }
        }
        [all, few]
    }

    #[test]
    fn rounding_loops_compiled_for_the_isa_equal_the_plain_ones() {
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for src in value_sets(1000) {
            let want: Vec<u16> = src.iter().map(|v| round_bf16(*v).to_bits()).collect();
            // Every length around the 32-value steps, from every offset.
            for (lo, len) in [(0, 1000), (1, 999), (5, 31), (7, 33), (0, 64), (3, 0)] {
                let src = &src[lo..lo + len];
                let mut out = [vec![bf16::ZERO; len], vec![bf16::ZERO; len]];
                let mut plain = vec![bf16::ZERO; len];
                round_slice(&mut out[0], src);
                round_slice_vec(&mut out[1], src);
                round_slice_plain(&mut plain, src);
                for o in &out {
                    assert_eq!(bits(o), bits(&plain), "offset {lo} length {len}");
                }
                assert_eq!(bits(&plain), want[lo..lo + len], "offset {lo} length {len}");
            }
            let want = |i: usize| round_bf16(src[i]).to_bits();
            let fbits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for pairs in [500, 37, 16, 5] {
                let (a, b) = (&src[..pairs], &src[500..500 + pairs]);
                let mut out = [vec![bf16::ZERO; 2 * pairs], vec![bf16::ZERO; 2 * pairs]];
                let mut sums = [vec![1.0f32; pairs], vec![1.0f32; pairs]];
                let (mut plain, mut plain_sum) = (vec![bf16::ZERO; 2 * pairs], vec![1.0; pairs]);
                interleave_round(&mut out[0], a, b, &mut sums[0]);
                interleave_round_vec(&mut out[1], a, b, &mut sums[1]);
                interleave_round_plain(&mut plain, a, b, &mut plain_sum);
                for (o, s) in out.iter().zip(&sums) {
                    assert_eq!(bits(o), bits(&plain), "{pairs} pairs");
                    assert_eq!(fbits(s), fbits(&plain_sum), "{pairs} pairs");
                }
                for i in 0..pairs {
                    assert_eq!(plain[2 * i].to_bits(), want(i), "pair {i}");
                    assert_eq!(plain[2 * i + 1].to_bits(), want(500 + i), "pair {i}");
                    assert_eq!(plain_sum[i].to_bits(), (1.0 + (a[i] + b[i])).to_bits());
                }
            }
        }
        let src = values(1000);
        let mut a = vec![bf16::ZERO; 1000];
        round_slice(&mut a, &src);
        assert_eq!(a[7].to_bits(), 0x3F80);
        assert_eq!(a[8].to_bits(), 0x3F82);
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
            for (step, set) in (1..=3).flat_map(|s| [(s, 0), (s, 1)]) {
                let src = value_sets(((n - 1) * step + 1) * c)[set].clone();
                // The path this CPU takes, and the generic one everywhere.
                let mut paths: Vec<(&str, Vec<bf16>)> = Vec::new();
                let mut dst = vec![bf16::from_f32(7.0); c * ld];
                transpose_round(&mut dst, ld, &src, c, n, step);
                paths.push(("dispatched", dst));
                let mut dst = vec![bf16::from_f32(7.0); c * ld];
                transpose_round_generic(&mut dst, ld, &src, c, n, step);
                paths.push(("generic", dst));
                #[cfg(target_arch = "x86_64")]
                if brgemm::Isa::selected() == Ok(brgemm::Isa::Avx512) {
                    let mut dst = vec![bf16::from_f32(7.0); c * ld];
                    // SAFETY: AVX-512F (selected); the sizes as above.
                    unsafe {
                        transpose_round_avx512(dst.as_mut_ptr(), ld, src.as_ptr(), c, n, step)
                    };
                    paths.push(("avx512", dst));
                }
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
