//! Mixed-precision LSTM/RNN: the input projection, the recurrent BRGEMMs of
//! every step, backward-data and the weight gradients on bf16 operands,
//! f32 accumulation; the cell arithmetic, c, the kept gates and the
//! gradients themselves in f32.
//!
//! The f32 W and R stay the master copies; [`RnnBf16::pack_weights`]
//! rounds them once per step into the VNNI operands of forward and of the
//! transposed passes (the same block grids as the f32 W, R and their
//! transposes). The step loops are the f32 layer's own: each step's h (and
//! in BPTT each dG block) is rounded into a bf16 copy as the cell writes
//! it, and the next step's recurrent BRGEMM reads that copy.

use super::{CellKind, Recurrent, Rnn, RnnGrads, RnnState, RnnTuning};
use crate::error::{check_buf, shape, Result};
use crate::fc_bf16::{to_bf16, FcBf16};
use crate::layout::Blocked;
use crate::threads::Pool;
use crate::view::{View, ViewMut};
use brgemm::bf16::{bf16, Bf16Isa};
use brgemm::{AlignedVec, BatchForm, Beta, DataType, Descriptor, Kernel};
use std::sync::Mutex;

/// W and R packed for the bf16 passes (see [`RnnBf16::pack_weights`]).
pub struct RnnBf16Weights {
    w: AlignedVec<bf16>,
    wt: AlignedVec<bf16>,
    r: AlignedVec<bf16>,
    rt: AlignedVec<bf16>,
}

impl Default for RnnBf16Weights {
    fn default() -> Self {
        let buf = || AlignedVec::new(brgemm::buffer::ALIGN);
        RnnBf16Weights {
            w: buf(),
            wt: buf(),
            r: buf(),
            rt: buf(),
        }
    }
}

/// The bf16 passes of an [`Rnn`].
pub struct RnnBf16 {
    /// The layer planned for: (cell, t, n, c, k) and its tuning.
    dims: (CellKind, usize, usize, usize, usize),
    tuning: RnnTuning,
    input: FcBf16,
    recur: FcBf16,
    /// The recurrent product of forward and of BPTT (beta = 1; the same
    /// shape both ways: bk x bn x bk blocks, R or R^T as A).
    rec: Kernel,
    /// As `rec` with beta = 0, for dh_0.
    rec0: Kernel,
    /// Rounded X, the bf16 copies of h_prev (forward) and of dG (BPTT).
    xb: Mutex<AlignedVec<bf16>>,
    hb: Mutex<AlignedVec<bf16>>,
    dgb: Mutex<AlignedVec<bf16>>,
}

