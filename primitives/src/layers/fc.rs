//! Fully-connected layer: forward, backward-data and backward-weights as
//! loop nests around BRGEMM.
//!
//! Shapes: X `[N][C]`, W `[K][C]`, Y = act(X W^T + b) `[N][K]`, in the blocked
//! layouts of [`crate::layout`]. Each pass is a three-loop nest; `c` is always
//! the reduction, done as the BRGEMM batch (`chunk` blocks per call; the
//! default, 0, means all of them in one call so the output block is stored
//! once).
//!
//! | pass | a | b | c (reduction, BRGEMM batch) | BRGEMM (m x n x k) | A_i | B_i | C |
//! |---|---|---|---|---|---|---|---|
//! | fwd | N blocks | K blocks | C blocks | bk x bn x bc | `W[kb][cb]` | `X[nb][cb]` | `Y[nb][kb]` |
//! | bwd | N blocks | C blocks | K blocks | bc x bn x bk | `Wt[cb][kb]` | `dZ[nb][kb]` | `dX[nb][cb]` |
//! | upd | K blocks | C blocks | N blocks | bk x bc x bn | `dZ[nb][kb]` | `X[nb][cb]` (row-major B) | `dW[kb][cb]` |
//!
//! Data reuse: one BRGEMM call streams a block-row of each operand. The
//! default order ([`PassConfig::heuristic`]) puts the output loop with more
//! blocks outside, so the operand of the inner loop is the smaller set of
//! block-rows and comes back from L2 for the next outer block; with more
//! than 8 reduction blocks the reduction is split into chunks of 8 and goes
//! outermost (`cAB`/`cBA`), so that set fits in L2 even for long
//! reductions (the LSTM's dW over all steps: x1.4; on cores that prefetch
//! from L2 only with the first output loop outside). Weights that stream
//! from memory (one or two N blocks, long block-rows) are read in chunks of
//! 16 blocks with the reduction innermost, each call prefetching the
//! next's. upd's reduction runs
//! over the minibatch, inside each output block's calls, so every
//! `dW[kb][cb]` is owned by one thread: no races, no per-thread partial sums.
//!
//! Both output loops are parallel, with the blocking of
//! [`FcTuning::heuristic`]. Any valid spec gives the same result (the tests
//! check every one).

use crate::act::mul_act_grad;
use crate::error::{check_buf, shape, Result};
use crate::layout::{check_shape, Blocked, Inner, Shape, SyncPtr};
use crate::loops::{LoopDef, LoopNest};
use crate::math::add_rows;
use crate::pass::{pick_block, Chunked, PassConfig};
use crate::threads::Pool;
use brgemm::{Activation, BatchForm, Descriptor, Epilogue, Prefetch, RawBatch};
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
        let (bn, bc, bk) = (
            pick_block(n, &cands),
            pick_block(c, &cands),
            pick_block(k, &cands),
        );
        let (nb, cb, kb) = (n.div_ceil(bn), c.div_ceil(bc), k.div_ceil(bk));
        FcTuning {
            bn,
            bc,
            bk,
            fwd: PassConfig::heuristic(nb, kb, cb),
            bwd: PassConfig::heuristic(nb, cb, kb),
            upd: PassConfig::heuristic(kb, cb, nb),
        }
    }
}

struct Pass {
    nest: LoopNest,
    kernels: Chunked,
    chunk: usize,
    red: usize,
    /// Loop a (N blocks) runs inside loop b, so consecutive calls share b's
    /// weight block-row: the next one is needed only after the last N
    /// block, and prefetching it during every call of the row brought it
    /// in nb times, pushing the current row and X out of L2. Measured on
    /// Zen 5 (alternating in one process, 21 pairs, two runs) with `BAc`:
    /// fwd/bwd (512,2048,2048) x1.03-1.04, (256,1024,1024) x1.00-1.04;
    /// one N block ((64,4096,4096)) is unchanged by construction.
    a_inner: bool,
    /// The reduction is the innermost loop: a chunked call is followed by
    /// the next chunk of the same weight block-row.
    red_inner: bool,
}

