//! `mpirun` for the tests that launch jobs: one launch at a time per test
//! binary, each with an OpenMPI session directory of its own.
//!
//! OpenMPI 4 makes its session directory (`TMPDIR/ompi.HOST.UID`) by
//! checking for it and then creating it, so two launches that start at once,
//! as tests running in parallel threads do, can fail in `orte_init` with
//! "File exists" (seen in CI, and about once in 30 paired launches here).
//! Under a base directory of its own a launch competes with nobody. Taking
//! turns besides keeps two jobs' ranks off the same cores, which the tests'
//! time limits assume.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Runs `mpirun`, with the arguments and environment that `configure` adds,
/// to its end.
pub fn run(configure: impl FnOnce(&mut Command)) -> std::io::Result<Output> {
    static TURN: Mutex<()> = Mutex::new(());
    static LAUNCHES: AtomicUsize = AtomicUsize::new(0);
    // A test that failed while holding the turn leaves nothing to repair.
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let base: PathBuf = std::env::temp_dir().join(format!(
        "brgemm-mpirun-{}-{}",
        std::process::id(),
        LAUNCHES.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&base)?;
    let mut cmd = Command::new("mpirun");
    // OpenMPI 4 (ORTE) and 5 (PRRTE) name the setting differently.
    cmd.env("OMPI_MCA_orte_tmpdir_base", &base)
        .env("PRTE_MCA_prte_tmpdir_base", &base);
    configure(&mut cmd);
    let out = cmd.output();
    std::fs::remove_dir_all(&base).ok();
    out
}
