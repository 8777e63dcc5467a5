//! Loop-order and blocking experiments for a layer shape.
//!
//! ```text
//! cargo run --release --example tune -- fc --n 256 --c 1024 --k 1024 \
//!     [--threads T] [--quick] [--out DIR] [--save FILE]
//! ```
//!
//! Sweeps blockings (bn, bc, bk), loop specs and reduction chunks for the
//! forward, backward-data and backward-weights passes, shows progress on
//! stderr, prints a ranked table with GFLOP/s, % of the peak of that many
//! threads (measured in this run) and % of the L1 tile ceiling, writes
//! `DIR/tune_fc_<shape>.csv` and an SVG chart, and with `--save FILE`
//! stores the best configuration for this shape in FILE (a JSON list of
//! entries, one per shape), which `brgemm_primitives::tuning::load`
//! reads back.
//!
//! ```text
//! cargo run --release --example tune -- conv --n 8 --c 64 --k 64 --h 56 --w 56 --r 3 --s 3 \
//!     [--stride 1] [--pad R/2] [--threads T] [--quick] [--out DIR]
//! ```
//!
//! Sweeps channel blocks (bc, bk), pixel runs (bq), loop specs and chunks of
//! the three convolution passes the same way (`bn` in the table and CSV is
//! `bq` there) and prints the best `ConvTuning` for `Conv::with_tuning`.
//!
//! ```text
//! cargo run --release --example tune -- lstm --t 50 --n 64 --c 512 --k 512 [--threads T] [--quick]
//! ```
//!
//! Sweeps the LSTM's blocks (bn, bc, bk) and per-step loop specs of forward
//! and backward (BPTT plus the weight gradients) and prints the best
//! `RnnTuning` for `Rnn::with_tuning`.
//!
//! Ranking: this machine's speed for anything that loads operands drifts by
//! 20-40% within a minute while the configurations are swept one after the
//! other, so raw GFLOP/s would rank the moment as much as the configuration.
//! Every timed sample is paired with a slice of
//! [`brgemm::peak::TileCeiling`] on all the pool's threads just before it,
//! and rows are ranked by `%tile`, the median of the per-sample ratios
//! (the CSV has both figures).

#[path = "support/fill.rs"]
mod fill;
#[path = "support/tune_conv.rs"]
mod tune_conv;
#[path = "support/tune_lstm.rs"]
mod tune_lstm;
#[path = "support/workload.rs"]
#[allow(dead_code)]
mod workload;
use brgemm::Isa;
use brgemm_primitives::tuning::{load as load_tuning, TunedFc};
use brgemm_primitives::PassConfig;
use brgemm_primitives::{Activation, Fc, FcTuning, Pool};
use fill::fill;
use plotters::prelude::*;
use std::io::Write;
use std::time::{Duration, Instant};
use workload::{measure_pool, on_every_thread, Probes};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// A positive integer option (a 0 shape or thread count is an error).
fn num(args: &[String], name: &str, default: usize) -> usize {
    match num_or_zero(args, name, default) {
        0 => fail(&format!("{name} 0: expected a positive integer")),
        v => v,
    }
}

/// A non-negative integer option (`--pad`).
fn num_or_zero(args: &[String], name: &str, default: usize) -> usize {
    match arg(args, name) {
        Some(v) => v
            .parse()
            .unwrap_or_else(|_| fail(&format!("{name} {v:?}: expected an integer"))),
        None => default,
    }
}

/// The tuning entries already in `--save`'s file (none when it does not
/// exist yet); a file that exists but is not a tuning file is an error
/// before the sweep, never replaced.
fn saved_tunings(path: &std::path::Path) -> Vec<TunedFc> {
    match std::fs::read_to_string(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
        Err(e) => fail(&format!("--save {}: {e}", path.display())),
        Ok(s) => serde_json::from_str(&s).unwrap_or_else(|e| {
            fail(&format!(
                "--save {}: not a tuning file ({e}); not replacing it",
                path.display()
            ))
        }),
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("tune: {msg}");
    std::process::exit(2)
}

/// What every sweep needs: threads, the pool on them, the ISA, this run's
/// peak on all the pool's threads (median of 5 probes, for the header and the
/// chart), the probes sampled between every configuration's samples, the
/// output folder.
struct Setup {
    threads: usize,
    quick: bool,
    out_dir: std::path::PathBuf,
    pool: Pool,
    peak: f64,
    probes: Probes,
}

/// The sweep's settings from `args`, its pool and the FMA peak of all its
/// threads, announced on stderr with `shape` (what is being tuned).
fn setup(args: &[String], shape: &str) -> Setup {
    let threads = num(args, "--threads", Pool::global().threads());
    let quick = args.iter().any(|a| a == "--quick");
    let out_dir =
        std::path::PathBuf::from(arg(args, "--out").unwrap_or_else(|| "target/tune".into()));
    std::fs::create_dir_all(&out_dir)
        .unwrap_or_else(|e| fail(&format!("{}: {e}", out_dir.display())));
    // Every configuration on all the threads asked for, however small the
    // shape: the sweep compares parallel schedules (a real layer of under
    // `MIN_PARALLEL_FLOPS` runs on one thread, see `Pool::for_work`).
    let pool = Pool::new(threads)
        .unwrap_or_else(|e| fail(&e.to_string()))
        .always_parallel();
    let isa = Isa::selected().unwrap_or_else(|e| fail(&e.to_string()));
    // Short slices: one pair of them precedes every sample of every configuration.
    let probes = Probes::new(isa, Duration::from_millis(3));
    let mut v: Vec<f64> = (0..5)
        .map(|_| on_every_thread(&pool, || probes.fma.sample()))
        .collect();
    let peak = workload::median(&mut v);
    eprintln!("{shape}: {threads} thread(s), {isa}, peak {peak:.1} GFLOP/s");
    Setup {
        threads,
        quick,
        out_dir,
        pool,
        peak,
        probes,
    }
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
    /// Median over the samples of the share of the L1 tile ceiling.
    pct_tile: f64,
}

/// `pass`'s rows, best first (by share of the L1 tile ceiling).
fn ranked<'a>(rows: &'a [Row], pass: &str) -> Vec<&'a Row> {
    let mut r: Vec<&Row> = rows.iter().filter(|r| r.pass == pass).collect();
    r.sort_by(|a, b| b.pct_tile.total_cmp(&a.pct_tile));
    r
}

