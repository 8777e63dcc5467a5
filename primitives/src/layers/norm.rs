//! Batch normalisation over the images and pixels of blocked
//! `[N][C/bc][H][W][bc]` tensors: training mode (minibatch statistics, and
//! running statistics updated with momentum), inference mode (running
//! statistics) and backward.
//!
//! Each pass reads the tensor plane by plane, one (image, channel block)
//! plane per work item split over the threads, so a layer with one channel
//! block still uses every core: per-plane sums (f32 over runs of 64 pixels,
//! f64 across runs) are combined per channel between the passes. The
//! variance sums are taken around a per-channel shift (the first pixel) so
//! that one pass suffices without cancellation. An optional ReLU is fused
//! into the output write ([`BatchNorm::relu`]), and its mask into backward.
//! Where a bf16 layer reads the output (or the input gradient), the `_to`
//! passes also write it rounded to bf16, piece by piece as it is computed.

use crate::eltwise::pass;
use crate::engine::bf16::{round_slice, thread_scratch, Twin, Widen};
use crate::engine::math::wide;
use crate::error::{check_buf, shape, Result};
use crate::tensor::Tensor4;
use crate::threads::Pool;
use brgemm::bf16::bf16;

/// A batch-normalisation layer with its parameters and running statistics
/// (all of length `padded_c`; the padding channels stay zero).
#[derive(Debug, Clone)]
pub struct BatchNorm {
    /// Channels.
    pub(crate) c: usize,
    /// Channel block of the tensors it reads.
    pub(crate) bc: usize,
    /// Added to the variance.
    pub eps: f32,
    /// Weight of the new minibatch in the running statistics.
    pub momentum: f32,
    /// Applies ReLU to the output in the same pass (NaN stays NaN);
    /// backward then goes through [`BatchNorm::backward_relu`].
    pub relu: bool,
    /// Scale.
    pub(crate) gamma: Vec<f32>,
    /// Shift.
    pub(crate) beta: Vec<f32>,
    /// Running mean (inference).
    pub(crate) running_mean: Vec<f32>,
    /// Running (unbiased) variance (inference).
    pub(crate) running_var: Vec<f32>,
    /// Minibatch mean of the last training forward.
    saved_mean: Vec<f32>,
    /// 1 / sqrt(var + eps) of the last training forward.
    saved_invstd: Vec<f32>,
    /// The per-channel scale and offset of the last training forward when
    /// it fused the ReLU without a residual (else empty): backward then
    /// finds where y was positive from x, bit for bit as the forward did,
    /// instead of reading y.
    saved_affine: (Vec<f32>, Vec<f32>),
}

/// An error naming `what` unless `t` has the dims of `x`.
fn same_dims<A, B>(what: &str, t: &Tensor4<A>, x: &Tensor4<B>) -> Result<()> {
    if t.dims() != x.dims() {
        return Err(shape(
            what,
            format!("{:?}", t.dims()),
            format!("must match x {:?}", x.dims()),
        ));
    }
    Ok(())
}

crate::layout::getters!(BatchNorm {
    c: usize = "Channels.",
    bc: usize = "Channel block of the tensors it reads.",
});

impl BatchNorm {
    /// Scale (length `padded_c`).
    pub fn gamma(&self) -> &[f32] {
        &self.gamma
    }
    /// Scale, to update in place (the length is fixed).
    pub fn gamma_mut(&mut self) -> &mut [f32] {
        &mut self.gamma
    }
    /// Shift (length `padded_c`).
    pub fn beta(&self) -> &[f32] {
        &self.beta
    }
    /// Shift, to update in place (the length is fixed).
    pub fn beta_mut(&mut self) -> &mut [f32] {
        &mut self.beta
    }
    /// Scale and shift together, to update both in place (an optimizer
    /// stepping over every parameter).
    pub fn gamma_beta_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        (&mut self.gamma, &mut self.beta)
    }
    /// Running mean (inference).
    pub fn running_mean(&self) -> &[f32] {
        &self.running_mean
    }
    /// Running mean, to set in place (e.g. when loading a model).
    pub fn running_mean_mut(&mut self) -> &mut [f32] {
        &mut self.running_mean
    }
    /// Running (unbiased) variance (inference).
    pub fn running_var(&self) -> &[f32] {
        &self.running_var
    }
    /// Running variance, to set in place (e.g. when loading a model).
    pub fn running_var_mut(&mut self) -> &mut [f32] {
        &mut self.running_var
    }
}

