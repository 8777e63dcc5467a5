//! The per-microarchitecture policy: every CPU-dependent plan-time choice
//! of the kernels and the primitives above them, in one table, chosen once
//! from CPUID (BLIS's per-CPU context is the model).
//!
//! A primitive never tests the CPU itself: it reads [`policy()`]. Each row
//! holds what was measured on that core; the measurements behind each entry
//! are in `docs/tuning-notes.md` (same process, alternating, as the project
//! measures). Cores not measured get [`Policy::DEFAULT`], the Sapphire
//! Rapids row, whose choices are the conservative ones (prefetch off where
//! it was not shown to pay).
//!
//! `BRGEMM_CPU_POLICY=zen5|default` picks a row by name instead of CPUID
//! (for experiments: compare a plan made both ways across processes); it is
//! read once, with CPUID, the first time a plan asks.

use crate::bf16::Bf16Isa;
use crate::error::invalid;
use crate::{Isa, Prefetch, RegisterTile, Result};
use std::sync::OnceLock;

/// From where a streamed operand (a weight panel re-read on every call)
/// must come for [`Prefetch::NextPair`] kernels to beat plain ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamPrefetch {
    /// Only operands streamed from L3 or memory (the core's own L2
    /// prefetchers keep up with L2-resident panels).
    BeyondL2,
    /// Also operands streamed from L2 (plain kernels wait on L2).
    BeyondL1,
}

/// One row of the table: what a microarchitecture was measured to want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The row's name, as `BRGEMM_CPU_POLICY` takes it.
    pub name: &'static str,
    /// From where the FC, convolution and bf16 passes prefetch streamed
    /// operands (the FC heuristic's reduction chunks follow it).
    pub stream_prefetch: StreamPrefetch,
    /// FC backward-weights with at most two N blocks and dW larger than
    /// this many bytes prefetches the next dW block (`None`: never).
    pub fc_upd_prefetch_from: Option<usize>,
    /// The RNN prefetches the next recurrent block once R is larger than
    /// this many bytes.
    pub rnn_prefetch_from: usize,
    /// The bf16 FC passes prefetch the next pair once a call's operands
    /// exceed this many bytes (`None`: never).
    pub bf16_prefetch_from: Option<usize>,
    /// The register tile of a convolution gather call that is a single pair
    /// producing 64-channel output columns, on AVX-512 (`None`: the
    /// blocking model's choice).
    pub single_pair_tile: Option<RegisterTile>,
    /// The bf16 kernels in order of preference where supported (AMX also
    /// needs every dimension a multiple of 32).
    pub bf16_order: [Bf16Isa; 3],
    /// Whether AVX512-BF16 runs a bf16 pass faster than the f32 pass on
    /// the same shape: the layers run bf16 only on AMX or where this holds
    /// (else they stay f32).
    pub avx512bf16_beats_f32: bool,
    /// Reduction blocks per call where a pass's default order splits a
    /// long reduction and runs it outermost.
    pub split_chunk: usize,
    /// Reduction blocks per call of a weight block-row streamed from
    /// memory with the reduction innermost (`BeyondL1` cores).
    pub stream_chunk: usize,
    /// The longest block-row, in reduction blocks, not treated as streamed.
    pub stream_row_blocks: usize,
}

impl Policy {
    /// AMD Zen 5 (family 0x1a).
    pub const ZEN5: Policy = Policy {
        name: "zen5",
        stream_prefetch: StreamPrefetch::BeyondL1,
        fc_upd_prefetch_from: Some(2 << 20),
        rnn_prefetch_from: 2 << 20,
        bf16_prefetch_from: Some(256 << 10),
        single_pair_tile: Some(RegisterTile { mv: 4, nr: 4 }),
        bf16_order: [Bf16Isa::Amx, Bf16Isa::Avx512Bf16, Bf16Isa::Fp32],
        avx512bf16_beats_f32: false,
        split_chunk: 8,
        stream_chunk: 16,
        stream_row_blocks: 32,
    };
    /// Intel Sapphire Rapids, and every core not measured.
    pub const DEFAULT: Policy = Policy {
        name: "default",
        stream_prefetch: StreamPrefetch::BeyondL2,
        fc_upd_prefetch_from: None,
        rnn_prefetch_from: 8 << 20,
        bf16_prefetch_from: None,
        single_pair_tile: None,
        bf16_order: [Bf16Isa::Amx, Bf16Isa::Avx512Bf16, Bf16Isa::Fp32],
        avx512bf16_beats_f32: false,
        split_chunk: 8,
        stream_chunk: 16,
        stream_row_blocks: 32,
    };
    /// Every row.
    pub const TABLE: [Policy; 2] = [Policy::ZEN5, Policy::DEFAULT];

    /// The row named `name` (case-insensitive).
    pub fn by_name(name: &str) -> Result<Policy> {
        Policy::TABLE
            .into_iter()
            .find(|p| p.name.eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| invalid("BRGEMM_CPU_POLICY", name, "expected zen5 or default"))
    }

    /// [`Policy::single_pair_tile`] where the kernels run AVX-512 (the tile
    /// is counted in 16-lane vectors).
    pub fn single_pair_tile(&self) -> Option<RegisterTile> {
        self.single_pair_tile
            .filter(|_| Isa::selected() == Ok(Isa::Avx512))
    }

    /// Whether a pass on the bf16 kernel `isa` beats the f32 pass of the
    /// same shape on this core (AMX: always; AVX512-BF16: as measured; the
    /// f32 kernel on widened inputs and the reference: never).
    pub fn bf16_beats_f32(&self, isa: Bf16Isa) -> bool {
        match isa {
            Bf16Isa::Amx => true,
            Bf16Isa::Avx512Bf16 => self.avx512bf16_beats_f32,
            Bf16Isa::Fp32 | Bf16Isa::Reference => false,
        }
    }

    /// [`Prefetch::NextPair`] when `cond`, else [`Prefetch::None`].
    pub fn prefetch_if(cond: bool) -> Prefetch {
        if cond {
            Prefetch::NextPair
        } else {
            Prefetch::None
        }
    }
}

/// This core's row: `BRGEMM_CPU_POLICY` when set (an unknown name is an
/// error), else from the CPUID vendor and family. Chosen once per process.
pub fn policy() -> Result<&'static Policy> {
    static P: OnceLock<Result<Policy>> = OnceLock::new();
    P.get_or_init(|| match std::env::var("BRGEMM_CPU_POLICY") {
        Ok(s) if !s.trim().is_empty() => Policy::by_name(&s),
        _ => Ok(if crate::cpu::is_zen5() {
            Policy::ZEN5
        } else {
            Policy::DEFAULT
        }),
    })
    .as_ref()
    .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_found_by_name_and_unknown_names_are_errors() {
        assert_eq!(Policy::by_name(" Zen5").unwrap(), Policy::ZEN5);
        assert_eq!(Policy::by_name("default").unwrap(), Policy::DEFAULT);
        let e = Policy::by_name("icelake").unwrap_err().to_string();
        assert!(e.contains("icelake"), "{e}");
    }
}
