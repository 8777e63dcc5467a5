//! A fully-connected layer on device buffers: forward with fused bias and
//! activation, backward-data and backward-weights, each one generated BRGEMM
//! whose batch runs over blocks of the reduced dimension.
//!
//! Layouts are plain column-major (the GPU needs no blocking of its own: the
//! kernel's tiles are the blocking): activations are `features x batch`
//! (sample j's features contiguous, i.e. row-major `[N][C]` as on the host),
//! weights `K x C` (element (k, c) at `k + c*K`), biases length K. Master
//! values are f32; the GEMM operands are converted to the layer's dtype on
//! the device (bf16 with round-to-nearest-even) right before each product;
//! f32 layers hand their buffers to the GEMMs as they are.

use crate::codegen::ElementwiseKernel as EK;
use crate::desc::{GpuBatch, GpuDescriptor, GpuDtype};
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
use crate::kernel::GpuBrgemm;
use brgemm::Activation;

/// Length of each block of a reduced dimension (the batch-reduce count is
/// `total / block`): the largest divisor up to 256 that is a multiple of 16,
/// else the whole dimension up to 512, else the largest divisor up to 256.
pub(crate) fn reduce_block(total: usize) -> usize {
    let divs = (1..=total.min(256))
        .rev()
        .filter(|d| total.is_multiple_of(*d));
    if let Some(d) = divs.clone().find(|d| d % 16 == 0) {
        return d;
    }
    if total <= 512 {
        return total;
    }
    divs.into_iter().next().unwrap_or(1)
}

/// One FC layer's three generated passes and its device scratch.
pub struct GpuFc {
    /// Input features.
    pub c: usize,
    /// Output features.
    pub k: usize,
    /// Minibatch.
    pub n: usize,
    act: Activation,
    dtype: GpuDtype,
    fwd: GpuBrgemm,
    bwd: GpuBrgemm,
    upd: GpuBrgemm,
    /// Converted copies of x, w and dZ; `None` for f32, whose GEMMs read
    /// the f32 buffers themselves.
    xd: Option<Buffer>,
    wd: Option<Buffer>,
    dzd: Option<Buffer>,
    /// Transposed (and converted) W and X, for backward-data and -weights.
    wtd: Buffer,
    xtd: Buffer,
    /// dY * act'(Z), f32, `K x N`.
    dz: Buffer,
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| invalid(what, v, "exceeds i32"))
}

impl GpuFc {
    /// Plans the layer `c -> k` for minibatch `n` with inputs of `dtype`.
    /// The activation's derivative is taken from the output, so GELU (whose
    /// derivative needs the pre-activation) is refused.
    pub fn new(
        dev: &Device,
        c: usize,
        k: usize,
        n: usize,
        act: Activation,
        dtype: GpuDtype,
    ) -> Result<GpuFc> {
        if matches!(act, Activation::Gelu) {
            return Err(invalid(
                "activation",
                "Gelu",
                "the GPU FC layer supports identity, relu, sigmoid and tanh",
            ));
        }
        for (what, v) in [("c", c), ("k", k), ("n", n)] {
            if v == 0 {
                return Err(invalid(what, v, "must be at least 1"));
            }
            i32_of(what, v)?;
        }
        let (bc, bk, bn) = (reduce_block(c), reduce_block(k), reduce_block(n));
        let fwd = GpuDescriptor::new(k, n, bc)
            .lda(k)
            .ldb(c)
            .ldc(k)
            .dtype(dtype)
            .batch(GpuBatch::Stride { a: bc * k, b: bc })
            .epilogue(true, act);
        let bwd = GpuDescriptor::new(c, n, bk)
            .lda(c)
            .ldb(k)
            .ldc(c)
            .dtype(dtype)
            .batch(GpuBatch::Stride { a: bk * c, b: bk });
        let upd = GpuDescriptor::new(k, c, bn)
            .lda(k)
            .ldb(n)
            .ldc(k)
            .dtype(dtype)
            .batch(GpuBatch::Stride { a: bn * k, b: bn });
        let es = dtype.size();
        let scratch = |elems: usize| -> Result<Option<Buffer>> {
            if dtype == GpuDtype::F32 {
                Ok(None)
            } else {
                dev.alloc(elems * es).map(Some)
            }
        };
        Ok(GpuFc {
            c,
            k,
            n,
            act,
            dtype,
            fwd: GpuBrgemm::new(&fwd)?,
            bwd: GpuBrgemm::new(&bwd)?,
            upd: GpuBrgemm::new(&upd)?,
            xd: scratch(c * n)?,
            wd: scratch(k * c)?,
            dzd: scratch(k * n)?,
            wtd: dev.alloc(c * k * es)?,
            xtd: dev.alloc(n * c * es)?,
            dz: dev.alloc(k * n * 4)?,
        })
    }

    /// The activation.
    pub fn activation(&self) -> Activation {
        self.act
    }