/// Prints the `top` best rows of `pass` under `label` (`first`: the name of
/// the first block column) and returns all of them, best first.
fn print_ranked<'a>(
    rows: &'a [Row],
    pass: &str,
    label: &str,
    first: &str,
    top: usize,
) -> Vec<&'a Row> {
    let r = ranked(rows, pass);
    println!("\n{label}: rank  {first}  bc  bk  spec    chunk   ms      GFLOP/s  %peak  %tile");
    for (i, x) in r.iter().take(top).enumerate() {
        println!(
            "     {:4}  {:3} {:3} {:3}  {:6}  {:5}  {:7.3}  {:7.1}  {:5.1}  {:5.1}",
            i + 1,
            x.bn,
            x.bc,
            x.bk,
            x.spec,
            x.chunk,
            x.secs * 1e3,
            x.gflops,
            x.pct,
            x.pct_tile
        );
    }
    r
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(|s| s.as_str()) {
        Some("fc") => tune_fc(&args[1..]),
        Some("conv") => tune_conv::tune_conv(&args[1..]),
        Some("lstm") => tune_lstm::tune_lstm(&args[1..]),
        _ => fail(
            "usage: tune fc --n N --c C --k K [--threads T] [--quick] [--out DIR] [--save FILE]\n       \
             tune conv --n N --c C --k K --h H --w W --r R --s S [--stride U] [--pad P] [--threads T] [--quick] [--out DIR]\n       \
             tune lstm --t T --n N --c C --k K [--threads T] [--quick] [--out DIR]",
        ),
    }
}

/// `spec`, written over (first output, second output, reduction) as
/// `a`, `b`, `c`, in the FC letters of `pass` (a = N, b = K, c = C blocks;
/// bwd reduces over b, upd over a).
fn fc_letters(spec: &str, pass: &str) -> String {
    let to = match pass {
        "bwd" => ['a', 'c', 'b'],
        "upd" => ['b', 'c', 'a'],
        _ => ['a', 'b', 'c'],
    };
    spec.chars()
        .map(|ch| {
            let l = to[(ch.to_ascii_lowercase() as u8 - b'a') as usize];
            if ch.is_ascii_uppercase() {
                l.to_ascii_uppercase()
            } else {
                l
            }
        })
        .collect()
}

