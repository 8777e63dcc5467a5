//! The gather passes: forward, and backward-data (one per phase of dX, see
//! [`super::phased`]), as BRGEMMs over input-channel blocks and filter taps
//! (the offset batch form).

use crate::engine::bf16::{round_slice, thread_scratch};
use crate::error::Result;
use crate::loops::{LoopDef, LoopNest};
use crate::pass::{Chunked, PassConfig};
use crate::threads::Pool;
use crate::view::{View, ViewMut};
use brgemm::bf16::bf16;
use brgemm::{AlignedVec, BatchForm, DataType, Descriptor, Element, Epilogue, RawBatch};
use std::sync::Mutex;

use super::{nest, pad_into};

/// Geometry of a gather pass: a forward convolution from `in_blocks` blocks
/// of `bi` channels to `out_blocks` blocks of `bo` channels.
#[derive(Debug, Clone, Copy)]
pub(super) struct GatherGeom {
    pub(super) n: usize,
    pub(super) in_blocks: usize,
    pub(super) out_blocks: usize,
    pub(super) bi: usize,
    pub(super) bo: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) ph: usize,
    pub(super) pw: usize,
    /// Output rows and columns of the pass.
    pub(super) p: usize,
    pub(super) q: usize,
    /// Taps per filter block (R x S): the filter's block stride.
    pub(super) rs: usize,
    /// Input rows and columns between neighbouring output pixels.
    pub(super) stride: (usize, usize),
    /// The padded input pixel that output pixel (0, 0) reads at tap
    /// offset (0, 0).
    pub(super) origin: (usize, usize),
    /// Where the pass's output pixels lie in the output tensor.
    pub(super) out: Placement,
    pub(super) bq: usize,
    /// The output blocks are the layer's K blocks (forward) rather than its
    /// C blocks (backward-data): which of the nest's loops b (K blocks) and
    /// c (C blocks) is the output and which the reduction.
    pub(super) out_is_k: bool,
}

/// A filter tap of a gather pass: its index `r * S + s` in a filter block
/// and the input rows and columns it reads past the output pixel's origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tap {
    pub(super) f: usize,
    pub(super) dr: usize,
    pub(super) dc: usize,
}

impl Tap {
    /// Every tap of an `r x s` filter dilated by `dil`, flipped (tap (r, s)
    /// at offset (R-1-r, S-1-s)) for a transposed pass.
    pub(super) fn grid(r: usize, s: usize, dil: (usize, usize), flip: bool) -> Vec<Tap> {
        let mut taps = Vec::with_capacity(r * s);
        for i in 0..r {
            for j in 0..s {
                let (fi, fj) = if flip { (r - 1 - i, s - 1 - j) } else { (i, j) };
                taps.push(Tap {
                    f: fi * s + fj,
                    dr: i * dil.0,
                    dc: j * dil.1,
                });
            }
        }
        taps
    }
}

/// The taps of a gather pass that some output rows reach inside the input,
/// and their batch offsets for a chunk of input blocks (`[block][tap]`).
struct TapSet {
    taps: Vec<Tap>,
    a_off: Vec<usize>,
    b_off: Vec<usize>,
}

/// Where a gather pass writes: its output row `o` is row `first.0 + o *
/// step.0` of an output tensor of `rows x cols` pixels per plane (columns
/// alike); a step above 1 writes every step-th pixel (a phase of dX).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Placement {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) step: (usize, usize),
    pub(super) first: (usize, usize),
}

impl Placement {
    /// The whole `p x q` output, pixel by pixel.
    pub(super) fn dense(p: usize, q: usize) -> Placement {
        Placement {
            rows: p,
            cols: q,
            step: (1, 1),
            first: (0, 0),
        }
    }
}

/// The residual a forward adds after the epilogue, and whether a ReLU
/// follows it.
pub(super) type Residual<'a> = Option<(&'a [f32], bool)>;

/// Where a gather pass writes its output.
pub(super) enum Out<'a> {
    /// The f32 output.
    F32(&'a mut [f32]),
    /// The output rounded to bf16 alone: each completed block is rounded
    /// from f32 sums that the kernel forms in a thread's L1 block where
    /// the block's whole reduction is one call ([`Gather::whole_blocks`];
    /// the second slice is then empty), else in the second slice, f32
    /// sums of the output's length.
    Bf16(&'a mut [bf16], &'a mut [f32]),
}

crate::math::widest! {
    /// `y += r`, then `max(y, 0)` when `relu` (NaN stays NaN).
    fn add_residual / add_residual_plain(y: &mut [f32], r: &[f32], relu: bool) {
        for (o, v) in y.iter_mut().zip(r) {
            let s = *o + v;
            *o = if relu && s < 0.0 { 0.0 } else { s };
        }
    }
}

