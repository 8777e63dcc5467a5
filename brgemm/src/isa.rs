//! Instruction sets, run-time detection and the `BRGEMM_ISA` override.

use crate::error::{Error, Result};
use std::fmt;
use std::sync::OnceLock;

/// An instruction set a kernel can be built for.
///
/// Ordered from strongest to weakest; [`Isa::best`] picks the first one the CPU
/// supports. `Reference` and `Portable` run everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// AVX-512F, 32 zmm registers: the hand-tuned kernel.
    Avx512,
    /// AVX2 + FMA, 16 ymm registers.
    Avx2,
    /// AArch64 Advanced SIMD, 32 q registers.
    Neon,
    /// Portable SIMD through the `wide` crate (whatever the build's target features give).
    Portable,
    /// Plain scalar loops: the test oracle and last fallback.
    Reference,
}

impl Isa {
    /// Every ISA this crate knows, strongest first.
    pub const ALL: [Isa; 5] = [
        Isa::Avx512,
        Isa::Avx2,
        Isa::Neon,
        Isa::Portable,
        Isa::Reference,
    ];

    /// The name used by `BRGEMM_ISA` and in bench output.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
            Isa::Reference => "reference",
        }
    }

    /// Parses a name as accepted by `BRGEMM_ISA`.
    pub fn parse(s: &str) -> Result<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| Error::UnknownIsa {
                value: s.to_string(),
            })
    }

    /// Whether this CPU (and this build's target) can run kernels of this ISA.
    pub fn is_supported(self) -> bool {
        crate::kernels::available(self.name(), crate::DataType::F32)
    }

    /// Every ISA this machine supports, strongest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The strongest supported ISA, ignoring `BRGEMM_ISA`.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|i| i.is_supported())
            .unwrap_or(Isa::Reference)
    }

    /// The ISA that default planning uses: `BRGEMM_ISA` when set (an error if
    /// it names an unknown or unsupported ISA), else [`Isa::best`]. The
    /// variable is read once per process.
    pub fn selected() -> Result<Isa> {
        static SELECTED: OnceLock<Result<Isa>> = OnceLock::new();
        SELECTED
            .get_or_init(|| match crate::env::Setting::Isa.value() {
                Some(s) if !s.trim().is_empty() => {
                    let isa = Isa::parse(&s)?;
                    if isa.is_supported() {
                        Ok(isa)
                    } else {
                        Err(Error::IsaUnsupported { isa })
                    }
                }
                _ => Ok(Isa::best()),
            })
            .clone()
    }

    /// Number of f32 lanes in one vector register of this ISA (1 for the reference).
    pub fn f32_lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 | Isa::Portable => 8,
            Isa::Neon => 4,
            Isa::Reference => 1,
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
