//! Bench runner: one JSON object per line, for machines.
//!
//! ```text
//! cargo run --release --example bench -- brgemm [--quick]
//! ```
//!
//! Every line carries GFLOP/s and `pct_peak`, the share of the FMA peak of
//! the same ISA measured by this process just before (`{"bench":"peak",..}`
//! lines), since this machine's speed varies between processes. Figures are
//! medians over repeated samples.

#[path = "support/workload.rs"]
mod workload;

use brgemm::peak::Probe;
use brgemm::{peak, BatchForm, Isa, Kernel, KernelOptions, RegisterTile};
use std::collections::HashMap;
use std::time::Duration;
use workload::{measure, BrgemmWorkload};

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
    let what: Vec<&str> = args
        .iter()
        .map(|s| s.as_str())
        .filter(|s| !s.starts_with("--"))
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
    for w in what {
        match w {
            "brgemm" => bench_brgemm(&opts),
            other => {
                eprintln!("unknown bench {other:?}; known: brgemm");
                std::process::exit(2);
            }
        }
    }
}

/// Prints one `peak` line per ISA and returns a probe per ISA, whose slices
/// are interleaved with every later measurement.
fn probes(isas: &[Isa], slice: Duration) -> HashMap<Isa, Probe> {
    let mut out = HashMap::new();
    for &isa in isas {
        let p = peak::fma_peak_gflops(isa).expect("supported ISA");
        println!(r#"{{"bench":"peak","isa":"{isa}","dtype":"f32","threads":1,"gflops":{p:.1}}}"#);
        out.insert(isa, Probe::new(isa, slice).expect("supported ISA"));
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
                    r#"{{"bench":"brgemm","isa":"{isa}","dtype":"f32","form":"{fname}","m":{m},"n":{n},"k":{k},"batch":{batch},"blocks":{},"tile":"{t}","threads":1,"gflops":{gf:.1},"peak_gflops":{:.1},"pct_peak":{:.1}}}"#,
                    w.blocks,
                    r.peak_gflops,
                    100.0 * gf / r.peak_gflops
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
            100.0 * gf / r.peak_gflops
        );
    }
}
