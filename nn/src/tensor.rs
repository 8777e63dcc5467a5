//! Tensors at the graph's edges. To the user a [`Tensor`] is plain NCHW,
//! row-major f32 (a flattened feature vector is `(n, features, 1, 1)`).
//! Between layers it may travel in the primitives' blocked layout
//! `[N][C/bc][H][W][bc]` instead, shared (not copied) by the layer that
//! wrote it and the layer that reads it; the plain values are made from it
//! only when someone asks for them. Layers reuse their output buffers from
//! step to step once no one else holds them. Under mixed precision the
//! layer that wrote the blocked values may have written them rounded to
//! bf16 too, in the same pass, for a bf16 layer that reads them
//! ([`crate::Layer::write_bf16`]).

use crate::error::{Error, Result};
use brgemm::bf16::bf16;
use brgemm::AlignedVec;
use brgemm_primitives::eltwise::relu_backward;
use brgemm_primitives::{Blocked, Pool, Tensor4};
use std::fmt;
use std::sync::{Arc, OnceLock};

/// The shape of an activation: minibatch, channels, height, width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Minibatch.
    pub n: usize,
    /// Channels (features after a flatten).
    pub c: usize,
    /// Height (1 for feature vectors).
    pub h: usize,
    /// Width (1 for feature vectors).
    pub w: usize,
}

impl Shape {
    /// `(n, c, h, w)`.
    pub fn new(n: usize, c: usize, h: usize, w: usize) -> Shape {
        Shape { n, c, h, w }
    }
    /// Feature vectors: `(n, features, 1, 1)`.
    pub fn flat(n: usize, features: usize) -> Shape {
        Shape::new(n, features, 1, 1)
    }
    /// Elements, or None on overflow.
    pub fn checked_len(&self) -> Option<usize> {
        self.n
            .checked_mul(self.c)?
            .checked_mul(self.h)?
            .checked_mul(self.w)
    }
    /// Elements (shapes in a built graph never overflow).
    pub fn len(&self) -> usize {
        self.n * self.c * self.h * self.w
    }
    /// Whether the shape holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Features per sample (`c * h * w`).
    pub fn features(&self) -> usize {
        self.c * self.h * self.w
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {}, {}, {})", self.n, self.c, self.h, self.w)
    }
}

/// An NCHW tensor. The data length always matches the shape.
#[derive(Clone)]
pub struct Tensor {
    shape: Shape,
    /// The plain values: set from the start, or made from `layout` on the
    /// first [`Tensor::data`].
    plain: OnceLock<Vec<f32>>,
    /// The layout a layer wrote the values in, if one did.
    layout: Layout,
    /// The layout's values rounded to bf16, element for element, where the
    /// layer that wrote them made that copy too.
    bf16: Option<Arc<AlignedVec<bf16>>>,
}

/// Where a tensor's values live besides (or before) the plain copy.
#[derive(Clone)]
enum Layout {
    /// Only the plain values.
    Plain,
    /// A layer's blocked NCHW buffer `[N][C/bc][H][W][bc]`.
    Nchw(Arc<Tensor4>),
    /// A flat tensor's rows in a linear layer's FC layout (the next linear
    /// layer reads them as they are).
    Rows(Arc<Blocked>),
    /// A layer's blocked NCHW buffer in bf16 alone (a bf16 convolution's
    /// output, for the batch norm after it): f32 readers get it widened.
    NchwBf16(Arc<Tensor4<bf16>>),
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .field("block", &self.block())
            .field("bf16", &self.bf16.is_some())
            .finish_non_exhaustive()
    }
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Tensor) -> bool {
        self.shape == other.shape && self.data() == other.data()
    }
}

