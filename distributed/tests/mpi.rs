//! Launched from `cargo test` through `mpirun` (OpenMPI): rank counts agree,
//! uneven splits work, a panicking rank ends the job, buckets sum right.

use std::path::PathBuf;
use std::time::{Duration, Instant};

#[path = "../../tests/support/mpirun.rs"]
mod launch;

fn mpirun(np: usize, args: &[&str]) -> (bool, String, Duration) {
    let t = Instant::now();
    let out = launch::run(|c| {
        c.args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--timeout",
            "60",
            "-np",
        ])
        .arg(np.to_string())
        .arg(env!("CARGO_BIN_EXE_ddp_check"))
        .args(args)
        .env("OMPI_MCA_btl", "self,vader");
    })
    .expect("mpirun is on PATH (apt-get install openmpi-bin)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, t.elapsed())
}

fn params(np: usize, global: usize, tag: &str) -> Vec<f64> {
    params_of("mlp", np, global, tag)
}

fn params_of(model: &str, np: usize, global: usize, tag: &str) -> Vec<f64> {
    params_with(model, np, global, tag, &[])
}

fn params_with(model: &str, np: usize, global: usize, tag: &str, extra: &[&str]) -> Vec<f64> {
    let path: PathBuf =
        std::env::temp_dir().join(format!("ddp-{model}-{tag}-{np}-{}.txt", std::process::id()));
    let p = path.to_str().unwrap();
    let g = global.to_string();
    let mut args = vec![
        "train",
        "--model",
        model,
        "--steps",
        "6",
        "--global-batch",
        &g,
        "--out",
        p,
    ];
    args.extend(extra);
    let (ok, text, _) = mpirun(np, &args);
    assert!(ok, "mpirun -np {np} failed:\n{text}");
    let v = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| l.parse().unwrap())
        .collect();
    std::fs::remove_file(&path).ok();
    v
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f64::max);
    assert!(worst < 1e-4, "{what}: worst relative difference {worst:e}");
    assert!(a.iter().zip(b).any(|(x, y)| x != y) || a == b);
}

#[test]
fn two_ranks_end_with_the_weights_of_one() {
    let one = params(1, 24, "even");
    let two = params(2, 24, "even");
    assert_close(&two, &one, "2 ranks vs 1");
}

/// Gradients sent as bf16 (half the bytes): the weights follow the f32
/// run's to bf16's precision, and do differ from them (bf16 was used).
#[test]
fn bf16_gradient_exchange_follows_the_f32_run() {
    let one = params(1, 24, "bf16-ref");
    let two = params_with("mlp", 2, 24, "bf16", &["--grad-bf16"]);
    assert_eq!(one.len(), two.len());
    let worst = one
        .iter()
        .zip(&two)
        .map(|(x, y)| (x - y).abs() / (1e-2 + x.abs()))
        .fold(0.0, f64::max);
    assert!(
        worst < 5e-2,
        "bf16 vs f32: worst relative difference {worst:e}"
    );
    assert!(one != two, "bf16 gave exactly the f32 weights: not used?");
}

#[test]
fn three_ranks_with_an_uneven_split() {
    let one = params(1, 25, "uneven");
    let three = params(3, 25, "uneven");
    assert_close(&three, &one, "3 ranks (9+8+8 rows) vs 1");
}

#[test]
fn cnn_two_and_three_ranks_end_with_the_weights_of_one() {
    let one = params_of("cnn", 1, 24, "even");
    let two = params_of("cnn", 2, 24, "even");
    assert_close(&two, &one, "CNN 2 ranks vs 1");
    let one = params_of("cnn", 1, 25, "uneven");
    let three = params_of("cnn", 3, 25, "uneven");
    assert_close(&three, &one, "CNN 3 ranks (9+8+8 images) vs 1");
}

#[test]
fn a_residual_graph_on_two_and_three_ranks_ends_with_the_weights_of_one() {
    let one = params_of("graph", 1, 24, "even");
    let two = params_of("graph", 2, 24, "even");
    assert_close(&two, &one, "graph 2 ranks vs 1");
    let one = params_of("graph", 1, 25, "uneven");
    let three = params_of("graph", 3, 25, "uneven");
    assert_close(&three, &one, "graph 3 ranks (9+8+8 images) vs 1");
}

/// Every progress strategy sums the same gradients: the loop-nest hook
/// testing at every chance (1 us), the communication thread, and tests
/// between layers only, on 2 and 3 ranks of a CNN.
#[test]
fn every_progress_strategy_ends_with_the_weights_of_one_rank() {
    let one = params_of("cnn", 1, 25, "progress");
    for p in ["loop:1", "thread:10", "layers"] {
        let tag = format!("progress-{}", p.replace(':', "-"));
        let two = params_with("cnn", 2, 25, &tag, &["--progress", p, "--bucket-kb", "1"]);
        assert_close(&two, &one, &format!("CNN 2 ranks, progress {p}, vs 1"));
        let three = params_with("cnn", 3, 25, &tag, &["--progress", p]);
        assert_close(&three, &one, &format!("CNN 3 ranks, progress {p}, vs 1"));
    }
}

#[test]
fn a_panicking_rank_ends_the_job_quickly() {
    let (ok, text, took) = mpirun(2, &["train", "--steps", "50", "--panic-rank", "1"]);
    assert!(!ok, "job should fail:\n{text}");
    assert!(text.contains("deliberate panic"), "{text}");
    assert!(took < Duration::from_secs(20), "took {took:?}:\n{text}");
}

#[test]
fn bucketed_allreduce_equals_the_local_sum() {
    let (ok, text, _) = mpirun(3, &["allreduce"]);
    assert!(ok && text.contains("allreduce ok"), "{text}");
}
