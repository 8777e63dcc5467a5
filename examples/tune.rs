//! Loop-order and blocking experiments for a layer shape.
//!
//! ```text
//! cargo run --release --example tune -- fc --n 256 --c 1024 --k 1024 \
//!     [--threads T] [--quick] [--out DIR] [--save FILE]
//! ```
//!
//! Sweeps blockings (bn, bc, bk), loop specs and reduction chunks for the
//! forward, backward-data and backward-weights passes, shows progress on
//! stderr, prints a ranked table with GFLOP/s and % of the peak of that many
//! threads (measured in this run), writes `DIR/tune_fc_<shape>.csv` and an SVG
//! chart, and with `--save FILE` stores the best configuration for this shape
//! in FILE (a JSON list of entries, one per shape), which
//! `brgemm_primitives::fc::load_tuning` reads back.

use brgemm::peak::Probe;
use brgemm::Isa;
use brgemm_primitives::fc::{load_tuning, PassConfig, TunedFc};
use brgemm_primitives::{Activation, Fc, FcTuning, Pool};
use plotters::prelude::*;
use std::io::Write;
use std::time::{Duration, Instant};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num(args: &[String], name: &str, default: usize) -> usize {
    match arg(args, name) {
        Some(v) => v
            .parse()
            .unwrap_or_else(|_| fail(&format!("{name} {v:?}: expected a positive integer"))),
        None => default,
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tune: {msg}");
    std::process::exit(2)
}

#[derive(Clone)]
struct Row {
    pass: &'static str,
    bn: usize,
    bc: usize,
    bk: usize,
    spec: String,
    chunk: usize,
    secs: f64,
    gflops: f64,
    pct: f64,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(|s| s.as_str()) {
        Some("fc") => tune_fc(&args[1..]),
        _ => fail(
            "usage: tune fc --n N --c C --k K [--threads T] [--quick] [--out DIR] [--save FILE]",
        ),
    }
}

fn tune_fc(args: &[String]) {
    let (n, c, k) = (
        num(args, "--n", 256),
        num(args, "--c", 1024),
        num(args, "--k", 1024),
    );
    let threads = num(args, "--threads", Pool::global().threads());
    let quick = args.iter().any(|a| a == "--quick");
    let out_dir =
        std::path::PathBuf::from(arg(args, "--out").unwrap_or_else(|| "target/tune".into()));
    std::fs::create_dir_all(&out_dir)
        .unwrap_or_else(|e| fail(&format!("{}: {e}", out_dir.display())));
    let pool = Pool::new(threads).unwrap_or_else(|e| fail(&e.to_string()));
    let isa = Isa::selected().unwrap_or_else(|e| fail(&e.to_string()));
    let probe = Probe::new(isa, Duration::from_millis(10)).expect("probe");
    let peak = {
        let s = std::sync::Mutex::new(vec![]);
        for _ in 0..5 {
            let tot = std::sync::Mutex::new(0.0);
            pool.broadcast(|_| *tot.lock().unwrap() += probe.sample());
            s.lock().unwrap().push(tot.into_inner().unwrap());
        }
        let mut v = s.into_inner().unwrap();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!("fc n={n} c={c} k={k}: {threads} thread(s), {isa}, peak {peak:.1} GFLOP/s");

    let blocks: &[usize] = if quick { &[64] } else { &[32, 64] };
    let specs = ["ABc", "BAc", "aBc", "bAc"];
    let chunks: &[usize] = if quick { &[0, 8] } else { &[0, 4, 8, 16] };
    let mut blockings = vec![];
    for &bn in blocks {
        for &bc in blocks {
            for &bk in blocks {
                blockings.push((bn, bc, bk));
            }
        }
    }
    let total = blockings.len() * 3 * specs.len() * chunks.len();
    let mut done = 0;
    let mut rows: Vec<Row> = vec![];
    let t0 = Instant::now();
    for &(bn, bc, bk) in &blockings {
        let base = FcTuning {
            bn,
            bc,
            bk,
            ..FcTuning::heuristic(n, c, k)
        };
        let fc0 = Fc::with_tuning(n, c, k, Activation::Relu, base.clone()).expect("plan");
        let mut x = fc0.x_layout();
        x.data
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = ((i % 7) as f32 - 3.0) / 8.0);
        let mut w = fc0.w_layout();
        w.data
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = ((i % 5) as f32 - 2.0) / 64.0);
        let bias = vec![0.0f32; fc0.padded_k()];
        let (mut y, mut dz, mut dx, mut dw) = (
            fc0.y_layout(),
            fc0.y_layout(),
            fc0.x_layout(),
            fc0.w_layout(),
        );
        dz.data
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = ((i % 3) as f32 - 1.0) / 4.0);
        let (mut wt, mut xt) = (fc0.wt_layout(), fc0.xt_layout());
        fc0.transpose_weights(&pool, &w, &mut wt).unwrap();
        fc0.relayout_input(&pool, &x, &mut xt).unwrap();
        let mut db = vec![0.0f32; fc0.padded_k()];
        for pass in ["fwd", "bwd", "upd"] {
            for spec in specs {
                for &chunk in chunks {
                    done += 1;
                    let pc = PassConfig {
                        chunk,
                        ..PassConfig::spec(spec)
                    };
                    let mut t = base.clone();
                    match pass {
                        "fwd" => t.fwd = pc,
                        "bwd" => t.bwd = pc,
                        _ => t.upd = pc,
                    }
                    let Ok(fc) = Fc::with_tuning(n, c, k, Activation::Relu, t) else {
                        continue;
                    };
                    let mut run = || match pass {
                        "fwd" => fc.forward(&pool, &x, &w, &bias, &mut y, None).unwrap(),
                        "bwd" => fc.backward_data(&pool, &dz, &wt, &mut dx).unwrap(),
                        _ => fc
                            .backward_weights(&pool, &dz, &xt, &mut dw, &mut db)
                            .unwrap(),
                    };
                    run();
                    let mut v: Vec<f64> = (0..if quick { 3 } else { 5 })
                        .map(|_| {
                            let t = Instant::now();
                            run();
                            t.elapsed().as_secs_f64()
                        })
                        .collect();
                    v.sort_by(f64::total_cmp);
                    let secs = v[v.len() / 2];
                    let gflops = fc.flops() / secs / 1e9;
                    let pass = match pass {
                        "fwd" => "fwd",
                        "bwd" => "bwd",
                        _ => "upd",
                    };
                    rows.push(Row {
                        pass,
                        bn,
                        bc,
                        bk,
                        spec: spec.into(),
                        chunk,
                        secs,
                        gflops,
                        pct: 100.0 * gflops / peak,
                    });
                    eprint!(
                        "\r[{done:3}/{total}] {:5.1}s  {pass} bn={bn} bc={bc} bk={bk} {spec:4} chunk={chunk:2}: {gflops:6.1} GFLOP/s   ",
                        t0.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }
    eprintln!();

    // Ranked table per pass.
    for pass in ["fwd", "bwd", "upd"] {
        let mut r: Vec<&Row> = rows.iter().filter(|r| r.pass == pass).collect();
        r.sort_by(|a, b| b.gflops.total_cmp(&a.gflops));
        println!("\n{pass}: rank  bn  bc  bk  spec  chunk   ms      GFLOP/s  %peak");
        for (i, x) in r.iter().take(10).enumerate() {
            println!(
                "     {:4}  {:3} {:3} {:3}  {:4}  {:5}  {:7.3}  {:7.1}  {:5.1}",
                i + 1,
                x.bn,
                x.bc,
                x.bk,
                x.spec,
                x.chunk,
                x.secs * 1e3,
                x.gflops,
                x.pct
            );
        }
    }

    let stem = format!("tune_fc_n{n}_c{c}_k{k}_t{threads}");
    let csv = out_dir.join(format!("{stem}.csv"));
    let mut f =
        std::fs::File::create(&csv).unwrap_or_else(|e| fail(&format!("{}: {e}", csv.display())));
    writeln!(f, "pass,bn,bc,bk,spec,chunk,seconds,gflops,pct_peak").unwrap();
    for r in &rows {
        writeln!(
            f,
            "{},{},{},{},{},{},{:.6},{:.2},{:.2}",
            r.pass, r.bn, r.bc, r.bk, r.spec, r.chunk, r.secs, r.gflops, r.pct
        )
        .unwrap();
    }
    let svg = out_dir.join(format!("{stem}.svg"));
    chart(
        &svg,
        &rows,
        peak,
        &format!("FC n={n} c={c} k={k}, {threads} thread(s)"),
    );
    println!("\nwrote {} and {}", csv.display(), svg.display());

    // Best blocking: least total time of the three passes at their best.
    let mut best: Option<(f64, FcTuning)> = None;
    for &(bn, bc, bk) in &blockings {
        let pick = |pass: &str| {
            rows.iter()
                .filter(|r| r.pass == pass && (r.bn, r.bc, r.bk) == (bn, bc, bk))
                .min_by(|a, b| a.secs.total_cmp(&b.secs))
        };
        if let (Some(f), Some(b), Some(u)) = (pick("fwd"), pick("bwd"), pick("upd")) {
            let total = f.secs + b.secs + u.secs;
            let pc = |r: &Row| PassConfig {
                chunk: r.chunk,
                ..PassConfig::spec(&r.spec)
            };
            let t = FcTuning {
                bn,
                bc,
                bk,
                fwd: pc(f),
                bwd: pc(b),
                upd: pc(u),
            };
            if best.as_ref().is_none_or(|(s, _)| total < *s) {
                best = Some((total, t));
            }
        }
    }
    let (secs, tuning) = best.expect("at least one configuration ran");
    let heur = FcTuning::heuristic(n, c, k);
    println!(
        "best: {tuning:?} ({:.3} ms for fwd+bwd+upd)\nheuristic default: {heur:?}",
        secs * 1e3
    );
    if let Some(path) = arg(args, "--save") {
        let path = std::path::PathBuf::from(path);
        let mut all: Vec<TunedFc> = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or_default();
        all.retain(|t| (t.n, t.c, t.k) != (n, c, k));
        all.push(TunedFc {
            n,
            c,
            k,
            tuning: tuning.clone(),
        });
        std::fs::write(&path, serde_json::to_string_pretty(&all).unwrap())
            .unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
        let back = load_tuning(&path, n, c, k).expect("reload").expect("entry");
        assert_eq!(back, tuning);
        println!(
            "saved to {} (load with brgemm_primitives::fc::load_tuning)",
            path.display()
        );
    }
}

/// One bar per configuration, grouped by pass, best first within each pass.
fn chart(path: &std::path::Path, rows: &[Row], peak: f64, title: &str) {
    let mut sorted: Vec<&Row> = vec![];
    for pass in ["fwd", "bwd", "upd"] {
        let mut r: Vec<&Row> = rows.iter().filter(|r| r.pass == pass).collect();
        r.sort_by(|a, b| b.gflops.total_cmp(&a.gflops));
        sorted.extend(r);
    }
    let root = SVGBackend::new(path, (1200, 520)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let ymax = peak.max(sorted.iter().map(|r| r.gflops).fold(0.0, f64::max)) * 1.05;
    let mut ch = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..sorted.len() as f64, 0f64..ymax)
        .unwrap();
    ch.configure_mesh()
        .disable_x_mesh()
        .x_desc("configurations (fwd | bwd | upd, best first)")
        .y_desc("GFLOP/s")
        .draw()
        .unwrap();
    let color = |p: &str| match p {
        "fwd" => BLUE,
        "bwd" => GREEN,
        _ => RED,
    };
    for pass in ["fwd", "bwd", "upd"] {
        let c = color(pass);
        ch.draw_series(
            sorted
                .iter()
                .enumerate()
                .filter(|(_, r)| r.pass == pass)
                .map(|(i, r)| {
                    Rectangle::new(
                        [(i as f64 + 0.1, 0.0), (i as f64 + 0.9, r.gflops)],
                        c.filled(),
                    )
                }),
        )
        .unwrap()
        .label(pass)
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
    }
    ch.draw_series(LineSeries::new(
        [(0.0, peak), (sorted.len() as f64, peak)],
        BLACK.stroke_width(2),
    ))
    .unwrap()
    .label("FMA peak (measured)")
    .legend(|(x, y)| PathElement::new([(x, y), (x + 12, y)], BLACK));
    ch.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .unwrap();
    root.present().unwrap();
}
