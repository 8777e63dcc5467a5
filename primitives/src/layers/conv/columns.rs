//! Backward-data for inputs narrower than a vector (the RGB stem: 3
//! channels), through the columns of all taps.
//!
//! The gather passes put the input channels of one block in the kernel's
//! vector dimension (m = bc): with 3 channels a 16-lane AVX-512 vector does
//! 3 lanes of work (measured: the 7x7/2 stem's backward-data at 16-17% of
//! peak). Here each output pixel's contributions to every tap and channel,
//! `cols[pixel][(r, s, c)] = sum_k W[k][c][r][s] dY[pixel][k]`, are one
//! BRGEMM per run of output pixels with m = R*S*C (147 for the stem, 10
//! vectors of which the last is 3/16 full), batch over the K blocks; the
//! columns are then added into a zero-padded dX plane per image (for each
//! tap row, the S*C values of a pixel fall on one run of the plane's row
//! when the columns are not dilated) and the plane's interior is copied
//! out. Each image belongs to one thread, so the additions do not race.

use super::params::ConvParams;
use crate::error::Result;
use crate::threads::Pool;
use crate::view::{View, ViewMut};
use brgemm::{AlignedVec, BatchForm, Descriptor, Kernel, Prefetch, RawBatch};
use std::sync::Arc;
use std::sync::Mutex;

/// A planned backward-data pass through tap columns, for layers of one
/// input-channel block of fewer than 16 channels and more than one tap.
pub(super) struct Columns {
    p: ConvParams,
    /// Channels per (only) C block, K blocks and their width.
    bc: usize,
    kb: usize,
    bk: usize,
    /// Output pixels per call.
    bq: usize,
    /// The whole reduction in one call (beta = 0, no epilogue): a run of
    /// `bq` pixels, and the row's shorter last run.
    main: Arc<Kernel>,
    tail: Option<Arc<Kernel>>,
    a_off: Vec<usize>,
    b_off: Vec<usize>,
    /// The filter as `[K][R][S][bc]` (the kernel's column-major A, m = R*S*bc)
    /// and each thread's padded dX plane and column block.
    a: Mutex<AlignedVec<f32>>,
    scratch: Mutex<AlignedVec<f32>>,
}

impl Columns {
    /// The pass, where it applies: one C block narrower than a vector and a
    /// filter of more than one tap.
    pub(super) fn plan(p: &ConvParams, bc: usize, bk: usize, bq: usize) -> Result<Option<Columns>> {
        if p.c > bc || bc >= 16 || p.r * p.s == 1 {
            return Ok(None);
        }
        let m = p.r * p.s * bc;
        let (kb, pq) = (p.k.div_ceil(bk), p.p() * p.q());
        let bq = bq.clamp(1, p.q());
        let desc = |n| {
            Descriptor::new(m, n, bk)
                .ldb(bk)
                .batch_form(BatchForm::Offset)
                .prefetch(Prefetch::NextPair)
        };
        let main = brgemm::dispatch(&desc(bq))?;
        let tail = (!p.q().is_multiple_of(bq))
            .then(|| brgemm::dispatch(&desc(p.q() % bq)))
            .transpose()?;
        Ok(Some(Columns {
            p: *p,
            bc,
            kb,
            bk,
            bq,
            main,
            tail,
            a_off: (0..kb).map(|b| b * bk * m).collect(),
            b_off: (0..kb).map(|b| b * pq * bk).collect(),
            a: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
            scratch: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
        }))
    }

