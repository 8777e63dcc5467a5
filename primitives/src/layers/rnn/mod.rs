//! LSTM and plain tanh RNN layers over whole sequences, as BRGEMM loops.
//!
//! Shapes: input X `[T][N][C]`, hidden and cell state `[N][K]`. The gate
//! pre-activations of all steps are one matrix G `[T*N][g*K]` (g = 4 gates
//! i, f, c, o for the LSTM, 1 for the RNN), in the FC layouts of
//! [`crate::layout`]:
//!
//! | tensor | layout | as |
//! |---|---|---|
//! | X (all steps) | `[T*N/bn][C/bc][bn][bc]` | FC input, rows `t*Np + n` |
//! | W (input weights, gates stacked) | `[g*K/bk][C/bc][bc][bk]` | FC weights |
//! | R (recurrent weights, gates stacked) | `[g*K/bk][K/bk][bk][bk]` | FC weights |
//! | H, G | `[T*N/bn][../bk][bn][bk]` | FC outputs |
//!
//! `Np` is N rounded up to `bn`, so a row block never spans two steps; gate
//! `j` owns the output columns `j*Kp .. j*Kp + K` (`Kp` = K rounded up to
//! `bk`).
//!
//! - **Forward**: the input projection of every step at once, `G = X W^T + b`,
//!   is one FC forward over `T*Np` rows (a large, parallel BRGEMM loop).
//!   Then per step, per `(n block, k block)` work item, each gate's block
//!   gets `+= R_gate h_(t-1)` as a BRGEMM over the hidden blocks (beta = 1)
//!   and the gate non-linearities and the c/h update run on the block while
//!   it is in L1. The activated gates, all c and all h are kept for backward.
//! - **Backward through time**, step by step from the last: the gate
//!   gradients of a block are element-wise from dh, dc and the kept gates;
//!   `dh_(t-1) += R^T dG_t` is a BRGEMM over the `g*K/bk` gate blocks (from a
//!   transposed copy of R made once per call). Afterwards the weight
//!   gradients are reductions over time and minibatch at once: `dW = dG^T X`
//!   and `dR = dG^T H_prev` are FC backward-weights over `T*Np` rows (one
//!   BRGEMM per output block whose batch runs over all steps), and
//!   `dX = dG W` is one FC backward-data.
//!
//! Per step the `(n block, k block)` items are a loop nest (spec over `a` =
//! N blocks, `b` = K blocks; default `AB`, both parallel); steps are
//! sequential (a step needs all of the previous step's h). The steps are
//! themselves the nest's outermost loop `c`, marked ordered (and backward's
//! two phases per step `d`), so a whole sequence is one hand-off to the pool
//! with a barrier between steps rather than one hand-off per step.

use crate::engine::bf16::round_slice;
use crate::error::{shape, Result};
use crate::fc::{Fc, FcTuning};
use crate::layout::{check_shape, Blocked, Inner, Shape};
use crate::loops::{LoopDef, LoopNest};
use crate::pass::{column_tile, plan_kernel, PassConfig};
use crate::threads::Pool;
use crate::view::View;
use crate::view::ViewMut;
use brgemm::bf16::bf16;
use brgemm::{Activation, BatchForm, Beta, Descriptor, Element, Kernel, RawBatch};
use std::sync::Arc;

mod cell;
mod io;
mod mixed;

pub use self::io::{RnnGrads, RnnState};

pub use self::mixed::{RnnBf16, RnnBf16Weights};

/// The recurrent operands of the step loops: the kernels (forward: `kernel`
/// only; BPTT: `kernel0` writes dh_0 with beta = 0), the blocks of R
/// (forward) or R^T (BPTT), and in bf16 the bf16 copy of the B operand
/// (h_prev, or dG) that the loops write as they produce it.
#[derive(Clone, Copy)]
struct Recurrent<'a, T> {
    kernel: &'a Kernel,
    kernel0: &'a Kernel,
    w: View<2, T>,
    b16: Option<ViewMut<2, bf16>>,
}