impl Tensor {
    /// Zeros of `shape`.
    pub fn zeros(shape: Shape) -> Tensor {
        Tensor::plain(shape, vec![0.0; shape.len()])
    }
    fn plain(shape: Shape, data: Vec<f32>) -> Tensor {
        Tensor {
            shape,
            plain: OnceLock::from(data),
            layout: Layout::Plain,
            bf16: None,
        }
    }
    /// `data` (NCHW) as a tensor of `shape`; an error names both lengths.
    pub fn from_vec(shape: Shape, data: Vec<f32>) -> Result<Tensor> {
        match shape.checked_len() {
            Some(n) if n == data.len() => Ok(Tensor::plain(shape, data)),
            _ => Err(Error::Graph(format!(
                "{} values do not fill a tensor of shape {shape}",
                data.len()
            ))),
        }
    }
    /// The shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }
    /// The values, NCHW (made from the blocked layout on first use).
    pub fn data(&self) -> &[f32] {
        self.plain.get_or_init(|| match &self.layout {
            Layout::Nchw(t) => t.to_nchw(),
            Layout::Rows(r) => r.to_plain(),
            Layout::NchwBf16(t) => t.to_nchw(),
            Layout::Plain => unreachable!("a plain tensor is made with its values"),
        })
    }
    /// The values, NCHW, to write in place (the length is fixed).
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.data();
        self.layout = Layout::Plain;
        self.bf16 = None;
        self.plain.get_mut().expect("made by data()")
    }
    /// The values.
    pub fn into_vec(mut self) -> Vec<f32> {
        self.data();
        self.plain.take().expect("made by data()")
    }
    /// The channel block of the blocked layout the values travel in, if
    /// any (a detail of the layers' planning, shown for diagnostics).
    pub fn block(&self) -> Option<usize> {
        self.blocked().map(|t| t.dims().4)
    }
    /// The same values under another shape of equal size (a flatten).
    pub(crate) fn reshaped(self, shape: Shape) -> Tensor {
        debug_assert_eq!(shape.len(), self.shape.len());
        Tensor::plain(shape, self.into_vec())
    }
    /// An error unless the shape is `want`.
    pub(crate) fn expect(&self, what: &str, want: Shape) -> Result<()> {
        if self.shape == want {
            Ok(())
        } else {
            Err(Error::Tensor {
                what: what.into(),
                expected: want,
                got: self.shape,
            })
        }
    }
    /// A tensor over a layer's blocked buffer (shared, not copied).
    pub(crate) fn from_blocked(t: Arc<Tensor4>) -> Tensor {
        let (n, c, h, w, _) = t.dims();
        Tensor {
            shape: Shape::new(n, c, h, w),
            plain: OnceLock::new(),
            layout: Layout::Nchw(t),
            bf16: None,
        }
    }
    /// A flat `(rows, cols, 1, 1)` tensor over a linear layer's FC-layout
    /// buffer (shared, not copied).
    pub(crate) fn from_rows(r: Arc<Blocked>) -> Tensor {
        Tensor {
            shape: Shape::flat(r.rows(), r.cols()),
            plain: OnceLock::new(),
            layout: Layout::Rows(r),
            bf16: None,
        }
    }
    /// A tensor over a layer's blocked bf16 buffer (shared, not copied):
    /// its values exist in bf16 alone.
    pub(crate) fn from_blocked_bf16(t: Arc<Tensor4<bf16>>) -> Tensor {
        let (n, c, h, w, _) = t.dims();
        Tensor {
            shape: Shape::new(n, c, h, w),
            plain: OnceLock::new(),
            layout: Layout::NchwBf16(t),
            bf16: None,
        }
    }
    /// The blocked values with channel block `bc` when they exist in bf16
    /// alone ([`Tensor::from_blocked_bf16`]).
    pub(crate) fn bf16_only_as(&self, bc: usize) -> Option<&Arc<Tensor4<bf16>>> {
        match &self.layout {
            Layout::NchwBf16(t) if t.dims().4 == bc => Some(t),
            _ => None,
        }
    }
    /// The tensor with `twin`, when given, as its bf16 copy: the layer
    /// that wrote the layout's values wrote `twin` from them in the same
    /// pass.
    pub(crate) fn with_bf16(mut self, twin: Option<&TwinBuf>) -> Tensor {
        debug_assert!(twin.is_none() || !matches!(self.layout, Layout::Plain));
        self.bf16 = twin.map(TwinBuf::arc);
        self
    }
    /// Whether the values travel in bf16 too (written by their layer for
    /// a bf16 layer after it).
    pub fn has_bf16(&self) -> bool {
        self.bf16.is_some() || matches!(self.layout, Layout::NchwBf16(_))
    }
    /// Whether the values exist in bf16 alone (written so for a reader
    /// that takes bf16; f32 readers widen them).
    pub fn is_bf16_only(&self) -> bool {
        matches!(self.layout, Layout::NchwBf16(_))
    }
    /// The bf16 copy of the blocked values with channel block `bc`.
    pub(crate) fn bf16_blocked_as(&self, bc: usize) -> Option<&[bf16]> {
        if let Some(t) = self.bf16_only_as(bc) {
            return Some(t.data());
        }
        self.blocked_as(bc)
            .and(self.bf16.as_deref().map(|v| &v[..]))
    }
    /// The bf16 copy of [`Tensor::bf16_blocked_as`]'s second case, shared:
    /// for a layer that reads it again in backward.
    pub(crate) fn bf16_copy_as(&self, bc: usize) -> Option<Arc<AlignedVec<bf16>>> {
        self.blocked_as(bc).and(self.bf16.clone())
    }
    /// The bf16 copy of the values in the FC layout `like`.
    pub(crate) fn bf16_rows_like(&self, like: &Blocked) -> Option<&[bf16]> {
        let rows = self.rows().filter(|r| same_layout(r, like));
        rows.and(self.bf16.as_deref().map(|v| &v[..]))
    }
    /// The values in the FC layout, when a linear layer wrote them.
    pub(crate) fn rows(&self) -> Option<&Arc<Blocked>> {
        match &self.layout {
            Layout::Rows(r) => Some(r),
            _ => None,
        }
    }
    /// The blocked values, when a layer wrote them.
    pub(crate) fn blocked(&self) -> Option<&Tensor4> {
        self.nchw().map(|t| &**t)
    }
    fn nchw(&self) -> Option<&Arc<Tensor4>> {
        match &self.layout {
            Layout::Nchw(t) => Some(t),
            _ => None,
        }
    }
    /// The blocked values when they have channel block `bc`.
    pub(crate) fn blocked_as(&self, bc: usize) -> Option<&Arc<Tensor4>> {
        self.nchw().filter(|t| t.dims().4 == bc)
    }
    /// Where the values exist in bf16 alone, puts them in the blocked
    /// layout with channel block `bc` in `buf`: the tensor's own buffer
    /// when it has that block, else a copy into `buf`'s, still in bf16 (a
    /// convolution whose blocks differ from its writer's: ResNet-50's res5
    /// 3x3 layers take blocks of 32 for their filters' sake, their
    /// neighbours 64). False, and `buf` untouched, where they do not.
    pub(crate) fn bf16_only_into(&self, pool: &Pool, bc: usize, buf: &mut BfBuf) -> Result<bool> {
        let Layout::NchwBf16(src) = &self.layout else {
            return Ok(false);
        };
        if src.dims().4 == bc {
            buf.share(src);
        } else {
            reblock_as(pool, src, buf.get_mut(self.shape, bc)?, |v| v);
        }
        Ok(true)
    }
    /// Puts the values, in the blocked layout with channel block `bc`, in
    /// `buf`: the tensor's own buffer when it has that layout, else a
    /// conversion into `buf`'s (reused when no one else holds it).
    pub(crate) fn blocked_into(&self, pool: &Pool, bc: usize, buf: &mut Buf) -> Result<()> {
        if let Some(t) = self.blocked_as(bc) {
            buf.share(t);
            return Ok(());
        }
        let dst = buf.get_mut(self.shape, bc)?;
        match &self.layout {
            Layout::Nchw(src) => reblock_as(pool, src, dst, |v| v),
            Layout::Rows(r) => brgemm_primitives::eltwise::unflatten(pool, r, dst)?,
            Layout::NchwBf16(src) if src.dims().4 == bc => widen(pool, src, dst),
            Layout::NchwBf16(src) => reblock_as(pool, src, dst, bf16::to_f32),
            Layout::Plain => from_nchw(pool, self.data(), dst),
        }
        Ok(())
    }
}

