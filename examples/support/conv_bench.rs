//! `bench conv`: the convolution passes on the ResNet-50 layers, f32 and
//! (where this CPU has a bf16 kernel) bf16 against f32 on each shape.

use super::{scaling, speedup_field, Opts};
use crate::fill::fill;
use crate::workload::{measure_pool, Measured, Probes};
use brgemm::Isa;
use brgemm_primitives::Pool;
use std::time::Duration;

/// (name, C, K, H, W, R, S, stride) of a convolution layer.
type ConvLayer = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

/// The ResNet-50 layers of the convolution benchmark.
const RESNET_LAYERS: [ConvLayer; 9] = [
    ("res2_3x3", 64, 64, 56, 56, 3, 3, 1),
    ("res2_1x1_up", 64, 256, 56, 56, 1, 1, 1),
    ("res2_1x1_down", 256, 64, 56, 56, 1, 1, 1),
    ("res3_3x3", 128, 128, 28, 28, 3, 3, 1),
    ("res4_3x3", 256, 256, 14, 14, 3, 3, 1),
    ("res5_3x3", 512, 512, 7, 7, 3, 3, 1),
    ("res3_3x3_s2", 128, 128, 56, 56, 3, 3, 2),
    ("res3_1x1_proj", 256, 512, 56, 56, 1, 1, 2),
    ("conv1_7x7", 3, 64, 224, 224, 7, 7, 2),
];

/// Convolution passes on the ResNet-50 layers at minibatches 8 and 16.
/// `fwd` includes the zero-padded input copy; the bf16 `upd` the per-call
/// relayout of X it reads (the f32 one reads X in place).
pub(crate) fn bench_conv(o: &Opts) {
    use brgemm_primitives::{Activation, Conv, ConvParams};
    let isa = Isa::selected().expect("ISA");
    let probe = Probes::new(isa, Duration::from_millis(10));
    let samples = if o.quick { 3 } else { 7 };
    let only: Option<String> = std::env::args().skip_while(|a| a != "--layer").nth(1);
    for (n, (name, c, k, h, w, r, s, stride)) in [8usize, 16]
        .into_iter()
        .flat_map(|n| RESNET_LAYERS.map(|l| (n, l)))
    {
        if only.as_deref().is_some_and(|l| l != name) {
            continue;
        }
        let p = ConvParams::new(n, c, k, h, w, r, s)
            .stride(stride)
            .pad(r / 2);
        let conv = Conv::new(p, Activation::Relu).expect("plan");
        let mut x = conv.x_tensor();
        let mut wf = conv.filter();
        fill(x.data_mut(), 7, 8.0);
        fill(wf.data_mut(), 5, 64.0);
        let bias = vec![0.1f32; conv.padded_k()];
        let (mut y, mut dz, mut dx, mut wt, mut dw) = (
            conv.y_tensor(),
            conv.y_tensor(),
            conv.x_tensor(),
            conv.filter_t(),
            conv.filter(),
        );
        fill(dz.data_mut(), 3, 4.0);
        conv.transpose_filter(&Pool::new(1).unwrap(), &wf, &mut wt)
            .unwrap();
        let mut db = vec![0.0f32; conv.padded_k()];
        let t = conv.tuning().clone();
        for threads in [1usize, 2] {
            let pool = Pool::new(threads).expect("pool");
            let flops = conv.flops();
            let line = |pass: &str, spec: &str, m: &Measured, sp: Option<f64>| {
                let gf = flops / m.secs / 1e9;
                println!(
                    r#"{{"bench":"conv","pass":"{pass}","layer":"{name}","n":{n},"c":{c},"k":{k},"h":{h},"w":{w},"r":{r},"s":{s},"stride":{stride},"bc":{},"bk":{},"bq":{},"spec":"{spec}","isa":"{isa}","threads":{threads},"gflops":{gf:.1},{}{}}}"#,
                    t.bc,
                    t.bk,
                    t.bq,
                    m.json(gf),
                    speedup_field(sp)
                );
            };
            let m = measure_pool(
                || conv.forward(&pool, &x, &wf, &bias, &mut y).unwrap(),
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                conv.forward(p, &x, &wf, &bias, &mut y).unwrap()
            });
            line("fwd", &t.fwd.spec, &m, sp);
            let m = measure_pool(
                || conv.backward_data(&pool, &dz, &wt, &mut dx).unwrap(),
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                conv.backward_data(p, &dz, &wt, &mut dx).unwrap()
            });
            line("bwd", &t.bwd.spec, &m, sp);
            let m = measure_pool(
                || {
                    conv.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                        .unwrap()
                },
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                conv.backward_weights(p, &dz, &x, &mut dw, &mut db).unwrap()
            });
            line("upd", &t.upd.spec, &m, sp);
            bench_conv_bf16(
                &conv,
                &pool,
                &probe,
                samples,
                &x,
                &wf,
                &dz,
                &|pass, gf, extra| {
                    println!(
                        r#"{{"bench":"conv","pass":"{pass}","dtype":"bf16","layer":"{name}","n":{n},"c":{c},"k":{k},"h":{h},"w":{w},"r":{r},"s":{s},"stride":{stride},"bc":{},"bk":{},"bq":{},"threads":{threads},"gflops":{gf:.1},{extra}}}"#,
                        t.bc, t.bk, t.bq
                    )
                },
            );
        }
    }
}

