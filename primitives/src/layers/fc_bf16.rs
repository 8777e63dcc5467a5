//! Mixed-precision FC passes: forward and backward-data with bf16 operands
//! on the bf16 BRGEMM (AMX tiles where the blocks bk and bc are multiples of 32, else
//! AVX512-BF16, else the reference), f32 accumulation and f32 outputs.
//!
//! The f32 weights stay the master copy (the optimizer updates them); each
//! step packs them once into the VNNI layout the bf16 kernel reads for A
//! (pairs along k: `[K/bk][C/bc][bc/2][bk][2]` for forward, and the
//! transposed `[C/bc][K/bk][bk/2][bc][2]` for backward-data), rounding to
//! nearest even: in a pass of its own ([`FcBf16::pack_weights`]), or block
//! by block inside the fused optimizer step
//! ([`FcBf16::backward_weights_step`]). Activations and output gradients are rounded to bf16 in
//! their blocked layouts (B operands keep the f32 kernel's layout). The
//! weight gradient stays an f32 BRGEMM on the f32 activations: its sums run
//! over the whole minibatch, where bf16 inputs would cost accuracy for
//! little time (it is one of three passes).

use crate::engine::bf16::{
    fit_weights, interleave_round, pack_block, pack_vnni, transpose_round, Twin, WeightGrid,
};
use crate::error::{shape, Result};
use crate::fc::Fc;
use crate::layout::{check_shape, Blocked, Inner, SyncPtr};
use crate::loops::{LoopDef, LoopNest};
use crate::pass::{streams_weights, Chunked};
use crate::threads::Pool;
use brgemm::bf16::{bf16, Bf16Isa};
use brgemm::Kernel;
use brgemm::{
    Activation, AlignedVec, BatchForm, DataType, Descriptor, Epilogue, Prefetch, RawBatch,
};
use std::sync::Mutex;

