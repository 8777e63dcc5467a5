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
//! `BRGEMM_CPU_POLICY=zen5|zen4|default` picks a row by name instead of CPUID
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

/// When a bf16 backward-weights pass beats the f32 pass of the same shape.
/// Its cost beyond the kernel is the rounding of its operands (X
/// transposed to channel-major rows, dY interleaved into pairs) and the
/// f32 dW blocks it stores; where the kernel is only about twice the f32
/// one, short reductions per dW element or little work per rounded element
/// leave nothing to gain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16UpdRule {
    /// The shortest reduction (rows or pixels summed into each dW element)
    /// at which bf16 pays.
    pub min_reduction: usize,
    /// The fewest flops per rounded element at which bf16 pays, elements of
    /// the transposed operand counted twice.
    pub min_flops_per_rounded: usize,
    /// dW above this many bytes: its f32 stores stream to memory and bound
    /// the bf16 and the f32 pass alike, so [`Bf16UpdRule::min_reduction_streamed`]
    /// applies.
    pub streamed_dw_bytes: usize,
    /// The shortest reduction at which bf16 pays once dW streams.
    pub min_reduction_streamed: usize,
}

impl Bf16UpdRule {
    /// bf16 always (AMX's rate leaves any rounding paid for).
    pub const ALWAYS: Bf16UpdRule = Bf16UpdRule {
        min_reduction: 0,
        min_flops_per_rounded: 0,
        streamed_dw_bytes: usize::MAX,
        min_reduction_streamed: 0,
    };
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
    /// Convolution backward-weights at a stride above 1 (X rows read at the
    /// stride) prefetches the next pair.
    pub conv_upd_prefetch_strided: bool,
    /// 1x1 convolution backward-weights, where every call reads rows no
    /// earlier call read, prefetches the next call's (dY, else X).
    pub conv_upd_prefetch_rows: bool,
    /// The register tile of a convolution gather call that is a single pair
    /// producing 64-channel output columns, on AVX-512 (`None`: the
    /// blocking model's choice).
    pub single_pair_tile: Option<RegisterTile>,
    /// The register tile of FC forward and backward-weights calls whose C
    /// blocks are as tall as the tile (whole 64-row columns on AVX-512) and
    /// whose width it divides (`None`: the blocking model's choice).
    pub fc_tile: Option<RegisterTile>,
    /// The AVX512-BF16 kernel's main register tile for C blocks whose rows
    /// are whole tiles of it (`None`: 2 x 12 everywhere).
    pub avx512bf16_tile: Option<RegisterTile>,
    /// [`Policy::single_pair_tile`] also for gather calls of several pairs
    /// (taps, channel blocks) producing 64-channel output columns.
    pub pair_tile_any_batch: bool,
    /// The bf16 kernels in order of preference where supported (AMX also
    /// needs every dimension a multiple of 32).
    pub bf16_order: [Bf16Isa; 3],
    /// Whether AVX512-BF16 runs a bf16 pass faster than the f32 pass on
    /// the same shape: the layers run bf16 only on AMX or where this holds
    /// (else they stay f32).
    pub avx512bf16_beats_f32: bool,
    /// Where an AVX512-BF16 backward-weights pass still loses to the f32
    /// pass, which the bf16 plans then run instead ([`Bf16UpdRule`]).
    pub avx512bf16_upd: Bf16UpdRule,
    /// The fewest minibatch rows at which a linear layer on AVX512-BF16
    /// beats f32 once it packs its weights to bf16 every step (a pass
    /// over W that the f32 layer does not make).
    pub avx512bf16_fc_min_rows: usize,
    /// As [`Policy::avx512bf16_fc_min_rows`] where the optimizer step is
    /// fused into backward-weights, which then packs each block as it
    /// steps it (no packing pass, no dW stored).
    pub avx512bf16_fc_min_rows_fused: usize,
    /// The fewest flops per activation element (the layer's input and
    /// output elements) at which a convolution on AVX512-BF16 beats f32:
    /// below it the layer is bound by memory, and rounding its input in a
    /// sweep of its own costs what the kernel saves.
    pub avx512bf16_conv_min_flops_per_elem: usize,
    /// Reduction blocks per call where a pass's default order splits a
    /// long reduction and runs it outermost.
    pub split_chunk: usize,
    /// Reduction blocks per call of a weight block-row streamed from
    /// memory with the reduction innermost (`BeyondL1` cores).
    pub stream_chunk: usize,
    /// [`Policy::stream_chunk`] where the calls' minibatch blocks are
    /// under 32 rows (FC forward at 16 rows).
    pub stream_chunk_narrow: usize,
    /// The longest block-row, in reduction blocks, not treated as streamed.
    pub stream_row_blocks: usize,
}

