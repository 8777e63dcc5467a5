//! Backward-data as gathers at every stride: dX split into phases, its
//! rows and columns modulo the strides.
//!
//! Forward reads padded pixel `stride * p + dil * r` for output row p and
//! tap r, so a padded dX row `y = stride * i + a` (phase a) receives from
//! the taps r with `dil * r % stride == a` alone, from dY row
//! `i - (dil * r - a) / stride`: a stride-1 gather of dY over a sub-filter,
//! whose output is every stride-th row of dX (columns alike). One phase at
//! stride 1 is the familiar transposed convolution with flipped taps; a 3x3
//! filter at stride 2 gives four phases of 4, 2, 2 and 1 taps; a 1x1 filter
//! at stride 2 one phase, and dX zero elsewhere. Each phase writes its
//! pixels once (beta = 0 on the first K chunk) straight into dX with a
//! column stride in the kernel's C: no scratch dX, no zero fill of the
//! pixels a tap reaches, no crop copy. The scatter it replaces (every dY
//! pixel adding `W^T dY` into a zero-filled padded dX, then cropped) ran
//! the ResNet-50 stride-2 layers at 40-60% of peak.

use super::gather::{Gather, GatherGeom, Out, Placement, Tap};
use super::pad_into;
use super::params::ConvParams;
use crate::error::Result;
use crate::layout::SyncPtr;
use crate::pass::PassConfig;
use crate::threads::Pool;
use brgemm::{AlignedVec, Element, Epilogue};
use std::sync::Mutex;

/// One axis of the convolution, as backward-data sees it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Axis {
    /// dX pixels.
    pub(super) x: usize,
    /// dY pixels.
    pub(super) y: usize,
    pub(super) taps: usize,
    pub(super) stride: usize,
    pub(super) dil: usize,
    pub(super) pad: usize,
}

/// One phase of one axis: the dX pixels `first + k * stride` (k < `len`)
/// and the taps that reach them with their dY shifts.
#[derive(Debug, Clone)]
pub(super) struct AxisPhase {
    /// The first pass output pixel's index in the phase's padded grid.
    pub(super) lo: usize,
    pub(super) len: usize,
    pub(super) first: usize,
    /// (tap, shift u): the tap reads dY pixel `i - u` for phase pixel i.
    pub(super) taps: Vec<(usize, usize)>,
}

impl Axis {
    /// A layer's rows (`cols` false) or columns as backward-data sees them.
    pub(super) fn of(p: &ConvParams, cols: bool) -> Axis {
        let (x, y, taps, stride, dil, pad) = match cols {
            false => (p.h, p.p(), p.r, p.stride_h, p.dil_h, p.pad_h),
            true => (p.w, p.q(), p.s, p.stride_w, p.dil_w, p.pad_w),
        };
        Axis {
            x,
            y,
            taps,
            stride,
            dil,
            pad,
        }
    }

    /// The axis's phases, one per residue modulo the stride.
    pub(super) fn phases(&self) -> Vec<AxisPhase> {
        let s = self.stride;
        (0..s)
            .map(|a| {
                let lo = self.pad.saturating_sub(a).div_ceil(s);
                // Phase pixels i with 0 <= s i + a - pad < x.
                let hi = (self.x + self.pad)
                    .checked_sub(a + 1)
                    .map_or(0, |last| last / s + 1);
                let taps = (0..self.taps)
                    .filter(|r| r * self.dil % s == a)
                    .map(|r| (r, (r * self.dil - a) / s))
                    .collect();
                AxisPhase {
                    lo,
                    len: hi.saturating_sub(lo),
                    first: (s * lo + a).saturating_sub(self.pad),
                    taps,
                }
            })
            .collect()
    }
}

/// Backward-data of a convolution: one gather per phase of dX that some
/// tap reaches, over one zero-padded copy of dY, and a zero fill of the
/// phases no tap reaches (by the gather's blocks as they complete where
/// one phase from pixel (0, 0) is all: [`Gather::zero_between`]).
pub(super) struct Phased<T = f32> {
    pub(super) phases: Vec<Gather<T>>,
    plan: Shape,
    scratch: Mutex<AlignedVec<T>>,
}

/// What [`Phased`] knows besides its gathers.
#[derive(Debug, Clone)]
struct Shape {
    /// Per row phase of dX: which column phases no tap reaches.
    holes: Vec<Vec<bool>>,
    /// dY's planes: how many, `(rows, cols, channels)`, and the padding of
    /// its copy.
    dy_planes: usize,
    dy: (usize, usize, usize),
    pad: (usize, usize),
    /// dX's planes: how many, `(rows, cols, channels)`, pads and strides.
    dx_planes: usize,
    dx: (usize, usize, usize),
    dx_pad: (usize, usize),
    dx_stride: (usize, usize),
}

