//! The example programs end with a clear error, not a panic, a silent
//! fallback or an OOM kill, on the bad inputs the hostile-input review
//! found; and every model family saves, loads and evaluates to the same
//! accuracy through `--save` / `--load --epochs 0`.
//!
//! The examples run as programs: `cargo test` builds them next to this
//! test's binary, and [`example`] brings them up to date.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The built example `name`. The examples are (re)built once per run, in
/// the profile of this test, so a stale binary is never what is tested (a
/// no-op after `cargo test` built them with default features). The test
/// script, whose `cargo test --all-targets` built them with its own
/// features, sets `BRGEMM_EXAMPLES_BUILT` so no second feature set is built.
fn example(name: &str) -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let deps = std::env::current_exe().unwrap();
    let profile_dir = deps.parent().unwrap().parent().unwrap().to_path_buf();
    BUILT.call_once(|| {
        if std::env::var_os("BRGEMM_EXAMPLES_BUILT").is_some() {
            return;
        }
        let profile = if profile_dir.ends_with("release") {
            "release"
        } else {
            "test"
        };
        let status = Command::new(env!("CARGO"))
            .args(["build", "-q", "--examples", "--profile", profile])
            .status()
            .unwrap();
        assert!(status.success(), "building the examples");
    });
    profile_dir.join("examples").join(name)
}