    /// Converts `x` (f32, `rows x cols`, or `cols x rows` transposed when
    /// `trans`) into `y` in the layer's dtype.
    /// `y = act(W x + b)`: x is `C x N`, w `K x C`, b length K, y `K x N`.
    /// Converts W for this product; a training loop packs it once per
    /// step instead ([`GpuFc::pack_weights`], [`GpuFc::forward_packed`]).
    pub fn forward(
        &mut self,
        dev: &Device,
        x: &Buffer,
        w: &Buffer,
        b: &Buffer,
        y: &mut Buffer,
    ) -> Result<()> {
        w.need("w", self.k * self.c)?;
        if let Some(wd) = &self.wd {
            dev.convert(self.dtype, w, wd, self.k, self.c, false)?;
        }
        self.forward_packed(dev, x, w, b, y)
    }

    /// Writes W (`K x C`, f32) in the GEMM type as the forward product
    /// reads it and transposed as backward-data reads it, in one pass:
    /// what [`GpuFc::forward_packed`] and [`GpuFc::backward_packed`] use
    /// until the weights change (a training loop calls it after each
    /// optimizer step).
    pub fn pack_weights(&mut self, dev: &Device, w: &Buffer) -> Result<()> {
        let (c, k) = (self.c, self.k);
        w.need("w", k * c)?;
        let y = self.wd.as_ref().unwrap_or(&self.wtd);
        dev.launch_elementwise(
            EK::Pack(self.dtype),
            k * c,
            &[
                Arg::Buf(w),
                Arg::Buf(y),
                Arg::Buf(&self.wtd),
                Arg::I32(i32_of("k", k)?),
                Arg::I32(i32_of("c", c)?),
                Arg::I32(self.wd.is_some() as i32),
            ],
        )
    }

    /// [`GpuFc::forward`] on the weights [`GpuFc::pack_weights`] last
    /// packed (`w` is read as it is only by f32 layers).
    pub fn forward_packed(
        &mut self,
        dev: &Device,
        x: &Buffer,
        w: &Buffer,
        b: &Buffer,
        y: &mut Buffer,
    ) -> Result<()> {
        let (c, k, n) = (self.c, self.k, self.n);
        x.need("x", c * n)?;
        w.need("w", k * c)?;
        b.need("b", k)?;
        y.need("y", k * n)?;
        let xo = dev.typed(self.dtype, x, &self.xd, c * n)?;
        let wo = self.wd.as_ref().unwrap_or(w);
        let batch = c / self.fwd.descriptor().k;
        self.fwd.execute(dev, wo, xo, y, Some(b), None, batch)
    }

    /// From `dy` (gradient at the output y, `K x N`): keeps dZ = dy *
    /// act'(y) for [`GpuFc::update`] and, when `dx` is given, writes
    /// dX = W^T dZ (`C x N`). Transposes W for this product; a training
    /// loop packs it once per step ([`GpuFc::backward_packed`]).
    pub fn backward(
        &mut self,
        dev: &Device,
        dy: &Buffer,
        y: &Buffer,
        w: &Buffer,
        dx: Option<&mut Buffer>,
    ) -> Result<()> {
        w.need("w", self.k * self.c)?;
        if dx.is_some() {
            dev.convert(self.dtype, w, &self.wtd, self.c, self.k, true)?;
        }
        self.backward_packed(dev, dy, y, dx)
    }

    /// [`GpuFc::backward`] on the transposed weights
    /// [`GpuFc::pack_weights`] last packed.
    pub fn backward_packed(
        &mut self,
        dev: &Device,
        dy: &Buffer,
        y: &Buffer,
        dx: Option<&mut Buffer>,
    ) -> Result<()> {
        let (c, k, n) = (self.c, self.k, self.n);
        dy.need("dy", k * n)?;
        y.need("y", k * n)?;
        dev.act_backward(self.act, y, dy, &self.dz, k * n)?;
        let dzo = dev.typed(self.dtype, &self.dz, &self.dzd, k * n)?;
        if let Some(dx) = dx {
            dx.need("dx", c * n)?;
            let batch = k / self.bwd.descriptor().k;
            self.bwd
                .execute(dev, &self.wtd, dzo, dx, None, None, batch)?;
        }
        Ok(())
    }

    /// After [`GpuFc::backward`]: dW = dZ X^T (`K x C`) and db = the row sums
    /// of dZ. `x` is the forward input.
    pub fn update(
        &mut self,
        dev: &Device,
        x: &Buffer,
        dw: &mut Buffer,
        db: &mut Buffer,
    ) -> Result<()> {
        let (c, k, n) = (self.c, self.k, self.n);
        x.need("x", c * n)?;
        dw.need("dw", k * c)?;
        db.need("db", k)?;
        dev.convert(self.dtype, x, &self.xtd, n, c, true)?;
        let batch = n / self.upd.descriptor().k;
        // dZ in the GEMM dtype, as backward left it (no conversion for f32).
        let dzo = self.dzd.as_ref().unwrap_or(&self.dz);
        self.upd
            .execute(dev, dzo, &self.xtd, dw, None, None, batch)?;
        let db: &Buffer = db;
        dev.launch_elementwise(
            EK::BiasGrad,
            k,
            &[
                Arg::Buf(&self.dz),
                Arg::Buf(db),
                Arg::I32(k as i32),
                Arg::I32(n as i32),
            ],
        )
    }
}
