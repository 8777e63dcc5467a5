//! Bench runner: one JSON object per line, for machines.
//!
//! ```text
//! cargo run --release --example bench -- brgemm [--quick]
//! cargo run --release --example bench -- fc [--quick]
//! cargo run --release --example bench -- conv [--quick] [--layer NAME]
//! cargo run --release --example bench -- lstm [--quick]
//! cargo run --release --example bench -- loops
//! cargo run --release --example bench -- resnet50 [--quick] [--batch B] [--dtype bf16] [--layers] [--fusion] [--unfused]
//! cargo run --release --features cuda --example bench -- gpu [--device cuda|opencl] [--quick]
//! cargo build --release --features mpi --example bench
//! mpirun -np R target/release/examples/bench mpi [--progress loop|thread|layers] [--bucket-kb N]
//! target/release/examples/bench mpi --cluster [--gbps 1,10,25]   # root: the emulated cluster
//! ```
//!
//! Every line carries GFLOP/s and `pct_peak`, the share of the FMA peak of
//! the same ISA measured by this process just before (`{"bench":"peak",..}`
//! lines), since this machine's speed varies between processes. Figures are
//! medians over repeated samples.
//!
//! The f32 lines also carry `tile_l1_gflops` and `pct_tile_l1`: the ISA's main
//! register tile on L1-resident operands ([`brgemm::peak::TileCeiling`]),
//! sampled between the same samples. On a shared core the register-only peak
//! barely moves while everything that loads operands slows down with the
//! neighbours; the second ratio says how much of a shortfall is the
//! primitive's and how much the machine's at that moment.
//!
//! The 2-thread lines of `fc`, `conv` and `lstm` carry `speedup_vs_1t`: the
//! same pass run on one thread and on two in turn, the median of the
//! per-pair time ratios, each timed call after an untimed one on the same
//! pool (as one pass of a loop on that pool runs). The 1- and 2-thread
//! lines themselves are taken seconds to minutes apart, so their GFLOP/s
//! ratio mixes scaling with the machine's drift. Every 2-thread sample and pair waits (up to ~2 s) until
//! the FMA probe on both threads at once reads at least 75% of twice one
//! core: the 2-vCPU VMs here at times lose a vCPU to the host for seconds,
//! and a sample taken then measures the host's scheduling.

#[path = "support/workload.rs"]
mod workload;

#[cfg(feature = "gpu")]
#[path = "support/gpu_bench.rs"]
mod gpu_bench;

#[path = "support/fill.rs"]
mod fill;

#[cfg(feature = "mpi")]
#[path = "support/mpi_bench.rs"]
mod mpi_bench;
use brgemm::{peak, BatchForm, Isa, Kernel, KernelOptions, RegisterTile};
use brgemm_primitives::Pool;
use fill::{fill, LstmData};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use workload::{measure, measure_pool, BrgemmWorkload, Measured, Probes};

const BRGEMM_SHAPES: [(usize, usize, usize, usize); 5] = [
    (64, 64, 64, 16),
    (32, 32, 32, 32),
    (16, 16, 16, 64),
    (64, 32, 128, 8),
    (128, 28, 64, 16),
];

struct Opts {
    quick: bool,
    tile: Option<RegisterTile>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The benches to run: the words that are neither options nor the value
    // of an option that takes one.
    const VALUED: [&str; 11] = [
        "--layer",
        "--batch",
        "--dtype",
        "--device",
        "--progress",
        "--bucket-kb",
        "--models",
        "--link-gbps",
        "--gbps",
        "--nodes",
        "--mtu",
    ];
    let what: Vec<&str> = args
        .iter()
        .enumerate()
        .filter(|(i, s)| {
            !s.starts_with("--") && (*i == 0 || !VALUED.contains(&args[i - 1].as_str()))
        })
        .map(|(_, s)| s.as_str())
        .collect();
    let opts = Opts {
        quick: args.iter().any(|a| a == "--quick"),
        tile: std::env::var("BENCH_TILE").ok().and_then(|s| {
            let (a, b) = s.split_once('x')?;
            Some(RegisterTile {
                mv: a.parse().ok()?,
                nr: b.parse().ok()?,
            })
        }),
    };
    let what = if what.is_empty() {
        vec!["brgemm"]
    } else {
        what
    };
    if what
        .iter()
        .any(|w| ["brgemm", "fc", "conv", "lstm", "resnet50"].contains(w))
    {
        machine_line();
    }
    for w in what {
        match w {
            "brgemm" => {
                bench_brgemm(&opts);
                bench_brgemm_bf16(&opts);
            }
            "fc" => bench_fc(&opts),
            "conv" => bench_conv(&opts),
            "lstm" => bench_lstm(&opts),
            "loops" => bench_loops(),
            "resnet50" => bench_resnet50(&opts, &args),
            "mpi" => bench_mpi(&args),
            #[cfg(feature = "gpu")]
            "gpu" => gpu_bench::bench_gpu(&args, opts.quick),
            #[cfg(not(feature = "gpu"))]
            "gpu" => {
                eprintln!("bench gpu needs --features cuda (or opencl)");
                std::process::exit(2);
            }
            other => {
                eprintln!(
                    "unknown bench {other:?}; known: brgemm, fc, conv, lstm, loops, resnet50, mpi, gpu"
                );
                std::process::exit(2);
            }
        }
    }
}

