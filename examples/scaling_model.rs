//! Projects data-parallel scaling beyond one box from measured per-layer
//! compute times and a ring all-reduce cost model.
//!
//! ```text
//! cargo run --release --example scaling_model -- [--bandwidth-gbps 100] [--latency-us 5]
//!     [--host-us-per-mb 0] [--batch 64] [--threads T] [--max-nodes 256]
//! ```
//!
//! The cost model is [`brgemm_dl::scaling`] (ring all-reduce of B bytes
//! over p nodes: `2 (p-1) latency + 2 (p-1)/p B / bandwidth`; optionally
//! `--host-us-per-mb`, the cores' time per MB all-reduced where no NIC
//! offloads the work, which delays the backward it overlaps), checked
//! against measured steps by `bench mpi --cluster`. Timeline of one step
//! (weak scaling, `--batch` samples per node): forward, then backward from
//! the last layer down. Layer l's gradient is ready after its
//! backward-weights pass; its all-reduce starts then, or when the network
//! is free, whichever is later. The step ends when backward and the last
//! all-reduce have both finished, plus the optimizer. Layer 0's all-reduce
//! can never hide (nothing of backward is left after it); the table reports,
//! for every other layer, the node count from which its all-reduce no longer
//! finishes under backward. Defaults model a 100 Gb/s fabric.
//!
//! The models (`--model mlp|cnn|both`, default both): the MLP of `bench mpi`
//! (1024-1024x3-10) and the CNN of `train_cnn` (conv3x3 1->32 + pool, conv3x3
//! 32->64 + pool, FC 3136->128, FC 128->10 on 28x28 images; a conv layer's
//! times include its ReLU and pooling).

use brgemm_dl::scaling::{Link, Timeline};
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::{Activation, Conv, ConvParams, Fc, Pool, Pool2d, PoolKind};
use std::time::Instant;

fn arg(args: &[String], name: &str, default: f64) -> f64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse().unwrap_or_else(|_| {
                eprintln!("{name} {v:?}: expected a number");
                std::process::exit(2)
            })
        })
        .unwrap_or(default)
}

struct LayerCost {
    name: String,
    fwd: f64,
    bwd: f64,
    upd: f64,
    grad_bytes: f64,
}

fn median(mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..7)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[3]
}

/// FC layers `dims[0] -> dims[1] -> ...`; the first needs no input gradient
/// unless `input_grad` (a network below it).
fn measure(pool: &Pool, batch: usize, dims: &[usize], input_grad: bool) -> (Vec<LayerCost>, f64) {
    let mut layers = vec![];
    let mut opt_s = 0.0;
    for (l, w) in dims.windows(2).enumerate() {
        let (c, k) = (w[0], w[1]);
        let act = if l + 2 == dims.len() {
            Activation::Identity
        } else {
            Activation::Relu
        };
        let fc = Fc::new(batch, c, k, act).expect("plan");
        let mut x = fc.x_layout();
        x.data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 7) as f32 / 8.0);
        let mut wt = fc.w_layout();
        wt.data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 5) as f32 / 64.0);
        let b = vec![0.0; fc.padded_k()];
        let (mut y, mut dy, mut dz, mut dx) =
            (fc.y_layout(), fc.y_layout(), fc.y_layout(), fc.x_layout());
        dy.data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 3) as f32 - 1.0);
        let (mut dzt, mut dw) = (fc.dzt_layout(), fc.w_layout());
        let mut db = vec![0.0; fc.padded_k()];
        let fwd = median(|| fc.forward(pool, &x, &wt, &b, &mut y, None).unwrap());
        let upd = median(|| {
            fc.activation_backward(pool, &dy, &y, None, &mut dz, None)
                .unwrap();
            fc.backward_weights(pool, &dz, &x, &mut dw, &mut db)
                .unwrap();
        });
        // Layer 0 needs no gradient for its input (unless a network is below).
        let bwd = if l == 0 && !input_grad {
            0.0
        } else {
            median(|| {
                fc.backward_data(pool, &dz, &wt, &mut dzt, &mut dx).unwrap();
            })
        };
        let mut st = OptState::default();
        let mut p = wt.data().to_vec();
        opt_s += median(|| st.step(&Optimizer::adam(1e-3), &mut p, dw.data()));
        layers.push(LayerCost {
            name: format!("fc{l} {c}->{k}"),
            fwd,
            bwd,
            upd,
            grad_bytes: 4.0 * (dw.data().len() + db.len()) as f64,
        });
    }
    (layers, opt_s)
}

