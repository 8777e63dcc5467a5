//! Fully-connected layer: forward, backward-data and backward-weights as
//! loop nests around BRGEMM.
//!
//! Shapes: X `[N][C]`, W `[K][C]`, Y = act(X W^T + b) `[N][K]`, in the blocked
//! layouts of [`crate::layout`]. Every pass is a nest over the same three
//! loops, `a` = N blocks, `b` = K blocks, `c` = C blocks; each pass reduces
//! over one of them as the BRGEMM batch (`chunk` blocks per call; the
//! default, 0, means all of them in one call so the output block is stored
//! once). The letters of every layer: `docs/loop-specs.md`.
//!
//! | pass | output loops | reduction | BRGEMM (m x n x k) | A_i | B_i | C |
//! |---|---|---|---|---|---|---|
//! | fwd | a, b | c | bk x bn x bc | `W[kb][cb]` | `X[nb][cb]` | `Y[nb][kb]` |
//! | bwd | a, c | b | bn x bc x bk | `dZt[nb][kb]` | `W[kb][cb]` | `dX[nb][cb]` (transposed) |
//! | bwd (`Wt`) | a, c | b | bc x bn x bk | `Wt[cb][kb]` | `dZ[nb][kb]` | `dX[nb][cb]` |
//! | upd | b, c | a | bk x bc x bn | `dZ[nb][kb]` | `X[nb][cb]` (row-major B) | `dW[kb][cb]` |
//!
//! Data reuse: one BRGEMM call streams a block-row of each operand. The
//! default order ([`PassConfig::heuristic`]) puts the output loop with more
//! blocks outside, so the operand of the inner loop is the smaller set of
//! block-rows and comes back from L2 for the next outer block; with more
//! than 8 reduction blocks the reduction is split into chunks of 8 and goes
//! outermost, so that set fits in L2 even for long reductions (the LSTM's
//! dW over all steps: x1.4; on cores that prefetch from L2 only with the
//! first output loop outside). Weights that stream from memory (one or two
//! N blocks, long block-rows) are read in chunks of 16 blocks with the
//! reduction innermost, each call prefetching the next call's (the engine
//! finds that call from the nest's order). upd's reduction runs over the
//! minibatch, inside each output block's calls, so every `dW[kb][cb]` is
//! owned by one thread: no races, no per-thread partial sums.
//!
//! Backward-data reads W where forward left it: the vector dimension of
//! its BRGEMM is the minibatch, so A is dZ with each block transposed
//! (`[bk][bn]`, O(NK) per step into a workspace) and each dX block comes
//! out transposed, turned round in L1 after its last call. The other
//! choice, vectors over C, needs W transposed (O(KC) per step, for N < C
//! the larger copy by C/N): [`Fc::backward_data_wt`] keeps it for callers
//! that reuse one transposed copy over many calls (the LSTM's steps).
//!
//! Both output loops are parallel, with the blocking of
//! [`FcTuning::heuristic`]. Any valid spec gives the same result (the tests
//! check every one).

use crate::act::mul_act_grad;
use crate::engine::bf16::Twin;
use crate::error::{check_buf, shape, Result};
use crate::layout::{check_shape, Blocked, Inner, Shape};
use crate::loops::LoopDef;
use crate::math::add_rows;
use crate::pass::{column_tile, pick_block, Ahead, Chunked, Operands, PassConfig, Reduction};
use crate::threads::Pool;
use crate::view::View;
use brgemm::bf16::bf16;
use brgemm::{Activation, BatchForm, Descriptor, Epilogue, Prefetch};
use brgemm::{Policy, StreamPrefetch};

/// Blocking and loop orders of an FC layer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FcTuning {
    /// Minibatch block (BRGEMM n in fwd/bwd, k in upd).
    pub bn: usize,
    /// Input-feature block.
    pub bc: usize,
    /// Output-feature block (BRGEMM m in fwd and upd).
    pub bk: usize,
    /// Forward.
    pub fwd: PassConfig,
    /// Backward-data.
    pub bwd: PassConfig,
    /// Backward-weights.
    pub upd: PassConfig,
}

