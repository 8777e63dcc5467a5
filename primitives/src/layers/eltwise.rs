//! Element-wise steps between layers, on any blocked buffer (the zero
//! padding of a layout maps to zero, so they work on the raw data): ReLU,
//! inverted dropout, and flattening a [`Tensor4`] into the FC layout.

use crate::error::{check_buf, shape, Result};
use crate::init::Rng;
use crate::layout::{Blocked, SyncPtr};
use crate::tensor::Tensor4;
use crate::threads::Pool;

/// y = max(x, 0), NaN kept as NaN (so a diverged layer shows downstream).
pub fn relu_forward(pool: &Pool, x: &[f32], y: &mut [f32]) -> Result<()> {
    check_buf("relu output", y.len(), x.len())?;
    pool.for_slices(y, |lo, out| {
        for (o, v) in out.iter_mut().zip(&x[lo..]) {
            *o = brgemm::Activation::Relu.apply(*v);
        }
    });
    Ok(())
}

/// dx = dy where y > 0, else 0.
pub fn relu_backward(pool: &Pool, dy: &[f32], y: &[f32], dx: &mut [f32]) -> Result<()> {
    check_buf("relu dy", dy.len(), dx.len())?;
    check_buf("relu y", y.len(), dx.len())?;
    pool.for_slices(dx, |lo, out| {
        for ((o, g), v) in out.iter_mut().zip(&dy[lo..]).zip(&y[lo..]) {
            *o = pass(*g, *v);
        }
    });
    Ok(())
}

/// `g` where `y > 0`, else 0, selected by a bit mask: written as a branch,
/// the loops around it did not vectorise (3x slower batch-norm backward).
#[inline(always)]
pub(crate) fn pass(g: f32, y: f32) -> f32 {
    f32::from_bits(g.to_bits() & 0u32.wrapping_sub(u32::from(y > 0.0)))
}

/// Inverted dropout: keeps each element with probability `1 - p`, scaled
/// by `1 / (1 - p)`, so inference needs no change.
#[derive(Debug, Clone)]
pub struct Dropout {
    /// Probability of dropping an element, in [0, 1).
    pub(crate) p: f32,
    /// The scale per element of the last training forward (0 or 1/(1-p)).
    mask: Vec<f32>,
    rng: Rng,
}

/// Elements per independently seeded run of the mask: the mask is the same
/// for any number of threads.
const DROP_RUN: usize = 4096;

crate::layout::getters!(Dropout {
    p: f32 = "Drop probability.",
});

impl Dropout {
    /// Dropout with probability `p`, masks drawn from `seed`.
    pub fn new(p: f32, seed: u64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(shape("dropout p", p, "must be in [0, 1)"));
        }
        Ok(Dropout {
            p,
            mask: vec![],
            rng: Rng::new(seed),
        })
    }

    /// Training forward: draws a new mask and writes y = x * mask.
    pub fn forward_train(&mut self, pool: &Pool, x: &[f32], y: &mut [f32]) -> Result<()> {
        check_buf("dropout output", y.len(), x.len())?;
        self.mask.resize(x.len(), 0.0);
        let step = self.rng.next_u64();
        let (p, scale) = (self.p, 1.0 / (1.0 - self.p));
        pool.for_slices(&mut self.mask, |lo, m| {
            // Runs start at multiples of DROP_RUN in the whole buffer.
            let mut i = lo;
            while i < lo + m.len() {
                let run = DROP_RUN - i % DROP_RUN;
                let end = (i + run).min(lo + m.len());
                let mut r =
                    Rng::new(step ^ ((i / DROP_RUN) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                for _ in 0..i % DROP_RUN {
                    r.uniform();
                }
                for v in &mut m[i - lo..end - lo] {
                    *v = if r.uniform() >= p { scale } else { 0.0 };
                }
                i = end;
            }
        });
        let mask = &self.mask;
        pool.for_slices(y, |lo, out| {
            for ((o, v), k) in out.iter_mut().zip(&x[lo..]).zip(&mask[lo..]) {
                *o = v * k;
            }
        });
        Ok(())
    }

    /// dx = dy * mask of the last training forward.
    pub fn backward(&self, pool: &Pool, dy: &[f32], dx: &mut [f32]) -> Result<()> {
        check_buf("dropout dy", dy.len(), self.mask.len())?;
        check_buf("dropout dx", dx.len(), self.mask.len())?;
        let mask = &self.mask;
        pool.for_slices(dx, |lo, out| {
            for ((o, g), k) in out.iter_mut().zip(&dy[lo..]).zip(&mask[lo..]) {
                *o = g * k;
            }
        });
        Ok(())
    }
}

fn check_flat(x: &Tensor4, f: &Blocked) -> Result<()> {
    let feats = x.c * x.h * x.w;
    if f.rows != x.n || f.cols != feats {
        return Err(shape(
            "flattened",
            format!("{}x{}", f.rows, f.cols),
            format!("must be N x C*H*W = {}x{feats}", x.n),
        ));
    }
    Ok(())
}

/// Writes `x` as an FC input: row n, feature `(c * H + h) * W + w` (the
/// NCHW order, so flattened weights match other frameworks').
pub fn flatten(pool: &Pool, x: &Tensor4, out: &mut Blocked) -> Result<()> {
    check_flat(x, out)?;
    let (hw, bc) = (x.h * x.w, x.bc);
    let o = SyncPtr(out.data.as_mut_ptr());
    let out_ref = &*out;
    let n = x.n;
    pool.for_each(n, |ni| {
        // SAFETY: row ni of the output belongs to this thread.
        let put = |to: usize, v: f32| unsafe { *o.get().add(to) = v };
        if hw == 1 {
            // Flat: an image's channels are its first c values, in order.
            let src = &x.data[x.index(ni, 0, 0, 0)..][..x.c];
            let mut c = 0;
            for (off, len, step) in out_ref.row_runs(ni) {
                for (t, v) in src[c..c + len].iter().enumerate() {
                    put(off + t * step, *v);
                }
                c += len;
            }
            return;
        }
        let src = (0..x.c).flat_map(|c| {
            let base = x.index(ni, c, 0, 0);
            (0..hw).map(move |p| base + p * bc)
        });
        for (from, to) in src.zip(out_ref.row_offsets(ni)) {
            put(to, x.data[from]);
        }
    });
    Ok(())
}

/// The inverse of [`flatten`]: gradients of the FC input back into the
/// blocked tensor (channel padding set to zero).
pub fn unflatten(pool: &Pool, d: &Blocked, dx: &mut Tensor4) -> Result<()> {
    check_flat(dx, d)?;
    let (hw, bc, c) = (dx.h * dx.w, dx.bc, dx.c);
    crate::tensor::par_images(pool, dx, |ni, img| {
        img.fill(0.0);
        if hw == 1 {
            // Flat: the image's first c values are its channels, in order.
            d.get_row(ni, &mut img[..c]);
            return;
        }
        let dst = (0..c).flat_map(|ch| {
            let base = (ch / bc) * hw * bc + ch % bc;
            (0..hw).map(move |p| base + p * bc)
        });
        for (to, from) in dst.zip(d.row_offsets(ni)) {
            img[to] = d.data[from];
        }
    });
    Ok(())
}