/// A layer's buffer, shared with the tensors it hands out and written
/// again in place once they are gone: [`Buf`] (blocked NCHW) and [`RowBuf`]
/// (the FC layout of a linear layer).
pub(crate) struct Shared<T>(Option<Arc<T>>);

impl<T> Default for Shared<T> {
    fn default() -> Self {
        Shared(None)
    }
}

/// A layer's blocked NCHW buffer.
pub(crate) type Buf = Shared<Tensor4>;
/// A linear layer's buffer in the FC layout.
pub(crate) type RowBuf = Shared<Blocked>;
/// A layer's bf16 copy of its output (or input gradient) buffer.
pub(crate) type TwinBuf = Shared<AlignedVec<bf16>>;
/// A layer's blocked NCHW buffer in bf16 alone.
pub(crate) type BfBuf = Shared<Tensor4<bf16>>;

impl<T> Shared<T> {
    /// The buffer, to write: the old one when no one else holds it and
    /// `fits` it, else `fresh()`.
    fn get_mut_or(
        &mut self,
        fits: impl Fn(&T) -> bool,
        fresh: impl FnOnce() -> Result<T>,
    ) -> Result<&mut T> {
        let reuse = self
            .0
            .as_mut()
            .and_then(Arc::get_mut)
            .is_some_and(|t| fits(t));
        if !reuse {
            self.0 = Some(Arc::new(fresh()?));
        }
        Ok(Arc::get_mut(self.0.as_mut().expect("set above")).expect("held only here"))
    }
    /// Shares `t` (another layer's buffer, read as it is).
    pub(crate) fn share(&mut self, t: &Arc<T>) {
        self.0 = Some(Arc::clone(t));
    }
    /// The buffer as written or shared last (a layer reads it only after
    /// writing it).
    pub(crate) fn get(&self) -> &T {
        self.0.as_ref().expect("written before it is read")
    }
    /// Lets go of a buffer another layer wrote (an input kept for
    /// backward), so its writer can reuse it; a buffer of this layer's own
    /// stays for the next step.
    pub(crate) fn release(&mut self) {
        if self.0.as_ref().is_some_and(|t| Arc::strong_count(t) > 1) {
            self.0 = None;
        }
    }
    fn arc(&self) -> Arc<T> {
        Arc::clone(self.0.as_ref().expect("written"))
    }
}

