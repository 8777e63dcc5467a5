//! Data-parallel training over MPI: the MLP on the embedded digits, or
//! (`--model cnn`) the CNN of `train_cnn` on Fashion-MNIST.
//!
//! ```text
//! cargo build --release --features mpi --example train_mpi
//! mpirun --allow-run-as-root -np 2 target/release/examples/train_mpi [--epochs N --batch GLOBAL]
//! mpirun --allow-run-as-root -np 2 target/release/examples/train_mpi --model cnn [--epochs N --batch GLOBAL --data DIR --train-limit N]
//! ```
//!
//! Every rank holds a replica; each global minibatch (same order whatever the
//! rank count) is split across ranks, gradients are all-reduced in buckets
//! while backward runs. Rank 0 prints per-epoch loss and test accuracy; every
//! rank prints its throughput, all-reduce time and the share of it hidden
//! under backward. Ends with `test_accuracy=<fraction>` (rank 0).

use brgemm_distributed::mpi;
use brgemm_distributed::{install_abort_on_panic, DataParallel, Replica};
use brgemm_dl::{data, train, train_cnn};
use brgemm_primitives::init::Rng;
use mpi::traits::*;
use std::time::Instant;

#[path = "support/cli.rs"]
mod cli;

const USAGE: &str = "train_mpi: data-parallel training under mpirun\n\
    usage: mpirun -np N train_mpi [--model mlp|cnn --epochs N --batch GLOBAL --lr LR --seed S --data DIR --train-limit N]";

fn main() {
    // Options first: a usage error ends every rank alike, before MPI starts.
    let args = cli::parse(
        USAGE,
        &[
            cli::value("model", "M", "mlp (digits, default) or cnn (Fashion-MNIST)"),
            cli::value("train-limit", "N", "cnn: train on the first N images only"),
        ],
    );
    args.no_model_files("data-parallel run");
    let universe = mpi::initialize().expect("MPI initialises once");
    install_abort_on_panic();
    let world = universe.world();
    match args.get_or("model", "mlp".to_string()).as_str() {
        "mlp" => {}
        "cnn" => return train_cnn_mpi(world, &args),
        other => cli::usage_error(format!("--model {other:?}: expected mlp or cnn")),
    }
    if args.get::<String>("data").is_some() || args.get::<String>("train-limit").is_some() {
        cli::usage_error("--data and --train-limit go with --model cnn");
    }
    let epochs = args.positive("epochs", 20);
    let global = args.positive("batch", 64);
    let (rank, size) = (world.rank() as usize, world.size() as usize);

    let all = data::digits().expect("embedded digits");
    let (tr, te) = all.split(0.2, 42);
    let cfg = train::TrainConfig {
        batch: global.div_ceil(size),
        seed: args.get_or("seed", 1),
        optimizer: brgemm_primitives::optim::Optimizer::adam(args.lr(3e-3)),
        tuning_file: args.tuning_file(),
        ..Default::default()
    };
    let mut model = train::build(&cfg, &tr).expect("model");
    let mut dp = DataParallel::new(world, &mut model, 64 << 10);
    dp.broadcast_parameters(&mut model);
    dp.calibrate(5);
    let pool = cli::pool();
    if rank == 0 {
        println!(
            "digits: {} train / {} test; {size} rank(s) x {} thread(s); global batch {global}; {} all-reduce bucket(s)",
            tr.len(),
            te.len(),
            pool.threads(),
            dp.buckets()
        );
    }
    let x = model.input_layout();
    let plan = Plan {
        epochs,
        global,
        len: tr.len(),
        whole_batches: false,
        seed: cfg.seed ^ 0x5eed,
        unit: "samples",
    };
    run(
        &mut dp,
        &mut model,
        x,
        &plan,
        &cfg.optimizer,
        |idx, x| tr.fill_batch(idx, x),
        |m| train::accuracy(m, pool, &te).expect("eval"),
    );
}

/// What a data-parallel run walks.
struct Plan {
    epochs: usize,
    /// Global minibatch.
    global: usize,
    /// Training items.
    len: usize,
    /// Leave out a short last global batch (batch norm).
    whole_batches: bool,
    seed: u64,
    /// What the items are called in the throughput line.
    unit: &'static str,
}

