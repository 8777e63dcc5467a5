//! Errors of the primitives: bad shapes, bad loop specs, kernel errors.

/// Everything a primitive can refuse. Messages name the bad value.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A loop-nest spec string or loop definition is invalid.
    #[error("loop spec {spec:?}: {reason}")]
    Spec {
        /// The spec string as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A shape, size or block is invalid.
    #[error("bad shape: {what} = {value}: {reason}")]
    Shape {
        /// The parameter, e.g. `"bn"`.
        what: String,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
    /// A buffer handed in has the wrong length.
    #[error("buffer {what}: expected {expected} elements, got {got}")]
    Buffer {
        /// Which buffer.
        what: String,
        /// Required length.
        expected: usize,
        /// Given length.
        got: usize,
    },
    /// Planning a BRGEMM failed.
    #[error("kernel: {0}")]
    Kernel(#[from] brgemm::Error),
    /// A training step produced a loss or gradient that is not finite; the
    /// optimizer did not run, so the weights are those before the step.
    #[error("training stopped at step {step}: the {what} is {value} (not finite)")]
    NonFinite {
        /// 0-based step of the run.
        step: u64,
        /// `"loss"` or `"gradient norm"`.
        what: String,
        /// The value.
        value: f64,
    },
    /// A setting (hyper-parameter, option, file) is invalid.
    #[error("bad setting: {what} = {value}: {reason}")]
    Setting {
        /// The setting, e.g. `"learning rate"`.
        what: String,
        /// Its value.
        value: String,
        /// Why.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("io: {0}")]
    Io(String),
}

/// Shorthand.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn shape(
    what: impl Into<String>,
    value: impl ToString,
    reason: impl Into<String>,
) -> Error {
    Error::Shape {
        what: what.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

pub(crate) fn setting(
    what: impl Into<String>,
    value: impl ToString,
    reason: impl Into<String>,
) -> Error {
    Error::Setting {
        what: what.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Elements one f32 buffer may hold: an allocation is at most `isize::MAX`
/// bytes.
const MAX_ELEMS: usize = isize::MAX as usize / 4;

/// The product of `dims`, or an error naming `what` and the factors when
/// it overflows or exceeds what one buffer can hold: plans check their
/// buffer sizes with this before any block arithmetic runs.
pub(crate) fn elems(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&p| p <= MAX_ELEMS)
        .ok_or_else(|| {
            let f: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
            shape(what, f.join(" x "), "too large for one buffer")
        })
}

pub(crate) fn check_buf(what: &str, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(Error::Buffer {
            what: what.to_string(),
            expected,
            got,
        });
    }
    Ok(())
}
