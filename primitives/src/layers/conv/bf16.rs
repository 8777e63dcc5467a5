//! Mixed-precision convolution: forward, backward-data and backward-weights
//! on bf16 operands, forward and backward-data on the f32 layer's own gather
//! loop nests, phases and blocking, with f32 accumulation and f32 outputs (AMX tiles where the channel blocks are
//! multiples of 32, else the next bf16 kernel of the CPU policy).
//!
//! The f32 filter stays the master copy; [`ConvBf16::pack_filter`] rounds
//! it once per step into the VNNI A operands of both passes (pairs along the
//! input channels for forward, along the output channels for the
//! transposed filter of backward-data). The f32 activations and output
//! gradients are rounded to bf16 in the pass that makes the gather's
//! zero-padded copy (one sweep; the pixel runs are the B operands as in
//! f32).
//!
//! Backward-weights (f32 accumulation into the f32 dW):
//! `dW[kb][cb][r][s] = sum_n dY[n][kb] X_rs[n][cb]^T` with all the pixels of
//! an image as one reduction. The zero-padded X is split into phases, its
//! rows and columns modulo the strides (one phase at stride 1); tap (r, s)
//! of output pixel (p, q) reads pixel (p + r dil_h / sh, q + s dil_w / sw)
//! of phase (r dil_h % sh, s dil_w % sw), so every tap is a stride-1 read of
//! one phase plane. The output rows are merged at the planes' width wpp
//! (pixel (p, q) at `p * wpp + q`, dY zero for q >= Q), and tap (r, s)
//! reads its plane contiguously from offset `r dil_h / sh * wpp + s dil_w /
//! sw`. The kernel wants both operands with that reduction contiguous, so
//! each call rounds dY into VNNI pairs along the merged pixels (padded with
//! zeros to `kq`, a multiple of 32: no per-row padding, which cost 2.3x the
//! work at 14 pixels per row and 4.6x at 7) and the phases that some tap
//! reads of the zero-padded X into channel-major planes (a 1x1 layer at
//! stride 2 reads one phase of four): O(activations), once per step. A
//! tap's calls start after the merged rows whose input row is top padding
//! and end before those of the bottom padding (to the kernel's
//! granularity: pairs, or 32 on AMX), one kernel per reduction length.
//! At stride 1 with small planes (the padding columns an eighth of the
//! merged rows or more: Q <= 14 for a 3x3 layer) each filter column gets
//! its own plane, shifted by the column, merged at exactly Q pixels: no
//! zero columns in the reduction, for S times the planes' writes (7x7
//! layer x1.22, 14x14 x1.03-1.09; at 28x28 the writes would cost more
//! than the 7% they save).
//! Items (K block, C block) are the threads' work; each walks the images
//! with every tap inside, accumulating (beta = 1 after the first image);
//! with fewer than two items per thread the images are split into partial
//! sums instead. Where the calls take one image each, the larger operand's
//! planes (X's or dY's) are made where they are read: a work unit takes
//! one plane's items (a C block and every K block, or the reverse) and
//! relays out each image's plane into its thread's scratch, read from L2,
//! so they never go to memory and back. An f32 operand whose writer made
//! a bf16 copy (a batch norm's residual join) is read from that copy.

use super::gather::{Gather, Out, Residual};
use super::phased::Phased;
use super::{AddResidual, Conv, ConvParams};
use crate::engine::bf16::{pack_vnni, round_slice, thread_scratch_bf16, WeightGrid, Widen};
use crate::error::{check_buf, shape, Result};
use crate::layout::SyncPtr;
use crate::math::add_rows;
use crate::pass::Chunked;
use crate::tensor::{Filter, Tensor4};
use crate::threads::Pool;
use brgemm::bf16::{bf16, Bf16Isa};
use brgemm::{AlignedVec, BatchForm, DataType, Descriptor, Epilogue, RawBatch};
use std::sync::Mutex;

