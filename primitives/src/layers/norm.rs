//! Batch normalisation over the images and pixels of blocked
//! `[N][C/bc][H][W][bc]` tensors: training mode (minibatch statistics, and
//! running statistics updated with momentum), inference mode (running
//! statistics) and backward.
//!
//! Work is split over channel blocks: one thread owns a channel's sums over
//! the whole minibatch, so no reduction across threads is needed. Sums are
//! accumulated in f64 per lane.

use crate::error::{check_buf, shape, Result};
use crate::layout::SyncPtr;
use crate::tensor::Tensor4;
use crate::threads::Pool;

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
        self.check("x", x)?;
        same_dims("y", y, x)?;
        let (cb, bc, hw, n) = (x.c_blocks(), x.bc, x.h * x.w, x.n);
        let count = (n * hw) as f64;
        let (mp, ip) = (
            SyncPtr(self.saved_mean.as_mut_ptr()),
            SyncPtr(self.saved_invstd.as_mut_ptr()),
        );
        let (rmp, rvp) = (
            SyncPtr(self.running_mean.as_mut_ptr()),
            SyncPtr(self.running_var.as_mut_ptr()),
        );
        let yp = SyncPtr(y.data.as_mut_ptr());
        let (eps, mom) = (self.eps, self.momentum);
        let (gamma, beta) = (&self.gamma, &self.beta);
        pool.for_each(cb, |b| {
            let planes = |ni: usize| (ni * cb + b) * hw * bc;
            let mut sum = vec![0f64; bc];
            for ni in 0..n {
                for px in x.data[planes(ni)..][..hw * bc].chunks_exact(bc) {
                    sum.iter_mut().zip(px).for_each(|(s, v)| *s += *v as f64);
                }
            }
            let mean: Vec<f64> = sum.iter().map(|s| s / count).collect();
            let mut sq = vec![0f64; bc];
            for ni in 0..n {
                for px in x.data[planes(ni)..][..hw * bc].chunks_exact(bc) {
                    for ((s, v), m) in sq.iter_mut().zip(px).zip(&mean) {
                        let d = *v as f64 - m;
                        *s += d * d;
                    }
                }
            }
            let (mut scale, mut shift) = (vec![0f32; bc], vec![0f32; bc]);
            for j in 0..bc {
                let ch = b * bc + j;
                let var = sq[j] / count;
                let inv = 1.0 / (var + eps as f64).sqrt();
                // SAFETY: channel `ch` belongs to this thread's block.
                unsafe {
                    *mp.get().add(ch) = mean[j] as f32;
                    *ip.get().add(ch) = inv as f32;
                    let unbiased = if count > 1.0 {
                        var * count / (count - 1.0)
                    } else {
                        var
                    };
                    *rmp.get().add(ch) = (1.0 - mom) * *rmp.get().add(ch) + mom * mean[j] as f32;
                    *rvp.get().add(ch) = (1.0 - mom) * *rvp.get().add(ch) + mom * unbiased as f32;
                }
                scale[j] = (gamma[ch] as f64 * inv) as f32;
                shift[j] = beta[ch] - (mean[j] * gamma[ch] as f64 * inv) as f32;
            }
            if b * bc + bc > self.c {
                // Padding channels: keep the running statistics at their
                // neutral values and the output at zero.
                for j in (self.c - b * bc)..bc {
                    scale[j] = 0.0;
                    shift[j] = 0.0;
                    // SAFETY: as above.
                    unsafe {
                        *rmp.get().add(b * bc + j) = 0.0;
                        *rvp.get().add(b * bc + j) = 0.0;
                    }
                }
            }
            for ni in 0..n {
                let src = &x.data[planes(ni)..][..hw * bc];
                // SAFETY: the planes of channel block b belong to this thread.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(yp.get().add(planes(ni)), hw * bc) };
                for (d, s) in dst.chunks_exact_mut(bc).zip(src.chunks_exact(bc)) {
                    for j in 0..bc {
                        d[j] = s[j] * scale[j] + shift[j];
                    }
                }
            }
        });
        Ok(())
    }

    /// Inference forward with the running statistics.
    pub fn forward_infer(&self, pool: &Pool, x: &Tensor4, y: &mut Tensor4) -> Result<()> {
        self.check("x", x)?;
        same_dims("y", y, x)?;
        let (cb, bc, hw, n) = (x.c_blocks(), x.bc, x.h * x.w, x.n);
        let yp = SyncPtr(y.data.as_mut_ptr());
        pool.for_each(cb, |b| {
            let (mut scale, mut shift) = (vec![0f32; bc], vec![0f32; bc]);
            for j in 0..bc {
                let ch = b * bc + j;
                if ch < self.c {
                    let inv = 1.0 / (self.running_var[ch] + self.eps).sqrt();
                    scale[j] = self.gamma[ch] * inv;
                    shift[j] = self.beta[ch] - self.running_mean[ch] * scale[j];
                }
            }
            for ni in 0..n {
                let off = (ni * cb + b) * hw * bc;
                // SAFETY: the planes of channel block b belong to this thread.
                let dst = unsafe { std::slice::from_raw_parts_mut(yp.get().add(off), hw * bc) };
                for (d, s) in dst
                    .chunks_exact_mut(bc)
                    .zip(x.data[off..][..hw * bc].chunks_exact(bc))
                {
                    for j in 0..bc {
                        d[j] = s[j] * scale[j] + shift[j];
                    }
                }
            }
        });
        Ok(())
    }

    /// Backward of the last [`BatchNorm::forward_train`] on `x`: writes dx
    /// and the parameter gradients (`dgamma`, `dbeta`, length `padded_c`).
    pub fn backward(
        &self,
        pool: &Pool,
        x: &Tensor4,
        dy: &Tensor4,
        dx: &mut Tensor4,
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) -> Result<()> {
        self.check("x", x)?;
        same_dims("dy", dy, x)?;
        same_dims("dx", dx, x)?;
        check_buf("dgamma", dgamma.len(), self.gamma.len())?;
        check_buf("dbeta", dbeta.len(), self.beta.len())?;
        let (cb, bc, hw, n) = (x.c_blocks(), x.bc, x.h * x.w, x.n);
        let count = (n * hw) as f64;
        let (dxp, dgp, dbp) = (
            SyncPtr(dx.data.as_mut_ptr()),
            SyncPtr(dgamma.as_mut_ptr()),
            SyncPtr(dbeta.as_mut_ptr()),
        );
        pool.for_each(cb, |b| {
            let mean = &self.saved_mean[b * bc..][..bc];
            let inv = &self.saved_invstd[b * bc..][..bc];
            let (mut sdy, mut sdyx) = (vec![0f64; bc], vec![0f64; bc]);
            for ni in 0..n {
                let off = (ni * cb + b) * hw * bc;
                for (g, v) in dy.data[off..][..hw * bc]
                    .chunks_exact(bc)
                    .zip(x.data[off..][..hw * bc].chunks_exact(bc))
                {
                    for j in 0..bc {
                        sdy[j] += g[j] as f64;
                        sdyx[j] += g[j] as f64 * ((v[j] - mean[j]) * inv[j]) as f64;
                    }
                }
            }
            let mut k1 = vec![0f32; bc];
            for j in 0..bc {
                // SAFETY: channel b*bc+j belongs to this thread.
                unsafe {
                    *dbp.get().add(b * bc + j) = sdy[j] as f32;
                    *dgp.get().add(b * bc + j) = sdyx[j] as f32;
                }
                k1[j] = self.gamma[b * bc + j] * inv[j];
            }
            for ni in 0..n {
                let off = (ni * cb + b) * hw * bc;
                // SAFETY: the planes of channel block b belong to this thread.
                let d = unsafe { std::slice::from_raw_parts_mut(dxp.get().add(off), hw * bc) };
                for ((o, g), v) in d
                    .chunks_exact_mut(bc)
                    .zip(dy.data[off..][..hw * bc].chunks_exact(bc))
                    .zip(x.data[off..][..hw * bc].chunks_exact(bc))
                {
                    for j in 0..bc {
                        let xhat = (v[j] - mean[j]) * inv[j];
                        o[j] = k1[j]
                            * (g[j] - (sdy[j] / count) as f32 - xhat * (sdyx[j] / count) as f32);
                    }
                }
            }
        });
        Ok(())
    }
}