/// The bf16 passes of `conv` (where it can run them), each timed between two
/// timings of its f32 pass in this process: `vs_f32` is the ratio of the
/// medians. Every bf16 pass rounds its f32 operands itself;
/// `gflops_with_packing` also counts packing the filter (forward; a
/// training step does it once). `pct_fp32_peak` sets the bf16 GFLOP/s
/// against the fp32 FMA peak probed between the bf16 samples (AMX lines
/// pass 100%). `layer_runs_bf16`: whether a network in mixed precision
/// runs the layer in bf16 on this CPU (`ConvBf16::pays`), else f32.
#[allow(clippy::too_many_arguments)]
fn bench_conv_bf16(
    conv: &brgemm_primitives::Conv,
    pool: &Pool,
    probe: &Probes,
    samples: usize,
    x: &brgemm_primitives::Tensor4,
    wf: &brgemm_primitives::Filter,
    dz: &brgemm_primitives::Tensor4,
    line: &dyn Fn(&str, f64, String),
) {
    use brgemm::bf16::bf16;
    use brgemm_primitives::conv::ConvBf16;
    let Ok(cb) = ConvBf16::new(conv) else {
        return;
    };
    let buf = || brgemm::AlignedVec::<bf16>::new(brgemm::buffer::ALIGN);
    let (mut wv, mut wtv) = (buf(), buf());
    cb.pack_filter(pool, wf, &mut wv, &mut wtv).unwrap();
    let bias = vec![0.1f32; conv.padded_k()];
    let (mut y, mut dx, mut wt) = (conv.y_tensor(), conv.x_tensor(), conv.filter_t());
    conv.transpose_filter(pool, wf, &mut wt).unwrap();
    let flops = conv.flops();
    // The kernel each pass runs on: backward-weights may be the f32 pass
    // where the CPU policy found bf16 not paying (`ConvBf16::upd_isa`).
    let upd_isa = cb.upd_isa().map_or("fp32 pass", |i| i.name());
    // Whether a mixed-precision network runs this layer in bf16 at all
    // (`ConvBf16::pays`); the passes are timed either way.
    let layer_bf16 = cb.pays();
    let fwd_isa = cb.isa().name();
    // The fp32 FMA peak of the bf16 sample, measured between its samples.
    let peak = std::cell::Cell::new(0.0);
    let time = |f: &mut dyn FnMut()| measure_pool(f, pool, probe, samples).secs;
    let time_bf16 = |f: &mut dyn FnMut()| {
        let m = measure_pool(f, pool, probe, samples);
        peak.set(m.peak_gflops);
        m.secs
    };
    // Seconds of f32, bf16 (the pass rounds its f32 input itself), bf16
    // with the filter packed too (once per training step), f32 again: the
    // f32 figure is the mean of the two around the bf16 ones.
    let report = |pass: &str, [f0, b, bc, f1]: [f64; 4]| {
        let f = (f0 + f1) / 2.0;
        let isa = if pass == "upd" { upd_isa } else { fwd_isa };
        line(
            pass,
            flops / b / 1e9,
            format!(
                r#""isa":"{isa}","gflops_with_packing":{:.1},"f32_gflops":{:.1},"vs_f32":{:.2},"vs_f32_with_packing":{:.2},"fp32_peak_gflops":{:.1},"pct_fp32_peak":{:.1},"layer_runs_bf16":{layer_bf16}"#,
                flops / bc / 1e9,
                flops / f / 1e9,
                f / b,
                f / bc,
                peak.get(),
                100.0 * flops / b / 1e9 / peak.get()
            ),
        )
    };
    let f0 = time(&mut || conv.forward(pool, x, wf, &bias, &mut y).unwrap());
    let b = time_bf16(&mut || cb.forward(pool, conv, x, &wv, &bias, &mut y).unwrap());
    let bc = time(&mut || {
        cb.pack_filter(pool, wf, &mut wv, &mut wtv).unwrap();
        cb.forward(pool, conv, x, &wv, &bias, &mut y).unwrap()
    });
    let f1 = time(&mut || conv.forward(pool, x, wf, &bias, &mut y).unwrap());
    report("fwd", [f0, b, bc, f1]);
    let (mut dw, mut db) = (conv.filter(), vec![0.0f32; conv.padded_k()]);
    let f0 = time(&mut || {
        conv.backward_weights(pool, dz, x, &mut dw, &mut db)
            .unwrap()
    });
    let b = time_bf16(&mut || {
        cb.backward_weights(pool, conv, dz, x, &mut dw, &mut db)
            .unwrap()
    });
    let f1 = time(&mut || {
        conv.backward_weights(pool, dz, x, &mut dw, &mut db)
            .unwrap()
    });
    report("upd", [f0, b, b, f1]);
    // Backward-data reads the filter packed with forward's: one figure.
    let f0 = time(&mut || conv.backward_data(pool, dz, &wt, &mut dx).unwrap());
    let b = time_bf16(&mut || cb.backward_data(pool, conv, dz, &wtv, &mut dx).unwrap());
    let f1 = time(&mut || conv.backward_data(pool, dz, &wt, &mut dx).unwrap());
    report("bwd", [f0, b, b, f1]);
}
