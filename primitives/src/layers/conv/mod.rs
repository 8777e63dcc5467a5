//! Convolution: forward, backward-data and backward-weights as loop nests
//! around BRGEMM, on the blocked layouts of [`crate::tensor`].
//!
//! Shapes: X `[N][C][H][W]`, W `[K][C][R][S]`, Y = act(conv(X, W) + b)
//! `[N][K][P][Q]` with `P = (H + 2 pad_h - dil_h (R-1) - 1) / stride_h + 1`
//! (Q alike, with the column settings: stride, padding and dilation are
//! per axis). Borders are handled by reading a zero-padded copy of the input
//! (made once per call, O(input)), so the hot loop has no per-pixel branch.
//!
//! Every pass uses the same letters: `a` images, `b` K blocks, `c` C
//! blocks, `d` rows and `e` pixel blocks of the pass's output, `f` filter
//! rows, `g` filter columns; a loop of one iteration may be left out of a
//! spec (`docs/loop-specs.md`).
//!
//! | pass | loops | reduction | one BRGEMM (m x n x k) | batch |
//! |---|---|---|---|---|
//! | fwd | a b c d e | c (chunks of C blocks) | bk x bq pixels x bc | C blocks of the chunk x R x S (offsets) |
//! | bwd, per phase of dX | a b c d e | b (chunks of K blocks) | bc x bq x bk | K blocks x the phase's taps, flipped |
//! | upd | a b c (d e: one iteration) f g | a ((image, row) pairs, chunks) | bk x bc x (Q, or the tap's columns inside the image) | the chunk's pairs that the tap's row reaches (offsets) |
//!
//! - **Forward**: the C tile is a run of `bq` output pixels of one output
//!   row (of the whole image when the convolution is 1x1, stride 1, no
//!   padding: the image is then one long row), the batch walks every input
//!   block and tap, so the output block is written once with bias and
//!   activation fused in the kernel's epilogue.
//! - **Backward-data** at stride 1 is a forward convolution of dY with the
//!   transposed filter ([`Filter::transpose_into`]) read with flipped taps
//!   and padding `dil (R-1) - pad` (gather). At other strides dX splits
//!   into phases (rows and columns modulo the strides), each a stride-1
//!   gather over the taps that reach it, written in place with a column
//!   stride; the phases no tap reaches are zeroed (the `phased` module).
//!   An input of one block narrower than a vector (the RGB stem) would
//!   leave most vector lanes idle there (m = C); it puts dX's pixels in the
//!   lanes instead (m = a row's pixels of one column phase, A = dY's rows
//!   transposed as the pass reaches them: the `narrow` module; the stem's
//!   backward-data 17% of peak as a gather, 85% so).
//! - **Backward-weights**: `dW[kb][cb][r][s] = sum_(n,p) dY[n][kb][p] X_rs[n][cb][p]^T`,
//!   a BRGEMM over (image, row) pairs with k = Q pixels. X is read in place
//!   as a *row-major* B (`Descriptor::b_row_major`, leading dimension
//!   `stride * bc`): no transpose of the activations, which for 1x1 layers
//!   cost as much as the arithmetic (measured, 256->64 1x1 layer, same
//!   process: 24% -> 43% of peak). Nor a zero-padded copy: each tap's
//!   calls take only the rows it reaches inside the image and the columns
//!   `lo..lo + k` that do (k = Q - 1 for the border taps of a 3x3 layer,
//!   one kernel per distinct k), skipping the products with the padding. Software prefetch of the next pair was measured to lose 1-15%
//!   at stride 1 (Sapphire Rapids) and to win at stride 2 on Zen 4 (the
//!   policy's `conv_upd_prefetch_strided`); the gather passes use it where
//!   it pays (`gather_prefetch`).
//!   Every `dW[kb][cb][r][s]` block belongs to one thread: no races, no
//!   partial sums (except with fewer than 8 blocks per thread, where the
//!   threads split the rows into partial sums instead; see
//!   [`Conv::backward_weights`]). The default `aBCFG` walks chunks of rows outermost and
//!   the taps of a chunk inside, so a chunk is read from memory once and
//!   reused from L2 for all R x S taps.
//!
//! Default specs and blocking come from [`ConvTuning::heuristic`]; any valid
//! spec gives the same result (the tests run every one).

