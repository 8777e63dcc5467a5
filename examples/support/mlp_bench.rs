//! `bench mlp`: a bf16 MLP's fused training step against the f32 one, on
//! the layer graph as a network runs it (the CPU policy decides which
//! linear layers run bf16; `BRGEMM_BF16_ISA` forces them all).

use super::{alternate, Opts};
use crate::workload::Probes;
use brgemm::bf16::Bf16Isa;
use brgemm::Isa;
use brgemm_dl::nn::models::{mlp, LayerSpec};
use brgemm_dl::nn::{Graph, Linear, Shape, Tensor};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Activation, Pool};
use std::time::Duration;

/// An MLP `w -> w -> w -> 16` (ReLU, Adam, fused steps:
/// `Graph::set_fused_update`) at minibatches of 32-64 rows, 1 and 2
/// threads: the graph with `set_bf16(true)` against the f32 graph, and a
/// second f32 graph against the first as a control for the setup's bias,
/// each pair alternated step by step in this process. `bf16_layers`: how
/// many of the three linear layers the policy runs bf16 at these rows
/// (`Policy::avx512bf16_fc_min_rows_fused`); where none, the "bf16" graph
/// is the f32 one and `vs_f32` reads the control's spread.
pub(crate) fn bench_mlp(o: &Opts) {
    let isa = Isa::selected().expect("ISA");
    let probe = Probes::new(isa, Duration::from_millis(10));
    let (rows, widths, samples): (&[usize], &[usize], usize) = if o.quick {
        (&[32, 48, 64], &[1024, 4096], 7)
    } else {
        (&[32, 40, 48, 64], &[1024, 2048, 4096], 15)
    };
    let opt = Optimizer::adam(1e-5);
    for &w in widths {
        for &n in rows {
            let specs = [
                LayerSpec {
                    out: w,
                    act: Activation::Relu,
                },
                LayerSpec {
                    out: w,
                    act: Activation::Relu,
                },
                LayerSpec {
                    out: 16,
                    act: Activation::Identity,
                },
            ];
            let net = |bf16: bool| {
                let mut g = mlp(w, n, &specs, 3).expect("mlp");
                g.set_bf16(bf16).expect("bf16");
                g.set_fused_update(true).expect("fused");
                g
            };
            let mut x = Tensor::zeros(Shape::flat(n, w));
            for (i, v) in x.data_mut().iter_mut().enumerate() {
                *v = ((i * 7) % 13) as f32 * 0.05 - 0.3;
            }
            let labels: Vec<usize> = (0..n).map(|i| i % 16).collect();
            let (mut f32_net, mut bf16_net, mut control) = (net(false), net(true), net(false));
            let layers = bf16_net
                .layers_of::<Linear>()
                .iter()
                .filter(|l| l.bf16_isa().is_some())
                .count();
            let kernel = bf16_net.layers_of::<Linear>()[0]
                .bf16_isa()
                .map_or("fp32 pass", |i| i.name());
            // Forward, backward-data and backward-weights, less the first
            // layer's backward-data (not needed).
            let layer_flops = f32_net.layer_flops();
            let flops = 3.0 * layer_flops.iter().map(|(_, f)| f).sum::<f64>() - layer_flops[0].1;
            for threads in [1usize, 2] {
                let pool = Pool::new(threads).expect("pool");
                let step = |g: &mut Graph| {
                    g.train_step(&pool, &x, &labels, &opt).expect("train step");
                };
                let (f, b, r) = alternate(samples, &mut || step(&mut f32_net), &mut || {
                    step(&mut bf16_net)
                });
                let (_, _, rc) = alternate(samples, &mut || step(&mut f32_net), &mut || {
                    step(&mut control)
                });
                let peak = probe.sample_pool(&pool).0;
                let gf = flops / b / 1e9;
                println!(
                    r#"{{"bench":"mlp","dtype":"bf16","fused":true,"rows":{n},"width":{w},"threads":{threads},"bf16_layers":{layers},"isa":"{kernel}","forced":{},"ms":{:.3},"f32_ms":{:.3},"gflops":{gf:.1},"f32_gflops":{:.1},"vs_f32":{r:.3},"control_vs_f32":{rc:.3},"fp32_peak_gflops":{peak:.1},"pct_fp32_peak":{:.1}}}"#,
                    Bf16Isa::is_forced(),
                    b * 1e3,
                    f * 1e3,
                    flops / f / 1e9,
                    100.0 * gf / peak
                );
            }
        }
    }
}
