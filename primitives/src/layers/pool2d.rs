//! Max and average pooling (forward, backward) and global average pooling on
//! blocked `[N][C/bc][H][W][bc]` tensors, parallel over images.
//!
//! Windows are `window x window` with a stride and zero padding; padded
//! positions never win a max and are not counted in an average (the divisor
//! is the number of real inputs under the window). The inner loops run over
//! the `bc` lanes of a channel block, which are contiguous.

use crate::error::{check_buf, shape, Result};
use crate::math::widest;
use crate::tensor::{par_images, Tensor4};
use crate::threads::Pool;

/// Which reduction a pooling layer does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// Maximum (backward routes the gradient to the arg-max).
    Max,
    /// Mean over the real (non-padding) inputs.
    Avg,
}

/// A planned pooling layer.
#[derive(Debug, Clone)]
pub struct Pool2d {
    /// Max or average.
    pub(crate) kind: PoolKind,
    /// Input (n, c, h, w, bc).
    pub(crate) input: (usize, usize, usize, usize, usize),
    /// Window height and width.
    pub(crate) window: (usize, usize),
    /// Stride.
    pub(crate) stride: usize,
    /// Zero padding on every side.
    pub(crate) pad: usize,
}

crate::layout::getters!(Pool2d {
    kind: PoolKind = "Max or average.",
    input: (usize, usize, usize, usize, usize) = "Input (n, c, h, w, bc).",
    window: (usize, usize) = "Window (height, width).",
    stride: usize = "Stride.",
    pad: usize = "Zero padding on each side.",
});

impl Pool2d {
    /// A `window x window` pooling of inputs shaped like `x`.
    pub fn new(
        kind: PoolKind,
        x: &Tensor4,
        window: usize,
        stride: usize,
        pad: usize,
    ) -> Result<Pool2d> {
        Pool2d::with_window(kind, x, (window, window), stride, pad)
    }

    /// Global average pooling: one output pixel per channel.
    pub fn global_avg(x: &Tensor4) -> Result<Pool2d> {
        Pool2d::with_window(PoolKind::Avg, x, (x.h, x.w), 1, 0)
    }

    fn with_window(
        kind: PoolKind,
        x: &Tensor4,
        window: (usize, usize),
        stride: usize,
        pad: usize,
    ) -> Result<Pool2d> {
        if window.0 == 0 || window.1 == 0 {
            return Err(shape("window", format!("{window:?}"), "must be at least 1"));
        }
        if stride == 0 {
            return Err(shape("stride", 0, "must be at least 1"));
        }
        if pad >= window.0 || pad >= window.1 {
            return Err(shape(
                "pad",
                pad,
                "must be smaller than the window (else a window can hold only padding)",
            ));
        }
        if window.0 > x.h + 2 * pad || window.1 > x.w + 2 * pad {
            return Err(shape(
                "window",
                format!("{}x{}", window.0, window.1),
                format!(
                    "larger than the padded input {}x{}",
                    x.h + 2 * pad,
                    x.w + 2 * pad
                ),
            ));
        }
        Ok(Pool2d {
            kind,
            input: x.dims(),
            window,
            stride,
            pad,
        })
    }

    /// Output height and width.
    pub fn out_hw(&self) -> (usize, usize) {
        let (_, _, h, w, _) = self.input;
        (
            (h + 2 * self.pad - self.window.0) / self.stride + 1,
            (w + 2 * self.pad - self.window.1) / self.stride + 1,
        )
    }

    /// A zero output tensor.
    pub fn output(&self) -> Tensor4 {
        let (n, c, _, _, bc) = self.input;
        let (p, q) = self.out_hw();
        Tensor4::zeros(n, c, p, q, bc).unwrap()
    }

