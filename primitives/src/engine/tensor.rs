//! Blocked 4-D tensors for convolutional networks, and conversions from and
//! to the plain layouts users hold.
//!
//! | tensor | blocked layout | plain |
//! |---|---|---|
//! | activations ([`Tensor4`]) | `[N][C/bc][H][W][bc]` | NCHW |
//! | filters ([`Filter`]) | `[K/bk][C/bc][R][S][bc][bk]` | KCRS |
//!
//! A channel count that is not a multiple of its block is padded with zero
//! channels (3 input channels in a block of 3 need none; 10 channels in
//! blocks of 4 get two). Every primitive keeps the padding at zero.
//!
//! With the channel block innermost, a run of pixels of one channel block is
//! a column-major `bc x pixels` matrix with leading dimension `bc` (or
//! `stride * bc` for every `stride`-th pixel): BRGEMM reads it in place.

use crate::error::{check_buf, shape, Result};
use crate::threads::Pool;
use brgemm::bf16::bf16;
use brgemm::{aligned_vec, AlignedVec};

crate::layout::tensor_type! {
    /// A blocked activation tensor `[N][C/bc][H][W][bc]`.
    ///
    /// Shape and storage are private (see [`Blocked`](crate::Blocked)): the
    /// constructors size the buffer.
    ///
    /// ```compile_fail
    /// use brgemm_primitives::Tensor4;
    /// let mut t = Tensor4::zeros(1, 4, 2, 2, 4).unwrap();
    /// t.data = brgemm::aligned_vec(1, 0.0);
    /// ```
    Tensor4 {
        n: usize = "Minibatch.",
        c: usize = "Channels (logical).",
        h: usize = "Height.",
        w: usize = "Width.",
        bc: usize = "Channel block.",
    }
}

/// The padded storage length of an `n x c x h x w` tensor in channel
/// blocks of `bc`; an error names a zero size or an overflow.
fn storage_len(n: usize, c: usize, h: usize, w: usize, bc: usize) -> Result<usize> {
    for (what, v) in [("n", n), ("c", c), ("h", h), ("w", w), ("bc", bc)] {
        if v == 0 {
            return Err(shape(what, v, "must be at least 1"));
        }
    }
    [n, c.div_ceil(bc), h, w, bc]
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| shape("tensor", format!("{n}x{c}x{h}x{w}"), "too large"))
}

impl Tensor4 {
    /// A zero tensor.
    pub fn zeros(n: usize, c: usize, h: usize, w: usize, bc: usize) -> Result<Tensor4> {
        Ok(Tensor4 {
            n,
            c,
            h,
            w,
            bc,
            data: aligned_vec(storage_len(n, c, h, w, bc)?, 0.0),
        })
    }

    /// Converts a plain NCHW tensor.
    pub fn from_nchw(
        plain: &[f32],
        n: usize,
        c: usize,
        h: usize,
        w: usize,
        bc: usize,
    ) -> Result<Tensor4> {
        let mut t = Tensor4::zeros(n, c, h, w, bc)?;
        t.set_nchw(plain)?;
        Ok(t)
    }

    /// Overwrites the logical part from a plain NCHW tensor.
    pub fn set_nchw(&mut self, plain: &[f32]) -> Result<()> {
        check_buf(
            "NCHW tensor",
            plain.len(),
            self.n * self.c * self.h * self.w,
        )?;
        let hw = self.h * self.w;
        for ni in 0..self.n {
            for ci in 0..self.c {
                let src = &plain[(ni * self.c + ci) * hw..][..hw];
                let base = self.index(ni, ci, 0, 0);
                for (p, v) in src.iter().enumerate() {
                    self.data[base + p * self.bc] = *v;
                }
            }
        }
        Ok(())
    }

    /// The logical part as a plain NCHW tensor.
    pub fn to_nchw(&self) -> Vec<f32> {
        let hw = self.h * self.w;
        let mut out = vec![0.0; self.n * self.c * hw];
        for ni in 0..self.n {
            for ci in 0..self.c {
                let base = self.index(ni, ci, 0, 0);
                for (p, o) in out[(ni * self.c + ci) * hw..][..hw].iter_mut().enumerate() {
                    *o = self.data[base + p * self.bc];
                }
            }
        }
        out
    }
}