impl FcTuning {
    /// The default: blocks of 64 where they divide the size (else 48, 32, 16;
    /// a size below 64 is one block; else 64 with zero padding). 64 rows of
    /// output (bk) are 4 AVX-512 vectors and feed the 2x12 register tile; 64
    /// columns (bn) keep a block's B panel and C tile in L1; 64-deep blocks
    /// (bc) make a BRGEMM batch element 16 KiB of weights. Loop orders from
    /// [`PassConfig::heuristic`] on each pass's block counts.
    pub fn heuristic(n: usize, c: usize, k: usize) -> FcTuning {
        let cands = [64, 48, 32, 16];
        let [bn, bc, bk] = [n, c, k].map(|d| pick_block(d, &cands));
        FcTuning::with_blocks(n, c, k, [bn, bc, bk])
    }

    /// Blocks `[bn, bc, bk]` with the heuristic's loop orders for them.
    fn with_blocks(n: usize, c: usize, k: usize, [bn, bc, bk]: [usize; 3]) -> FcTuning {
        let (nb, cb, kb) = (n.div_ceil(bn), c.div_ceil(bc), k.div_ceil(bk));
        let pol = crate::policy();
        FcTuning {
            bn,
            bc,
            bk,
            // Forward prefetches the next call's W chunk; narrow N blocks
            // want it a block at a time (docs/tuning-notes.md).
            fwd: PassConfig::heuristic_for(
                [('a', nb), ('b', kb)],
                ('c', cb),
                Some(pol.stream_chunk_for(bn)),
            ),
            // Tuned for `backward_data` (W in place, no next-call prefetch);
            // `backward_data_wt` at 16 rows would rather chunk (x0.88).
            bwd: PassConfig::heuristic_for([('a', nb), ('c', cb)], ('b', kb), None),
            upd: PassConfig::heuristic_for(
                [('b', kb), ('c', cb)],
                ('a', nb),
                Some(pol.stream_chunk),
            ),
        }
    }

    /// [`FcTuning::heuristic`] for layers that run the bf16 passes
    /// ([`crate::fc_bf16::FcBf16`]), which pair values along the reduction
    /// (VNNI): an odd feature block grows by one padded lane.
    pub fn heuristic_bf16(n: usize, c: usize, k: usize) -> FcTuning {
        let t = FcTuning::heuristic(n, c, k);
        FcTuning::with_blocks(n, c, k, [t.bn, t.bc + t.bc % 2, t.bk + t.bk % 2])
    }
}

/// A planned FC layer: shapes, blocking, loop nests and kernels. Buffers are
/// passed to each call (see [`Fc::x_layout`] and friends to allocate them).
pub struct Fc {
    /// Minibatch.
    pub(crate) n: usize,
    /// Input features.
    pub(crate) c: usize,
    /// Output features.
    pub(crate) k: usize,
    /// Activation after the bias.
    pub(crate) act: Activation,
    tuning: FcTuning,
    fwd: Reduction,
    fwd_pre: Option<Chunked>,
    bwd: Reduction,
    bwd_wt: Reduction,
    upd: Reduction,
}

impl std::fmt::Debug for Fc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fc")
            .field("n", &self.n)
            .field("c", &self.c)
            .field("k", &self.k)
            .field("act", &self.act)
            .field("tuning", &self.tuning)
            .finish()
    }
}

/// Whether the backward-weights kernels prefetch, each call bringing in the
/// next dW block (the next item of the default order) while it computes:
/// where the CPU policy says so, for a stream of dW stores (one or two N
/// blocks) larger than its threshold (docs/tuning-notes.md).
fn upd_prefetch(n: usize, c: usize, k: usize, t: &FcTuning) -> Prefetch {
    let from = crate::policy().fc_upd_prefetch_from;
    Policy::prefetch_if(from.is_some_and(|f| n.div_ceil(t.bn) <= 2 && 4 * k * c > f))
}