impl Policy {
    /// AMD Zen 5 (family 0x1a): the default row but for prefetching from
    /// L2 (streamed operands, FC dW blocks, the LSTM's recurrent weights
    /// from 2 MiB, bf16 operands from 256 KiB) and the 4x4 tile for
    /// single-pair convolution calls (docs/tuning-notes.md).
    pub const ZEN5: Policy = Policy {
        name: "zen5",
        stream_prefetch: StreamPrefetch::BeyondL1,
        fc_upd_prefetch_from: Some(2 << 20),
        rnn_prefetch_from: 2 << 20,
        bf16_prefetch_from: Some(256 << 10),
        single_pair_tile: Some(RegisterTile { mv: 4, nr: 4 }),
        ..Policy::DEFAULT
    };
    /// AMD Zen 4 (family 0x19 with AVX-512): the Zen 5 row's prefetch and
    /// tile entries, which measured as well here, but no bf16 prefetch; the
    /// 4x4 tile for gather calls of any batch, for FC forward and
    /// backward-weights calls and for the AVX512-BF16 kernel; strided and
    /// 1x1 convolution updates prefetch; AVX512-BF16 beats f32 except on
    /// convolutions bound by memory (docs/tuning-notes.md).
    pub const ZEN4: Policy = Policy {
        name: "zen4",
        bf16_prefetch_from: None,
        conv_upd_prefetch_strided: true,
        conv_upd_prefetch_rows: true,
        pair_tile_any_batch: true,
        fc_tile: Some(RegisterTile { mv: 4, nr: 4 }),
        avx512bf16_tile: Some(RegisterTile { mv: 4, nr: 4 }),
        avx512bf16_beats_f32: true,
        avx512bf16_upd: Bf16UpdRule {
            min_reduction: 32,
            min_flops_per_rounded: 100,
            streamed_dw_bytes: 16 << 20,
            min_reduction_streamed: 32,
        },
        avx512bf16_fc_min_rows: 64,
        avx512bf16_fc_min_rows_fused: 48,
        avx512bf16_conv_min_flops_per_elem: 64,
        ..Policy::ZEN5
    };
    /// Intel Sapphire Rapids, and every core not measured.
    pub const DEFAULT: Policy = Policy {
        name: "default",
        stream_prefetch: StreamPrefetch::BeyondL2,
        fc_upd_prefetch_from: None,
        rnn_prefetch_from: 8 << 20,
        bf16_prefetch_from: None,
        conv_upd_prefetch_strided: false,
        conv_upd_prefetch_rows: false,
        single_pair_tile: None,
        fc_tile: None,
        avx512bf16_tile: None,
        pair_tile_any_batch: false,
        bf16_order: [Bf16Isa::Amx, Bf16Isa::Avx512Bf16, Bf16Isa::Fp32],
        avx512bf16_beats_f32: false,
        avx512bf16_upd: Bf16UpdRule::ALWAYS,
        avx512bf16_fc_min_rows: 0,
        avx512bf16_fc_min_rows_fused: 0,
        avx512bf16_conv_min_flops_per_elem: 0,
        split_chunk: 8,
        stream_chunk: 16,
        stream_chunk_narrow: 1,
        stream_row_blocks: 32,
    };
    /// Every row.
    pub const TABLE: [Policy; 3] = [Policy::ZEN5, Policy::ZEN4, Policy::DEFAULT];

