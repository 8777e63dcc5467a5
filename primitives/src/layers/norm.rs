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
use crate::engine::bf16::Twin;
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
    /// backward then needs the output ([`BatchNorm::backward_relu`]).
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
}

/// An error naming `what` unless `t` has the dims of `x`.
fn same_dims(what: &str, t: &Tensor4, x: &Tensor4) -> Result<()> {
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
        })
    }

    fn check(&self, what: &str, t: &Tensor4) -> Result<()> {
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
    fn forward_checks<'a>(
        &self,
        x: &Tensor4,
        res: Option<(&Tensor4, bool)>,
        y: &Tensor4,
        yb: Option<&'a mut [bf16]>,
    ) -> Result<Twin<'a>> {
        self.check("x", x)?;
        same_dims("y", y, x)?;
        if let Some((r, _)) = res {
            self.check_residual(r, x)?;
        }
        Twin::new("bf16 y", yb, y.data.len())
    }

    /// An error unless `r` can join the output of `x`.
    fn check_residual(&self, r: &Tensor4, x: &Tensor4) -> Result<()> {
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
    pub fn forward_train_to(
        &mut self,
        pool: &Pool,
        x: &Tensor4,
        res: Option<(&Tensor4, bool)>,
        y: &mut Tensor4,
        yb: Option<&mut [bf16]>,
    ) -> Result<()> {
        let yb = self.forward_checks(x, res, y, yb)?;
        let (bc, pc) = (x.bc, x.padded_c());
        let count = (x.n * x.h * x.w) as f64;
        // The first image's first pixel per channel: the shift that keeps
        // the one-pass variance free of cancellation.
        let shift: Vec<f32> = (0..pc)
            .map(|ch| x.data[plane(x, 0, ch / bc) + ch % bc])
            .collect();
        let sums = plane_sums(pool, x, |i, out| {
            let k = &shift[(i % x.c_blocks()) * bc..][..bc];
            runs(
                bc,
                &x.data[plane(x, i / x.c_blocks(), i % x.c_blocks())..][..plane_len(x)],
                out,
                |j, v| {
                    let d = v - k[j];
                    (d, d * d)
                },
            );
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
        self.apply(pool, x, res, (y, yb), &scale, &offset);
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
    pub fn forward_infer_to(
        &self,
        pool: &Pool,
        x: &Tensor4,
        res: Option<(&Tensor4, bool)>,
        y: &mut Tensor4,
        yb: Option<&mut [bf16]>,
    ) -> Result<()> {
        let yb = self.forward_checks(x, res, y, yb)?;
        let pc = x.padded_c();
        let (mut scale, mut offset) = (vec![0f32; pc], vec![0f32; pc]);
        for ch in 0..self.c {
            let inv = 1.0 / (self.running_var[ch] + self.eps).sqrt();
            scale[ch] = self.gamma[ch] * inv;
            offset[ch] = self.beta[ch] - self.running_mean[ch] * scale[ch];
        }
        self.apply(pool, x, res, (y, yb), &scale, &offset);
        Ok(())
    }

    /// y = x * scale + offset per channel (+ the residual), then ReLU when
    /// fused or asked with the residual; the padding channels have scale
    /// and offset 0 (and a zero residual), so they stay zero.
    fn apply(
        &self,
        pool: &Pool,
        x: &Tensor4,
        res: Option<(&Tensor4, bool)>,
        (y, yb): (&mut Tensor4, Twin<'_>),
        scale: &[f32],
        offset: &[f32],
    ) {
        let (cb, bc, len) = (x.c_blocks(), x.bc, plane_len(x));
        let relu = res.map_or(self.relu, |r| r.1);
        pool.for_slices_of(&mut y.data, len, |i, dst| {
            let (k, o) = (
                &scale[(i % cb) * bc..][..bc],
                &offset[(i % cb) * bc..][..bc],
            );
            let piece = Twin::PIECE.next_multiple_of(bc);
            for (at, dst) in (0..len).step_by(piece).zip(dst.chunks_mut(piece)) {
                let src = &x.data[i * len + at..][..dst.len()];
                match res {
                    Some((r, _)) => {
                        let r = &r.data[i * len + at..][..dst.len()];
                        let rows = dst.chunks_exact_mut(bc).zip(src.chunks_exact(bc));
                        for ((d, s), r) in rows.zip(r.chunks_exact(bc)) {
                            for j in 0..bc {
                                let v = s[j] * k[j] + o[j] + r[j];
                                d[j] = if relu && v < 0.0 { 0.0 } else { v };
                            }
                        }
                    }
                    None => {
                        for (d, s) in dst.chunks_exact_mut(bc).zip(src.chunks_exact(bc)) {
                            for j in 0..bc {
                                let v = s[j] * k[j] + o[j];
                                d[j] = if relu && v < 0.0 { 0.0 } else { v };
                            }
                        }
                    }
                }
                // SAFETY: plane i is this thread's.
                unsafe { yb.round(i * len + at, dst) };
            }
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
    #[allow(clippy::too_many_arguments)]
    pub fn backward_to(
        &self,
        pool: &Pool,
        x: &Tensor4,
        y: Option<&Tensor4>,
        dy: &Tensor4,
        (dx, dxb): (&mut Tensor4, Option<&mut [bf16]>),
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) -> Result<()> {
        self.check("x", x)?;
        if y.is_none() && self.relu {
            return Err(shape(
                "batch norm backward",
                "without y",
                "the fused ReLU needs the output: call backward_relu",
            ));
        }
        if let Some(y) = y {
            same_dims("y", y, x)?;
        }
        same_dims("dy", dy, x)?;
        same_dims("dx", dx, x)?;
        let dxb = Twin::new("bf16 dx", dxb, dx.data.len())?;
        check_buf("dgamma", dgamma.len(), self.gamma.len())?;
        check_buf("dbeta", dbeta.len(), self.beta.len())?;
        let (cb, bc, len) = (x.c_blocks(), x.bc, plane_len(x));
        let count = (x.n * x.h * x.w) as f32;
        let y = y.map_or(&[][..], |y| &y.data[..]);
        let stats = |i: usize| {
            let r = (i % cb) * bc..(i % cb + 1) * bc;
            (&self.saved_mean[r.clone()], &self.saved_invstd[r])
        };
        let sums = plane_sums(pool, x, |i, out| {
            let (mean, inv) = stats(i);
            let planes = (&x.data[i * len..][..len], &dy.data[i * len..][..len]);
            let y = if y.is_empty() {
                y
            } else {
                &y[i * len..][..len]
            };
            grad_sums(bc, planes, y, mean, inv, out);
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
        let piece = Twin::PIECE.next_multiple_of(bc);
        pool.for_slices_of(&mut dx.data, len, |i, d| {
            let (mean, inv) = stats(i);
            let r = (i % cb) * bc..(i % cb + 1) * bc;
            let k = [&k1[r.clone()], &k2[r.clone()], &k3[r], mean, inv];
            for (at, d) in (i * len..).step_by(piece).zip(d.chunks_mut(piece)) {
                let planes = (&x.data[at..][..d.len()], &dy.data[at..][..d.len()]);
                if y.is_empty() {
                    grad_apply::<false>(bc, planes, y, k, d);
                } else {
                    grad_apply::<true>(bc, planes, &y[at..][..d.len()], k, d);
                }
                // SAFETY: plane i is this thread's.
                unsafe { dxb.round(at, d) };
            }
        });
        Ok(())
    }
}

/// The sums of g and g * xhat over a plane, per lane, where g is dy, or dy
/// where the fused ReLU's output `y` is positive when `y` is not empty.
fn grad_sums(
    bc: usize,
    (x, dy): (&[f32], &[f32]),
    y: &[f32],
    mean: &[f32],
    inv: &[f32],
    out: &mut [f64],
) {
    if y.is_empty() {
        grad_sums_of::<false>(bc, x, dy, y, mean, inv, out)
    } else {
        grad_sums_of::<true>(bc, x, dy, y, mean, inv, out)
    }
}

/// [`grad_sums`] for the mask known at compile time (so the loop
/// vectorises either way).
fn grad_sums_of<const RELU: bool>(
    bc: usize,
    x: &[f32],
    dy: &[f32],
    y: &[f32],
    mean: &[f32],
    inv: &[f32],
    out: &mut [f64],
) {
    let (mut a, mut b) = (vec![0f32; bc], vec![0f32; bc]);
    let run = 64 * bc;
    for start in (0..x.len()).step_by(run) {
        let end = (start + run).min(x.len());
        for p in (start..end).step_by(bc) {
            let (xs, gs) = (&x[p..p + bc], &dy[p..p + bc]);
            let ys = if RELU { &y[p..p + bc] } else { gs };
            for j in 0..bc {
                let g = if RELU { pass(gs[j], ys[j]) } else { gs[j] };
                a[j] += g;
                b[j] += g * (xs[j] - mean[j]) * inv[j];
            }
        }
        for j in 0..bc {
            out[j] += f64::from(a[j]);
            out[bc + j] += f64::from(b[j]);
        }
        a.fill(0.0);
        b.fill(0.0);
    }
}

/// dx of one plane; `k` is (gamma*inv, mean(g), mean(g*xhat), mean, inv)
/// of the plane's lanes.
fn grad_apply<const RELU: bool>(
    bc: usize,
    (x, dy): (&[f32], &[f32]),
    y: &[f32],
    k: [&[f32]; 5],
    d: &mut [f32],
) {
    let [k1, k2, k3, mean, inv] = k;
    for (p, o) in (0..d.len()).step_by(bc).zip(d.chunks_exact_mut(bc)) {
        let (xs, gs) = (&x[p..p + bc], &dy[p..p + bc]);
        let ys = if RELU { &y[p..p + bc] } else { gs };
        for j in 0..bc {
            let g = if RELU { pass(gs[j], ys[j]) } else { gs[j] };
            let xhat = (xs[j] - mean[j]) * inv[j];
            o[j] = k1[j] * (g - k2[j] - xhat * k3[j]);
        }
    }
}

/// Offset of the plane of image `n`, channel block `b`.
fn plane(x: &Tensor4, n: usize, b: usize) -> usize {
    (n * x.c_blocks() + b) * plane_len(x)
}

/// Values in one (image, channel block) plane.
fn plane_len(x: &Tensor4) -> usize {
    x.h * x.w * x.bc
}

/// For every plane `i` (image `i / c_blocks`, block `i % c_blocks`),
/// `f(i, sums)` fills `2 * bc` sums; returns them all, planes in order.
fn plane_sums(pool: &Pool, x: &Tensor4, f: impl Fn(usize, &mut [f64]) + Sync) -> Vec<f64> {
    let mut out = vec![0f64; x.n * x.c_blocks() * 2 * x.bc];
    pool.for_slices_of(&mut out, 2 * x.bc, f);
    out
}

/// Sums `f(lane, value) = (a, b)` over the pixels of a plane, lane by lane,
/// into `out[..bc]` (a) and `out[bc..]` (b): in f32 over runs of 64 pixels,
/// in f64 across runs.
fn runs(bc: usize, plane: &[f32], out: &mut [f64], mut f: impl FnMut(usize, f32) -> (f32, f32)) {
    let (mut a, mut b) = (vec![0f32; bc], vec![0f32; bc]);
    for run in plane.chunks(64 * bc) {
        for px in run.chunks_exact(bc) {
            for j in 0..bc {
                let (u, v) = f(j, px[j]);
                a[j] += u;
                b[j] += v;
            }
        }
        for j in 0..bc {
            out[j] += f64::from(a[j]);
            out[bc + j] += f64::from(b[j]);
        }
        a.fill(0.0);
        b.fill(0.0);
    }
}

/// The two sums of channel `ch` over every image.
fn channel_sum(x: &Tensor4, sums: &[f64], ch: usize) -> (f64, f64) {
    let (cb, bc) = (x.c_blocks(), x.bc);
    (0..x.n).fold((0.0, 0.0), |(s, q), n| {
        let at = (n * cb + ch / bc) * 2 * bc + ch % bc;
        (s + sums[at], q + sums[at + bc])
    })
}
