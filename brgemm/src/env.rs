//! Every environment variable the workspace reads, in one table
//! ([`Setting`]), and the one place they are read from
//! ([`Setting::value`]). Each setting is read once per process by the code
//! it steers (the kernels' ISA, the CPU policy, the thread pool, ...), and
//! never by a layer's constructor: a program that wants a setting of its
//! own passes it in (the examples read `BRGEMM_TUNING` once and hand the
//! file to the plans). A set value that does not parse is an error naming
//! the variable and the value, never a silent default.

use std::ffi::OsString;

/// A setting taken from the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Setting {
    /// `BRGEMM_ISA`: the f32 kernels' ISA (`avx512`, `avx2`, `neon`,
    /// `portable`) instead of the best this CPU has.
    Isa,
    /// `BRGEMM_BF16_ISA`: the bf16 kernel (`amx`, `avx512bf16`, `fp32`,
    /// `reference`), run wherever bf16 is asked for, whatever its speed.
    Bf16Isa,
    /// `BRGEMM_CPU_POLICY`: the per-CPU policy row by name (`zen5`,
    /// `zen4`, `default`) instead of the one CPUID picks.
    CpuPolicy,
    /// `BRGEMM_PIPELINE`: `0` turns the pipelined register tiles off (read
    /// at each plan, so that one process can compare both).
    Pipeline,
    /// `BRGEMM_AMX_DENY`: set to anything, acts as if Linux refused the
    /// AMX tile permission (to test the fallback).
    AmxDeny,
    /// `BRGEMM_SCHEDULE`: `static` or `steal` (default), how loop nests
    /// share their iterations between threads.
    Schedule,
    /// `BRGEMM_NUM_THREADS`: threads of the process-wide pool.
    NumThreads,
    /// `BRGEMM_MIN_PARALLEL_FLOPS`: the work below which a pass runs on
    /// the calling thread alone.
    MinParallelFlops,
    /// `BRGEMM_DENORMALS`: `flush` (default) or `keep` IEEE subnormals in
    /// the passes.
    Denormals,
    /// `BRGEMM_TUNING`: a tuning file (`examples/tune --save`) the
    /// examples hand to the plans of the shapes it holds.
    Tuning,
    /// `BRGEMM_CUDA_PTX`: `1` loads the generated CUDA kernels as PTX for
    /// the driver to compile, instead of cubins.
    CudaPtx,
}

impl Setting {
    /// Every setting.
    pub const ALL: [Setting; 11] = [
        Setting::Isa,
        Setting::Bf16Isa,
        Setting::CpuPolicy,
        Setting::Pipeline,
        Setting::AmxDeny,
        Setting::Schedule,
        Setting::NumThreads,
        Setting::MinParallelFlops,
        Setting::Denormals,
        Setting::Tuning,
        Setting::CudaPtx,
    ];

    /// The variable's name.
    pub fn name(self) -> &'static str {
        match self {
            Setting::Isa => "BRGEMM_ISA",
            Setting::Bf16Isa => "BRGEMM_BF16_ISA",
            Setting::CpuPolicy => "BRGEMM_CPU_POLICY",
            Setting::Pipeline => "BRGEMM_PIPELINE",
            Setting::AmxDeny => "BRGEMM_AMX_DENY",
            Setting::Schedule => "BRGEMM_SCHEDULE",
            Setting::NumThreads => "BRGEMM_NUM_THREADS",
            Setting::MinParallelFlops => "BRGEMM_MIN_PARALLEL_FLOPS",
            Setting::Denormals => "BRGEMM_DENORMALS",
            Setting::Tuning => "BRGEMM_TUNING",
            Setting::CudaPtx => "BRGEMM_CUDA_PTX",
        }
    }

    /// The value when the variable is set (and valid unicode).
    pub fn value(self) -> Option<String> {
        std::env::var(self.name()).ok()
    }

    /// The value when the variable is set, as the OS gives it (a path).
    pub fn value_os(self) -> Option<OsString> {
        std::env::var_os(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::Setting;
    use std::collections::HashSet;

    /// Names are distinct and every `"BRGEMM_..."` name the workspace's
    /// library and example sources spell out is in the table (outside tests,
    /// where test harness variables live).
    #[test]
    fn the_table_names_every_variable_the_sources_read() {
        let names: HashSet<_> = Setting::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(names.len(), Setting::ALL.len());
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dirs = [
            "brgemm/src",
            "primitives/src",
            "nn/src",
            "gpu/src",
            "distributed/src",
            "src",
            "examples",
        ];
        let mut files = vec![];
        for d in dirs {
            let mut stack = vec![root.join(d)];
            while let Some(p) = stack.pop() {
                for e in std::fs::read_dir(&p).unwrap().flatten() {
                    let p = e.path();
                    if p.is_dir() {
                        stack.push(p);
                    } else if p.extension().is_some_and(|x| x == "rs") {
                        files.push(p);
                    }
                }
            }
        }
        assert!(files.len() > 50, "{} source files", files.len());
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            // The sources up to their unit tests.
            let code = text.split("#[cfg(test)]").next().unwrap();
            for (i, _) in code.match_indices("\"BRGEMM_") {
                let name: String = code[i + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                assert!(
                    names.contains(name.as_str()),
                    "{name} in {} is not in brgemm::env::Setting",
                    f.display()
                );
            }
        }
    }
}
