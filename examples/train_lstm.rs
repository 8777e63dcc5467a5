//! Classifies Fashion-MNIST images read row by row (28 steps of 28 pixels,
//! the sequential-MNIST setting) with an LSTM of 128 hidden units and an FC
//! head; prints per-epoch loss, test accuracy and sequences/s, and ends with
//! `test_accuracy=<fraction>`. Without the data set it falls back to the
//! embedded UCI digits read row by row (8 steps of 8) and says so.
//!
//! ```text
//! cargo run --release --example train_lstm [-- --data DIR --epochs N --batch B --hidden K
//!     --lr LR --layers L --bidirectional --rnn --train-limit N --seed S]
//! ```
//!
//! `--layers 2` stacks LSTM layers (each reads the one below at every step);
//! `--bidirectional` runs every layer in both directions and gives the head
//! both final states; `--rnn` uses the plain tanh cell.

use brgemm_dl::{data, train_lstm};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{CellKind, Pool};

#[path = "support/cli.rs"]
mod cli;
use cli::arg;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir: String = arg(&args, "--data", data::FASHION_MNIST_DIR.to_string());
    let (name, mut tr, te, steps) = match data::fashion_mnist(std::path::Path::new(&dir)) {
        Ok((tr, te)) => ("fashion-mnist", tr.data, te.data, 28),
        Err(e) => {
            println!("{e}");
            println!(
                "falling back to the embedded UCI digits, read row by row (8 steps of 8 pixels)"
            );
            let (tr, te) = data::digits().expect("embedded digits").split(0.2, 42);
            ("digits", tr, te, 8)
        }
    };
    let mut cfg = train_lstm::SeqConfig::lstm(steps);
    if name == "digits" {
        cfg.epochs = 30;
    }
    cfg.epochs = arg(&args, "--epochs", cfg.epochs);
    cfg.batch = arg(&args, "--batch", cfg.batch);
    cfg.hidden = arg(&args, "--hidden", cfg.hidden);
    cfg.layers = arg(&args, "--layers", cfg.layers);
    cfg.seed = arg(&args, "--seed", cfg.seed);
    cfg.optimizer = Optimizer::adam(arg(&args, "--lr", 2e-3));
    cfg.bidirectional = args.iter().any(|a| a == "--bidirectional");
    if args.iter().any(|a| a == "--rnn") {
        cfg.kind = CellKind::Rnn;
    }
    let limit: usize = arg(&args, "--train-limit", usize::MAX);
    if limit < tr.len() {
        tr = tr.subset(&(0..limit).collect::<Vec<_>>());
    }
    let pool = Pool::global();
    println!(
        "{name}: {} train / {} test sequences of {} steps x {} features; {:?} {} x {} hidden{}, head {:?} -> {}; batch {}, {} thread(s)",
        tr.len(),
        te.len(),
        steps,
        tr.features / steps,
        cfg.kind,
        cfg.layers,
        cfg.hidden,
        if cfg.bidirectional { " x 2 directions" } else { "" },
        cfg.head,
        tr.classes,
        cfg.batch,
        pool.threads()
    );
    let (_model, last) = cli::run_training("sequences", |report| {
        train_lstm::train(&cfg, pool, &tr, &te, report)
    });
    println!("test_accuracy={last:.4}");
}