fn run(name: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(example(name));
    c.args(args).env("BRGEMM_NUM_THREADS", "1");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// The run must fail with `status` and say `want` on stderr.
fn fails(out: &Output, status: i32, want: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(status), "stderr: {err}");
    assert!(err.contains(want), "expected {want:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// The run must succeed; returns its `test_accuracy=` figure.
fn accuracy(out: &Output) -> String {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text.lines().find(|l| l.starts_with("test_accuracy="));
    line.unwrap_or_else(|| panic!("no accuracy in {text}"))
        .to_string()
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("brgemm-examples-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn epochs_zero_without_a_model_is_refused() {
    // It once printed test_accuracy=0.0000 for a model never evaluated.
    let out = run("train_mlp", &["--epochs", "0"], &[]);
    fails(&out, 2, "--epochs 0");
}

#[test]
fn a_batch_that_cannot_fit_is_refused_before_allocating() {
    let out = run("train_mlp", &["--batch", "100000000000"], &[]);
    fails(&out, 2, "--batch 100000000000");
}

#[test]
fn a_bad_thread_count_is_an_error_naming_it() {
    for bad in ["0", "abc"] {
        let out = run(
            "train_mlp",
            &["--epochs", "1"],
            &[("BRGEMM_NUM_THREADS", bad)],
        );
        fails(&out, 2, "BRGEMM_NUM_THREADS");
    }
}

#[test]
fn a_missing_data_directory_is_an_error_not_a_fallback() {
    // train_lstm once trained on the embedded digits instead.
    let out = run(
        "train_lstm",
        &["--data", "/no/such/dir", "--epochs", "1"],
        &[],
    );
    fails(&out, 1, "/no/such/dir");
}

#[test]
fn tune_refuses_zero_sizes_and_keeps_a_malformed_save_file() {
    let out = run("tune", &["fc", "--n", "0", "--c", "16", "--k", "16"], &[]);
    fails(&out, 2, "--n");
    let keep = tmp("not-a-tuning-file.json");
    std::fs::write(&keep, b"my notes, not JSON").unwrap();
    let out = run(
        "tune",
        &[
            "fc",
            "--n",
            "8",
            "--c",
            "16",
            "--k",
            "16",
            "--quick",
            "--save",
            keep.to_str().unwrap(),
        ],
        &[],
    );
    fails(&out, 2, "not replacing it");
    assert_eq!(std::fs::read(&keep).unwrap(), b"my notes, not JSON");
}

#[test]
fn the_mlp_saves_and_evaluates_the_same_after_loading() {
    let p = tmp("mlp.bin");
    let path = p.to_str().unwrap();
    let trained = accuracy(&run("train_mlp", &["--epochs", "2", "--save", path], &[]));
    let loaded = accuracy(&run("train_mlp", &["--epochs", "0", "--load", path], &[]));
    assert_eq!(trained, loaded);
    // The MLP's file does not fit the CNN: refused, naming both shapes.
    let out = run("train_cnn", &["--epochs", "0", "--load", path], &[]);
    fails(&out, 1, "the file is for inputs of (c, h, w) = [64, 1, 1]");
}

/// A tiny Fashion-MNIST-shaped IDX set: 28x28 images whose class is the
/// row band holding a bright stripe (learnable in an epoch or two).
fn tiny_fashion(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let write = |name: &str, n: u32| {
        let mut img = std::fs::File::create(dir.join(format!("{name}-images-idx3-ubyte"))).unwrap();
        let mut lab = std::fs::File::create(dir.join(format!("{name}-labels-idx1-ubyte"))).unwrap();
        img.write_all(&[0, 0, 8, 3]).unwrap();
        for d in [n, 28, 28] {
            img.write_all(&d.to_be_bytes()).unwrap();
        }
        lab.write_all(&[0, 0, 8, 1]).unwrap();
        lab.write_all(&n.to_be_bytes()).unwrap();
        for i in 0..n {
            let class = (i % 10) as u8;
            let mut px = [0u8; 784];
            let row = 1 + 2 * class as usize + (i as usize / 10) % 2;
            px[row * 28..row * 28 + 28].fill(255);
            img.write_all(&px).unwrap();
            lab.write_all(&[class]).unwrap();
        }
    };
    write("train", 64);
    write("t10k", 32);
}

#[test]
fn the_cnn_and_the_lstm_save_and_evaluate_the_same_after_loading() {
    let dir = tmp("fashion");
    tiny_fashion(&dir);
    let data = dir.to_str().unwrap();
    for example in ["train_cnn", "train_lstm"] {
        let p = tmp(&format!("{example}.bin"));
        let path = p.to_str().unwrap();
        let common = ["--data", data, "--batch", "16", "--hidden", "16"];
        let common = if example == "train_cnn" {
            &common[..4]
        } else {
            &common[..]
        };
        let mut args = common.to_vec();
        args.extend(["--epochs", "1", "--save", path]);
        let trained = accuracy(&run(example, &args, &[]));
        let mut args = common.to_vec();
        args.extend(["--epochs", "0", "--load", path]);
        let loaded = accuracy(&run(example, &args, &[]));
        assert_eq!(trained, loaded, "{example}");
    }
}

#[test]
fn the_resnet_trains_on_the_graph_and_saves_and_loads_it() {
    let dir = tmp("fashion-resnet");
    tiny_fashion(&dir);
    let data = dir.to_str().unwrap();
    let out = run(
        "train_resnet",
        &["--data", data, "--batch", "16", "--epochs", "2"],
        &[],
    );
    let line = accuracy(&out);
    let acc: f64 = line.trim_start_matches("test_accuracy=").parse().unwrap();
    assert!((0.0..=1.0).contains(&acc), "{acc}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("epoch 2: loss"), "{text}");
    // Saved after training, loaded at another batch size: the same accuracy.
    let p = tmp("resnet.bin");
    let path = p.to_str().unwrap();
    let trained = accuracy(&run(
        "train_resnet",
        &[
            "--data", data, "--batch", "16", "--epochs", "1", "--save", path,
        ],
        &[],
    ));
    let loaded = accuracy(&run(
        "train_resnet",
        &[
            "--data", data, "--batch", "8", "--epochs", "0", "--load", path,
        ],
        &[],
    ));
    assert_eq!(trained, loaded);
    std::fs::write(&p, b"BRGEMM-NN\n").unwrap();
    let out = run(
        "train_resnet",
        &["--data", data, "--epochs", "0", "--load", path],
        &[],
    );
    fails(&out, 1, "truncated");
}