impl BatchNorm {
    /// gamma = 1, beta = 0, running mean 0 and variance 1; eps 1e-5,
    /// momentum 0.1.
    pub fn new(c: usize, bc: usize) -> Result<BatchNorm> {
        if c == 0 || bc == 0 {
            return Err(shape(
                "channels or block",
                format!("c={c} bc={bc}"),
                "must be at least 1",
            ));
        }
        let pc = c.div_ceil(bc) * bc;
        let ones = |v: f32| {
            (0..pc)
                .map(|i| if i < c { v } else { 0.0 })
                .collect::<Vec<_>>()
        };
        Ok(BatchNorm {
            c,
            bc,
            eps: 1e-5,
            momentum: 0.1,
            relu: false,
            gamma: ones(1.0),
            beta: vec![0.0; pc],
            running_mean: vec![0.0; pc],
            running_var: ones(1.0),
            saved_mean: vec![0.0; pc],
            saved_invstd: vec![0.0; pc],
            saved_affine: (Vec::new(), Vec::new()),
        })
    }

    fn check<T>(&self, what: &str, t: &Tensor4<T>) -> Result<()> {
        if t.c != self.c || t.bc != self.bc {
            return Err(shape(
                what,
                format!("c={} bc={}", t.c, t.bc),
                format!("layer has c={} bc={}", self.c, self.bc),
            ));
        }
        Ok(())
    }

    /// Training forward: normalises with the minibatch statistics, keeps
    /// them for backward and updates the running statistics.
    pub fn forward_train(&mut self, pool: &Pool, x: &Tensor4, y: &mut Tensor4) -> Result<()> {
        self.forward_train_to(pool, x, None, y, None)
    }

    /// [`BatchNorm::forward_train`] with the residual join in the same
    /// pass: `y = bn(x) + r`, then a ReLU when `relu` (the layer's own fused
    /// ReLU, which would come before the addition, must be off). Backward
    /// is [`BatchNorm::backward`] of the gradient through that ReLU.
    pub fn forward_train_add(
        &mut self,
        pool: &Pool,
        x: &Tensor4,
        r: &Tensor4,
        relu: bool,
        y: &mut Tensor4,
    ) -> Result<()> {
        self.forward_train_to(pool, x, Some((r, relu)), y, None)
    }

    /// The checks of a forward's operands; the bf16 copy of y.
    fn forward_checks<X>(
        &self,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        y: &Output<'_>,
    ) -> Result<()> {
        self.check("x", x)?;
        match y {
            Output::F32(y, _) => same_dims("y", y, x)?,
            Output::Bf16(y) => same_dims("y", y, x)?,
        }
        if let Some((r, _)) = res {
            self.check_residual(r, x)?;
        }
        Ok(())
    }

    /// An error unless `r` can join the output of `x`.
    fn check_residual<X>(&self, r: &Tensor4, x: &Tensor4<X>) -> Result<()> {
        same_dims("residual", r, x)?;
        if self.relu {
            return Err(shape(
                "relu",
                "true",
                "a batch norm with its own ReLU cannot add a residual after it",
            ));
        }
        Ok(())
    }

    /// [`BatchNorm::forward_train`], or [`BatchNorm::forward_train_add`]
    /// with `res`, also writing `y` rounded to bf16 into `yb` (of y's
    /// length) when given: the input of a bf16 layer, made in this pass.
    pub fn forward_train_to<X: Widen>(
        &mut self,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        y: &mut Tensor4,
        yb: Option<&mut [bf16]>,
    ) -> Result<()> {
        let len = y.data.len();
        self.forward_train_with(pool, x, res, Output::F32(y, Twin::new("bf16 y", yb, len)?))
    }

    /// [`BatchNorm::forward_train_to`] with y in bf16 alone, each piece
    /// rounded from f32 in L1 (the bits of the f32 y rounded): the input of
    /// bf16 convolutions that read it so ([`crate::conv::Operand`]).
    pub fn forward_train_bf16<X: Widen>(
        &mut self,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        y: &mut Tensor4<bf16>,
    ) -> Result<()> {
        self.forward_train_with(pool, x, res, Output::Bf16(y))
    }

