//! A 2-D convolution on device buffers (odd filters with padding `r / 2`,
//! any stride), forward with fused bias and activation, backward-data and
//! backward-weights, each a generated BRGEMM over the filter taps, as on
//! the CPU (the offset batch form). A strided convolution is the stride-1
//! one on the grid, read at the stride's pixels (its gradient spread back
//! over the grid with zeros between): stride^2 times the arithmetic, for
//! the few strided layers of a network.
//!
//! The trick that makes every pass one batch-reduce GEMM: the input is
//! written once onto its padded grid (`h + 2ph` x `w + 2pw` pixels per
//! image, channels contiguous, `margin` zero pixels before and after), and
//! the convolution is computed for every pixel of that grid. For tap
//! (r, s) every output pixel reads the input pixel a fixed number of grid
//! pixels away, so tap t's B operand is the padded input shifted by a
//! constant: `Y_grid = sum_t W_t X_grid[+shift_t]`, one BRGEMM whose batch
//! is the taps. Outputs on the border of the grid read across image rows and
//! are cropped away; the interior is exact. Backward-data is the same with
//! the transposed taps and the opposite shifts over the padded dZ (zero on
//! the border); backward-weights reduces over the grid's pixels, per tap,
//! the dZ pixels against the shifted input's.
//!
//! Layouts: activations NHWC (`x[((n*h + y)*w + x)*c + ch]`, as the
//! channels-last CPU tensors), weights tap-major, each tap `k x c`
//! column-major (`w[t*k*c + ko + ci*k]`, `t = r*s_w + s`), biases length k.
//! Master values are f32; GEMM operands are converted to the layer's dtype
//! on the device.

use crate::codegen::ElementwiseKernel as EK;
use crate::desc::{GpuBatch, GpuDescriptor, GpuDtype};
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
use crate::fc::reduce_block;
use crate::kernel::{BatchTable, GpuBrgemm};
use brgemm::Activation;

/// The shape of a convolution layer: `n` images of `h x w` pixels and `c`
/// channels in, `k` channels out, an `r x s` filter (odd sizes, padding
/// `r / 2` and `s / 2`) at `stride` (output `(h - 1) / stride + 1` rows, as
/// PyTorch's with that padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvShape {
    /// Images per minibatch.
    pub n: usize,
    /// Image height.
    pub h: usize,
    /// Image width.
    pub w: usize,
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub k: usize,
    /// Filter height (odd).
    pub r: usize,
    /// Filter width (odd).
    pub s: usize,
    /// Stride (1: same size out).
    pub stride: usize,
}

impl ConvShape {
    fn pads(&self) -> (usize, usize) {
        (self.r / 2, self.s / 2)
    }
    fn grid_w(&self) -> usize {
        self.w + 2 * self.pads().1
    }
    /// Pixels of the padded grid.
    fn grid(&self) -> usize {
        self.n * (self.h + 2 * self.pads().0) * self.grid_w()
    }
    /// Zero pixels before and after the grid: the farthest shift.
    fn margin(&self) -> usize {
        let (ph, pw) = self.pads();
        ph * self.grid_w() + pw
    }
    fn taps(&self) -> usize {
        self.r * self.s
    }
    /// Grid pixels between an output pixel and what tap `t` reads.
    fn shift(&self, t: usize) -> isize {
        let (ph, pw) = self.pads();
        let (dr, ds) = (
            (t / self.s) as isize - ph as isize,
            (t % self.s) as isize - pw as isize,
        );
        dr * self.grid_w() as isize + ds
    }
    /// Input pixels (images x height x width).
    pub fn pixels(&self) -> usize {
        self.n * self.h * self.w
    }
    /// Output rows and columns.
    pub fn out_hw(&self) -> (usize, usize) {
        (
            (self.h - 1) / self.stride + 1,
            (self.w - 1) / self.stride + 1,
        )
    }
    /// Output pixels.
    pub fn out_pixels(&self) -> usize {
        let (oh, ow) = self.out_hw();
        self.n * oh * ow
    }
    fn grid_h(&self) -> usize {
        self.h + 2 * self.pads().0
    }
}