impl RnnBf16 {
    /// Plans the bf16 passes for `rnn`'s shape and blocking (even blocks).
    pub fn new(rnn: &Rnn) -> Result<RnnBf16> {
        let tn = rnn.tuning();
        if !tn.bk.is_multiple_of(2) {
            return Err(shape(
                "bk",
                tn.bk,
                "bf16 recurrent layers need an even hidden block (VNNI pairs)",
            ));
        }
        let (bn, bk) = (tn.bn, tn.bk);
        let desc = Descriptor::new(bk, bn, bk)
            .dtype(DataType::Bf16)
            .batch_form(BatchForm::Stride {
                a: bk * bk,
                b: bn * bk,
            });
        let buf = || Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN));
        Ok(RnnBf16 {
            dims: (rnn.kind, rnn.t, rnn.n, rnn.c, rnn.k),
            tuning: tn.clone(),
            input: FcBf16::new(&rnn.input)?,
            recur: FcBf16::new(&rnn.recur)?,
            rec: Kernel::new(&desc.beta(Beta::One))?,
            rec0: Kernel::new(&desc)?,
            xb: buf(),
            hb: buf(),
            dgb: buf(),
        })
    }

    /// The bf16 kernel of the recurrent BRGEMMs, e.g. `Amx`.
    pub fn isa(&self) -> Bf16Isa {
        self.rec.bf16_isa().expect("planned with a bf16 descriptor")
    }

    /// Packs the f32 `w` and `r` (the layouts of [`Rnn::w_layout`] and
    /// [`Rnn::r_layout`]) for forward and the transposed passes.
    pub fn pack_weights(
        &self,
        pool: &Pool,
        w: &Blocked,
        r: &Blocked,
        out: &mut RnnBf16Weights,
    ) -> Result<()> {
        self.input.pack_weights(pool, w, &mut out.w, &mut out.wt)?;
        self.recur.pack_weights(pool, r, &mut out.r, &mut out.rt)
    }

    /// An error unless `rnn` is the layer these passes were planned for
    /// (the kernels' blocks and the buffers' sizes come from it).
    fn check(&self, rnn: &Rnn) -> Result<()> {
        if (rnn.kind, rnn.t, rnn.n, rnn.c, rnn.k) != self.dims || *rnn.tuning() != self.tuning {
            return Err(shape(
                "rnn",
                format!("{rnn:?}"),
                "is not the layer these bf16 passes were planned for",
            ));
        }
        Ok(())
    }

    /// Hidden blocks, gate blocks, elements per R block, rows of a sequence.
    fn grid(rnn: &Rnn) -> (usize, usize, usize, usize) {
        let tn = rnn.tuning();
        let kb = rnn.padded_k() / tn.bk;
        (
            kb,
            rnn.kind.gates() * kb,
            tn.bk * tn.bk,
            rnn.t * rnn.padded_n(),
        )
    }

    /// [`Rnn::forward`] on bf16 operands: X (f32, rounded here) and the
    /// packed weights; the state as the f32 pass leaves it.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        pool: &Pool,
        rnn: &Rnn,
        x: &Blocked,
        packed: &RnnBf16Weights,
        bias: &[f32],
        h0: Option<&Blocked>,
        c0: Option<&Blocked>,
        st: &mut RnnState,
    ) -> Result<()> {
        let pool = pool.for_work(rnn.flops());
        self.check(rnn)?;
        let (kb, gkb, blk, rows) = Self::grid(rnn);
        check_buf("packed R", packed.r.len(), gkb * kb * blk)?;
        rnn.check_forward(x, h0, c0, st)?;
        let mut xb = self.xb.lock().unwrap_or_else(|e| e.into_inner());
        to_bf16(pool, &x.data, &mut xb);
        self.input
            .forward(pool, &xb, &packed.w, bias, &mut st.gates, None)?;
        let mut hb = self.hb.lock().unwrap_or_else(|e| e.into_inner());
        hb.resize(rows * kb * rnn.tuning().bk, bf16::ZERO);
        let rec = Recurrent {
            kernel: &self.rec,
            kernel0: &self.rec,
            w: View::new(&packed.r, [kb * blk, blk]),
            b16: Some(ViewMut::new(
                &mut hb,
                [kb * st.h_prev.block_len(), st.h_prev.block_len()],
            )),
        };
        rnn.steps_forward(pool, rec, h0, c0, st)
    }

    /// [`Rnn::backward_from_state`] on bf16 operands (the recurrent
    /// BRGEMMs of BPTT, dX, dW and dR), gradients accumulated in f32.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_state(
        &self,
        pool: &Pool,
        rnn: &Rnn,
        dh: &Blocked,
        dc_last: Option<&Blocked>,
        x: &Blocked,
        packed: &RnnBf16Weights,
        st: &RnnState,
        gr: &mut RnnGrads,
    ) -> Result<()> {
        let pool = pool.for_work(rnn.flops());
        self.check(rnn)?;
        let (kb, gkb, blk, _) = Self::grid(rnn);
        check_buf("packed Rt", packed.rt.len(), gkb * kb * blk)?;
        rnn.check_backward(dh, dc_last, x, st, gr)?;
        let mut dgb = self.dgb.lock().unwrap_or_else(|e| e.into_inner());
        dgb.resize(gr.dg.data.len(), bf16::ZERO);
        let bl = gr.dg.block_len();
        let rec = Recurrent {
            kernel: &self.rec,
            kernel0: &self.rec0,
            w: View::new(&packed.rt, [gkb * blk, blk]),
            b16: Some(ViewMut::new(&mut dgb, [gkb * bl, bl])),
        };
        rnn.bptt(pool, rec, dh, dc_last, st, gr);
        self.input
            .backward_data(pool, &dgb, &packed.wt, &mut gr.dx)?;
        // dW = dG^T X and dR = dG^T H_prev over every step at once, on
        // bf16 operands (the recurrent FC's bias gradient, equal to db,
        // goes to scratch as in f32).
        self.input
            .backward_weights(pool, &rnn.input, &gr.dg, x, &mut gr.dw, &mut gr.db)?;
        let h = &st.h_prev;
        self.recur
            .backward_weights(pool, &rnn.recur, &gr.dg, h, &mut gr.dr, &mut gr.db_r)
    }
}
