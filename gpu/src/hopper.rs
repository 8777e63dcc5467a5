//! The sm_90a path: which descriptors it takes, and its block tiling.
//!
//! On a Hopper GPU the `mma.sync` kernel leaves the tensor cores idle for
//! much of each k-step (measured on an H100: 198 TFLOP/s against cuBLAS's
//! 748 on 4096x4096 x (64x64) bf16). The sm_90a kernel
//! ([`crate::codegen::wgmma_source`]) feeds `wgmma` from shared memory that
//! TMA fills: one producer warpgroup issues the bulk tensor copies into a
//! ring of stages in dynamic shared memory, signalled by `mbarrier`s; two
//! consumer warpgroups each own 64 rows of the block's 128 and release a
//! stage as soon as their `wgmma`s on it have completed.
//!
//! TMA reads A and B through tensor maps of rank 3 (rows, columns, batch
//! entry), so it takes the stride batch form with 16-byte aligned leading
//! dimensions and strides; the edges of C, k and the batch are the
//! tensor map's bounds, zero-filled by the copy engine.

use crate::desc::{GpuBatch, GpuDescriptor, GpuDtype};
use crate::error::{invalid, Result};

/// Dynamic shared memory a block may opt into on sm_90 (227 KiB).
pub const HOPPER_SHARED_LIMIT: usize = 227 * 1024;

/// Which kernel a [`crate::GpuBrgemm`] launches on CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuPath {
    /// The sm_90a kernel where the device is sm_90 and the descriptor
    /// qualifies ([`hopper_eligible`]), else `mma.sync`.
    Auto,
    /// `cp.async` + `ldmatrix` + `mma.sync` (sm_80 and up; the only path
    /// of f32 operands and of the offset and address forms).
    Mma,
    /// TMA + `wgmma` (sm_90a); an error where it does not apply.
    Wgmma,
}

/// The block tiling of the sm_90a kernel: 128 rows of C (two consumer
/// warpgroups of `m64`), `bn` columns (the `wgmma` N), k depth 64 (one
/// 128-byte swizzle row of 16-bit elements), `stages` TMA stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HopperTiling {
    /// Columns of C per block: 64, 128 or 256.
    pub bn: usize,
    /// Shared-memory stages (2..=8).
    pub stages: usize,
}

impl HopperTiling {
    /// Rows of C per block.
    pub const BM: usize = 128;
    /// k depth of one stage.
    pub const BK: usize = 64;
    /// Threads per block: a producer warpgroup and two consumers.
    pub const THREADS: usize = 384;

    /// Bytes of one stage (A: 128 x 64, B: bn x 64, 16-bit).
    pub fn stage_bytes(&self) -> usize {
        (Self::BM + self.bn) * Self::BK * 2
    }
    /// Dynamic shared memory of a block: the stages, two mbarriers per
    /// stage, and 1 KiB to align the ring to the 128-byte swizzle's
    /// 1024-byte atom.
    pub fn shared_bytes(&self) -> usize {
        self.stages * self.stage_bytes() + 16 * self.stages + 1024
    }
    /// For C of `n` columns: 256 x 3 stages from 256 columns, else 128
    /// (64 for narrow C) x 4 stages. Measured on an H100 (4096x4096 x
    /// (64x64), bf16, one run): 128x256/3 stages 692.8 TFLOP/s, /4 stages
    /// 677.4; 128x128/4 stages 559.8, /6 stages 562.0 (cuBLAS 744.0).
    /// The wider tile reads each A stage for twice the columns.
    pub fn heuristic(n: usize) -> HopperTiling {
        match n {
            256.. => HopperTiling { bn: 256, stages: 3 },
            65.. => HopperTiling { bn: 128, stages: 4 },
            _ => HopperTiling { bn: 64, stages: 4 },
        }
    }
    /// Checks the tile width, the stage count and the shared memory.
    pub fn validate(&self) -> Result<()> {
        if ![64, 128, 256].contains(&self.bn) {
            return Err(invalid(
                "hopper tiling bn",
                self.bn,
                "must be 64, 128 or 256",
            ));
        }
        if !(2..=8).contains(&self.stages) {
            return Err(invalid(
                "hopper tiling stages",
                self.stages,
                "must be 2..=8",
            ));
        }
        let b = self.shared_bytes();
        if b > HOPPER_SHARED_LIMIT {
            return Err(invalid(
                "hopper tiling",
                format!("{self:?}"),
                format!("needs {b} bytes of shared memory, more than {HOPPER_SHARED_LIMIT}"),
            ));
        }
        Ok(())
    }
}

/// Why `d` cannot take the sm_90a path (`None`: it can): TMA needs 16-bit
/// operands in the stride form, leading dimensions and strides that are
/// whole 16-byte units, and nonzero strides.
pub fn hopper_ineligible(d: &GpuDescriptor) -> Option<String> {
    if d.dtype == GpuDtype::F32 {
        return Some("f32 operands (wgmma takes bf16 and f16 here)".into());
    }
    let GpuBatch::Stride { a, b } = d.batch_form else {
        return Some(format!(
            "the {:?} batch form (TMA takes strides)",
            d.batch_form
        ));
    };
    for (what, v) in [
        ("lda", d.lda),
        ("ldb", d.ldb),
        ("stride a", a),
        ("stride b", b),
    ] {
        if v == 0 || v % 8 != 0 {
            return Some(format!(
                "{what} = {v} (TMA needs a nonzero multiple of 8 elements)"
            ));
        }
    }
    None
}

/// Whether `d` can take the sm_90a path.
pub fn hopper_eligible(d: &GpuDescriptor) -> bool {
    hopper_ineligible(d).is_none()
}

/// The order of a tensor map's two outer dimensions: TMA wants strides
/// that grow with the dimension, so where an operand's batch stride is
/// below its leading dimension (B_i = B + i*k inside one wide B), the
/// batch is dimension 1 and the columns dimension 2.
pub(crate) fn batch_inner(ld: usize, stride: usize) -> bool {
    stride < ld
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heuristic_tilings_fit_and_validate() {
        for n in [1, 64, 65, 128, 200, 256, 4096] {
            let t = HopperTiling::heuristic(n);
            t.validate().unwrap();
            assert!(
                t.stages >= 3 && t.bn <= n.next_power_of_two().max(64),
                "{t:?}"
            );
        }
        let e = HopperTiling { bn: 256, stages: 8 }
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("shared memory"), "{e}");
        let e = HopperTiling { bn: 96, stages: 4 }
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("96"), "{e}");
    }

    #[test]
    fn eligibility_names_what_stops_it() {
        let d = GpuDescriptor::new(128, 128, 64).validate().unwrap();
        assert!(hopper_eligible(&d));
        let f = GpuDescriptor::new(128, 128, 64)
            .dtype(GpuDtype::F32)
            .validate()
            .unwrap();
        assert!(hopper_ineligible(&f).unwrap().contains("f32"));
        let o = GpuDescriptor::new(128, 128, 64)
            .batch(GpuBatch::Offset)
            .validate()
            .unwrap();
        assert!(hopper_ineligible(&o).unwrap().contains("Offset"));
        let l = GpuDescriptor::new(100, 128, 64)
            .lda(100)
            .validate()
            .unwrap();
        assert!(hopper_ineligible(&l).unwrap().contains("lda = 100"));
    }
}