    fn forward_train_with<X: Widen>(
        &mut self,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        yb: Output<'_>,
    ) -> Result<()> {
        self.forward_checks(x, res, &yb)?;
        let (bc, pc) = (x.bc, x.padded_c());
        let count = (x.n * x.h * x.w) as f64;
        // The first image's first pixel per channel: the shift that keeps
        // the one-pass variance free of cancellation.
        let shift: Vec<f32> = (0..pc)
            .map(|ch| x.data[plane(x, 0, ch / bc) + ch % bc].f32())
            .collect();
        let sums = plane_sums(pool, x, |i, out| {
            let k = &shift[(i % x.c_blocks()) * bc..][..bc];
            let x = &x.data[plane(x, i / x.c_blocks(), i % x.c_blocks())..][..plane_len(x)];
            by_group!(bc, G => wide(#[inline(always)] || shifted_sums::<G, X>(bc, x, k, out)));
        });
        let (mut scale, mut offset) = (vec![0f32; pc], vec![0f32; pc]);
        for ch in 0..self.c {
            let (s, q) = channel_sum(x, &sums, ch);
            let mean = s / count;
            let var = (q / count - mean * mean).max(0.0);
            let inv = 1.0 / (var + f64::from(self.eps)).sqrt();
            let mean = mean + f64::from(shift[ch]);
            self.saved_mean[ch] = mean as f32;
            self.saved_invstd[ch] = inv as f32;
            let unbiased = if count > 1.0 {
                var * count / (count - 1.0)
            } else {
                var
            };
            let m = self.momentum;
            self.running_mean[ch] = (1.0 - m) * self.running_mean[ch] + m * mean as f32;
            self.running_var[ch] = (1.0 - m) * self.running_var[ch] + m * unbiased as f32;
            scale[ch] = (f64::from(self.gamma[ch]) * inv) as f32;
            offset[ch] = self.beta[ch] - (mean * f64::from(self.gamma[ch]) * inv) as f32;
        }
        self.apply(pool, x, res, yb, &scale, &offset);
        self.saved_affine = match res.is_none() && self.relu {
            true => (scale, offset),
            false => (Vec::new(), Vec::new()),
        };
        Ok(())
    }

    /// Inference forward with the running statistics.
    pub fn forward_infer(&self, pool: &Pool, x: &Tensor4, y: &mut Tensor4) -> Result<()> {
        self.forward_infer_to(pool, x, None, y, None)
    }

    /// [`BatchNorm::forward_infer`] with the residual join in the same pass
    /// (as [`BatchNorm::forward_train_add`]).
    pub fn forward_infer_add(
        &self,
        pool: &Pool,
        x: &Tensor4,
        r: &Tensor4,
        relu: bool,
        y: &mut Tensor4,
    ) -> Result<()> {
        self.forward_infer_to(pool, x, Some((r, relu)), y, None)
    }

    /// [`BatchNorm::forward_infer`] (with `res`, the residual join) also
    /// writing `y` rounded to bf16 into `yb` when given
    /// ([`BatchNorm::forward_train_to`]).
    pub fn forward_infer_to<X: Widen>(
        &self,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        y: &mut Tensor4,
        yb: Option<&mut [bf16]>,
    ) -> Result<()> {
        let len = y.data.len();
        self.forward_infer_with(pool, x, res, Output::F32(y, Twin::new("bf16 y", yb, len)?))
    }

    /// [`BatchNorm::forward_infer_to`] with y in bf16 alone
    /// ([`BatchNorm::forward_train_bf16`]).
    pub fn forward_infer_bf16<X: Widen>(
        &self,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        y: &mut Tensor4<bf16>,
    ) -> Result<()> {
        self.forward_infer_with(pool, x, res, Output::Bf16(y))
    }

    fn forward_infer_with<X: Widen>(
        &self,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        yb: Output<'_>,
    ) -> Result<()> {
        self.forward_checks(x, res, &yb)?;
        let pc = x.padded_c();
        let (mut scale, mut offset) = (vec![0f32; pc], vec![0f32; pc]);
        for ch in 0..self.c {
            let inv = 1.0 / (self.running_var[ch] + self.eps).sqrt();
            scale[ch] = self.gamma[ch] * inv;
            offset[ch] = self.beta[ch] - self.running_mean[ch] * scale[ch];
        }
        self.apply(pool, x, res, yb, &scale, &offset);
        Ok(())
    }

    /// y = x * scale + offset per channel (+ the residual), then ReLU when
    /// fused or asked with the residual; the padding channels have scale
    /// and offset 0 (and a zero residual), so they stay zero.
    fn apply<X: Widen>(
        &self,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        y: Output<'_>,
        scale: &[f32],
        offset: &[f32],
    ) {
        let (cb, bc, len) = (x.c_blocks(), x.bc, plane_len(x));
        let relu = res.map_or(self.relu, |r| r.1);
        y.fill(pool, len, bc, |i, at, dst| {
            let (k, o) = (
                &scale[(i % cb) * bc..][..bc],
                &offset[(i % cb) * bc..][..bc],
            );
            let src = &x.data[at..][..dst.len()];
            let r = res.map(|(r, _)| &r.data[at..][..dst.len()]);
            by_group!(bc, G => wide(#[inline(always)] || affine::<G, X>(bc, src, r, (k, o), relu, dst)));
        });
    }

    /// Backward of the last [`BatchNorm::forward_train`] on `x` without the
    /// fused ReLU: writes dx and the parameter gradients (`dgamma`,
    /// `dbeta`, length `padded_c`).
    pub fn backward(
        &self,
        pool: &Pool,
        x: &Tensor4,
        dy: &Tensor4,
        dx: &mut Tensor4,
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) -> Result<()> {
        if self.relu {
            return Err(shape(
                "batch norm backward",
                "without y",
                "the fused ReLU needs the output: call backward_relu",
            ));
        }
        self.backward_to(pool, x, None, dy, (dx, None), dgamma, dbeta)
    }

    /// [`BatchNorm::backward`] through the fused ReLU: dy counts where the
    /// forward's output `y` is positive.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_relu(
        &self,
        pool: &Pool,
        x: &Tensor4,
        y: &Tensor4,
        dy: &Tensor4,
        dx: &mut Tensor4,
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) -> Result<()> {
        self.backward_to(pool, x, Some(y), dy, (dx, None), dgamma, dbeta)
    }

    /// [`BatchNorm::backward`], or with `y` [`BatchNorm::backward_relu`],
    /// writing dx and, when given, dx rounded to bf16 (of dx's length) in
    /// the same pass: the output gradient of a bf16 layer before it.
    ///
    /// After a forward that fused the ReLU (no residual), where y was
    /// positive is recomputed from x with the forward's own scale and
    /// offset (the same bits), so neither sweep reads y: two streams of
    /// eight (`docs/tuning-notes.md`). `y` is still checked where given,
    /// and may be None there (an output written in bf16 alone,
    /// [`BatchNorm::forward_train_bf16`]).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_to<X: Widen, D: Widen>(
        &self,
        pool: &Pool,
        x: &Tensor4<X>,
        y: Option<&Tensor4>,
        dy: &Tensor4<D>,
        (dx, dxb): (&mut Tensor4, Option<&mut [bf16]>),
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) -> Result<()> {
        same_dims("dx", dx, x)?;
        let dxb = Twin::new("bf16 dx", dxb, dx.data.len())?;
        self.backward_with(pool, x, y, dy, Output::F32(dx, dxb), dgamma, dbeta)
    }

    /// [`BatchNorm::backward_to`] with dx in bf16 alone, each piece rounded
    /// from f32 in L1 (the bits of the f32 dx rounded): the output
    /// gradient of a bf16 convolution before it that reads it so
    /// ([`crate::conv::Operand`]).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_to_bf16<X: Widen, D: Widen>(
        &self,
        pool: &Pool,
        x: &Tensor4<X>,
        y: Option<&Tensor4>,
        dy: &Tensor4<D>,
        dx: &mut Tensor4<bf16>,
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) -> Result<()> {
        same_dims("dx", dx, x)?;
        self.backward_with(pool, x, y, dy, Output::Bf16(dx), dgamma, dbeta)
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_with<X: Widen, D: Widen>(
        &self,
        pool: &Pool,
        x: &Tensor4<X>,
        y: Option<&Tensor4>,
        dy: &Tensor4<D>,
        dx: Output<'_>,
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) -> Result<()> {
        self.check("x", x)?;
        // After a forward that fused the ReLU (no residual) the mask comes
        // from x, so y may be absent (written in bf16 alone, say).
        if y.is_none() && self.relu && self.saved_affine.0.is_empty() {
            return Err(shape(
                "batch norm backward",
                "without y",
                "the fused ReLU after a residual join needs the output",
            ));
        }
        if let Some(y) = y {
            same_dims("y", y, x)?;
        }
        same_dims("dy", dy, x)?;
        check_buf("dgamma", dgamma.len(), self.gamma.len())?;
        check_buf("dbeta", dbeta.len(), self.beta.len())?;
        let (cb, bc, len) = (x.c_blocks(), x.bc, plane_len(x));
        let count = (x.n * x.h * x.w) as f32;
        // Where the ReLU passed: nowhere masked, where y is positive, or
        // where x under the forward's affine map is.
        let (sc, of) = (&self.saved_affine.0[..], &self.saved_affine.1[..]);
        let (mask, y) = match y {
            _ if !sc.is_empty() => (X_MASK, &[][..]),
            None => (NO_MASK, &[][..]),
            Some(y) => (Y_MASK, &y.data[..]),
        };
        let stats = |i: usize| {
            let r = (i % cb) * bc..(i % cb + 1) * bc;
            (&self.saved_mean[r.clone()], &self.saved_invstd[r])
        };
        // The mask's operands ([`masked`]) for `n` values of plane i from
        // offset `at`.
        let ops = |i: usize, at: usize, n: usize| -> [&[f32]; 3] {
            let r = (i % cb) * bc..(i % cb + 1) * bc;
            match mask {
                NO_MASK => [&[], &[], &[]],
                Y_MASK => [&y[at..][..n], &[], &[]],
                _ => [&[], &sc[r.clone()], &of[r]],
            }
        };
        let sums = plane_sums(pool, x, |i, out| {
            let (mean, inv) = stats(i);
            let planes = (&x.data[i * len..][..len], &dy.data[i * len..][..len]);
            let ops = ops(i, i * len, len);
            let stats = (mean, inv);
            by_group!(bc, G => wide(#[inline(always)] || match mask {
                NO_MASK => grad_sums::<NO_MASK, G, X, D>(bc, planes, ops, stats, out),
                Y_MASK => grad_sums::<Y_MASK, G, X, D>(bc, planes, ops, stats, out),
                _ => grad_sums::<X_MASK, G, X, D>(bc, planes, ops, stats, out),
            }));
        });
        dgamma.fill(0.0);
        dbeta.fill(0.0);
        let pc = cb * bc;
        let (mut k1, mut k2, mut k3) = (vec![0f32; pc], vec![0f32; pc], vec![0f32; pc]);
        for ch in 0..self.c {
            let (sdy, sdyx) = channel_sum(x, &sums, ch);
            dbeta[ch] = sdy as f32;
            dgamma[ch] = sdyx as f32;
            // dx = gamma*inv * (g - mean(g) - xhat * mean(g*xhat)).
            k1[ch] = self.gamma[ch] * self.saved_invstd[ch];
            k2[ch] = sdy as f32 / count;
            k3[ch] = sdyx as f32 / count;
        }
        // dx of plane i from element `at` on, into `d`.
        let apply = |i: usize, at: usize, d: &mut [f32]| {
            let (mean, inv) = stats(i);
            let r = (i % cb) * bc..(i % cb + 1) * bc;
            let k = [&k1[r.clone()], &k2[r.clone()], &k3[r], mean, inv];
            let planes = (&x.data[at..][..d.len()], &dy.data[at..][..d.len()]);
            let ops = ops(i, at, d.len());
            by_group!(bc, G => wide(#[inline(always)] || match mask {
                NO_MASK => grad_apply::<NO_MASK, G, X, D>(bc, planes, ops, k, d),
                Y_MASK => grad_apply::<Y_MASK, G, X, D>(bc, planes, ops, k, d),
                _ => grad_apply::<X_MASK, G, X, D>(bc, planes, ops, k, d),
            }));
        };
        dx.fill(pool, len, bc, apply);
        Ok(())
    }
}

