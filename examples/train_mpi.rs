//! Data-parallel training over MPI: the MLP on the embedded digits, or
//! (`--model cnn`) the CNN of `train_cnn` or (`--model resnet`) the small
//! ResNet of `train_resnet` on Fashion-MNIST.
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
//!
//! `--checkpoint DIR`: after every epoch rank 0 writes `DIR/checkpoint.bin`
//! (model, optimizer state, epoch, step, shuffle state; atomically).
//! `--resume DIR` goes on from it to `--epochs` in all, on any rank count,
//! and ends with the weights of a run that never stopped (to rounding when
//! the rank count changes the reduction order).

use brgemm_distributed::mpi;
use brgemm_distributed::{install_abort_on_panic, DataParallel, GradDtype, Progress};
use brgemm_dl::checkpoint::Checkpoint;
use brgemm_dl::fit::{self, Samples};
use brgemm_dl::nn::models::{mlp, LayerSpec};
use brgemm_dl::nn::{Graph, Tensor};
use brgemm_dl::{data, train_cnn};
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;
use mpi::traits::*;
use std::path::PathBuf;
use std::time::Instant;

#[path = "support/cli.rs"]
mod cli;

const USAGE: &str = "train_mpi: data-parallel training under mpirun\n\
    usage: mpirun -np N train_mpi [--model mlp|cnn|resnet --epochs N --batch GLOBAL --lr LR --seed S --data DIR --train-limit N\n\
    --checkpoint DIR --resume DIR --grad-dtype f32|bf16 --progress loop|thread|layers --bucket-kb N --link-gbps G --latency-us L]";

fn main() {
    // Options first: a usage error ends every rank alike, before MPI starts.
    let args = cli::parse(
        USAGE,
        &[
            cli::value(
                "model",
                "M",
                "mlp (digits, default), cnn or resnet (the small ResNet; both Fashion-MNIST)",
            ),
            cli::value("train-limit", "N", "cnn, resnet: train on the first N images only"),
            cli::value(
                "checkpoint",
                "DIR",
                "rank 0 writes DIR/checkpoint.bin (model, optimizer, epoch, step, shuffle state) after every epoch",
            ),
            cli::value(
                "resume",
                "DIR",
                "go on from DIR/checkpoint.bin (same --batch and --seed, any rank count) to --epochs in all",
            ),
            cli::value(
                "progress",
                "P",
                "how the all-reduce moves during backward: loop[:US] (default, tests from the loop nests every 100 us), thread[:US] or layers",
            ),
            cli::value("bucket-kb", "N", "all-reduce buckets of at least N KiB (default: from --link-gbps, else per model)"),
            cli::value(
                "link-gbps",
                "G",
                "the link between nodes, for the default bucket size (the scaling model's: 10 x nodes x latency x bandwidth)",
            ),
            cli::value("latency-us", "L", "with --link-gbps: the link's latency (default 20)"),
            cli::value(
                "grad-dtype",
                "T",
                "f32 (default) or bf16: gradients rounded to bf16 on the wire, half the bytes",
            ),
            cli::value(
                "kill-after-epoch",
                "K",
                "fault test: the last rank aborts right after epoch K's checkpoint",
            ),
        ],
    );
    args.no_model_files("data-parallel run");
    if args.flag("fused-update") {
        cli::usage_error(
            "--fused-update: a data-parallel step all-reduces every gradient before the optimizer runs",
        );
    }
    let (universe, _) =
        brgemm_distributed::initialize(mpi::Threading::Serialized).expect("MPI initialises once");
    install_abort_on_panic();
    let world = universe.world();
    match args.get_or("model", "mlp".to_string()).as_str() {
        "mlp" => {}
        "cnn" => return train_images_mpi(world, &args, false),
        "resnet" => return train_images_mpi(world, &args, true),
        other => cli::usage_error(format!("--model {other:?}: expected mlp, cnn or resnet")),
    }
    if args.get::<String>("data").is_some() || args.get::<String>("train-limit").is_some() {
        cli::usage_error("--data and --train-limit go with --model cnn or resnet");
    }
    let epochs = args.positive("epochs", 20);
    let global = args.positive("batch", 64);
    let size = world.size() as usize;

    let all = data::digits().expect("embedded digits");
    let (tr, te) = all.split(0.2, 42);
    let seed = args.get_or("seed", 1);
    let opt = Optimizer::adam(args.lr(3e-3));
    let specs = LayerSpec::classifier(&[128, 64], tr.classes);
    // Every rank plans for the largest shard.
    let model = mlp(tr.features, global.div_ceil(size), &specs, seed).expect("model");
    let plan = Plan {
        epochs,
        global,
        whole_batches: false,
        seed: seed ^ 0x5eed,
        unit: "samples",
        bucket_bytes: 64 << 10,
        opts: RunOpts::from_args(&args),
    };
    run(world, model, &plan, &opt, &tr, &te, "digits MLP");
}

