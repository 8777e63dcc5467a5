//! `tune conv`: every loop order and blocking of the convolution passes
//! on one layer, ranked.

use super::{fail, num, num_or_zero, print_ranked, setup, write_results, Row, Setup};
use crate::fill::fill;
use crate::workload::measure_pool;
use brgemm_primitives::{Activation, PassConfig};
use std::time::Instant;

pub(crate) fn tune_conv(args: &[String]) {
    use brgemm_primitives::{Conv, ConvParams, ConvTuning};
    let r = num(args, "--r", 3);
    let p = ConvParams::new(
        num(args, "--n", 8),
        num(args, "--c", 64),
        num(args, "--k", 64),
        num(args, "--h", 56),
        num(args, "--w", 56),
        r,
        num(args, "--s", r),
    )
    .stride(num(args, "--stride", 1))
    .pad(num_or_zero(args, "--pad", r / 2));
    p.validate().unwrap_or_else(|e| fail(&e.to_string()));
    let Setup {
        threads,
        quick,
        out_dir,
        pool,
        peak,
        probes,
    } = setup(args, &format!("conv {p:?}"));
    let heur = ConvTuning::heuristic(&p);
    let cands = |x: usize| -> Vec<usize> {
        let mut v: Vec<usize> = [16usize, 32, 64].into_iter().filter(|b| *b <= x).collect();
        if v.is_empty() || quick {
            v = vec![heur.bc.min(x).max(1)];
        }
        v
    };
    let (bcs, bks) = (cands(p.c), if quick { vec![heur.bk] } else { cands(p.k) });
    let bqs: Vec<usize> = if quick {
        vec![heur.bq]
    } else {
        let mut v = vec![heur.bq, 14, 28];
        v.dedup();
        v
    };
    // The layer's letters (docs/loop-specs.md): a images, b K, c C blocks,
    // d rows, e pixel blocks, f, g filter taps.
    let fwd_specs = ["ABdec", "BAdec", "ABDEc", "BADEc", "aBdec"];
    // Backward-data reduces over b and writes c: the forward specs with b
    // and c swapped.
    let bwd_specs = ["ACdeb", "CAdeb", "ACDEb", "CADEb", "aCdeb"];
    let upd_specs = ["aBCFG", "BCFGa", "aBCfg"];
    let samples = if quick { 3 } else { 5 };
    let mut rows: Vec<Row> = vec![];
    let t0 = Instant::now();
    for &bc in &bcs {
        for &bk in &bks {
            for &bq in &bqs {
                let base = ConvTuning {
                    bc,
                    bk,
                    bq,
                    ..heur.clone()
                };
                let c0 = Conv::with_tuning(p, Activation::Relu, base.clone()).expect("plan");
                let mut x = c0.x_tensor();
                fill(x.data_mut(), 7, 8.0);
                let mut w = c0.filter();
                fill(w.data_mut(), 5, 64.0);
                let bias = vec![0.0f32; c0.padded_k()];
                let (mut y, mut dz, mut dx, mut dw, mut wt) = (
                    c0.y_tensor(),
                    c0.y_tensor(),
                    c0.x_tensor(),
                    c0.filter(),
                    c0.filter_t(),
                );
                fill(dz.data_mut(), 3, 4.0);
                c0.transpose_filter(&pool, &w, &mut wt).unwrap();
                let mut db = vec![0.0f32; c0.padded_k()];
                let mut configs: Vec<(&'static str, PassConfig)> = vec![];
                for spec in fwd_specs {
                    for chunk in [0, 1] {
                        configs.push((
                            "fwd",
                            PassConfig {
                                chunk,
                                ..PassConfig::spec(spec)
                            },
                        ));
                    }
                }
                for spec in &bwd_specs {
                    configs.push(("bwd", PassConfig::spec(spec)));
                }
                for spec in upd_specs {
                    for chunk in [0, 4, 32] {
                        configs.push((
                            "upd",
                            PassConfig {
                                chunk,
                                ..PassConfig::spec(spec)
                            },
                        ));
                    }
                }
                for (pass, pc) in configs {
                    let mut t = base.clone();
                    match pass {
                        "fwd" => t.fwd = pc.clone(),
                        "bwd" => t.bwd = pc.clone(),
                        _ => t.upd = pc.clone(),
                    }
                    let Ok(conv) = Conv::with_tuning(p, Activation::Relu, t) else {
                        continue;
                    };
                    let tm = measure_pool(
                        || match pass {
                            "fwd" => conv.forward(&pool, &x, &w, &bias, &mut y).unwrap(),
                            "bwd" => conv.backward_data(&pool, &dz, &wt, &mut dx).unwrap(),
                            _ => conv
                                .backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                                .unwrap(),
                        },
                        &pool,
                        &probes,
                        samples,
                    );
                    let secs = tm.secs;
                    let gflops = conv.flops() / secs / 1e9;
                    eprint!(
                        "\r{:5.1}s  {pass} bc={bc} bk={bk} bq={bq} {:6} chunk={:2}: {gflops:6.1} GFLOP/s   ",
                        t0.elapsed().as_secs_f64(),
                        pc.spec,
                        pc.chunk
                    );
                    rows.push(Row {
                        pass,
                        bn: bq,
                        bc,
                        bk,
                        spec: pc.spec,
                        chunk: pc.chunk,
                        secs,
                        gflops,
                        pct: tm.pct_peak(gflops),
                        pct_tile: tm.pct_tile_l1(gflops),
                    });
                }
            }
        }
    }
    eprintln!();
    let mut best = heur.clone();
    for pass in ["fwd", "bwd", "upd"] {
        let r = print_ranked(&rows, pass, pass, "bq", 8);
        if let Some(top) = r.first() {
            if pass == "fwd" {
                (best.bc, best.bk, best.bq) = (top.bc, top.bk, top.bn);
            }
            let pc = PassConfig {
                chunk: top.chunk,
                ..PassConfig::spec(&top.spec)
            };
            match pass {
                "fwd" => best.fwd = pc,
                "bwd" => best.bwd = pc,
                _ => best.upd = pc,
            }
        }
    }
    let stem = format!(
        "tune_conv_n{}_c{}_k{}_h{}_w{}_r{}_s{}_u{}_t{threads}",
        p.n, p.c, p.k, p.h, p.w, p.r, p.s, p.stride_h
    );
    write_results(
        &out_dir,
        &stem,
        "bq",
        &rows,
        peak,
        &format!(
            "conv {}x{}x{}x{} k{} {}x{}/{}, {threads} thread(s)",
            p.n, p.c, p.h, p.w, p.k, p.r, p.s, p.stride_h
        ),
    );
    println!("best per pass by %tile (blocking from the best forward): {best:?}\nheuristic default: {heur:?}");
}
