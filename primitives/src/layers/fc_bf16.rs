//! Mixed-precision FC passes: forward and backward-data with bf16 operands
//! on the bf16 BRGEMM (AMX tiles where the blocks bk and bc are multiples of 32, else
//! AVX512-BF16, else the reference), f32 accumulation and f32 outputs.
//!
//! The f32 weights stay the master copy (the optimizer updates them); each
//! step packs them once into the VNNI layout the bf16 kernel reads for A
//! (pairs along k: `[K/bk][C/bc][bc/2][bk][2]` for forward, and the
//! transposed `[C/bc][K/bk][bk/2][bc][2]` for backward-data), rounding to
//! nearest even. Activations and output gradients are rounded to bf16 in
//! their blocked layouts (B operands keep the f32 kernel's layout). The
//! weight gradient stays an f32 BRGEMM on the f32 activations: its sums run
//! over the whole minibatch, where bf16 inputs would cost accuracy for
//! little time (it is one of three passes).

use crate::engine::bf16::{pack_vnni, WeightGrid};
use crate::error::{shape, Result};
use crate::fc::Fc;
use crate::layout::{Blocked, SyncPtr};
use crate::loops::{LoopDef, LoopNest};
use crate::threads::Pool;
use brgemm::bf16::bf16;
use brgemm::Kernel;
use brgemm::{
    Activation, AlignedVec, BatchForm, DataType, Descriptor, Epilogue, Prefetch, RawBatch,
};

/// The bf16 forward and backward-data of an [`Fc`] layer.
pub struct FcBf16 {
    fwd: Kernel,
    bwd: Kernel,
    nest_fwd: LoopNest,
    nest_bwd: LoopNest,
    bn: usize,
    bc: usize,
    bk: usize,
    nb: usize,
    cb: usize,
    kb: usize,
    k: usize,
    act: Activation,
}

pub use crate::engine::bf16::{round_bf16, to_bf16};

/// Whether the kernels of a pass whose calls each reduce over `red`
/// elements, with `bn` columns and `bo` rows of output, prefetch the next
/// pair: above the CPU policy's per-call size (docs/tuning-notes.md).
fn bf16_prefetch(red: usize, bn: usize, bo: usize) -> Prefetch {
    let from = crate::policy().bf16_prefetch_from;
    brgemm::Policy::prefetch_if(from.is_some_and(|f| 2 * red * (bn + bo) > f))
}

impl FcBf16 {
    /// Plans the bf16 passes for `fc`'s shape and blocking. The blocks bc
    /// and bk must be even (VNNI pairs); GELU is not fused here.
    pub fn new(fc: &Fc) -> Result<FcBf16> {
        crate::check_policy()?;
        let t = fc.tuning();
        let (bn, bc, bk) = (t.bn, t.bc, t.bk);
        for (what, v) in [("bc", bc), ("bk", bk)] {
            if v % 2 != 0 {
                return Err(shape(
                    what,
                    v,
                    "bf16 FC passes need even blocks (VNNI pairs along k)",
                ));
            }
        }
        if fc.act == Activation::Gelu {
            return Err(shape(
                "activation",
                "Gelu",
                "the bf16 FC fuses Identity, Relu, Sigmoid or Tanh",
            ));
        }
        let (nb, cb, kb) = (fc.n.div_ceil(bn), fc.c.div_ceil(bc), fc.k.div_ceil(bk));
        let fwd = Kernel::new(
            &Descriptor::new(bk, bn, bc)
                .dtype(DataType::Bf16)
                .prefetch(bf16_prefetch(cb * bc, bn, bk))
                .batch_form(BatchForm::Stride {
                    a: bc * bk,
                    b: bn * bc,
                })
                .epilogue(Epilogue {
                    bias: true,
                    activation: fc.act,
                }),
        )?;
        let bwd = Kernel::new(
            &Descriptor::new(bc, bn, bk)
                .dtype(DataType::Bf16)
                .prefetch(bf16_prefetch(kb * bk, bn, bc))
                .batch_form(BatchForm::Stride {
                    a: bc * bk,
                    b: bn * bk,
                }),
        )?;
        let nest = |a, b| {
            LoopNest::new(
                vec![LoopDef::new("N blocks", nb, 1), LoopDef::new(a, b, 1)],
                "BA",
            )
        };
        Ok(FcBf16 {
            fwd,
            bwd,
            nest_fwd: nest("K blocks", kb)?,
            nest_bwd: nest("C blocks", cb)?,
            bn,
            bc,
            bk,
            nb,
            cb,
            kb,
            k: fc.k,
            act: fc.act,
        })
    }

    /// The bf16 kernel in use (forward), e.g. `Amx`.
    pub fn isa(&self) -> brgemm::bf16::Bf16Isa {
        self.fwd.bf16_isa().expect("planned with a bf16 descriptor")
    }