/// Which recurrent cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CellKind {
    /// Long short-term memory: gates i, f, c, o; `c_t = f c_(t-1) + i c~`,
    /// `h_t = o tanh(c_t)`.
    Lstm,
    /// Plain RNN: `h_t = tanh(W x_t + R h_(t-1) + b)`.
    Rnn,
}

impl CellKind {
    /// Gates per cell.
    pub fn gates(self) -> usize {
        match self {
            CellKind::Lstm => 4,
            CellKind::Rnn => 1,
        }
    }
}

/// Blocking and loop orders of a recurrent layer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RnnTuning {
    /// Minibatch block.
    pub bn: usize,
    /// Input-feature block.
    pub bc: usize,
    /// Hidden block.
    pub bk: usize,
    /// Forward nest: `a` = N blocks, `b` = K blocks, `c` = steps (ordered:
    /// outside the parallel loops; default `cAB`).
    pub fwd: PassConfig,
    /// Backward nest: as forward, plus `d` = the two phases of a step
    /// (ordered, inside `c`; default `cdAB`).
    pub bwd: PassConfig,
}

impl RnnTuning {
    /// Blocks of 64 where they divide (else 48, 32, 16; sizes below 64 are
    /// one block; else 64 with padding), like [`FcTuning::heuristic`], and
    /// both per-step loops parallel inside the steps (`cAB`, `cdAB`): a
    /// step's (n, k) blocks are independent.
    pub fn heuristic(n: usize, c: usize, k: usize) -> RnnTuning {
        let cands = [64, 48, 32, 16];
        let pick = |x| crate::pass::pick_block(x, &cands);
        RnnTuning {
            bn: pick(n),
            bc: pick(c),
            bk: pick(k),
            fwd: PassConfig::spec("cAB"),
            bwd: PassConfig::spec("cdAB"),
        }
    }
}

impl RnnTuning {
    /// [`RnnTuning::heuristic`] with the input and hidden blocks rounded up
    /// to multiples of 32, the AMX kernel's granule (28 input features
    /// become one block of 32 with 4 zero columns): the bf16 passes then
    /// run every product on AMX where the CPU has it, not the input
    /// projection on the next kernel, which is slower than f32.
    pub fn heuristic_bf16(n: usize, c: usize, k: usize) -> RnnTuning {
        let t = RnnTuning::heuristic(n, c, k);
        RnnTuning {
            bc: t.bc.next_multiple_of(32),
            bk: t.bk.next_multiple_of(32),
            ..t
        }
    }
}

/// A planned LSTM or RNN layer for sequences of `t` steps, minibatch `n`,
/// `c` input features and `k` hidden units.
pub struct Rnn {
    /// Cell.
    pub(crate) kind: CellKind,
    /// Steps.
    pub(crate) t: usize,
    /// Minibatch.
    pub(crate) n: usize,
    /// Input features.
    pub(crate) c: usize,
    /// Hidden units.
    pub(crate) k: usize,
    tuning: RnnTuning,
    /// Input projection over all steps: `T*Np x C -> T*Np x g*Kp`.
    input: Fc,
    /// The recurrent weights as an FC over all steps (only its
    /// backward-weights is used: dR = dG^T H_prev).
    recur: Fc,
    /// Per-step nests.
    fwd_nest: LoopNest,
    bwd_nest: LoopNest,
    /// G block += R_gate h_(t-1): m = bk, n = bn, k = bk, batch over K blocks.
    rec_kernel: Arc<Kernel>,
    /// dh_(t-1) block += R^T dG_t: batch over the g*K/bk gate blocks.
    rec_t_kernel: Arc<Kernel>,
    /// As `rec_t_kernel` with beta = 0 (for dh_0, which starts empty).
    rec_t_kernel0: Arc<Kernel>,
}

impl std::fmt::Debug for Rnn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rnn")
            .field("kind", &self.kind)
            .field("t", &self.t)
            .field("n", &self.n)
            .field("c", &self.c)
            .field("k", &self.k)
            .field("tuning", &self.tuning)
            .finish()
    }
}

crate::layout::getters!(Rnn {
    kind: CellKind = "Cell.",
    t: usize = "Steps.",
    n: usize = "Minibatch.",
    c: usize = "Input features.",
    k: usize = "Hidden units.",
});