/// The CNN's layers: convolutions (with their pooling) then the FC head.
fn measure_cnn(pool: &Pool, batch: usize) -> (Vec<LayerCost>, f64) {
    let mut layers = vec![];
    let mut opt_s = 0.0;
    for (l, (c, k, hw)) in [(1usize, 32usize, 28usize), (32, 64, 14)]
        .into_iter()
        .enumerate()
    {
        let conv = Conv::new(
            ConvParams::new(batch, c, k, hw, hw, 3, 3).pad(1),
            Activation::Relu,
        )
        .expect("plan");
        let mut x = conv.x_tensor();
        x.data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 7) as f32 / 8.0);
        let (mut w, mut wt, mut dw) = (conv.filter(), conv.filter_t(), conv.filter());
        // Written, not just allocated: never-written pages all map to the
        // zero page and would read as if L1-resident.
        w.data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 5) as f32 / 64.0);
        let b = vec![0.0; conv.padded_k()];
        let mut db = b.clone();
        let (mut y, mut dz, mut dx) = (conv.y_tensor(), conv.y_tensor(), conv.x_tensor());
        let mp = Pool2d::new(PoolKind::Max, &y, 2, 2, 0).expect("pool");
        let (mut py, mut am) = (mp.output(), vec![0u32; mp.output().data().len()]);
        let fwd = median(|| {
            conv.forward(pool, &x, &w, &b, &mut y).unwrap();
            mp.forward(pool, &y, &mut py, Some(&mut am)).unwrap();
        });
        let upd = median(|| {
            mp.backward(pool, &py, Some(&am), &mut dz).unwrap();
            conv.backward_weights(pool, &dz, &x, &mut dw, &mut db)
                .unwrap();
        });
        let bwd = if l == 0 {
            0.0
        } else {
            median(|| {
                conv.transpose_filter(pool, &w, &mut wt).unwrap();
                conv.backward_data(pool, &dz, &wt, &mut dx).unwrap();
            })
        };
        let mut st = OptState::default();
        let mut p = w.data().to_vec();
        opt_s += median(|| st.step(&Optimizer::adam(1e-3), &mut p, dw.data()));
        layers.push(LayerCost {
            name: format!("conv{l} {c}->{k}"),
            fwd,
            bwd,
            upd,
            grad_bytes: 4.0 * (dw.data().len() + db.len()) as f64,
        });
    }
    let (fc, fc_opt) = measure(pool, batch, &[64 * 7 * 7, 128, 10], true);
    for (i, mut l) in fc.into_iter().enumerate() {
        l.name = format!("fc{} {}", i + 2, l.name.split_once(' ').map_or("", |x| x.1));
        layers.push(l);
    }
    (layers, opt_s + fc_opt)
}

struct Projection {
    step: f64,
    /// Per layer: whether its all-reduce ends after backward does.
    exposed: Vec<bool>,
    comm_exposed: f64,
}

