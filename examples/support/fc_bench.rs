//! `bench fc`: the FC passes (forward, backward-data with and without
//! the weight transpose, backward-weights), the fused optimizer step, the
//! layer's whole training step, and the bf16 passes on the same shapes.

use super::{alternate, scaling, speedup_field, Opts};
use crate::fill::fill;
use crate::workload::{measure_pool, Measured, Probes};
use brgemm::Isa;
use brgemm_primitives::Pool;
use std::time::Duration;

pub(crate) fn bench_fc(o: &Opts) {
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
                let (mut w0, mut w1) = (weights(&fc, &w), weights(&fc, &w));
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
                // `vs_f32`: the median ratio of f32 to bf16 seconds over
                // pairs run alternately (a bf16 plan that runs the f32 pass
                // reads about 1.0; separate timings moved 20% apart).
                let bline = |pass: &str, m: &Measured, s_conv: f64, vs_f32: f64| {
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
                        vs_f32,
                        100.0 * gf / peak
                    );
                };
                // The bf16 side's own outputs (the two closures live
                // together), from the layer's layouts: a clone of dW would
                // lose the huge pages the f32 side's dW has (x0.80-0.95 on
                // the same f32 pass at 4096 features).
                let (mut y2, mut dx2, mut dw2) = (fc.y_layout(), fc.x_layout(), fc.w_layout());
                let mut db2 = db.clone();
                let (_, _, f32_fwd) = alternate(
                    samples.max(5),
                    &mut || fc.forward(&pool, &x, &w, &bias, &mut y, None).unwrap(),
                    &mut || fb.forward(&pool, &xb, &wv, &bias, &mut y2, None).unwrap(),
                );
                let mb = measure_pool(
                    || fb.forward(&pool, &xb, &wv, &bias, &mut y, None).unwrap(),
                    &pool,
                    &probe,
                    samples,
                );
                let sc = measure_pool(
                    || {
                        fb.pack_weights(&pool, &w, &mut wv, &mut wtv).unwrap();
                        to_bf16(&pool, x.data(), &mut xb);
                        fb.forward(&pool, &xb, &wv, &bias, &mut y, None).unwrap()
                    },
                    &pool,
                    &probe,
                    samples,
                )
                .secs;
                bline("fwd", &mb, sc, f32_fwd);
                let (_, _, f32_bwd) = alternate(
                    samples.max(5),
                    &mut || fc.backward_data(&pool, &dz, &w, &mut dzt, &mut dx).unwrap(),
                    &mut || fb.backward_data(&pool, &dzb, &wtv, &mut dx2).unwrap(),
                );
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
                let (_, _, f32_upd) = alternate(
                    samples.max(5),
                    &mut || {
                        fc.backward_weights(&pool, &dz, &x, &mut dw, &mut db)
                            .unwrap()
                    },
                    &mut || {
                        fb.backward_weights(&pool, &fc, &dz, &x, &mut dw2, &mut db2)
                            .unwrap()
                    },
                );
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
                // `step_isa`: the fused step's kernel (f32 where the policy
                // keeps it so); `layer_runs_bf16`: whether a mixed-precision
                // network with fused steps runs this layer in bf16 at all.
                let opt = Optimizer::adam(1e-5);
                let mut s = [
                    OptState::default(),
                    OptState::default(),
                    OptState::default(),
                ];
                let [s0, s1, s2] = &mut s;
                // Each variant its own buffers (the closures live together);
                // weights and their packed copies as the layer allocates
                // them (huge pages), not as clones (small pages).
                let bufs = || (weights(&fc, &w), y.clone(), dx.clone(), db.clone());
                let ((mut w0, mut y0, mut dx0, mut db0), mut dw0) = (bufs(), weights(&fc, &dw));
                let ((mut w1, mut y1, mut dx1, mut db1), mut dzt2) = (bufs(), dzt.clone());
                let (mut w2, mut y2, mut dx2, mut db2) = bufs();
                let (mut wv1, mut wtv1, mut xb1, mut dzb1) =
                    (new(), new(), xb.clone(), dzb.clone());
                fb.pack_weights(&pool, &w1, &mut wv1, &mut wtv1).unwrap();
                let mut unfused = || {
                    fb.pack_weights(&pool, &w0, &mut wv, &mut wtv).unwrap();
                    to_bf16(&pool, x.data(), &mut xb);
                    fb.forward(&pool, &xb, &wv, &bias, &mut y0, None).unwrap();
                    to_bf16(&pool, dz.data(), &mut dzb);
                    fb.backward_data(&pool, &dzb, &wtv, &mut dx0).unwrap();
                    fb.backward_weights(&pool, &fc, &dz, &x, &mut dw0, &mut db0)
                        .unwrap();
                    s0.step_on(&pool, &opt, w0.data_mut(), dw0.data());
                };
                let mut fused = || {
                    to_bf16(&pool, x.data(), &mut xb1);
                    fb.forward(&pool, &xb1, &wv1, &bias, &mut y1, None).unwrap();
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
                    r#"{{"bench":"fc","pass":"step","dtype":"bf16","opt":"adam","n":{n},"c":{c},"k":{k},"isa":"{}","step_isa":"{}","threads":{threads},"ms":{:.3},"unfused_ms":{:.3},"vs_unfused":{r:.2},"f32_ms":{:.3},"ms_again":{:.3},"vs_f32":{rf:.2},"layer_runs_bf16":{}}}"#,
                    fb.isa().name(),
                    fb.step_isa().map_or("fp32 pass", |i| i.name()),
                    b * 1e3,
                    a * 1e3,
                    f * 1e3,
                    b2 * 1e3,
                    fb.pays(true),
                );
            }
        }
        drop(x);
    }
}

/// A copy of the weights (or weight gradient) `w` in the layer's own
/// layout, on the huge pages the layer gives its weights: a clone would sit
/// on small pages and time differently (bc0f252).
fn weights(
    fc: &brgemm_primitives::Fc,
    w: &brgemm_primitives::layout::Blocked,
) -> brgemm_primitives::layout::Blocked {
    let mut c = fc.w_layout();
    c.data_mut().copy_from_slice(w.data());
    c
}
