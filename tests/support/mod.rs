//! What the facade's MPI tests share: the built examples and `mpirun`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

pub mod mpirun;

/// The built example `name` (built by the test script, or by `cargo build
/// --features mpi --examples` in this test's profile).
pub fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().unwrap();
    let bin = deps
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.exists(),
        "{} not built (--features mpi --examples)",
        bin.display()
    );
    bin
}

/// `mpirun ARGS -np NP train_mpi EXTRA` (one thread per rank): success, the
/// output, the time taken.
pub fn train_mpi(mpirun_args: &[&str], np: usize, extra: &[&str]) -> (bool, String, Duration) {
    let t = Instant::now();
    let out = mpirun::run(|c| {
        c.args(mpirun_args)
            .args(["--timeout", "120", "-np"])
            .arg(np.to_string())
            .arg(example("train_mpi"))
            .args(extra)
            .env("BRGEMM_NUM_THREADS", "1");
    })
    .expect("mpirun is on PATH (apt-get install openmpi-bin)");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text, t.elapsed())
}