/// Where a pass writes its output (y, or dx): f32 (with its bf16 copy
/// when asked), or bf16 alone.
enum Output<'a> {
    F32(&'a mut Tensor4, Twin<'a>),
    Bf16(&'a mut Tensor4<bf16>),
}

impl Output<'_> {
    /// Fills the output plane by plane (`len` values each, split over the
    /// pool), each piece of at most [`Twin::PIECE`] values (a multiple of
    /// `bc`) by `f(plane, offset, piece)` in f32, then rounded into the
    /// copy, or from a thread's f32 piece into the bf16 output, while in
    /// L1.
    fn fill(self, pool: &Pool, len: usize, bc: usize, f: impl Fn(usize, usize, &mut [f32]) + Sync) {
        let piece = Twin::PIECE.next_multiple_of(bc);
        match self {
            Output::F32(y, twin) => pool.for_slices_of(&mut y.data, len, |i, d| {
                for (at, d) in (i * len..).step_by(piece).zip(d.chunks_mut(piece)) {
                    f(i, at, d);
                    // SAFETY: plane i is this thread's.
                    unsafe { twin.round(at, d) };
                }
            }),
            Output::Bf16(y) => pool.for_slices_of(&mut y.data, len, |i, d| {
                let buf = thread_scratch(piece);
                for (at, d) in (i * len..).step_by(piece).zip(d.chunks_mut(piece)) {
                    // SAFETY: `piece` values of this thread's scratch, which
                    // `f` (the pass's arithmetic) does not take.
                    let v = unsafe { std::slice::from_raw_parts_mut(buf, d.len()) };
                    f(i, at, v);
                    round_slice(d, v);
                }
            }),
        }
    }
}