use crate::act::mul_act_grad;
use crate::error::{check_buf, shape, Result};
use crate::layout::SyncPtr;
use crate::loops::{LoopDef, LoopNest};
use crate::math::add_rows;
use crate::pass::{Chunked, PassConfig};
use crate::tensor::{par_images, Filter, Tensor4};
use crate::threads::Pool;
use crate::view::{View, ViewMut};
use brgemm::{Activation, AlignedVec, BatchForm, Descriptor, Epilogue, RawBatch};
use std::sync::Mutex;

mod bf16;
mod gather;
mod narrow;
mod params;
mod phased;

pub use bf16::{ConvBf16, Operand};
use gather::{Gather, GatherGeom, Out, Placement, Residual, Tap};
use narrow::Narrow;
use params::upd_chunk;
pub use params::{ConvParams, ConvTuning};
use phased::{Axis, PhasePlan, Phased};

fn nest(which: &str, loops: Vec<LoopDef>, cfg: &PassConfig) -> Result<LoopNest> {
    cfg.nest(&format!("conv {which}"), loops)
}

/// Zero-padded copies of `[N][blocks][h][w][b]` planes, each row passed
/// through `conv(out, in)` (a copy, or rounding to bf16).
fn pad_into<S: Copy + Send + Sync, T: Copy + Default + Send + Sync>(
    pool: &Pool,
    src: &[S],
    planes: usize,
    (h, w, b): (usize, usize, usize),
    (ph, pw): (usize, usize),
    dst: &mut [T],
    conv: impl Fn(&mut [T], &[S]) + Sync,
) {
    let (hp, wp) = (h + 2 * ph, w + 2 * pw);
    let d = SyncPtr(dst.as_mut_ptr());
    pool.for_each(planes, |pl| {
        // SAFETY: each plane belongs to one thread.
        let out =
            unsafe { std::slice::from_raw_parts_mut(d.get().add(pl * hp * wp * b), hp * wp * b) };
        let inp = &src[pl * h * w * b..][..h * w * b];
        out[..ph * wp * b].fill(T::default());
        out[(ph + h) * wp * b..].fill(T::default());
        for y in 0..h {
            let row = &mut out[(ph + y) * wp * b..][..wp * b];
            row[..pw * b].fill(T::default());
            let src = &inp[y * w * b..][..w * b];
            conv(&mut row[pw * b..(pw + w) * b], src);
            row[(pw + w) * b..].fill(T::default());
        }
    });
}

/// Backward-weights.
struct Upd {
    nest: LoopNest,
    chunk: usize,
    /// Each call prefetches the next call's new rows (dY, else X).
    rows_ahead: bool,
    /// Every (image, row) pair's dY row, in the reduction's order: the
    /// bias gradient's rows and the 1x1 layers' prefetch.
    a_off: Vec<usize>,
    /// Per filter row, the pairs whose input row lies inside the image.
    rows: Vec<TapRows>,
    /// Per filter column, the output columns whose input column does.
    cols: Vec<TapCols>,
    /// One set of kernels per reduction length among `cols`.
    kernels: Vec<(usize, Chunked)>,
    /// The (K block, C block, r, s) items: dW blocks, one thread each.
    items: usize,
    /// The other threads' dW and db partial sums when the rows are split.
    partials: Mutex<AlignedVec<f32>>,
}

/// The (image, row) pairs a filter row reads inside the image, as batch
/// offsets: dY rows and the X rows they meet (unpadded X, column 0).
struct TapRows {
    a_off: Vec<usize>,
    b_off: Vec<usize>,
    /// `starts[c]..starts[c + 1]`: the offsets of reduction chunk `c`.
    starts: Vec<usize>,
}

/// The output columns `lo..lo + k` that a filter column reads inside the
/// image (the rest meet padding: zero products, skipped), the input column
/// of column `lo`, and the index of its kernels in `Upd::kernels`.
#[derive(Debug, Clone, Copy)]
struct TapCols {
    lo: usize,
    k: usize,
    x0: usize,
    kernels: usize,
}