/// A convolution layer planned for one shape and type.
pub struct GpuConv2d {
    /// The layer's shape.
    pub shape: ConvShape,
    act: Activation,
    dtype: GpuDtype,
    fwd: GpuBrgemm,
    fwd_tab: BatchTable,
    bwd: GpuBrgemm,
    bwd_tab: BatchTable,
    upd: GpuBrgemm,
    upd_tabs: Vec<BatchTable>,
    upd_batch: usize,
    /// Padded input (f32) and its GEMM-type copies (plain, transposed).
    xpad: Buffer,
    xpad_d: Option<Buffer>,
    xt_d: Buffer,
    /// Weights in the GEMM type, and transposed per tap (f32, then typed).
    wd: Option<Buffer>,
    wt: Buffer,
    wt_d: Option<Buffer>,
    /// Outputs and input gradients on the grid.
    yg: Buffer,
    dxg: Buffer,
    /// dZ = dY * act'(Y) (NHWC) and on the padded grid (f32, typed).
    dz: Buffer,
    dzp: Buffer,
    dzp_d: Option<Buffer>,
    /// One tap's weight gradient.
    dw_tap: Buffer,
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| invalid(what, v, "exceeds i32"))
}

/// The table alignment the offsets allow: a whole 16-byte vector where
/// every offset is one, else 1.
fn align_of(dtype: GpuDtype, offs: &[usize]) -> usize {
    let v = 16 / dtype.size();
    if offs.iter().all(|o| o % v == 0) {
        v
    } else {
        1
    }
}

impl GpuConv2d {
    /// Plans the three passes for `shape`; `act` is fused into the forward
    /// epilogue (identity, relu, sigmoid or tanh), `dtype` is the GEMM
    /// operands' type.
    pub fn new(
        dev: &Device,
        shape: ConvShape,
        act: Activation,
        dtype: GpuDtype,
    ) -> Result<GpuConv2d> {
        let ConvShape {
            n,
            h,
            w,
            c,
            k,
            r,
            s,
            stride,
        } = shape;
        for (what, v) in [
            ("n", n),
            ("h", h),
            ("w", w),
            ("c", c),
            ("k", k),
            ("stride", stride),
        ] {
            if v == 0 {
                return Err(invalid(what, v, "must be at least 1"));
            }
        }
        for (what, v) in [("r", r), ("s", s)] {
            if v % 2 == 0 {
                return Err(invalid(
                    what,
                    v,
                    "the GPU convolution takes odd filters (padding r / 2, s / 2)",
                ));
            }
        }
        if matches!(act, Activation::Gelu) {
            return Err(invalid(
                "activation",
                "Gelu",
                "the GPU convolution supports identity, relu, sigmoid and tanh",
            ));
        }
        let (grid, margin, taps) = (shape.grid(), shape.margin(), shape.taps());
        let ptot = grid + 2 * margin;
        i32_of("padded elements", ptot * c.max(k))?;
        let shifted = |t: usize, sign: isize| (margin as isize + sign * shape.shift(t)) as usize;
        // Forward: Y_grid (k x grid) = sum_t W_t (k x c) X[+shift_t] (c x grid).
        let fa: Vec<usize> = (0..taps).map(|t| t * k * c).collect();
        let fb: Vec<usize> = (0..taps).map(|t| shifted(t, 1) * c).collect();
        let fd = GpuDescriptor::new(k, grid, c)
            .lda(k)
            .ldb(c)
            .ldc(k)
            .dtype(dtype)
            .batch(GpuBatch::Offset)
            .table_align(align_of(dtype, &[&fa[..], &fb[..]].concat()))
            .epilogue(true, act);
        // Backward-data: dX_grid (c x grid) = sum_t W_t^T (c x k) dZ[-shift_t].
        let ba: Vec<usize> = (0..taps).map(|t| t * k * c).collect();
        let bb: Vec<usize> = (0..taps).map(|t| shifted(t, -1) * k).collect();
        let bd = GpuDescriptor::new(c, grid, k)
            .lda(c)
            .ldb(k)
            .ldc(c)
            .dtype(dtype)
            .batch(GpuBatch::Offset)
            .table_align(align_of(dtype, &[&ba[..], &bb[..]].concat()));
        // Backward-weights, per tap: dW_t (k x c) = sum over grid blocks of
        // dZ (k x blk) X^T[+shift_t] (blk x c).
        let blk = reduce_block(grid);
        let ub = grid / blk;
        let ua: Vec<usize> = (0..ub).map(|i| (margin + i * blk) * k).collect();
        let ubs: Vec<Vec<usize>> = (0..taps)
            .map(|t| (0..ub).map(|i| shifted(t, 1) + i * blk).collect())
            .collect();
        let all_b: Vec<usize> = ubs.concat();
        let ud = GpuDescriptor::new(k, c, blk)
            .lda(k)
            .ldb(ptot)
            .ldc(k)
            .dtype(dtype)
            .batch(GpuBatch::Offset)
            .table_align(align_of(dtype, &[&ua[..], &all_b[..]].concat()));
        let es = dtype.size();
        let typed = |elems: usize| -> Result<Option<Buffer>> {
            if dtype == GpuDtype::F32 {
                Ok(None)
            } else {
                dev.alloc(elems * es).map(Some)
            }
        };
        let f = |elems: usize| dev.alloc(elems * 4);
        Ok(GpuConv2d {
            shape,
            act,
            dtype,
            fwd_tab: BatchTable::offsets(dev, &fd, &fa, &fb)?,
            fwd: GpuBrgemm::new(&fd)?,
            bwd_tab: BatchTable::offsets(dev, &bd, &ba, &bb)?,
            bwd: GpuBrgemm::new(&bd)?,
            upd_tabs: ubs
                .iter()
                .map(|b| BatchTable::offsets(dev, &ud, &ua, b))
                .collect::<Result<_>>()?,
            upd: GpuBrgemm::new(&ud)?,
            upd_batch: ub,
            xpad: f(ptot * c)?,
            xpad_d: typed(ptot * c)?,
            xt_d: dev.alloc(ptot * c * es)?,
            wd: typed(taps * k * c)?,
            wt: f(taps * k * c)?,
            wt_d: typed(taps * k * c)?,
            yg: f(grid * k)?,
            dxg: f(grid * c)?,
            dz: f(shape.out_pixels() * k)?,
            dzp: f(ptot * k)?,
            dzp_d: typed(ptot * k)?,
            dw_tap: f(k * c)?,
        })
    }