impl Buf {
    /// The buffer, to write, with dims `(s, bc)` (a new zero one unless the
    /// old one is free and has them).
    pub(crate) fn get_mut(&mut self, s: Shape, bc: usize) -> Result<&mut Tensor4> {
        let want = (s.n, s.c, s.h, s.w, bc);
        self.get_mut_or(
            |t| t.dims() == want,
            || Ok(Tensor4::zeros(s.n, s.c, s.h, s.w, bc)?),
        )
    }
    /// A tensor sharing the buffer.
    pub(crate) fn tensor(&self) -> Tensor {
        Tensor::from_blocked(self.arc())
    }
}

impl BfBuf {
    /// The buffer, to write, with dims `(s, bc)` (a new zero one unless the
    /// old one is free and has them).
    pub(crate) fn get_mut(&mut self, s: Shape, bc: usize) -> Result<&mut Tensor4<bf16>> {
        let want = (s.n, s.c, s.h, s.w, bc);
        self.get_mut_or(
            |t| t.dims() == want,
            || Ok(Tensor4::zeros_bf16(s.n, s.c, s.h, s.w, bc)?),
        )
    }
    /// A tensor sharing the buffer.
    pub(crate) fn tensor(&self) -> Tensor {
        Tensor::from_blocked_bf16(self.arc())
    }
}

impl TwinBuf {
    /// The buffer, to write, of `len` values when `on` (a new one unless
    /// the old one is free and that long); None otherwise.
    pub(crate) fn get_mut_if(&mut self, on: bool, len: usize) -> Result<Option<&mut [bf16]>> {
        if !on {
            return Ok(None);
        }
        let buf = self.get_mut_or(
            |b| b.len() == len,
            || Ok(brgemm::aligned_vec(len, bf16::ZERO)),
        )?;
        Ok(Some(&mut buf[..]))
    }
}

