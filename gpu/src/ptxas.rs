//! What ptxas reports about a compiled kernel (`ptxas -v`): registers per
//! thread, spill stores, spill loads and stack frame, each read from its own
//! field, for the checks that generated kernels keep their accumulators in
//! registers within the tiling's budget ([`crate::Tiling::register_budget`]).
//!
//! ptxas prints, per entry function:
//!
//! ```text
//! ptxas info    : Function properties for brgemm_...
//!     96 bytes stack frame, 100 bytes spill stores, 136 bytes spill loads
//! ptxas info    : Used 40 registers, used 1 barriers, 96 bytes cumulative stack size, ...
//! ```

/// One entry function's resource usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Registers per thread.
    pub registers: usize,
    /// Bytes stored to local memory because registers ran out.
    pub spill_stores: usize,
    /// Bytes loaded back from those spills.
    pub spill_loads: usize,
    /// Bytes of local-memory stack frame.
    pub stack_frame: usize,
}

impl Usage {
    /// The usage of the first entry function in a `ptxas -v` log; None when
    /// a field is missing. Each number is the one right before its own
    /// words (`N bytes spill stores`), never a neighbour's on the same line.
    pub fn parse(log: &str) -> Option<Usage> {
        let words: Vec<&str> = log
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|w| !w.is_empty())
            .collect();
        // The number before the first occurrence of `key` (a word sequence).
        let before = |key: &[&str]| -> Option<usize> {
            let at = (1..words.len()).find(|&i| words[i..].starts_with(key))?;
            words[at - 1].parse().ok()
        };
        // "Used N registers": the number after "Used".
        let registers = (0..words.len().saturating_sub(2))
            .find(|&i| words[i] == "Used" && words[i + 2] == "registers")
            .and_then(|i| words[i + 1].parse().ok())?;
        Some(Usage {
            registers,
            spill_stores: before(&["bytes", "spill", "stores"])?,
            spill_loads: before(&["bytes", "spill", "loads"])?,
            stack_frame: before(&["bytes", "stack", "frame"])?,
        })
    }

    /// No spills and no stack frame: everything in registers.
    pub fn in_registers(&self) -> bool {
        self.spill_stores == 0 && self.spill_loads == 0 && self.stack_frame == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Recorded: ptxas 12.9 on a bf16 variant with its minimum blocks per
    /// SM raised to 12 in the PTX, which caps it at 40 registers.
    const SPILLING: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'brgemm_bf16_m128n8k100_ld136_108_129_p8_a3f000000_b1_bias_identity_t64x32x32w2x2s3' for 'sm_80'
ptxas info    : Function properties for brgemm_bf16_m128n8k100_ld136_108_129_p8_a3f000000_b1_bias_identity_t64x32x32w2x2s3
    96 bytes stack frame, 100 bytes spill stores, 136 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 96 bytes cumulative stack size, 21504 bytes smem, 404 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 31.775 ms
";

    /// Recorded: the same variant as generated (launch bound of 4 blocks).
    const CLEAN: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'brgemm_bf16_m128n8k100_ld136_108_129_p8_a3f000000_b1_bias_identity_t64x32x32w2x2s3' for 'sm_80'
ptxas info    : Function properties for brgemm_bf16_m128n8k100_ld136_108_129_p8_a3f000000_b1_bias_identity_t64x32x32w2x2s3
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 84 registers, used 1 barriers, 21504 bytes smem, 404 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 33.418 ms
";

    #[test]
    fn each_field_is_read_from_its_own_words() {
        assert_eq!(
            Usage::parse(SPILLING),
            Some(Usage {
                registers: 40,
                spill_stores: 100,
                spill_loads: 136,
                stack_frame: 96,
            })
        );
        assert!(!Usage::parse(SPILLING).unwrap().in_registers());
        let clean = Usage::parse(CLEAN).unwrap();
        assert_eq!((clean.registers, clean.in_registers()), (84, true));
    }

    #[test]
    fn a_log_without_the_fields_is_none() {
        assert_eq!(
            Usage::parse("ptxas fatal   : Unresolved extern function"),
            None
        );
        assert_eq!(Usage::parse(""), None);
    }
}
