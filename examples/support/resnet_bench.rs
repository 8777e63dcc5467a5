//! `bench resnet50`: the ResNet-50 training step and inference through
//! the layer graph, per layer with `--layers`, bf16 against f32 with
//! `--dtype bf16`, fused against unfused graphs with `--fusion`.

use super::Opts;
use crate::fill::fill;
use crate::workload::{measure_pool, Probes};
use brgemm::Isa;
use brgemm_primitives::Pool;
use std::time::{Duration, Instant};

/// ResNet-50 v1.5 on the layer graph, synthetic 224x224x3 input, batch 16
/// (`--batch B`), 1 and 2 threads: a training step (forward, softmax
/// cross-entropy, backward, SGD with momentum) and inference. FLOPs count
/// the convolutions' and the FC's multiply-adds x 2 for forward,
/// backward-data and backward-weights, less the first convolution's
/// backward-data (not needed). `--layers` adds a per-node time table,
/// `--fusion` the step with and without the graph's fusions; `--unfused`
/// measures the graph built without them; `--dtype bf16` adds the mixed
/// precision step (`Graph::set_bf16`), timed between two f32 steps, with
/// how many layers run bf16, how many outputs and input gradients are
/// handed to them in bf16 (`Graph::bf16_handoffs`) and how many outputs
/// exist in bf16 alone (`Graph::bf16_only_outputs`).
pub(crate) fn bench_resnet50(o: &Opts, args: &[String]) {
    use brgemm_dl::nn::{models, Mode, Tensor};
    use brgemm_primitives::optim::Optimizer;
    let batch: usize = args
        .iter()
        .skip_while(|a| *a != "--batch")
        .nth(1)
        .and_then(|b| b.parse().ok())
        .unwrap_or(16);
    let isa = Isa::selected().expect("ISA");
    let probe = Probes::new(isa, Duration::from_millis(10));
    let samples = if o.quick { 2 } else { 3 };
    let (b, out) = models::resnet50_layers(batch, 224, 1000, 1).expect("resnet50");
    let fuse = !args.iter().any(|a| a == "--unfused");
    let mut g = b.fuse(fuse).build(out).expect("build");
    let layers = g.layer_flops();
    let fwd: f64 = layers.iter().map(|(_, f)| f).sum();
    let train_flops = 3.0 * fwd - layers[0].1;
    let per_layer = args.iter().any(|a| a == "--layers");
    let bf16 = args.windows(2).any(|w| w[0] == "--dtype" && w[1] == "bf16");
    let mut x = Tensor::zeros(g.input_shape());
    fill(x.data_mut(), 7, 1.0);
    let labels: Vec<usize> = (0..batch).map(|i| (i * 37) % 1000).collect();
    let opt = Optimizer::Sgd {
        lr: 1e-3,
        momentum: 0.9,
    };
    for threads in [1usize, 2] {
        let pool = Pool::new(threads).expect("pool");
        let train = measure_pool(
            || {
                g.train_step(&pool, &x, &labels, &opt).expect("train step");
            },
            &pool,
            &probe,
            samples,
        );
        let infer = measure_pool(
            || {
                g.forward(&pool, &x, Mode::Eval).expect("inference");
            },
            &pool,
            &probe,
            samples,
        );
        let (tg, ig) = (train_flops / train.secs / 1e9, fwd / infer.secs / 1e9);
        println!(
            r#"{{"bench":"resnet50","batch":{batch},"threads":{threads},"train_images_per_s":{:.2},"infer_images_per_s":{:.2},"train_gflops":{tg:.1},"infer_gflops":{ig:.1},"infer_pct_peak":{:.1},{}}}"#,
            batch as f64 / train.secs,
            batch as f64 / infer.secs,
            infer.pct_peak(ig),
            train.json(tg)
        );
        if per_layer {
            resnet50_layers(&mut g, &pool, &x, &labels, &opt, threads);
        }
        if bf16 {
            // f32, bf16, f32 again: the bf16 step against the mean of the
            // two f32 steps around it, in this process.
            let step = |g: &mut brgemm_dl::nn::Graph| {
                measure_pool(
                    || {
                        g.train_step(&pool, &x, &labels, &opt).expect("train step");
                    },
                    &pool,
                    &probe,
                    samples,
                )
                .secs
            };
            let f0 = step(&mut g);
            let layers = g.set_bf16(true).expect("bf16");
            let (handoffs, alone) = (g.bf16_handoffs(), g.bf16_only_outputs());
            let b = step(&mut g);
            let bi = measure_pool(
                || {
                    g.forward(&pool, &x, Mode::Eval).expect("inference");
                },
                &pool,
                &probe,
                samples,
            )
            .secs;
            if per_layer {
                resnet50_layers(&mut g, &pool, &x, &labels, &opt, threads);
            }
            g.set_bf16(false).expect("f32");
            let f1 = step(&mut g);
            let f = (f0 + f1) / 2.0;
            println!(
                r#"{{"bench":"resnet50","dtype":"bf16","batch":{batch},"threads":{threads},"bf16_layers":{layers},"bf16_handoffs":{handoffs},"bf16_only_outputs":{alone},"train_images_per_s":{:.2},"infer_images_per_s":{:.2},"train_gflops":{:.1},"f32_train_images_per_s":{:.2},"train_vs_f32":{:.2}}}"#,
                batch as f64 / b,
                batch as f64 / bi,
                train_flops / b / 1e9,
                batch as f64 / f,
                f / b
            );
        }
    }
    if args.iter().any(|a| a == "--fusion") {
        drop(g);
        resnet50_fusion(batch, &x, &labels, &opt, samples);
    }
}