/// What a data-parallel run walks.
struct Plan {
    epochs: usize,
    /// Global minibatch.
    global: usize,
    /// All-reduce bucket size.
    bucket_bytes: usize,
    /// Leave out a short last global batch (batch norm).
    whole_batches: bool,
    seed: u64,
    /// What the items are called in the throughput line.
    unit: &'static str,
    /// Checkpoints, the fault-test hook and the gradients' dtype.
    opts: RunOpts,
}

/// `--checkpoint`, `--resume`, the fault-test hook, the wire's dtype, the
/// progress strategy and the bucket size.
struct RunOpts {
    save: Option<PathBuf>,
    from: Option<PathBuf>,
    kill_after: Option<usize>,
    grad_dtype: GradDtype,
    progress: Progress,
    /// `--bucket-kb`, in bytes.
    bucket: Option<usize>,
    /// `--link-gbps` and `--latency-us`.
    link: Option<brgemm_dl::scaling::Link>,
}

impl RunOpts {
    fn from_args(args: &cli::Args) -> RunOpts {
        let file = |o: &str| {
            args.get::<String>(o).map(|d| {
                let dir = PathBuf::from(d);
                if !dir.is_dir() {
                    cli::usage_error(format!("--{o} {}: not a directory", dir.display()));
                }
                dir.join("checkpoint.bin")
            })
        };
        RunOpts {
            save: file("checkpoint"),
            from: file("resume"),
            kill_after: args.get("kill-after-epoch"),
            grad_dtype: match args.get_or("grad-dtype", "f32".to_string()).as_str() {
                "f32" => GradDtype::F32,
                "bf16" => GradDtype::Bf16,
                other => cli::usage_error(format!("--grad-dtype {other:?}: expected f32 or bf16")),
            },
            progress: args.get::<String>("progress").map_or_else(Progress::default, |p| {
                p.parse()
                    .unwrap_or_else(|e| cli::usage_error(format!("--progress {e}")))
            }),
            bucket: args.get::<usize>("bucket-kb").map(|k| {
                if k == 0 {
                    cli::usage_error("--bucket-kb 0: expected a positive number of KiB");
                }
                k << 10
            }),
            link: args.get::<f64>("link-gbps").map(|g| {
                let lat: f64 = args.get_or("latency-us", 20.0);
                if !(g > 0.0 && lat >= 0.0) {
                    cli::usage_error(format!("--link-gbps {g} --latency-us {lat}: expected a positive rate and a latency >= 0"));
                }
                brgemm_dl::scaling::Link::new(g, lat)
            }),
        }
    }

    /// The bucket size: `--bucket-kb`, else the scaling model's for
    /// `--link-gbps`, else the model's `default`.
    fn bucket_bytes(&self, nodes: usize, default: usize) -> usize {
        self.bucket
            .or_else(|| self.link.map(|l| l.bucket_bytes(nodes)))
            .unwrap_or(default)
    }
}