    /// Arguments of pad_nhwc/crop_nhwc: `src` (rows, columns) images of
    /// `ch` channels on this layer's grid, `margin` pixels around, placed
    /// at `stride`.
    fn grid_args(
        &self,
        src: (usize, usize),
        ch: usize,
        margin: usize,
        stride: usize,
    ) -> Result<[Arg<'static>; 10]> {
        let (ph, pw) = self.shape.pads();
        Ok([
            Arg::I32(i32_of("n", self.shape.n)?),
            Arg::I32(i32_of("h", src.0)?),
            Arg::I32(i32_of("w", src.1)?),
            Arg::I32(i32_of("channels", ch)?),
            Arg::I32(ph as i32),
            Arg::I32(pw as i32),
            Arg::I32(i32_of("margin", margin)?),
            Arg::I32(i32_of("stride", stride)?),
            Arg::I32(i32_of("grid rows", self.shape.grid_h())?),
            Arg::I32(i32_of("grid columns", self.shape.grid_w())?),
        ])
    }

    /// `y = act(conv(x, w) + b)`: x NHWC with c channels, y NHWC with k.
    pub fn forward(
        &mut self,
        dev: &Device,
        x: &Buffer,
        w: &Buffer,
        b: &Buffer,
        y: &mut Buffer,
    ) -> Result<()> {
        let ConvShape {
            h,
            w: iw,
            c,
            k,
            stride,
            ..
        } = self.shape;
        let (px, taps, margin) = (self.shape.pixels(), self.shape.taps(), self.shape.margin());
        let opx = self.shape.out_pixels();
        let ptot = self.shape.grid() + 2 * margin;
        x.need("x", px * c)?;
        w.need("w", taps * k * c)?;
        b.need("b", k)?;
        y.need("y", opx * k)?;
        let mut args = vec![Arg::Buf(x), Arg::Buf(&self.xpad)];
        args.extend(self.grid_args((h, iw), c, margin, 1)?);
        dev.launch_elementwise(EK::PadNhwc, ptot * c, &args)?;
        let xo = dev.typed(self.dtype, &self.xpad, &self.xpad_d, ptot * c)?;
        let wo = dev.typed(self.dtype, w, &self.wd, taps * k * c)?;
        self.fwd.execute(
            dev,
            wo,
            xo,
            &mut self.yg,
            Some(b),
            Some(&self.fwd_tab),
            taps,
        )?;
        // The outputs at the stride's pixels of the grid.
        let y: &Buffer = y;
        let mut args = vec![Arg::Buf(&self.yg), Arg::Buf(y)];
        args.extend(self.grid_args(self.shape.out_hw(), k, 0, stride)?);
        dev.launch_elementwise(EK::CropNhwc, opx * k, &args)
    }