impl<T> Tensor4<T> {
    /// Channel blocks.
    pub fn c_blocks(&self) -> usize {
        self.c.div_ceil(self.bc)
    }
    /// Channels including the zero padding.
    pub fn padded_c(&self) -> usize {
        self.c_blocks() * self.bc
    }
    /// Elements of one image.
    pub fn image_len(&self) -> usize {
        self.c_blocks() * self.h * self.w * self.bc
    }
    /// Offset of element (n, c, h, w).
    #[inline]
    pub fn index(&self, n: usize, c: usize, h: usize, w: usize) -> usize {
        (((n * self.c_blocks() + c / self.bc) * self.h + h) * self.w + w) * self.bc + c % self.bc
    }
    /// (n, c, h, w, bc): what a primitive compares a buffer against.
    pub fn dims(&self) -> (usize, usize, usize, usize, usize) {
        (self.n, self.c, self.h, self.w, self.bc)
    }
}

/// A bf16 tensor in the same layout: activations that travel between bf16
/// layers at half the bytes (a bf16 convolution's output, read by the batch
/// norm after it; [`crate::BatchNorm::forward_train_to`]).
impl Tensor4<bf16> {
    /// A zero tensor (the bf16 zero is all bits clear, as f32's).
    pub fn zeros_bf16(n: usize, c: usize, h: usize, w: usize, bc: usize) -> Result<Tensor4<bf16>> {
        Ok(Tensor4 {
            n,
            c,
            h,
            w,
            bc,
            data: aligned_vec(storage_len(n, c, h, w, bc)?, bf16::ZERO),
        })
    }

    /// `t`'s values rounded to bf16 (to nearest even), padding included.
    pub fn rounded(pool: &Pool, t: &Tensor4) -> Tensor4<bf16> {
        let mut data = AlignedVec::new(brgemm::buffer::ALIGN);
        crate::engine::bf16::to_bf16(pool, &t.data, &mut data);
        Tensor4 {
            n: t.n,
            c: t.c,
            h: t.h,
            w: t.w,
            bc: t.bc,
            data,
        }
    }

    /// The values widened to f32 (exactly), in the same layout.
    pub fn widened(&self) -> Tensor4 {
        let mut data = aligned_vec(self.data.len(), 0.0);
        data.iter_mut()
            .zip(self.data.iter())
            .for_each(|(o, v)| *o = v.to_f32());
        Tensor4 {
            n: self.n,
            c: self.c,
            h: self.h,
            w: self.w,
            bc: self.bc,
            data,
        }
    }

    /// The logical part as a plain NCHW f32 tensor.
    pub fn to_nchw(&self) -> Vec<f32> {
        self.widened().to_nchw()
    }
}

/// Runs `f(image, &mut image_data)` for every image of `t`, images split
/// over the pool's threads.
pub(crate) fn par_images<F: Fn(usize, &mut [f32]) + Sync>(pool: &Pool, t: &mut Tensor4, f: F) {
    let len = t.image_len();
    let n = t.n;
    let p = crate::layout::SyncPtr(t.data.as_mut_ptr());
    pool.for_each(n, |i| {
        // SAFETY: each image belongs to one thread.
        let img = unsafe { std::slice::from_raw_parts_mut(p.get().add(i * len), len) };
        f(i, img);
    });
}

crate::layout::tensor_type! {
    /// A blocked filter `[K/bk][C/bc][R][S][bc][bk]`: K output and C input
    /// channels, R x S taps. Shape and storage are private, as in
    /// [`Tensor4`].
    ///
    /// ```compile_fail
    /// use brgemm_primitives::Filter;
    /// let mut f = Filter::zeros(4, 4, 3, 3, 4, 4).unwrap();
    /// f.k = 1 << 20;
    /// ```
    Filter {
        k: usize = "Output channels.",
        c: usize = "Input channels.",
        r: usize = "Kernel height.",
        s: usize = "Kernel width.",
        bk: usize = "Output-channel block (innermost).",
        bc: usize = "Input-channel block.",
    }
}

