//! Trains a small ResNet on Fashion-MNIST with the layer graph
//! (`brgemm_nn::models::small_resnet`: a 3x3 stem, three basic residual
//! blocks of 16, 32 and 64 channels with batch norm and projection
//! shortcuts, global average pooling, a linear classifier) with Adam and a
//! per-epoch cosine decay of the learning rate. Prints per-epoch loss, test
//! accuracy and images/s, and ends with `test_accuracy=<fraction>`.
//!
//! ```text
//! cargo run --release --example train_resnet [-- --data DIR --epochs N --batch B --lr LR
//!     --train-limit N --seed S --save FILE --load FILE --dtype f32|bf16]
//! cargo run --release --features cuda --example train_resnet -- --device opencl|cuda [--dtype f32|bf16|f16]
//! ```
//!
//! `--device` trains the same graph on a GPU (`brgemm_gpu::GpuGraph`: the
//! convolutions as generated BRGEMMs, batch norm, ReLU, residual adds and
//! pooling on the device) from the same weights, shuffles and schedule.
//!
//! `--save` writes the trained graph's values (`Graph::save`: versioned,
//! PyTorch layouts); `--load` starts from them, and with `--epochs 0` only
//! evaluates. The file fits any batch size: it holds no minibatch.
//!
//! Data: the IDX files of Fashion-MNIST (Xiao, Rasul and Vollgraf 2017, MIT
//! licence) as the Debian package `dataset-fashion-mnist` installs them in
//! /usr/share/datasets/fashion-mnist, or in `--data DIR`.

use brgemm_dl::data::{self, ImageSet};
use brgemm_dl::nn::{models, Graph, Shape, Tensor};
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::Pool;
use std::time::Instant;

#[path = "support/cli.rs"]
mod cli;

const USAGE: &str = "train_resnet: a small ResNet on Fashion-MNIST (layer graph)\n\
    usage: train_resnet [--data DIR --epochs N --batch B --lr LR --train-limit N --seed S\n\
    --save FILE --load FILE --dtype f32|bf16 --device cpu|opencl|cuda]";

/// Ends the process with status 1 and the error.
fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("error: {e}");
    std::process::exit(1)
}

/// The images `idx` (padded with zeros to the graph's minibatch) and their
/// labels.
fn batch(set: &ImageSet, idx: &[usize], shape: Shape) -> (Tensor, Vec<usize>) {
    let f = set.data.features;
    let mut x = vec![0.0f32; shape.len()];
    for (row, &i) in idx.iter().enumerate() {
        x[row * f..][..f].copy_from_slice(&set.data.x[i * f..][..f]);
    }
    let labels = idx.iter().map(|&i| set.data.y[i]).collect();
    (
        Tensor::from_vec(shape, x).expect("sized to the shape"),
        labels,
    )
}

/// Accuracy on `set`, in minibatches of the graph's size (the last one
/// padded; its padding rows are not counted).
fn accuracy(g: &mut Graph, pool: &Pool, set: &ImageSet) -> f64 {
    let shape = g.input_shape();
    let mut right = 0;
    let all: Vec<usize> = (0..set.data.len()).collect();
    for idx in all.chunks(shape.n) {
        let (x, labels) = batch(set, idx, shape);
        let pred = g.predict(pool, &x).unwrap_or_else(|e| fail(e));
        right += pred.iter().zip(&labels).filter(|(p, l)| p == l).count();
    }
    right as f64 / set.data.len() as f64
}

fn main() {
    let args = cli::parse(
        USAGE,
        &[
            cli::value("train-limit", "N", "train on the first N images only"),
            cli::value("device", "D", "cpu, or opencl|cuda with --features cuda"),
            cli::DTYPE,
        ],
    );
    let bf16 = args.bf16();
    let dtype = if bf16 { "bf16" } else { "f32" };
    let epochs = args.epochs(8);
    let bs = args.positive("batch", 64);
    let seed: u64 = args.get_or("seed", 1);
    let lr = args.lr(2e-3);
    let limit: usize = args.positive("train-limit", usize::MAX);
    let dir: String = args.get_or("data", data::FASHION_MNIST_DIR.to_string());
    let (mut tr, te) = data::fashion_mnist(std::path::Path::new(&dir)).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    if tr.dims != (1, 28, 28) || te.dims != (1, 28, 28) {
        fail(format!(
            "the small ResNet takes 1x28x28 images, got {:?} / {:?}",
            tr.dims, te.dims
        ));
    }
    if limit < tr.data.len() {
        let idx: Vec<usize> = (0..limit).collect();
        tr.data = tr.data.subset(&idx);
    }
    let device: String = args.get_or("device", "cpu".to_string());
    if device != "cpu" {
        args.no_model_files("GPU ResNet");
        let dt: String = args.get_or("dtype", "f32".to_string());
        return gpu_main(&device, &dt, &tr, &te, (epochs, bs, lr, seed));
    }
    // Per image: about 40 activation-sized buffers of up to 16x28x28 f32.
    cli::check_batch_memory(bs, 40 * 4 * 16 * 28 * 28);
    let pool = cli::pool();
    let save = args.save_path();
    let mut g = models::small_resnet(bs, tr.data.classes, seed).unwrap_or_else(|e| fail(e));
    // No gradient check runs here, so nothing waits for whole gradients.
    g.set_fused_update(args.flag("fused-update"))
        .unwrap_or_else(|e| fail(e));
    if let Some(path) = args.get::<String>("load") {
        g.load(&path).unwrap_or_else(|e| fail(e));
    }
    let in_bf16 = g.set_bf16(bf16).unwrap_or_else(|e| fail(e));
    println!(
        "fashion-mnist: {} train / {} test images; small ResNet ({} layers, {in_bf16} in bf16, {} bf16 handoffs, {} outputs in bf16 alone); batch {bs}, {} thread(s), {dtype}",
        tr.data.len(),
        te.data.len(),
        g.layer_names().len(),
        g.bf16_handoffs(),
        g.bf16_only_outputs(),
        pool.threads()
    );
    let mut rng = Rng::new(seed);
    let mut order: Vec<usize> = (0..tr.data.len()).collect();
    let mut last = if epochs == 0 {
        accuracy(&mut g, pool, &te)
    } else {
        0.0
    };
    for epoch in 1..=epochs {
        // Cosine decay of the learning rate over the epochs (per epoch).
        let phase = std::f32::consts::PI * (epoch - 1) as f32 / epochs as f32;
        let opt = Optimizer::adam(lr * 0.5 * (1.0 + phase.cos()));
        rng.shuffle(&mut order);
        let t0 = Instant::now();
        let (mut sum, mut steps) = (0.0f64, 0usize);
        // Whole minibatches only: a short last one would train on padding.
        for idx in order.chunks_exact(bs) {
            let (x, labels) = batch(&tr, idx, g.input_shape());
            let loss = g
                .train_step(pool, &x, &labels, &opt)
                .unwrap_or_else(|e| fail(e));
            sum += f64::from(loss);
            steps += 1;
        }
        let secs = t0.elapsed().as_secs_f64();
        last = accuracy(&mut g, pool, &te);
        println!(
            "epoch {epoch}: loss {:.4}, test accuracy {last:.4}, {:.0} images/s",
            sum / steps.max(1) as f64,
            (steps * bs) as f64 / secs
        );
    }
    if let Some(path) = save {
        g.save(&path).unwrap_or_else(|e| fail(e));
        println!("saved {}", path.display());
    }
    println!("test_accuracy={last:.4}");
}