/// The bf16 backward-weights plan.
struct Upd {
    /// The kernels of the whole reduction (`kq`), then those of the
    /// shorter ones of `taps`.
    kernels: Vec<(usize, Chunked)>,
    /// Merged pixels per image in the VNNI dY (P * wpp rounded up to 32).
    kq: usize,
    /// Pixels per channel of one phase plane of an image's transposed X.
    wt: usize,
    /// Columns of a phase plane: the padded width over the column stride.
    wpp: usize,
    /// The phases the taps read, `(row, column)` offsets modulo the
    /// strides, in the order of their planes; with `shifted`, `(0, s
    /// dil_w)`: filter column s's plane.
    phases: Vec<(usize, usize)>,
    /// One plane per filter column, shifted by it, rows of Q pixels (see
    /// [`ConvBf16::new`]).
    shifted: bool,
    /// Per tap (r, s).
    taps: Vec<UpdTap>,
    dyv: Mutex<AlignedVec<bf16>>,
    xt: Mutex<AlignedVec<bf16>>,
    /// The other threads' dW partial sums when the images are split.
    partials: Mutex<AlignedVec<f32>>,
    /// Whether the pass runs on the bf16 kernel; else the f32 pass runs on
    /// the same f32 operands (the CPU policy's [`brgemm::Bf16UpdRule`]).
    bf16: bool,
    /// Each tap's call reduces over all the images at once (the batch),
    /// instead of one call per image: where every image's dY and X planes
    /// together stay in L2 (1 MiB) for the taps, so each dW block is
    /// loaded and stored once per tap, not once per image and tap. Zen 4,
    /// 2 threads, minibatch 16, alternated in one process: 7x7 layers
    /// 1.14-1.18x (3x3 512, 1x1 512->2048), 14x14 1.04-1.08x; at 28x28
    /// (3.6 MB) 0.99-1.02x and at 56x56 0.95x, where one image's planes
    /// per call keep L2.
    batch_images: bool,
}

/// A tap of the bf16 update: its phase plane, its offset in it, and the
/// part `start..start + k` of the merged pixels it reduces over (with
/// `kernels[kernel]`): the output rows whose input row of this tap lies
/// in the padding are left out (zero products), as far as the kernel's
/// reduction granularity allows.
#[derive(Debug, Clone, Copy)]
struct UpdTap {
    plane: usize,
    off: usize,
    start: usize,
    kernel: usize,
}

/// An operand of the bf16 passes as the layer before handed it over: f32,
/// with its values rounded to bf16 in the same layout where the pass that
/// wrote it made that copy too, or in bf16 alone (a batch norm's input
/// gradient, [`crate::BatchNorm::backward_to_bf16`]). The bf16 passes read
/// the bf16 values either way; an f32 pass (backward-weights where
/// [`ConvBf16::upd_isa`] is None) widens values in bf16 alone first.
#[derive(Clone, Copy)]
pub enum Operand<'a> {
    /// f32, and optionally its values rounded to bf16.
    F32(&'a Tensor4, Option<&'a [bf16]>),
    /// bf16 alone.
    Bf16(&'a Tensor4<bf16>),
}

impl<'a> From<&'a Tensor4> for Operand<'a> {
    fn from(t: &'a Tensor4) -> Self {
        Operand::F32(t, None)
    }
}

impl<'a> From<&'a Tensor4<bf16>> for Operand<'a> {
    fn from(t: &'a Tensor4<bf16>) -> Self {
        Operand::Bf16(t)
    }
}

/// Where the bf16 update makes its operands' planes: all before the
/// kernel calls (the images batched per call), or, with one image per
/// call, X's (or dY's) in each work unit's scratch, image by image, just
/// before the calls that read them, the other operand's before.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Made {
    Before,
    X,
    Dy,
}

/// An operand's values as a pass reads them: f32, or bf16 (its own, or
/// the copy of an f32 operand).
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl<'a> Values<'a> {
    /// `t`'s bf16 copy where it has one (an error names a copy of another
    /// length), else its f32 values.
    fn of(t: &'a Tensor4, copy: Option<&'a [bf16]>) -> Result<Values<'a>> {
        match copy {
            None => Ok(Values::F32(&t.data)),
            Some(c) => {
                check_buf("bf16 copy", c.len(), t.data.len())?;
                Ok(Values::Bf16(c))
            }
        }
    }
}

/// The f32 tensor of `o`: its own, or `w`, its bf16 values widened.
fn f32_of<'a>(o: Operand<'a>, w: &'a Option<Tensor4>) -> &'a Tensor4 {
    match (o, w) {
        (Operand::F32(t, _), _) => t,
        (_, w) => w.as_ref().expect("widened"),
    }
}

/// The f32 sums of an output in bf16 alone ([`Out::Bf16`]): none where
/// each block's sums stay in L1 (`whole`), else `acc` grown to `len`.
fn block_sums(acc: &mut AlignedVec<f32>, whole: bool, len: usize) -> &mut [f32] {
    match whole {
        true => &mut [],
        false => {
            acc.resize(len, 0.0);
            &mut acc[..]
        }
    }
}

/// The bf16 forward and (stride-1) backward-data of a [`Conv`] layer.
pub struct ConvBf16 {
    fwd: Gather<bf16>,
    /// The f32 sums of a bf16 forward output whose blocks' reductions span
    /// calls ([`ConvBf16::forward_bf16`]).
    acc: Mutex<AlignedVec<f32>>,
    bwd: Phased<bf16>,
    upd: Upd,
    params: ConvParams,
    bc: usize,
    bk: usize,
}

