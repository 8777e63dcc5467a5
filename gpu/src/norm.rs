//! Batch normalisation over NHWC activations on the device (statistics per
//! channel over every pixel of the minibatch), with an optional fused
//! ReLU: training forward with batch statistics and running-statistics
//! updates, inference forward with the running statistics, backward to the
//! input, the scale and the shift. The channel sums are two-level (per
//! chunk of pixels, then the chunks in order), so they are parallel and do
//! not depend on timing.

use crate::codegen::ElementwiseKernel as EK;
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};

/// Pixels per partial sum.
const CHUNK: usize = 256;

/// A batch-norm layer on the device.
pub struct GpuBatchNorm {
    c: usize,
    pixels: usize,
    relu: bool,
    eps: f32,
    momentum: f32,
    pub(crate) gamma: Buffer,
    pub(crate) beta: Buffer,
    pub(crate) dgamma: Buffer,
    pub(crate) dbeta: Buffer,
    run_mean: Buffer,
    run_var: Buffer,
    mean: Buffer,
    invstd: Buffer,
    scale: Buffer,
    offset: Buffer,
    part: Buffer,
}

impl GpuBatchNorm {
    /// `c` channels over `pixels` (images x height x width) per
    /// minibatch, with the given scale, shift and running statistics;
    /// `eps` and `momentum` as PyTorch's (the CPU layer's 1e-5 and 0.1).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &Device,
        c: usize,
        pixels: usize,
        relu: bool,
        [gamma, beta, run_mean, run_var]: [&[f32]; 4],
        eps: f32,
        momentum: f32,
    ) -> Result<GpuBatchNorm> {
        if c == 0 || pixels == 0 {
            return Err(invalid(
                "batch norm",
                format!("{c} channels x {pixels} pixels"),
                "needs both at least 1",
            ));
        }
        for (what, v) in [
            ("gamma", gamma),
            ("beta", beta),
            ("running_mean", run_mean),
            ("running_var", run_var),
        ] {
            if v.len() != c {
                return Err(invalid(what, v.len(), format!("needs {c} values")));
            }
        }
        i32::try_from(pixels * c)
            .map_err(|_| invalid("batch norm elements", pixels * c, "exceeds i32"))?;
        let f = |n: usize| dev.alloc(n * 4);
        let chunks = pixels.div_ceil(CHUNK);
        Ok(GpuBatchNorm {
            c,
            pixels,
            relu,
            eps,
            momentum,
            gamma: dev.upload(gamma)?,
            beta: dev.upload(beta)?,
            dgamma: f(c)?,
            dbeta: f(c)?,
            run_mean: dev.upload(run_mean)?,
            run_var: dev.upload(run_var)?,
            mean: f(c)?,
            invstd: f(c)?,
            scale: f(c)?,
            offset: f(c)?,
            part: f(2 * chunks * c)?,
        })
    }

    fn check(&self, what: &str, b: &Buffer) -> Result<()> {
        if b.holds(self.pixels * self.c, 4) {
            Ok(())
        } else {
            Err(invalid(
                what,
                format!("{} bytes", b.bytes()),
                format!("needs {} f32", self.pixels * self.c),
            ))
        }
    }

    fn apply(&self, dev: &Device, x: &Buffer, y: &Buffer) -> Result<()> {
        let n = self.pixels * self.c;
        dev.launch_elementwise(
            EK::BnApply,
            n,
            &[
                Arg::Buf(x),
                Arg::Buf(y),
                Arg::Buf(&self.scale),
                Arg::Buf(&self.offset),
                Arg::I32(self.c as i32),
                Arg::I32(n as i32),
                Arg::I32(self.relu as i32),
            ],
        )
    }

    /// Training forward: normalises `x` with its batch statistics (kept for
    /// backward) and updates the running ones.
    pub fn forward_train(&mut self, dev: &Device, x: &Buffer, y: &mut Buffer) -> Result<()> {
        self.check("x", x)?;
        self.check("y", y)?;
        let (c, pixels) = (self.c, self.pixels);
        let chunks = pixels.div_ceil(CHUNK);
        dev.launch_elementwise(
            EK::BnPartial,
            chunks * c,
            &[
                Arg::Buf(x),
                Arg::Buf(&self.part),
                Arg::I32(pixels as i32),
                Arg::I32(c as i32),
                Arg::I32(CHUNK as i32),
            ],
        )?;
        dev.launch_elementwise(
            EK::BnFinish,
            c,
            &[
                Arg::Buf(x),
                Arg::Buf(&self.part),
                Arg::I32(chunks as i32),
                Arg::I32(c as i32),
                Arg::I32(pixels as i32),
                Arg::Buf(&self.gamma),
                Arg::Buf(&self.beta),
                Arg::F32(self.eps),
                Arg::F32(self.momentum),
                Arg::Buf(&self.mean),
                Arg::Buf(&self.invstd),
                Arg::Buf(&self.run_mean),
                Arg::Buf(&self.run_var),
                Arg::Buf(&self.scale),
                Arg::Buf(&self.offset),
            ],
        )?;
        self.apply(dev, x, y)
    }

    /// Inference forward with the running statistics.
    pub fn forward_infer(&mut self, dev: &Device, x: &Buffer, y: &mut Buffer) -> Result<()> {
        self.check("x", x)?;
        self.check("y", y)?;
        dev.launch_elementwise(
            EK::BnInfer,
            self.c,
            &[
                Arg::Buf(&self.gamma),
                Arg::Buf(&self.beta),
                Arg::Buf(&self.run_mean),
                Arg::Buf(&self.run_var),
                Arg::F32(self.eps),
                Arg::I32(self.c as i32),
                Arg::Buf(&self.scale),
                Arg::Buf(&self.offset),
            ],
        )?;
        self.apply(dev, x, y)
    }

    /// Backward of the last training forward (`x` its input, `y` its
    /// output, `dy` the gradient at y): the scale and shift gradients (kept
    /// for the optimizer) and `dx`.
    pub fn backward(
        &mut self,
        dev: &Device,
        x: &Buffer,
        y: &Buffer,
        dy: &Buffer,
        dx: &mut Buffer,
    ) -> Result<()> {
        for (what, b) in [("x", x), ("y", y), ("dy", dy)] {
            self.check(what, b)?;
        }
        self.check("dx", dx)?;
        let (c, pixels) = (self.c, self.pixels);
        let chunks = pixels.div_ceil(CHUNK);
        dev.launch_elementwise(
            EK::BnGradPartial,
            chunks * c,
            &[
                Arg::Buf(x),
                Arg::Buf(y),
                Arg::Buf(dy),
                Arg::Buf(&self.mean),
                Arg::Buf(&self.invstd),
                Arg::Buf(&self.part),
                Arg::I32(pixels as i32),
                Arg::I32(c as i32),
                Arg::I32(CHUNK as i32),
                Arg::I32(self.relu as i32),
            ],
        )?;
        dev.launch_elementwise(
            EK::BnGradFinish,
            c,
            &[
                Arg::Buf(&self.part),
                Arg::I32(chunks as i32),
                Arg::I32(c as i32),
                Arg::Buf(&self.dgamma),
                Arg::Buf(&self.dbeta),
            ],
        )?;
        let dx: &Buffer = dx;
        dev.launch_elementwise(
            EK::BnDx,
            pixels * c,
            &[
                Arg::Buf(x),
                Arg::Buf(y),
                Arg::Buf(dy),
                Arg::Buf(&self.mean),
                Arg::Buf(&self.invstd),
                Arg::Buf(&self.gamma),
                Arg::Buf(&self.dgamma),
                Arg::Buf(&self.dbeta),
                Arg::Buf(dx),
                Arg::I32(pixels as i32),
                Arg::I32(c as i32),
                Arg::I32(self.relu as i32),
            ],
        )
    }

    /// Scale, shift, running mean and running variance.
    pub fn values(&self, dev: &Device) -> Result<[Vec<f32>; 4]> {
        let c = self.c;
        Ok([
            dev.download(&self.gamma, c)?,
            dev.download(&self.beta, c)?,
            dev.download(&self.run_mean, c)?,
            dev.download(&self.run_var, c)?,
        ])
    }
}