/// Whether the forward and backward-data kernels prefetch the next pair
/// (and the next call's weight block-row, see [`Fc::forward`]). Each call
/// reduces over a block-row of the weights and one of the activations,
/// re-read for every N block; where those come from decides
/// ([`brgemm::StreamPrefetch`]).
fn fc_prefetch(n: usize, c: usize, k: usize, t: &FcTuning) -> Prefetch {
    Policy::prefetch_if(match crate::policy().stream_prefetch {
        // Larger than L2 and re-read for at most two N blocks: streamed
        // from L3 (else reused from L2, where prefetching costs).
        StreamPrefetch::BeyondL2 => 4 * k * c > (1 << 21) && n.div_ceil(t.bn) <= 2,
        // A call's operands do not fit L1 (48 KiB): its pairs come from L2.
        StreamPrefetch::BeyondL1 => 4 * c.min(k) * (t.bn + t.bc.min(t.bk)) > 48 << 10,
    })
}

crate::layout::getters!(Fc {
    n: usize = "Minibatch rows.",
    c: usize = "Input features.",
    k: usize = "Output features.",
    act: Activation = "The fused activation of forward.",
});

impl Fc {
    /// Plans a layer with the heuristic tuning ([`FcTuning::heuristic`]).
    /// A tuning saved by `examples/tune --save` is planned with
    /// [`crate::tuning::load`] and [`Fc::with_tuning`].
    pub fn new(n: usize, c: usize, k: usize, act: Activation) -> Result<Fc> {
        Fc::with_tuning(n, c, k, act, FcTuning::heuristic(n, c, k))
    }

    /// Plans a layer with the given blocking and loop orders.
    pub fn with_tuning(n: usize, c: usize, k: usize, act: Activation, t: FcTuning) -> Result<Fc> {
        crate::check_policy()?;
        for (what, v) in [
            ("n", n),
            ("c", c),
            ("k", k),
            ("bn", t.bn),
            ("bc", t.bc),
            ("bk", t.bk),
        ] {
            if v == 0 {
                return Err(shape(what, v, "must be at least 1"));
            }
        }
        let (nb, cb, kb) = (n.div_ceil(t.bn), c.div_ceil(t.bc), k.div_ceil(t.bk));
        // Every buffer (padded) and so every block product fits, before any
        // of the index arithmetic below runs.
        crate::error::elems("X (padded n x c)", &[nb, t.bn, cb, t.bc])?;
        crate::error::elems("W (padded k x c)", &[kb, t.bk, cb, t.bc])?;
        crate::error::elems("Y (padded n x k)", &[nb, t.bn, kb, t.bk])?;
        let (bn, bc, bk) = (t.bn, t.bc, t.bk);
        let ep = Epilogue {
            bias: true,
            activation: act,
        };
        let stride = |a: usize, b: usize| BatchForm::Stride { a, b };
        let pf = fc_prefetch(n, c, k, &t);
        let fdesc = Descriptor::new(bk, bn, bc)
            .batch_form(stride(bk * bc, bn * bc))
            .prefetch(pf);
        let loops = || {
            vec![
                LoopDef::new("N blocks", nb, 1),
                LoopDef::new("K blocks", kb, 1),
                LoopDef::new("C blocks", cb, 1),
            ]
        };
        let fwd_tile = column_tile(bk, bn);
        let fwd = Reduction::new("fwd", &t.fwd, loops(), 2, (fdesc, ep), Ahead::A, fwd_tile)?;
        // GELU's derivative needs the pre-activation: training writes Z with
        // a bias-only epilogue and applies GELU on the hot block.
        let pre = Epilogue {
            bias: true,
            activation: Activation::Identity,
        };
        let fwd_pre = (act == Activation::Gelu)
            .then(|| Chunked::with_tile(fdesc, pre, fwd_tile))
            .transpose()?;
        // dX^T[nb][cb] = sum_kb dZt[nb][kb] (bn x bk) * W[kb][cb] (bk x bc).
        let bdesc = Descriptor::new(bn, bc, bk)
            .batch_form(stride(bk * bn, cb * bc * bk))
            .prefetch(pf);
        let none = Epilogue::default();
        let bwd = Reduction::new(
            "bwd",
            &t.bwd,
            loops(),
            1,
            (bdesc, none),
            Ahead::Nothing,
            None,
        )?;
        let tdesc = Descriptor::new(bc, bn, bk)
            .batch_form(stride(bc * bk, bn * bk))
            .prefetch(pf);
        let bwd_wt = Reduction::new("bwd", &t.bwd, loops(), 1, (tdesc, none), Ahead::A, None)?;
        // X blocks are [bn][bc]: read in place as a row-major B (k = bn rows).
        // Prefetching kernels bring in the next dW block.
        let udesc = Descriptor::new(bk, bc, bn)
            .b_row_major()
            .ldb(bc)
            .batch_form(stride(kb * bn * bk, cb * bn * bc))
            .prefetch(upd_prefetch(n, c, k, &t));
        let upd_tile = column_tile(bk, bc);
        let upd = Reduction::new("upd", &t.upd, loops(), 0, (udesc, none), Ahead::C, upd_tile)?;
        Ok(Fc {
            n,
            c,
            k,
            act,
            tuning: t,
            fwd,
            fwd_pre,
            bwd,
            bwd_wt,
            upd,
        })
    }

