//! Trains an MLP (64 -> 128 ReLU -> 64 ReLU -> 10, a layer graph of `Linear`
//! layers) on the embedded UCI digits with a fixed seeded 80/20 split;
//! prints per-epoch loss, test accuracy and samples/s, and ends with
//! `test_accuracy=<fraction>`.
//!
//! ```text
//! cargo run --release --example train_mlp [-- --epochs N --batch B --lr LR --seed S
//!     --save FILE --load FILE --dtype f32|bf16 --no-finite-check]
//! cargo run --release --features cuda --example train_mlp -- --device cuda|opencl [--dtype f32|bf16|f16]
//! ```
//!
//! `--device` trains on a GPU through the run-time generated kernels of
//! `brgemm-gpu` (CUDA tensor cores, or OpenCL, e.g. PoCL on the CPU) from
//! the same initial weights, printing the same lines.
//!
//! Data: E. Alpaydin and C. Kaynak (1998), UCI Machine Learning Repository, CC BY 4.0.

use brgemm_dl::{data, train};
use brgemm_nn::Linear;
use brgemm_primitives::optim::Optimizer;

#[path = "support/cli.rs"]
mod cli;

const USAGE: &str = "train_mlp: an MLP on the embedded UCI digits\n\
    usage: train_mlp [--epochs N --batch B --lr LR --seed S --save FILE --load FILE --dtype f32|bf16 --device cpu|opencl|cuda]";

fn main() {
    let args = cli::parse(
        USAGE,
        &[
            cli::value(
                "dtype",
                "T",
                "f32 or bf16 (bf16 operands, f32 master weights); f16 on a GPU",
            ),
            cli::value("device", "D", "cpu, or opencl|cuda with --features cuda"),
        ],
    );
    let mut cfg = train::TrainConfig::default();
    cfg.epochs = args.epochs(cfg.epochs);
    cfg.batch = args.positive("batch", cfg.batch);
    cfg.seed = args.get_or("seed", cfg.seed);
    cfg.optimizer = Optimizer::adam(args.lr(3e-3));
    cfg.check_finite = !args.flag("no-finite-check");
    cfg.fused_update = args.flag("fused-update");
    cfg.tuning_file = args.tuning_file();
    if args.get::<String>("data").is_some() {
        cli::usage_error("--data: train_mlp trains on the embedded digits only");
    }
    let dtype: String = args.get_or("dtype", "f32".to_string());
    let device: String = args.get_or("device", "cpu".to_string());
    if device != "cpu" {
        args.no_model_files("GPU MLP");
        return gpu_main(&cfg, &device, &dtype);
    }
    cfg.bf16 = args.bf16();
    let save = args.save_path();
    // Activations, gradients and scratch of every layer, f32, about 6 per
    // width per row.
    let widths: usize = 64 + cfg.hidden.iter().sum::<usize>() + 10;
    cli::check_batch_memory(cfg.batch, 6 * 4 * widths);

    let all = data::digits().expect("embedded digits");
    let (tr, te) = all.split(0.2, 42);
    let pool = cli::pool();
    let model = args.graph(|| train::build(&cfg, &tr), |g| train::check_fits(g, &tr));
    header(
        &cfg,
        &all,
        &tr,
        &te,
        &format!("{} thread(s), {dtype}", pool.threads()),
    );
    let (model, last) = cli::train_or_evaluate(
        "samples",
        cfg.epochs,
        model,
        |m| train::accuracy(m, pool, &te),
        |m, report| train::train_model(&cfg, pool, m, &tr, &te, report),
    );
    if let Some(isa) = model
        .layers_of::<Linear>()
        .first()
        .and_then(|l| l.bf16_isa())
    {
        println!("bf16 kernel of the first layer: {isa:?}");
    }
    cli::save_graph(&model, save);
    println!("test_accuracy={last:.4}");
}

/// The first line of every run: data, model, batch and where it runs.
fn header(
    cfg: &train::TrainConfig,
    all: &data::Dataset,
    tr: &data::Dataset,
    te: &data::Dataset,
    run: &str,
) {
    println!(
        "digits: {} train / {} test images, {} features, {} classes; MLP {} -> {:?} -> {}; batch {}, {run}",
        tr.len(),
        te.len(),
        all.features,
        all.classes,
        all.features,
        cfg.hidden,
        all.classes,
        cfg.batch
    );
}

#[cfg(feature = "gpu")]
fn gpu_main(cfg: &train::TrainConfig, device: &str, dtype: &str) {
    let (backend, dt) = cli::gpu_target(device, dtype);
    let all = data::digits().expect("embedded digits");
    let (tr, te) = all.split(0.2, 42);
    header(cfg, &all, &tr, &te, &format!("device {device}, {dtype}"));
    cli::run_gpu_training("samples", |report| {
        brgemm_dl::train_gpu::train(cfg, backend, dt, &tr, &te, report)
    });
}

#[cfg(not(feature = "gpu"))]
fn gpu_main(_: &train::TrainConfig, device: &str, _: &str) {
    cli::no_gpu_build("train_mlp", device)
}
