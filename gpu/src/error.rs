//! Errors of the GPU crate: each names the bad value or the missing piece.

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A descriptor, buffer or argument is invalid; the message names it.
    #[error("invalid {what} = {value}: {why}")]
    Invalid {
        /// The parameter.
        what: String,
        /// Its value.
        value: String,
        /// The rule it breaks.
        why: String,
    },
    /// The CUDA driver or NVRTC library is not there (checked before use).
    #[error("CUDA unavailable: {0}")]
    NoCuda(String),
    /// No OpenCL platform or device.
    #[error("OpenCL unavailable: {0}")]
    NoOpenCl(String),
    /// The generated source did not compile; the log and the source's name.
    #[error("compiling {name} failed:\n{log}")]
    Compile {
        /// Kernel name.
        name: String,
        /// Compiler log.
        log: String,
    },
    /// A CUDA driver, NVRTC or cuBLAS call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// An OpenCL call failed.
    #[error("OpenCL: {0}")]
    OpenCl(String),
}

pub(crate) fn invalid(
    what: impl Into<String>,
    value: impl std::fmt::Display,
    why: impl Into<String>,
) -> Error {
    Error::Invalid {
        what: what.into(),
        value: value.to_string(),
        why: why.into(),
    }
}

/// The CPU descriptor's validation errors, which the GPU descriptor shares:
/// the field, its value and the rule keep their names.
impl From<brgemm::Error> for Error {
    fn from(e: brgemm::Error) -> Error {
        match e {
            brgemm::Error::InvalidDescriptor {
                field,
                value,
                reason,
            } => invalid(field, value, reason),
            other => invalid("descriptor", other, "rejected"),
        }
    }
}
