//! `tune lstm`: the LSTM passes' loop orders and blockings, ranked.

use super::{num, print_ranked, setup, write_results, Row, Setup};
use crate::fill::LstmData;
use crate::workload::measure_pool;
use brgemm_primitives::PassConfig;
use std::time::Instant;

pub(crate) fn tune_lstm(args: &[String]) {
    use brgemm_primitives::{CellKind, Rnn, RnnTuning};
    let (t, n, c, k) = (
        num(args, "--t", 50),
        num(args, "--n", 64),
        num(args, "--c", 512),
        num(args, "--k", 512),
    );
    let Setup {
        threads,
        quick,
        out_dir,
        pool,
        peak,
        probes,
    } = setup(args, &format!("lstm t={t} n={n} c={c} k={k}"));
    let heur = RnnTuning::heuristic(n, c, k);
    let blocks: Vec<usize> = if quick { vec![0] } else { vec![0, 32, 64] };
    // Steps (c) outermost; backward runs its two phases (d) inside them.
    let specs = ["cAB", "cBA", "caB", "cAb"];
    let mut rows: Vec<Row> = vec![];
    let t0 = Instant::now();
    for &bn in &blocks {
        for &bk in &blocks {
            let tn = RnnTuning {
                bn: if bn == 0 { heur.bn } else { bn.min(n) },
                bk: if bk == 0 { heur.bk } else { bk.min(k) },
                ..heur.clone()
            };
            for spec in specs {
                let bwd_spec = spec.replacen('c', "cd", 1);
                let tt = RnnTuning {
                    fwd: PassConfig::spec(spec),
                    bwd: PassConfig::spec(&bwd_spec),
                    ..tn.clone()
                };
                let Ok(rnn) = Rnn::with_tuning(CellKind::Lstm, t, n, c, k, tt) else {
                    continue;
                };
                let mut d = LstmData::new(&rnn);
                let samples = if quick { 3 } else { 5 };
                let ft = measure_pool(
                    || {
                        rnn.forward(&pool, &d.x, &d.w, &d.r, &d.bias, None, None, &mut d.st)
                            .unwrap()
                    },
                    &pool,
                    &probes,
                    samples,
                );
                let bt = measure_pool(
                    || {
                        rnn.backward(&pool, &d.dh, &d.x, &d.w, &d.r, &d.st, &mut d.gr)
                            .unwrap()
                    },
                    &pool,
                    &probes,
                    samples,
                );
                for (pass, tm, flops, spec) in [
                    ("fwd", ft, rnn.flops(), spec),
                    ("bwd_upd", bt, 2.0 * rnn.flops(), &bwd_spec[..]),
                ] {
                    let secs = tm.secs;
                    let gflops = flops / secs / 1e9;
                    rows.push(Row {
                        pass,
                        bn: tn.bn,
                        bc: tn.bc,
                        bk: tn.bk,
                        spec: spec.into(),
                        chunk: 0,
                        secs,
                        gflops,
                        pct: tm.pct_peak(gflops),
                        pct_tile: tm.pct_tile_l1(gflops),
                    });
                }
                eprint!(
                    "\r{:5.1}s  bn={} bk={} {spec}",
                    t0.elapsed().as_secs_f64(),
                    tn.bn,
                    tn.bk
                );
            }
        }
    }
    eprintln!();
    let mut best = heur.clone();
    for (pass, label) in [("fwd", "fwd"), ("bwd_upd", "bwd+upd")] {
        let r = print_ranked(&rows, pass, label, "bn", 8);
        if let Some(top) = r.first() {
            if pass == "fwd" {
                (best.bn, best.bk) = (top.bn, top.bk);
                best.fwd = PassConfig::spec(&top.spec);
            } else {
                best.bwd = PassConfig::spec(&top.spec);
            }
        }
    }
    let stem = format!("tune_lstm_t{t}_n{n}_c{c}_k{k}_t{threads}");
    write_results(
        &out_dir,
        &stem,
        "bn",
        &rows,
        peak,
        &format!("LSTM t={t} n={n} c={c} k={k}, {threads} thread(s)"),
    );
    println!("best by %tile (blocks from the best forward): {best:?}\nheuristic default: {heur:?}");
}