/// The epoch loop of both models: every rank walks the same shuffled global
/// batches and trains on its shard; rank 0 reports per epoch, every rank its
/// throughput and communication, rank 0 the final `test_accuracy=` line.
fn run<R: Replica>(
    dp: &mut DataParallel,
    model: &mut R,
    mut x: R::Input,
    plan: &Plan,
    opt: &brgemm_primitives::optim::Optimizer,
    mut fill: impl FnMut(&[usize], &mut R::Input) -> Vec<usize>,
    mut evaluate: impl FnMut(&mut R) -> f64,
) {
    let (rank, size) = (dp.rank(), dp.size());
    let pool = cli::pool();
    let mut order: Vec<usize> = (0..plan.len).collect();
    let mut rng = Rng::new(plan.seed);
    let (mut samples, mut secs) = (0usize, 0.0f64);
    let mut acc = 0.0;
    for epoch in 1..=plan.epochs {
        rng.shuffle(&mut order);
        let t = Instant::now();
        let (mut loss_sum, mut steps) = (0.0f64, 0usize);
        for batch in order.chunks(plan.global) {
            // A short last global batch: skipped when a rank would get no
            // rows, or when only whole batches are wanted.
            if batch.len() < size || (plan.whole_batches && batch.len() < plan.global) {
                continue;
            }
            let mine = &batch[dp.shard(batch.len())];
            let labels = fill(mine, &mut x);
            // The guard sees the same global values on every rank, so all
            // ranks stop at the same step.
            let loss = dp
                .train_step(model, pool, &x, &labels, batch.len(), opt)
                .unwrap_or_else(|e| {
                    eprintln!("rank {rank}: training failed: {e}");
                    dp.world().abort(1)
                });
            loss_sum += loss as f64;
            samples += mine.len();
            steps += 1;
        }
        secs += t.elapsed().as_secs_f64();
        acc = evaluate(model);
        if rank == 0 {
            println!(
                "epoch {epoch:3}  loss {:.4}  test_acc {acc:.4}",
                loss_sum / steps.max(1) as f64
            );
        }
    }
    let s = dp.stats;
    println!(
        "rank {rank}: {:.0} {}/s, all-reduce alone {:.3} ms/step, not waited for after backward {:.2} (upper bound of the hidden share; bench mpi measures it from step times)",
        samples as f64 / secs,
        plan.unit,
        1e3 * s.standalone_s,
        s.hidden_fraction()
    );
    dp.world().barrier();
    if rank == 0 {
        println!("test_accuracy={acc:.4}");
    }
}

/// The CNN of `train_cnn` on Fashion-MNIST, data-parallel.
fn train_cnn_mpi(world: mpi::topology::SimpleCommunicator, args: &cli::Args) {
    let epochs = args.positive("epochs", 2);
    let global = args.positive("batch", 64);
    let limit = args.positive("train-limit", usize::MAX);
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let dir: String = args.get_or("data", data::FASHION_MNIST_DIR.into());
    let (mut tr, te) = data::fashion_mnist(std::path::Path::new(&dir)).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    if limit < tr.data.len() {
        tr.data = tr.data.subset(&(0..limit).collect::<Vec<_>>());
    }
    let cfg = train_cnn::CnnConfig {
        batch: global.div_ceil(size),
        seed: args.get_or("seed", 1),
        optimizer: brgemm_primitives::optim::Optimizer::adam(args.lr(1e-3)),
        ..Default::default()
    };
    let mut model = train_cnn::build(&cfg, &tr).expect("model");
    let mut dp = DataParallel::new(world, &mut model, 256 << 10);
    dp.broadcast_parameters(&mut model);
    dp.calibrate(5);
    let pool = cli::pool();
    if rank == 0 {
        println!(
            "fashion-mnist CNN: {} train / {} test; {size} rank(s) x {} thread(s); global batch {global}; {} all-reduce bucket(s)",
            tr.data.len(),
            te.data.len(),
            pool.threads(),
            dp.buckets()
        );
    }
    let x = model.input_tensor();
    let plan = Plan {
        epochs,
        global,
        len: tr.data.len(),
        whole_batches: true,
        seed: cfg.seed ^ 0xc22,
        unit: "images",
    };
    run(
        &mut dp,
        &mut model,
        x,
        &plan,
        &cfg.optimizer,
        |idx, x| train_cnn::fill_images(&tr, idx, x),
        |m| train_cnn::accuracy(m, pool, &te).expect("eval"),
    );
}
