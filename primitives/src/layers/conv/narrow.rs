//! Backward-data for inputs narrower than a vector (the RGB stem: 3
//! channels), with dX's pixels in the kernel's vector lanes.
//!
//! The gather passes put a block of input channels in the vector
//! dimension: with 3 channels a 16-lane AVX-512 vector does 3 lanes of
//! work. Here dX goes a row at a time, split by column phases (columns
//! modulo the stride, as in the `phased` module): phase b's pixels of a
//! row are one BRGEMM call with m = those pixels (112 for the stem, seven
//! full vectors) and n = the input channels, reduced over the taps that
//! reach the row and the K channels of dY, with A = dY's row `i - u`
//! transposed (channels by columns, so that a tap's column shift is an
//! offset into it) and B the tap's filter. Each dY row is transposed once,
//! when the first dX row that reads it comes up, into a ring of as many
//! rows as one dX row reads (four for the stem, 115 KiB: L2); a call's batch
//! runs (tap row, K chunk, tap column), so the column shifts of one chunk
//! reread lines in L1. The call's C (channels by pixels) is then scattered
//! into the row of dX.
//!
//! It replaced tap columns (`cols[pixel][(r, s, c)] = W^T dY[pixel]`, a
//! GEMM with m = R*S*C = 147 whose columns were then added into dX): the
//! stem's backward-data at minibatch 16 from 58-61% to 86-87% of peak on
//! one thread, 58-59% to 75-78% on two (Zen 4, bench builds alternated;
//! `docs/tuning-notes.md`).

use super::params::ConvParams;
use super::phased::{Axis, AxisPhase};
use crate::error::Result;
use crate::layout::{transpose_block_ld, SyncPtr};
use crate::threads::Pool;
use brgemm::{AlignedVec, BatchForm, Descriptor, Kernel, Prefetch, RawBatch};
use std::sync::{Arc, Mutex};

/// K per batch item at most: 16 transposed stem rows are 7 KiB, which
/// the calls of the other tap columns find in L1.
const KC: usize = 16;

/// A column phase that some tap reaches, with its kernel.
struct ColPhase {
    /// The phase's pixels in a row (the kernel's m) and the first one's
    /// column in dX.
    len: usize,
    first: usize,
    kern: Arc<Kernel>,
    /// (tap column s, A's column offset in a ring row for its shift).
    taps: Vec<(usize, usize)>,
    /// Where its C starts in a thread's C buffer.
    c_at: usize,
}

/// A planned backward-data pass for layers of one input-channel block of
/// fewer than 16 channels and more than one tap.
pub(super) struct Narrow {
    p: ConvParams,
    /// dX's channel block (its only one); dY's K blocks and their width.
    bc: usize,
    kb: usize,
    bk: usize,
    /// K per batch item, and K padded to a multiple of it.
    kc: usize,
    kp: usize,
    /// Per row phase: the taps and dY row shifts that reach it.
    rows: Vec<AxisPhase>,
    cols: Vec<ColPhase>,
    /// Floats of a thread's C buffer: every column phase's C.
    c_len: usize,
    /// A ring row: `lda` floats, dY column x at `x - x0`; the columns
    /// `qa..qb` are dY's, the rest zero.
    x0: isize,
    qa: usize,
    qb: usize,
    lda: usize,
    /// Transposed dY rows a thread keeps.
    ring: usize,
    /// Whether a dX row has pixels or channels that no call writes.
    fill: bool,
    /// The filter per tap, `[R*S][C][kp]`, zero past K.
    b: Mutex<AlignedVec<f32>>,
    /// Per thread: the ring, then the calls' C.
    scratch: Mutex<AlignedVec<f32>>,
}

