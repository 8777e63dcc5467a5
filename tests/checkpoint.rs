//! `train_mpi --checkpoint/--resume` under `mpirun`: a run whose last rank
//! is killed after epoch 2 ends promptly, and resumed from its checkpoint it
//! ends with the weights of a run that never stopped: bit for bit on the
//! same rank count, to rounding on another. Also the checkpoint file's own
//! checks.
#![cfg(feature = "mpi")]

use brgemm_dl::checkpoint::Checkpoint;
use brgemm_dl::nn::models::{mlp, LayerSpec};
use brgemm_dl::nn::Linear;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod support;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("brgemm-ckpt-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `train_mpi` on `np` local ranks: success, output, time taken.
fn train_mpi(np: usize, args: &[&str]) -> (bool, String, Duration) {
    support::train_mpi(&["--allow-run-as-root", "--oversubscribe"], np, args)
}

/// Every weight and bias of the digits MLP in checkpoint `d`, and its epoch.
fn weights(d: &Path) -> (u64, Vec<f32>) {
    let ck = Checkpoint::load(&d.join("checkpoint.bin")).unwrap();
    let specs = LayerSpec::classifier(&[128, 64], 10);
    let mut g = mlp(64, 8, &specs, 0).unwrap();
    ck.restore(&mut g).unwrap();
    let w = g
        .layers_of::<Linear>()
        .iter()
        .flat_map(|l| [l.weights(), l.bias()].concat())
        .collect();
    (ck.epoch, w)
}

#[test]
fn a_killed_run_resumed_on_any_rank_count_ends_where_an_unbroken_one_does() {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (full, cut, one, two) = (dir("full"), dir("cut"), dir("one"), dir("two"));
    let (ok, text, _) = train_mpi(2, &["--epochs", "4", "--checkpoint", &s(&full)]);
    assert!(ok, "{text}");

    let (ok, text, took) = train_mpi(
        2,
        &[
            "--epochs",
            "4",
            "--checkpoint",
            &s(&cut),
            "--kill-after-epoch",
            "2",
        ],
    );
    assert!(!ok, "the job survived its killed rank: {text}");
    assert!(
        took < Duration::from_secs(20),
        "the job took {took:?} to end"
    );
    assert_eq!(weights(&cut).0, 2, "the last checkpoint is epoch 2's");

    // The same rank count: bit for bit.
    std::fs::copy(cut.join("checkpoint.bin"), two.join("checkpoint.bin")).unwrap();
    let (ok, text, _) = train_mpi(
        2,
        &[
            "--epochs",
            "4",
            "--resume",
            &s(&two),
            "--checkpoint",
            &s(&two),
        ],
    );
    assert!(ok && text.contains("resumed after epoch 2"), "{text}");
    let (ef, wf) = weights(&full);
    assert_eq!(ef, 4);
    assert_eq!(weights(&two), (4, wf.clone()));

    // One rank: the same sums in another order.
    let (ok, text, _) = train_mpi(
        1,
        &[
            "--epochs",
            "4",
            "--resume",
            &s(&cut),
            "--checkpoint",
            &s(&one),
        ],
    );
    assert!(ok, "{text}");
    let (e1, w1) = weights(&one);
    assert_eq!(e1, 4);
    let worst = wf
        .iter()
        .zip(&w1)
        .map(|(a, b)| (a - b).abs() / (1e-3 + a.abs()))
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-2, "1 rank vs 2: relative difference {worst}");

    // Another global batch is refused by name, on every rank.
    let (ok, text, _) = train_mpi(2, &["--epochs", "4", "--batch", "32", "--resume", &s(&cut)]);
    assert!(!ok && text.contains("global batch 64"), "{text}");
    for d in [full, cut, one, two] {
        std::fs::remove_dir_all(d).ok();
    }
}

#[test]
fn a_damaged_checkpoint_is_refused_by_name() {
    let d = dir("damaged");
    let (ok, text, _) = train_mpi(1, &["--epochs", "1", "--checkpoint", d.to_str().unwrap()]);
    assert!(ok, "{text}");
    let p = d.join("checkpoint.bin");
    let bytes = std::fs::read(&p).unwrap();
    assert!(Checkpoint::from_bytes(&bytes).is_ok());
    for at in [0, 12, 20, bytes.len() / 2, bytes.len() - 1] {
        let mut b = bytes.clone();
        b[at] ^= 0x40;
        assert!(Checkpoint::from_bytes(&b).is_err(), "flip at byte {at}");
    }
    for cut in [0, 10, 40, bytes.len() - 1] {
        assert!(
            Checkpoint::from_bytes(&bytes[..cut]).is_err(),
            "cut at {cut}"
        );
    }
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let (ok, text, _) = train_mpi(1, &["--epochs", "2", "--resume", d.to_str().unwrap()]);
    assert!(
        !ok && text.contains("checkpoint.bin") && text.contains("checksum"),
        "{text}"
    );
    std::fs::remove_dir_all(d).ok();
}