impl Rnn {
    /// Plans a layer with the heuristic tuning.
    pub fn new(kind: CellKind, t: usize, n: usize, c: usize, k: usize) -> Result<Rnn> {
        Rnn::with_tuning(kind, t, n, c, k, RnnTuning::heuristic(n, c, k))
    }

    /// Plans a layer with the given blocking and per-step loop orders.
    pub fn with_tuning(
        kind: CellKind,
        t: usize,
        n: usize,
        c: usize,
        k: usize,
        tn: RnnTuning,
    ) -> Result<Rnn> {
        crate::check_policy()?;
        for (what, v) in [
            ("t", t),
            ("n", n),
            ("c", c),
            ("k", k),
            ("bn", tn.bn),
            ("bc", tn.bc),
            ("bk", tn.bk),
        ] {
            if v == 0 {
                return Err(shape(what, v, "must be at least 1"));
            }
        }
        let g = kind.gates();
        let (nb, kb) = (n.div_ceil(tn.bn), k.div_ceil(tn.bk));
        // The largest buffers (gates over the sequence, W, R, the cell
        // states), padded, before the products below are formed.
        crate::error::elems(
            "gates (t x padded n x gates x padded k)",
            &[t + 1, nb, tn.bn, g, kb, tn.bk],
        )?;
        crate::error::elems(
            "W (gates x padded k x c)",
            &[g, kb, tn.bk, c.div_ceil(tn.bc), tn.bc],
        )?;
        crate::error::elems("R (gates x padded k x k)", &[g, kb, tn.bk, kb, tn.bk])?;
        let (np, kp) = (nb * tn.bn, kb * tn.bk);
        let gk = g * kp;
        let fc_t = |bc| FcTuning {
            bn: tn.bn,
            bc,
            bk: tn.bk,
            ..FcTuning::heuristic(t * np, c, gk)
        };
        let input = Fc::with_tuning(t * np, c, gk, Activation::Identity, fc_t(tn.bc))?;
        let recur = Fc::with_tuning(t * np, k, gk, Activation::Identity, fc_t(tn.bk))?;
        // The steps are an ordered loop (backward adds the two phases of a
        // step): a whole sequence is one hand-off to the pool, with a
        // barrier per step.
        let step_nest = |which: &str, cfg: &PassConfig, phases: usize| {
            let mut loops = vec![
                LoopDef::new("N blocks", nb, 1),
                LoopDef::new("K blocks", kb, 1),
                LoopDef::new("steps", t, 1).ordered(),
            ];
            if phases > 1 {
                loops.push(LoopDef::new("phases", phases, 1).ordered());
            }
            cfg.nest(&format!("rnn {which}"), loops)
        };
        let (bn, bk) = (tn.bn, tn.bk);
        // Software prefetch of the next recurrent block pays once R streams
        // from beyond the level where the core's prefetchers keep up.
        let r_bytes = 4 * kind.gates() * kp * kp;
        let pf = brgemm::Policy::prefetch_if(r_bytes > crate::policy().rnn_prefetch_from);
        // The recurrent blocks are FC forward calls (C = bk x bn): the
        // policy's whole-column tile where it has one.
        let tile = column_tile(bk, bn);
        let rec_kernel = plan_kernel(
            &Descriptor::new(bk, bn, bk)
                .beta(Beta::One)
                .prefetch(pf)
                .batch_form(BatchForm::Stride {
                    a: bk * bk,
                    b: bn * bk,
                }),
            tile,
        )?;
        // R^T blocks: [K/bk][g*Kp/bk][bk][bk] (FC wt layout of R).
        let rt_desc = Descriptor::new(bk, bn, bk)
            .prefetch(pf)
            .batch_form(BatchForm::Stride {
                a: bk * bk,
                b: bn * bk,
            });
        Ok(Rnn {
            kind,
            t,
            n,
            c,
            k,
            fwd_nest: step_nest("fwd", &tn.fwd, 1)?,
            bwd_nest: step_nest("bwd", &tn.bwd, 2)?,
            tuning: tn,
            input,
            recur,
            rec_kernel,
            rec_t_kernel: plan_kernel(&rt_desc.beta(Beta::One), tile)?,
            rec_t_kernel0: plan_kernel(&rt_desc, tile)?,
        })
    }