/// The step on `p` nodes by [`brgemm_dl::scaling`]: each layer's gradient
/// ready after its backward-weights pass, sent as a bucket of its own.
fn project(layers: &[LayerCost], opt_s: f64, p: usize, link: &Link) -> Projection {
    let mut t: f64 = layers.iter().map(|l| l.fwd).sum();
    let mut ready = Vec::with_capacity(layers.len());
    for l in layers.iter().rev() {
        t += l.upd;
        ready.push((t, l.grad_bytes));
        t += l.bwd;
    }
    let tl = Timeline {
        ready,
        backward_end: t,
        tail: opt_s,
    };
    let pr = tl.predict(&vec![1; layers.len()], p, link);
    Projection {
        step: pr.step_s,
        // `ready` runs from the last layer down.
        exposed: pr.bucket_exposed.into_iter().rev().collect(),
        comm_exposed: pr.exposed_s,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let link = Link::new(
        arg(&args, "--bandwidth-gbps", 100.0),
        arg(&args, "--latency-us", 5.0),
    )
    .with_host_cost(arg(&args, "--host-us-per-mb", 0.0));
    let (bw, lat) = (link.bytes_per_s, link.latency_s);
    let batch = arg(&args, "--batch", 64.0) as usize;
    let max_nodes = arg(&args, "--max-nodes", 256.0) as usize;
    let threads = arg(&args, "--threads", Pool::global().threads() as f64) as usize;
    let pool = Pool::new(threads.max(1)).expect("pool");
    let which = args
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "both".into());
    if which == "mlp" || which == "both" {
        let dims = [1024usize, 1024, 1024, 1024, 10];
        println!(
            "model mlp {dims:?}, batch {batch} per node, {threads} thread(s) per node; ring all-reduce at {:.1} GB/s, {:.1} us latency",
            bw / 1e9,
            lat * 1e6
        );
        let (layers, opt_s) = measure(&pool, batch, &dims, false);
        report(&layers, opt_s, batch, max_nodes, &link);
    }
    if which == "cnn" || which == "both" {
        println!(
            "\nmodel cnn (conv3x3 1->32, pool, conv3x3 32->64, pool, fc 3136->128, fc 128->10), batch {batch} per node, {threads} thread(s) per node; ring all-reduce at {:.1} GB/s, {:.1} us latency",
            bw / 1e9,
            lat * 1e6
        );
        let (layers, opt_s) = measure_cnn(&pool, batch);
        report(&layers, opt_s, batch, max_nodes, &link);
    }
}

fn report(layers: &[LayerCost], opt_s: f64, batch: usize, max_nodes: usize, link: &Link) {
    println!("\nmeasured per step on this machine (ms):");
    println!("  layer              fwd     bwd-data  bwd-weights  gradient MB");
    for l in layers {
        println!(
            "  {:16} {:7.3}  {:8.3}  {:11.3}  {:10.2}",
            l.name,
            l.fwd * 1e3,
            l.bwd * 1e3,
            l.upd * 1e3,
            l.grad_bytes / 1e6
        );
    }
    println!("  optimizer        {:7.3}", opt_s * 1e3);
    let base = project(layers, opt_s, 1, link);
    println!("\nnodes  step ms  samples/s    efficiency  exposed comm ms  layers whose all-reduce is not hidden");
    let mut first_unhidden: Vec<Option<usize>> = vec![None; layers.len()];
    let mut p = 1;
    while p <= max_nodes {
        let pr = project(layers, opt_s, p, link);
        let names: Vec<&str> = layers
            .iter()
            .zip(&pr.exposed)
            .filter(|(_, &e)| e)
            .map(|(l, _)| l.name.as_str())
            .collect();
        for (i, &e) in pr.exposed.iter().enumerate() {
            if e && first_unhidden[i].is_none() {
                first_unhidden[i] = Some(p);
            }
        }
        println!(
            "{p:5}  {:7.3}  {:10.0}  {:9.1}%  {:15.3}  {}",
            pr.step * 1e3,
            (p * batch) as f64 / pr.step,
            100.0 * base.step / pr.step,
            pr.comm_exposed * 1e3,
            if names.is_empty() {
                "-".to_string()
            } else {
                names.join(", ")
            }
        );
        p *= 2;
    }
    // Layer 0's all-reduce starts when backward is over: never hidden.
    let first = (1..layers.len())
        .filter_map(|i| first_unhidden[i].map(|p| (p, i)))
        .min();
    match first {
        Some((p, i)) => println!(
            "\nfirst all-reduce to stop hiding (besides {}, which never can): {} at {p} nodes",
            layers[0].name, layers[i].name
        ),
        None => println!(
            "\nevery all-reduce but {}'s (which never can) stays hidden up to {max_nodes} nodes",
            layers[0].name
        ),
    }
}