    fn check(&self, x: &Tensor4, y: &Tensor4) -> Result<()> {
        if x.dims() != self.input {
            return Err(shape(
                "pool input",
                format!("{:?}", x.dims()),
                format!("layer needs {:?}", self.input),
            ));
        }
        // (Not `self.output().dims()`: that allocated a zeroed tensor on
        // every call, 1.5% of a CNN training step.)
        let (n, c, _, _, bc) = self.input;
        let (p, q) = self.out_hw();
        let want = (n, c, p, q, bc);
        if y.dims() != want {
            return Err(shape(
                "pool output",
                format!("{:?}", y.dims()),
                format!("layer needs {want:?}"),
            ));
        }
        Ok(())
    }

    /// The input rows (or columns) under output position `o` along an axis
    /// of length `len` with window `win`.
    #[inline]
    fn span(&self, o: usize, win: usize, len: usize) -> (usize, usize) {
        let lo = (o * self.stride) as isize - self.pad as isize;
        let hi = (lo + win as isize).min(len as isize);
        (lo.max(0) as usize, hi as usize)
    }

    /// y = pool(x). For max pooling in training, `argmax` (one entry per
    /// element of y) receives the winning input pixel (h * W + w) for
    /// backward; `None` for inference and for average pooling.
    pub fn forward(
        &self,
        pool: &Pool,
        x: &Tensor4,
        y: &mut Tensor4,
        argmax: Option<&mut [u32]>,
    ) -> Result<()> {
        self.check(x, y)?;
        if let Some(a) = &argmax {
            check_buf("argmax", a.len(), y.data.len())?;
        }
        let (p, q) = self.out_hw();
        let (h, w, bc, cb) = (x.h, x.w, x.bc, x.c_blocks());
        let ilen = x.image_len();
        let am = argmax.map(|a| crate::layout::SyncPtr(a.as_mut_ptr() as *mut f32));
        let kind = self.kind;
        par_images(pool, y, |ni, out| {
            let img = &x.data[ni * ilen..][..ilen];
            let first = ni * out.len(); // this image's first entry of argmax
            for c in 0..cb {
                let plane = &img[c * h * w * bc..][..h * w * bc];
                for oy in 0..p {
                    let (y0, y1) = self.span(oy, self.window.0, h);
                    for ox in 0..q {
                        let (x0, x1) = self.span(ox, self.window.1, w);
                        let o = ((c * p + oy) * q + ox) * bc;
                        let dst = &mut out[o..o + bc];
                        match kind {
                            PoolKind::Max => {
                                dst.fill(f32::NEG_INFINITY);
                                // The arg-max goes straight into its place in
                                // `argmax`; inference keeps none.
                                // SAFETY: argmax has one entry per element of
                                // y (checked); each image's range belongs to
                                // one thread.
                                let mut best = am.map(|am| unsafe {
                                    std::slice::from_raw_parts_mut(
                                        (am.get() as *mut u32).add(first + o),
                                        bc,
                                    )
                                });
                                if let Some(b) = best.as_deref_mut() {
                                    b.fill((y0 * w + x0) as u32);
                                }
                                for iy in y0..y1 {
                                    for ix in x0..x1 {
                                        let at = iy * w + ix;
                                        let src = &plane[at * bc..][..bc];
                                        match best.as_deref_mut() {
                                            Some(b) => max_into(dst, b, src, at as u32),
                                            None => max_of(dst, src),
                                        }
                                    }
                                }
                            }
                            PoolKind::Avg => {
                                dst.fill(0.0);
                                for iy in y0..y1 {
                                    for ix in x0..x1 {
                                        let src = &plane[(iy * w + ix) * bc..][..bc];
                                        dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
                                    }
                                }
                                let inv = 1.0 / ((y1 - y0) * (x1 - x0)) as f32;
                                dst.iter_mut().for_each(|d| *d *= inv);
                            }
                        }
                    }
                }
            }
        });
        Ok(())
    }