/// Prefetch of the gather passes' kernels (the next pair's input rows, or
/// for a single-pair call the next output block; docs/tuning-notes.md):
/// where the CPU policy prefetches from L2, and everywhere for an f32 pass
/// of one tap, whose input rows are read once and stream from memory (the
/// 1x1 layers: on Sapphire Rapids forward x1.04-1.23, backward-data
/// x1.04-1.38; with several taps the rows come back from L2 for the next
/// ones, and prefetching them lost 1-5%; the AMX passes measured
/// x0.87-1.18, median 0.96: off).
fn gather_prefetch(taps: usize, dtype: DataType) -> brgemm::Prefetch {
    let from_l2 = crate::policy().stream_prefetch == brgemm::StreamPrefetch::BeyondL1;
    brgemm::Policy::prefetch_if(from_l2 || (taps == 1 && dtype == DataType::F32))
}

/// The register tile of gather calls of `n` pixels producing 64-channel
/// output columns, where the CPU policy names one: for single-pair calls,
/// and for every batch where the policy says so and the tile's columns
/// divide `n` (a tail of columns lost: 14-pixel rows x0.94-0.98, Zen 4).
fn single_pair_tile(bo: usize, pairs: usize, n: usize) -> Option<brgemm::RegisterTile> {
    let p = crate::policy();
    p.single_pair_tile()
        .filter(|t| bo == 64 && (pairs == 1 || (p.pair_tile_any_batch && n.is_multiple_of(t.nr))))
}

/// A planned gather pass (forward, and a phase of backward-data) on
/// operands of type `T` (f32, or bf16 with the filter in VNNI pairs along
/// the input channels: the same block sizes, so the same offsets).
pub(super) struct Gather<T = f32> {
    pub(super) g: GatherGeom,
    pub(super) nest: LoopNest,
    /// Nest loops of the output blocks and of the reduction's chunks.
    pub(super) out_loop: usize,
    pub(super) red_loop: usize,
    pub(super) main: Chunked,
    pub(super) tail: Option<Chunked>,
    pub(super) chunk: usize,
    /// The taps the batch walks per input block.
    pub(super) taps: Vec<Tap>,
    /// Per output row, its entry in `rows_taps`.
    row_class: Vec<usize>,
    /// The batch offsets of each set of taps that output rows reach inside
    /// the input: a border row of a padded layer skips the filter rows that
    /// meet the padding (zero products; at 7x7 a tenth of a 3x3 layer's).
    rows_taps: Vec<TapSet>,
    pub(super) scratch: Mutex<AlignedVec<T>>,
    /// The pass writes every `step`-th pixel of a zero-padless output from
    /// (0, 0) (backward-data of a one-phase strided convolution): each
    /// completed block also zeroes the pixels between and below its own,
    /// which no tap reaches, while they are the thread's to write anyway
    /// (a separate pass over dX afterwards cost the 1x1 stride-2 layers
    /// 5-10% of peak, all threads waiting on memory at once).
    pub(super) zero_between: bool,
}