/// The outputs `lo..hi` of an axis of `outs` whose input `o * stride + off
/// - pad` lies in `0..len`.
pub(super) fn inside(
    outs: usize,
    stride: usize,
    off: usize,
    pad: usize,
    len: usize,
) -> (usize, usize) {
    let lo = pad.saturating_sub(off).div_ceil(stride);
    let hi = match (len + pad).checked_sub(off + 1) {
        Some(last) => (last / stride + 1).min(outs),
        None => 0,
    };
    (lo.min(hi), hi)
}

/// With fewer dW blocks than this many per thread, backward-weights splits
/// the rows between the threads instead (see [`Conv::backward_weights`]).
const UPD_ITEMS_PER_THREAD: usize = 8;

/// A tensor that a forward adds to its output after the bias and the
/// activation, then a ReLU when `relu`: the residual join of a ResNet
/// block ([`Conv::forward_add`], [`ConvBf16::forward_add`]).
#[derive(Debug, Clone, Copy)]
pub struct AddResidual<'a> {
    /// Of the output's dims and blocking.
    pub r: &'a Tensor4,
    /// A ReLU after the addition.
    pub relu: bool,
}

/// A planned convolution layer. Buffers are passed to each call (see
/// [`Conv::x_tensor`] and friends to allocate them).
pub struct Conv {
    /// The geometry.
    pub(crate) params: ConvParams,
    /// Activation after the bias.
    pub(crate) act: Activation,
    tuning: ConvTuning,
    fwd: Gather,
    /// Backward-data's geometry (the bf16 passes plan theirs from it).
    bwd_plan: PhasePlan,
    bwd: Phased,
    /// Backward-data with dX's pixels in the vector lanes, taken instead of
    /// `bwd` where the input is one block narrower than a vector.
    bwd_narrow: Option<Narrow>,
    upd: Upd,
}

impl std::fmt::Debug for Conv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conv")
            .field("params", &self.params)
            .field("act", &self.act)
            .field("tuning", &self.tuning)
            .finish()
    }
}

impl Conv {
    /// The layer's shape.
    pub fn params(&self) -> &ConvParams {
        &self.params
    }
    /// The fused activation of forward.
    pub fn act(&self) -> Activation {
        self.act
    }
}

impl Conv {
    /// Plans a layer with the heuristic tuning.
    pub fn new(params: ConvParams, act: Activation) -> Result<Conv> {
        params.validate()?;
        Conv::with_tuning(params, act, ConvTuning::heuristic(&params))
    }