impl RowBuf {
    /// The buffer, to write, laid out as `like` (a new zero one unless the
    /// old one is free and has that layout).
    pub(crate) fn get_mut(&mut self, like: &Blocked) -> Result<&mut Blocked> {
        self.get_mut_or(
            |b| same_layout(b, like),
            || {
                Ok(Blocked::zeros(
                    like.rows(),
                    like.cols(),
                    like.br(),
                    like.bc(),
                    like.inner(),
                )?)
            },
        )
    }
    /// A flat tensor sharing the buffer.
    pub(crate) fn tensor(&self) -> Tensor {
        Tensor::from_rows(self.arc())
    }
}

/// Whether two FC-layout matrices have the same dims and blocking.
pub(crate) fn same_layout(a: &Blocked, b: &Blocked) -> bool {
    (a.rows(), a.cols(), a.br(), a.bc(), a.inner())
        == (b.rows(), b.cols(), b.br(), b.bc(), b.inner())
}

/// Runs `f(image, values)` for every image of `data` (`len` values each),
/// images split over the pool's threads.
pub(crate) fn par_images<T: Send>(
    pool: &Pool,
    data: &mut [T],
    len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    pool.for_slices_of(data, len, f);
}

/// Plain NCHW into a blocked tensor of the same logical shape.
fn from_nchw(pool: &Pool, src: &[f32], dst: &mut Tensor4) {
    let c = dst.dims().1;
    channels_from_nchw(pool, src, c, 0, dst);
}

/// Channels `c0..` of a plain NCHW tensor of `total` channels into a
/// blocked tensor holding as many channels as it has (a convolution
/// group's input).
pub(crate) fn channels_from_nchw(
    pool: &Pool,
    src: &[f32],
    total: usize,
    c0: usize,
    dst: &mut Tensor4,
) {
    let (_, c, h, w, bc) = dst.dims();
    let (hw, len) = (h * w, dst.image_len());
    par_images(pool, dst.data_mut(), len, |i, image| {
        let plain = &src[(i * total + c0) * hw..][..c * hw];
        for ci in 0..c {
            let (blk, lane) = (ci / bc, ci % bc);
            for (p, v) in plain[ci * hw..][..hw].iter().enumerate() {
                image[(blk * hw + p) * bc + lane] = *v;
            }
        }
    });
}

/// A blocked tensor's channels into channels `c0..` of a plain NCHW
/// buffer of `total` channels (a convolution group's output).
pub(crate) fn channels_to_nchw(src: &Tensor4, total: usize, c0: usize, dst: &mut [f32]) {
    let (n, c, h, w, bc) = src.dims();
    let (hw, len, data) = (h * w, src.image_len(), src.data());
    for i in 0..n {
        let image = &data[i * len..][..len];
        for ci in 0..c {
            let out = &mut dst[(i * total + c0 + ci) * hw..][..hw];
            for (p, o) in out.iter_mut().enumerate() {
                *o = image[((ci / bc) * hw + p) * bc + ci % bc];
            }
        }
    }
}

/// A bf16 blocked tensor widened into an f32 one of the same dims.
fn widen(pool: &Pool, src: &Tensor4<bf16>, dst: &mut Tensor4) {
    let s = src.data();
    pool.for_slices(dst.data_mut(), |lo, o| {
        o.iter_mut()
            .zip(&s[lo..])
            .for_each(|(o, v)| *o = v.to_f32());
    });
}

/// One blocked layout into another of the same logical shape, each value
/// through `f` (a widening, or none).
fn reblock_as<S: Copy + Sync, D: Copy + Send>(
    pool: &Pool,
    src: &Tensor4<S>,
    dst: &mut Tensor4<D>,
    f: impl Fn(S) -> D + Sync,
) {
    let (_, c, h, w, bc) = src.dims();
    let bd = dst.dims().4;
    let (hw, si, len) = (h * w, src.image_len(), dst.image_len());
    let s = src.data();
    par_images(pool, dst.data_mut(), len, |i, image| {
        let from = &s[i * si..][..si];
        for ci in 0..c {
            for p in 0..hw {
                image[((ci / bd) * hw + p) * bd + ci % bd] =
                    f(from[((ci / bc) * hw + p) * bc + ci % bc]);
            }
        }
    });
}

