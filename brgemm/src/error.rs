//! The one error type of the kernel crate.

use crate::Isa;

/// Everything that can go wrong when planning or calling a kernel.
///
/// Every variant names the offending field or operand and its value, so a
/// message read in a log is enough to find the bad call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A descriptor field is out of range (zero dimension, leading dimension
    /// smaller than the matrix, a size that overflows).
    #[error("invalid descriptor: {field} = {value}: {reason}")]
    InvalidDescriptor {
        /// The descriptor field, e.g. `"lda"`.
        field: &'static str,
        /// Its value, as written by the caller.
        value: String,
        /// Why the value is refused.
        reason: String,
    },
    /// A slice handed to a safe call is shorter than the descriptor and batch need.
    #[error("{operand} slice too short: needs at least {needed} elements, got {len}")]
    ShortSlice {
        /// Which operand: `"A"`, `"B"`, `"C"`, `"bias"`, `"A[3]"`, ...
        operand: String,
        /// The smallest length that works.
        needed: usize,
        /// The length given.
        len: usize,
    },
    /// The batch arguments do not match the descriptor's batch form, or their
    /// parts disagree (e.g. different counts of A and B pointers).
    #[error("batch mismatch: {0}")]
    BatchMismatch(String),
    /// A batch count or offset makes an address overflow.
    #[error("overflow: {what} = {value} makes addresses overflow")]
    Overflow {
        /// The quantity that overflowed, e.g. `"batch"`.
        what: &'static str,
        /// Its value.
        value: usize,
    },
    /// The requested instruction set is not available on this CPU or target.
    #[error("ISA {isa} is not supported on this machine")]
    IsaUnsupported {
        /// The instruction set asked for.
        isa: Isa,
    },
    /// `BRGEMM_ISA` (or a parse call) named no known instruction set.
    #[error("unknown ISA {value:?}: expected one of avx512, avx2, neon, portable, reference")]
    UnknownIsa {
        /// The string that was given.
        value: String,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn invalid(
    field: &'static str,
    value: impl ToString,
    reason: impl Into<String>,
) -> Error {
    Error::InvalidDescriptor {
        field,
        value: value.to_string(),
        reason: reason.into(),
    }
}