impl Filter {
    /// A zero filter.
    pub fn zeros(k: usize, c: usize, r: usize, s: usize, bk: usize, bc: usize) -> Result<Filter> {
        for (what, v) in [
            ("k", k),
            ("c", c),
            ("r", r),
            ("s", s),
            ("bk", bk),
            ("bc", bc),
        ] {
            if v == 0 {
                return Err(shape(what, v, "must be at least 1"));
            }
        }
        let len = [k.div_ceil(bk), c.div_ceil(bc), r, s, bc, bk]
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .ok_or_else(|| shape("filter", format!("{k}x{c}x{r}x{s}"), "too large"))?;
        Ok(Filter {
            k,
            c,
            r,
            s,
            bk,
            bc,
            data: brgemm::buffer::aligned_vec_huge(len, 0.0),
        })
    }

    /// Converts a plain KCRS filter.
    pub fn from_kcrs(
        plain: &[f32],
        (k, c, r, s): (usize, usize, usize, usize),
        bk: usize,
        bc: usize,
    ) -> Result<Filter> {
        let mut f = Filter::zeros(k, c, r, s, bk, bc)?;
        f.set_kcrs(plain)?;
        Ok(f)
    }

    /// Overwrites the logical part from a plain KCRS filter.
    pub fn set_kcrs(&mut self, plain: &[f32]) -> Result<()> {
        check_buf(
            "KCRS filter",
            plain.len(),
            self.k * self.c * self.r * self.s,
        )?;
        for (i, v) in plain.iter().enumerate() {
            let (rs, ks) = (i % (self.r * self.s), i / (self.r * self.s));
            let (ki, ci) = (ks / self.c, ks % self.c);
            let j = self.index(ki, ci, rs / self.s, rs % self.s);
            self.data[j] = *v;
        }
        Ok(())
    }

    /// The logical part as a plain KCRS filter.
    pub fn to_kcrs(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.k * self.c * self.r * self.s];
        for (i, o) in out.iter_mut().enumerate() {
            let (rs, ks) = (i % (self.r * self.s), i / (self.r * self.s));
            *o = self.data[self.index(ks / self.c, ks % self.c, rs / self.s, rs % self.s)];
        }
        out
    }

    /// Offset of element (k, c, r, s).
    #[inline]
    pub fn index(&self, k: usize, c: usize, r: usize, s: usize) -> usize {
        let cb = self.c.div_ceil(self.bc);
        (((((k / self.bk) * cb + c / self.bc) * self.r + r) * self.s + s) * self.bc + c % self.bc)
            * self.bk
            + k % self.bk
    }

    /// (k, c, r, s, bk, bc).
    pub fn dims(&self) -> (usize, usize, usize, usize, usize, usize) {
        (self.k, self.c, self.r, self.s, self.bk, self.bc)
    }

    /// Writes the filter with input and output channels swapped into `t`
    /// (`[C/bc][K/bk][R][S][bk][bc]`, taps not flipped): what backward-data
    /// reads. A transpose of every `bc x bk` block, parallel over `pool`.
    pub fn transpose_into(&self, t: &mut Filter, pool: &Pool) -> Result<()> {
        let want = (self.c, self.k, self.r, self.s, self.bc, self.bk);
        if t.dims() != want {
            return Err(shape(
                "transposed filter",
                format!("{:?}", t.dims()),
                format!("must be (k, c, r, s, bk, bc) = {want:?}"),
            ));
        }
        let (kb, cb, rs, blk) = (
            self.k.div_ceil(self.bk),
            self.c.div_ceil(self.bc),
            self.r * self.s,
            self.bk * self.bc,
        );
        let dst = crate::layout::SyncPtr(t.data.as_mut_ptr());
        let (bk, bc) = (self.bk, self.bc);
        pool.for_each(cb, |ci| {
            for ki in 0..kb {
                for x in 0..rs {
                    let s = &self.data[((ki * cb + ci) * rs + x) * blk..][..blk];
                    // SAFETY: each C block of the target belongs to one thread.
                    let d = unsafe {
                        std::slice::from_raw_parts_mut(
                            dst.get().add(((ci * kb + ki) * rs + x) * blk),
                            blk,
                        )
                    };
                    // s is [bc][bk], d is [bk][bc].
                    crate::layout::transpose_block(s, d, bc, bk);
                }
            }
        });
        Ok(())
    }
}
