//! Pooling and the residual join on NHWC device buffers: max pooling with
//! any window, stride and padding (forward keeps where each max was;
//! backward gathers, per input, the gradients of the windows it won, in a
//! fixed order), global average pooling, and `y = a + b` with an optional
//! ReLU, and dropout with the CPU layer's masks. The pieces a ResNet or a
//! CNN needs beside the convolutions, batch norm and the FC head.

use crate::codegen::ElementwiseKernel as EK;
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};

/// A max-pooling layer's shape: `n` images of `h x w` pixels and `c`
/// channels, `win x win` windows at `stride`, `pad` pixels of padding that
/// never win.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Images.
    pub n: usize,
    /// Rows.
    pub h: usize,
    /// Columns.
    pub w: usize,
    /// Channels.
    pub c: usize,
    /// Window side.
    pub win: usize,
    /// Stride.
    pub stride: usize,
    /// Padding.
    pub pad: usize,
}

impl PoolShape {
    /// Output rows and columns (PyTorch's, without ceil mode).
    pub fn out_hw(&self) -> (usize, usize) {
        let o = |x: usize| (x + 2 * self.pad - self.win) / self.stride + 1;
        (o(self.h), o(self.w))
    }
    /// Checks the window against the padded image.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("n", self.n),
            ("h", self.h),
            ("w", self.w),
            ("c", self.c),
            ("win", self.win),
            ("stride", self.stride),
        ] {
            if v == 0 {
                return Err(invalid(what, v, "must be at least 1"));
            }
        }
        if self.pad >= self.win || self.win > self.h.min(self.w) + 2 * self.pad {
            return Err(invalid(
                "pooling window",
                format!("{} with padding {}", self.win, self.pad),
                format!(
                    "needs padding below the window and a window within the padded {}x{} image",
                    self.h, self.w
                ),
            ));
        }
        let elems = self.n * self.h * self.w * self.c;
        i32::try_from(elems).map_err(|_| invalid("pooling elements", elems, "exceeds i32"))?;
        Ok(())
    }
    fn args(&self) -> [Arg<'static>; 9] {
        let (oh, ow) = self.out_hw();
        [
            self.n,
            self.h,
            self.w,
            self.c,
            self.win,
            self.stride,
            self.pad,
            oh,
            ow,
        ]
        .map(|v| Arg::I32(v as i32))
    }
}

/// Max pooling forward: `y` the window maxima, `arg` (i32) where each was.
pub fn maxpool_forward(
    dev: &Device,
    sh: &PoolShape,
    x: &Buffer,
    y: &Buffer,
    arg: &Buffer,
) -> Result<()> {
    sh.validate()?;
    let (oh, ow) = sh.out_hw();
    let out = sh.n * oh * ow * sh.c;
    x.need("x", sh.n * sh.h * sh.w * sh.c)?;
    y.need("y", out)?;
    arg.need("arg", out)?;
    let mut a = vec![Arg::Buf(x), Arg::Buf(y), Arg::Buf(arg)];
    a.extend(sh.args());
    dev.launch_elementwise(EK::MaxPoolFwd, out, &a)
}

/// Max pooling backward: `dx` from `dy` and the forward's `arg`.
pub fn maxpool_backward(
    dev: &Device,
    sh: &PoolShape,
    dy: &Buffer,
    arg: &Buffer,
    dx: &Buffer,
) -> Result<()> {
    sh.validate()?;
    let (oh, ow) = sh.out_hw();
    let (out, inp) = (sh.n * oh * ow * sh.c, sh.n * sh.h * sh.w * sh.c);
    dy.need("dy", out)?;
    arg.need("arg", out)?;
    dx.need("dx", inp)?;
    let mut a = vec![Arg::Buf(dy), Arg::Buf(arg), Arg::Buf(dx)];
    a.extend(sh.args());
    dev.launch_elementwise(EK::MaxPoolBwd, inp, &a)
}

/// Global average pooling of `n` images of `hw` pixels and `c` channels:
/// `y` is `n x c`.
pub fn global_avgpool_forward(
    dev: &Device,
    (n, hw, c): (usize, usize, usize),
    x: &Buffer,
    y: &Buffer,
) -> Result<()> {
    x.need("x", n * hw * c)?;
    y.need("y", n * c)?;
    let ints = [n, hw, c].map(|v| Arg::I32(v as i32));
    let mut a = vec![Arg::Buf(x), Arg::Buf(y)];
    a.extend(ints);
    dev.launch_elementwise(EK::GAvgPoolFwd, n * c, &a)
}

/// Global average pooling backward: `dy` (`n x c`) spread over the pixels.
pub fn global_avgpool_backward(
    dev: &Device,
    (n, hw, c): (usize, usize, usize),
    dy: &Buffer,
    dx: &Buffer,
) -> Result<()> {
    dy.need("dy", n * c)?;
    dx.need("dx", n * hw * c)?;
    let ints = [n, hw, c].map(|v| Arg::I32(v as i32));
    let mut a = vec![Arg::Buf(dy), Arg::Buf(dx)];
    a.extend(ints);
    dev.launch_elementwise(EK::GAvgPoolBwd, n * hw * c, &a)
}

/// The residual join `y = a + b` over `n` values, then a ReLU when `relu`
/// (its gradient: the ReLU's, to both inputs).
pub fn add(dev: &Device, a: &Buffer, b: &Buffer, y: &Buffer, n: usize, relu: bool) -> Result<()> {
    for (what, x) in [("a", a), ("b", b), ("y", y)] {
        x.need(what, n)?;
    }
    dev.launch_elementwise(
        EK::AddAct,
        n,
        &[
            Arg::Buf(a),
            Arg::Buf(b),
            Arg::Buf(y),
            Arg::I32(n as i32),
            Arg::I32(relu as i32),
        ],
    )
}

/// Dropout forward over `n` values: the mask of the CPU dropout
/// ([`brgemm_primitives::eltwise::Dropout`]) for the step's `key` (its
/// 64-bit draw from the layer's seed) over the same flat indices, into
/// `mask`; `y = x * mask`.
#[allow(clippy::too_many_arguments)]
pub fn dropout_forward(
    dev: &Device,
    x: &Buffer,
    y: &Buffer,
    mask: &Buffer,
    n: usize,
    p: f32,
    key: u64,
) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        return Err(invalid("dropout p", p, "must be in [0, 1)"));
    }
    for (what, b) in [("x", x), ("y", y), ("mask", mask)] {
        b.need(what, n)?;
    }
    dev.launch_elementwise(
        EK::DropoutFwd,
        n,
        &[
            Arg::Buf(x),
            Arg::Buf(y),
            Arg::Buf(mask),
            Arg::I32(n as i32),
            Arg::F32(p),
            Arg::I32(key as u32 as i32),
            Arg::I32((key >> 32) as u32 as i32),
        ],
    )
}

/// Dropout backward: `dx = dy * mask`.
pub fn dropout_backward(
    dev: &Device,
    dy: &Buffer,
    mask: &Buffer,
    dx: &Buffer,
    n: usize,
) -> Result<()> {
    for (what, b) in [("dy", dy), ("mask", mask), ("dx", dx)] {
        b.need(what, n)?;
    }
    dev.launch_elementwise(
        EK::DropoutBwd,
        n,
        &[
            Arg::Buf(dy),
            Arg::Buf(mask),
            Arg::Buf(dx),
            Arg::I32(n as i32),
        ],
    )
}