    /// From `dy` (gradient at the output y, NHWC): keeps dZ = dy * act'(y)
    /// for [`GpuConv2d::update`] and, when `dx` is given, writes dX (NHWC).
    pub fn backward(
        &mut self,
        dev: &Device,
        dy: &Buffer,
        y: &Buffer,
        w: &Buffer,
        dx: Option<&mut Buffer>,
    ) -> Result<()> {
        let ConvShape {
            h,
            w: iw,
            c,
            k,
            stride,
            ..
        } = self.shape;
        let (px, taps, margin) = (self.shape.pixels(), self.shape.taps(), self.shape.margin());
        let opx = self.shape.out_pixels();
        let ptot = self.shape.grid() + 2 * margin;
        dy.need("dy", opx * k)?;
        y.need("y", opx * k)?;
        w.need("w", taps * k * c)?;
        dev.act_backward(self.act, y, dy, &self.dz, opx * k)?;
        // dZ at the stride's pixels of the grid, zeros between.
        let mut args = vec![Arg::Buf(&self.dz), Arg::Buf(&self.dzp)];
        args.extend(self.grid_args(self.shape.out_hw(), k, margin, stride)?);
        dev.launch_elementwise(EK::PadNhwc, ptot * k, &args)?;
        if let Some(d) = &self.dzp_d {
            dev.convert(self.dtype, &self.dzp, d, ptot * k, 1, false)?;
        }
        let Some(dx) = dx else { return Ok(()) };
        dx.need("dx", px * c)?;
        dev.launch_elementwise(
            EK::TransposeTaps,
            taps * k * c,
            &[
                Arg::Buf(w),
                Arg::Buf(&self.wt),
                Arg::I32(k as i32),
                Arg::I32(c as i32),
                Arg::I32(taps as i32),
            ],
        )?;
        let wto = dev.typed(self.dtype, &self.wt, &self.wt_d, taps * k * c)?;
        let dzo = self.dzp_d.as_ref().unwrap_or(&self.dzp);
        self.bwd.execute(
            dev,
            wto,
            dzo,
            &mut self.dxg,
            None,
            Some(&self.bwd_tab),
            taps,
        )?;
        let dx: &Buffer = dx;
        let mut args = vec![Arg::Buf(&self.dxg), Arg::Buf(dx)];
        args.extend(self.grid_args((h, iw), c, 0, 1)?);
        dev.launch_elementwise(EK::CropNhwc, px * c, &args)
    }

    /// After [`GpuConv2d::backward`]: dW (tap-major, as the weights) and
    /// db, from the last forward's input and backward's dZ.
    pub fn update(&mut self, dev: &Device, dw: &mut Buffer, db: &mut Buffer) -> Result<()> {
        let ConvShape { c, k, .. } = self.shape;
        let (px, taps, margin) = (
            self.shape.out_pixels(),
            self.shape.taps(),
            self.shape.margin(),
        );
        let ptot = self.shape.grid() + 2 * margin;
        dw.need("dw", taps * k * c)?;
        db.need("db", k)?;
        // X^T: the padded input with its pixels contiguous per channel.
        dev.convert(self.dtype, &self.xpad, &self.xt_d, ptot, c, true)?;
        let dzo = self.dzp_d.as_ref().unwrap_or(&self.dzp);
        let dw: &Buffer = dw;
        for (t, tab) in self.upd_tabs.iter().enumerate() {
            self.upd.execute(
                dev,
                dzo,
                &self.xt_d,
                &mut self.dw_tap,
                None,
                Some(tab),
                self.upd_batch,
            )?;
            dev.launch_elementwise(
                EK::CopySlot,
                k * c,
                &[
                    Arg::Buf(&self.dw_tap),
                    Arg::Buf(dw),
                    Arg::I32(i32_of("k*c", k * c)?),
                    Arg::I32(0),
                    Arg::I32(i32_of("dw offset", t * k * c)?),
                ],
            )?;
        }
        let db: &Buffer = db;
        dev.launch_elementwise(
            EK::BiasGrad,
            k,
            &[
                Arg::Buf(&self.dz),
                Arg::Buf(db),
                Arg::I32(k as i32),
                Arg::I32(i32_of("pixels", px)?),
            ],
        )
    }
}
