//! The emulated cluster (`scripts/cluster.sh`): two network namespaces
//! joined by rate-limited veth links come up, `train_mpi` runs one rank in
//! each over TCP through `mpirun`, and everything is torn down again.
//!
//! It changes the machine's network configuration for a second (names
//! starting `brgc`, removed at the end), so it runs only when asked:
//! `BRGEMM_REQUIRE_CLUSTER=1` (the test script sets it where it can create
//! a namespace; a missing capability is then a failure) or
//! `BRGEMM_CLUSTER_TEST=1` (skipped without root). Needs OpenMPI and the
//! `train_mpi` and `bench` examples built with `--features mpi`.
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::Command;

mod support;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster.sh");

fn sh(args: &[&str]) -> (bool, String) {
    let out = Command::new("bash")
        .arg(SCRIPT)
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Tears the cluster down when dropped, also when the test panics.
struct Cluster;

impl Drop for Cluster {
    fn drop(&mut self) {
        let (ok, text) = sh(&["down"]);
        assert!(ok || std::thread::panicking(), "cluster.sh down: {text}");
    }
}

/// Whether this process may make network namespaces.
fn capable() -> bool {
    let probe = Command::new("ip")
        .args(["netns", "add", "brgc-probe"])
        .output();
    let ok = probe.is_ok_and(|o| o.status.success());
    if ok {
        Command::new("ip")
            .args(["netns", "del", "brgc-probe"])
            .status()
            .ok();
    }
    ok
}

fn bytes_sent(dev: &str) -> u64 {
    let p = Path::new("/sys/class/net")
        .join(dev)
        .join("statistics/rx_bytes");
    std::fs::read_to_string(p).map_or(0, |s| s.trim().parse().unwrap_or(0))
}

/// Whether the cluster tests run here (see the module docs); they take
/// turns, since both use the same names.
fn enabled() -> Option<std::sync::MutexGuard<'static, ()>> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let required = std::env::var_os("BRGEMM_REQUIRE_CLUSTER").is_some();
    if !required && std::env::var_os("BRGEMM_CLUSTER_TEST").is_none() {
        eprintln!("SKIPPED: set BRGEMM_CLUSTER_TEST=1 (root) to bring up the emulated cluster");
        return None;
    }
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    if !capable() {
        assert!(
            !required,
            "BRGEMM_REQUIRE_CLUSTER is set but this process cannot create a network namespace"
        );
        eprintln!("SKIPPED: no network namespaces here (needs root / CAP_NET_ADMIN)");
        return None;
    }
    Some(turn)
}

/// Nothing named `brgc` is left: no link, no namespace.
fn assert_all_gone() {
    let left = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(!left.contains("brgc"), "links left behind: {left}");
    let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(
        !String::from_utf8_lossy(&ns.stdout).contains("brgc"),
        "namespaces left behind"
    );
}

/// `bench mpi --cluster` brings the cluster up per node count, prints a
/// line per model and node count with the figures the cluster is for, and
/// takes it down again.
#[test]
fn bench_mpi_over_the_cluster_prints_its_figures_and_cleans_up() {
    let Some(_turn) = enabled() else { return };
    let out = Command::new(support::example("bench"))
        .args([
            "mpi",
            "--cluster",
            "--gbps",
            "10",
            "--nodes",
            "1,2",
            "--models",
            "cnn",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('{')).collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (line, ranks) in lines.iter().zip(["1", "2"]) {
        for key in [
            "\"link_gbps\":10",
            &format!("\"ranks\":{ranks}"),
            "\"model\":\"cnn\"",
            "\"samples_per_s\":",
            "\"allreduce_ms\":",
            "\"hidden\":",
            "\"predicted_step_ms\":",
        ] {
            assert!(line.contains(key), "{key} missing: {line}");
        }
    }
    assert!(lines[1].contains("\"vs_twice_one_node\":"), "{}", lines[1]);
    assert!(!lines[1].contains("\"wire_gbps\":null"), "{}", lines[1]);
    assert_all_gone();
}

#[test]
fn train_mpi_runs_over_two_emulated_nodes_and_the_cluster_goes_away() {
    let Some(_turn) = enabled() else { return };
    let cluster = Cluster;
    let (ok, text) = sh(&["up", "2", "--gbps", "1"]);
    assert!(ok, "cluster.sh up: {text}");
    let args = text
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("mpirun_args="))
        .unwrap_or_else(|| panic!("no mpirun_args= line last: {text}"))
        .to_string();
    // The links carry the ranks' traffic: what the bridge ports received
    // from the two nodes before and after.
    let before: u64 = ["brgc-v1", "brgc-v2"].iter().map(|d| bytes_sent(d)).sum();
    let margs: Vec<&str> = args.split_whitespace().collect();
    let (ok, text, _) = support::train_mpi(&margs, 2, &["--epochs", "2"]);
    assert!(ok, "mpirun over the cluster: {text}");
    assert!(text.contains("2 rank(s)"), "{text}");
    let acc: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("test_accuracy="))
        .unwrap_or_else(|| panic!("no test_accuracy line: {text}"))
        .parse()
        .unwrap();
    assert!(acc > 0.8, "accuracy {acc}: {text}");
    let after: u64 = ["brgc-v1", "brgc-v2"].iter().map(|d| bytes_sent(d)).sum();
    // 2 epochs of all-reduces of the MLP's ~17k parameters per step.
    assert!(
        after - before > 1 << 20,
        "only {} bytes crossed the links",
        after - before
    );
    // A rank killed after epoch 1 ends the job promptly; the run resumes
    // from epoch 1's checkpoint, on the cluster again.
    let dir = std::env::temp_dir().join(format!("brgemm-cluster-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    let kill = [
        "--epochs",
        "3",
        "--checkpoint",
        d,
        "--kill-after-epoch",
        "1",
    ];
    let (ok, text, took) = support::train_mpi(&margs, 2, &kill);
    assert!(!ok, "the job survived its killed rank: {text}");
    assert!(
        took.as_secs() < 20,
        "the job took {took:?} to end after a rank died"
    );
    let (ok, text, _) = support::train_mpi(&margs, 2, &["--epochs", "2", "--resume", d]);
    assert!(ok && text.contains("resumed after epoch 1"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
    drop(cluster);
    assert_all_gone();
}
