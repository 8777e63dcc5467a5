//! What every pass's plan shares: its loop order and blocking
//! ([`PassConfig`], with the default order's heuristic), the block-size
//! choice, the kernels of a reduction split into chunks ([`Chunked`]), and
//! the runner of a reduction pass ([`Reduction`]), which picks each call's
//! kernel and prefetches the next call's operand from the nest's order.

use crate::error::Result;
use crate::loops::{LoopDef, LoopNest};
use crate::threads::Pool;
use brgemm::StreamPrefetch;
use brgemm::{BatchForm, Beta, Descriptor, Epilogue, Kernel, Prefetch, RawBatch, RegisterTile};
use std::sync::Arc;

/// Loop order and blocking of one pass.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PassConfig {
    /// Spec string over loops a, b, c (see the module docs).
    pub spec: String,
    /// Reduction blocks per BRGEMM call (0: all).
    pub chunk: usize,
    /// Blocking levels of loop a (in blocks).
    pub blocks_a: Vec<usize>,
    /// Blocking levels of loop b (in blocks).
    pub blocks_b: Vec<usize>,
}

impl PassConfig {
    /// The nest of pass `pass` over `loops`, with this config's blocking
    /// levels on loops a and b and its spec.
    pub(crate) fn nest(&self, pass: &str, mut loops: Vec<LoopDef>) -> Result<LoopNest> {
        loops[0].blocks = self.blocks_a.clone();
        loops[1].blocks = self.blocks_b.clone();
        LoopNest::named(pass, loops, &self.spec)
    }

    /// Iterations of a reduction of `red` per call: `chunk`, 0 meaning all.
    pub(crate) fn chunk_of(&self, red: usize) -> usize {
        if self.chunk == 0 {
            red
        } else {
            self.chunk.min(red)
        }
    }

    /// [`PassConfig::heuristic`] for a pass whose output loops are the
    /// nest's letters `out[0]` and `out[1]` and whose reduction is `red.0`
    /// (of `red.1` blocks): the heuristic's `a`, `b` and `c` renamed.
    /// `stream`: the chunk for streamed weights, as in
    /// [`PassConfig::heuristic_stream`].
    pub(crate) fn heuristic_for(
        out: [(char, usize); 2],
        red: (char, usize),
        stream: Option<usize>,
    ) -> Self {
        let h = PassConfig::heuristic_stream(out[0].1, out[1].1, red.1, stream);
        let rename = |ch: char| {
            let to = [out[0].0, out[1].0, red.0][(ch.to_ascii_lowercase() as u8 - b'a') as usize];
            if ch.is_ascii_uppercase() {
                to.to_ascii_uppercase()
            } else {
                to
            }
        };
        PassConfig {
            spec: h.spec.chars().map(rename).collect(),
            ..h
        }
    }

    /// The default order of a pass with `a` x `b` output blocks and `red`
    /// reduction blocks: both output loops parallel, the one with more blocks
    /// outside, the reduction innermost. Past the CPU policy's
    /// `split_chunk` reduction blocks the reduction is split into chunks and
    /// goes outermost (`cAB`/`cBA`), where the policy says the split pays;
    /// where it prefetches from L2 and the weights stream from memory, the
    /// reduction stays innermost in chunks of `stream_chunk`. The
    /// measurements: `docs/tuning-notes.md`.
    pub fn heuristic(a: usize, b: usize, red: usize) -> Self {
        PassConfig::heuristic_stream(a, b, red, Some(crate::policy().stream_chunk))
    }

    /// [`PassConfig::heuristic`] with the chunk of streamed weights given:
    /// `Some(blocks)` for a pass that prefetches the next call's chunk,
    /// `None` for one that does not, whose streamed reduction is then not
    /// chunked. The chunks are what make that prefetch fit L2; a pass whose
    /// next call's weights are not contiguous (FC backward-data reading W
    /// in place) does not prefetch them, and chunking it only stores and
    /// reloads its output blocks (docs/tuning-notes.md).
    pub fn heuristic_stream(a: usize, b: usize, red: usize, stream: Option<usize>) -> Self {
        let outer = if a >= b { "AB" } else { "BA" };
        let pol = crate::policy();
        let split_pays = match pol.stream_prefetch {
            StreamPrefetch::BeyondL2 => true,
            StreamPrefetch::BeyondL1 => a >= b,
        };
        if red > pol.split_chunk && split_pays {
            PassConfig {
                chunk: pol.split_chunk,
                ..PassConfig::spec(&format!("c{outer}"))
            }
        } else if let Some(chunk) = stream.filter(|_| streams_weights(a, b, red)) {
            PassConfig {
                chunk,
                ..PassConfig::spec(&format!("{outer}c"))
            }
        } else {
            PassConfig::spec(&format!("{outer}c"))
        }
    }

