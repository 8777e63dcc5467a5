//! What the bf16 passes share: rounding f32 to bf16, and packing f32 weight
//! blocks into the VNNI layout the bf16 kernel reads for A, for a pass and
//! for its transposed twin (forward and backward-data) in one sweep.

use crate::layout::SyncPtr;
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

/// Rounds `src` to bf16 (nearest even) into `dst`, split over the pool.
/// `dst` is 64-byte aligned so that the bf16 kernels' tile rows are whole
/// cache lines (x1.4 on AMX against the 16-byte offset a `Vec` gets).
pub fn to_bf16(pool: &Pool, src: &[f32], dst: &mut AlignedVec<bf16>) {
    dst.resize(src.len(), bf16::ZERO);
    pool.for_slices(dst, |lo, out| round_slice(out, &src[lo..]));
}

/// Rounds `src` into `dst` (nearest even), as far as the shorter reaches.
pub(crate) fn round_slice(dst: &mut [bf16], src: &[f32]) {
    for (o, v) in dst.iter_mut().zip(src) {
        *o = round_bf16(*v);
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
    fwd.resize(len, bf16::ZERO);
    bwd.resize(len, bf16::ZERO);
    let (pv, pt) = (SyncPtr(fwd.as_mut_ptr()), SyncPtr(bwd.as_mut_ptr()));
    thread_local! {
        static ROUNDED: std::cell::RefCell<AlignedVec<bf16>> =
            std::cell::RefCell::new(AlignedVec::new(brgemm::buffer::ALIGN));
    }
    pool.for_each(g.outer * g.inner, |b| {
        let (o, i) = (b / g.inner, b % g.inner);
        for t in 0..g.taps {
            let from = (b * g.taps + t) * blk;
            let to_t = ((i * g.outer + o) * g.taps + t) * blk;
            // SAFETY: block (o, i, t) of `fwd` and (i, o, t) of `bwd` are
            // written by this thread only; both hold `len` elements.
            let (dv, dt) = unsafe {
                (
                    std::slice::from_raw_parts_mut(pv.get().add(from), blk),
                    std::slice::from_raw_parts_mut(pt.get().add(to_t), blk),
                )
            };
            ROUNDED.with_borrow_mut(|r| {
                r.resize(blk, bf16::ZERO);
                round_slice(r, &src[from..][..blk]);
                // Forward A (m = bo, k = bi): rows i, i+1 interleaved.
                for (ip, out) in dv.chunks_exact_mut(2 * bo).enumerate() {
                    let (r0, r1) = (&r[2 * ip * bo..][..bo], &r[(2 * ip + 1) * bo..][..bo]);
                    for ((o, a), b) in out.chunks_exact_mut(2).zip(r0).zip(r1) {
                        o[0] = *a;
                        o[1] = *b;
                    }
                }
                // Transposed A (m = bi, k = bo): the pair (j, j+1) of row i
                // goes to k-pair row j/2 at column i, so read as 32-bit
                // words r is a bi x bo/2 matrix and the block its
                // transpose. Moved as f32 bit patterns, never computed on.
                // SAFETY: r is 64-byte aligned and dt starts a multiple of
                // blk (even) elements into a 64-byte aligned buffer, so
                // both are 4-byte aligned; each holds blk bf16 = blk/2 words.
                let (words, dst) = unsafe {
                    (
                        std::slice::from_raw_parts(r.as_ptr() as *const f32, blk / 2),
                        std::slice::from_raw_parts_mut(dt.as_mut_ptr() as *mut f32, blk / 2),
                    )
                };
                crate::layout::transpose_block(words, dst, bi, bo / 2);
            });
        }
    });
}