    /// The row named `name` (case-insensitive).
    pub fn by_name(name: &str) -> Result<Policy> {
        Policy::TABLE
            .into_iter()
            .find(|p| p.name.eq_ignore_ascii_case(name.trim()))
            .ok_or_else(|| invalid("BRGEMM_CPU_POLICY", name, "expected zen5, zen4 or default"))
    }

    /// [`Policy::single_pair_tile`] where the kernels run AVX-512 (the tile
    /// is counted in 16-lane vectors).
    pub fn single_pair_tile(&self) -> Option<RegisterTile> {
        self.single_pair_tile
            .filter(|_| Isa::selected() == Ok(Isa::Avx512))
    }

    /// [`Policy::fc_tile`] where the kernels run AVX-512.
    pub fn fc_tile(&self) -> Option<RegisterTile> {
        self.fc_tile.filter(|_| Isa::selected() == Ok(Isa::Avx512))
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

    /// Whether a backward-weights pass on the bf16 kernel `isa` beats the
    /// f32 pass of its shape: `reduction` rows or pixels summed into each
    /// dW element, `flops_per_rounded` as in [`Bf16UpdRule`], `dw_bytes`
    /// the f32 dW it stores. AMX: always; AVX512-BF16: by
    /// [`Policy::avx512bf16_upd`]; a kernel forced by name
    /// (`BRGEMM_BF16_ISA`): always, so that it is what runs.
    pub fn bf16_upd_pays(
        &self,
        isa: Bf16Isa,
        reduction: usize,
        flops_per_rounded: f64,
        dw_bytes: usize,
    ) -> bool {
        let rule = self.avx512bf16_upd;
        let min_reduction = if dw_bytes > rule.streamed_dw_bytes {
            rule.min_reduction.max(rule.min_reduction_streamed)
        } else {
            rule.min_reduction
        };
        isa != Bf16Isa::Avx512Bf16
            || Bf16Isa::is_forced()
            || (reduction >= min_reduction
                && flops_per_rounded >= rule.min_flops_per_rounded as f64)
    }

    /// Whether a linear layer of `rows` minibatch rows on the bf16 kernel
    /// `isa` beats the f32 layer, its weights packed every step (by the
    /// fused optimizer step where `fused_step`, else in a pass of their
    /// own): where [`Policy::bf16_beats_f32`] holds and, on AVX512-BF16,
    /// from [`Policy::avx512bf16_fc_min_rows`] rows (or
    /// [`Policy::avx512bf16_fc_min_rows_fused`]); a kernel forced by name
    /// (`BRGEMM_BF16_ISA`) always.
    pub fn bf16_fc_pays(&self, isa: Bf16Isa, rows: usize, fused_step: bool) -> bool {
        if Bf16Isa::is_forced() {
            return true;
        }
        let min_rows = match fused_step {
            true => self.avx512bf16_fc_min_rows_fused,
            false => self.avx512bf16_fc_min_rows,
        };
        self.bf16_beats_f32(isa) && (isa != Bf16Isa::Avx512Bf16 || rows >= min_rows)
    }

    /// Whether a convolution on the bf16 kernel `isa` beats its f32 passes,
    /// doing `flops_per_elem` forward flops per element of its input and
    /// output: where [`Policy::bf16_beats_f32`] holds and, on AVX512-BF16,
    /// from [`Policy::avx512bf16_conv_min_flops_per_elem`]; a kernel forced
    /// by name (`BRGEMM_BF16_ISA`) always.
    pub fn bf16_conv_pays(&self, isa: Bf16Isa, flops_per_elem: f64) -> bool {
        if Bf16Isa::is_forced() {
            return true;
        }
        self.bf16_beats_f32(isa)
            && (isa != Bf16Isa::Avx512Bf16
                || flops_per_elem >= self.avx512bf16_conv_min_flops_per_elem as f64)
    }

    /// Reduction blocks per call of weights streamed from memory, for calls
    /// whose minibatch block has `rows` rows: [`Policy::stream_chunk`],
    /// [`Policy::stream_chunk_narrow`] under 32 rows.
    pub fn stream_chunk_for(&self, rows: usize) -> usize {
        if rows < 32 {
            self.stream_chunk_narrow
        } else {
            self.stream_chunk
        }
        .max(1)
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
    P.get_or_init(|| match crate::env::Setting::CpuPolicy.value() {
        Some(s) if !s.trim().is_empty() => Policy::by_name(&s),
        _ => Ok(if crate::cpu::is_zen5() {
            Policy::ZEN5
        } else if crate::cpu::is_zen4() {
            Policy::ZEN4
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
        assert_eq!(Policy::by_name("ZEN4").unwrap(), Policy::ZEN4);
        let e = Policy::by_name("icelake").unwrap_err().to_string();
        assert!(e.contains("icelake"), "{e}");
    }

    #[test]
    fn bf16_backward_weights_pays_by_the_rule_of_its_kernel() {
        if Bf16Isa::is_forced() {
            return; // a kernel named by BRGEMM_BF16_ISA always runs
        }
        let (z, isa) = (Policy::ZEN4, Bf16Isa::Avx512Bf16);
        // FC at 16 rows; 1x1 256->64 and 64->256 convolutions (57 and 85
        // flops per rounded element); a 1x1 512->128 one (114); a 3x3 one;
        // AMX at 16 rows.
        let (small, large) = (4 << 20, 64 << 20);
        assert!(!z.bf16_upd_pays(isa, 16, 2730.0, small));
        assert!(z.bf16_upd_pays(isa, 32, 682.0, small));
        assert!(!z.bf16_upd_pays(isa, 50176, 56.9, small));
        assert!(!z.bf16_upd_pays(isa, 50176, 85.3, small));
        assert!(z.bf16_upd_pays(isa, 12544, 113.8, small));
        assert!(z.bf16_upd_pays(isa, 50176, 384.0, small));
        assert!(z.bf16_upd_pays(Bf16Isa::Amx, 16, 1.0, large));
        // FC 4096 x 4096 (64 MiB of dW): 16 rows stay f32, 32 run bf16.
        assert!(!z.bf16_upd_pays(isa, 16, 2730.0, large));
        assert!(z.bf16_upd_pays(isa, 32, 2730.0, large));
        // Linear layers pack their weights every step: 64 rows up, 48
        // where the fused step packs them.
        assert!(!z.bf16_fc_pays(isa, 48, false));
        assert!(z.bf16_fc_pays(isa, 64, false));
        assert!(!z.bf16_fc_pays(isa, 32, true));
        assert!(z.bf16_fc_pays(isa, 48, true));
        assert!(!Policy::DEFAULT.bf16_fc_pays(isa, 1024, true));
        // Convolutions at 56x56: 1x1 64->32 (43 flops per activation
        // element), 64->64 (64), 64->256 (102), 256->128 (171); a 3x3
        // 64->64 (576).
        assert!(!z.bf16_conv_pays(isa, 42.7));
        assert!(z.bf16_conv_pays(isa, 64.0));
        assert!(z.bf16_conv_pays(isa, 102.4));
        assert!(z.bf16_conv_pays(isa, 170.7));
        assert!(z.bf16_conv_pays(isa, 576.0));
        assert!(z.bf16_conv_pays(Bf16Isa::Amx, 1.0));
        assert!(!Policy::DEFAULT.bf16_conv_pays(isa, 576.0));
        assert!(!z.bf16_conv_pays(Bf16Isa::Fp32, 576.0));
    }
}