impl Pass {
    /// The weights the call after this one reads, to prefetch during this
    /// one: `(first block, blocks)`, counting blocks of the weights in
    /// their order (block-row `row` of `rows` holds blocks `row * red ..`),
    /// for a call at block-row `row`, reduction blocks `r0..r0 + cnt` and
    /// N block `nb` of `nbn`. `None` where the next call reuses the
    /// block-row just read (N loop inside, see `a_inner`) or there is none.
    fn next_weights(
        &self,
        row: usize,
        rows: usize,
        (r0, cnt): (usize, usize),
        (nb, nbn): (usize, usize),
    ) -> Option<(usize, usize)> {
        if self.red_inner && r0 + cnt < self.red {
            let r1 = r0 + cnt;
            return Some((row * self.red + r1, self.chunk.min(self.red - r1)));
        }
        if row + 1 == rows || (self.a_inner && nb + 1 < nbn) {
            return None;
        }
        Some(if self.red_inner {
            ((row + 1) * self.red, self.chunk)
        } else {
            ((row + 1) * self.red + r0, cnt)
        })
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
    fwd: Pass,
    fwd_pre: Option<Chunked>,
    bwd: Pass,
    upd: Pass,
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

fn pass(
    which: &str,
    cfg: &PassConfig,
    a: (&'static str, usize),
    b: (&'static str, usize),
    red: (&'static str, usize),
    desc: Descriptor,
    ep: Epilogue,
) -> Result<Pass> {
    let chunk = if cfg.chunk == 0 {
        red.1
    } else {
        cfg.chunk.min(red.1)
    };
    let nest = cfg.nest(
        which,
        vec![
            LoopDef::new(a.0, a.1, 1),
            LoopDef::new(b.0, b.1, 1),
            LoopDef::new(red.0, red.1, chunk).reduction(),
        ],
    )?;
    let first = |l: char| cfg.spec.find(|c: char| c.eq_ignore_ascii_case(&l));
    Ok(Pass {
        nest,
        kernels: Chunked::new(desc, ep)?,
        chunk,
        red: red.1,
        a_inner: first('a') > first('b'),
        red_inner: cfg.spec.ends_with(['c', 'C']),
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
        let fwd = pass(
            "fwd",
            &t.fwd,
            ("N blocks", nb),
            ("K blocks", kb),
            ("C blocks", cb),
            fdesc,
            ep,
        )?;
        // GELU's derivative needs the pre-activation: training writes Z with
        // a bias-only epilogue and applies GELU on the hot block.
        let fwd_pre = (act == Activation::Gelu)
            .then(|| {
                Chunked::new(
                    fdesc,
                    Epilogue {
                        bias: true,
                        activation: Activation::Identity,
                    },
                )
            })
            .transpose()?;
        let bdesc = Descriptor::new(bc, bn, bk)
            .batch_form(stride(bc * bk, bn * bk))
            .prefetch(pf);
        let bwd = pass(
            "bwd",
            &t.bwd,
            ("N blocks", nb),
            ("C blocks", cb),
            ("K blocks", kb),
            bdesc,
            Epilogue::default(),
        )?;
        // X blocks are [bn][bc]: read in place as a row-major B (k = bn rows).
        let udesc = Descriptor::new(bk, bc, bn)
            .b_row_major()
            .ldb(bc)
            .batch_form(stride(kb * bn * bk, cb * bn * bc))
            .prefetch(upd_prefetch(n, c, k, &t));
        let upd = pass(
            "upd",
            &t.upd,
            ("K blocks", kb),
            ("C blocks", cb),
            ("N blocks", nb),
            udesc,
            Epilogue::default(),
        )?;
        Ok(Fc {
            n,
            c,
            k,
            act,
            tuning: t,
            fwd,
            fwd_pre,
            bwd,
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
        Blocked::zeros(
            self.n,
            self.c,
            self.tuning.bn,
            self.tuning.bc,
            Inner::RowMajor,
        )
        .unwrap()
    }
    /// A zero output Y (also dY, dZ and Z: `[N/bn][K/bk][bn][bk]`).
    pub fn y_layout(&self) -> Blocked {
        Blocked::zeros(
            self.n,
            self.k,
            self.tuning.bn,
            self.tuning.bk,
            Inner::RowMajor,
        )
        .unwrap()
    }
    /// Zero weights W (`[K/bk][C/bc][bc][bk]`).
    pub fn w_layout(&self) -> Blocked {
        Blocked::zeros(
            self.k,
            self.c,
            self.tuning.bk,
            self.tuning.bc,
            Inner::ColMajor,
        )
        .unwrap()
    }
    /// Zero transposed weights, as backward-data reads them (`[C/bc][K/bk][bk][bc]`).
    pub fn wt_layout(&self) -> Blocked {
        Blocked::zeros(
            self.c,
            self.k,
            self.tuning.bc,
            self.tuning.bk,
            Inner::ColMajor,
        )
        .unwrap()
    }

    fn x_shape(&self) -> Shape {
        (
            self.n,
            self.c,
            self.tuning.bn,
            self.tuning.bc,
            Inner::RowMajor,
        )
    }
    fn y_shape(&self) -> Shape {
        (
            self.n,
            self.k,
            self.tuning.bn,
            self.tuning.bk,
            Inner::RowMajor,
        )
    }
    fn w_shape(&self) -> Shape {
        (
            self.k,
            self.c,
            self.tuning.bk,
            self.tuning.bc,
            Inner::ColMajor,
        )
    }
    fn wt_shape(&self) -> Shape {
        (
            self.c,
            self.k,
            self.tuning.bc,
            self.tuning.bk,
            Inner::ColMajor,
        )
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
        let t = &self.tuning;
        let (xp, wp, bp) = (
            x.data.as_ptr() as usize,
            w.data.as_ptr() as usize,
            bias.as_ptr() as usize,
        );
        let (kbn, cbn) = (self.k.div_ceil(t.bk), self.c.div_ceil(t.bc));
        let (bn, bc, bk) = (t.bn, t.bc, t.bk);
        let yp = SyncPtr(y.data.as_mut_ptr());
        let zp = match (z, &self.fwd_pre) {
            (Some(z), Some(_)) => {
                self.check("Z", z, self.y_shape())?;
                Some(SyncPtr(z.data.as_mut_ptr()))
            }
            _ => None,
        };
        // Sigmoid(0) = 0.5 would fill K padding: keep padding at zero.
        let k_tail = self.k % bk;
        let clear_pad = k_tail != 0 && self.act.apply(0.0) != 0.0;
        let p = &self.fwd;
        let nbn = self.n.div_ceil(bn);
        p.nest.run(pool, |i| {
            let (nb, kb, c0) = (i[0], i[1], i[2]);
            let cnt = p.chunk.min(p.red - c0);
            let (first, last) = (c0 == 0, c0 + cnt == p.red);
            let a = (wp as *const f32).wrapping_add((kb * cbn + c0) * bk * bc);
            let b = (xp as *const f32).wrapping_add((nb * cbn + c0) * bn * bc);
            let off = (nb * kbn + kb) * bn * bk;
            let bias = (bp as *const f32).wrapping_add(kb * bk);
            let batch = RawBatch::Stride { a, b, count: cnt };
            // SAFETY: shapes were checked above; blocks (nb, kb) are owned by
            // one thread (the c loop is a reduction, never parallel).
            unsafe {
                match (zp, &self.fwd_pre) {
                    (Some(zp), Some(pre)) => {
                        let zc = zp.get().add(off);
                        pre.pick(first, last).execute_raw(batch, zc, bias);
                        if last {
                            let (zs, ys) = (
                                std::slice::from_raw_parts(zc, bn * bk),
                                std::slice::from_raw_parts_mut(yp.get().add(off), bn * bk),
                            );
                            for (y, z) in ys.iter_mut().zip(zs) {
                                *y = self.act.apply(*z);
                            }
                        }
                    }
                    // With prefetching kernels (weights streaming from
                    // memory), bring in the next K block's weights during
                    // the call before they are needed: the next call's, or
                    // with the N loop inside, the last N block's.
                    _ => {
                        let (ahead, len) = p
                            .next_weights(kb, kbn, (c0, cnt), (nb, nbn))
                            .map_or((0, 0), |(blk, n)| (blk * bk * bc, n * bk * bc));
                        p.kernels.pick(first, last).execute_raw_ahead(
                            batch,
                            yp.get().add(off),
                            bias,
                            (wp as *const f32).wrapping_add(ahead),
                            len,
                        )
                    }
                }
                if last && clear_pad && kb + 1 == kbn {
                    let blk = std::slice::from_raw_parts_mut(yp.get().add(off), bn * bk);
                    for row in blk.chunks_exact_mut(bk) {
                        row[k_tail..].fill(0.0);
                    }
                }
            }
        });
        Ok(())
    }

    /// dZ = dY * act'(.), from Y (or from Z for GELU).
    pub fn activation_backward(
        &self,
        pool: &Pool,
        dy: &Blocked,
        y: &Blocked,
        z: Option<&Blocked>,
        dz: &mut Blocked,
    ) -> Result<()> {
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
            let n = out.len();
            let zs = z.map_or(&[][..], |z| &z.data[lo..lo + n]);
            mul_act_grad(act, out, &dy.data[lo..lo + n], &y.data[lo..lo + n], zs);
        });
        Ok(())
    }

    /// dX = dZ W, reading the weights transposed (see [`Fc::transpose_weights`]).
    pub fn backward_data(
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
        let t = &self.tuning;
        let (kbn, cbn) = (self.k.div_ceil(t.bk), self.c.div_ceil(t.bc));
        let (bn, bc, bk) = (t.bn, t.bc, t.bk);
        let (dzp, wtp) = (dz.data.as_ptr() as usize, wt.data.as_ptr() as usize);
        let dxp = SyncPtr(dx.data.as_mut_ptr());
        let p = &self.bwd;
        let nbn = self.n.div_ceil(t.bn);
        p.nest.run(pool, |i| {
            let (nb, cb, k0) = (i[0], i[1], i[2]);
            let cnt = p.chunk.min(p.red - k0);
            let a = (wtp as *const f32).wrapping_add((cb * kbn + k0) * bc * bk);
            let b = (dzp as *const f32).wrapping_add((nb * kbn + k0) * bn * bk);
            // SAFETY: as in forward; dX[nb][cb] is owned by one thread.
            // As in forward, the next C block's weights come in meanwhile.
            let (ahead, len) = p
                .next_weights(cb, cbn, (k0, cnt), (nb, nbn))
                .map_or((0, 0), |(blk, n)| (blk * bc * bk, n * bc * bk));
            unsafe {
                p.kernels
                    .pick(k0 == 0, k0 + cnt == p.red)
                    .execute_raw_ahead(
                        RawBatch::Stride { a, b, count: cnt },
                        dxp.get().add((nb * cbn + cb) * bn * bc),
                        std::ptr::null(),
                        (wtp as *const f32).wrapping_add(ahead),
                        len,
                    )
            };
        });
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
        let t = &self.tuning;
        let (kbn, cbn) = (self.k.div_ceil(t.bk), self.c.div_ceil(t.bc));
        let (bn, bc, bk) = (t.bn, t.bc, t.bk);
        let (dzp, xp) = (dz.data.as_ptr() as usize, x.data.as_ptr() as usize);
        let dwp = SyncPtr(dw.data.as_mut_ptr());
        let p = &self.upd;
        // The bias gradient rides along: the item of C block 0 adds the dZ
        // blocks its BRGEMM just read (hot in L2) into db[kb], instead of a
        // second pass over dZ from memory.
        db.fill(0.0);
        let dbp = SyncPtr(db.as_mut_ptr());
        p.nest.run(pool, |i| {
            let (kb, cb, n0) = (i[0], i[1], i[2]);
            let cnt = p.chunk.min(p.red - n0);
            let a = (dzp as *const f32).wrapping_add((n0 * kbn + kb) * bn * bk);
            if cb == 0 {
                // SAFETY: db[kb] is touched by this item alone, and the
                // chunks of one K block run in order (loop c is a serial
                // reduction); the blocks lie inside dZ (checked).
                unsafe {
                    let out = std::slice::from_raw_parts_mut(dbp.get().add(kb * bk), bk);
                    for j in 0..cnt {
                        add_rows(
                            out,
                            std::slice::from_raw_parts(a.add(j * kbn * bn * bk), bn * bk),
                        );
                    }
                }
            }
            let b = (xp as *const f32).wrapping_add((n0 * cbn + cb) * bn * bc);
            // SAFETY: as in forward; dW[kb][cb] is owned by one thread. The
            // next block is only prefetched (prefetching kernels only), and
            // may lie past dW's end.
            unsafe {
                p.kernels
                    .pick(n0 == 0, n0 + cnt == p.red)
                    .execute_raw_ahead(
                        RawBatch::Stride { a, b, count: cnt },
                        dwp.get().add((kb * cbn + cb) * bk * bc),
                        std::ptr::null(),
                        dwp.get().wrapping_add((kb * cbn + cb + 1) * bk * bc),
                        bk * bc,
                    )
            };
        });
        Ok(())
    }

    /// Writes W transposed into `wt` for backward-data (O(KC), once per
    /// step; a block copy per block, parallel over `pool`).
    pub fn transpose_weights(&self, pool: &Pool, w: &Blocked, wt: &mut Blocked) -> Result<()> {
        let pool = pool.for_work(self.flops());
        self.check("W", w, self.w_shape())?;
        self.check("Wt", wt, self.wt_shape())?;
        w.transpose_into_par(wt, pool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calls of a pass's nest on one thread, in order: (block-row,
    /// first reduction block, N block).
    fn calls(spec: &str, rows: usize, red: usize, chunk: usize, nbn: usize) -> Vec<[usize; 3]> {
        let mut v = vec![];
        if spec == "cBA" {
            for c0 in (0..red).step_by(chunk) {
                for x in 0..rows * nbn {
                    v.push([x / nbn, c0, x % nbn]);
                }
            }
            return v;
        }
        for x in 0..rows * nbn {
            for c0 in (0..red).step_by(chunk) {
                v.push(match spec {
                    "BAc" => [x / nbn, c0, x % nbn],
                    "ABc" => [x % rows, c0, x / rows],
                    _ => unreachable!(),
                });
            }
        }
        v
    }

    #[test]
    fn each_call_prefetches_the_weights_the_next_call_reads() {
        let (rows, red) = (3, 40);
        for (spec, nbn, chunk) in [
            ("BAc", 1, 16),
            ("BAc", 2, 16),
            ("BAc", 1, 0),
            ("BAc", 3, 0),
            ("ABc", 2, 16),
            ("ABc", 2, 0),
            ("cBA", 1, 8),
            ("cBA", 2, 8),
        ] {
            let cfg = PassConfig {
                chunk,
                ..PassConfig::spec(spec)
            };
            let t = FcTuning {
                bn: 64,
                bc: 64,
                bk: 64,
                fwd: cfg.clone(),
                bwd: cfg,
                upd: PassConfig::spec("ABc"),
            };
            let fc =
                Fc::with_tuning(64 * nbn, 64 * red, 64 * rows, Activation::Identity, t).unwrap();
            let p = &fc.fwd;
            let seq = calls(spec, rows, red, p.chunk, nbn);
            assert_eq!(seq.len(), rows * nbn * red.div_ceil(p.chunk));
            let mut prefetched = 0;
            for (i, &[row, r0, nb]) in seq.iter().enumerate() {
                let got = p.next_weights(row, rows, (r0, p.chunk.min(red - r0)), (nb, nbn));
                let Some(&[r1, c1, nb1]) = seq.get(i + 1) else {
                    assert_eq!(got, None, "{spec} {nbn} {chunk}: after the last call");
                    continue;
                };
                match got {
                    Some(g) => {
                        assert_eq!(g, (r1 * red + c1, p.chunk.min(red - c1)), "{spec} call {i}");
                        prefetched += 1;
                    }
                    // Only where the next call goes back to a row read
                    // before: the same row for the next N block, or row 0.
                    None => assert!(r1 < row || (r1 == row && nb1 != nb), "{spec} call {i}"),
                }
            }
            if spec == "BAc" && nbn == 1 {
                assert_eq!(prefetched, seq.len() - 1, "{spec} {chunk}");
            }
        }
    }
}