    /// Plans a layer with the given blocking and loop orders.
    pub fn with_tuning(params: ConvParams, act: Activation, t: ConvTuning) -> Result<Conv> {
        crate::check_policy()?;
        params.validate()?;
        for (what, v) in [("bc", t.bc), ("bk", t.bk), ("bq", t.bq)] {
            if v == 0 {
                return Err(shape(what, v, "must be at least 1"));
            }
        }
        if matches!(act, Activation::Gelu) {
            return Err(shape(
                "activation",
                "Gelu",
                "convolutions fuse Identity, Relu, Sigmoid or Tanh",
            ));
        }
        let pr = params;
        let (p, q) = (pr.p(), pr.q());
        let (cb, kb) = (pr.c.div_ceil(t.bc), pr.k.div_ceil(t.bk));
        // Pointwise layers see an image as one row of H*W pixels.
        let (h, w, p1, q1) = if pr.pointwise() {
            (1, pr.h * pr.w, 1, p * q)
        } else {
            (pr.h, pr.w, p, q)
        };
        let bq = t.bq.min(q1);
        let fwd = Gather::new(
            "fwd",
            GatherGeom {
                n: pr.n,
                in_blocks: cb,
                out_blocks: kb,
                bi: t.bc,
                bo: t.bk,
                h,
                w,
                ph: pr.pad_h,
                pw: pr.pad_w,
                p: p1,
                q: q1,
                rs: pr.r * pr.s,
                stride: (pr.stride_h, pr.stride_w),
                origin: (0, 0),
                out: Placement::dense(p1, q1),
                bq,
                out_is_k: true,
            },
            &Tap::grid(pr.r, pr.s, (pr.dil_h, pr.dil_w), false),
            &t.fwd,
            Epilogue {
                bias: true,
                activation: act,
            },
        )?;
        // Backward-data by phases of dX; pointwise layers as one row, as
        // forward.
        let (rows, cols) = if pr.pointwise() {
            let flat = ConvParams::new(pr.n, pr.c, pr.k, 1, w, 1, 1);
            (Axis::of(&flat, false), Axis::of(&flat, true))
        } else {
            (Axis::of(&pr, false), Axis::of(&pr, true))
        };
        let bwd_plan = PhasePlan::new(pr.n, (kb, t.bk), (cb, t.bc), rows, cols, t.bq);
        let bwd = bwd_plan.build(&t.bwd, Epilogue::default())?;
        let bwd_narrow = Narrow::plan(&pr, t.bc, t.bk)?;
        let rows = pr.n * p;
        let chunk = if t.upd.chunk == 0 {
            upd_chunk(&pr, t.bc, t.bk)
        } else {
            t.upd.chunk
        }
        .min(rows);
        // X is read in place, padding or not: a tap's calls skip the rows
        // and columns where it meets the padding (their products are zero),
        // instead of reading a zero-padded copy made every step.
        let (h, w) = (pr.h, pr.w);
        let mut a_off = Vec::with_capacity(rows);
        for ni in 0..pr.n {
            for pi in 0..p {
                a_off.push((ni * kb * p + pi) * q * t.bk);
            }
        }
        let tap_rows = (0..pr.r)
            .map(|r| {
                let (lo, hi) = inside(p, pr.stride_h, r * pr.dil_h, pr.pad_h, h);
                let mut tr = TapRows {
                    a_off: Vec::new(),
                    b_off: Vec::new(),
                    starts: vec![0],
                };
                for (j, &a) in a_off.iter().enumerate() {
                    let (ni, pi) = (j / p, j % p);
                    if (lo..hi).contains(&pi) {
                        let y = pi * pr.stride_h + r * pr.dil_h - pr.pad_h;
                        tr.a_off.push(a);
                        tr.b_off.push((ni * cb * h + y) * w * t.bc);
                    }
                    if (j + 1) % chunk == 0 || j + 1 == rows {
                        tr.starts.push(tr.a_off.len());
                    }
                }
                tr
            })
            .collect();
        // The reduction runs over (image, row) pairs in chunks that may cross
        // images: loop a walks them, and d (rows) and e (pixel blocks) have
        // one iteration each (a call reads whole rows).
        let uloops = vec![
            LoopDef::new("(image, row) pairs", rows, chunk).reduction(),
            LoopDef::new("K blocks", kb, 1),
            LoopDef::new("C blocks", cb, 1),
            LoopDef::new("rows (in a)", 1, 1),
            LoopDef::new("pixel blocks (whole rows)", 1, 1),
            LoopDef::new("filter rows", pr.r, 1),
            LoopDef::new("filter columns", pr.s, 1),
        ];
        let unest = nest("upd", uloops, &t.upd)?;
        let pol = crate::policy();
        // 1x1 filters: every call reads rows no earlier call read, dY rows
        // (the next K block's or chunk's) or else X rows (the next C
        // block's), and prefetches the next call's; at a stride the X rows
        // it reads every other pixel of (docs/tuning-notes.md).
        let rows_ahead = pol.conv_upd_prefetch_rows && pr.r * pr.s == 1;
        let strided = pol.conv_upd_prefetch_strided && pr.stride_w > 1 && t.bc >= 16;
        // B_i = a row of X read in place, pixels (k) strided by stride * bc,
        // channels (n) contiguous: a row-major B; one set of kernels per
        // reduction length. A column tap that meets only padding runs
        // empty batches (C = beta * C) on kernels of k = 1, at column 0.
        let mut kernels: Vec<(usize, Chunked)> = Vec::new();
        let mut tap_cols = Vec::with_capacity(pr.s);
        for s in 0..pr.s {
            let (lo, hi) = inside(q, pr.stride_w, s * pr.dil_w, pr.pad_w, w);
            let x0 = match hi > lo {
                true => lo * pr.stride_w + s * pr.dil_w - pr.pad_w,
                false => 0,
            };
            let k = (hi - lo).max(1);
            let at = match kernels.iter().position(|(kk, _)| *kk == k) {
                Some(at) => at,
                None => {
                    let d = Descriptor::new(t.bk, t.bc, k)
                        .b_row_major()
                        .ldb(pr.stride_w * t.bc)
                        .batch_form(BatchForm::Offset)
                        .prefetch(brgemm::Policy::prefetch_if(rows_ahead || strided));
                    kernels.push((k, Chunked::new(d, Epilogue::default())?));
                    kernels.len() - 1
                }
            };
            tap_cols.push(TapCols {
                lo,
                k: hi - lo,
                x0,
                kernels: at,
            });
        }
        let upd = Upd {
            nest: unest,
            chunk,
            rows_ahead,
            a_off,
            rows: tap_rows,
            cols: tap_cols,
            kernels,
            items: kb * cb * pr.r * pr.s,
            partials: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
        };
        Ok(Conv {
            params,
            act,
            tuning: t,
            fwd,
            bwd_plan,
            bwd,
            bwd_narrow,
            upd,
        })
    }