    /// The work of one pass for [`Pool::for_work`], in f32-equivalent
    /// operations: bf16 kernels run about twice the f32 rate, so the same
    /// hand-off needs twice the operations to pay.
    fn work(&self) -> f64 {
        let (n, c, k) = (self.nb * self.bn, self.cb * self.bc, self.kb * self.bk);
        (n * c * k) as f64
    }

    /// Packs the f32 weights `w` (`[K/bk][C/bc][bc][bk]`) into the VNNI
    /// layouts of forward (`wv`) and backward-data (`wtv`).
    pub fn pack_weights(
        &self,
        pool: &Pool,
        w: &Blocked,
        wv: &mut AlignedVec<bf16>,
        wtv: &mut AlignedVec<bf16>,
    ) -> Result<()> {
        let pool = pool.for_work(self.work());
        let (bc, bk, cb, kb) = (self.bc, self.bk, self.cb, self.kb);
        if w.data.len() != kb * cb * bc * bk || w.br != bk || w.bc != bc {
            return Err(shape(
                "W",
                format!("{}x{} in {}x{} blocks", w.rows, w.cols, w.br, w.bc),
                "does not match the layer",
            ));
        }
        let grid = WeightGrid {
            outer: kb,
            inner: cb,
            taps: 1,
            bi: bc,
            bo: bk,
        };
        pack_vnni(pool, &w.data, grid, wv, wtv);
        Ok(())
    }

    /// Y = act(X W^T + b) from bf16 X (the blocked layout of `fc.x_layout`,
    /// rounded by [`to_bf16`]) and packed weights; `y` in `fc.y_layout`.
    pub fn forward(
        &self,
        pool: &Pool,
        x: &[bf16],
        wv: &[bf16],
        bias: &[f32],
        y: &mut Blocked,
    ) -> Result<()> {
        let pool = pool.for_work(self.work());
        let (bn, bc, bk, nb, cb, kb) = (self.bn, self.bc, self.bk, self.nb, self.cb, self.kb);
        crate::error::check_buf("bf16 X", x.len(), nb * cb * bn * bc)?;
        crate::error::check_buf("packed W", wv.len(), kb * cb * bc * bk)?;
        crate::error::check_buf("bias", bias.len(), kb * bk)?;
        crate::error::check_buf("Y", y.data.len(), nb * kb * bn * bk)?;
        let (xp, wp, bp) = (
            x.as_ptr() as usize,
            wv.as_ptr() as usize,
            bias.as_ptr() as usize,
        );
        let yp = SyncPtr(y.data.as_mut_ptr());
        self.nest_fwd.run(pool, |i| {
            let (ni, ki) = (i[0], i[1]);
            // SAFETY: lengths checked above; block (ni, ki) of Y belongs to
            // this item.
            unsafe {
                self.fwd.execute_raw(
                    RawBatch::Stride {
                        a: (wp as *const bf16).add(ki * cb * bc * bk),
                        b: (xp as *const bf16).add(ni * cb * bn * bc),
                        count: cb,
                    },
                    yp.get().add((ni * kb + ki) * bn * bk),
                    (bp as *const f32).add(ki * bk),
                )
            };
        });
        if !self.k.is_multiple_of(bk) && self.act.apply(0.0) != 0.0 {
            let tail = self.k % bk;
            for ni in 0..nb {
                let blk = &mut y.data[(ni * kb + kb - 1) * bn * bk..][..bn * bk];
                for row in blk.chunks_exact_mut(bk) {
                    row[tail..].fill(0.0);
                }
            }
        }
        Ok(())
    }

    /// dX = dZ W from bf16 dZ (the layout of `fc.y_layout`) and the packed
    /// transposed weights; `dx` in `fc.x_layout`.
    pub fn backward_data(
        &self,
        pool: &Pool,
        dz: &[bf16],
        wtv: &[bf16],
        dx: &mut Blocked,
    ) -> Result<()> {
        let pool = pool.for_work(self.work());
        let (bn, bc, bk, nb, cb, kb) = (self.bn, self.bc, self.bk, self.nb, self.cb, self.kb);
        crate::error::check_buf("bf16 dZ", dz.len(), nb * kb * bn * bk)?;
        crate::error::check_buf("packed Wt", wtv.len(), kb * cb * bc * bk)?;
        crate::error::check_buf("dX", dx.data.len(), nb * cb * bn * bc)?;
        let (dzp, wp) = (dz.as_ptr() as usize, wtv.as_ptr() as usize);
        let dxp = SyncPtr(dx.data.as_mut_ptr());
        self.nest_bwd.run(pool, |i| {
            let (ni, ci) = (i[0], i[1]);
            // SAFETY: as in forward; block (ni, ci) of dX belongs to this item.
            unsafe {
                self.bwd.execute_raw(
                    RawBatch::Stride {
                        a: (wp as *const bf16).add(ci * kb * bc * bk),
                        b: (dzp as *const bf16).add(ni * kb * bn * bk),
                        count: kb,
                    },
                    dxp.get().add((ni * cb + ci) * bn * bc),
                    std::ptr::null(),
                )
            };
        });
        Ok(())
    }
}
