//! Driver for the MPI tests (run under `mpirun`): trains a small MLP, CNN or
//! residual network (all layer graphs) on seeded synthetic data for a few data-parallel steps and writes rank
//! 0's final parameters, so runs on different rank counts can be compared.
//!
//! ```text
//! ddp_check train [--model mlp|cnn|graph] --steps S --global-batch G --out FILE [--bucket-kb B] [--panic-rank R] [--grad-bf16]
//!     [--progress loop[:US]|thread[:US]|layers]
//! ddp_check allreduce            (bucketed all-reduce vs the local sum)
//! ```

use brgemm_distributed::{install_abort_on_panic, DataParallel, GradDtype, Progress, Replica};
use brgemm_nn::models::{mlp, CnnSpec, LayerSpec, StageSpec};
use brgemm_nn::{
    Conv2d, GlobalAvgPool, Graph, GraphBuilder, Linear, Relu, Shape, Tensor as NnTensor,
};
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Activation, Pool};
use mpi::traits::*;

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} {v:?}: not a number"))
        })
        .unwrap_or(default)
}

fn main() {
    let (universe, _) =
        brgemm_distributed::initialize(mpi::Threading::Serialized).expect("MPI initialises once");
    install_abort_on_panic();
    let world = universe.world();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(|s| s.as_str()) {
        Some("allreduce") => check_allreduce(world),
        Some("train") => train(world, &args),
        _ => panic!("usage: ddp_check train|allreduce ..."),
    }
}

fn check_allreduce(world: mpi::topology::SimpleCommunicator) {
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let value = |r: usize, i: usize| ((r * 31 + i * 7) % 17) as f32 - 8.0;
    let n = 10_007;
    let mut buf: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
    let spec = LayerSpec {
        out: 2,
        act: Activation::Identity,
    };
    let mut m = mlp(3, 2, &[spec], 1).unwrap();
    let dp = DataParallel::new(world, &mut m, 1 << 12);
    dp.allreduce_sum(&mut buf, 1000);
    for (i, v) in buf.iter().enumerate() {
        let want: f32 = (0..size).map(|r| value(r, i)).sum();
        assert_eq!(*v, want, "element {i} on rank {rank}");
    }
    if rank == 0 {
        println!("allreduce ok: {n} elements, {size} ranks, buckets of 1000");
    }
}

fn train(world: mpi::topology::SimpleCommunicator, args: &[String]) {
    let global = arg(args, "--global-batch", 24);
    let size = world.size() as usize;
    // Every rank plans for the largest shard; different seeds per rank prove
    // the broadcast replaces them with rank 0's weights.
    let local_max = global.div_ceil(size);
    let seed = 100 + world.rank() as u64;
    let model = args
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| args.get(i + 1))
        .map_or("mlp", |m| m.as_str());
    // Seeded synthetic data: 97 rows of 2x6x6 = 72 features, 5 classes.
    let (rows, feats, classes) = (97usize, 72usize, 5usize);
    let mut r = Rng::new(7);
    let data: Vec<f32> = (0..rows * feats).map(|_| 2.0 * r.uniform() - 1.0).collect();
    let labels: Vec<usize> = (0..rows).map(|_| r.below(classes)).collect();
    let g = match model {
        "graph" => residual_graph(local_max, classes, seed),
        "cnn" => CnnSpec {
            input: (2, 6, 6),
            stages: vec![
                StageSpec {
                    channels: 5,
                    kernel: 3,
                    batchnorm: false,
                    pool: 2,
                },
                StageSpec {
                    channels: 6,
                    kernel: 3,
                    batchnorm: false,
                    pool: 1,
                },
            ],
            hidden: vec![12],
            classes,
            dropout: 0.0,
        }
        .graph(local_max, seed)
        .unwrap(),
        "mlp" => {
            let act = |out, act| LayerSpec { out, act };
            let specs = [
                act(48, Activation::Tanh),
                act(40, Activation::Relu),
                act(classes, Activation::Identity),
            ];
            mlp(feats, local_max, &specs, seed).unwrap()
        }
        other => panic!("--model {other:?}: expected mlp, cnn or graph"),
    };
    drive(world, args, g, &data, feats, &labels);
}

/// Data-parallel steps of `model` on the synthetic rows (`feats` values
/// each); rank 0 writes the final parameters (every group's buffers, one
/// value per line).
fn drive(
    world: mpi::topology::SimpleCommunicator,
    args: &[String],
    mut model: Graph,
    data: &[f32],
    feats: usize,
    labels: &[usize],
) {
    let rows = labels.len();
    let mut x = NnTensor::zeros(model.input_shape());
    let steps = arg(args, "--steps", 5);
    let global = arg(args, "--global-batch", 24);
    let bucket = arg(args, "--bucket-kb", 4) << 10;
    let panic_rank = arg(args, "--panic-rank", usize::MAX);
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let size = world.size() as usize;
    let mut dp = DataParallel::new(world, &mut model, bucket);
    if args.iter().any(|a| a == "--grad-bf16") {
        dp.set_grad_dtype(GradDtype::Bf16);
    }
    if let Some(p) = args.iter().position(|a| a == "--progress") {
        let p: Progress = args[p + 1].parse().expect("--progress");
        dp.set_progress(p).expect("progress strategy");
    }
    dp.broadcast_parameters(&mut model);
    dp.calibrate(3);
    let pool = Pool::new(1).unwrap();
    let opt = Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
    };
    for step in 0..steps {
        if step == 1 && dp.rank() == panic_rank {
            panic!("deliberate panic on rank {panic_rank} (fault test)");
        }
        let shard = dp.shard(global);
        x.data_mut().fill(0.0);
        let mut lab = Vec::new();
        for (row, g) in shard.clone().enumerate() {
            let i = (step * global + g) % rows;
            x.data_mut()[row * feats..][..feats].copy_from_slice(&data[i * feats..][..feats]);
            lab.push(labels[i]);
        }
        let loss = dp
            .train_step(&mut model, &pool, &x, &lab, global, &opt)
            .unwrap();
        if dp.rank() == 0 {
            println!("step {step} loss {loss:.6}");
        }
    }
    if dp.rank() == 0 {
        if let Some(path) = out {
            let mut text = String::new();
            for g in 0..model.groups() {
                for buf in model.parameters_mut(g) {
                    for v in buf.iter() {
                        text.push_str(&format!("{v:e}\n"));
                    }
                }
            }
            std::fs::write(&path, text).unwrap();
        }
        println!(
            "ranks {size} buckets {} hidden {:.2}",
            dp.buckets(),
            dp.stats.hidden_fraction()
        );
    }
}

/// A residual network on 2x6x6 inputs: conv, conv + the shortcut, ReLU,
/// global average pooling, a classifier (no batch norm: each rank would
/// normalise with its own shard's statistics).
fn residual_graph(batch: usize, classes: usize, seed: u64) -> Graph {
    let mut b = GraphBuilder::new(Shape::new(batch, 2, 6, 6));
    let x = b.input();
    let a = b
        .layer(x, Conv2d::new(2, 6, (3, 3), 1, 1, Activation::Tanh, seed))
        .unwrap();
    let c = b
        .layer(
            a,
            Conv2d::new(6, 6, (3, 3), 1, 1, Activation::Identity, seed + 1),
        )
        .unwrap();
    let s = b.add(c, a).unwrap();
    let r = b.layer(s, Relu::new()).unwrap();
    let p = b.layer(r, GlobalAvgPool::new()).unwrap();
    let out = b
        .layer(p, Linear::new(6, classes, Activation::Identity, seed + 2))
        .unwrap();
    b.build(out).unwrap()
}
