//! Block tiling of the generated kernel, shared by the CUDA source and its
//! OpenCL twin.
//!
//! One thread block owns a `bm x bn` tile of C for the whole batch x k loop.
//! Its warps form a `warps_m x warps_n` grid; each warp owns
//! `(bm/warps_m) x (bn/warps_n)` as `frag_m x frag_n` fragments of the
//! `m16n8k16` tensor-core instruction, so a thread holds `4*frag_m*frag_n`
//! f32 accumulators. A and B tiles of depth `bk` go through a ring of
//! `stages` shared-memory buffers.

use crate::dtype::GpuDtype;
use crate::error::{invalid, Result};

/// Shared memory the generated kernels stay under: the static limit every
/// sm_80+ device gives without an opt-in attribute.
pub const SHARED_LIMIT: usize = 48 * 1024;

/// Padding (elements) of each shared-memory row: keeps `ldmatrix` row
/// addresses 16-byte aligned and spreads the 8 rows of one 8x8 matrix over
/// distinct bank groups.
pub const SMEM_PAD: usize = 8;

/// A block tiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tiling {
    /// Rows of C per block (multiple of 16 * warps_m).
    pub bm: usize,
    /// Columns of C per block (multiple of 8 * warps_n).
    pub bn: usize,
    /// k depth of one pipeline stage (multiple of 16).
    pub bk: usize,
    /// Warps along m.
    pub warps_m: usize,
    /// Warps along n.
    pub warps_n: usize,
    /// Shared-memory stages (>= 2).
    pub stages: usize,
}

impl Tiling {
    /// Threads per block.
    pub fn threads(&self) -> usize {
        32 * self.warps_m * self.warps_n
    }
    /// m16 fragments per warp.
    pub fn frag_m(&self) -> usize {
        self.bm / self.warps_m / 16
    }
    /// n8 fragments per warp.
    pub fn frag_n(&self) -> usize {
        self.bn / self.warps_n / 8
    }
    /// Elements per row of the A tile in shared memory (`[bk][bm + pad]`).
    pub fn a_row(&self) -> usize {
        self.bm + SMEM_PAD
    }
    /// Elements per row of the B tile in shared memory (`[bn][bk + pad]`).
    pub fn b_row(&self) -> usize {
        self.bk + SMEM_PAD
    }
    /// Shared-memory bytes for all stages.
    pub fn shared_bytes(&self, dtype: GpuDtype) -> usize {
        self.stages * (self.bk * self.a_row() + self.bn * self.b_row()) * dtype.size()
    }
    /// Accumulator registers per thread.
    pub fn accumulators(&self) -> usize {
        4 * self.frag_m() * self.frag_n()
    }
    /// Blocks per SM the tiling is meant to keep resident (the
    /// `__launch_bounds__` minimum), which fixes the register budget.
    /// Scalar f32 tiles need the whole register file of one block.
    pub fn min_blocks(&self, dtype: GpuDtype) -> usize {
        if dtype == GpuDtype::F32 {
            1
        } else if self.threads() >= 256 {
            2
        } else {
            4
        }
    }
    /// Registers per thread the tiling assumes: what `min_blocks` blocks of
    /// `threads` leave of an SM's 64K registers, capped at the ISA's 255.
    pub fn register_budget(&self, dtype: GpuDtype) -> usize {
        (65536 / (self.threads() * self.min_blocks(dtype))).min(255)
    }

    /// The default for a problem: the largest of 128/64/32 that the problem
    /// fills in each dimension; warps own 64x32 (or 32x32) of C; as many
    /// stages (2..=4) as fit in 48 KiB.
    /// `m` x `n` is C's shape, `dtype` the operands' type.
    pub fn heuristic(m: usize, n: usize, dtype: GpuDtype) -> Tiling {
        let pick = |x: usize| {
            if x > 64 {
                128
            } else if x > 32 {
                64
            } else {
                32
            }
        };
        let (bm, bn) = (pick(m), pick(n));
        let warps_m = (bm / 64).max(1);
        let warps_n = (bn / 32).max(1);
        let mut t = Tiling {
            bm,
            bn,
            bk: 32,
            warps_m,
            warps_n,
            stages: 4,
        };
        while t.stages > 2 && t.shared_bytes(dtype) > SHARED_LIMIT {
            t.stages -= 1;
        }
        if t.shared_bytes(dtype) > SHARED_LIMIT {
            t.bk = 16;
        }
        t
    }

    /// Checks that the fragments tile the block and the stages fit.
    pub fn validate(&self, dtype: GpuDtype) -> Result<()> {
        let name = format!("{self:?}");
        if self.warps_m == 0 || self.warps_n == 0 || self.threads() > 1024 {
            return Err(invalid("tiling", name, "needs 1..=32 warps"));
        }
        if self.bm == 0 || !self.bm.is_multiple_of(16 * self.warps_m) {
            return Err(invalid(
                "tiling.bm",
                self.bm,
                "must be a multiple of 16 * warps_m",
            ));
        }
        if self.bn == 0 || !self.bn.is_multiple_of(8 * self.warps_n) {
            return Err(invalid(
                "tiling.bn",
                self.bn,
                "must be a multiple of 8 * warps_n",
            ));
        }
        if self.bk == 0 || !self.bk.is_multiple_of(16) {
            return Err(invalid(
                "tiling.bk",
                self.bk,
                "must be a multiple of 16 (one mma k-step)",
            ));
        }
        if self.stages < 2 {
            return Err(invalid(
                "tiling.stages",
                self.stages,
                "the pipeline needs at least 2",
            ));
        }
        let bytes = self.shared_bytes(dtype);
        if bytes > SHARED_LIMIT {
            return Err(invalid(
                "tiling",
                name,
                format!("needs {bytes} bytes of shared memory, more than {SHARED_LIMIT}"),
            ));
        }
        Ok(())
    }
}
