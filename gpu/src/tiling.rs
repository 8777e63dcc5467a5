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

/// Registers beyond the accumulators that a generated kernel may hold
/// ([`Tiling::register_budget`]). Measured with ptxas 12.9 over the NVRTC
/// test's sweep (sm_80 and sm_90): 52-135 beyond 16-64 accumulators; the
/// budget keeps a margin of 9 over the largest.
pub const REGISTER_OVERHEAD: usize = 144;

/// Registers a tensor-core kernel needs beside its accumulators at the
/// least (the A and B fragments of one k step, addresses, indices): fewer
/// and ptxas spills ([`Tiling::min_blocks`] keeps fewer blocks resident
/// rather than go under it).
pub const MIN_OVERHEAD: usize = 64;

/// Shared memory the portable default tilings stay under: what every
/// sm_80+ device gives a block without the opt-in attribute, and what
/// OpenCL GPUs commonly have.
pub const SHARED_LIMIT: usize = 48 * 1024;

/// Shared memory the CUDA default tilings stay under: the smallest opt-in
/// maximum of an sm_80+ device (99 KiB on sm_86/sm_89; sm_80 allows 163,
/// sm_90 227). The CUDA kernel takes its tiles in dynamic shared memory
/// with the opt-in attribute set.
pub const SHARED_OPTIN_LIMIT: usize = 99 * 1024;

/// Shared memory any tiling may ask for: the largest opt-in maximum of a
/// device (sm_90's 227 KiB). What the device at hand gives (its opt-in
/// maximum, an OpenCL device's local memory) is checked at launch, and a
/// tiling that needs more is refused there, naming both sizes.
pub const SHARED_MAX: usize = 227 * 1024;

/// Padding (elements) of each shared-memory row: keeps `ldmatrix` row
/// addresses 16-byte aligned and spreads the 8 rows of one 8x8 matrix over
/// distinct bank groups.
pub const SMEM_PAD: usize = 8;