/// Where backward's gradient passes the fused ReLU, as the const
/// parameter of its loops (so each vectorises for its own): no ReLU;
/// where the forward's output y is positive; where x * scale + offset
/// (the forward's pre-activation) is.
const NO_MASK: u8 = 0;
const Y_MASK: u8 = 1;
const X_MASK: u8 = 2;

/// Lanes per step of the per-lane loops below: 64, 32, 16, 8 or 1, the
/// widest that divides `bc`. Each loop takes a group of `G` lanes as a
/// fixed-size array (no bounds checks, one or a few vector registers) and
/// walks the pixels with stride `bc`; indexing all `bc` lanes of a pixel
/// through slices kept LLVM from vectorising at all, and the passes ran at
/// about one value per 3 cycles, in bf16 as in f32.
macro_rules! by_group {
    ($bc:expr, $g:ident => $call:expr) => {
        match $bc {
            bc if bc % 64 == 0 => {
                const $g: usize = 64;
                $call
            }
            bc if bc % 32 == 0 => {
                const $g: usize = 32;
                $call
            }
            bc if bc % 16 == 0 => {
                const $g: usize = 16;
                $call
            }
            bc if bc % 8 == 0 => {
                const $g: usize = 8;
                $call
            }
            _ => {
                const $g: usize = 1;
                $call
            }
        }
    };
}
use by_group;