/// The bf16 forward and backward-data of an [`Fc`] layer.
pub struct FcBf16 {
    fwd: Chunked,
    bwd: Chunked,
    /// Reduction blocks per forward and backward-data call
    /// ([`stream_chunk`]).
    fwd_chunk: usize,
    bwd_chunk: usize,
    /// Backward-weights: one call per (K block, C block) over every row.
    upd: Kernel,
    /// dZ as VNNI pairs of rows (per K block) and X channel-major (per C
    /// block), made by each backward-weights call.
    dzv: Mutex<AlignedVec<bf16>>,
    xt: Mutex<AlignedVec<bf16>>,
    n: usize,
    c: usize,
    /// Whether backward-weights runs on the bf16 kernel; else the f32 pass
    /// runs on the same f32 operands (the CPU policy's
    /// [`brgemm::Bf16UpdRule`]).
    upd_bf16: bool,
    /// Whether the fused step ([`FcBf16::backward_weights_step`]) runs
    /// the bf16 kernel: as `upd_bf16`, but with no dW stored.
    step_bf16: bool,
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

/// Rows of the backward-weights reduction: the N blocks' rows rounded up
/// to `step` (zero rows past N).
fn upd_rows(nb: usize, bn: usize, step: usize) -> usize {
    (nb * bn).next_multiple_of(step)
}

/// Whether the kernels of a pass whose calls each reduce over `red`
/// elements, with `bn` columns and `bo` rows of output, prefetch the next
/// pair: above the CPU policy's per-call size (docs/tuning-notes.md).
fn bf16_prefetch(red: usize, bn: usize, bo: usize) -> Prefetch {
    let from = crate::policy().bf16_prefetch_from;
    brgemm::Policy::prefetch_if(from.is_some_and(|f| 2 * red * (bn + bo) > f))
}

/// Pairs per call of the forward and backward-data passes, `nb` N blocks
/// of `bn` rows by `out` output blocks, each reducing over `red` weight
/// blocks: as the f32 forward ([`crate::PassConfig::heuristic_stream`]),
/// weights that stream from memory go in the policy's chunks, else the
/// whole reduction per call. A 16-row call of 64-row output blocks re-reads
/// its chunk of W for its second column step of tiles, which waits on
/// memory with long chunks (docs/tuning-notes.md).
fn stream_chunk(nb: usize, out: usize, red: usize, bn: usize) -> usize {
    if streams_weights(nb, out, red) {
        crate::policy().stream_chunk_for(bn)
    } else {
        red
    }
}

/// One output block: `c` = the reduction of `n` pairs (A_i = `a + i *
/// sa`, B_i = `b + i * sb`) in calls of `chunk` pairs, the first
/// overwriting C, the last applying the epilogue (with `bias`).
///
/// # Safety
/// As [`Kernel::execute_raw`] for the whole batch, every chunk in turn.
unsafe fn run_chunks(
    k: &Chunked,
    chunk: usize,
    [a, b]: [*const bf16; 2],
    [sa, sb, n]: [usize; 3],
    c: *mut f32,
    bias: *const f32,
) {
    let mut i = 0;
    while i < n {
        let count = chunk.min(n - i);
        let batch = RawBatch::Stride {
            a: a.add(i * sa),
            b: b.add(i * sb),
            count,
        };
        k.pick(i == 0, i + count == n).execute_raw(batch, c, bias);
        i += count;
    }
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
        let fwd = Chunked::new(
            Descriptor::new(bk, bn, bc)
                .dtype(DataType::Bf16)
                .prefetch(bf16_prefetch(cb * bc, bn, bk))
                .batch_form(BatchForm::Stride {
                    a: bc * bk,
                    b: bn * bc,
                }),
            Epilogue {
                bias: true,
                activation: fc.act,
            },
        )?;
        let bwd = Chunked::new(
            Descriptor::new(bc, bn, bk)
                .dtype(DataType::Bf16)
                .prefetch(bf16_prefetch(kb * bk, bn, bc))
                .batch_form(BatchForm::Stride {
                    a: bc * bk,
                    b: bn * bk,
                }),
            Epilogue::default(),
        )?;
        // dW block (bk x bc) = dZ block-column^T X block-column over all
        // rows: A = dZ with pairs of rows interleaved (k = rows), B = X^T.
        // Rows rounded up to AMX's k step (32) where AMX takes the plan;
        // other kernels need only pairs (at 16 rows, 32 doubled the
        // AVX512-BF16 kernel's work; on Zen 4 the pass's time hardly moved,
        // its dW stores being the cost: see `Bf16UpdRule`).
        let upd_desc = |rows_pad| {
            Descriptor::new(bk, bc, rows_pad)
                .dtype(DataType::Bf16)
                .ldb(rows_pad)
                .batch_form(BatchForm::Stride {
                    a: rows_pad * bk,
                    b: rows_pad * bc,
                })
        };
        let mut upd = Kernel::new(&upd_desc(upd_rows(nb, bn, 32)))?;
        if upd.bf16_isa() != Some(Bf16Isa::Amx) {
            upd = Kernel::new(&upd_desc(upd_rows(nb, bn, 2)))?;
        }
        // Rounded: X transposed (counted twice) and dZ, per row.
        let per_row = (2 * cb * bc + kb * bk) as f64;
        // The pass stores dW whole; the fused step keeps each block in L1.
        let pays = |dw_bytes| {
            upd.bf16_isa().is_some_and(|isa| {
                let flops = 2.0 * (cb * bc * kb * bk) as f64;
                crate::policy().bf16_upd_pays(isa, fc.n, flops / per_row, dw_bytes)
            })
        };
        let upd_bf16 = pays(4 * cb * bc * kb * bk);
        let step_bf16 = pays(0);
        let nest = |a, b| {
            LoopNest::new(
                vec![LoopDef::new("N blocks", nb, 1), LoopDef::new(a, b, 1)],
                "BA",
            )
        };
        let buf = || Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN));
        Ok(FcBf16 {
            fwd,
            bwd,
            fwd_chunk: stream_chunk(nb, kb, cb, bn),
            bwd_chunk: stream_chunk(nb, cb, kb, bn),
            upd,
            upd_bf16,
            step_bf16,
            dzv: buf(),
            xt: buf(),
            n: fc.n,
            c: fc.c,
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
        self.fwd
            .pick(true, true)
            .bf16_isa()
            .expect("planned with a bf16 descriptor")
    }

    /// Whether this layer on bf16, its weights packed every step, beats the
    /// f32 layer on this CPU ([`brgemm::Policy::bf16_fc_pays`] at its
    /// minibatch rows): with `fused_step`, where the step is
    /// [`FcBf16::backward_weights_step`] (which packs each block as it
    /// steps it), else [`FcBf16::pack_weights`] and a separate step. A
    /// mixed-precision network keeps the layers where this is false in f32.
    pub fn pays(&self, fused_step: bool) -> bool {
        crate::policy().bf16_fc_pays(self.isa(), self.n, fused_step)
    }

    /// The bf16 kernel of backward-weights, or None where that pass runs
    /// in f32 because bf16 would not pay on this CPU (the policy's
    /// [`brgemm::Bf16UpdRule`]: on AVX512-BF16, minibatches under 32 rows,
    /// where storing the f32 dW blocks is the pass's cost).
    pub fn upd_isa(&self) -> Option<Bf16Isa> {
        self.upd.bf16_isa().filter(|_| self.upd_bf16)
    }

    /// The bf16 kernel of the fused step ([`FcBf16::backward_weights_step`]),
    /// or None where it runs the f32 pass. It can run bf16 where
    /// backward-weights does not: the step keeps each dW block in L1, so
    /// the rule's streamed-dW limit does not apply (measured in
    /// `docs/tuning-notes.md`, `avx512bf16_fc_min_rows`).
    pub fn step_isa(&self) -> Option<Bf16Isa> {
        self.upd.bf16_isa().filter(|_| self.step_bf16)
    }

    /// An error unless `fc` is the layer this plan was made for.
    fn check_fc(&self, fc: &Fc) -> Result<()> {
        let t = fc.tuning();
        let ours = (self.n, self.c, self.k, self.bn, self.bc, self.bk);
        let theirs = (fc.n, fc.c, fc.k, t.bn, t.bc, t.bk);
        if ours != theirs {
            return Err(shape(
                "fc",
                format!("{theirs:?}"),
                format!("the (n, c, k, bn, bc, bk) of this bf16 plan, {ours:?}"),
            ));
        }
        Ok(())
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
    /// rounded by [`to_bf16`], or handed over by the layer before) and
    /// packed weights; `y` in `fc.y_layout`. With `yb` (of Y's length), Y
    /// is also written rounded to bf16 there, block by block as the kernel
    /// leaves it in L1: the next bf16 layer's input without a rounding
    /// sweep.
    pub fn forward(
        &self,
        pool: &Pool,
        x: &[bf16],
        wv: &[bf16],
        bias: &[f32],
        y: &mut Blocked,
        yb: Option<&mut [bf16]>,
    ) -> Result<()> {
        let pool = pool.for_work(self.work());
        let (bn, bc, bk, nb, cb, kb) = (self.bn, self.bc, self.bk, self.nb, self.cb, self.kb);
        let yb = Twin::new("bf16 Y", yb, y.data.len())?;
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
        // The padding columns of a K tail hold act(0): zeroed, as the
        // next layer's padding rows must be.
        let tail =
            (!self.k.is_multiple_of(bk) && self.act.apply(0.0) != 0.0).then_some(self.k % bk);
        self.nest_fwd.run(pool, |i| {
            let (ni, ki) = (i[0], i[1]);
            let at = (ni * kb + ki) * bn * bk;
            // SAFETY: lengths checked above; block (ni, ki) of Y (and of
            // its bf16 copy) belongs to this item.
            unsafe {
                run_chunks(
                    &self.fwd,
                    self.fwd_chunk,
                    [
                        (wp as *const bf16).add(ki * cb * bc * bk),
                        (xp as *const bf16).add(ni * cb * bn * bc),
                    ],
                    [bc * bk, bn * bc, cb],
                    yp.get().add(at),
                    (bp as *const f32).add(ki * bk),
                );
                let blk = std::slice::from_raw_parts_mut(yp.get().add(at), bn * bk);
                if let Some(t) = tail.filter(|_| ki == kb - 1) {
                    blk.chunks_exact_mut(bk).for_each(|row| row[t..].fill(0.0));
                }
                yb.round(at, blk);
            };
        });
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
                run_chunks(
                    &self.bwd,
                    self.bwd_chunk,
                    [
                        (wp as *const bf16).add(ci * kb * bc * bk),
                        (dzp as *const bf16).add(ni * kb * bn * bk),
                    ],
                    [bc * bk, bn * bk, kb],
                    dxp.get().add((ni * cb + ci) * bn * bc),
                    std::ptr::null(),
                )
            };
        });
        Ok(())
    }

    /// dW = dZ^T X and db = the column sums of dZ from the f32 dZ
    /// (`fc.y_layout`) and X (`fc.x_layout`), on bf16 operands with f32
    /// accumulation; `dw` in `fc.w_layout`, overwritten. Each call rounds
    /// dZ into VNNI pairs of rows (summing db in the same read) and X into
    /// channel-major rows, then one BRGEMM per (K block, C block) reduces
    /// over every row at once. Where [`FcBf16::upd_isa`] is None, `fc`'s
    /// f32 pass runs instead, on the same operands.
    pub fn backward_weights(
        &self,
        pool: &Pool,
        fc: &Fc,
        dz: &Blocked,
        x: &Blocked,
        dw: &mut Blocked,
        db: &mut [f32],
    ) -> Result<()> {
        self.check_fc(fc)?;
        if !self.upd_bf16 {
            return fc.backward_weights(pool, dz, x, dw, db);
        }
        let pool = pool.for_work(self.work());
        check_shape(
            "dW",
            dw,
            (self.k, self.c, self.bk, self.bc, Inner::ColMajor),
        )?;
        let (dzv, xt) = self.round_upd_operands(pool, dz, x, db)?;
        let wp = SyncPtr(dw.data.as_mut_ptr());
        pool.for_each(self.kb * self.cb, |item| {
            // SAFETY: dW block `item` belongs to this item.
            unsafe { self.upd_block(&dzv, &xt, item, wp.get().add(item * self.bc * self.bk)) };
        });
        Ok(())
    }

    /// [`FcBf16::backward_weights`] with the optimizer step and the packing
    /// of the next step's bf16 weights fused in: each dW block goes from the
    /// kernel to a per-thread L1 block, `opt` updates W's block (and its
    /// moments in `state`) from it, and the updated block is rounded into
    /// its places in `wv` and `wtv` ([`FcBf16::pack_weights`]'s layouts)
    /// while it is in L1. So dW never goes to memory, and W is read once
    /// per step instead of twice (step, then packing). db is written as by
    /// `backward_weights`. Where the step's kernel is f32
    /// ([`FcBf16::step_isa`] None), [`Fc::backward_weights_step`] runs,
    /// packing each block it steps the same way.
    ///
    /// Not for data-parallel training, where gradients must be all-reduced
    /// before any step.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_weights_step(
        &self,
        pool: &Pool,
        fc: &Fc,
        dz: &Blocked,
        x: &Blocked,
        w: &mut Blocked,
        db: &mut [f32],
        opt: &crate::optim::Optimizer,
        state: &mut crate::optim::OptState,
        packed: (&mut AlignedVec<bf16>, &mut AlignedVec<bf16>),
    ) -> Result<()> {
        self.check_fc(fc)?;
        opt.validate()?;
        let (wv, wtv) = packed;
        check_shape("W", w, (self.k, self.c, self.bk, self.bc, Inner::ColMajor))?;
        let (bc, bk, cb, kb) = (self.bc, self.bk, self.cb, self.kb);
        let blk = bc * bk;
        fit_weights(wv, w.data.len());
        fit_weights(wtv, w.data.len());
        let (pv, pt) = (SyncPtr(wv.as_mut_ptr()), SyncPtr(wtv.as_mut_ptr()));
        // Rounds stepped W block (ki, ci), in L1, into its forward VNNI
        // block and its transposed block (ci, ki).
        let pack = |ki: usize, ci: usize, wb: &[f32]| {
            // SAFETY: each W block is stepped, and so handed here, once per
            // call, by one thread: its two packed blocks are that thread's;
            // wtv's block starts a multiple of blk (even) elements into a
            // 64-byte aligned buffer.
            unsafe {
                let dv = std::slice::from_raw_parts_mut(pv.get().add((ki * cb + ci) * blk), blk);
                let dt = std::slice::from_raw_parts_mut(pt.get().add((ci * kb + ki) * blk), blk);
                pack_block(wb, bc, bk, dv, dt);
            }
        };
        if !self.step_bf16 {
            // The f32 pass and step, each block packed as it leaves the
            // step: a separate packing pass re-read all of W.
            return fc.step_blocks(pool, dz, x, w, db, opt, state, &pack);
        }
        let pool = pool.for_work(self.work());
        let (dzv, xt) = self.round_upd_operands(pool, dz, x, db)?;
        let rule = state.begin(opt, w.data.len());
        let wp = SyncPtr(w.data.as_mut_ptr());
        pool.for_each(kb * cb, |item| {
            let g = crate::pass::thread_block(blk);
            // SAFETY: W block `item` (and its moments) belongs to this item;
            // the thread's gradient block `g` is its own (blk floats).
            let wb = unsafe {
                self.upd_block(&dzv, &xt, item, g);
                let wb = std::slice::from_raw_parts_mut(wp.get().add(item * blk), blk);
                rule.apply(item * blk, wb, std::slice::from_raw_parts(g, blk));
                wb
            };
            pack(item / cb, item % cb, wb);
        });
        Ok(())
    }

    /// Backward-weights' operands: dZ rounded into VNNI pairs of rows per
    /// K block (db, the column sums of dZ, taken in the same read) and X
    /// rounded into channel-major rows per C block.
    #[allow(clippy::type_complexity)]
    fn round_upd_operands(
        &self,
        pool: &Pool,
        dz: &Blocked,
        x: &Blocked,
        db: &mut [f32],
    ) -> Result<(
        std::sync::MutexGuard<'_, AlignedVec<bf16>>,
        std::sync::MutexGuard<'_, AlignedVec<bf16>>,
    )> {
        let (bn, bc, bk, nb, cb, kb) = (self.bn, self.bc, self.bk, self.nb, self.cb, self.kb);
        check_shape("dZ", dz, (self.n, self.k, bn, bk, Inner::RowMajor))?;
        check_shape("X", x, (self.n, self.c, bn, bc, Inner::RowMajor))?;
        crate::error::check_buf("db", db.len(), kb * bk)?;
        let (rows, kp) = (nb * bn, self.upd.descriptor().k);
        let mut dzv = self.dzv.lock().unwrap_or_else(|e| e.into_inner());
        let mut xt = self.xt.lock().unwrap_or_else(|e| e.into_inner());
        dzv.resize(kb * kp * bk, bf16::ZERO);
        xt.resize(cb * bc * kp, bf16::ZERO);
        let zero = vec![0.0f32; bk];
        let (dp, dbp) = (SyncPtr(dzv.as_mut_ptr()), SyncPtr(db.as_mut_ptr()));
        pool.for_each(kb, |ki| {
            // SAFETY: K block ki's pairs and its db block belong to this
            // iteration alone.
            let (out, sums) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dp.get().add(ki * kp * bk), kp * bk),
                    std::slice::from_raw_parts_mut(dbp.get().add(ki * bk), bk),
                )
            };
            sums.fill(0.0);
            let row = |r: usize| match r < rows {
                true => &dz.data[((r / bn) * kb + ki) * bn * bk + (r % bn) * bk..][..bk],
                false => &zero[..],
            };
            for (p, pair) in out.chunks_exact_mut(2 * bk).enumerate() {
                interleave_round(pair, row(2 * p), row(2 * p + 1), sums);
            }
        });
        let xp = SyncPtr(xt.as_mut_ptr());
        pool.for_each(cb, |ci| {
            // SAFETY: C block ci's rows belong to this iteration alone.
            let out =
                unsafe { std::slice::from_raw_parts_mut(xp.get().add(ci * bc * kp), bc * kp) };
            for ni in 0..nb {
                let src = &x.data[(ni * cb + ci) * bn * bc..][..bn * bc];
                transpose_round(&mut out[ni * bn..], kp, src, bc, bn, 1);
            }
            for ch in out.chunks_exact_mut(kp) {
                ch[rows..].fill(bf16::ZERO);
            }
        });
        Ok((dzv, xt))
    }

    /// The dW block of `item` (K block `item / cb`, C block `item % cb`)
    /// into `c` (`bk x bc`, column-major), from the rounded operands.
    ///
    /// # Safety
    /// `c` is valid for `bk * bc` floats written by this thread alone;
    /// `dzv` and `xt` were made by [`FcBf16::round_upd_operands`].
    unsafe fn upd_block(&self, dzv: &[bf16], xt: &[bf16], item: usize, c: *mut f32) {
        let (ki, ci) = (item / self.cb, item % self.cb);
        let kp = self.upd.descriptor().k;
        self.upd.execute_raw(
            RawBatch::Stride {
                a: dzv.as_ptr().add(ki * kp * self.bk),
                b: xt.as_ptr().add(ci * self.bc * kp),
                count: 1,
            },
            c,
            std::ptr::null(),
        )
    }
}