/// The geometry of [`Phased`] without the kernels: the per-phase gathers'
/// geometries and taps, for a pass of any operand type.
pub(super) struct PhasePlan {
    phases: Vec<(GatherGeom, Vec<Tap>)>,
    shape: Shape,
}

impl PhasePlan {
    /// Plans backward-data from dY (`in_blocks` blocks of `bi`) to dX
    /// (`out_blocks` of `bo`) over `n` images, rows and columns as given.
    pub(super) fn new(
        n: usize,
        (in_blocks, bi): (usize, usize),
        (out_blocks, bo): (usize, usize),
        rows: Axis,
        cols: Axis,
        bq: usize,
    ) -> PhasePlan {
        let (rp, cp) = (rows.phases(), cols.phases());
        let live = |ph: &AxisPhase| ph.len > 0 && !ph.taps.is_empty();
        // dY's padding: every phase's reads inside the padded copy. Phase
        // pixel i and tap shift u read dY pixel i - u, at least lo - max u
        // and at most lo + len - 1 - min u.
        let pad_of = |phases: &[AxisPhase], dy: usize| {
            (phases.iter().filter(|p| live(p)))
                .map(|p| {
                    let umax = p.taps.iter().map(|t| t.1).max().unwrap_or(0);
                    let umin = p.taps.iter().map(|t| t.1).min().unwrap_or(0);
                    let below = umax.saturating_sub(p.lo);
                    let above = (p.lo + p.len).saturating_sub(umin + dy);
                    below.max(above)
                })
                .max()
                .unwrap_or(0)
        };
        let pad = (pad_of(&rp, rows.y), pad_of(&cp, cols.y));
        let mut phases = Vec::new();
        for a in rp.iter().filter(|p| live(p)) {
            for b in cp.iter().filter(|p| live(p)) {
                let umax = a.taps.iter().map(|t| t.1).max().unwrap_or(0);
                let vmax = b.taps.iter().map(|t| t.1).max().unwrap_or(0);
                let mut taps = Vec::with_capacity(a.taps.len() * b.taps.len());
                for &(r, u) in &a.taps {
                    for &(s, v) in &b.taps {
                        taps.push(Tap {
                            f: r * cols.taps + s,
                            dr: umax - u,
                            dc: vmax - v,
                        });
                    }
                }
                taps.sort_by_key(|t| (t.dr, t.dc));
                let g = GatherGeom {
                    n,
                    in_blocks,
                    out_blocks,
                    bi,
                    bo,
                    h: rows.y,
                    w: cols.y,
                    ph: pad.0,
                    pw: pad.1,
                    p: a.len,
                    q: b.len,
                    rs: rows.taps * cols.taps,
                    stride: (1, 1),
                    origin: (pad.0 + a.lo - umax, pad.1 + b.lo - vmax),
                    out: Placement {
                        rows: rows.x,
                        cols: cols.x,
                        step: (rows.stride, cols.stride),
                        first: (a.first, b.first),
                    },
                    bq,
                    out_is_k: false,
                };
                phases.push((g, taps));
            }
        }
        let holes = rp
            .iter()
            .map(|a| {
                cp.iter()
                    .map(|b| a.taps.is_empty() || b.taps.is_empty())
                    .collect()
            })
            .collect();
        PhasePlan {
            phases,
            shape: Shape {
                holes,
                dy_planes: n * in_blocks,
                dy: (rows.y, cols.y, bi),
                pad,
                dx_planes: n * out_blocks,
                dx: (rows.x, cols.x, bo),
                dx_pad: (rows.pad, cols.pad),
                dx_stride: (rows.stride, cols.stride),
            },
        }
    }