/// `G` values from `at`.
#[inline(always)]
fn group<T, const G: usize>(v: &[T], at: usize) -> &[T; G] {
    v[at..at + G].try_into().expect("G values")
}

/// The sums of `x - shift` and of its square over a plane, per lane, into
/// `out[..bc]` and `out[bc..]`: in f32 over runs of 64 pixels, in f64
/// across runs (each lane's additions in pixel order).
#[inline(always)]
fn shifted_sums<const G: usize, X: Widen>(bc: usize, x: &[X], shift: &[f32], out: &mut [f64]) {
    // Runs outer, so that a run's lanes are read from L1.
    for run in x.chunks(64 * bc) {
        for j0 in (0..bc).step_by(G) {
            let k = group::<_, G>(shift, j0);
            let (mut a, mut b) = ([0f32; G], [0f32; G]);
            for p in (j0..run.len()).step_by(bc) {
                let v = group::<_, G>(run, p);
                for j in 0..G {
                    let d = v[j].f32() - k[j];
                    a[j] += d;
                    b[j] += d * d;
                }
            }
            for j in 0..G {
                out[j0 + j] += f64::from(a[j]);
                out[bc + j0 + j] += f64::from(b[j]);
            }
        }
    }
}

/// `dst = x * scale + offset (+ r)` per lane, then the ReLU when `relu`
/// (NaN stays NaN).
#[inline(always)]
fn affine<const G: usize, X: Widen>(
    bc: usize,
    x: &[X],
    r: Option<&[f32]>,
    (scale, offset): (&[f32], &[f32]),
    relu: bool,
    dst: &mut [f32],
) {
    for p in (0..dst.len()).step_by(bc) {
        for j0 in (0..bc).step_by(G) {
            let (k, o) = (group::<_, G>(scale, j0), group::<_, G>(offset, j0));
            let s = group::<_, G>(x, p + j0);
            let mut v = [0f32; G];
            for j in 0..G {
                v[j] = s[j].f32() * k[j] + o[j];
            }
            if let Some(r) = r {
                let r = group::<_, G>(r, p + j0);
                for j in 0..G {
                    v[j] += r[j];
                }
            }
            let d: &mut [f32; G] = (&mut dst[p + j0..p + j0 + G]).try_into().expect("G values");
            for j in 0..G {
                d[j] = if relu && v[j] < 0.0 { 0.0 } else { v[j] };
            }
        }
    }
}

/// dy where the ReLU passed it (mask `M`) at the `G` lanes from `at`
/// (within the plane's operands `[y, scale, offset]`, lane `j0`).
/// `x * scale + offset` repeats the forward's arithmetic (Rust does not
/// contract it into an FMA), so its sign is the one y had.
#[inline(always)]
fn masked<const M: u8, const G: usize>(
    g: [f32; G],
    x: [f32; G],
    [y, sc, of]: [&[f32]; 3],
    at: usize,
    j0: usize,
) -> [f32; G] {
    match M {
        NO_MASK => g,
        Y_MASK => {
            let y = group::<_, G>(y, at);
            std::array::from_fn(|j| pass(g[j], y[j]))
        }
        _ => {
            let (sc, of) = (group::<_, G>(sc, j0), group::<_, G>(of, j0));
            std::array::from_fn(|j| pass(g[j], x[j] * sc[j] + of[j]))
        }
    }
}

