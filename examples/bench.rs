//! Bench runner: one JSON object per line, for machines.
//!
//! ```text
//! cargo run --release --example bench -- brgemm [--quick]
//! cargo run --release --example bench -- fc [--quick]
//! cargo run --release --example bench -- conv [--quick] [--layer NAME]
//! cargo run --release --example bench -- lstm [--quick]
//! cargo run --release --example bench -- mlp [--quick]
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

#[path = "support/conv_bench.rs"]
mod conv_bench;
#[path = "support/fc_bench.rs"]
mod fc_bench;
#[path = "support/fill.rs"]
mod fill;
#[path = "support/mlp_bench.rs"]
mod mlp_bench;
#[path = "support/resnet_bench.rs"]
mod resnet_bench;

#[cfg(feature = "mpi")]
#[path = "support/mpi_bench.rs"]
mod mpi_bench;
use brgemm::{peak, BatchForm, Isa, Kernel, KernelOptions, RegisterTile};
use brgemm_primitives::Pool;
use fill::LstmData;
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
        .any(|w| ["brgemm", "fc", "conv", "lstm", "mlp", "resnet50"].contains(w))
    {
        machine_line();
    }
    for w in what {
        match w {
            "brgemm" => {
                bench_brgemm(&opts);
                bench_brgemm_bf16(&opts);
            }
            "fc" => fc_bench::bench_fc(&opts),
            "conv" => conv_bench::bench_conv(&opts),
            "lstm" => bench_lstm(&opts),
            "mlp" => mlp_bench::bench_mlp(&opts),
            "loops" => bench_loops(),
            "resnet50" => resnet_bench::bench_resnet50(&opts, &args),
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
                    "unknown bench {other:?}; known: brgemm, fc, conv, lstm, mlp, loops, resnet50, mpi, gpu"
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

/// Runs `a` and `b` once each, then `samples` (at least 3) times
/// alternately, each first in every other pair: the medians of their times
/// and of the per-pair ratios `a / b` (one process, the same moments, so
/// the ratio holds where two separate timings would not).
fn alternate(samples: usize, a: &mut dyn FnMut(), b: &mut dyn FnMut()) -> (f64, f64, f64) {
    a();
    b();
    let (mut ta, mut tb, mut ratio) = (vec![], vec![], vec![]);
    let time = |f: &mut dyn FnMut()| {
        let t0 = Instant::now();
        f();
        t0.elapsed().as_secs_f64()
    };
    for i in 0..samples.max(3) {
        // Each goes first in every other pair: the second of a pair runs
        // on what the first left (dirty lines to write back, a cooler or
        // warmer core), which on this VM moved the same pass timed twice
        // by up to 20%.
        let (x, y) = if i % 2 == 0 {
            let x = time(a);
            (x, time(b))
        } else {
            let y = time(b);
            (time(a), y)
        };
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