/// The tensor-core tilings `bench gpu` measures against the CUDA default on
/// large shapes: 64x32 and 64x64 warp tiles, k 32 and 64 per stage, rings
/// within 99 KiB and past it (sm_80 and sm_90 devices only), four warps
/// and eight. The NVRTC test assembles each for sm_80 and sm_90 without
/// spills; `docs/gpu-notes.md` has their figures.
pub const MMA_CANDIDATES: [Tiling; 10] = {
    const fn t(bm: usize, bn: usize, bk: usize, wm: usize, wn: usize, stages: usize) -> Tiling {
        Tiling {
            bm,
            bn,
            bk,
            warps_m: wm,
            warps_n: wn,
            stages,
        }
    }
    [
        t(128, 128, 32, 2, 4, 4),
        t(128, 128, 32, 2, 2, 4),
        t(128, 256, 32, 2, 4, 3),
        t(256, 128, 32, 4, 2, 3),
        t(128, 128, 64, 2, 2, 2),
        t(128, 128, 64, 2, 4, 2),
        t(128, 128, 64, 2, 2, 3),
        t(128, 128, 64, 2, 2, 4),
        t(128, 256, 64, 2, 4, 3),
        t(256, 128, 64, 4, 2, 3),
    ]
};

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
    /// Local-memory bytes of the OpenCL twin's emulated tensor core: each
    /// lane's A (8) and B (4) fragment slots, as f32, per fragment.
    pub fn fragment_scratch_bytes(&self) -> usize {
        self.threads() * (8 * self.frag_m() + 4 * self.frag_n()) * 4
    }
    /// Accumulator registers per thread.
    pub fn accumulators(&self) -> usize {
        4 * self.frag_m() * self.frag_n()
    }
    /// Blocks per SM the tiling is meant to keep resident (the
    /// `__launch_bounds__` minimum), which fixes the register budget.
    /// Scalar f32 tiles need the whole register file of one block. Tensor
    /// core tiles aim at 2 blocks of 256 threads (4 of fewer), and at fewer
    /// where that would leave a thread under [`MIN_OVERHEAD`] registers
    /// beside its accumulators (64x64 warp tiles hold 128).
    pub fn min_blocks(&self, dtype: GpuDtype) -> usize {
        if dtype == GpuDtype::F32 {
            return 1;
        }
        let mut blocks = if self.threads() >= 256 { 2 } else { 4 };
        while blocks > 1 && 65536 / (self.threads() * blocks) < self.accumulators() + MIN_OVERHEAD {
            blocks -= 1;
        }
        blocks
    }
    /// Registers per thread the launch bound leaves: what `min_blocks`
    /// blocks of `threads` leave of an SM's 64K registers, capped at the
    /// ISA's 255. ptxas enforces it (by spilling), so it is no check.
    pub fn register_cap(&self, dtype: GpuDtype) -> usize {
        (65536 / (self.threads() * self.min_blocks(dtype))).min(255)
    }

    /// Registers per thread a kernel of this tiling may use: the
    /// accumulators plus [`REGISTER_OVERHEAD`] (addresses, the A and B
    /// fragments in flight, loop and stage indices), in ptxas's units of
    /// 8, and never above the launch bound's [`Tiling::register_cap`]. A
    /// generated kernel over it carries more than its tile needs, which
    /// costs occupancy before ptxas would ever spill: the NVRTC test fails
    /// it.
    pub fn register_budget(&self, dtype: GpuDtype) -> usize {
        (self.accumulators() + REGISTER_OVERHEAD)
            .next_multiple_of(8)
            .min(self.register_cap(dtype))
    }

    /// Slices of the `batch x k` tiles to split a launch into: one while the
    /// C tiles (`blocks`) already give every one of the device's `units`
    /// multiprocessors a block, else enough for each to have one (at most
    /// one slice per tile of `bk`, so every slice has work), capped at 256.
    pub fn split(blocks: usize, tiles: usize, units: usize) -> usize {
        if blocks == 0 || blocks >= units || tiles < 2 {
            return 1;
        }
        units.div_ceil(blocks).min(tiles).min(256)
    }

    /// The default for a problem: the largest of 128/64/32 that the problem
    /// fills in each dimension; warps own 64x32 (or 32x32) of C; as many
    /// stages (2..=4) as fit in 48 KiB ([`SHARED_LIMIT`]).
    /// `m` x `n` is C's shape, `dtype` the operands' type.
    pub fn heuristic(m: usize, n: usize, dtype: GpuDtype) -> Tiling {
        Self::heuristic_within(m, n, dtype, SHARED_LIMIT)
    }

    /// The CUDA default, within [`SHARED_OPTIN_LIMIT`] (what every sm_80+
    /// device gives a block that opts in). Tensor-core tiles of 128x128 C
    /// take four warps of 64x64 and k 64 per stage: twice the mma per
    /// `ldmatrix` and half the barriers per k of the portable 64x32 warps
    /// (measured on an H200, bf16, 4096x4096 x (64x64) batch 64, one run:
    /// 333.9 TFLOP/s against 279.2 for the portable tile with 4 stages; the
    /// instruction's own ceiling there is 641). Others: the portable tile.
    /// Either with as many stages (up to 4) as fit.
    pub fn heuristic_cuda(m: usize, n: usize, dtype: GpuDtype) -> Tiling {
        let t = Self::heuristic_within(m, n, dtype, SHARED_OPTIN_LIMIT);
        if dtype == GpuDtype::F32 || (t.bm, t.bn) != (128, 128) {
            return t;
        }
        let wide = Tiling {
            bk: 64,
            warps_m: 2,
            warps_n: 2,
            ..t
        };
        wide.fit_stages(dtype, SHARED_OPTIN_LIMIT)
    }

    /// This tiling with as many stages (4 down to 2) as fit in `limit`.
    fn fit_stages(mut self, dtype: GpuDtype, limit: usize) -> Tiling {
        self.stages = 4;
        while self.stages > 2 && self.shared_bytes(dtype) > limit {
            self.stages -= 1;
        }
        self
    }

    fn heuristic_within(m: usize, n: usize, dtype: GpuDtype, limit: usize) -> Tiling {
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
        }
        .fit_stages(dtype, limit);
        if t.shared_bytes(dtype) > limit {
            t.bk = 16;
        }
        t
    }

    /// Checks that the fragments tile the block and the stages fit in
    /// [`SHARED_MAX`].
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
        if bytes > SHARED_MAX {
            return Err(invalid(
                "tiling",
                name,
                format!("needs {bytes} bytes of shared memory, more than {SHARED_MAX}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget binds below the launch bound where the launch bound
    /// leaves the whole register file (one-warp and f32 tilings), and
    /// never above it.
    #[test]
    fn the_register_budget_is_below_the_launch_bound_where_that_is_loose() {
        for (m, n) in [(32, 32), (64, 64), (128, 128), (128, 32)] {
            for dt in [GpuDtype::F32, GpuDtype::Bf16] {
                let t = Tiling::heuristic(m, n, dt);
                let (b, cap) = (t.register_budget(dt), t.register_cap(dt));
                assert!(b <= cap && b % 8 == 0 || b == cap, "{t:?}: {b} vs {cap}");
                assert!(b >= t.accumulators() + REGISTER_OVERHEAD.min(cap - t.accumulators()));
            }
        }
        let t = Tiling::heuristic(32, 32, GpuDtype::F32);
        assert_eq!(t.register_cap(GpuDtype::F32), 255);
        assert!(t.register_budget(GpuDtype::F32) < 255, "{t:?}");
    }

    /// 64x64 warp tiles (128 accumulators) keep fewer blocks resident
    /// instead of a launch bound that would make ptxas spill; the 64x32
    /// defaults keep theirs.
    #[test]
    fn large_warp_tiles_lower_the_resident_blocks() {
        let t = |bm, bn, warps_m, warps_n| Tiling {
            bm,
            bn,
            bk: 32,
            warps_m,
            warps_n,
            stages: 3,
        };
        let bf = GpuDtype::Bf16;
        assert_eq!(Tiling::heuristic(128, 128, bf).min_blocks(bf), 2);
        let wide = Tiling::heuristic_cuda(4096, 4096, bf);
        assert_eq!((wide.bm, wide.bn, wide.bk), (128, 128, 64));
        assert_eq!((wide.warps_m, wide.warps_n, wide.stages), (2, 2, 2));
        assert_eq!(wide.min_blocks(bf), 2);
        // f32 (no tensor cores) and smaller tiles keep the portable warps.
        assert_eq!(Tiling::heuristic_cuda(4096, 4096, GpuDtype::F32).warps_n, 4);
        assert_eq!(Tiling::heuristic_cuda(64, 64, bf).warps_n, 2);
        assert_eq!(t(64, 32, 2, 2).min_blocks(bf), 4);
        for (tile, blocks) in [(t(128, 128, 2, 2), 2), (t(128, 256, 2, 4), 1)] {
            assert_eq!(tile.accumulators(), 128);
            assert_eq!(tile.min_blocks(bf), blocks, "{tile:?}");
            assert!(tile.register_cap(bf) >= tile.accumulators() + MIN_OVERHEAD);
        }
    }

    #[test]
    fn split_fills_an_h100_whenever_the_work_allows() {
        let sms = 132;
        // The bench's shapes (m, n, k, batch) and a large one.
        for (m, n, k, batch) in [
            (128usize, 128usize, 64usize, 64usize),
            (256, 128, 64, 32),
            (128, 128, 64, 1),
            (4096, 4096, 64, 4),
        ] {
            let t = Tiling::heuristic(m, n, GpuDtype::Bf16);
            let blocks = m.div_ceil(t.bm) * n.div_ceil(t.bn);
            let tiles = batch * k.div_ceil(t.bk);
            let s = Tiling::split(blocks, tiles, sms);
            assert!(s >= 1 && s <= tiles.max(1));
            if blocks >= sms {
                assert_eq!(s, 1, "{m}x{n}: enough C tiles already");
            } else {
                // As many blocks as SMs, or every tile its own slice.
                assert!(
                    blocks * s >= sms || s == tiles,
                    "{m}x{n}x{k} batch {batch}: {blocks} x {s}"
                );
            }
        }
        assert_eq!(Tiling::split(1, 128, 132), 128);
        assert_eq!(Tiling::split(2, 64, 132), 64);
        assert_eq!(Tiling::split(1, 1, 132), 1);
    }
}