    /// dx = pool^T(dy). Max pooling needs the `argmax` of the training
    /// forward pass.
    pub fn backward(
        &self,
        pool: &Pool,
        dy: &Tensor4,
        argmax: Option<&[u32]>,
        dx: &mut Tensor4,
    ) -> Result<()> {
        self.check(dx, dy)?;
        if self.kind == PoolKind::Max {
            match argmax {
                Some(a) => check_buf("argmax", a.len(), dy.data.len())?,
                None => {
                    return Err(shape(
                        "argmax",
                        "None",
                        "max-pool backward needs the arg-max of forward",
                    ))
                }
            }
        }
        let (p, q) = self.out_hw();
        let (h, w, bc, cb) = (dx.h, dx.w, dx.bc, dx.c_blocks());
        let olen = dy.image_len();
        let kind = self.kind;
        let argmax = argmax.unwrap_or(&[]);
        par_images(pool, dx, |ni, img| {
            img.fill(0.0);
            let g = &dy.data[ni * olen..][..olen];
            for c in 0..cb {
                let plane = &mut img[c * h * w * bc..][..h * w * bc];
                for oy in 0..p {
                    let (y0, y1) = self.span(oy, self.window.0, h);
                    for ox in 0..q {
                        let o = ((c * p + oy) * q + ox) * bc;
                        match kind {
                            PoolKind::Max => {
                                let am = &argmax[ni * olen + o..][..bc];
                                let (x0, x1) = self.span(ox, self.window.1, w);
                                for iy in y0..y1 {
                                    for ix in x0..x1 {
                                        let at = iy * w + ix;
                                        let d = &mut plane[at * bc..][..bc];
                                        route_max(d, am, &g[o..o + bc], at as u32);
                                    }
                                }
                            }
                            PoolKind::Avg => {
                                let (x0, x1) = self.span(ox, self.window.1, w);
                                let inv = 1.0 / ((y1 - y0) * (x1 - x0)) as f32;
                                for iy in y0..y1 {
                                    for ix in x0..x1 {
                                        let d = &mut plane[(iy * w + ix) * bc..][..bc];
                                        d.iter_mut()
                                            .zip(&g[o..o + bc])
                                            .for_each(|(d, s)| *d += s * inv);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        });
        Ok(())
    }
}

widest! {
    /// One pixel of a max-pool window, backward: `dst += g` in the channels
    /// whose arg-max is this pixel (`at`), `+= 0` elsewhere. A select per
    /// lane over the window's pixels, where a scatter of `g` to the arg-max
    /// pixels was scalar; overlapping windows still accumulate.
    fn route_max / route_max_plain(dst: &mut [f32], best: &[u32], g: &[f32], at: u32) {
        let (best, g) = (&best[..dst.len()], &g[..dst.len()]);
        for j in 0..dst.len() {
            dst[j] += if best[j] == at { g[j] } else { 0.0 };
        }
    }
}

widest! {
    /// One pixel of a max-pool window without the arg-max (inference):
    /// `dst = src` where `src > dst`.
    fn max_of / max_of_plain(dst: &mut [f32], src: &[f32]) {
        let src = &src[..dst.len()];
        for j in 0..dst.len() {
            // A NaN input wins and then stays: NaN propagates as in PyTorch.
            let better = src[j] > dst[j] || src[j].is_nan();
            dst[j] = if better { src[j] } else { dst[j] };
        }
    }
}

widest! {
    /// One pixel of a max-pool window: per channel, `best = at` and `dst =
    /// src` where `src > dst` or `src` is NaN (so the first maximum wins, and
    /// a NaN input reaches the output and stays there). Selects,
    /// not branches: the loop vectorises, where the branchy one stayed scalar
    /// (17% of a CNN training step).
    fn max_into / max_into_plain(dst: &mut [f32], best: &mut [u32], src: &[f32], at: u32) {
        let (best, src) = (&mut best[..dst.len()], &src[..dst.len()]);
        for j in 0..dst.len() {
            let better = src[j] > dst[j] || src[j].is_nan();
            dst[j] = if better { src[j] } else { dst[j] };
            best[j] = if better { at } else { best[j] };
        }
    }
}
