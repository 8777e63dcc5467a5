//! What the training examples share (they include this file by path): the
//! `--name value` option parser and the epoch-by-epoch report.

use brgemm_dl::train::EpochReport;
use std::time::Instant;

/// The value after `name` in `args`, parsed, or `default` when absent; a
/// missing or unparsable value ends the process with a message.
pub fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    match args.iter().position(|a| a == name) {
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                eprintln!("{name} needs a value");
                std::process::exit(2)
            }),
        None => default,
    }
}

/// Runs `train` with a reporter printing one line per epoch (`unit` per
/// second), ends the process if training fails, prints the time taken, and
/// returns the model and the last test accuracy.
#[allow(dead_code)] // train_mpi reports per rank itself
pub fn run_training<M, E: std::fmt::Display>(
    unit: &str,
    train: impl FnOnce(&mut dyn FnMut(&EpochReport)) -> Result<M, E>,
) -> (M, f64) {
    let t = Instant::now();
    let mut last = 0.0;
    let model = train(&mut |r: &EpochReport| {
        println!(
            "epoch {:3}  loss {:.4}  test_acc {:.4}  {:.0} {unit}/s",
            r.epoch, r.loss, r.test_accuracy, r.samples_per_s
        );
        last = r.test_accuracy;
    })
    .unwrap_or_else(|e| {
        eprintln!("training failed: {e}");
        std::process::exit(1)
    });
    println!("trained in {:.2} s", t.elapsed().as_secs_f64());
    (model, last)
}
