//! Trains a small CNN on Fashion-MNIST: two stages of 3x3 conv + ReLU + 2x2
//! max pooling (32 and 64 channels), FC 128 + ReLU, FC 10, as a layer graph
//! (`CnnSpec::graph`), trained with the graph loop (`brgemm_dl::fit`). Prints per-epoch
//! loss, test accuracy and images/s, and ends with `test_accuracy=<fraction>`.
//!
//! ```text
//! cargo run --release --example train_cnn [-- --data DIR --epochs N --batch B --lr LR
//!     --save FILE --load FILE --batchnorm --dropout P --train-limit N --seed S --dtype f32|bf16]
//! cargo run --release --features cuda --example train_cnn -- --device opencl|cuda [--dtype f32|bf16|f16]
//! ```
//!
//! `--device` trains on a GPU through the run-time generated kernels (the
//! convolutions as BRGEMMs over the filter taps, pooling, the FC head, the
//! loss and Adam on the device), from the same seeded weights.
//!
//! Data: the IDX files of Fashion-MNIST (Xiao, Rasul and Vollgraf 2017, MIT
//! licence) as the Debian package `dataset-fashion-mnist` installs them in
//! /usr/share/datasets/fashion-mnist, or in `--data DIR`.

use brgemm_dl::{data, train_cnn};
use brgemm_primitives::optim::Optimizer;

#[path = "support/cli.rs"]
mod cli;

const USAGE: &str = "train_cnn: a small CNN on Fashion-MNIST\n\
    usage: train_cnn [--data DIR --epochs N --batch B --lr LR --batchnorm --dropout P --train-limit N --seed S --dtype f32|bf16 --device cpu|opencl|cuda]";

fn main() {
    let args = cli::parse(
        USAGE,
        &[
            cli::flag("batchnorm", "batch normalisation after each convolution"),
            cli::value("dropout", "P", "dropout before the FC head, in [0, 1)"),
            cli::value("train-limit", "N", "train on the first N images only"),
            cli::value("device", "D", "cpu, or opencl|cuda with --features cuda"),
            cli::DTYPE,
        ],
    );
    let mut cfg = train_cnn::CnnConfig::default();
    cfg.epochs = args.epochs(cfg.epochs);
    cfg.batch = args.positive("batch", cfg.batch);
    cfg.seed = args.get_or("seed", cfg.seed);
    cfg.dropout = args.get_or("dropout", cfg.dropout);
    cfg.optimizer = Optimizer::adam(args.lr(1e-3));
    cfg.check_finite = !args.flag("no-finite-check");
    cfg.fused_update = args.flag("fused-update");
    cfg.bf16 = args.bf16();
    let dtype = if cfg.bf16 { "bf16" } else { "f32" };
    let bn = args.flag("batchnorm");
    for s in &mut cfg.stages {
        s.batchnorm = bn;
    }
    let dir: String = args.get_or("data", data::FASHION_MNIST_DIR.to_string());
    let limit: usize = args.positive("train-limit", usize::MAX);
    let save = args.save_path();
    // Per image: every stage's activations, their gradients and scratch
    // (about 8 copies of 28x28 x channels, f32).
    let per_image: usize = cfg.stages.iter().map(|s| s.channels * 28 * 28).sum();
    cli::check_batch_memory(cfg.batch, 8 * 4 * per_image);

    let (mut tr, te) = data::fashion_mnist(std::path::Path::new(&dir)).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    if limit < tr.data.len() {
        let idx: Vec<usize> = (0..limit).collect();
        tr.data = tr.data.subset(&idx);
    }
    let device: String = args.get_or("device", "cpu".to_string());
    if device != "cpu" {
        args.no_model_files("GPU CNN");
        let dt: String = args.get_or("dtype", "f32".to_string());
        return gpu_main(&cfg, &device, &dt, &tr, &te);
    }
    let pool = cli::pool();
    println!(
        "fashion-mnist: {} train / {} test images of {:?}; CNN {:?}, FC {:?} -> {}, batchnorm {bn}, dropout {}; batch {}, {} thread(s), {dtype}",
        tr.data.len(),
        te.data.len(),
        tr.dims,
        cfg.stages.iter().map(|s| s.channels).collect::<Vec<_>>(),
        cfg.hidden,
        tr.data.classes,
        cfg.dropout,
        cfg.batch,
        pool.threads()
    );
    let model = args.graph(
        || train_cnn::build(&cfg, &tr),
        |g| train_cnn::check_fits(g, &tr),
    );
    let (mut model, last) = cli::train_or_evaluate(
        "images",
        cfg.epochs,
        model,
        |m| train_cnn::accuracy(m, pool, &te),
        |m, report| train_cnn::train_model(&cfg, pool, m, &tr, &te, report),
    );
    if cfg.bf16 {
        let n = model.set_bf16(true).expect("bf16 was on during training");
        println!("layers in bf16: {n} (the others stay f32: odd channel blocks, or no bf16 kernel faster than f32 here)");
    }
    cli::save_graph(&model, save);
    println!("test_accuracy={last:.4}");
}

#[cfg(feature = "gpu")]
fn gpu_main(
    cfg: &train_cnn::CnnConfig,
    device: &str,
    dtype: &str,
    tr: &data::ImageSet,
    te: &data::ImageSet,
) {
    let (backend, dt) = cli::gpu_target(device, dtype);
    println!(
        "fashion-mnist: {} train / {} test images of {:?}; CNN {:?}, FC {:?} -> {}; batch {}, device {device}, {dtype}",
        tr.data.len(),
        te.data.len(),
        tr.dims,
        cfg.stages.iter().map(|s| s.channels).collect::<Vec<_>>(),
        cfg.hidden,
        tr.data.classes,
        cfg.batch,
    );
    cli::run_gpu_training("images", |report| {
        brgemm_dl::train_gpu::train_cnn(cfg, backend, dt, tr, te, report)
    });
}

#[cfg(not(feature = "gpu"))]
fn gpu_main(
    _: &train_cnn::CnnConfig,
    device: &str,
    _: &str,
    _: &data::ImageSet,
    _: &data::ImageSet,
) {
    cli::no_gpu_build("train_cnn", device)
}