impl ConvBf16 {
    /// Plans the bf16 passes for `conv`'s shape, blocking and loop orders.
    /// The channel blocks bc and bk must be even (VNNI pairs).
    pub fn new(conv: &Conv) -> Result<ConvBf16> {
        let t = conv.tuning();
        for (what, v) in [("bc", t.bc), ("bk", t.bk)] {
            if v % 2 != 0 {
                return Err(shape(
                    what,
                    v,
                    "bf16 convolutions need even channel blocks (VNNI pairs)",
                ));
            }
        }
        let ep = Epilogue {
            bias: true,
            activation: conv.act,
        };
        let bwd = conv.bwd_plan.build(&t.bwd, Epilogue::default())?;
        let p = conv.params;
        let upd = {
            let (kb, cb) = (p.k.div_ceil(t.bk), p.c.div_ceil(t.bc));
            let (hp, wp) = (p.h + 2 * p.pad_h, p.w + 2 * p.pad_w);
            let (sh, sw) = (p.stride_h, p.stride_w);
            // The padded X split into phases by row and column modulo the
            // strides: tap (r, s) of output pixel (p, q) reads padded pixel
            // (sh p + r dil_h, sw q + s dil_w), which is pixel
            // (p + r dil_h / sh, q + s dil_w / sw) of phase
            // (r dil_h % sh, s dil_w % sw): a stride-1 read of that plane.
            // At stride 1, where the merged rows' padding columns would be
            // an eighth of the reduction or more (Q = 14 and under for a 3x3
            // layer), each filter column gets a plane of its own instead,
            // shifted by that column: rows of exactly Q pixels, no zero
            // columns between them, for S times the planes' writes.
            let shifted = sh == 1 && sw == 1 && p.s > 1 && 8 * (wp - p.q()) >= p.q();
            let wpp = if shifted { p.q() } else { wp.div_ceil(sw) };
            let mut phases = Vec::new();
            let mut taps = Vec::with_capacity(p.r * p.s);
            for (r, s) in (0..p.r).flat_map(|r| (0..p.s).map(move |s| (r, s))) {
                let (dr, ds) = (r * p.dil_h, s * p.dil_w);
                let ph = if shifted { (0, ds) } else { (dr % sh, ds % sw) };
                let i = phases.iter().position(|&q| q == ph).unwrap_or_else(|| {
                    phases.push(ph);
                    phases.len() - 1
                });
                let col = if shifted { 0 } else { ds / sw };
                taps.push((i, dr / sh * wpp + col));
            }
            // An image's output rows merged into one reduction of P rows
            // of wpp pixels (zero dY beyond Q), rounded up to 32.
            let kq = (p.p() * wpp).next_multiple_of(32);
            // A phase plane: its rows of the padded image, then zeros for
            // the taps' offsets past its end.
            let far = taps.iter().map(|t| t.1).max().unwrap_or(0);
            let wt = (kq + far).max(hp.div_ceil(sh) * wpp);
            // One image per call: the images are the calls, in an order
            // that keeps an image's planes in L2 for every tap.
            let desc = |k| {
                Descriptor::new(t.bk, t.bc, k)
                    .dtype(DataType::Bf16)
                    .ldb(wt)
                    .batch_form(BatchForm::Stride {
                        a: kb * kq * t.bk,
                        b: cb * phases.len() * t.bc * wt,
                    })
            };
            let mut kernels = vec![(kq, Chunked::new(desc(kq), Epilogue::default())?)];
            let isa = kernels[0].1.pick(true, true).bf16_isa();
            // Each tap reduces over the merged rows whose input row lies
            // inside the image, widened to the kernel's granularity (AMX
            // tiles: 32 pixels; else VNNI pairs); a shorter reduction
            // planned on another kernel than the whole one's keeps the
            // whole one.
            let g = if isa == Some(Bf16Isa::Amx) { 32 } else { 2 };
            let taps = taps
                .into_iter()
                .enumerate()
                .map(|(tap, (plane, off))| {
                    let r = tap / p.s;
                    let (lo, hi) = super::inside(p.p(), sh, r * p.dil_h, p.pad_h, p.h);
                    let (start, end) = ((lo * wpp) / g * g, (hi * wpp).next_multiple_of(g).min(kq));
                    let whole = UpdTap {
                        plane,
                        off,
                        start: 0,
                        kernel: 0,
                    };
                    if end <= start || end - start == kq {
                        return Ok(whole);
                    }
                    let k = end - start;
                    let at = match kernels.iter().position(|(kk, _)| *kk == k) {
                        Some(at) => at,
                        None => {
                            let ks = Chunked::new(desc(k), Epilogue::default())?;
                            if ks.pick(true, true).bf16_isa() != isa {
                                return Ok(whole);
                            }
                            kernels.push((k, ks));
                            kernels.len() - 1
                        }
                    };
                    Ok(UpdTap {
                        start,
                        kernel: at,
                        ..whole
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // The rounded elements: the phase planes of X that some tap
            // reads (transposed, counted twice) and dY.
            let plane = |&(a, b): &(usize, usize)| {
                let rows = (p.h + p.pad_h).saturating_sub(a).div_ceil(sh).min(p.h);
                let cols = (p.w + p.pad_w).saturating_sub(b).div_ceil(sw).min(p.w);
                rows * cols
            };
            let x_px: usize = phases.iter().map(plane).sum();
            let rounded = 2 * p.c * x_px + p.k * p.p() * p.q();
            let flops = 2.0 * (p.k * p.c * p.r * p.s * p.p() * p.q()) as f64;
            let bf16 = isa.is_some_and(|isa| {
                let dw_bytes = 4 * p.k * p.c * p.r * p.s;
                let per_rounded = flops / rounded as f64;
                crate::policy().bf16_upd_pays(isa, p.n * p.p() * p.q(), per_rounded, dw_bytes)
            });
            let image_bytes = 2 * (kq * t.bk + phases.len() * t.bc * wt);
            Upd {
                kernels,
                bf16,
                batch_images: p.n * image_bytes <= 1 << 20,
                shifted,
                kq,
                wt,
                wpp,
                phases,
                taps,
                dyv: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
                xt: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
                partials: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
            }
        };
        Ok(ConvBf16 {
            fwd: Gather::new("fwd", conv.fwd.g, &conv.fwd.taps, &t.fwd, ep)?,
            acc: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
            bwd,
            upd,
            params: conv.params,
            bc: t.bc,
            bk: t.bk,
        })
    }

    /// The bf16 kernel of the forward pass, e.g. `Amx`.
    pub fn isa(&self) -> Bf16Isa {
        let k = self.fwd.main.pick(true, true);
        k.bf16_isa().expect("planned with a bf16 descriptor")
    }

    /// Whether this layer on bf16 beats its f32 passes on this CPU
    /// ([`brgemm::Policy::bf16_conv_pays`]): the forward kernel does, and on
    /// AVX512-BF16 the layer does enough work per activation element for
    /// its rounding sweeps to pay. A mixed-precision network keeps the
    /// layers where this is false in f32.
    pub fn pays(&self) -> bool {
        crate::policy().bf16_conv_pays(self.isa(), self.params.flops_per_activation())
    }

    /// Whether forward and backward-data read their bf16 operand in place
    /// when it comes in bf16 (`xb` of [`ConvBf16::forward`], `dzb` of
    /// [`ConvBf16::backward_data`]): where they
    /// pad no border around it (a 1x1 layer), so no sweep over it at all.
    pub fn reads_in_place(&self) -> (bool, bool) {
        (
            self.fwd.g.ph == 0 && self.fwd.g.pw == 0,
            self.bwd.unpadded(),
        )
    }

    /// The bf16 kernel of backward-weights, or None where that pass runs
    /// in f32 because bf16 would not pay on this CPU (the policy's
    /// [`brgemm::Bf16UpdRule`]: on AVX512-BF16, a 1x1 layer whose large
    /// input must be transposed for little work per element).
    pub fn upd_isa(&self) -> Option<Bf16Isa> {
        let k = self.upd.kernels[0].1.pick(true, true);
        k.bf16_isa().filter(|_| self.upd.bf16)
    }

    /// Packs the f32 filter `w` into the VNNI operands of forward (`wv`)
    /// and backward-data (`wtv`).
    pub fn pack_filter(
        &self,
        pool: &Pool,
        w: &Filter,
        wv: &mut AlignedVec<bf16>,
        wtv: &mut AlignedVec<bf16>,
    ) -> Result<()> {
        let p = &self.params;
        if w.dims() != (p.k, p.c, p.r, p.s, self.bk, self.bc) {
            return Err(shape(
                "W",
                format!("(k, c, r, s, bk, bc) = {:?}", w.dims()),
                "does not match the layer",
            ));
        }
        let grid = WeightGrid {
            outer: p.k.div_ceil(self.bk),
            inner: p.c.div_ceil(self.bc),
            taps: p.r * p.s,
            bi: self.bc,
            bo: self.bk,
        };
        pack_vnni(pool.for_work(p.flops()), &w.data, grid, wv, wtv);
        Ok(())
    }

    /// Y = act(conv(X, W) + b) from X and the packed filter. An f32 X is
    /// rounded to bf16 in the same pass that makes the zero-padded copy the
    /// gather reads; its bf16 copy ([`Operand::F32`] with the copy, made by
    /// the pass that wrote X, e.g. [`crate::BatchNorm::forward_train_to`])
    /// or X in bf16 alone is read as it is: in place where the layer pads
    /// no border (no sweep over X at all), else copied into the padded
    /// input at half the bytes.
    pub fn forward<'a>(
        &self,
        pool: &Pool,
        conv: &Conv,
        x: impl Into<Operand<'a>>,
        wv: &[bf16],
        bias: &[f32],
        y: &mut Tensor4,
    ) -> Result<()> {
        self.forward_f32(pool, conv, x.into(), wv, bias, None, y)
    }

    /// As [`ConvBf16::forward`], then `+ R` and a ReLU when `add.relu`, on
    /// each output block in L1 ([`Conv::forward_add`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add<'a>(
        &self,
        pool: &Pool,
        conv: &Conv,
        x: impl Into<Operand<'a>>,
        wv: &[bf16],
        bias: &[f32],
        add: AddResidual<'_>,
        y: &mut Tensor4,
    ) -> Result<()> {
        conv.check_y("residual", add.r)?;
        let res = Some((&add.r.data[..], add.relu));
        self.forward_f32(pool, conv, x.into(), wv, bias, res, y)
    }

    /// The forward into the f32 `y`, with the residual `res`.
    #[allow(clippy::too_many_arguments)]
    fn forward_f32(
        &self,
        pool: &Pool,
        conv: &Conv,
        x: Operand<'_>,
        wv: &[bf16],
        bias: &[f32],
        res: Residual<'_>,
        y: &mut Tensor4,
    ) -> Result<()> {
        conv.check_y("Y", y)?;
        self.forward_with(pool, conv, x, wv, bias, res, Out::F32(&mut y.data))?;
        conv.clear_channel_tail(pool, y);
        Ok(())
    }

    /// As [`ConvBf16::forward`], with the output in bf16 alone: each output
    /// block is rounded from its f32 sums while they sit in L1 (the same
    /// bits as rounding the f32 output), so the output costs half the
    /// bytes and no f32 output exists (the input of a batch norm reading
    /// bf16, [`crate::BatchNorm::forward_train_to`]).
    pub fn forward_bf16<'a>(
        &self,
        pool: &Pool,
        conv: &Conv,
        x: impl Into<Operand<'a>>,
        wv: &[bf16],
        bias: &[f32],
        y: &mut Tensor4<bf16>,
    ) -> Result<()> {
        conv.check_y("Y", y)?;
        let mut acc = self.acc.lock().unwrap_or_else(|e| e.into_inner());
        let acc = block_sums(&mut acc, self.fwd.whole_blocks(), y.data.len());
        let out = Out::Bf16(&mut y.data, acc);
        self.forward_with(pool, conv, x.into(), wv, bias, None, out)?;
        conv.clear_channel_tail(pool, y);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_with(
        &self,
        pool: &Pool,
        conv: &Conv,
        x: Operand<'_>,
        wv: &[bf16],
        bias: &[f32],
        res: Residual<'_>,
        y: Out<'_>,
    ) -> Result<()> {
        let pool = pool.for_work(self.params.flops());
        self.check(conv)?;
        check_buf("packed W", wv.len(), conv.filter_len())?;
        check_buf("bias", bias.len(), conv.padded_k())?;
        match x {
            Operand::F32(x, xb) => {
                conv.check_x("X", x)?;
                match xb {
                    Some(xb) => {
                        check_buf("bf16 X", xb.len(), x.data.len())?;
                        self.fwd.run(pool, xb, wv, Some(bias), res, y)
                    }
                    None => {
                        let f = round_slice;
                        self.fwd
                            .run_converted(pool, &x.data, f, wv, Some(bias), res, y)
                    }
                }
            }
            Operand::Bf16(x) => {
                conv.check_x("X", x)?;
                self.fwd.run(pool, &x.data, wv, Some(bias), res, y)
            }
        }
        Ok(())
    }

    /// dX = conv^T(dZ, W) from dZ and the packed transposed filter. An f32
    /// dZ is rounded to bf16 in the pass that pads it; its bf16 copy
    /// ([`Operand::F32`] with the copy, made by the pass that wrote dZ, e.g.
    /// [`crate::BatchNorm::backward_to`]) or dZ in bf16 alone is read as it
    /// is, in place where the transposed convolution pads no border.
    pub fn backward_data<'a>(
        &self,
        pool: &Pool,
        conv: &Conv,
        dz: impl Into<Operand<'a>>,
        wtv: &[bf16],
        dx: &mut Tensor4,
    ) -> Result<()> {
        conv.check_x("dX", dx)?;
        self.backward_data_with(pool, conv, dz.into(), wtv, Out::F32(&mut dx.data))
    }

    /// As [`ConvBf16::backward_data`], with dX in bf16 alone (rounded from
    /// each block's f32 sums in L1, the bits of the f32 dX rounded): the
    /// output gradient of a batch norm that reads it so
    /// ([`crate::BatchNorm::backward_to`]). Only where backward-data is one
    /// phase that writes every pixel of dX, stride 1
    /// ([`ConvBf16::writes_dx_bf16`]); elsewhere an error.
    pub fn backward_data_bf16<'a>(
        &self,
        pool: &Pool,
        conv: &Conv,
        dz: impl Into<Operand<'a>>,
        wtv: &[bf16],
        dx: &mut Tensor4<bf16>,
    ) -> Result<()> {
        conv.check_x("dX", dx)?;
        if !self.writes_dx_bf16() {
            let p = &self.params;
            return Err(shape(
                "bf16 dX",
                format!("strides ({}, {})", p.stride_h, p.stride_w),
                "backward-data writes dX in bf16 alone at stride 1 only",
            ));
        }
        let mut acc = self.acc.lock().unwrap_or_else(|e| e.into_inner());
        let acc = block_sums(&mut acc, self.bwd.whole_blocks(), dx.data.len());
        self.backward_data_with(pool, conv, dz.into(), wtv, Out::Bf16(&mut dx.data, acc))
    }