    /// The blocking and specs in use.
    pub fn tuning(&self) -> &FcTuning {
        &self.tuning
    }
    /// K rounded up to whole blocks: the length of the bias buffer.
    pub fn padded_k(&self) -> usize {
        self.k.div_ceil(self.tuning.bk) * self.tuning.bk
    }
    /// Floating-point operations of one pass (any of the three).
    pub fn flops(&self) -> f64 {
        2.0 * (self.n * self.c * self.k) as f64
    }
    /// A zero input X (`[N/bn][C/bc][bn][bc]`).
    pub fn x_layout(&self) -> Blocked {
        Blocked::zeros_of(self.x_shape())
    }
    /// A zero output Y (also dY, dZ and Z: `[N/bn][K/bk][bn][bk]`).
    pub fn y_layout(&self) -> Blocked {
        Blocked::zeros_of(self.y_shape())
    }
    /// Zero weights W (`[K/bk][C/bc][bc][bk]`).
    pub fn w_layout(&self) -> Blocked {
        Blocked::weights_of(self.w_shape())
    }
    /// Zero transposed weights, as [`Fc::backward_data_wt`] reads them
    /// (`[C/bc][K/bk][bk][bc]`).
    pub fn wt_layout(&self) -> Blocked {
        Blocked::weights_of(self.wt_shape())
    }
    /// The workspace of [`Fc::backward_data`]: dZ with each block
    /// transposed (`[N/bn][K/bk][bk][bn]`).
    pub fn dzt_layout(&self) -> Blocked {
        Blocked::zeros_of(self.dzt_shape())
    }

    fn x_shape(&self) -> Shape {
        let t = &self.tuning;
        (self.n, self.c, t.bn, t.bc, Inner::RowMajor)
    }
    fn y_shape(&self) -> Shape {
        let t = &self.tuning;
        (self.n, self.k, t.bn, t.bk, Inner::RowMajor)
    }
    fn w_shape(&self) -> Shape {
        let t = &self.tuning;
        (self.k, self.c, t.bk, t.bc, Inner::ColMajor)
    }
    fn dzt_shape(&self) -> Shape {
        let t = &self.tuning;
        (self.n, self.k, t.bn, t.bk, Inner::ColMajor)
    }
    fn wt_shape(&self) -> Shape {
        let t = &self.tuning;
        (self.c, self.k, t.bc, t.bk, Inner::ColMajor)
    }

    /// Compares a buffer's shape with what the layer needs, allocating
    /// nothing (these checks run on every call).
    fn check(&self, what: &str, b: &Blocked, want: Shape) -> Result<()> {
        check_shape(what, b, want)
    }