    /// The blocking and specs in use.
    pub fn tuning(&self) -> &ConvTuning {
        &self.tuning
    }
    /// K rounded up to whole blocks: the length of the bias buffer.
    pub fn padded_k(&self) -> usize {
        self.params.k.div_ceil(self.tuning.bk) * self.tuning.bk
    }
    /// Floating-point operations of one pass.
    pub fn flops(&self) -> f64 {
        self.params.flops()
    }
    /// A zero input (also dX).
    pub fn x_tensor(&self) -> Tensor4 {
        let p = &self.params;
        Tensor4::zeros(p.n, p.c, p.h, p.w, self.tuning.bc).unwrap()
    }
    /// A zero output (also dY).
    pub fn y_tensor(&self) -> Tensor4 {
        let p = &self.params;
        Tensor4::zeros(p.n, p.k, p.p(), p.q(), self.tuning.bk).unwrap()
    }
    /// A zero filter (also dW).
    pub fn filter(&self) -> Filter {
        let p = &self.params;
        Filter::zeros(p.k, p.c, p.r, p.s, self.tuning.bk, self.tuning.bc).unwrap()
    }
    /// A zero transposed filter, as backward-data reads it.
    pub fn filter_t(&self) -> Filter {
        let p = &self.params;
        Filter::zeros(p.c, p.k, p.r, p.s, self.tuning.bc, self.tuning.bk).unwrap()
    }

    fn check_t<T>(
        &self,
        what: &str,
        t: &Tensor4<T>,
        (c, h, w, b): (usize, usize, usize, usize),
    ) -> Result<()> {
        let want = (self.params.n, c, h, w, b);
        if t.dims() != want {
            return Err(shape(
                what,
                format!("(n, c, h, w, block) = {:?}", t.dims()),
                format!("layer needs {want:?}"),
            ));
        }
        Ok(())
    }
    fn check_x<T>(&self, what: &str, t: &Tensor4<T>) -> Result<()> {
        let p = &self.params;
        self.check_t(what, t, (p.c, p.h, p.w, self.tuning.bc))
    }
    fn check_y<T>(&self, what: &str, t: &Tensor4<T>) -> Result<()> {
        let p = &self.params;
        self.check_t(what, t, (p.k, p.p(), p.q(), self.tuning.bk))
    }
    /// The dims of the layer's filter, `(k, c, r, s, bk, bc)`, or with
    /// `transposed` of the filter backward-data reads.
    fn filter_dims(&self, transposed: bool) -> (usize, usize, usize, usize, usize, usize) {
        let (p, t) = (&self.params, &self.tuning);
        match transposed {
            false => (p.k, p.c, p.r, p.s, t.bk, t.bc),
            true => (p.c, p.k, p.r, p.s, t.bc, t.bk),
        }
    }
    /// Elements of the (padded, blocked) filter.
    fn filter_len(&self) -> usize {
        let (p, t) = (&self.params, &self.tuning);
        p.k.div_ceil(t.bk) * p.c.div_ceil(t.bc) * p.r * p.s * t.bk * t.bc
    }
    /// Compares without building the wanted filter: the passes check on
    /// every call.
    fn check_f(&self, what: &str, f: &Filter, transposed: bool) -> Result<()> {
        let want = self.filter_dims(transposed);
        if f.dims() != want {
            return Err(shape(
                what,
                format!("(k, c, r, s, bk, bc) = {:?}", f.dims()),
                format!("layer needs {want:?}"),
            ));
        }
        Ok(())
    }

