//! Classifies Fashion-MNIST images read row by row (28 steps of 28 pixels,
//! the sequential-MNIST setting) with an LSTM of 128 hidden units and an FC
//! head; prints per-epoch loss, test accuracy and sequences/s, and ends with
//! `test_accuracy=<fraction>`. Without the data set it falls back to the
//! embedded UCI digits read row by row (8 steps of 8) and says so.
//!
//! ```text
//! cargo run --release --example train_lstm [-- --data DIR --epochs N --batch B --hidden K
//!     --lr LR --layers L --bidirectional --rnn --train-limit N --seed S --dtype f32|bf16]
//! ```
//!
//! `--layers 2` stacks LSTM layers (each reads the one below at every step);
//! `--bidirectional` runs every layer in both directions and gives the head
//! both final states; `--rnn` uses the plain tanh cell.
//!
//! `cargo run --release --features cuda --example train_lstm -- --device
//! opencl|cuda [--dtype f32|bf16|f16]` trains the one-layer LSTM classifier on a
//! GPU through the run-time generated kernels, from the same seeded weights.

use brgemm_dl::{data, train_lstm};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::CellKind;

#[path = "support/cli.rs"]
mod cli;

const USAGE: &str = "train_lstm: an LSTM classifier of images read row by row\n\
    usage: train_lstm [--data DIR --epochs N --batch B --hidden K --lr LR --layers L --bidirectional --rnn --train-limit N --seed S --dtype f32|bf16 --device cpu|opencl|cuda]";

fn main() {
    let args = cli::parse(
        USAGE,
        &[
            cli::value("hidden", "K", "hidden units per layer"),
            cli::value("layers", "L", "stacked recurrent layers"),
            cli::flag("bidirectional", "every layer in both directions"),
            cli::flag("rnn", "the plain tanh cell instead of the LSTM"),
            cli::value("train-limit", "N", "train on the first N sequences only"),
            cli::value("device", "D", "cpu, or opencl|cuda with --features cuda"),
            cli::DTYPE,
        ],
    );
    let bf16 = args.bf16();
    let dtype = if bf16 { "bf16" } else { "f32" };
    let explicit: Option<String> = args.get("data");
    let dir = explicit
        .clone()
        .unwrap_or(data::FASHION_MNIST_DIR.to_string());
    let (name, mut tr, te, steps) = match data::fashion_mnist(std::path::Path::new(&dir)) {
        Ok((tr, te)) => ("fashion-mnist", tr.data, te.data, 28),
        // A --data the user named must exist: no silent fallback then.
        Err(e) if explicit.is_some() => {
            eprintln!("--data: {e}");
            std::process::exit(1)
        }
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
    cfg.bf16 = bf16;
    if name == "digits" {
        cfg.epochs = 30;
    }
    cfg.epochs = args.epochs(cfg.epochs);
    cfg.batch = args.positive("batch", cfg.batch);
    cfg.hidden = args.positive("hidden", cfg.hidden);
    cfg.layers = args.positive("layers", cfg.layers);
    cfg.seed = args.get_or("seed", cfg.seed);
    cfg.optimizer = Optimizer::adam(args.lr(2e-3));
    cfg.check_finite = !args.flag("no-finite-check");
    cfg.fused_update = args.flag("fused-update");
    cfg.bidirectional = args.flag("bidirectional");
    if args.flag("rnn") {
        cfg.kind = CellKind::Rnn;
    }
    let limit: usize = args.positive("train-limit", usize::MAX);
    let save = args.save_path();
    // Per sequence: states, gates and their gradients of every step, layer
    // and direction (about 16 values of the hidden width each, f32).
    let dirs = if cfg.bidirectional { 2 } else { 1 };
    let per_row = steps * cfg.layers * dirs * 16 * 4 * (cfg.hidden + tr.features / steps);
    cli::check_batch_memory(cfg.batch, per_row);
    if limit < tr.len() {
        tr = tr.subset(&(0..limit).collect::<Vec<_>>());
    }
    let device: String = args.get_or("device", "cpu".to_string());
    if device != "cpu" {
        args.no_model_files("GPU sequence classifier");
        let dt: String = args.get_or("dtype", "f32".to_string());
        return gpu_main(&cfg, &device, &dt, name, &tr, &te);
    }
    let pool = cli::pool();
    println!(
        "{name}: {} train / {} test sequences of {} steps x {} features; {:?} {} x {} hidden{}, head {:?} -> {}; batch {}, {} thread(s), {dtype}",
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
    let model = args.graph(
        || train_lstm::build(&cfg, &tr),
        |g| train_lstm::check_fits(g, &tr),
    );
    let (mut model, last) = cli::train_or_evaluate(
        "sequences",
        cfg.epochs,
        model,
        |m| train_lstm::accuracy(m, pool, &te),
        |m, report| train_lstm::train_model(&cfg, pool, m, &tr, &te, report),
    );
    if cfg.bf16 {
        let n = model.set_bf16(true).expect("bf16 was on during training");
        println!("layers in bf16: {n} (the others stay f32: no bf16 kernel faster than f32 here)");
    }
    cli::save_graph(&model, save);
    println!("test_accuracy={last:.4}");
}

#[cfg(feature = "gpu")]
fn gpu_main(
    cfg: &train_lstm::SeqConfig,
    device: &str,
    dtype: &str,
    name: &str,
    tr: &data::Dataset,
    te: &data::Dataset,
) {
    let (backend, dt) = cli::gpu_target(device, dtype);
    println!(
        "{name}: {} train / {} test sequences of {} steps x {} features; {:?} {} hidden -> {}; batch {}, device {device}, {dtype}",
        tr.len(),
        te.len(),
        cfg.steps,
        tr.features / cfg.steps,
        cfg.kind,
        cfg.hidden,
        tr.classes,
        cfg.batch,
    );
    cli::run_gpu_training("sequences", |report| {
        brgemm_dl::train_gpu::train_lstm(cfg, backend, dt, tr, te, report)
    });
}

#[cfg(not(feature = "gpu"))]
fn gpu_main(
    _: &train_lstm::SeqConfig,
    device: &str,
    _: &str,
    _: &str,
    _: &data::Dataset,
    _: &data::Dataset,
) {
    cli::no_gpu_build("train_lstm", device)
}