fn tune_fc(args: &[String]) {
    let save = arg(args, "--save").map(std::path::PathBuf::from);
    let mut all = save.as_deref().map(saved_tunings).unwrap_or_default();
    let (n, c, k) = (
        num(args, "--n", 256),
        num(args, "--c", 1024),
        num(args, "--k", 1024),
    );
    let Setup {
        threads,
        quick,
        out_dir,
        pool,
        peak,
        probes,
    } = setup(args, &format!("fc n={n} c={c} k={k}"));

    let blocks: &[usize] = if quick { &[64] } else { &[32, 64] };
    // c first: the reduction chunked and outermost (the heuristic's choice
    // for long reductions); with chunk 0 it would repeat ABc/BAc.
    let specs = ["ABc", "BAc", "aBc", "bAc", "cAB", "cBA"];
    let chunks: &[usize] = if quick { &[0, 8] } else { &[0, 4, 8, 16] };
    let combos: Vec<(&str, usize)> = specs
        .iter()
        .flat_map(|&s| chunks.iter().map(move |&ch| (s, ch)))
        .filter(|&(s, ch)| !(s.starts_with('c') && ch == 0))
        .collect();
    let mut blockings = vec![];
    for &bn in blocks {
        for &bc in blocks {
            for &bk in blocks {
                blockings.push((bn, bc, bk));
            }
        }
    }
    let total = blockings.len() * 3 * combos.len();
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
        fill(x.data_mut(), 7, 8.0);
        let mut w = fc0.w_layout();
        fill(w.data_mut(), 5, 64.0);
        let bias = vec![0.0f32; fc0.padded_k()];
        let (mut y, mut dz, mut dx, mut dw) = (
            fc0.y_layout(),
            fc0.y_layout(),
            fc0.x_layout(),
            fc0.w_layout(),
        );
        fill(dz.data_mut(), 3, 4.0);
        let mut dzt = fc0.dzt_layout();
        let mut db = vec![0.0f32; fc0.padded_k()];
        for pass in ["fwd", "bwd", "upd"] {
            for &(spec, chunk) in &combos {
                done += 1;
                let pc = PassConfig {
                    chunk,
                    ..PassConfig::spec(&fc_letters(spec, pass))
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
                    "bwd" => fc.backward_data(&pool, &dz, &w, &mut dzt, &mut dx).unwrap(),
                    _ => fc
                        .backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                        .unwrap(),
                };
                let tm = measure_pool(&mut run, &pool, &probes, if quick { 3 } else { 5 });
                let secs = tm.secs;
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
                    spec: fc_letters(spec, pass),
                    chunk,
                    secs,
                    gflops,
                    pct: tm.pct_peak(gflops),
                    pct_tile: tm.pct_tile_l1(gflops),
                });
                eprint!(
                    "\r[{done:3}/{total}] {:5.1}s  {pass} bn={bn} bc={bc} bk={bk} {spec:4} chunk={chunk:2}: {gflops:6.1} GFLOP/s   ",
                    t0.elapsed().as_secs_f64()
                );
            }
        }
    }
    eprintln!();

    // Ranked table per pass.
    for pass in ["fwd", "bwd", "upd"] {
        print_ranked(&rows, pass, pass, "bn", 10);
    }

    let stem = format!("tune_fc_n{n}_c{c}_k{k}_t{threads}");
    write_results(
        &out_dir,
        &stem,
        "bn",
        &rows,
        peak,
        &format!("FC n={n} c={c} k={k}, {threads} thread(s)"),
    );

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
    if let Some(path) = save {
        all.retain(|t| (t.n, t.c, t.k) != (n, c, k));
        all.push(TunedFc {
            n,
            c,
            k,
            tuning: tuning.clone(),
        });
        // Atomically: a crash mid-write never leaves half a tuning file.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_string_pretty(&all).unwrap())
            .and_then(|_| std::fs::rename(&tmp, &path))
            .unwrap_or_else(|e| fail(&format!("{}: {e}", path.display())));
        let back = load_tuning(&path, n, c, k).expect("reload").expect("entry");
        assert_eq!(back, tuning);
        println!(
            "saved to {} (load with brgemm_primitives::tuning::load)",
            path.display()
        );
    }
}

/// Writes `rows` as `DIR/STEM.csv` (first block column named `first`) and
/// an SVG chart, and says where.
fn write_results(
    out_dir: &std::path::Path,
    stem: &str,
    first: &str,
    rows: &[Row],
    peak: f64,
    title: &str,
) {
    let csv = out_dir.join(format!("{stem}.csv"));
    let mut f =
        std::fs::File::create(&csv).unwrap_or_else(|e| fail(&format!("{}: {e}", csv.display())));
    writeln!(
        f,
        "pass,{first},bc,bk,spec,chunk,seconds,gflops,pct_peak,pct_tile_l1"
    )
    .unwrap();
    for r in rows {
        writeln!(
            f,
            "{},{},{},{},{},{},{:.6},{:.2},{:.2},{:.2}",
            r.pass, r.bn, r.bc, r.bk, r.spec, r.chunk, r.secs, r.gflops, r.pct, r.pct_tile
        )
        .unwrap();
    }
    let svg = out_dir.join(format!("{stem}.svg"));
    chart(&svg, rows, peak, title);
    println!("\nwrote {} and {}", csv.display(), svg.display());
}

/// One bar per configuration, grouped by pass, best first within each pass.
fn chart(path: &std::path::Path, rows: &[Row], peak: f64, title: &str) {
    let mut passes: Vec<&str> = vec![];
    for r in rows {
        if !passes.contains(&r.pass) {
            passes.push(r.pass);
        }
    }
    let mut sorted: Vec<&Row> = vec![];
    for &pass in &passes {
        sorted.extend(ranked(rows, pass));
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
        .x_desc(format!(
            "configurations ({}, best first)",
            passes.join(" | ")
        ))
        .y_desc("GFLOP/s")
        .draw()
        .unwrap();
    let color = |p: &str| match p {
        "fwd" => BLUE,
        "bwd" => GREEN,
        _ => RED,
    };
    for &pass in &passes {
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