    /// Y = act(conv(X, W) + b).
    pub fn forward(
        &self,
        pool: &Pool,
        x: &Tensor4,
        w: &Filter,
        bias: &[f32],
        y: &mut Tensor4,
    ) -> Result<()> {
        self.forward_with(pool, x, w, bias, None, y)
    }

    /// Y = act(conv(X, W) + b) + R, then a ReLU when `add.relu`: a
    /// residual join done on each output block while it is in L1, instead
    /// of a pass of its own over Y.
    pub fn forward_add(
        &self,
        pool: &Pool,
        x: &Tensor4,
        w: &Filter,
        bias: &[f32],
        add: AddResidual<'_>,
        y: &mut Tensor4,
    ) -> Result<()> {
        self.check_y("residual", add.r)?;
        self.forward_with(pool, x, w, bias, Some((&add.r.data, add.relu)), y)
    }

    fn forward_with(
        &self,
        pool: &Pool,
        x: &Tensor4,
        w: &Filter,
        bias: &[f32],
        res: Residual<'_>,
        y: &mut Tensor4,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check_x("X", x)?;
        self.check_f("W", w, false)?;
        self.check_y("Y", y)?;
        check_buf("bias", bias.len(), self.padded_k())?;
        self.fwd.run(
            pool,
            &x.data,
            &w.data,
            Some(bias),
            res,
            Out::F32(&mut y.data),
        );
        self.clear_channel_tail(pool, y);
        Ok(())
    }

    /// Sigmoid(0) = 0.5 would fill the channel padding of Y: keeps it at zero.
    fn clear_channel_tail<T: Copy + Default + Send>(&self, pool: &Pool, y: &mut Tensor4<T>) {
        let (k, bk) = (self.params.k, self.tuning.bk);
        if !k.is_multiple_of(bk) && self.act.apply(0.0) != 0.0 {
            let kb = k.div_ceil(bk);
            let (hw, len) = (y.h * y.w, y.image_len());
            pool.for_slices_of(&mut y.data, len, |_, img| {
                for px in img[(kb - 1) * hw * bk..].chunks_exact_mut(bk) {
                    px[k % bk..].fill(T::default());
                }
            });
        }
    }

    /// dZ = dY * act'(.) from Y.
    pub fn activation_backward(
        &self,
        pool: &Pool,
        dy: &Tensor4,
        y: &Tensor4,
        dz: &mut Tensor4,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check_y("dY", dy)?;
        self.check_y("Y", y)?;
        self.check_y("dZ", dz)?;
        let act = self.act;
        par_images(pool, dz, |i, img| {
            let len = img.len();
            let (dy, y) = (&dy.data[i * len..][..len], &y.data[i * len..][..len]);
            mul_act_grad(act, img, dy, y, &[]);
        });
        Ok(())
    }