impl Narrow {
    /// The pass, where it applies: one C block narrower than a vector and a
    /// filter of more than one tap.
    pub(super) fn plan(p: &ConvParams, bc: usize, bk: usize) -> Result<Option<Narrow>> {
        if p.c > bc || bc >= 16 || p.r * p.s == 1 {
            return Ok(None);
        }
        let q = p.q();
        let rows = Axis::of(p, false).phases();
        let all = Axis::of(p, true).phases();
        let live: Vec<&AxisPhase> = (all.iter())
            .filter(|ph| ph.len > 0 && !ph.taps.is_empty())
            .collect();
        let shift = |ph: &AxisPhase, f: fn(usize, usize) -> usize| {
            ph.taps.iter().map(|t| t.1).reduce(f).unwrap_or(0) as isize
        };
        // Phase pixel j and shift v read dY column j - v.
        let x0 = (live.iter())
            .map(|ph| ph.lo as isize - shift(ph, usize::max))
            .min()
            .unwrap_or(0);
        let x1 = (live.iter())
            .map(|ph| (ph.lo + ph.len) as isize - shift(ph, usize::min))
            .max()
            .unwrap_or(0);
        let lda = ((x1 - x0) as usize).max(1);
        let chunks = p.k.div_ceil(KC);
        let kc = p.k.div_ceil(chunks);
        let mut c_at = 0;
        let mut cols = Vec::with_capacity(live.len());
        for ph in live {
            let desc = Descriptor::new(ph.len, p.c, kc)
                .lda(lda)
                .ldb(kc * chunks)
                .ldc(ph.len)
                .batch_form(BatchForm::Offset)
                .prefetch(Prefetch::NextPair);
            let taps = (ph.taps.iter())
                .map(|&(s, v)| (s, (ph.lo as isize - v as isize - x0) as usize))
                .collect();
            cols.push(ColPhase {
                len: ph.len,
                first: ph.first,
                kern: brgemm::dispatch(&desc)?,
                taps,
                c_at,
            });
            c_at += p.c * ph.len;
        }
        let umax = rows.iter().flat_map(|ph| ph.taps.iter().map(|t| t.1)).max();
        Ok(Some(Narrow {
            p: *p,
            bc,
            kb: p.k.div_ceil(bk),
            bk,
            kc,
            kp: kc * chunks,
            rows,
            x0,
            qa: x0.max(0) as usize,
            qb: (x1.max(0) as usize).min(q),
            lda,
            ring: umax.unwrap_or(0) + 1,
            fill: bc > p.c || all.iter().any(|ph| ph.len > 0 && ph.taps.is_empty()),
            cols,
            c_len: c_at,
            b: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
            scratch: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
        }))
    }

    /// dX from dY and the transposed filter `wt` (`[1][Kb][R][S][bk][bc]`).
    /// Sizes were checked by the caller.
    pub(super) fn run(&self, pool: &Pool, dy: &[f32], wt: &[f32], dx: &mut [f32]) {
        let (p, bc, bk, kp) = (&self.p, self.bc, self.bk, self.kp);
        let (cn, rs, pp) = (p.c, p.r * p.s, p.p());
        let mut b = self.b.lock().unwrap_or_else(|e| e.into_inner());
        b.resize(rs * cn * kp, 0.0);
        for kbi in 0..self.kb {
            for f in 0..rs {
                for kk in 0..bk.min(p.k - kbi * bk) {
                    for c in 0..cn {
                        b[(f * cn + c) * kp + kbi * bk + kk] =
                            wt[((kbi * rs + f) * bk + kk) * bc + c];
                    }
                }
            }
        }
        let slot = kp * self.lda;
        let ring_len = self.ring * slot;
        let per_thread = ring_len + self.c_len;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        // Zero once: a ring row's padding columns and its rows past K are
        // never written (the geometry is the plan's, the same every call).
        scratch.resize(pool.threads() * per_thread, 0.0);
        // Bands of rows when there are few images to share (each band
        // transposes the dY rows its first dX row reads again).
        let bands = (2 * pool.threads()).div_ceil(p.n).clamp(1, p.h);
        let band_rows = p.h.div_ceil(bands);
        let (sp, dxp, b) = (
            SyncPtr(scratch.as_mut_ptr()),
            SyncPtr(dx.as_mut_ptr()),
            &b[..],
        );
        pool.broadcast(|t| {
            // SAFETY: thread t alone uses its part of the scratch.
            let s =
                unsafe { std::slice::from_raw_parts_mut(sp.get().add(t * per_thread), per_thread) };
            let (ring, cbuf) = s.split_at_mut(ring_len);
            let mut tags = vec![usize::MAX; self.ring];
            let (mut a_offs, mut b_offs) = (Vec::new(), Vec::new());
            for item in pool.share(t, p.n * bands) {
                let (ni, band) = (item / bands, item % bands);
                tags.fill(usize::MAX);
                for y in band * band_rows..((band + 1) * band_rows).min(p.h) {
                    // SAFETY: row y of image ni belongs to this item.
                    let row = unsafe {
                        let at = (ni * p.h + y) * p.w * bc;
                        std::slice::from_raw_parts_mut(dxp.get().add(at), p.w * bc)
                    };
                    let yp = y + p.pad_h;
                    let i = yp / p.stride_h;
                    let present = || {
                        (self.rows[yp % p.stride_h].taps.iter())
                            .filter(|&&(_, u)| i >= u && i - u < pp)
                    };
                    if present().next().is_none() {
                        row.fill(0.0);
                        continue;
                    }
                    for &(_, u) in present() {
                        let (pr, sl) = (i - u, (i - u) % self.ring);
                        if tags[sl] != pr {
                            self.transpose_row(dy, ni, pr, &mut ring[sl * slot..][..slot]);
                            tags[sl] = pr;
                        }
                    }
                    if self.fill {
                        row.fill(0.0);
                    }
                    touch(row);
                    let parts = p.stride_h * self.cols.len();
                    for (ci, cp) in self.cols.iter().enumerate() {
                        let part = yp % p.stride_h * self.cols.len() + ci;
                        let (ahead, ahead_len) = self.ahead(dy, ni, i + 1, part, parts);
                        a_offs.clear();
                        b_offs.clear();
                        for &(r, u) in present() {
                            let base = (i - u) % self.ring * slot;
                            for k0 in (0..kp).step_by(self.kc) {
                                for &(s, col) in &cp.taps {
                                    a_offs.push(base + k0 * self.lda + col);
                                    b_offs.push((r * p.s + s) * cn * kp + k0);
                                }
                            }
                        }
                        let len = cp.len;
                        let c = &mut cbuf[cp.c_at..][..cn * len];
                        let batch = RawBatch::Offset {
                            a: ring.as_ptr(),
                            b: b.as_ptr(),
                            a_offs: a_offs.as_ptr(),
                            b_offs: b_offs.as_ptr(),
                            count: a_offs.len(),
                        };
                        // SAFETY: every offset leaves a whole A (k rows of
                        // `lda`, m = len from its column) inside the ring
                        // (the plan's x0..x1) and a whole B inside `b`; C
                        // holds cn * len floats.
                        unsafe {
                            (cp.kern).execute_raw_ahead(
                                batch,
                                c.as_mut_ptr(),
                                std::ptr::null(),
                                ahead,
                                ahead_len,
                            )
                        };
                        let at = &mut row[cp.first * bc..];
                        let px = p.stride_w * bc;
                        match cn {
                            3 => scatter::<3>(at, c, px),
                            1 => scatter::<1>(at, c, px),
                            _ => scatter_any(at, c, cn, px),
                        }
                    }
                }
            }
        });
    }