impl<T: Element + Default + Send + Sync> Gather<T> {
    pub(super) fn new(
        which: &str,
        g: GatherGeom,
        taps: &[Tap],
        cfg: &PassConfig,
        ep: Epilogue,
    ) -> Result<Gather<T>> {
        let chunk = cfg.chunk_of(g.in_blocks);
        let (hp, wp) = (g.h + 2 * g.ph, g.w + 2 * g.pw);
        let g = GatherGeom {
            bq: g.bq.min(g.q),
            ..g
        };
        let nqb = g.q.div_ceil(g.bq);
        // The layer's letters: a images, b K blocks, c C blocks, d rows and
        // e pixel blocks of the pass's output.
        let (out_loop, red_loop) = if g.out_is_k { (1, 2) } else { (2, 1) };
        let mut loops = vec![
            LoopDef::new("images", g.n, 1),
            LoopDef::new("K blocks", 0, 1),
            LoopDef::new("C blocks", 0, 1),
            LoopDef::new("rows", g.p, 1),
            LoopDef::new("pixel blocks", nqb, 1),
        ];
        loops[out_loop].end = g.out_blocks;
        loops[red_loop] = LoopDef::new(loops[red_loop].name, g.in_blocks, chunk).reduction();
        let nest = nest(which, loops, cfg)?;
        let desc = |n| {
            Descriptor::new(g.bo, n, g.bi)
                .dtype(T::DTYPE)
                .ldb(g.stride.1 * g.bi)
                .ldc(g.out.step.1 * g.bo)
                .batch_form(BatchForm::Offset)
                .prefetch(gather_prefetch(taps.len(), T::DTYPE))
        };
        let tile =
            |n| single_pair_tile(g.bo, chunk * taps.len(), n).filter(|_| T::DTYPE == DataType::F32);
        let main = Chunked::with_tile(desc(g.bq), ep, tile(g.bq))?;
        let tail = (!g.q.is_multiple_of(g.bq))
            .then(|| Chunked::with_tile(desc(g.q % g.bq), ep, tile(g.q % g.bq)))
            .transpose()?;
        let (mut row_class, mut rows_taps) = (Vec::with_capacity(g.p), Vec::<TapSet>::new());
        for pr in 0..g.p {
            let inside =
                |t: &&Tap| (g.ph..g.ph + g.h).contains(&(g.origin.0 + pr * g.stride.0 + t.dr));
            let live: Vec<Tap> = taps.iter().filter(inside).copied().collect();
            let class = match rows_taps.iter().position(|c| c.taps == live) {
                Some(c) => c,
                None => {
                    let (mut a_off, mut b_off) = (vec![], vec![]);
                    for cb in 0..chunk {
                        for t in &live {
                            a_off.push((cb * g.rs + t.f) * g.bi * g.bo);
                            b_off.push(cb * hp * wp * g.bi + (t.dr * wp + t.dc) * g.bi);
                        }
                    }
                    rows_taps.push(TapSet {
                        taps: live,
                        a_off,
                        b_off,
                    });
                    rows_taps.len() - 1
                }
            };
            row_class.push(class);
        }
        Ok(Gather {
            g,
            nest,
            out_loop,
            red_loop,
            main,
            tail,
            chunk,
            taps: taps.to_vec(),
            row_class,
            rows_taps,
            scratch: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
            zero_between: false,
        })
    }

    /// Zeroes the output pixels that block (`ni`, `ob`, row `pr`, pixels
    /// `q0..q0 + qn`) owns besides its own: rows `pr * sh` to the next
    /// phase row, columns `q0 * sw` to the next block's, all but the
    /// block's pixels.
    ///
    /// # Safety
    /// `plane` is the (image, output block) plane of the output, which this
    /// thread alone writes in that region ([`Gather::zero_between`]'s
    /// placement: first pixel (0, 0), every pixel below the grid's reach).
    unsafe fn zero_region(&self, plane: *mut f32, pr: usize, q0: usize, qn: usize) {
        let (o, bo) = (self.g.out, self.g.bo);
        let (sh, sw) = o.step;
        let (x0, x1) = (q0 * sw, ((q0 + qn) * sw).min(o.cols));
        for y in pr * sh..((pr + 1) * sh).min(o.rows) {
            let row = plane.add(y * o.cols * bo);
            if y == pr * sh {
                for x in (x0..x1).filter(|x| (x - x0) % sw != 0) {
                    std::ptr::write_bytes(row.add(x * bo), 0, bo);
                }
            } else {
                std::ptr::write_bytes(row.add(x0 * bo), 0, (x1 - x0) * bo);
            }
        }
    }

    /// y = conv(x, a) (+ bias, activation by the kernels' epilogue; then
    /// `+ r` and a ReLU when `res` is `Some((r, relu))`). Sizes were checked
    /// by the caller.
    pub(super) fn run(
        &self,
        pool: &Pool,
        x: &[T],
        a: &[T],
        bias: Option<&[f32]>,
        res: Residual<'_>,
        y: Out<'_>,
    ) {
        let g = self.g;
        if g.ph == 0 && g.pw == 0 {
            return self.run_padded(pool, x, a, bias, res, y);
        }
        let mut xs = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.pad(
            pool,
            x,
            |o: &mut [T], v: &[T]| o.copy_from_slice(v),
            &mut xs,
        );
        self.run_padded(pool, &xs, a, bias, res, y)
    }