/// `a + b` into `buf` (blocked when both travel in one blocked layout,
/// else plain): the residual join, and the sum of the gradients of a
/// node that feeds several. With `relu`, `max(a + b, 0)` in the same pass
/// (NaN stays NaN).
pub(crate) fn add(
    pool: &Pool,
    a: &Tensor,
    b: &Tensor,
    buf: &mut Buf,
    relu: bool,
) -> Result<Tensor> {
    debug_assert_eq!(a.shape, b.shape);
    let f = |u: f32, v: f32| {
        let s = u + v;
        if relu && s < 0.0 {
            0.0
        } else {
            s
        }
    };
    if let Some(bc) = a.block() {
        if let (Some(x), Some(y)) = (a.blocked_as(bc), b.blocked_as(bc)) {
            let (x, y) = (x.data(), y.data());
            let out = buf.get_mut(a.shape, bc)?;
            pool.for_slices(out.data_mut(), |lo, o| {
                for ((o, u), v) in o.iter_mut().zip(&x[lo..]).zip(&y[lo..]) {
                    *o = f(*u, *v);
                }
            });
            return Ok(buf.tensor());
        }
    }
    let out = a
        .data()
        .iter()
        .zip(b.data())
        .map(|(u, v)| f(*u, *v))
        .collect();
    Tensor::from_vec(a.shape, out)
}