    /// The blocking and specs in use.
    pub fn tuning(&self) -> &RnnTuning {
        &self.tuning
    }
    /// N rounded up to the minibatch block: rows per step.
    pub fn padded_n(&self) -> usize {
        self.n.div_ceil(self.tuning.bn) * self.tuning.bn
    }
    /// K rounded up to the hidden block.
    pub fn padded_k(&self) -> usize {
        self.k.div_ceil(self.tuning.bk) * self.tuning.bk
    }
    /// Length of the bias (`g * Kp`).
    pub fn bias_len(&self) -> usize {
        self.kind.gates() * self.padded_k()
    }
    /// Floating-point operations of the forward pass (the GEMMs).
    pub fn flops(&self) -> f64 {
        2.0 * (self.t * self.n * self.kind.gates() * self.k * (self.c + self.k)) as f64
    }
    fn check(&self, what: &str, b: &Blocked, want: Shape) -> Result<()> {
        check_shape(what, b, want)
    }
    /// Shape of the stacked recurrent weights R.
    fn r_shape(&self) -> Shape {
        (
            self.bias_len(),
            self.k,
            self.tuning.bk,
            self.tuning.bk,
            Inner::ColMajor,
        )
    }
    /// Shape of a sequence buffer of `cols` columns in blocks of `bc`.
    fn seq_shape(&self, rows_steps: usize, cols: usize, bc: usize) -> Shape {
        (
            rows_steps * self.padded_n(),
            cols,
            self.tuning.bn,
            bc,
            Inner::RowMajor,
        )
    }