    /// As [`Gather::run`] from an input of another type, converted a row
    /// at a time by `conv(out, in)` in the same pass that makes the
    /// zero-padded copy (f32 input rounded for a bf16 pass: one sweep over
    /// it, not two).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_converted<S: Copy + Send + Sync>(
        &self,
        pool: &Pool,
        x: &[S],
        conv: impl Fn(&mut [T], &[S]) + Sync,
        a: &[T],
        bias: Option<&[f32]>,
        res: Residual<'_>,
        y: Out<'_>,
    ) {
        let mut xs = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.pad(pool, x, conv, &mut xs);
        self.run_padded(pool, &xs, a, bias, res, y)
    }

    /// The zero-padded (and converted) copy of the input in `out`.
    pub(super) fn pad<S: Copy + Send + Sync>(
        &self,
        pool: &Pool,
        x: &[S],
        conv: impl Fn(&mut [T], &[S]) + Sync,
        out: &mut AlignedVec<T>,
    ) {
        let g = self.g;
        let (hp, wp) = (g.h + 2 * g.ph, g.w + 2 * g.pw);
        out.resize(g.n * g.in_blocks * hp * wp * g.bi, T::default());
        pad_into(
            pool,
            x,
            g.n * g.in_blocks,
            (g.h, g.w, g.bi),
            (g.ph, g.pw),
            out,
            conv,
        );
    }

    /// Whether each output block's calls follow one another on one thread
    /// (the whole reduction in one call, or the reduction the nest's
    /// innermost loop and not blocked: a blocked one comes back to the
    /// block after others), so that [`Out::Bf16`] can keep a block's f32
    /// sums in L1 until it is complete, and needs none of the output's
    /// size.
    pub(super) fn whole_blocks(&self) -> bool {
        let red = char::from(b'a' + self.red_loop as u8);
        let spec = self.nest.spec();
        let is_red = |c: &char| c.eq_ignore_ascii_case(&red);
        let inner = spec.chars().last().is_some_and(|c| is_red(&c));
        let once = spec.chars().filter(is_red).count() == 1;
        (self.chunk >= self.g.in_blocks || (inner && once))
            && self.g.out.step == (1, 1)
            && !self.zero_between
    }

    /// [`Gather::run`] on the zero-padded input `xs`.
    pub(super) fn run_padded(
        &self,
        pool: &Pool,
        xs: &[T],
        a: &[T],
        bias: Option<&[f32]>,
        res: Residual<'_>,
        out: Out<'_>,
    ) {
        let g = self.g;
        debug_assert!(res.is_none() || g.out.step == (1, 1));
        let (hp, wp) = (g.h + 2 * g.ph, g.w + 2 * g.pw);
        let rs = g.rs;
        // Padded input planes by (image x input block, row, column), filter
        // blocks by (output block, input block), output pixels by (image,
        // output block, row, column).
        let xv = View::new(xs, [hp * wp * g.bi, wp * g.bi, g.bi]);
        let av = View::new(a, [g.in_blocks * rs * g.bi * g.bo, rs * g.bi * g.bo]);
        let bv = bias.map(|b| View::new(b, [g.bo]));
        let (o, plane) = (g.out, g.out.rows * g.out.cols * g.bo);
        let strides = [g.out_blocks * plane, plane, o.cols * g.bo, g.bo];
        // With a bf16 output, its f32 sums: in `acc`, or per block in L1.
        let (y, yb, in_l1) = match out {
            Out::F32(y) => (y, None, false),
            Out::Bf16(yb, acc) => {
                debug_assert!(acc.len() == yb.len() || (acc.is_empty() && self.whole_blocks()));
                debug_assert!(o.step == (1, 1) && o.first == (0, 0));
                let in_l1 = acc.is_empty();
                (acc, Some(ViewMut::new(yb, strides)), in_l1)
            }
        };
        let yv = ViewMut::new(y, strides);
        let out_at = |ni: usize, ob: usize, pr: usize, q0: usize| {
            yv.at([ni, ob, o.first.0 + pr * o.step.0, o.first.1 + q0 * o.step.1])
        };
        // The next call is looked up only for kernels that prefetch it. A
        // call brings in the next call's output block where that block is
        // one run of memory and the call a single pair; and every call of
        // a phase of backward-data at a stride, whose output pixels lie
        // `step` apart (the run over them, the other phases' pixels between
        // included): its few taps make short calls whose stores otherwise
        // wait on memory at each call's end (3x3 stride-2 layers x1.00-1.05,
        // Zen 4, alternated in one process). Not a phase that zeroes the
        // pixels between its own (the 1x1 stride-2 projection: x0.87-0.96),
        // nor a bf16 output, whose f32 blocks are not in the output.
        let prefetches = self.main.pick(true, true).descriptor().prefetch != brgemm::Prefetch::None;
        let pf = yb.is_none() && prefetches;
        // A call of several pairs of one tap (a 1x1 layer, whose input rows
        // stream from memory) on a prefetching kernel names the next call's
        // first rows ([`brgemm::Kernel::execute_raw_then`]), which the last
        // pair walks as the others walk their successor's: without it each
        // call began on rows still in memory. Zen 4, minibatch 16, two
        // threads, alternated in one process: f32 256 -> 64 forward x1.13,
        // 64 -> 256 backward-data x1.11, the stride-2 projection forward
        // x1.07; bf16 four-pair calls x1.12-1.16, two-pair x1.06-1.10. The
        // 3x3 layers, whose rows come back from L2 for the taps, measured
        // x0.98-1.00, so they are left as they were.
        let pf_rows = prefetches && self.taps.len() == 1;
        let b_at = |ni: usize, c0: usize, pr: usize, q0: usize| {
            xv.at([
                ni * g.in_blocks + c0,
                g.origin.0 + pr * g.stride.0,
                g.origin.1 + q0 * g.stride.1,
            ])
        };
        let (span, every) = (o.step.1, o.step.1 > 1 && !self.zero_between);
        self.nest.run(pool, |i| {
            let (ni, ob, pr, qb, c0) = (i[0], i[self.out_loop], i[3], i[4], i[self.red_loop]);
            let q0 = qb * g.bq;
            let cnt = self.chunk.min(g.in_blocks - c0);
            let row = &self.rows_taps[self.row_class[pr]];
            let ks = if q0 + g.bq <= g.q {
                &self.main
            } else {
                self.tail.as_ref().unwrap()
            };
            let pairs = cnt * row.taps.len();
            let batch = RawBatch::Offset {
                a: av.at([ob, c0]),
                b: b_at(ni, c0, pr, q0),
                a_offs: row.a_off.as_ptr(),
                b_offs: row.b_off.as_ptr(),
                count: pairs,
            };
            let bias = bv.map_or(std::ptr::null(), |b| b.at([ob]));
            let single = pairs == 1 && span == 1;
            // The next call's output block (single-pair and strided calls)
            // or else its first input rows (several pairs of one tap).
            let out_next = pf && (single || every);
            let rows_next = !out_next && pf_rows && pairs > 1;
            let next = (out_next || rows_next)
                .then(|| self.nest.successor(i))
                .flatten();
            let (ahead, len) = match next {
                Some(n) if out_next => (
                    out_at(n[0], n[self.out_loop], n[3], n[4] * g.bq) as *const f32,
                    g.bq * g.bo * span,
                ),
                _ => (std::ptr::null(), 0),
            };
            let next_rows = next.filter(|_| rows_next).and_then(|n| {
                let nrow = &self.rows_taps[self.row_class[n[3]]];
                let first = *nrow.b_off.first()?;
                let b = b_at(n[0], n[self.red_loop], n[3], n[4] * g.bq);
                Some(b.wrapping_add(first))
            });
            let last = c0 + cnt == g.in_blocks;
            let mut c = out_at(ni, ob, pr, q0);
            if in_l1 {
                // The thread's f32 block (16 KiB at 64 x 64), kept between
                // the block's calls: nothing else on this thread takes it
                // meanwhile.
                c = thread_scratch(g.bq * g.bo);
            }
            // SAFETY: buffer sizes were checked at the public entry; the
            // offsets stay inside the padded input and the filter; the
            // output block (ni, ob, pr, qb) belongs to one thread; the next
            // rows are only prefetched.
            unsafe {
                let k = ks.pick(c0 == 0, last);
                match next_rows {
                    Some(nb) => k.execute_raw_then(batch, c, bias, nb),
                    None => k.execute_raw_ahead(batch, c, bias, ahead, len),
                }
            };
            if self.zero_between && last {
                let qn = g.bq.min(g.q - q0);
                // SAFETY: the region belongs to this block (see the field).
                unsafe { self.zero_region(yv.at([ni, ob, 0, 0]), pr, q0, qn) };
            }
            if let (Some((r, relu)), true) = (res, last) {
                // The block is in L1: the residual joins it there instead of
                // in a pass of its own over Y (dense placement, so the block
                // is one run, at the same offset in R).
                let n = g.bq.min(g.q - q0) * g.bo;
                // SAFETY: as above; R has Y's layout (checked at the entry).
                unsafe {
                    let y = std::slice::from_raw_parts_mut(c, n);
                    let off = out_at(ni, ob, pr, q0).offset_from(yv.at([0, 0, 0, 0])) as usize;
                    add_residual(y, &r[off..off + n], relu);
                }
            }
            if let (Some(yb), true) = (yb, last) {
                // Dense placement: the block is one run of the output.
                let n = g.bq.min(g.q - q0) * g.bo;
                // SAFETY: the block's f32 sums are complete (its last call)
                // and its bf16 run is this thread's, as the f32 block above.
                unsafe {
                    let src = std::slice::from_raw_parts(c, n);
                    round_slice(yb.slice([ni, ob, pr, q0], n), src);
                }
            }
        });
    }
}