    /// Whether [`ConvBf16::backward_data_bf16`] can write dX in bf16 alone
    /// (stride 1).
    pub fn writes_dx_bf16(&self) -> bool {
        self.bwd.one_dense_phase()
    }

    fn backward_data_with(
        &self,
        pool: &Pool,
        conv: &Conv,
        dz: Operand<'_>,
        wtv: &[bf16],
        dx: Out<'_>,
    ) -> Result<()> {
        let pool = pool.for_work(self.params.flops());
        self.check(conv)?;
        check_buf("packed Wt", wtv.len(), conv.filter_len())?;
        match dz {
            Operand::F32(dz, dzb) => {
                conv.check_y("dZ", dz)?;
                match dzb {
                    Some(dzb) => {
                        check_buf("bf16 dZ", dzb.len(), dz.data.len())?;
                        self.bwd.run(pool, dzb, wtv, dx)
                    }
                    None => self.bwd.run_converted(pool, &dz.data, round_slice, wtv, dx),
                }
            }
            Operand::Bf16(dz) => {
                conv.check_y("dZ", dz)?;
                self.bwd.run(pool, &dz.data, wtv, dx)
            }
        }
        Ok(())
    }

    /// dW = sum over the minibatch of dZ (x) X and db = the sums of dZ per
    /// output channel, from dZ (f32, rounded here, or in bf16 alone: the
    /// same pairs, db then summed from the rounded values) and the f32 X
    /// (rounded here), accumulated in f32; where [`ConvBf16::upd_isa`] is
    /// None, `conv`'s f32 pass on the same operands (dZ in bf16 alone
    /// widened first).
    pub fn backward_weights<'a, 'b>(
        &self,
        pool: &Pool,
        conv: &Conv,
        dz: impl Into<Operand<'a>>,
        x: impl Into<Operand<'b>>,
        dw: &mut Filter,
        db: &mut [f32],
    ) -> Result<()> {
        self.check(conv)?;
        let (dz, x) = (dz.into(), x.into());
        if !self.upd.bf16 {
            // The f32 pass: operands in bf16 alone widened first.
            let widened = |o: Operand<'_>| match o {
                Operand::F32(..) => None,
                Operand::Bf16(t) => Some(t.widened()),
            };
            let (dzw, xw) = (widened(dz), widened(x));
            return conv.backward_weights(pool, f32_of(dz, &dzw), f32_of(x, &xw), dw, db);
        }
        // The values the pass reads: X's bf16 copy where the f32 operand
        // has one (half the bytes to relay out), else the operand's own.
        // An f32 dZ is read as f32 even with a copy: the bias gradient
        // sums its f32 values, as the pass without the copy does.
        let dz = match dz {
            Operand::F32(t, _) => {
                conv.check_y("dZ", t)?;
                Values::F32(&t.data)
            }
            Operand::Bf16(t) => {
                conv.check_y("dZ", t)?;
                Values::Bf16(&t.data)
            }
        };
        let x = match x {
            Operand::F32(t, c) => {
                conv.check_x("X", t)?;
                Values::of(t, c)?
            }
            Operand::Bf16(t) => {
                conv.check_x("X", t)?;
                Values::Bf16(&t.data)
            }
        };
        use Values::{Bf16 as B, F32 as F};
        match (dz, x) {
            (F(dz), F(x)) => self.upd_bf16(pool, conv, dz, x, dw, db),
            (F(dz), B(x)) => self.upd_bf16(pool, conv, dz, x, dw, db),
            (B(dz), F(x)) => self.upd_bf16(pool, conv, dz, x, dw, db),
            (B(dz), B(x)) => self.upd_bf16(pool, conv, dz, x, dw, db),
        }
    }

    /// The bf16 backward-weights on the values of dZ and X (checked
    /// against the layer), of either type (pairs and planes rounded from
    /// f32, or moved from bf16).
    fn upd_bf16<D: Widen, X: Widen>(
        &self,
        pool: &Pool,
        conv: &Conv,
        dz: &[D],
        x: &[X],
        dw: &mut Filter,
        db: &mut [f32],
    ) -> Result<()> {
        let pool = pool.for_work(self.params.flops());
        let u = &self.upd;
        conv.check_f("dW", dw, false)?;
        check_buf("db", db.len(), conv.padded_k())?;
        let pr = &self.params;
        let (bc, bk, kq, wt) = (self.bc, self.bk, u.kq, u.wt);
        let (p, q) = (pr.p(), pr.q());
        let (kb, cb) = (pr.k.div_ceil(bk), pr.c.div_ceil(bc));
        let wpp = u.wpp;
        let mut dyv = u.dyv.lock().unwrap_or_else(|e| e.into_inner());
        let mut xt = u.xt.lock().unwrap_or_else(|e| e.into_inner());
        // dY planes as VNNI pairs along the merged pixels (row p, column
        // q at p * wpp + q), zero at columns q >= Q and past the last row;
        // each with its bias-gradient sums, taken in the same read (a
        // separate pass over dY cost more than the AMX work on 1x1 layers:
        // 40% of res2's 64->256 backward-weights).
        let plane = kq * bk;
        let zero = vec![D::ZERO; bk];
        let mut db_parts = vec![0.0f32; pr.n * kb * bk];
        let sp = SyncPtr(db_parts.as_mut_ptr());
        let dy_plane = |i: usize, out: &mut [bf16]| {
            // SAFETY: plane i's sums belong to the one caller of plane i.
            let sums = unsafe { std::slice::from_raw_parts_mut(sp.get().add(i * bk), bk) };
            let src = &dz[i * p * q * bk..][..p * q * bk];
            let px = |m: usize| {
                let (row, col) = (m / wpp, m % wpp);
                match row < p && col < q {
                    true => &src[(row * q + col) * bk..][..bk],
                    false => &zero[..],
                }
            };
            for (mp, pair) in out.chunks_exact_mut(2 * bk).enumerate() {
                // Two pixels' channels interleaved: one 32-bit word per
                // channel.
                D::interleave(pair, px(2 * mp), px(2 * mp + 1), sums);
            }
        };
        // X channel-major per phase plane of the padded image, zero in the
        // padding and beyond; only the phases that some tap reads.
        let (sh, sw) = (pr.stride_h, pr.stride_w);
        let xplane = u.phases.len() * bc * wt;
        let x_plane = |i: usize, out: &mut [bf16]| {
            out.fill(bf16::ZERO);
            let src = &x[i * pr.h * pr.w * bc..][..pr.h * pr.w * bc];
            // Each image row's pixels of a phase into that plane's channel
            // rows (runs of pixels, every sw-th of the row).
            for y in 0..pr.h {
                let (ph_row, row) = ((y + pr.pad_h) % sh, (y + pr.pad_h) / sh);
                if u.shifted {
                    // Plane k holds padded row y + pad_h at columns ds..ds + Q.
                    for (k, &(_, ds)) in u.phases.iter().enumerate() {
                        let (lo, hi) = super::inside(q, 1, ds, pr.pad_w, pr.w);
                        if lo < hi {
                            let s = &src[(y * pr.w + lo + ds - pr.pad_w) * bc..];
                            let d = &mut out[k * bc * wt + row * wpp + lo..];
                            X::transpose(d, wt, s, bc, hi - lo, 1);
                        }
                    }
                    continue;
                }
                for (k, &(a, b)) in u.phases.iter().enumerate() {
                    // The first column whose padded index is b modulo sw.
                    let x0 = (b + sw - pr.pad_w % sw) % sw;
                    if a != ph_row || x0 >= pr.w {
                        continue;
                    }
                    let s = &src[(y * pr.w + x0) * bc..];
                    let d = &mut out[k * bc * wt + row * wpp + (x0 + pr.pad_w) / sw..];
                    X::transpose(d, wt, s, bc, (pr.w - x0).div_ceil(sw), sw);
                }
            }
        };
        // With one image per call, the larger operand's planes are made
        // where they are used: each work unit relays out an image's plane
        // into its thread's scratch (L2) and runs every item of that plane
        // on it, so that operand never goes to memory and back ([`Made`]).
        // With the images batched per call, every plane of both is made
        // first.
        let made = match u.batch_images {
            true => Made::Before,
            false if cb * xplane >= kb * plane => Made::X,
            false => Made::Dy,
        };
        if made != Made::Dy {
            dyv.resize(pr.n * kb * plane, bf16::ZERO);
            pool.for_slices_of(&mut dyv, plane, dy_plane);
        }
        if made != Made::X {
            xt.resize(pr.n * cb * xplane, bf16::ZERO);
            pool.for_slices_of(&mut xt, xplane, x_plane);
        }
        let (dyp, xtp) = (dyv.as_ptr() as usize, xt.as_ptr() as usize);
        let rs = pr.r * pr.s;
        let blk = bc * bk;
        // Work: units of (K block, C block) items, each walking the images
        // with every tap inside (an image's dY and X planes are read from
        // memory once and reused from L2 for the R x S taps); where a
        // plane is made in place, a unit is that plane's items: (C block,
        // all K blocks) for X's, (K block, all C blocks) for dY's. With
        // fewer units than two per thread, the images are split between
        // the threads instead, into partial sums added at the end.
        let (units, inner) = match made {
            Made::Before => (kb * cb, 1),
            Made::X => (cb, kb),
            Made::Dy => (kb, cb),
        };
        let threads = pool.threads();
        let split = if units >= 2 * threads {
            1
        } else {
            threads.min(pr.n)
        };
        let dw_len = dw.data.len();
        let mut partials = u.partials.lock().unwrap_or_else(|e| e.into_inner());
        partials.resize((split - 1) * dw_len, 0.0);
        let (dwp, pp) = (
            SyncPtr(dw.data.as_mut_ptr()),
            SyncPtr(partials.as_mut_ptr()),
        );
        let scratch_len = match made {
            Made::X => xplane,
            Made::Dy => plane,
            Made::Before => 0,
        };
        pool.for_each(units * split, |w| {
            let (unit, part) = (w / split, w % split);
            let (lo, hi) = (pr.n * part / split, pr.n * (part + 1) / split);
            let scratch = match made {
                Made::Before => std::ptr::null_mut(),
                _ => thread_scratch_bf16(scratch_len),
            };
            // SAFETY: the dW blocks of this unit's items in part `part`
            // (the layer's dW or that part's partials) belong to this work
            // unit, as do the planes it makes (one image's, into its
            // thread's scratch, which nothing else on the thread takes
            // meanwhile); the offsets stay inside the buffers made above.
            unsafe {
                let out = match part {
                    0 => dwp.get(),
                    k => pp.get().add((k - 1) * dw_len),
                };
                // Images per call: this part's all, or one ([`Upd::batch_images`]).
                let count = if u.batch_images { hi - lo } else { 1 };
                for n0 in (lo..hi).step_by(count.max(1)) {
                    let here = || std::slice::from_raw_parts_mut(scratch, scratch_len);
                    match made {
                        Made::X => x_plane(n0 * cb + unit, here()),
                        Made::Dy => dy_plane(n0 * kb + unit, here()),
                        Made::Before => {}
                    }
                    for j in 0..inner {
                        let (ki, ci) = match made {
                            Made::Before => (unit / cb, unit % cb),
                            Made::X => (j, unit),
                            Made::Dy => (unit, j),
                        };
                        let a = match made {
                            Made::Dy => scratch as *const bf16,
                            _ => (dyp as *const bf16).add((n0 * kb + ki) * plane),
                        };
                        let b = match made {
                            Made::X => scratch as *const bf16,
                            _ => (xtp as *const bf16).add((n0 * cb + ci) * xplane),
                        };
                        let item = ki * cb + ci;
                        for (tap, t) in u.taps.iter().enumerate() {
                            // Merged pixel `start` of dY's VNNI pairs (start
                            // even) and of the tap's run of the phase plane.
                            let a = a.add(t.start * bk);
                            let b = b.add(t.plane * bc * wt + t.off + t.start);
                            let batch = RawBatch::Stride { a, b, count };
                            let k = u.kernels[t.kernel].1.pick(n0 == lo, false);
                            k.execute_raw(
                                batch,
                                out.add((item * rs + tap) * blk),
                                std::ptr::null(),
                            );
                        }
                    }
                }
            }
        });
        if split > 1 {
            let parts = &partials[..];
            pool.for_slices(&mut dw.data, |lo, out| {
                for k in 0..split - 1 {
                    add_rows(out, &parts[k * dw_len + lo..][..out.len()]);
                }
            });
        }
        // The planes' sums in image order (the same bits on any thread count).
        let db = &mut db[..kb * bk];
        db.fill(0.0);
        add_rows(db, &db_parts);
        Ok(())
    }

    fn check(&self, conv: &Conv) -> Result<()> {
        let t = conv.tuning();
        if conv.params != self.params || (t.bc, t.bk) != (self.bc, self.bk) {
            return Err(shape(
                "conv",
                format!("{:?}", conv.params),
                "is not the layer these bf16 passes were planned for",
            ));
        }
        Ok(())
    }
}