    /// `spec` with no blocking levels and the whole reduction per call.
    pub fn spec(spec: &str) -> Self {
        PassConfig {
            spec: spec.into(),
            chunk: 0,
            blocks_a: vec![],
            blocks_b: vec![],
        }
    }
}

/// Whether a pass with `a` x `b` output blocks (`a` the smaller loop)
/// reads block-rows of `red` weight blocks streamed from memory, once or
/// twice each, on a core whose policy prefetches from L2: where chunked
/// calls that prefetch the next chunk pay (`Policy::stream_chunk_for`).
pub(crate) fn streams_weights(a: usize, b: usize, red: usize) -> bool {
    let pol = crate::policy();
    pol.stream_prefetch == StreamPrefetch::BeyondL1
        && a < b
        && a <= 2
        && red > pol.stream_row_blocks
}

/// The calling thread's 64-byte aligned block of at least `len` floats,
/// grown once per thread and kept for its life: where a fused optimizer
/// step forms each weight-gradient block, to step the weights from it
/// while it is in L1. The pointer stays valid until the thread asks again
/// for more than it got.
pub(crate) fn thread_block(len: usize) -> *mut f32 {
    thread_local! {
        static BLOCK: std::cell::RefCell<brgemm::AlignedVec<f32>> =
            std::cell::RefCell::new(brgemm::AlignedVec::new(brgemm::buffer::ALIGN));
    }
    BLOCK.with_borrow_mut(|v| {
        if v.len() < len {
            *v = brgemm::aligned_vec(len, 0.0);
        }
        v.as_mut_ptr()
    })
}

/// The largest candidate that divides `x`, else `x` itself when it is small,
/// else the first candidate (with zero padding).
pub(crate) fn pick_block(x: usize, cands: &[usize]) -> usize {
    if let Some(&b) = cands.iter().find(|&&b| x.is_multiple_of(b)) {
        return b;
    }
    if x <= cands[0] {
        return x;
    }
    cands[0]
}

/// The kernel for `d`, on register tile `tile` where given (planned apart
/// from the dispatch cache), else the shared one of the dispatch cache.
pub(crate) fn plan_kernel(d: &Descriptor, tile: Option<RegisterTile>) -> Result<Arc<Kernel>> {
    match tile {
        None => Ok(brgemm::dispatch(d)?),
        Some(t) => {
            let opts = brgemm::KernelOptions {
                tile: Some(t),
                ..Default::default()
            };
            Ok(Arc::new(Kernel::with_options(d, opts)?))
        }
    }
}

/// The register tile of f32 calls whose C blocks are `m` rows by `n`
/// columns, where the CPU policy's [`brgemm::Policy::fc_tile`] covers whole
/// columns of C (m = 64 on AVX-512) and divides `n`; else None (the
/// blocking model's choice). Each k step then reads a whole column of A, so
/// weights streaming from memory (FC forward, the LSTM's recurrent blocks)
/// or dZ (FC backward-weights) come in as contiguous runs
/// (docs/tuning-notes.md, `fc_tile`).
pub(crate) fn column_tile(m: usize, n: usize) -> Option<RegisterTile> {
    let lanes = brgemm::Isa::selected().map_or(0, |i| i.f32_lanes());
    crate::policy()
        .fc_tile()
        .filter(|t| t.mv * lanes == m && n.is_multiple_of(t.nr))
}

/// Kernels for the positions of a chunk in the reduction.
pub(crate) struct Chunked {
    /// The whole reduction in one call (or the last chunk): epilogue on.
    only: Arc<Kernel>,
    first: Arc<Kernel>,
    mid: Arc<Kernel>,
    last: Arc<Kernel>,
}

impl Chunked {
    pub(crate) fn new(base: Descriptor, ep: Epilogue) -> Result<Chunked> {
        Chunked::with_tile(base, ep, None)
    }
    /// As [`Chunked::new`], with the register tile forced when `tile` is
    /// given (planned apart from the dispatch cache).
    pub(crate) fn with_tile(
        base: Descriptor,
        ep: Epilogue,
        tile: Option<RegisterTile>,
    ) -> Result<Chunked> {
        let k = |beta, ep| plan_kernel(&base.beta(beta).epilogue(ep), tile);
        Ok(Chunked {
            only: k(Beta::Zero, ep)?,
            first: k(Beta::Zero, Epilogue::default())?,
            mid: k(Beta::One, Epilogue::default())?,
            last: k(Beta::One, ep)?,
        })
    }
    #[inline]
    pub(crate) fn pick(&self, first: bool, last: bool) -> &Kernel {
        match (first, last) {
            (true, true) => &self.only,
            (true, false) => &self.first,
            (false, false) => &self.mid,
            (false, true) => &self.last,
        }
    }
}

/// The operands of one call of a [`Reduction`], at the call's first
/// reduction step (the stride batch form walks the rest).
pub(crate) struct Operands {
    pub(crate) a: *const f32,
    pub(crate) b: *const f32,
    pub(crate) c: *mut f32,
    pub(crate) bias: *const f32,
}