    /// Y = act(X W^T + b). With `z`, also keeps Z = X W^T + b when the
    /// activation's derivative needs it (GELU; ignored otherwise).
    pub fn forward(
        &self,
        pool: &Pool,
        x: &Blocked,
        w: &Blocked,
        bias: &[f32],
        y: &mut Blocked,
        z: Option<&mut Blocked>,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("X", x, self.x_shape())?;
        self.check("W", w, self.w_shape())?;
        self.check("Y", y, self.y_shape())?;
        check_buf("bias", bias.len(), self.padded_k())?;
        let (bn, bk) = (self.tuning.bn, self.tuning.bk);
        let (xv, wv, bv) = (x.blocks(), w.blocks(), View::new(bias, [bk]));
        let yv = y.blocks_mut();
        // With GELU in training the kernels write Z, and Y = GELU(Z) follows
        // on the hot block.
        let (out, pre) = match (z, &self.fwd_pre) {
            (Some(z), Some(pre)) => {
                self.check("Z", z, self.y_shape())?;
                (z.blocks_mut(), Some(pre))
            }
            _ => (yv, None),
        };
        // Sigmoid(0) = 0.5 would fill K padding: keep padding at zero.
        let k_tail = self.k % bk;
        let clear_pad = k_tail != 0 && self.act.apply(0.0) != 0.0;
        let kbn = self.k.div_ceil(bk);
        let at = |i: &[usize]| Operands {
            a: wv.at([i[1], i[2]]),
            b: xv.at([i[0], i[2]]),
            c: out.at([i[0], i[1]]),
            bias: bv.at([i[1]]),
        };
        // SAFETY: shapes were checked above; blocks (nb, kb) are owned by
        // one thread (the C loop is a reduction, never parallel), and only
        // the call that completed them touches them after it.
        unsafe {
            self.fwd.run(pool, pre, at, |i, op, _, last| {
                if !last {
                    return;
                }
                let ys = yv.slice([i[0], i[1]], bn * bk);
                if pre.is_some() {
                    let zs = std::slice::from_raw_parts(op.c, bn * bk);
                    for (y, z) in ys.iter_mut().zip(zs) {
                        *y = self.act.apply(*z);
                    }
                }
                if clear_pad && i[1] + 1 == kbn {
                    for row in ys.chunks_exact_mut(bk) {
                        row[k_tail..].fill(0.0);
                    }
                }
            });
        }
        Ok(())
    }

    /// dZ = dY * act'(.), from Y (or from Z for GELU); with `dzb` (of
    /// dZ's length) also dZ rounded to bf16, piece by piece in L1: the bf16
    /// backward-data pass's operand without a sweep of its own.
    pub fn activation_backward(
        &self,
        pool: &Pool,
        dy: &Blocked,
        y: &Blocked,
        z: Option<&Blocked>,
        dz: &mut Blocked,
        dzb: Option<&mut [bf16]>,
    ) -> Result<()> {
        let dzb = Twin::new("bf16 dZ", dzb, dz.data.len())?;
        let want = self.y_shape();
        self.check("dY", dy, want)?;
        self.check("Y", y, want)?;
        self.check("dZ", dz, want)?;
        let z = match (self.act, z) {
            (Activation::Gelu, Some(z)) => {
                self.check("Z", z, want)?;
                Some(z)
            }
            (Activation::Gelu, None) => {
                return Err(shape(
                    "Z",
                    "None",
                    "GELU backward needs the pre-activation from forward",
                ))
            }
            _ => None,
        };
        let act = self.act;
        pool.for_slices(&mut dz.data, |lo, out| {
            for (at, out) in (lo..).step_by(Twin::PIECE).zip(out.chunks_mut(Twin::PIECE)) {
                let n = out.len();
                let zs = z.map_or(&[][..], |z| &z.data[at..at + n]);
                mul_act_grad(act, out, &dy.data[at..at + n], &y.data[at..at + n], zs);
                // SAFETY: this thread's share of dZ.
                unsafe { dzb.round(at, out) };
            }
        });
        Ok(())
    }

    /// dX = dZ W, reading W in its forward layout: no copy of the
    /// weights; `dzt` ([`Fc::dzt_layout`]) receives dZ blocks transposed.
    pub fn backward_data(
        &self,
        pool: &Pool,
        dz: &Blocked,
        w: &Blocked,
        dzt: &mut Blocked,
        dx: &mut Blocked,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("dZ", dz, self.y_shape())?;
        self.check("W", w, self.w_shape())?;
        self.check("dZt", dzt, self.dzt_shape())?;
        self.check("dX", dx, self.x_shape())?;
        dz.relayout_into_par(dzt, pool)?;
        let (bn, bc) = (self.tuning.bn, self.tuning.bc);
        let (dztv, wv, dxv) = (dzt.blocks(), w.blocks(), dx.blocks_mut());
        let at = |i: &[usize]| Operands {
            a: dztv.at([i[0], i[1]]),
            b: wv.at([i[1], i[2]]),
            c: dxv.at([i[0], i[2]]),
            bias: std::ptr::null(),
        };
        // SAFETY: as in forward; dX[nb][cb] is owned by one thread, which
        // turns it round after the call that completed it.
        unsafe {
            self.bwd.run(pool, None, at, |i, _, _, last| {
                if last {
                    transpose_in_place(dxv.slice([i[0], i[2]], bn * bc), bc, bn);
                }
            })
        };
        Ok(())
    }