    /// Writes the transposed filter backward-data reads.
    pub fn transpose_filter(&self, pool: &Pool, w: &Filter, wt: &mut Filter) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check_f("W", w, false)?;
        self.check_f("Wt", wt, true)?;
        w.transpose_into(wt, pool)
    }

    /// dX = conv^T(dZ, W), reading the transposed filter (see
    /// [`Conv::transpose_filter`]).
    pub fn backward_data(
        &self,
        pool: &Pool,
        dz: &Tensor4,
        wt: &Filter,
        dx: &mut Tensor4,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check_y("dZ", dz)?;
        self.check_f("Wt", wt, true)?;
        self.check_x("dX", dx)?;
        match &self.bwd_narrow {
            Some(nw) => nw.run(pool, &dz.data, &wt.data, &mut dx.data),
            None => self
                .bwd
                .run(pool, &dz.data, &wt.data, Out::F32(&mut dx.data)),
        }
        Ok(())
    }

    /// dW = sum over the minibatch of dZ (x) X, and db = the sums of dZ per
    /// output channel.
    ///
    /// Each dW block (K block, C block, r, s) is one item of the spec's
    /// nest, its reduction over the (image, row) chunks run in order by one
    /// thread. With fewer than 8 items per thread (res2's 3x3: 9 on two
    /// threads, a 5 + 4 split) the rows are split instead: every thread runs
    /// every item over its share of the chunks into its own partial sums,
    /// which are then added (then results differ from one thread's in
    /// rounding). Measured on Zen 5, speed-up of two threads over one
    /// (median of 15 alternating pairs, two runs), minibatch 8 at 56x56:
    /// 64->64 3x3 x1.67 -> x1.81-1.83, 1x1 64->256 x1.65-1.73 ->
    /// x1.76-1.82, 1x1 256->64 (4 items) x1.77-1.79 -> x1.78-1.81; forcing
    /// the split on 36 and more items lost (128->128 3x3 x1.85 -> x1.68).
    pub fn backward_weights(
        &self,
        pool: &Pool,
        dz: &Tensor4,
        x: &Tensor4,
        dw: &mut Filter,
        db: &mut [f32],
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check_y("dZ", dz)?;
        self.check_x("X", x)?;
        self.check_f("dW", dw, false)?;
        check_buf("db", db.len(), self.padded_k())?;
        let pr = &self.params;
        let t = &self.tuning;
        let (p, q) = (pr.p(), pr.q());
        let u = &self.upd;
        let rows = pr.n * p;
        // dZ's K-block planes (from each row's offset in `a_off`), the X
        // planes by (C block, row, column), and dW's blocks by (K block,
        // C block, r, s) in the layer's or a thread's partials.
        let dzv = View::new(&dz.data, [p * q * t.bk]);
        let xv = View::new(&x.data, [pr.h * pr.w * t.bc, pr.w * t.bc, t.bc]);
        let cb = pr.c.div_ceil(t.bc);
        let rs = pr.r * pr.s;
        let blk = t.bc * t.bk;
        let dw_strides = [cb * rs * blk, rs * blk, pr.s * blk, blk];
        // The bias gradient rides along: the item of tap (0, 0) and C block
        // 0 adds the dY rows its BRGEMM just read (hot in L2) into db[ki].
        // A separate pass re-read all of dY from memory: 25 MiB, 4.6 ms,
        // a quarter of the 64->256 1x1 layer's update.
        db.fill(0.0);
        let bk = t.bk;
        // One item: the dW block (ki, ci, r, s) over the row chunk at r0,
        // into `dw_out`/`db_out` (the layer's or a thread's partials);
        // `first`/`last`: the first and last chunk that output sees.
        let item = |i: &[usize], dw_out: *mut f32, db_out: *mut f32, first: bool, last: bool| {
            let (r0, ki, ci, r, s) = (i[0], i[1], i[2], i[5], i[6]);
            let cnt = u.chunk.min(rows - r0);
            let a = dzv.at([ki]);
            if ci == 0 && r == 0 && s == 0 {
                // SAFETY: db_out[ki] is touched by this item alone within a
                // chunk, and the chunks of one output run in order (loop a is
                // a serial reduction); the rows lie inside dZ (checked).
                unsafe {
                    let out = std::slice::from_raw_parts_mut(db_out.add(ki * bk), bk);
                    for &off in &u.a_off[r0..r0 + cnt] {
                        add_rows(out, std::slice::from_raw_parts(a.add(off), q * bk));
                    }
                }
            }
            // The chunk's pairs whose input row tap r reaches, and the
            // columns tap s reaches: none leaves C at beta * C (zero on the
            // first chunk).
            let (tr, tc) = (&u.rows[r], u.cols[s]);
            let (lo, hi) = (tr.starts[r0 / u.chunk], tr.starts[r0 / u.chunk + 1]);
            let batch = RawBatch::Offset {
                a: a.wrapping_add(tc.lo * bk),
                b: xv.at([ci, 0, tc.x0]),
                a_offs: tr.a_off[lo..].as_ptr(),
                b_offs: tr.b_off[lo..].as_ptr(),
                count: if tc.k == 0 { 0 } else { hi - lo },
            };
            let c = ViewMut::from_ptr(dw_out, dw_strides).at([ki, ci, r, s]);
            // The next call's new rows: dY where its K block or chunk
            // differs, else X, the next C block's rows of this chunk (one
            // run within an image; a chunk that crosses images prefetches
            // past its first image's end). The 1x1 filter's one tap row
            // is this call's.
            let (ahead, len) = match u.rows_ahead.then(|| u.nest.successor(i)).flatten() {
                Some(n) if n[1] != ki || n[0] != r0 => (
                    dzv.at([n[1]]).wrapping_add(u.a_off[n[0]]),
                    u.chunk.min(rows - n[0]) * q * bk,
                ),
                Some(n) if lo < hi => (
                    xv.at([n[2], 0, tc.x0]).wrapping_add(tr.b_off[lo]),
                    u.chunk.min(rows - n[0]) * pr.stride_h * pr.w * t.bc,
                ),
                _ => (std::ptr::null(), 0),
            };
            let kernels = &u.kernels[tc.kernels].1;
            // SAFETY: sizes checked at the entry; the rows and columns of
            // the batch lie inside dZ and X (planned so); the block
            // dW[ki][ci][r][s] of `dw_out` belongs to one thread (loop a,
            // the reduction, is never parallel; split rows write partials);
            // `ahead` is only prefetched.
            unsafe {
                kernels
                    .pick(first, last)
                    .execute_raw_ahead(batch, c, std::ptr::null(), ahead, len)
            };
        };
        let threads = pool.threads();
        let chunks = rows.div_ceil(u.chunk);
        if threads == 1 || u.items >= UPD_ITEMS_PER_THREAD * threads || chunks < threads {
            let (dwp, dbp) = (SyncPtr(dw.data.as_mut_ptr()), SyncPtr(db.as_mut_ptr()));
            u.nest.run(pool, |i| {
                item(i, dwp.get(), dbp.get(), i[0] == 0, i[0] + u.chunk >= rows)
            });
            return Ok(());
        }
        // Few dW blocks (res2's 3x3 has 9: 5 + 4 on two threads): every
        // thread runs all of them over its share of the row chunks, in the
        // spec's order, into its own partial sums (thread 0 straight into
        // dW), which are then added up. The partials of dW and db are small
        // next to the rows read; the sums' rounding differs from one
        // thread's by the reassociation only.
        let (wlen, blen) = (dw.data.len(), db.len());
        let mut parts = u.partials.lock().unwrap_or_else(|e| e.into_inner());
        parts.resize((threads - 1) * (wlen + blen), 0.0);
        let (dwp, dbp) = (SyncPtr(dw.data.as_mut_ptr()), SyncPtr(db.as_mut_ptr()));
        let pp = SyncPtr(parts.as_mut_ptr());
        pool.broadcast(|tid| {
            let mine = pool.share(tid, chunks);
            let (dw_out, db_out) = if tid == 0 {
                (dwp.get(), dbp.get())
            } else {
                // SAFETY: thread tid alone uses partial tid - 1.
                unsafe {
                    let base = pp.get().add((tid - 1) * (wlen + blen));
                    std::slice::from_raw_parts_mut(base.add(wlen), blen).fill(0.0);
                    (base, base.add(wlen))
                }
            };
            u.nest.run_serial(|i| {
                let c = i[0] / u.chunk;
                if mine.contains(&c) {
                    item(i, dw_out, db_out, c == mine.start, c + 1 == mine.end)
                }
            });
        });
        // Every thread had at least one chunk, so each of its partial dW
        // blocks was written by a beta = 0 call before any was added to.
        let parts: &[f32] = &parts;
        pool.for_slices(&mut dw.data, |off, out| {
            for tp in 0..threads - 1 {
                add_rows(out, &parts[tp * (wlen + blen) + off..][..out.len()]);
            }
        });
        for tp in 0..threads - 1 {
            add_rows(db, &parts[tp * (wlen + blen) + wlen..][..blen]);
        }
        Ok(())
    }
}