/// One line naming the machine the figures come from: the CPU (Linux's
/// `/proc/cpuinfo`), the CPU policy row, the f32 ISA and the bf16 kernel
/// plans take, and whether layers run bf16 on it (the machines differ
/// from session to session).
fn machine_line() {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map_or("unknown".to_string(), |(_, v)| v.trim().replace('"', "'"))
    };
    let policy = brgemm::policy().map_or("invalid", |p| p.name);
    let isa = Isa::selected().map_or("none".to_string(), |i| format!("{i:?}").to_lowercase());
    let bf16 = brgemm::bf16::Bf16Isa::ALL
        .into_iter()
        .find(|i| i.is_supported())
        .expect("the reference kernel runs everywhere");
    println!(
        r#"{{"bench":"machine","cpu":"{}","cpu_family":"{}","cpu_model":"{}","policy":"{policy}","isa":"{isa}","bf16_kernel":"{}","bf16_beats_f32":{},"threads":{}}}"#,
        field("model name"),
        field("cpu family"),
        field("model"),
        bf16.name(),
        bf16.beats_f32(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
}

/// Prints one `peak` line per ISA and returns the probes per ISA, whose
/// slices are interleaved with every later measurement.
fn probes(isas: &[Isa], slice: Duration) -> HashMap<Isa, Probes> {
    let mut out = HashMap::new();
    for &isa in isas {
        let p = peak::fma_peak_gflops(isa).expect("supported ISA");
        println!(r#"{{"bench":"peak","isa":"{isa}","dtype":"f32","threads":1,"gflops":{p:.1}}}"#);
        out.insert(isa, Probes::new(isa, slice));
    }
    out
}

fn bench_brgemm(o: &Opts) {
    let isas: Vec<Isa> = [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable]
        .into_iter()
        .filter(|i| i.is_supported())
        .collect();
    let (min_sample, samples) = if o.quick {
        (Duration::from_millis(10), 5)
    } else {
        (Duration::from_millis(30), 15)
    };
    let probe = probes(&isas, min_sample / 2);
    for (m, n, k, batch) in BRGEMM_SHAPES {
        let mut w = BrgemmWorkload::new(m, n, k, batch, 1 << 20);
        let forms: [(&str, BatchForm); 3] = [
            ("stride", BatchForm::Packed),
            ("offset", BatchForm::Offset),
            ("address", BatchForm::Address),
        ];
        for &isa in &isas {
            for (fname, form) in forms {
                // Every form on the strongest ISA; stride alone on the others.
                if isa != isas[0] && fname != "stride" {
                    continue;
                }
                let kern = Kernel::with_options(
                    &w.descriptor(form),
                    KernelOptions {
                        isa: Some(isa),
                        tile: o.tile,
                        bf16: None,
                    },
                )
                .expect("valid descriptor");
                let r = measure(|| w.pass(&kern), &probe[&isa], min_sample, samples);
                let gf = w.flops_per_pass() / r.secs / 1e9;
                let t = kern
                    .register_tile()
                    .map(|t| format!("{}x{}", t.mv, t.nr))
                    .unwrap_or_default();
                println!(
                    r#"{{"bench":"brgemm","isa":"{isa}","dtype":"f32","form":"{fname}","m":{m},"n":{n},"k":{k},"batch":{batch},"blocks":{},"tile":"{t}","threads":1,"gflops":{gf:.1},{}}}"#,
                    w.blocks,
                    r.json(gf)
                );
            }
        }
        let r = measure(
            || w.pass_gemm_crate(),
            &probe[&isas[0]],
            min_sample,
            samples,
        );
        let gf = w.flops_per_pass() / r.secs / 1e9;
        println!(
            r#"{{"bench":"gemm_loop","impl":"gemm-crate","dtype":"f32","m":{m},"n":{n},"k":{k},"batch":{batch},"blocks":{},"threads":1,"gflops":{gf:.1},"peak_gflops":{:.1},"pct_peak":{:.1}}}"#,
            w.blocks,
            r.peak_gflops,
            r.pct_peak(gf)
        );
    }
}

fn bench_fc(o: &Opts) {
    use brgemm_primitives::optim::{OptState, Optimizer};
    use brgemm_primitives::PassConfig;
    use brgemm_primitives::{Activation, Fc};
    let isa = Isa::selected().expect("ISA");
    let probe = Probes::new(isa, Duration::from_millis(10));
    let samples = if o.quick { 3 } else { 7 };
    // The last four: the small minibatches where the weight-gradient and
    // transposed-weight passes do little reduction per load of W.
    for (n, c, k) in [
        (256usize, 1024usize, 1024usize),
        (512, 2048, 2048),
        (64, 4096, 4096),
        (16, 1024, 1024),
        (32, 1024, 1024),
        (16, 4096, 4096),
        (32, 4096, 4096),
    ] {
        let fc = Fc::new(n, c, k, Activation::Relu).expect("plan");
        let t = fc.tuning().clone();
        let mut x = fc.x_layout();
        let mut w = fc.w_layout();
        fill(x.data_mut(), 7, 8.0);
        fill(w.data_mut(), 5, 64.0);
        let bias = vec![0.1f32; fc.padded_k()];
        let (mut y, mut dz, mut dx, mut wt, mut dw, mut dzt) = (
            fc.y_layout(),
            fc.y_layout(),
            fc.x_layout(),
            fc.wt_layout(),
            fc.w_layout(),
            fc.dzt_layout(),
        );
        fill(dz.data_mut(), 3, 4.0);
        // Written before any timing: a never-written buffer maps the shared
        // zero page, which reads like an L1-resident block.
        fc.transpose_weights(&Pool::new(1).expect("pool"), &w, &mut wt)
            .expect("transpose");
        fill(dx.data_mut(), 2, 8.0);
        fill(dzt.data_mut(), 2, 8.0);
        fill(y.data_mut(), 2, 8.0);
        fill(dw.data_mut(), 2, 8.0);
        let mut db = vec![0.0f32; fc.padded_k()];
        for threads in [1usize, 2] {
            let pool = Pool::new(threads).expect("pool");
            let flops = fc.flops();
            let line = |pass: &str,
                        cfg: &PassConfig,
                        m: &Measured,
                        s_layout: f64,
                        extra: &str,
                        sp: Option<f64>| {
                let gf = flops / m.secs / 1e9;
                println!(
                    r#"{{"bench":"fc","pass":"{pass}","n":{n},"c":{c},"k":{k},"bn":{},"bc":{},"bk":{},"spec":"{}","chunk":{},"isa":"{isa}","threads":{threads},"gflops":{gf:.1},"gflops_with_layout":{:.1},{extra}{}{}}}"#,
                    t.bn,
                    t.bc,
                    t.bk,
                    cfg.spec,
                    cfg.chunk,
                    flops / s_layout / 1e9,
                    m.json(gf),
                    speedup_field(sp)
                );
            };
            let m = measure_pool(
                || fc.forward(&pool, &x, &w, &bias, &mut y, None).unwrap(),
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                fc.forward(p, &x, &w, &bias, &mut y, None).unwrap()
            });
            line("fwd", &t.fwd, &m, m.secs, "", sp);
            // Backward-data reads W in place; its figure includes turning
            // the dZ blocks round. Beside it, the path through a transposed
            // copy of W: the pass alone (`wt_gflops`) and with the transpose
            // a training step pays (`wt_gflops_with_layout`).
            let m = measure_pool(
                || fc.backward_data(&pool, &dz, &w, &mut dzt, &mut dx).unwrap(),
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                fc.backward_data(p, &dz, &w, &mut dzt, &mut dx).unwrap()
            });
            let s1 = measure_pool(
                || fc.backward_data_wt(&pool, &dz, &wt, &mut dx).unwrap(),
                &pool,
                &probe,
                samples,
            )
            .secs;
            let s2 = measure_pool(
                || {
                    fc.transpose_weights(&pool, &w, &mut wt).unwrap();
                    fc.backward_data_wt(&pool, &dz, &wt, &mut dx).unwrap()
                },
                &pool,
                &probe,
                samples,
            )
            .secs;
            let wt_fields = format!(
                r#""wt_gflops":{:.1},"wt_gflops_with_layout":{:.1},"#,
                flops / s1 / 1e9,
                flops / s2 / 1e9
            );
            line("bwd", &t.bwd, &m, m.secs, &wt_fields, sp);
            // upd reads X in place (row-major B): no layout step to add.
            let m = measure_pool(
                || {
                    fc.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                        .unwrap()
                },
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                fc.backward_weights(p, &dz, &x, &mut dw, &mut db).unwrap()
            });
            line("upd", &t.upd, &m, m.secs, "", sp);
            // The weight update as a training step pays it: backward-weights
            // then the optimizer over W on the pool's threads (as
            // `Graph::train_step` runs it unfused), against the fused pass
            // (`Fc::backward_weights_step`: each dW block stepped from L1 by
            // the thread that computed it).
            // Alternated call by call; medians of the times and of the
            // per-pair ratios.
            for (oname, opt) in [
                (
                    "sgd",
                    Optimizer::Sgd {
                        lr: 1e-4,
                        momentum: 0.9,
                    },
                ),
                ("adam", Optimizer::adam(1e-5)),
            ] {
                let (mut s_sep, mut s_fused) = (OptState::default(), OptState::default());
                let (mut w_sep, mut w_fused) = (w.clone(), w.clone());
                let mut db2 = db.clone();
                let mut sep = || {
                    fc.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                        .unwrap();
                    s_sep.step_on(&pool, &opt, w_sep.data_mut(), dw.data());
                };
                let mut fused = || {
                    fc.backward_weights_step(
                        &pool,
                        &dz,
                        &x,
                        &mut w_fused,
                        &mut db2,
                        &opt,
                        &mut s_fused,
                    )
                    .unwrap()
                };
                let (a, b, r) = alternate(samples, &mut sep, &mut fused);
                println!(
                    r#"{{"bench":"fc","pass":"upd_step","opt":"{oname}","n":{n},"c":{c},"k":{k},"isa":"{isa}","threads":{threads},"fused_ms":{:.3},"unfused_ms":{:.3},"fused_gflops":{:.1},"unfused_gflops":{:.1},"fused_vs_unfused":{r:.2}}}"#,
                    b * 1e3,
                    a * 1e3,
                    flops / b / 1e9,
                    flops / a / 1e9,
                );
            }
            // The layer's whole training step (Adam) as the previous
            // release ran it (forward, W transposed, backward-data from the
            // copy, backward-weights, a separate step) and as it runs now
            // (backward-data reading W in place, the fused step).
            {
                let opt = Optimizer::adam(1e-5);
                let (mut s0, mut s1) = (OptState::default(), OptState::default());
                let (mut w0, mut w1) = (w.clone(), w.clone());
                let mut db2 = db.clone();
                let (mut y1, mut dx1) = (y.clone(), dx.clone());
                let mut before = || {
                    fc.forward(&pool, &x, &w0, &bias, &mut y, None).unwrap();
                    fc.transpose_weights(&pool, &w0, &mut wt).unwrap();
                    fc.backward_data_wt(&pool, &dz, &wt, &mut dx).unwrap();
                    fc.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                        .unwrap();
                    s0.step(&opt, w0.data_mut(), dw.data());
                };
                let mut now = || {
                    fc.forward(&pool, &x, &w1, &bias, &mut y1, None).unwrap();
                    fc.backward_data(&pool, &dz, &w1, &mut dzt, &mut dx1)
                        .unwrap();
                    fc.backward_weights_step(&pool, &dz, &x, &mut w1, &mut db2, &opt, &mut s1)
                        .unwrap();
                };
                let (a, b, r) = alternate(samples, &mut before, &mut now);
                println!(
                    r#"{{"bench":"fc","pass":"step","opt":"adam","n":{n},"c":{c},"k":{k},"isa":"{isa}","threads":{threads},"ms":{:.3},"before_ms":{:.3},"gflops":{:.1},"before_gflops":{:.1},"vs_before":{r:.2}}}"#,
                    b * 1e3,
                    a * 1e3,
                    3.0 * flops / b / 1e9,
                    3.0 * flops / a / 1e9,
                );
            }
            // Mixed precision: the bf16 passes on the same shape, in the same
            // run; `gflops_with_convert` adds rounding the activations (or
            // output gradients) to bf16 and packing the weights, as one
            // training step does (backward-weights rounds its f32 operands
            // itself: the same figure).
            if let Ok(fb) = brgemm_primitives::fc_bf16::FcBf16::new(&fc) {
                use brgemm_primitives::fc_bf16::to_bf16;
                let new = || brgemm::AlignedVec::new(brgemm::buffer::ALIGN);
                let (mut wv, mut wtv, mut xb, mut dzb) = (new(), new(), new(), new());
                fb.pack_weights(&pool, &w, &mut wv, &mut wtv).unwrap();
                to_bf16(&pool, x.data(), &mut xb);
                to_bf16(&pool, dz.data(), &mut dzb);
                let bline = |pass: &str, m: &Measured, s_conv: f64, f32_s: f64| {
                    // Backward-weights may run the f32 pass where bf16
                    // would not pay on this CPU (`FcBf16::upd_isa`).
                    let isa = match pass {
                        "upd" => fb.upd_isa().map_or("fp32 pass", |i| i.name()),
                        _ => fb.isa().name(),
                    };
                    let (s, peak) = (m.secs, m.peak_gflops);
                    let gf = flops / s / 1e9;
                    println!(
                        r#"{{"bench":"fc","pass":"{pass}","dtype":"bf16","n":{n},"c":{c},"k":{k},"bn":{},"bc":{},"bk":{},"isa":"{isa}","threads":{threads},"gflops":{gf:.1},"gflops_with_convert":{:.1},"vs_f32":{:.2},"fp32_peak_gflops":{peak:.1},"pct_fp32_peak":{:.1}}}"#,
                        t.bn,
                        t.bc,
                        t.bk,
                        flops / s_conv / 1e9,
                        f32_s / s,
                        100.0 * gf / peak
                    );
                };
                let f32_fwd = measure_pool(
                    || fc.forward(&pool, &x, &w, &bias, &mut y, None).unwrap(),
                    &pool,
                    &probe,
                    samples,
                )
                .secs;
                let mb = measure_pool(
                    || fb.forward(&pool, &xb, &wv, &bias, &mut y).unwrap(),
                    &pool,
                    &probe,
                    samples,
                );
                let sc = measure_pool(
                    || {
                        fb.pack_weights(&pool, &w, &mut wv, &mut wtv).unwrap();
                        to_bf16(&pool, x.data(), &mut xb);
                        fb.forward(&pool, &xb, &wv, &bias, &mut y).unwrap()
                    },
                    &pool,
                    &probe,
                    samples,
                )
                .secs;
                bline("fwd", &mb, sc, f32_fwd);
                let f32_bwd = measure_pool(
                    || fc.backward_data(&pool, &dz, &w, &mut dzt, &mut dx).unwrap(),
                    &pool,
                    &probe,
                    samples,
                )
                .secs;
                let mb = measure_pool(
                    || fb.backward_data(&pool, &dzb, &wtv, &mut dx).unwrap(),
                    &pool,
                    &probe,
                    samples,
                );
                let sc = measure_pool(
                    || {
                        to_bf16(&pool, dz.data(), &mut dzb);
                        fb.backward_data(&pool, &dzb, &wtv, &mut dx).unwrap()
                    },
                    &pool,
                    &probe,
                    samples,
                )
                .secs;
                bline("bwd", &mb, sc, f32_bwd);
                // Backward-weights rounds its f32 operands itself: one figure.
                let f32_upd = measure_pool(
                    || {
                        fc.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                            .unwrap()
                    },
                    &pool,
                    &probe,
                    samples,
                )
                .secs;
                let mb = measure_pool(
                    || {
                        fb.backward_weights(&pool, &fc, &dz, &x, &mut dw, &mut db)
                            .unwrap()
                    },
                    &pool,
                    &probe,
                    samples,
                );
                bline("upd", &mb, mb.secs, f32_upd);
                // The bf16 layer's whole training step (Adam): as it ran
                // before (weights packed by the forward, a separate step),
                // fused (the step packs the next step's weights from each
                // block it updates), and the f32 layer's fused step.
                let opt = Optimizer::adam(1e-5);
                let mut s = [
                    OptState::default(),
                    OptState::default(),
                    OptState::default(),
                ];
                let [s0, s1, s2] = &mut s;
                // Each variant its own buffers (the closures live together).
                let bufs = || (w.clone(), y.clone(), dx.clone(), db.clone());
                let ((mut w0, mut y0, mut dx0, mut db0), mut dw0) = (bufs(), dw.clone());
                let ((mut w1, mut y1, mut dx1, mut db1), mut dzt2) = (bufs(), dzt.clone());
                let (mut w2, mut y2, mut dx2, mut db2) = bufs();
                let (mut wv1, mut wtv1, mut xb1, mut dzb1) =
                    (wv.clone(), wtv.clone(), xb.clone(), dzb.clone());
                let mut unfused = || {
                    fb.pack_weights(&pool, &w0, &mut wv, &mut wtv).unwrap();
                    to_bf16(&pool, x.data(), &mut xb);
                    fb.forward(&pool, &xb, &wv, &bias, &mut y0).unwrap();
                    to_bf16(&pool, dz.data(), &mut dzb);
                    fb.backward_data(&pool, &dzb, &wtv, &mut dx0).unwrap();
                    fb.backward_weights(&pool, &fc, &dz, &x, &mut dw0, &mut db0)
                        .unwrap();
                    s0.step_on(&pool, &opt, w0.data_mut(), dw0.data());
                };
                let mut fused = || {
                    to_bf16(&pool, x.data(), &mut xb1);
                    fb.forward(&pool, &xb1, &wv1, &bias, &mut y1).unwrap();
                    to_bf16(&pool, dz.data(), &mut dzb1);
                    fb.backward_data(&pool, &dzb1, &wtv1, &mut dx1).unwrap();
                    let packed = (&mut wv1, &mut wtv1);
                    fb.backward_weights_step(
                        &pool, &fc, &dz, &x, &mut w1, &mut db1, &opt, s1, packed,
                    )
                    .unwrap();
                };
                let (a, b, r) = alternate(samples, &mut unfused, &mut fused);
                let mut f32_step = || {
                    fc.forward(&pool, &x, &w2, &bias, &mut y2, None).unwrap();
                    fc.backward_data(&pool, &dz, &w2, &mut dzt2, &mut dx2)
                        .unwrap();
                    fc.backward_weights_step(&pool, &dz, &x, &mut w2, &mut db2, &opt, s2)
                        .unwrap();
                };
                let (f, b2, rf) = alternate(samples, &mut f32_step, &mut fused);
                println!(
                    r#"{{"bench":"fc","pass":"step","dtype":"bf16","opt":"adam","n":{n},"c":{c},"k":{k},"isa":"{}","threads":{threads},"ms":{:.3},"unfused_ms":{:.3},"vs_unfused":{r:.2},"f32_ms":{:.3},"ms_again":{:.3},"vs_f32":{rf:.2},"layer_runs_bf16":{}}}"#,
                    fb.isa().name(),
                    b * 1e3,
                    a * 1e3,
                    f * 1e3,
                    b2 * 1e3,
                    brgemm::policy().is_ok_and(|p| p.bf16_fc_pays(fb.isa(), n)),
                );
            }
        }
        drop(x);
    }
}

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