    /// The passes on operands of type `T`.
    pub(super) fn build<T: Element + Default + Send + Sync>(
        &self,
        cfg: &PassConfig,
        ep: Epilogue,
    ) -> Result<Phased<T>> {
        let mut phases: Vec<Gather<T>> = (self.phases.iter())
            .map(|(g, taps)| Gather::new("bwd", *g, taps, cfg, ep))
            .collect::<Result<_>>()?;
        // One live phase of an unpadded dX with holes (a 1x1 filter at a
        // stride): its blocks zero the holes as they complete. Tap 0 always
        // reaches phase 0, so that phase starts at pixel (0, 0), and its
        // pixels at the stride cover dX to the end.
        let s = &self.shape;
        if let [only] = &mut phases[..] {
            let o = only.g.out;
            only.zero_between = s.dx_pad == (0, 0) && s.holes.iter().flatten().any(|h| *h);
            debug_assert!(
                !only.zero_between
                    || (o.first == (0, 0)
                        && only.g.p * o.step.0 >= o.rows
                        && only.g.q * o.step.1 >= o.cols)
            );
        }
        Ok(Phased {
            phases,
            plan: self.shape.clone(),
            scratch: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
        })
    }
}

impl<T: Element + Default + Send + Sync> Phased<T> {
    /// dX from dY and the transposed filter `wt` (dY read in place where
    /// no phase reads past its edges). Sizes were checked by the caller.
    pub(super) fn run(&self, pool: &Pool, dy: &[T], wt: &[T], dx: Out<'_>) {
        if self.unpadded() {
            return self.run_padded(pool, dy, wt, dx);
        }
        self.run_converted(
            pool,
            dy,
            |o: &mut [T], v: &[T]| o.copy_from_slice(v),
            wt,
            dx,
        )
    }

    /// Whether [`Phased::run`] reads dY in place (no border to pad).
    pub(super) fn unpadded(&self) -> bool {
        self.plan.pad == (0, 0)
    }

    /// As [`Phased::run`] from dY of another type, converted by
    /// `conv(out, in)` in the pass that pads it (rounding for bf16).
    pub(super) fn run_converted<S: Copy + Send + Sync>(
        &self,
        pool: &Pool,
        dy: &[S],
        conv: impl Fn(&mut [T], &[S]) + Sync,
        wt: &[T],
        dx: Out<'_>,
    ) {
        let p = &self.plan;
        let mut xs = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let (h, w, b) = p.dy;
        let (hp, wp) = (h + 2 * p.pad.0, w + 2 * p.pad.1);
        xs.resize(p.dy_planes * hp * wp * b, T::default());
        pad_into(pool, dy, p.dy_planes, p.dy, p.pad, &mut xs, conv);
        self.run_padded(pool, &xs, wt, dx)
    }

    fn run_padded(&self, pool: &Pool, dy: &[T], wt: &[T], dx: Out<'_>) {
        let dx = match dx {
            Out::F32(dx) => dx,
            bf16 => {
                debug_assert!(self.one_dense_phase());
                return self.phases[0].run_padded(pool, dy, wt, None, None, bf16);
            }
        };
        for g in &self.phases {
            g.run_padded(pool, dy, wt, None, None, Out::F32(dx));
        }
        if !self.phases.iter().any(|g| g.zero_between) {
            self.zero_holes(pool, dx);
        }
    }

    /// Whether dX is one phase that writes every pixel (stride 1): what an
    /// output in bf16 alone ([`Out::Bf16`]) needs.
    pub(super) fn one_dense_phase(&self) -> bool {
        match &self.phases[..] {
            [g] => {
                let o = g.g.out;
                o.step == (1, 1) && o.first == (0, 0) && !g.zero_between
            }
            _ => false,
        }
    }

    /// Whether each dX block's sums can stay in L1 ([`Gather::whole_blocks`]).
    pub(super) fn whole_blocks(&self) -> bool {
        self.phases.iter().all(|g| g.whole_blocks())
    }

    /// Zeros the dX pixels of the phases no tap reaches.
    fn zero_holes(&self, pool: &Pool, dx: &mut [f32]) {
        let p = &self.plan;
        if p.holes.iter().flatten().all(|h| !h) {
            return;
        }
        let (h, w, b) = p.dx;
        let (sh, sw) = p.dx_stride;
        let (ph, pw) = p.dx_pad;
        let plane = h * w * b;
        let d = SyncPtr(dx.as_mut_ptr());
        pool.for_each(p.dx_planes, |pl| {
            // SAFETY: plane pl of dX belongs to this iteration alone.
            let out = unsafe { std::slice::from_raw_parts_mut(d.get().add(pl * plane), plane) };
            for (y, row) in out.chunks_exact_mut(w * b).enumerate() {
                let holes = &p.holes[(y + ph) % sh];
                if holes.iter().all(|h| *h) {
                    row.fill(0.0);
                    continue;
                }
                for (x, px) in row.chunks_exact_mut(b).enumerate() {
                    if holes[(x + pw) % sw] {
                        px.fill(0.0);
                    }
                }
            }
        });
    }
}