/// Which operand of the next call a prefetching [`Reduction`] brings in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ahead {
    /// Its A blocks (weights streaming from memory).
    A,
    /// Nothing beyond the kernels' own next-pair prefetch: for a next
    /// call whose blocks are not contiguous (W's in FC backward-data, a
    /// stride of C/bc blocks apart; measured: prefetching the first of
    /// them cost 0.75x at N = 32-64, 4096 x 4096).
    Nothing,
    /// Its C block (a stream of output blocks, each read and written once).
    C,
}

/// A reduction pass: a nest one of whose loops is the reduction, done
/// [`Reduction::chunk`] iterations per BRGEMM call (stride batch form, one
/// A and one B block per iteration), with the kernel for each position of a
/// call in the reduction and the prefetch of the next call's operand.
pub(crate) struct Reduction {
    pub(crate) nest: LoopNest,
    pub(crate) kernels: Chunked,
    red_loop: usize,
    red: usize,
    chunk: usize,
    /// What to prefetch and its elements per reduction step (A) or per
    /// call (C); None when the kernels do not prefetch.
    ahead: Option<(Ahead, usize)>,
}

impl Reduction {
    /// Plans pass `which` over `loops` (steps of 1) whose loop `red_loop`
    /// is the reduction, in `cfg`'s order, with kernels for `desc` (stride
    /// form) and `ep` on the call that completes an output, on register
    /// tile `tile` where given; prefetching kernels bring in the next
    /// call's `ahead`.
    pub(crate) fn new(
        which: &str,
        cfg: &PassConfig,
        mut loops: Vec<LoopDef>,
        red_loop: usize,
        (desc, ep): (Descriptor, Epilogue),
        ahead: Ahead,
        tile: Option<RegisterTile>,
    ) -> Result<Reduction> {
        let red = loops[red_loop].end;
        let chunk = cfg.chunk_of(red);
        loops[red_loop] = LoopDef::new(loops[red_loop].name, red, chunk).reduction();
        let len = match (ahead, desc.batch_form) {
            (Ahead::A, BatchForm::Stride { a, .. }) => a,
            _ => desc.m * desc.n,
        };
        Ok(Reduction {
            nest: cfg.nest(which, loops)?,
            kernels: Chunked::with_tile(desc, ep, tile)?,
            red_loop,
            red,
            chunk,
            ahead: (desc.prefetch != Prefetch::None && ahead != Ahead::Nothing)
                .then_some((ahead, len)),
        })
    }

    /// Whether each output block is completed by one call (the whole
    /// reduction in one chunk).
    pub(crate) fn one_call_per_output(&self) -> bool {
        self.chunk >= self.red
    }

    /// Runs the pass with `kernels` (this pass's unless given). `at(idx)`
    /// gives the operands of the call at nest point `idx`; `after(idx, op,
    /// count, last)` runs after each call (`count` reduction steps; `last`:
    /// it completed its output). With prefetching kernels each call brings
    /// in the operand of the call after it in the nest's order
    /// ([`LoopNest::successor`]), unless that call uses the same one.
    ///
    /// # Safety
    /// For every point of the nest, `at` must give operands the kernels may
    /// read (the chunk's A and B blocks in the stride form; the bias when
    /// the epilogue adds one) and write (C), and points that differ in a
    /// parallel loop must have disjoint C.
    pub(crate) unsafe fn run<F, G>(&self, pool: &Pool, kernels: Option<&Chunked>, at: F, after: G)
    where
        F: Fn(&[usize]) -> Operands + Sync,
        G: Fn(&[usize], &Operands, usize, bool) + Sync,
    {
        let kernels = kernels.unwrap_or(&self.kernels);
        self.nest.run(pool, |i| {
            let r0 = i[self.red_loop];
            let count = self.chunk.min(self.red - r0);
            let (first, last) = (r0 == 0, r0 + count == self.red);
            let op = at(i);
            let (mut ahead, mut len) = (std::ptr::null(), 0);
            if let Some((what, per)) = self.ahead {
                if let Some(next) = self.nest.successor(i) {
                    let nx = at(&next[..i.len()]);
                    (ahead, len) = match what {
                        Ahead::A if nx.a != op.a => {
                            (nx.a, self.chunk.min(self.red - next[self.red_loop]) * per)
                        }
                        Ahead::C if nx.c != op.c => (nx.c as *const f32, per),
                        _ => (ahead, 0),
                    };
                }
            }
            let batch = RawBatch::Stride {
                a: op.a,
                b: op.b,
                count,
            };
            // SAFETY: the caller's contract.
            unsafe {
                kernels
                    .pick(first, last)
                    .execute_raw_ahead(batch, op.c, op.bias, ahead, len)
            };
            after(i, &op, count, last);
        });
    }
}