    /// Runs the whole sequence: `st.h` receives h_1..h_T. `h0`/`c0` are the
    /// initial states (zero when `None`; `c0` is ignored by the RNN).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        pool: &Pool,
        x: &Blocked,
        w: &Blocked,
        r: &Blocked,
        bias: &[f32],
        h0: Option<&Blocked>,
        c0: Option<&Blocked>,
        st: &mut RnnState,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("R", r, self.r_shape())?;
        self.check_forward(x, h0, c0, st)?;
        // Input projection of all steps at once (checks W, bias, gates).
        self.input.forward(pool, x, w, bias, &mut st.gates, None)?;
        let rec = Recurrent {
            kernel: &self.rec_kernel,
            kernel0: &self.rec_kernel,
            w: r.blocks(),
            b16: None,
        };
        self.steps_forward(pool, rec, h0, c0, st)
    }

    /// The checks of a forward: X, R, the state and the initial states.
    fn check_forward(
        &self,
        x: &Blocked,
        h0: Option<&Blocked>,
        c0: Option<&Blocked>,
        st: &RnnState,
    ) -> Result<()> {
        self.check("X", x, self.seq_shape(self.t, self.c, self.tuning.bc))?;
        self.check(
            "state h",
            &st.h,
            self.seq_shape(self.t, self.k, self.tuning.bk),
        )?;
        self.check(
            "state h_prev",
            &st.h_prev,
            self.seq_shape(self.t, self.k, self.tuning.bk),
        )?;
        for (what, s) in [("h0", h0), ("c0", c0)] {
            if let Some(s) = s {
                self.check(what, s, self.seq_shape(1, self.k, self.tuning.bk))?;
            }
        }
        if self.kind == CellKind::Lstm {
            self.check(
                "state c",
                &st.c,
                self.seq_shape(self.t + 1, self.k, self.tuning.bk),
            )?;
        }
        Ok(())
    }

    /// The steps of forward, after the input projection filled `st.gates`:
    /// per step the recurrent BRGEMMs on `rec` and the cell.
    fn steps_forward<T: Element>(
        &self,
        pool: &Pool,
        rec: Recurrent<'_, T>,
        h0: Option<&Blocked>,
        c0: Option<&Blocked>,
        st: &mut RnnState,
    ) -> Result<()> {
        let tn = &self.tuning;
        let (bn, bk) = (tn.bn, tn.bk);
        let (nb, kb) = (self.padded_n() / bn, self.padded_k() / bk);
        let step_len = nb * kb * bn * bk;
        // h_prev[0] = h0, c[0] = c0.
        match h0 {
            Some(h) => st.h_prev.data[..step_len].copy_from_slice(&h.data),
            None => st.h_prev.data[..step_len].fill(0.0),
        }
        if let Some(hb) = rec.b16 {
            // SAFETY: the bf16 copy has h_prev's layout (its owner sized it).
            let out = unsafe { hb.slice([0, 0], step_len) };
            round_slice(out, &st.h_prev.data[..step_len]);
        }
        if self.kind == CellKind::Lstm {
            match c0 {
                Some(c) => st.c.data[..step_len].copy_from_slice(&c.data),
                None => st.c.data[..step_len].fill(0.0),
            }
        }
        let g = self.kind.gates();
        let (rv, hpv) = (rec.w, st.h_prev.blocks_mut());
        let (gv, hv, cv) = (st.gates.blocks_mut(), st.h.blocks_mut(), st.c.blocks_mut());
        let blk = bn * bk;
        let nest = &self.fwd_nest;
        // The next call is looked up only for kernels that prefetch it.
        let pf = rec.kernel.descriptor().prefetch != brgemm::Prefetch::None;
        // The B operand of a step: h_prev itself, or its bf16 copy.
        let h_b = |row: usize| match rec.b16 {
            Some(hb) => hb.at([row, 0]) as *const T,
            None => hpv.at([row, 0]) as *const T,
        };
        nest.run(pool, |i| {
            let (ni, ki, t) = (i[0], i[1], i[2]);
            let row = t * nb + ni;
            // R block-row of gate j for hidden block ki; with prefetching
            // kernels (R streaming from memory) the next call's comes in
            // meanwhile: the next gate's, then the next item's first.
            let r_row = |j: usize, ki: usize| rv.at([j * kb + ki, 0]);
            let next_item = pf
                .then(|| nest.successor(i))
                .flatten()
                .map(|n| n[1])
                .filter(|&k| k != ki);
            // SAFETY: all offsets are inside buffers whose shapes were
            // checked; the (step, n block, k block) blocks of gates, h,
            // h_prev[t+1] and c[t+1] are written by this item only, and
            // h_prev[t] (read by every item) was finished by the
            // previous step (the steps loop is ordered: a barrier
            // separates steps).
            unsafe {
                let gate = |j: usize| gv.slice([row, j * kb + ki], blk);
                for j in 0..g {
                    let next = match (j + 1 < g, next_item) {
                        (true, _) => r_row(j + 1, ki),
                        (false, Some(k)) => r_row(0, k),
                        (false, None) => std::ptr::null(),
                    };
                    rec.kernel.execute_raw_ahead(
                        RawBatch::Stride {
                            a: r_row(j, ki),
                            b: h_b(row),
                            count: kb,
                        },
                        gv.at([row, j * kb + ki]),
                        std::ptr::null(),
                        next as *const f32,
                        kb * bk * bk,
                    );
                }
                let hout = hv.slice([row, ki], blk);
                match self.kind {
                    CellKind::Rnn => cell::rnn_fwd(gate(0), hout),
                    CellKind::Lstm => {
                        let (cprev, cnew) =
                            (cv.slice([row, ki], blk), cv.slice([row + nb, ki], blk));
                        cell::lstm_fwd(gate(0), gate(1), gate(2), gate(3), cprev, cnew, hout);
                    }
                }
                // Hidden padding stays zero by itself: zero weight
                // rows and bias there give G = 0, so c = f*0 + i*tanh(0)
                // = 0 and h = o*tanh(0) = 0 (RNN: tanh(0) = 0).
                if t + 1 < self.t {
                    hpv.slice([row + nb, ki], blk).copy_from_slice(hout);
                    if let Some(hb) = rec.b16 {
                        round_slice(hb.slice([row + nb, ki], blk), hout);
                    }
                }
            }
        });
        Ok(())
    }

    /// Backpropagation through time of the last [`Rnn::forward`] (whose
    /// state is `st`) for the output gradient `dh` (`T*Np x K`, dL/dh_t of
    /// every step; zero where the loss does not read h_t), with `dc_t`
    /// flowing only through the recurrence. Writes every gradient of `gr`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        pool: &Pool,
        dh: &Blocked,
        x: &Blocked,
        w: &Blocked,
        r: &Blocked,
        st: &RnnState,
        gr: &mut RnnGrads,
    ) -> Result<()> {
        self.backward_from_state(pool, dh, None, x, w, r, st, gr)
    }

    /// [`Rnn::backward`] with a gradient `dc_last` (`Np x K`, a
    /// [`Rnn::state_layout`]) for the final cell state c_T, which a later
    /// layer read (an encoder's state handed to a decoder); LSTM only.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_from_state(
        &self,
        pool: &Pool,
        dh: &Blocked,
        dc_last: Option<&Blocked>,
        x: &Blocked,
        w: &Blocked,
        r: &Blocked,
        st: &RnnState,
        gr: &mut RnnGrads,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("R", r, self.r_shape())?;
        self.check_backward(dh, dc_last, x, st, gr)?;
        self.recur.transpose_weights(pool, r, &mut gr.rt)?;
        let rec = Recurrent {
            kernel: &self.rec_t_kernel,
            kernel0: &self.rec_t_kernel0,
            w: gr.rt.blocks(),
            b16: None,
        };
        self.bptt(pool, rec, dh, dc_last, st, gr);
        // Reductions over all steps at once.
        self.input.transpose_weights(pool, w, &mut gr.wt)?;
        self.input
            .backward_data_wt(pool, &gr.dg, &gr.wt, &mut gr.dx)?;
        self.weight_grads(pool, x, st, gr)
    }

    /// dW = dG^T X, db, and dR = dG^T H_prev over all steps at once.
    fn weight_grads(
        &self,
        pool: &Pool,
        x: &Blocked,
        st: &RnnState,
        gr: &mut RnnGrads,
    ) -> Result<()> {
        self.input
            .backward_weights(pool, &gr.dg, x, &mut gr.dw, &mut gr.db)?;
        // The recurrent FC's bias gradient equals db: written to scratch.
        self.recur
            .backward_weights(pool, &gr.dg, &st.h_prev, &mut gr.dr, &mut gr.db_r)
    }

    /// The checks of a backward.
    fn check_backward(
        &self,
        dh: &Blocked,
        dc_last: Option<&Blocked>,
        x: &Blocked,
        st: &RnnState,
        gr: &RnnGrads,
    ) -> Result<()> {
        if let Some(dc) = dc_last {
            if self.kind != CellKind::Lstm {
                return Err(shape("dc_T", "given", "a tanh RNN has no cell state"));
            }
            self.check("dc_T", dc, self.seq_shape(1, self.k, self.tuning.bk))?;
        }
        self.check("dH", dh, self.seq_shape(self.t, self.k, self.tuning.bk))?;
        self.check("X", x, self.seq_shape(self.t, self.c, self.tuning.bc))?;
        self.check(
            "gradient dh scratch",
            &gr.dh,
            self.seq_shape(self.t, self.k, self.tuning.bk),
        )?;
        self.check("dh0", &gr.dh0, self.seq_shape(1, self.k, self.tuning.bk))?;
        self.check("dc0", &gr.dc0, self.seq_shape(1, self.k, self.tuning.bk))?;
        self.check(
            "gates",
            &st.gates,
            self.seq_shape(self.t, self.bias_len(), self.tuning.bk),
        )
    }

    /// Backward through time (shapes checked): dG of every step into
    /// `gr.dg` (and its bf16 copy in `rec.b16`), dh_0 and dc_0.
    fn bptt<T: Element>(
        &self,
        pool: &Pool,
        rec: Recurrent<'_, T>,
        dh: &Blocked,
        dc_last: Option<&Blocked>,
        st: &RnnState,
        gr: &mut RnnGrads,
    ) {
        gr.dh.data.copy_from_slice(&dh.data);
        let tn = &self.tuning;
        let (bn, bk) = (tn.bn, tn.bk);
        let (nb, kb) = (self.padded_n() / bn, self.padded_k() / bk);
        let gkb = self.kind.gates() * kb;
        let blk = bn * bk;
        // dc of the step being processed: dc0 doubles as the running buffer,
        // starting from dL/dc_T.
        match dc_last {
            Some(dc) => gr.dc0.data.copy_from_slice(&dc.data),
            None => gr.dc0.data.fill(0.0),
        }
        let (dgv, dhv, dcv) = (gr.dg.blocks_mut(), gr.dh.blocks_mut(), gr.dc0.blocks_mut());
        let (dh0v, rtv) = (gr.dh0.blocks_mut(), rec.w);
        let (gt, cs) = (st.gates.blocks(), st.c.blocks());
        let nest = &self.bwd_nest;
        let pf = rec.kernel.descriptor().prefetch != brgemm::Prefetch::None;
        // Steps from the last; per step two ordered phases over the
        // (n block, k block) items.
        nest.run(pool, |i| {
            let (ni, ki, t) = (i[0], i[1], self.t - 1 - i[2]);
            let row = t * nb + ni;
            if i[3] == 0 {
                // Gate gradients of step t, block by block.
                // SAFETY: shapes checked above; each (n block, k block) of
                // dG[t], dc and dh[t] belongs to this item.
                unsafe {
                    let kept = |v: View<2>, r: usize, j: usize| {
                        std::slice::from_raw_parts(v.at([r, j * kb + ki]), blk)
                    };
                    let dgate = |j: usize| dgv.slice([row, j * kb + ki], blk);
                    let dht = &*dhv.slice([row, ki], blk);
                    match self.kind {
                        CellKind::Rnn => cell::rnn_bwd(kept(gt, row, 0), dht, dgate(0)),
                        CellKind::Lstm => {
                            let kept = cell::LstmKept {
                                gi: kept(gt, row, 0),
                                gf: kept(gt, row, 1),
                                gc: kept(gt, row, 2),
                                go: kept(gt, row, 3),
                                cnow: kept(cs, row + nb, 0),
                                cprev: kept(cs, row, 0),
                            };
                            let mut grads = cell::LstmGateGrads {
                                di: dgate(0),
                                df: dgate(1),
                                dc: dgate(2),
                                dout: dgate(3),
                            };
                            cell::lstm_bwd(&kept, dht, dcv.slice([ni, ki], blk), &mut grads);
                        }
                    }
                    if let Some(db16) = rec.b16 {
                        for j in 0..self.kind.gates() {
                            let at = [row, j * kb + ki];
                            round_slice(db16.slice(at, blk), dgv.slice(at, blk));
                        }
                    }
                }
            } else {
                // dh_(t-1) += R^T dG_t (dh_0 for t = 0), block by block; the
                // next item's R^T row comes in meanwhile (prefetching kernels
                // only; see forward).
                let next = pf
                    .then(|| nest.successor(i))
                    .flatten()
                    .filter(|n| n[3] == 1 && n[1] != ki)
                    .map_or(std::ptr::null(), |n| rtv.at([n[1], 0]));
                let batch = RawBatch::Stride {
                    a: rtv.at([ki, 0]),
                    b: match rec.b16 {
                        Some(v) => v.at([row, 0]) as *const T,
                        None => dgv.at([row, 0]) as *const T,
                    },
                    count: gkb,
                };
                let (kernel, out) = if t > 0 {
                    (rec.kernel, dhv.at([row - nb, ki]))
                } else {
                    (rec.kernel0, dh0v.at([ni, ki]))
                };
                // SAFETY: as above; the (n block, hidden block) of
                // dh[t-1] / dh0 belongs to this item, dG[t] is complete.
                unsafe {
                    kernel.execute_raw_ahead(
                        batch,
                        out,
                        std::ptr::null(),
                        next as *const f32,
                        gkb * bk * bk,
                    )
                };
            }
        });
    }
}