/// The training loop above on a GPU: the same graph, weights, shuffles,
/// whole minibatches and cosine schedule; the losses read every 16 steps.
#[cfg(feature = "gpu")]
fn gpu_main(
    device: &str,
    dtype: &str,
    tr: &ImageSet,
    te: &ImageSet,
    (epochs, bs, lr, seed): (usize, usize, f32, u64),
) {
    use brgemm_dl::gpu::{Device, GpuGraph, GpuMlp};
    let (backend, dt) = cli::gpu_target(device, dtype);
    let cpu = models::small_resnet(bs, tr.data.classes, seed).unwrap_or_else(|e| fail(e));
    let dev = Device::open(backend).unwrap_or_else(|e| fail(e));
    let mut g = GpuGraph::from_cpu(&dev, &cpu, dt).unwrap_or_else(|e| fail(e));
    let train_d = g
        .dataset(&dev, &tr.data.x, &tr.data.y)
        .unwrap_or_else(|e| fail(e));
    let test_d = g
        .dataset(&dev, &te.data.x, &te.data.y)
        .unwrap_or_else(|e| fail(e));
    println!(
        "fashion-mnist: {} train / {} test images; small ResNet on {}; batch {bs}, {dtype}",
        tr.data.len(),
        te.data.len(),
        dev.name()
    );
    let accuracy = |g: &mut GpuGraph| -> f64 {
        let all: Vec<usize> = (0..te.data.len()).collect();
        let mut right = 0;
        for idx in all.chunks(bs) {
            let pred = g.predict_on(&dev, &test_d, idx).unwrap_or_else(|e| fail(e));
            right += pred
                .iter()
                .zip(idx)
                .filter(|(p, &i)| **p == te.data.y[i])
                .count();
        }
        right as f64 / te.data.len() as f64
    };
    let mut rng = Rng::new(seed);
    let mut order: Vec<usize> = (0..tr.data.len()).collect();
    let mut last = if epochs == 0 { accuracy(&mut g) } else { 0.0 };
    let t_all = Instant::now();
    for epoch in 1..=epochs {
        let phase = std::f32::consts::PI * (epoch - 1) as f32 / epochs as f32;
        let opt = Optimizer::adam(lr * 0.5 * (1.0 + phase.cos()));
        rng.shuffle(&mut order);
        let t0 = Instant::now();
        let (mut sum, mut steps) = (0.0f64, 0usize);
        for idx in order.chunks_exact(bs) {
            g.train_step_on(&dev, &train_d, idx, &opt)
                .unwrap_or_else(|e| fail(e));
            steps += 1;
            if steps % GpuMlp::LOSS_WINDOW == 0 {
                sum += g
                    .losses(&dev)
                    .unwrap_or_else(|e| fail(e))
                    .iter()
                    .map(|&l| f64::from(l))
                    .sum::<f64>();
            }
        }
        sum += g
            .losses(&dev)
            .unwrap_or_else(|e| fail(e))
            .iter()
            .map(|&l| f64::from(l))
            .sum::<f64>();
        let secs = t0.elapsed().as_secs_f64();
        last = accuracy(&mut g);
        println!(
            "epoch {epoch}: loss {:.4}, test accuracy {last:.4}, {:.0} images/s",
            sum / steps.max(1) as f64,
            (steps * bs) as f64 / secs
        );
    }
    println!("trained in {:.2} s", t_all.elapsed().as_secs_f64());
    println!("device: {}", dev.name());
    println!("test_accuracy={last:.4}");
}

#[cfg(not(feature = "gpu"))]
fn gpu_main(device: &str, _: &str, _: &ImageSet, _: &ImageSet, _: (usize, usize, f32, u64)) {
    cli::no_gpu_build("train_resnet", device)
}