/// `G` values of `v` from `at`, widened.
#[inline(always)]
fn widened<const G: usize, X: Widen>(v: &[X], at: usize) -> [f32; G] {
    let v = group::<_, G>(v, at);
    std::array::from_fn(|j| v[j].f32())
}

/// The sums of g and g * xhat over a plane, per lane, where g is dy where
/// the fused ReLU passed it (mask `M`, its operands `ops`).
#[inline(always)]
fn grad_sums<const M: u8, const G: usize, X: Widen, D: Widen>(
    bc: usize,
    (x, dy): (&[X], &[D]),
    ops: [&[f32]; 3],
    (mean, inv): (&[f32], &[f32]),
    out: &mut [f64],
) {
    for start in (0..x.len()).step_by(64 * bc) {
        let end = (start + 64 * bc).min(x.len());
        for j0 in (0..bc).step_by(G) {
            let (mu, is) = (group::<_, G>(mean, j0), group::<_, G>(inv, j0));
            let (mut a, mut b) = ([0f32; G], [0f32; G]);
            for p in (start + j0..end).step_by(bc) {
                let xs = widened::<G, X>(x, p);
                let g = masked::<M, G>(widened::<G, D>(dy, p), xs, ops, p, j0);
                for j in 0..G {
                    a[j] += g[j];
                    b[j] += g[j] * (xs[j] - mu[j]) * is[j];
                }
            }
            for j in 0..G {
                out[j0 + j] += f64::from(a[j]);
                out[bc + j0 + j] += f64::from(b[j]);
            }
        }
    }
}

/// dx of one piece; `k` is (gamma*inv, mean(g), mean(g*xhat), mean, inv)
/// of the plane's lanes, `ops` the mask's operands ([`masked`]) from the
/// piece's start.
#[inline(always)]
fn grad_apply<const M: u8, const G: usize, X: Widen, D: Widen>(
    bc: usize,
    (x, dy): (&[X], &[D]),
    ops: [&[f32]; 3],
    k: [&[f32]; 5],
    d: &mut [f32],
) {
    for p in (0..d.len()).step_by(bc) {
        for j0 in (0..bc).step_by(G) {
            let [k1, k2, k3, mu, is] = k.map(|k| group::<_, G>(k, j0));
            let xs = widened::<G, X>(x, p + j0);
            let g = masked::<M, G>(widened::<G, D>(dy, p + j0), xs, ops, p + j0, j0);
            let o: &mut [f32; G] = (&mut d[p + j0..p + j0 + G]).try_into().expect("G values");
            for j in 0..G {
                let xhat = (xs[j] - mu[j]) * is[j];
                o[j] = k1[j] * (g[j] - k2[j] - xhat * k3[j]);
            }
        }
    }
}

/// Offset of the plane of image `n`, channel block `b`.
fn plane<T>(x: &Tensor4<T>, n: usize, b: usize) -> usize {
    (n * x.c_blocks() + b) * plane_len(x)
}

/// Values in one (image, channel block) plane.
fn plane_len<T>(x: &Tensor4<T>) -> usize {
    x.h * x.w * x.bc
}

/// For every plane `i` (image `i / c_blocks`, block `i % c_blocks`),
/// `f(i, sums)` fills `2 * bc` sums; returns them all, planes in order.
fn plane_sums<T>(pool: &Pool, x: &Tensor4<T>, f: impl Fn(usize, &mut [f64]) + Sync) -> Vec<f64> {
    let mut out = vec![0f64; x.n * x.c_blocks() * 2 * x.bc];
    pool.for_slices_of(&mut out, 2 * x.bc, f);
    out
}