/// The training step and inference with and without the graph's fusions
/// (batch norm + ReLU in one pass; batch norm folded into the convolution
/// in inference), alternating fused and unfused graphs in this process
/// (one graph alive at a time), medians of `2 * samples` steps each.
fn resnet50_fusion(
    batch: usize,
    x: &brgemm_dl::nn::Tensor,
    labels: &[usize],
    opt: &brgemm_primitives::optim::Optimizer,
    samples: usize,
) {
    use brgemm_dl::nn::{models, Mode};
    for threads in [1usize, 2] {
        let pool = Pool::new(threads).expect("pool");
        // [fused, unfused] x [train, infer]
        let mut secs = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
        for _round in 0..2 {
            for (k, fuse) in [true, false].into_iter().enumerate() {
                let (b, out) = models::resnet50_layers(batch, 224, 1000, 1).expect("resnet50");
                let mut g = b.fuse(fuse).build(out).expect("build");
                g.train_step(&pool, x, labels, opt).expect("warm-up step");
                for _ in 0..samples {
                    let t = Instant::now();
                    g.train_step(&pool, x, labels, opt).expect("train step");
                    secs[k][0].push(t.elapsed().as_secs_f64());
                }
                g.forward(&pool, x, Mode::Eval).expect("warm-up inference");
                for _ in 0..samples {
                    let t = Instant::now();
                    g.forward(&pool, x, Mode::Eval).expect("inference");
                    secs[k][1].push(t.elapsed().as_secs_f64());
                }
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let [[ft, fi], [ut, ui]] = secs.map(|mut s| [med(&mut s[0]), med(&mut s[1])]);
        let rate = |s: f64| batch as f64 / s;
        println!(
            r#"{{"bench":"resnet50_fusion","batch":{batch},"threads":{threads},"fused_train_images_per_s":{:.2},"unfused_train_images_per_s":{:.2},"train_speedup":{:.3},"fused_infer_images_per_s":{:.2},"unfused_infer_images_per_s":{:.2},"infer_speedup":{:.3}}}"#,
            rate(ft),
            rate(ut),
            ut / ft,
            rate(fi),
            rate(ui),
            ui / fi
        );
    }
}

/// One JSON line per node of two training steps and two inferences:
/// forward, backward and inference milliseconds per step, and the layer's
/// GFLOP/s where it has FLOPs. Each mode runs once untimed first: the
/// first inference after a step folds the batch norms into the
/// convolutions again, and the first run of a mode after the other meets
/// fresh allocations (Zen 4, bf16 graph, before the folds kept their
/// buffers: 0.6 s of the first inference, and the res5 stride-2
/// convolution's forward 46 ms against 13 in the first step), which the
/// table would count as the layers' own time.
fn resnet50_layers(
    g: &mut brgemm_dl::nn::Graph,
    pool: &Pool,
    x: &brgemm_dl::nn::Tensor,
    labels: &[usize],
    opt: &brgemm_primitives::optim::Optimizer,
    threads: usize,
) {
    use brgemm_dl::nn::Mode;
    const STEPS: usize = 2;
    g.forward(pool, x, Mode::Eval).expect("inference");
    g.reset_times();
    for _ in 0..STEPS {
        g.forward(pool, x, Mode::Eval).expect("inference");
    }
    let infer: Vec<f64> = g.times().iter().map(|t| t.forward_s).collect();
    g.train_step(pool, x, labels, opt).expect("train step");
    g.reset_times();
    for _ in 0..STEPS {
        g.train_step(pool, x, labels, opt).expect("train step");
    }
    for (i, t) in g.times().iter().enumerate() {
        let (f, b) = (t.forward_s / STEPS as f64, t.backward_s / STEPS as f64);
        let inf = infer[i] / STEPS as f64;
        // Backward is data and weights: twice the forward's FLOPs.
        let rate = |flops: f64, s: f64| if s > 0.0 { flops / s / 1e9 } else { 0.0 };
        println!(
            r#"{{"bench":"resnet50_layer","threads":{threads},"node":{i},"layer":"{}","fwd_gflop":{:.3},"fwd_ms":{:.2},"bwd_ms":{:.2},"infer_ms":{:.2},"fwd_gflops":{:.1},"bwd_gflops":{:.1},"infer_gflops":{:.1}}}"#,
            t.name,
            t.flops / 1e9,
            f * 1e3,
            b * 1e3,
            inf * 1e3,
            rate(t.flops, f),
            rate(2.0 * t.flops, b),
            rate(t.flops, inf)
        );
    }
}