/// The epoch loop of both models: every rank walks the same shuffled global
/// batches and trains on its shard; rank 0 reports per epoch, every rank its
/// throughput and communication, rank 0 the final `test_accuracy=` line.
fn run(
    world: mpi::topology::SimpleCommunicator,
    mut model: Graph,
    plan: &Plan,
    opt: &Optimizer,
    tr: &impl Samples,
    te: &impl Samples,
    what: &str,
) {
    let bucket = plan
        .opts
        .bucket_bytes(world.size() as usize, plan.bucket_bytes);
    let mut dp = DataParallel::new(world, &mut model, bucket);
    dp.set_grad_dtype(plan.opts.grad_dtype);
    dp.set_progress(plan.opts.progress).unwrap_or_else(|e| {
        eprintln!("--progress: {e}");
        dp.world().abort(2)
    });
    dp.broadcast_parameters(&mut model);
    dp.calibrate(5);
    let (rank, size) = (dp.rank(), dp.size());
    let pool = cli::pool();
    if rank == 0 {
        println!(
            "{what}: {} train / {} test; {size} rank(s) x {} thread(s); global batch {}; {} all-reduce bucket(s) of >= {} KiB of {:?} gradients, progress {}",
            tr.len(),
            te.len(),
            pool.threads(),
            plan.global,
            dp.buckets(),
            bucket >> 10,
            dp.grad_dtype(),
            dp.progress()
        );
    }
    let mut x = Tensor::zeros(model.input_shape());

    let mut order: Vec<usize> = (0..tr.len()).collect();
    let mut rng = Rng::new(plan.seed);
    let (mut first, mut done_steps) = (1, 0u64);
    if let Some(path) = &plan.opts.from {
        // Every rank reads the same file: all go on from the same place.
        let ck = Checkpoint::load(path).unwrap_or_else(|e| {
            eprintln!("rank {rank}: --resume: {e}");
            dp.world().abort(1)
        });
        if (ck.global_batch, ck.seed) != (plan.global as u64, plan.seed) {
            eprintln!(
                "rank {rank}: --resume: the checkpoint is of a run with global batch {} (seed {:#x}), this one has {} ({:#x})",
                ck.global_batch, ck.seed, plan.global, plan.seed
            );
            dp.world().abort(1)
        }
        ck.restore(&mut model).unwrap_or_else(|e| {
            eprintln!("rank {rank}: --resume: {e}");
            dp.world().abort(1)
        });
        rng = Rng::new(ck.rng);
        (first, done_steps) = (ck.epoch as usize + 1, ck.steps);
        if rank == 0 {
            println!("resumed after epoch {} (step {})", ck.epoch, ck.steps);
        }
    }
    let (mut samples, mut secs) = (0usize, 0.0f64);
    let mut acc = 0.0;
    for epoch in first..=plan.epochs {
        // Each epoch shuffles the items in their own order, so the
        // generator's state alone says what comes next (a checkpoint).
        order.iter_mut().enumerate().for_each(|(i, o)| *o = i);
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
            let labels = tr.fill(mine, x.data_mut());
            // The guard sees the same global values on every rank, so all
            // ranks stop at the same step.
            let loss = dp
                .train_step(&mut model, pool, &x, &labels, batch.len(), opt)
                .unwrap_or_else(|e| {
                    eprintln!("rank {rank}: training failed: {e}");
                    dp.world().abort(1)
                });
            loss_sum += loss as f64;
            samples += mine.len();
            steps += 1;
            done_steps += 1;
        }
        secs += t.elapsed().as_secs_f64();
        acc = fit::accuracy(&mut model, pool, te).expect("eval");
        if rank == 0 {
            println!(
                "epoch {epoch:3}  loss {:.4}  test_acc {acc:.4}",
                loss_sum / steps.max(1) as f64
            );
        }
        if let Some(path) = &plan.opts.save {
            if rank == 0 {
                Checkpoint::of(
                    &mut model,
                    epoch as u64,
                    done_steps,
                    rng.state(),
                    plan.global as u64,
                    plan.seed,
                )
                .and_then(|ck| ck.save(path))
                .unwrap_or_else(|e| {
                    eprintln!("rank 0: --checkpoint: {e}");
                    dp.world().abort(1)
                });
            }
            // No rank runs ahead of a checkpoint being written.
            dp.world().barrier();
        }
        if plan.opts.kill_after == Some(epoch) && rank == size - 1 {
            eprintln!("rank {rank}: aborting after epoch {epoch} (--kill-after-epoch)");
            std::process::abort();
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

/// The CNN of `train_cnn` or (`resnet`) the small ResNet of `train_resnet`
/// on Fashion-MNIST, data-parallel (batch norm per rank, unsynchronised).
fn train_images_mpi(world: mpi::topology::SimpleCommunicator, args: &cli::Args, resnet: bool) {
    let epochs = args.positive("epochs", 2);
    let global = args.positive("batch", 64);
    let limit = args.positive("train-limit", usize::MAX);
    let size = world.size() as usize;
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
        optimizer: Optimizer::adam(args.lr(1e-3)),
        ..Default::default()
    };
    if resnet && tr.dims != (1, 28, 28) {
        cli::usage_error(format!(
            "--model resnet takes 1x28x28 images, the data have {:?}",
            tr.dims
        ));
    }
    let (model, what) = if resnet {
        let g = brgemm_dl::nn::models::small_resnet(cfg.batch, tr.data.classes, cfg.seed);
        (g.expect("model"), "fashion-mnist small ResNet")
    } else {
        (
            train_cnn::build(&cfg, &tr).expect("model"),
            "fashion-mnist CNN",
        )
    };
    let plan = Plan {
        epochs,
        global,
        whole_batches: true,
        seed: cfg.seed ^ 0xc22,
        unit: "images",
        bucket_bytes: 256 << 10,
        opts: RunOpts::from_args(args),
    };
    run(world, model, &plan, &cfg.optimizer, &tr, &te, what);
}
