//! Trains an MLP (64 -> 128 ReLU -> 64 ReLU -> 10) on the embedded UCI digits
//! with a fixed seeded 80/20 split; prints per-epoch loss, test accuracy and
//! samples/s, and ends with `test_accuracy=<fraction>`.
//!
//! ```text
//! cargo run --release --example train_mlp [-- --epochs N --batch B --seed S --save FILE --dtype f32|bf16]
//! cargo run --release --features cuda --example train_mlp -- --device cuda|opencl [--dtype f32|bf16|f16]
//! ```
//!
//! `--device` trains on a GPU through the run-time generated kernels of
//! `brgemm-gpu` (CUDA tensor cores, or OpenCL, e.g. PoCL on the CPU) from
//! the same initial weights, printing the same lines.
//!
//! Data: E. Alpaydin and C. Kaynak (1998), UCI Machine Learning Repository, CC BY 4.0.

use brgemm_dl::{data, train};
use brgemm_primitives::Pool;

#[path = "support/cli.rs"]
mod cli;
use cli::arg;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg = train::TrainConfig::default();
    cfg.epochs = arg(&args, "--epochs", cfg.epochs);
    cfg.batch = arg(&args, "--batch", cfg.batch);
    cfg.seed = arg(&args, "--seed", cfg.seed);
    let dtype: String = arg(&args, "--dtype", "f32".to_string());
    let device: String = arg(&args, "--device", "cpu".to_string());
    if device != "cpu" {
        return gpu_main(&cfg, &device, &dtype);
    }
    cfg.bf16 = match dtype.as_str() {
        "f32" => false,
        "bf16" => true,
        other => {
            eprintln!("--dtype {other:?}: expected f32 or bf16");
            std::process::exit(2)
        }
    };
    let save: Option<String> = args
        .iter()
        .position(|a| a == "--save")
        .and_then(|i| args.get(i + 1).cloned());

    let all = data::digits().expect("embedded digits");
    let (tr, te) = all.split(0.2, 42);
    let pool = Pool::global();
    header(
        &cfg,
        &all,
        &tr,
        &te,
        &format!("{} thread(s), {dtype}", pool.threads()),
    );
    let (model, last) = cli::run_training("samples", |report| {
        train::train(&cfg, pool, &tr, &te, report)
    });
    if let Some(isa) = model.bf16_isa() {
        println!("bf16 kernel of the first layer: {isa:?}");
    }
    if let Some(path) = save {
        model.save(std::path::Path::new(&path)).expect("save");
        println!("saved weights to {path}");
    }
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
    use brgemm_dl::gpu::{Backend, GpuDtype};
    use brgemm_dl::train_gpu;
    let fail = |msg: String| -> ! {
        eprintln!("{msg}");
        std::process::exit(2)
    };
    let backend: Backend = device
        .parse()
        .unwrap_or_else(|e| fail(format!("--device: {e}")));
    let dt = match dtype {
        "f32" => GpuDtype::F32,
        "bf16" => GpuDtype::Bf16,
        "f16" => GpuDtype::F16,
        other => fail(format!("--dtype {other:?}: expected f32, bf16 or f16")),
    };
    let all = data::digits().expect("embedded digits");
    let (tr, te) = all.split(0.2, 42);
    header(cfg, &all, &tr, &te, &format!("device {device}, {dtype}"));
    let ((_, dev), last) = cli::run_training("samples", |report| {
        train_gpu::train(cfg, backend, dt, &tr, &te, report)
    });
    println!("device: {}", dev.name());
    println!("test_accuracy={last:.4}");
}

#[cfg(not(feature = "gpu"))]
fn gpu_main(_: &train::TrainConfig, device: &str, _: &str) {
    eprintln!(
        "--device {device}: this build has no GPU support; rebuild with --features cuda \
         (or --features opencl), e.g. cargo run --release --features cuda --example train_mlp -- --device {device}"
    );
    std::process::exit(2)
}