    /// dX = dZ W from a transposed copy of W ([`Fc::transpose_weights`]):
    /// for callers that reuse one copy over many calls (the LSTM's input
    /// projection, the recurrent steps); else [`Fc::backward_data`].
    pub fn backward_data_wt(
        &self,
        pool: &Pool,
        dz: &Blocked,
        wt: &Blocked,
        dx: &mut Blocked,
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("dZ", dz, self.y_shape())?;
        self.check("Wt", wt, self.wt_shape())?;
        self.check("dX", dx, self.x_shape())?;
        let (dzv, wtv, dxv) = (dz.blocks(), wt.blocks(), dx.blocks_mut());
        let at = |i: &[usize]| Operands {
            a: wtv.at([i[2], i[1]]),
            b: dzv.at([i[0], i[1]]),
            c: dxv.at([i[0], i[2]]),
            bias: std::ptr::null(),
        };
        // SAFETY: as in forward; dX[nb][cb] is owned by one thread.
        unsafe { self.bwd_wt.run(pool, None, at, |_, _, _, _| {}) };
        Ok(())
    }

    /// dW = dZ^T X (reduced over the whole minibatch inside BRGEMM, reading
    /// X's `[bn][bc]` blocks in place as row-major B) and db = column sums
    /// of dZ.
    pub fn backward_weights(
        &self,
        pool: &Pool,
        dz: &Blocked,
        x: &Blocked,
        dw: &mut Blocked,
        db: &mut [f32],
    ) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("dZ", dz, self.y_shape())?;
        self.check("X", x, self.x_shape())?;
        self.check("dW", dw, self.w_shape())?;
        check_buf("db", db.len(), self.padded_k())?;
        let dwv = dw.blocks_mut();
        // SAFETY: shapes were checked above; dW[kb][cb] is owned by one
        // thread, and the chunks of one output run in order (the N loop is
        // a serial reduction). The next block is only prefetched, and may
        // lie past dW's end.
        unsafe { self.run_upd(pool, dz, x, db, |i| dwv.at([i[1], i[2]]), |_, _| {}) };
        Ok(())
    }

    /// The backward-weights nest: call `i` writes its dW block to `c(i)`,
    /// then `done(i, op)` runs on the same thread; db = column sums of dZ
    /// ride along (the calls of C block 0 add the dZ blocks they just
    /// read, hot in L2, into db[kb], instead of a second pass over dZ).
    ///
    /// # Safety
    /// dZ, X and db were checked against the plan; `c(i)` is `bk * bc`
    /// floats the calling thread alone writes from the call through `done`
    /// (a block of dW, or a thread's own block).
    unsafe fn run_upd(
        &self,
        pool: &Pool,
        dz: &Blocked,
        x: &Blocked,
        db: &mut [f32],
        c: impl Fn(&[usize]) -> *mut f32 + Sync,
        done: impl Fn(&[usize], &Operands) + Sync,
    ) {
        let t = &self.tuning;
        let (bn, bk, kbn) = (t.bn, t.bk, self.k.div_ceil(t.bk));
        let (dzv, xv) = (dz.blocks(), x.blocks());
        db.fill(0.0);
        let dbv = crate::view::ViewMut::new(db, [bk]);
        let at = |i: &[usize]| Operands {
            a: dzv.at([i[0], i[1]]),
            b: xv.at([i[0], i[2]]),
            c: c(i),
            bias: std::ptr::null(),
        };
        // SAFETY: the caller's contract; db[kb] is owned by the thread of
        // the (kb, 0) blocks.
        self.upd.run(pool, None, at, |i, op, count, _| {
            if i[2] == 0 {
                let out = dbv.slice([i[1]], bk);
                for j in 0..count {
                    let rows = op.a.add(j * kbn * bn * bk);
                    add_rows(out, std::slice::from_raw_parts(rows, bn * bk));
                }
            }
            done(i, op);
        });
    }

    /// [`Fc::backward_weights`] with the optimizer step fused: each dW
    /// block goes from the kernel to a per-thread L1 block, and `opt`
    /// updates W's block (and its moments in `state`) from it right away,
    /// so dW is never stored whole, nor read again by a separate step. W
    /// is the parameter `state` follows; db is written as by
    /// `backward_weights` (the bias, small, takes its own step). Where the
    /// plan splits a block's reduction over several calls, the gradient is
    /// formed whole first and stepped after (the same result).
    ///
    /// Not for data-parallel training, where gradients must be all-reduced
    /// before any step, nor under a guard that checks the gradient before
    /// the optimizer touches the weights.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_weights_step(
        &self,
        pool: &Pool,
        dz: &Blocked,
        x: &Blocked,
        w: &mut Blocked,
        db: &mut [f32],
        opt: &crate::optim::Optimizer,
        state: &mut crate::optim::OptState,
    ) -> Result<()> {
        self.step_blocks(pool, dz, x, w, db, opt, state, &|_, _, _| {})
    }

    /// [`Fc::backward_weights_step`], handing each updated W block
    /// (`[ki][ci]`, `bc x bk`) to `then` on the thread that stepped it,
    /// while the block is in L1: the bf16 layer rounds it into its packed
    /// weights there.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn step_blocks(
        &self,
        pool: &Pool,
        dz: &Blocked,
        x: &Blocked,
        w: &mut Blocked,
        db: &mut [f32],
        opt: &crate::optim::Optimizer,
        state: &mut crate::optim::OptState,
        then: &(dyn Fn(usize, usize, &[f32]) + Sync),
    ) -> Result<()> {
        opt.validate()?;
        self.check("W", w, self.w_shape())?;
        let blk = self.tuning.bk * self.tuning.bc;
        if !self.upd.one_call_per_output() {
            let mut dw = self.w_layout();
            self.backward_weights(pool, dz, x, &mut dw, db)?;
            state.step(opt, w.data_mut(), dw.data());
            let cb = self.c.div_ceil(self.tuning.bc);
            let w = w.data();
            pool.for_work(self.flops()).for_each(w.len() / blk, |item| {
                then(item / cb, item % cb, &w[item * blk..][..blk])
            });
            return Ok(());
        }
        let pool = pool.for_work(self.flops());
        self.check("dZ", dz, self.y_shape())?;
        self.check("X", x, self.x_shape())?;
        check_buf("db", db.len(), self.padded_k())?;
        let rule = state.begin(opt, w.data().len());
        let wv = w.blocks_mut();
        let w0 = wv.at([0, 0]) as usize;
        // The calling thread's L1 block; the call and its `done` run on
        // the same thread, one after the other.
        let scratch = |_: &[usize]| crate::pass::thread_block(blk);
        // SAFETY: shapes checked above; each thread's block is its own, and
        // every W block (and its moments) is stepped once, by the thread
        // that owns it, from the gradient block its own call just wrote.
        unsafe {
            self.run_upd(pool, dz, x, db, scratch, |i, op| {
                let wb = wv.slice([i[1], i[2]], blk);
                let at = (wb.as_ptr() as usize - w0) / std::mem::size_of::<f32>();
                rule.apply(at, wb, std::slice::from_raw_parts(op.c, blk));
                then(i[1], i[2], wb);
            });
        }
        Ok(())
    }

    /// Writes W transposed into `wt` for [`Fc::backward_data_wt`] (O(KC);
    /// a block copy per block, parallel over `pool`).
    pub fn transpose_weights(&self, pool: &Pool, w: &Blocked, wt: &mut Blocked) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("W", w, self.w_shape())?;
        self.check("Wt", wt, self.wt_shape())?;
        w.transpose_into_par(wt, pool)
    }
}

/// `block` (`r x c` row-major) becomes its transpose (`c x r` row-major),
/// through a per-thread copy (an L1-hot block, once per output block).
fn transpose_in_place(block: &mut [f32], r: usize, c: usize) {
    thread_local! {
        static TMP: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    TMP.with_borrow_mut(|tmp| {
        tmp.clear();
        tmp.extend_from_slice(&block[..r * c]);
        crate::layout::transpose_block(tmp, block, r, c);
    });
}