/// Runs `a` and `b` once each, then `samples` (at least 3) times
/// alternately: the medians of their times and of the per-pair ratios
/// `a / b` (one process, the same moments, so the ratio holds where two
/// separate timings would not).
fn alternate(samples: usize, a: &mut dyn FnMut(), b: &mut dyn FnMut()) -> (f64, f64, f64) {
    a();
    b();
    let (mut ta, mut tb, mut ratio) = (vec![], vec![], vec![]);
    for _ in 0..samples.max(3) {
        let t0 = Instant::now();
        a();
        let x = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        b();
        let y = t0.elapsed().as_secs_f64();
        ta.push(x);
        tb.push(y);
        ratio.push(x / y);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (med(&mut ta), med(&mut tb), med(&mut ratio))
}

/// Convolution passes on the ResNet-50 layers at minibatches 8 and 16.
/// `upd` includes the per-call relayout of X it reads; `fwd` the
/// zero-padded input copy.
fn bench_conv(o: &Opts) {
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
/// pass 100%).
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
                r#""isa":"{isa}","gflops_with_packing":{:.1},"f32_gflops":{:.1},"vs_f32":{:.2},"vs_f32_with_packing":{:.2},"fp32_peak_gflops":{:.1},"pct_fp32_peak":{:.1}"#,
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

/// For a line on more than one thread: the speed-up over one thread,
/// measured by alternating the two ([`workload::speedup`]).
fn scaling(
    threads: usize,
    pool: &Pool,
    probe: &Probes,
    samples: usize,
    f: impl FnMut(&Pool),
) -> Option<f64> {
    (threads > 1).then(|| workload::speedup(f, &Pool::new(1).expect("pool"), pool, probe, samples))
}

/// `,"speedup_vs_1t":x` for a multi-thread line, else nothing.
fn speedup_field(sp: Option<f64>) -> String {
    sp.map(|x| format!(r#","speedup_vs_1t":{x:.2}"#))
        .unwrap_or_default()
}

/// LSTM forward and backward+update (BPTT, dX, dW, dR, db) on the paper's
/// shapes. FLOPs are the GEMMs': 2*T*N*4K*(C+K) forward, twice that for
/// backward+update.
fn bench_lstm(o: &Opts) {
    use brgemm_primitives::{CellKind, Rnn};
    let isa = Isa::selected().expect("ISA");
    let probe = Probes::new(isa, Duration::from_millis(10));
    let samples = if o.quick { 3 } else { 7 };
    for (t, n, c, k) in [
        (50usize, 64usize, 512usize, 512usize),
        (25, 64, 1024, 1024),
        (50, 16, 256, 256),
    ] {
        let rnn = Rnn::new(CellKind::Lstm, t, n, c, k).expect("plan");
        let tn = rnn.tuning().clone();
        let mut d = LstmData::new(&rnn);
        for threads in [1usize, 2] {
            let pool = Pool::new(threads).expect("pool");
            let line = |pass: &str, flops: f64, m: &Measured, sp: Option<f64>| {
                let gf = flops / m.secs / 1e9;
                println!(
                    r#"{{"bench":"lstm","pass":"{pass}","t":{t},"n":{n},"c":{c},"k":{k},"bn":{},"bc":{},"bk":{},"isa":"{isa}","threads":{threads},"gflops":{gf:.1},{}{}}}"#,
                    tn.bn,
                    tn.bc,
                    tn.bk,
                    m.json(gf),
                    speedup_field(sp)
                );
            };
            let m = measure_pool(
                || {
                    rnn.forward(&pool, &d.x, &d.w, &d.r, &d.bias, None, None, &mut d.st)
                        .unwrap()
                },
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                rnn.forward(p, &d.x, &d.w, &d.r, &d.bias, None, None, &mut d.st)
                    .unwrap()
            });
            line("fwd", rnn.flops(), &m, sp);
            let m = measure_pool(
                || {
                    rnn.backward(&pool, &d.dh, &d.x, &d.w, &d.r, &d.st, &mut d.gr)
                        .unwrap()
                },
                &pool,
                &probe,
                samples,
            );
            let sp = scaling(threads, &pool, &probe, samples, |p| {
                rnn.backward(p, &d.dh, &d.x, &d.w, &d.r, &d.st, &mut d.gr)
                    .unwrap()
            });
            line("bwd_upd", 2.0 * rnn.flops(), &m, sp);
            // bf16 (rounding X and packing W and R included: once per
            // step in training), each timed between two f32 timings.
            if let Ok(mb) = brgemm_primitives::rnn::RnnBf16::new(&rnn) {
                let mut pw = brgemm_primitives::rnn::RnnBf16Weights::default();
                let time = |f: &mut dyn FnMut()| measure_pool(f, &pool, &probe, samples);
                let f0 = time(&mut || {
                    rnn.forward(&pool, &d.x, &d.w, &d.r, &d.bias, None, None, &mut d.st)
                        .unwrap()
                })
                .secs;
                let b = time(&mut || {
                    mb.pack_weights(&pool, &d.w, &d.r, &mut pw).unwrap();
                    mb.forward(&pool, &rnn, &d.x, &pw, &d.bias, None, None, &mut d.st)
                        .unwrap()
                });
                let f1 = time(&mut || {
                    rnn.forward(&pool, &d.x, &d.w, &d.r, &d.bias, None, None, &mut d.st)
                        .unwrap()
                })
                .secs;
                let g0 = time(&mut || {
                    rnn.backward(&pool, &d.dh, &d.x, &d.w, &d.r, &d.st, &mut d.gr)
                        .unwrap()
                })
                .secs;
                let gb = time(&mut || {
                    mb.backward_from_state(&pool, &rnn, &d.dh, None, &d.x, &pw, &d.st, &mut d.gr)
                        .unwrap()
                });
                let g1 = time(&mut || {
                    rnn.backward(&pool, &d.dh, &d.x, &d.w, &d.r, &d.st, &mut d.gr)
                        .unwrap()
                })
                .secs;
                for (pass, flops, f, b) in [
                    ("fwd", rnn.flops(), (f0 + f1) / 2.0, b),
                    ("bwd_upd", 2.0 * rnn.flops(), (g0 + g1) / 2.0, gb),
                ] {
                    let gf = flops / b.secs / 1e9;
                    println!(
                        r#"{{"bench":"lstm","pass":"{pass}","dtype":"bf16","t":{t},"n":{n},"c":{c},"k":{k},"isa":"{}","threads":{threads},"gflops":{gf:.1},"f32_gflops":{:.1},"vs_f32":{:.2},"fp32_peak_gflops":{:.1},"pct_fp32_peak":{:.1}}}"#,
                        mb.isa().name(),
                        flops / f / 1e9,
                        f / b.secs,
                        b.peak_gflops,
                        100.0 * gf / b.peak_gflops
                    );
                }
            }
        }
    }
}

/// Cost of the loop-nest interpreter per body call (empty body), serial and
/// parallel, for a 3-loop nest with one blocking level.
fn bench_loops() {
    use brgemm_primitives::{LoopDef, LoopNest};
    use std::sync::atomic::{AtomicUsize, Ordering};
    for (spec, threads) in [("abc", 1usize), ("aABc", 1), ("aABc", 2), ("cAB", 2)] {
        let loops = vec![
            LoopDef::new("a", 64, 1).blocks(vec![8]),
            LoopDef::new("b", 64, 1),
            LoopDef::new("c", 64, 1).reduction(),
        ];
        let nest = LoopNest::new(loops, spec).expect("spec");
        let pool = Pool::new(threads).expect("pool");
        let hits = AtomicUsize::new(0);
        let body = |i: &[usize]| {
            std::hint::black_box(i);
        };
        let mut secs = vec![];
        for _ in 0..7 {
            let t = Instant::now();
            nest.run(&pool, body);
            secs.push(t.elapsed().as_secs_f64());
        }
        nest.run(&pool, |_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        let calls = hits.load(Ordering::Relaxed);
        let s = workload::median(&mut secs);
        println!(
            r#"{{"bench":"loops","spec":"{spec}","threads":{threads},"body_calls":{calls},"ns_per_call":{:.2}}}"#,
            s * 1e9 * threads as f64 / calls as f64
        );
    }
}

#[cfg(not(feature = "mpi"))]
fn bench_mpi(_: &[String]) {
    eprintln!(
        "bench mpi needs the mpi feature: cargo build --release --features mpi --example bench"
    );
    std::process::exit(2);
}

#[cfg(feature = "mpi")]
fn bench_mpi(args: &[String]) {
    mpi_bench::bench(args)
}

/// bf16 lines: AMX on every bench shape it fits (m and k multiples of 32),
/// AVX512-BF16 and the f32 kernel on widened inputs on all, with the fp32
/// kernel on the same shape in the same run for the ratio; `chosen` names the
/// kernel a plan gets here unforced (the CPU policy's order). Blocks fill
/// about 1 MiB as in the fp32 lines.
fn bench_brgemm_bf16(o: &Opts) {
    use brgemm::bf16::{bf16, Bf16Isa};
    use brgemm::{DataType, Descriptor, RawBatch};
    use brgemm::{Kernel, KernelOptions};
    let isas: Vec<Bf16Isa> = [Bf16Isa::Amx, Bf16Isa::Avx512Bf16, Bf16Isa::Fp32]
        .into_iter()
        .filter(|i| i.is_supported())
        .collect();
    if isas.len() == 1 {
        println!(
            r#"{{"bench":"brgemm","dtype":"bf16","note":"neither AMX nor AVX512-BF16 here; the reference bf16 kernel is not benchmarked"}}"#
        );
        return;
    }
    let (min_sample, samples) = if o.quick {
        (Duration::from_millis(10), 5)
    } else {
        (Duration::from_millis(30), 15)
    };
    let isa32 = Isa::best();
    let probe = Probes::new(isa32, min_sample / 2);
    let mut shapes = BRGEMM_SHAPES.to_vec();
    shapes.push((128, 128, 64, 16));
    for (m, n, k, batch) in shapes {
        let (sa, sb) = (m * k, k * n); // VNNI A with lda = m has m*k elements
        let per_block = 2 * batch * (sa + sb) + 4 * m * n;
        let blocks = ((1usize << 20) / per_block).clamp(2, 64);
        // 64-byte aligned, as `pack_a_vnni` and the primitives give them:
        // from a `Vec` (16 bytes off a line) AMX runs about 1.4x slower.
        let fill = |len: usize, f: fn(usize) -> f32| {
            brgemm::AlignedVec::from_iter(
                brgemm::buffer::ALIGN,
                (0..len).map(|i| bf16::from_f32(f(i))),
            )
        };
        let a = fill(blocks * batch * sa, |i| ((i % 13) as f32 - 6.0) / 8.0);
        let b = fill(blocks * batch * sb, |i| ((i % 7) as f32 - 3.0) / 8.0);
        let mut c = brgemm::aligned_vec(blocks * m * n, 0.0f32);
        let d = Descriptor::new(m, n, k).dtype(DataType::Bf16);
        let mut w = BrgemmWorkload::new(m, n, k, batch, 1 << 20);
        let k32 = Kernel::new(&w.descriptor(BatchForm::Packed)).expect("plan");
        // The kernel a plan gets here without forcing one.
        let chosen = Kernel::new(&d).map_or("none", |k| k.bf16_isa().map_or("none", |i| i.name()));
        let r32 = measure(|| w.pass(&k32), &probe, min_sample, samples);
        let gf32 = w.flops_per_pass() / r32.secs / 1e9;
        for &isa in &isas {
            let opts = KernelOptions {
                bf16: Some(isa),
                ..KernelOptions::default()
            };
            let Ok(kern) = Kernel::with_options(&d, opts) else {
                continue;
            }; // AMX: m and k multiples of 32 only
            let mut pass = || {
                for j in 0..blocks {
                    let raw = RawBatch::Stride {
                        a: a[j * batch * sa..].as_ptr(),
                        b: b[j * batch * sb..].as_ptr(),
                        count: batch,
                    };
                    // SAFETY: block j holds batch VNNI A_i, B_i and one C.
                    unsafe { kern.execute_raw(raw, c[j * m * n..].as_mut_ptr(), std::ptr::null()) };
                }
            };
            let flops = 2.0 * (m * n * k * batch * blocks) as f64;
            let r = measure(&mut pass, &probe, min_sample, samples);
            let gf = flops / r.secs / 1e9;
            println!(
                r#"{{"bench":"brgemm","isa":"{}","dtype":"bf16","form":"stride","m":{m},"n":{n},"k":{k},"batch":{batch},"blocks":{blocks},"threads":1,"gflops":{gf:.1},"chosen":"{chosen}","fp32_isa":"{isa32}","fp32_gflops":{gf32:.1},"x_fp32":{:.2},"fp32_peak_gflops":{:.1}}}"#,
                isa.name(),
                gf / gf32,
                r.peak_gflops
            );
        }
    }
}

/// ResNet-50 v1.5 on the layer graph, synthetic 224x224x3 input, batch 16
/// (`--batch B`), 1 and 2 threads: a training step (forward, softmax
/// cross-entropy, backward, SGD with momentum) and inference. FLOPs count
/// the convolutions' and the FC's multiply-adds x 2 for forward,
/// backward-data and backward-weights, less the first convolution's
/// backward-data (not needed). `--layers` adds a per-node time table,
/// `--fusion` the step with and without the graph's fusions; `--unfused`
/// measures the graph built without them; `--dtype bf16` adds the mixed
/// precision step (`Graph::set_bf16`), timed between two f32 steps.
fn bench_resnet50(o: &Opts, args: &[String]) {
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
                r#"{{"bench":"resnet50","dtype":"bf16","batch":{batch},"threads":{threads},"bf16_layers":{layers},"train_images_per_s":{:.2},"infer_images_per_s":{:.2},"train_gflops":{:.1},"f32_train_images_per_s":{:.2},"train_vs_f32":{:.2}}}"#,
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
/// GFLOP/s where it has FLOPs.
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
    g.reset_times();
    for _ in 0..STEPS {
        g.forward(pool, x, Mode::Eval).expect("inference");
    }
    let infer: Vec<f64> = g.times().iter().map(|t| t.forward_s).collect();
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
