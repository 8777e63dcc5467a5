//! The data loaders' error ([`crate::data`], [`crate::idx`]).

/// Errors of the data loaders.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A line of a CSV file is malformed.
    #[error("{source_name} line {line}: {reason}")]
    Parse {
        /// The file.
        source_name: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// A binary file is malformed.
    #[error("{source_name}: {reason}")]
    Format {
        /// The file.
        source_name: String,
        /// What is wrong.
        reason: String,
    },
    /// A data set is not where it was looked for.
    #[error("{0}")]
    Missing(String),
    /// Reading failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