/// `g` where `y > 0`, else 0, into `buf` (blocked when both travel in one
/// blocked layout, else plain): the gradient through a ReLU fused into the
/// node that wrote `y`.
pub(crate) fn relu_grad(pool: &Pool, g: &Tensor, y: &Tensor, buf: &mut Buf) -> Result<Tensor> {
    if let Some(bc) = y.block() {
        if let (Some(gb), Some(yb)) = (g.blocked_as(bc), y.blocked_as(bc)) {
            let out = buf.get_mut(g.shape, bc)?;
            relu_backward(pool, gb.data(), yb.data(), out.data_mut())?;
            return Ok(buf.tensor());
        }
    }
    let mut out = vec![0.0; g.shape.len()];
    relu_backward(pool, g.data(), y.data(), &mut out)?;
    Tensor::from_vec(g.shape, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocked_layouts_round_trip_and_keep_padding_zero() {
        let s = Shape::new(2, 5, 3, 2);
        let plain: Vec<f32> = (0..s.len()).map(|i| i as f32 - 7.5).collect();
        let t = Tensor::from_vec(s, plain.clone()).unwrap();
        let pool = Pool::new(2).unwrap().always_parallel();
        let (mut a, mut b) = (Buf::default(), Buf::default());
        t.blocked_into(&pool, 3, &mut a).unwrap();
        assert_eq!(a.get().to_nchw(), plain);
        // 5 channels in blocks of 3: one padding lane per pixel, zero.
        let zeros = a.get().data().iter().filter(|v| **v == 0.0).count();
        assert_eq!(zeros, 2 * 3 * 2);
        let shared = a.tensor();
        assert_eq!(shared.block(), Some(3));
        shared.blocked_into(&pool, 4, &mut b).unwrap();
        assert_eq!(b.get().to_nchw(), plain);
        assert_eq!(b.tensor().data(), &plain[..]);
        // The same block again is shared, not copied.
        let mut c = Buf::default();
        shared.blocked_into(&pool, 3, &mut c).unwrap();
        assert!(Arc::ptr_eq(c.0.as_ref().unwrap(), a.0.as_ref().unwrap()));
        // Writing a plain copy drops the blocked values.
        let mut m = b.tensor();
        m.data_mut()[0] = 100.0;
        assert_eq!(m.block(), None);
        assert_eq!(m.data()[0], 100.0);
    }

    #[test]
    fn values_in_bf16_alone_are_widened_for_f32_readers() {
        let s = Shape::new(2, 5, 3, 2);
        let plain: Vec<f32> = (0..s.len()).map(|i| i as f32 * 0.37 - 7.5).collect();
        let pool = Pool::new(2).unwrap().always_parallel();
        let mut blocked = Buf::default();
        Tensor::from_vec(s, plain.clone())
            .unwrap()
            .blocked_into(&pool, 4, &mut blocked)
            .unwrap();
        let mut bb = BfBuf::default();
        *bb.get_mut(s, 4).unwrap() = Tensor4::rounded(&pool, blocked.get());
        let t = bb.tensor();
        let want: Vec<f32> = plain.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
        assert!(t.is_bf16_only() && t.has_bf16());
        // No f32 blocked layout to share: f32 readers take the plain path.
        assert_eq!(t.block(), None);
        assert_eq!(t.data(), &want[..]);
        assert_eq!(t.bf16_blocked_as(4).map(<[bf16]>::len), Some(2 * 2 * 6 * 4));
        assert!(t.bf16_blocked_as(3).is_none());
        // Widened into the same block, and into others.
        for bc in [4, 3, 2] {
            let mut out = Buf::default();
            bb.tensor().blocked_into(&pool, bc, &mut out).unwrap();
            assert_eq!(out.get().to_nchw(), want, "block {bc}");
        }
        // Kept in bf16 for bf16 readers: the same block shared, others
        // copied, the padding lanes zero.
        for bc in [4, 3, 2] {
            let mut h = BfBuf::default();
            assert!(t.bf16_only_into(&pool, bc, &mut h).unwrap());
            assert_eq!(h.get().dims().4, bc);
            assert_eq!(h.get().to_nchw(), want, "bf16, block {bc}");
            let zeros = h.get().data().iter().filter(|v| v.to_f32() == 0.0).count();
            let pad = h.get().data().len() - want.len();
            assert_eq!(zeros, pad, "bf16, block {bc}: padding");
            let shared = Arc::ptr_eq(h.0.as_ref().unwrap(), bb.0.as_ref().unwrap());
            assert_eq!(shared, bc == 4, "bf16, block {bc}: shared");
        }
        // f32 values are not in bf16 alone: nothing is written.
        let mut none = BfBuf::default();
        assert!(!blocked
            .tensor()
            .bf16_only_into(&pool, 4, &mut none)
            .unwrap());
        assert!(none.0.is_none());
    }

    #[test]
    fn a_buffer_is_reused_only_when_no_one_else_holds_it() {
        let s = Shape::new(1, 4, 2, 2);
        let mut buf = Buf::default();
        let first = buf.get_mut(s, 4).unwrap() as *const Tensor4;
        let held = buf.tensor();
        let second = buf.get_mut(s, 4).unwrap() as *const Tensor4;
        assert_ne!(first, second, "a held buffer must not be written");
        drop(held);
        let third = buf.get_mut(s, 4).unwrap() as *const Tensor4;
        assert_eq!(second, third);
    }

    #[test]
    fn add_sums_in_the_shared_layout_and_in_plain() {
        let s = Shape::new(2, 3, 2, 2);
        let pool = Pool::new(1).unwrap();
        let x = Tensor::from_vec(s, (0..24).map(|i| i as f32).collect()).unwrap();
        let y = Tensor::from_vec(s, (0..24).map(|i| 2.0 * i as f32).collect()).unwrap();
        let want: Vec<f32> = (0..24).map(|i| 3.0 * i as f32).collect();
        let mut out = Buf::default();
        assert_eq!(
            add(&pool, &x, &y, &mut out, false).unwrap().data(),
            &want[..]
        );
        let (mut bx, mut by) = (Buf::default(), Buf::default());
        x.blocked_into(&pool, 2, &mut bx).unwrap();
        y.blocked_into(&pool, 2, &mut by).unwrap();
        let sum = add(&pool, &bx.tensor(), &by.tensor(), &mut out, false).unwrap();
        assert_eq!(sum.block(), Some(2));
        assert_eq!(sum.data(), &want[..]);
    }
}