    /// dX from dY and the transposed filter `wt` (`[1][Kb][R][S][bk][bc]`).
    /// Sizes were checked by the caller.
    pub(super) fn run(&self, pool: &Pool, dy: &[f32], wt: &[f32], dx: &mut [f32]) {
        let (p, bc, bk) = (&self.p, self.bc, self.bk);
        let (rs, m) = (p.r * p.s, p.r * p.s * bc);
        let (pp, q) = (p.p(), p.q());
        let (hp, wp) = (p.h + 2 * p.pad_h, p.w + 2 * p.pad_w);
        let plane = hp * wp * bc;
        let cols = self.bq * m;
        let mut a = self.a.lock().unwrap_or_else(|e| e.into_inner());
        a.resize(self.kb * bk * m, 0.0);
        // a[k][x][c] = wt[kb][x][kk][c] for k = kb * bk + kk and tap x.
        for (kbi, blk) in a.chunks_exact_mut(bk * m).enumerate() {
            for x in 0..rs {
                let src = &wt[(kbi * rs + x) * bk * bc..][..bk * bc];
                for kk in 0..bk {
                    blk[kk * m + x * bc..][..bc].copy_from_slice(&src[kk * bc..][..bc]);
                }
            }
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        scratch.resize(pool.threads() * (plane + cols), 0.0);
        let (a, sv) = (&a[..], ViewMut::new(&mut scratch, [plane + cols]));
        let dyv = View::new(dy, [self.kb * pp * q * bk, q * bk, bk]);
        let dxv = ViewMut::new(dx, [p.h * p.w * bc, p.w * bc]);
        let geo = Geom {
            bc,
            taps: (p.r, p.s),
            dil: (p.dil_h, p.dil_w),
            step: p.stride_w,
            wp,
        };
        pool.broadcast(|t| {
            // SAFETY: thread t alone uses its scratch part.
            let (pad, col) = unsafe {
                let s = sv.at([t]);
                (
                    std::slice::from_raw_parts_mut(s, plane),
                    std::slice::from_raw_parts_mut(s.add(plane), cols),
                )
            };
            for ni in pool.share(t, p.n) {
                pad.fill(0.0);
                for pi in 0..pp {
                    for q0 in (0..q).step_by(self.bq) {
                        let nq = self.bq.min(q - q0);
                        let ks = if nq == self.bq {
                            &self.main
                        } else {
                            self.tail.as_ref().unwrap()
                        };
                        let batch_b = dyv.at([ni, pi, q0]);
                        let batch = RawBatch::Offset {
                            a: a.as_ptr(),
                            b: batch_b,
                            a_offs: self.a_off.as_ptr(),
                            b_offs: self.b_off.as_ptr(),
                            count: self.kb,
                        };
                        // Each call's dY rows are read once, from memory:
                        // the kernel brings in the next call's, which in
                        // dY's layout follow this call's (the next run, or
                        // the next row's first) while it computes (the
                        // stem, minibatch 16, alternated in one process on
                        // Zen 4: x1.085-1.10 on 1 and 2 threads).
                        let ahead = batch_b.wrapping_add(nq * bk);
                        // SAFETY: the offsets stay inside A and this
                        // image's dY; `col` holds nq * m floats; `ahead`
                        // is only prefetched.
                        unsafe {
                            ks.execute_raw_ahead(
                                batch,
                                col.as_mut_ptr(),
                                std::ptr::null(),
                                ahead,
                                self.bq * bk,
                            )
                        };
                        let at = (pi * p.stride_h * wp + q0 * p.stride_w) * bc;
                        add_columns(&mut pad[at..], &col[..nq * m], &geo);
                    }
                }
                for y in 0..p.h {
                    let src = &pad[((y + p.pad_h) * wp + p.pad_w) * bc..][..p.w * bc];
                    // SAFETY: image ni's rows of dX belong to this thread.
                    unsafe {
                        std::slice::from_raw_parts_mut(dxv.at([ni, y]), p.w * bc)
                            .copy_from_slice(src)
                    };
                }
            }
        });
    }
}

/// What [`add_columns`] needs of the layer.
#[derive(Clone, Copy)]
struct Geom {
    bc: usize,
    taps: (usize, usize),
    dil: (usize, usize),
    /// Padded dX columns between neighbouring output pixels (the stride).
    step: usize,
    /// Padded dX row length in pixels.
    wp: usize,
}

/// `d += s` for runs of `L` floats, `L` known to the compiler: a run is a
/// few whole vector operations instead of one and a scalar tail.
#[inline(always)]
fn add_run<const L: usize>(d: &mut [f32], s: &[f32]) {
    let (Ok(d), Ok(s)) = (<&mut [f32; L]>::try_from(d), <&[f32; L]>::try_from(s)) else {
        unreachable!("runs of {L}")
    };
    for (d, s) in d.iter_mut().zip(s) {
        *d += s;
    }
}

crate::math::widest! {
    /// Adds the columns of a run of output pixels (`col`: R*S*bc values per
    /// pixel) into the padded dX plane `pad`, which starts at the first
    /// pixel's origin. Neighbouring pixels' runs overlap (a 7-wide filter at
    /// stride 2 shares 5 columns), and a load that partly overlaps a store
    /// just before it waits for that store to retire: the pixels go in
    /// passes whose runs are disjoint (every 4th pixel for the stem), and
    /// tap rows outermost.
    fn add_columns / add_columns_plain(pad: &mut [f32], col: &[f32], g: &Geom) {
        let (r_taps, s_taps) = g.taps;
        let m = r_taps * s_taps * g.bc;
        let n = col.len() / m;
        let span = (s_taps - 1) * g.dil.1 + 1;
        let passes = span.div_ceil(g.step).min(n.max(1));
        for r in 0..r_taps {
            let row = r * g.dil.0 * g.wp;
            for first in 0..passes {
                for j in (first..n).step_by(passes) {
                    let src = &col[j * m + r * s_taps * g.bc..][..s_taps * g.bc];
                    let at = (row + j * g.step) * g.bc;
                    if g.dil.1 == 1 {
                        let d = &mut pad[at..][..src.len()];
                        // RGB stems' runs (3x3, 5x5, 7x7 taps of 3 channels)
                        // at a length the compiler knows: the 7x7 stem's
                        // backward-data x1.03-1.10 (Zen 4, alternated in
                        // one process, same bits).
                        match src.len() {
                            9 => add_run::<9>(d, src),
                            15 => add_run::<15>(d, src),
                            21 => add_run::<21>(d, src),
                            _ => d.iter_mut().zip(src).for_each(|(d, s)| *d += s),
                        }
                    } else {
                        for (s, v) in src.chunks_exact(g.bc).enumerate() {
                            let d = &mut pad[at + s * g.dil.1 * g.bc..][..g.bc];
                            d.iter_mut().zip(v).for_each(|(d, s)| *d += s);
                        }
                    }
                }
            }
        }
    }
}