    /// The calls of the dX rows that read dY row `next - 1` last bring in
    /// row `next`, in `parts` parts, part `part` now, while they compute:
    /// the next row's transpose finds it in cache (with the dX row's lines
    /// asked for before its calls: the stem at minibatch 16, one thread,
    /// 62% -> 71-81% of peak).
    fn ahead(
        &self,
        dy: &[f32],
        ni: usize,
        next: usize,
        part: usize,
        parts: usize,
    ) -> (*const f32, usize) {
        let (pp, plane) = (self.p.p(), self.p.q() * self.bk);
        let chunk = (self.kb * plane).div_ceil(parts);
        let start = part * chunk;
        if next >= pp || start >= self.kb * plane {
            return (std::ptr::null(), 0);
        }
        let (kbi, off) = (start / plane, start % plane);
        let at = ((ni * self.kb + kbi) * pp + next) * plane + off;
        (dy[at..].as_ptr(), chunk.min(plane - off))
    }

    /// dY row `pr` of image `ni`, channels by columns, into a ring row.
    fn transpose_row(&self, dy: &[f32], ni: usize, pr: usize, dst: &mut [f32]) {
        let (p, bk, lda) = (&self.p, self.bk, self.lda);
        let (pp, q) = (p.p(), p.q());
        let width = self.qb.saturating_sub(self.qa);
        let at = (self.qa as isize - self.x0) as usize;
        for kbi in 0..self.kb {
            let src = &dy[(((ni * self.kb + kbi) * pp + pr) * q + self.qa) * bk..][..width * bk];
            let dst = &mut dst[kbi * bk * lda + at..];
            let real = bk.min(p.k - kbi * bk);
            if real == bk {
                transpose_block_ld(src, dst, width, bk, lda);
            } else {
                // The last block's padding channels stay out: rows past K
                // must stay zero.
                for kk in 0..real {
                    for j in 0..width {
                        dst[kk * lda + j] = src[j * bk + kk];
                    }
                }
            }
        }
    }
}

/// Asks for the cache lines of `s` ahead of its use (no effect off x86-64).
fn touch(s: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for l in s.chunks(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch never faults, and the line lies in `s`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(l.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = s;
}

/// `row[j * step + ch] = c[ch][j]` for C's `CN` rows of `c.len() / CN`
/// pixels `step` floats apart in the row: the channel count
/// known to the compiler, so a pixel is a few moves, not a loop (the
/// stem's backward-data spent 5% here, Zen 4).
fn scatter<const CN: usize>(row: &mut [f32], c: &[f32], step: usize) {
    let len = c.len() / CN;
    let rows: [&[f32]; CN] = std::array::from_fn(|ch| &c[ch * len..][..len]);
    for (j, px) in row.chunks_mut(step).take(len).enumerate() {
        let px = &mut px[..CN];
        for ch in 0..CN {
            px[ch] = rows[ch][j];
        }
    }
}

/// [`scatter`] for any channel count.
fn scatter_any(row: &mut [f32], c: &[f32], cn: usize, step: usize) {
    let len = c.len() / cn;
    for (j, px) in row.chunks_mut(step).take(len).enumerate() {
        for (ch, d) in px[..cn].iter_mut().enumerate() {
            *d = c[ch * len + j];
        }
    }
}