/// The two sums of channel `ch` over every image.
fn channel_sum<T>(x: &Tensor4<T>, sums: &[f64], ch: usize) -> (f64, f64) {
    let (cb, bc) = (x.c_blocks(), x.bc);
    (0..x.n).fold((0.0, 0.0), |(s, q), n| {
        let at = (n * cb + ch / bc) * 2 * bc + ch % bc;
        (s + sums[at], q + sums[at + bc])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Backward through the fused ReLU finds the same mask from x (the
    /// forward's affine map) as from y: identical bits, on channels whose
    /// pre-activations sit on both sides of zero.
    #[test]
    fn relu_mask_from_x_is_the_mask_from_y() {
        let pool = Pool::new(2).unwrap().always_parallel();
        // Five channels in blocks of 4 (a padded block), 2 x 3 x 5 pixels.
        let (n, c, h, w, bc) = (2, 5, 3, 5, 4);
        let vals: Vec<f32> = (0..n * c * h * w)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 4.0)
            .collect();
        let x = Tensor4::from_nchw(&vals, n, c, h, w, bc).unwrap();
        let g = Tensor4::from_nchw(
            &vals.iter().map(|v| 1.5 - v).collect::<Vec<_>>(),
            n,
            c,
            h,
            w,
            bc,
        )
        .unwrap();
        let mut bn = BatchNorm::new(c, bc).unwrap();
        bn.relu = true;
        bn.beta_mut()[..c].copy_from_slice(&[0.0, 0.3, -0.4, 1.0, -2.0]);
        let mut y = x.clone();
        bn.forward_train(&pool, &x, &mut y).unwrap();
        assert!(!bn.saved_affine.0.is_empty());
        let positive = y.data().iter().filter(|v| **v > 0.0).count();
        assert!(positive > 10 && positive + 10 < y.data().len());
        let mut from_y = bn.clone();
        from_y.saved_affine = (Vec::new(), Vec::new());
        let pc = bn.gamma().len();
        let run = |bn: &BatchNorm| {
            let (mut dx, mut dg, mut db) = (x.clone(), vec![0.0; pc], vec![0.0; pc]);
            bn.backward_relu(&pool, &x, &y, &g, &mut dx, &mut dg, &mut db)
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            (bits(dx.data()), bits(&dg), bits(&db))
        };
        assert_eq!(run(&bn), run(&from_y));
        // A later residual forward (its ReLU after the add) drops the map.
        let mut r = x.clone();
        bn.relu = false;
        bn.forward_train_add(&pool, &x, &g, true, &mut r).unwrap();
        assert!(bn.saved_affine.0.is_empty());
    }

    /// Each lane sums its pixels in the same order whatever the channel
    /// block, so every block width (lane groups of 64, 32, 16, 8 and 1,
    /// [`by_group`]) gives the same bits: forward with the fused ReLU and
    /// with a residual join, backward through each mask, the statistics.
    #[test]
    fn every_lane_group_gives_the_same_bits() {
        let pool = Pool::new(2).unwrap().always_parallel();
        // 135 pixels: runs of 64, 64 and 7.
        let (n, c, h, w) = (2, 96, 9, 15);
        let vals = |seed: usize| -> Vec<f32> {
            (0..n * c * h * w)
                .map(|i| (((i * 37 + seed) % 29) as f32 - 13.0) / 4.0)
                .collect()
        };
        let (xs, gs, rs) = (vals(0), vals(5), vals(11));
        let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let run = |bc: usize| {
            let t = |v: &[f32]| Tensor4::from_nchw(v, n, c, h, w, bc).unwrap();
            let (x, g, r) = (t(&xs), t(&gs), t(&rs));
            let mut bn = BatchNorm::new(c, bc).unwrap();
            bn.relu = true;
            for (i, gm) in bn.gamma_mut().iter_mut().take(c).enumerate() {
                *gm = 0.5 + (i % 7) as f32 / 8.0;
            }
            let pc = bn.gamma().len();
            let mut out = Vec::new();
            let (mut y, mut dx) = (x.clone(), x.clone());
            let (mut dg, mut db) = (vec![0.0; pc], vec![0.0; pc]);
            // Fused ReLU: backward's mask from x.
            bn.forward_train(&pool, &x, &mut y).unwrap();
            out.push(bits(y.to_nchw()));
            bn.backward_relu(&pool, &x, &y, &g, &mut dx, &mut dg, &mut db)
                .unwrap();
            out.extend([
                bits(dx.to_nchw()),
                bits(dg[..c].to_vec()),
                bits(db[..c].to_vec()),
            ]);
            // Residual join with the ReLU after it: the mask from y.
            bn.relu = false;
            bn.forward_train_add(&pool, &x, &r, true, &mut y).unwrap();
            out.push(bits(y.to_nchw()));
            bn.backward_relu(&pool, &x, &y, &g, &mut dx, &mut dg, &mut db)
                .unwrap();
            out.extend([bits(dx.to_nchw()), bits(dg[..c].to_vec())]);
            // No ReLU.
            bn.forward_infer(&pool, &x, &mut y).unwrap();
            out.push(bits(y.to_nchw()));
            bn.backward(&pool, &x, &g, &mut dx, &mut dg, &mut db)
                .unwrap();
            out.extend([bits(dx.to_nchw()), bits(bn.running_var()[..c].to_vec())]);
            out
        };
        let want = run(64);
        for bc in [32, 48, 16, 24, 8, 12, 5] {
            assert!(run(bc) == want, "bc {bc}");
        }
    }
}
