//! What every pass's plan shares: its loop order and blocking
//! ([`PassConfig`], with the default order's heuristic), the block-size
//! choice, and the kernels of a reduction split into chunks ([`Chunked`]).

use crate::error::Result;
use crate::loops::{LoopDef, LoopNest};
use brgemm::{Beta, Descriptor, Epilogue, Kernel, StreamPrefetch};
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
    /// levels on the first two loops and its spec.
    pub(crate) fn nest(&self, pass: &str, mut loops: Vec<LoopDef>) -> Result<LoopNest> {
        loops[0].blocks = self.blocks_a.clone();
        loops[1].blocks = self.blocks_b.clone();
        LoopNest::named(pass, loops, &self.spec)
    }

    /// Reduction blocks per call when a pass splits its reduction.
    pub const HEURISTIC_CHUNK: usize = 8;

    /// The default order of a pass with `a` x `b` output blocks and `red`
    /// reduction blocks: both output loops parallel, the one with more blocks
    /// outside, the reduction innermost. Past [`Self::HEURISTIC_CHUNK`]
    /// reduction blocks the reduction is split into chunks and goes
    /// outermost (`cAB`/`cBA`), where the CPU policy says the split pays;
    /// where it prefetches from L2 and the weights stream from memory, the
    /// reduction stays innermost in chunks of [`Self::STREAM_CHUNK`]. The
    /// measurements: `docs/tuning-notes.md`.
    pub fn heuristic(a: usize, b: usize, red: usize) -> Self {
        let outer = if a >= b { "AB" } else { "BA" };
        let prefetch = crate::policy().stream_prefetch;
        let split_pays = match prefetch {
            StreamPrefetch::BeyondL2 => true,
            StreamPrefetch::BeyondL1 => a >= b,
        };
        if red > Self::HEURISTIC_CHUNK && split_pays {
            PassConfig {
                chunk: Self::HEURISTIC_CHUNK,
                ..PassConfig::spec(&format!("c{outer}"))
            }
        } else if prefetch == StreamPrefetch::BeyondL1
            && a < b
            && a <= 2
            && red > Self::STREAM_ROW_BLOCKS
        {
            PassConfig {
                chunk: Self::STREAM_CHUNK,
                ..PassConfig::spec(&format!("{outer}c"))
            }
        } else {
            PassConfig::spec(&format!("{outer}c"))
        }
    }

    /// Reduction blocks per call for streamed block-rows (see
    /// [`PassConfig::heuristic`]): 256 KiB of 64x64 blocks.
    pub const STREAM_CHUNK: usize = 16;
    /// Longest block-row, in reduction blocks, not treated as streamed:
    /// 512 KiB of 64x64 blocks, half of the L2 where this was measured.
    pub const STREAM_ROW_BLOCKS: usize = 32;

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
        tile: Option<brgemm::RegisterTile>,
    ) -> Result<Chunked> {
        let k = |beta, ep| {
            let d = base.beta(beta).epilogue(ep);
            match tile {
                None => brgemm::dispatch(&d),
                Some(t) => Kernel::with_options(
                    &d,
                    brgemm::KernelOptions {
                        isa: None,
                        tile: Some(t),
                    },
                )
                .map(Arc::new),
            }
        };
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
