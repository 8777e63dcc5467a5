//! Tuning files: the per-shape FC tunings `examples/tune --save` writes (a
//! JSON list of [`TunedFc`]), read back for [`crate::Fc::with_tuning`].

use crate::error::{Error, Result};
use crate::fc::FcTuning;

/// Which passes a stored tuning entry applies to: one FC shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TunedFc {
    /// Minibatch.
    pub n: usize,
    /// Input features.
    pub c: usize,
    /// Output features.
    pub k: usize,
    /// The configuration.
    pub tuning: FcTuning,
}

/// Loads the tuning for `(n, c, k)` from a JSON file written by
/// `examples/tune --save` (a list of [`TunedFc`]); `Ok(None)` when the file
/// has no entry for it. An unreadable or malformed file is an error naming
/// it.
pub fn load(path: &std::path::Path, n: usize, c: usize, k: usize) -> Result<Option<FcTuning>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    parse(&text, n, c, k).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}

/// [`load`] on the file's text (what the fuzz target drives). The tuning
/// it returns is not yet validated: [`crate::Fc::with_tuning`] does that.
pub fn parse(text: &str, n: usize, c: usize, k: usize) -> Result<Option<FcTuning>> {
    let all: Vec<TunedFc> = serde_json::from_str(text).map_err(|e| Error::Io(e.to_string()))?;
    Ok(all
        .into_iter()
        .find(|t| (t.n, t.c, t.k) == (n, c, k))
        .map(|t| t.tuning))
}
