//! Mixed bf16 precision on the layer graph (`Graph::set_bf16`): bf16
//! operands in the linear and convolution layers' forward and
//! backward-data passes (convolutions where bf16 beats f32 here), f32
//! master weights, weight gradients and optimizer. Run once per bf16 kernel
//! by `scripts/test.sh` (`BRGEMM_BF16_ISA`).

use brgemm_nn::models::{mlp, CnnSpec, LayerSpec, StageSpec};
use brgemm_nn::{Graph, GraphBuilder, Linear, Shape, Tensor};
use brgemm_primitives::{Activation, Optimizer, Pool};

mod support;
use support::Lcg;

fn specs(hidden: usize, classes: usize) -> [LayerSpec; 2] {
    [
        LayerSpec {
            out: hidden,
            act: Activation::Relu,
        },
        LayerSpec {
            out: classes,
            act: Activation::Identity,
        },
    ]
}

/// Samples whose class is the arg max of their first `classes` features.
fn toy(n: usize, c: usize, classes: usize) -> (Tensor, Vec<usize>) {
    let x = Lcg(9).tensor(Shape::flat(n, c));
    let labels = x
        .data()
        .chunks(c)
        .map(|r| (0..classes).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap())
        .collect();
    (x, labels)
}

/// Whether `BRGEMM_BF16_ISA` names a kernel: layers then run it whatever
/// its speed (`Bf16Isa::beats_f32`).
fn forced() -> bool {
    std::env::var("BRGEMM_BF16_ISA").is_ok_and(|v| !v.trim().is_empty())
}

/// Whether the AVX512-BF16 kernel runs here and the CPU policy measured it
/// faster than f32 (Zen 4): layers whose blocks AMX cannot take run bf16
/// on it.
fn avx512bf16_pays() -> bool {
    use brgemm::bf16::Bf16Isa;
    Bf16Isa::Avx512Bf16.is_supported() && Bf16Isa::Avx512Bf16.beats_f32()
}

/// Whether a convolution of `flops_per_elem` forward flops per input and
/// output element, too narrow for AMX, runs bf16 here: on AVX512-BF16 where
/// the CPU policy measured it faster than f32 for layers of that much work
/// (Zen 4: 64 flops and up).
fn avx512bf16_pays_for_conv(flops_per_elem: f64) -> bool {
    use brgemm::bf16::Bf16Isa;
    let isa = Bf16Isa::Avx512Bf16;
    isa.is_supported()
        && brgemm::policy()
            .unwrap()
            .bf16_conv_pays(isa, flops_per_elem)
}

/// The linear layers that run bf16, each on a kernel that beats f32 here
/// (or was forced).
fn linears_in_bf16(g: &Graph) -> usize {
    let isas: Vec<_> = g
        .layers_of::<Linear>()
        .iter()
        .filter_map(|l| l.bf16_isa())
        .collect();
    assert!(isas.iter().all(|i| i.beats_f32()), "{isas:?}");
    isas.len()
}

/// |a - b| and |a| (Euclidean).
fn diff_and_norm(a: &[f32], b: &[f32]) -> (f32, f32) {
    let sq = |it: &mut dyn Iterator<Item = f32>| it.map(|v| v * v).sum::<f32>().sqrt();
    (
        sq(&mut a.iter().zip(b).map(|(p, q)| p - q)),
        sq(&mut a.iter().copied()),
    )
}

fn train(g: &mut Graph, pool: &Pool, x: &Tensor, labels: &[usize], steps: usize) -> f32 {
    let opt = Optimizer::adam(1e-2);
    let mut last = 0.0;
    for _ in 0..steps {
        last = g.train_step(pool, x, labels, &opt).unwrap();
    }
    last
}

#[test]
fn a_bf16_mlp_trains_like_the_f32_one() {
    let pool = Pool::new(2).unwrap().always_parallel();
    let (n, c, classes) = (64, 32, 4);
    let (x, labels) = toy(n, c, classes);
    let mut losses = vec![];
    for bf in [false, true] {
        let mut g = mlp(c, n, &specs(64, classes), 5).unwrap();
        let on = g.set_bf16(bf).unwrap();
        assert_eq!(on, if bf { linears_in_bf16(&g) } else { 0 });
        if forced() {
            assert_eq!(on, if bf { 2 } else { 0 });
        }
        let isa = g.layers_of::<Linear>()[0].bf16_isa();
        losses.push(train(&mut g, &pool, &x, &labels, 80));
        let pred = g.predict(&pool, &x).unwrap();
        let acc = pred.iter().zip(&labels).filter(|(p, l)| p == l).count() as f64 / n as f64;
        assert!(acc > 0.95, "bf16 {bf} ({isa:?}): accuracy {acc}");
    }
    assert!(
        losses.iter().all(|&l| l < 0.1),
        "losses f32/bf16 {losses:?}"
    );
}

/// The fused step in bf16 (`set_fused_update`: each linear layer's weight
/// gradient stepped from L1, the next step's bf16 weights packed in the
/// same pass) trains bit for bit as the separate step and packing do, for
/// SGD with momentum and Adam; the layers do run bf16 where the kernel
/// pays here (64 rows), and no weight gradient is stored whole.
#[test]
fn the_fused_bf16_step_packs_the_weights_the_forward_would() {
    let pool = Pool::new(2).unwrap().always_parallel();
    let (n, c, classes) = (64, 96, 5);
    let (x, labels) = toy(n, c, classes);
    for opt in [
        Optimizer::Sgd {
            lr: 0.05,
            momentum: 0.9,
        },
        Optimizer::adam(1e-2),
    ] {
        let net = || {
            let mut g = mlp(c, n, &specs(128, classes), 6).unwrap();
            let on = g.set_bf16(true).unwrap();
            assert_eq!(on, linears_in_bf16(&g));
            if forced() || avx512bf16_pays() {
                assert_eq!(on, 2, "{opt:?}");
            }
            g
        };
        let data = (&x, &labels[..]);
        support::fused_steps_match((net(), net()), &pool, data, &opt, true, "bf16 mlp");
    }
}

/// The fused step packs the bf16 weights as it steps them (no packing
/// pass), so a bf16 linear layer pays from fewer rows there
/// (`Policy::avx512bf16_fc_min_rows_fused`, Zen 4: 48 against 64):
/// `set_fused_update` plans the layers again by that rule, and back; the
/// graph then trains on the new plans (its moments started afresh).
#[test]
fn fused_steps_plan_bf16_linear_layers_by_their_own_row_limit() {
    use brgemm::bf16::Bf16Isa;
    let pool = Pool::new(2).unwrap();
    let (n, c, classes) = (48, 96, 5);
    let (x, labels) = toy(n, c, classes);
    let mut g = mlp(c, n, &specs(128, classes), 6).unwrap();
    g.set_bf16(true).unwrap();
    let unfused = linears_in_bf16(&g);
    train(&mut g, &pool, &x, &labels, 2);
    g.set_fused_update(true).unwrap();
    let fused = linears_in_bf16(&g);
    let loss = train(&mut g, &pool, &x, &labels, 3);
    assert!(loss.is_finite(), "{loss}");
    g.set_fused_update(false).unwrap();
    assert_eq!(linears_in_bf16(&g), unfused);
    assert!(fused >= unfused, "{fused} fused, {unfused} unfused");
    // Where AVX512-BF16 is the kernel these blocks get, the policy's rule
    // decides both counts.
    let isa = Bf16Isa::Avx512Bf16;
    if !forced() && isa.is_supported() && !Bf16Isa::Amx.is_supported() {
        let policy = brgemm::policy().unwrap();
        let want = |f: bool| 2 * usize::from(policy.bf16_fc_pays(isa, n, f));
        assert_eq!((unfused, fused), (want(false), want(true)));
    }
}

/// A layer says its plan changed (and the graph then restarts the
/// optimizer's moments) only where its precision did: at rows where bf16
/// pays with and without the fused step, the flag changes nothing.
#[test]
fn a_linear_layer_reports_a_new_plan_only_where_its_precision_changed() {
    use brgemm_nn::Layer;
    for rows in [16, 48, 128] {
        let mut l = Linear::new(256, 256, Activation::Relu, 1);
        l.build(Shape::flat(rows, 256)).unwrap();
        assert!(l.set_bf16(true).is_ok());
        for on in [true, false, false] {
            let before = l.bf16_isa();
            let changed = l.plan_fused_update(on).unwrap();
            assert_eq!(changed, l.bf16_isa() != before, "{rows} rows, fused {on}");
        }
    }
}

#[test]
fn bf16_gradients_are_the_f32_ones_to_bf16_rounding() {
    let pool = Pool::new(2).unwrap();
    let (n, c, classes) = (32, 48, 6);
    let (x, labels) = toy(n, c, classes);
    let grads = |bf: bool| {
        let mut g = mlp(c, n, &specs(40, classes), 3).unwrap();
        g.set_bf16(bf).unwrap();
        let loss = g
            .compute_gradients_with(&pool, &x, &labels, &mut |_, _| {})
            .unwrap();
        let gs: Vec<(Vec<f32>, Vec<f32>)> = g
            .layers_of::<Linear>()
            .iter()
            .map(|l| l.gradients())
            .collect();
        (loss, gs)
    };
    let (l32, g32) = grads(false);
    let (l16, g16) = grads(true);
    assert!((l32 - l16).abs() < 1e-2 * l32.abs(), "loss {l32} vs {l16}");
    for (i, ((w32, b32), (w16, b16))) in g32.iter().zip(&g16).enumerate() {
        for (what, a, b) in [("dW", w32, w16), ("db", b32, b16)] {
            let (diff, norm) = diff_and_norm(a, b);
            // bf16 keeps 8 bits of mantissa: a few parts in a thousand per
            // operand, more after a backward-data pass.
            assert!(
                diff <= 3e-2 * norm,
                "layer {i} {what}: |diff| {diff}, |grad| {norm}"
            );
        }
    }
}

#[test]
fn a_cnn_head_runs_in_bf16_on_the_convolutions_blocked_output() {
    let pool = Pool::new(2).unwrap();
    let stage = |channels| StageSpec {
        channels,
        kernel: 3,
        batchnorm: false,
        pool: 2,
    };
    let spec = CnnSpec {
        input: (2, 8, 8),
        stages: vec![stage(8)],
        hidden: vec![16],
        classes: 3,
        dropout: 0.0,
    };
    let x = Lcg(2).tensor(Shape::new(8, 2, 8, 8));
    let labels = [0, 1, 2, 0, 1, 2, 0, 1];
    let out = |bf: bool| {
        let mut g = spec.graph(8, 4).unwrap();
        // The convolution (8 output channels) has no AMX blocks: it runs
        // bf16 on a kernel forced by name, or on AVX512-BF16 where that
        // beats f32 on a layer of its work per activation element
        // (2 -> 8 channels, 3x3, 8x8 pixels: 2 * 2 * 8 * 9 / (2 + 8)).
        let on = g.set_bf16(bf).unwrap();
        let conv = usize::from(forced() || avx512bf16_pays_for_conv(28.8));
        assert_eq!(on, if bf { linears_in_bf16(&g) + conv } else { 0 });
        if forced() {
            assert_eq!(on, if bf { 3 } else { 0 });
        }
        let l = g
            .compute_gradients_with(&pool, &x, &labels, &mut |_, _| {})
            .unwrap();
        let y = g.predict(&pool, &x).unwrap();
        (l, y)
    };
    let (l32, _) = out(false);
    let (l16, _) = out(true);
    assert!((l32 - l16).abs() < 2e-2 * l32.abs(), "loss {l32} vs {l16}");
}

#[test]
fn gelu_refuses_bf16_by_name_and_f32_comes_back_exactly() {
    let mut b = GraphBuilder::new(Shape::flat(4, 8));
    let h = b
        .layer(b.input(), Linear::new(8, 16, Activation::Gelu, 1))
        .unwrap();
    let mut g = b.build(h).unwrap();
    let e = g.set_bf16(true).err().unwrap().to_string();
    assert!(e.contains("linear 8->16") && e.contains("Gelu"), "{e}");

    // On, then off again: the f32 passes give the fresh f32 graph's loss.
    let pool = Pool::new(1).unwrap();
    let (x, labels) = toy(16, 24, 5);
    let loss = |g: &mut Graph| {
        g.compute_gradients_with(&pool, &x, &labels, &mut |_, _| {})
            .unwrap()
    };
    let mut a = mlp(24, 16, &specs(32, 5), 7).unwrap();
    let mut b = mlp(24, 16, &specs(32, 5), 7).unwrap();
    b.set_bf16(true).unwrap();
    loss(&mut b);
    b.set_bf16(false).unwrap();
    assert_eq!(loss(&mut a), loss(&mut b));
}

/// Convolutions run bf16 where a bf16 kernel beats f32 on this CPU (AMX:
/// 32-channel blocks, 8-pixel rows as the kernel's column tails), with
/// gradients the f32 ones to bf16 rounding; elsewhere they stay f32 and the
/// count says so. Identity activations: behind a ReLU, bf16 rounding flips
/// the units near zero, which moves a gradient by the square root of their
/// share (2-7% measured here), not by the rounding; here 0.1-1.1%.
#[test]
fn convolutions_run_bf16_where_it_pays_with_f32_gradients_to_rounding() {
    use brgemm::bf16::Bf16Isa;
    use brgemm_nn::Conv2d;
    let pool = Pool::new(2).unwrap().always_parallel();
    let x = Lcg(5).tensor(Shape::new(4, 32, 8, 8));
    let labels = [0, 1, 2, 1];
    let amx = Bf16Isa::Amx.is_supported()
        && std::env::var("BRGEMM_BF16_ISA").map_or(true, |v| v.trim().is_empty() || v == "amx");
    let grads = |bf: bool| {
        let mut b = GraphBuilder::new(Shape::new(4, 32, 8, 8));
        let id = Activation::Identity;
        let c1 = b
            .layer(b.input(), Conv2d::new(32, 32, (3, 3), 1, 1, id, 1))
            .unwrap();
        let c2 = b
            .layer(c1, Conv2d::new(32, 64, (3, 3), 1, 1, id, 2))
            .unwrap();
        let out = b.layer(c2, Linear::new(64 * 64, 3, id, 3)).unwrap();
        let mut g = b.build(out).unwrap();
        let n = g.set_bf16(bf).unwrap();
        // 288 and 384 flops per activation element: past the policy's bar.
        let convs = if amx || forced() || avx512bf16_pays_for_conv(288.0) {
            2
        } else {
            0
        };
        let on = if bf { linears_in_bf16(&g) + convs } else { 0 };
        assert_eq!(n, on, "layers in bf16");
        let loss = g
            .compute_gradients_with(&pool, &x, &labels, &mut |_, _| {})
            .unwrap();
        // The head's in plain order (its blocking follows the precision);
        // the convolutions' blocked (the same in both).
        let (w, b) = g.layers_of::<Linear>()[0].gradients();
        let mut gs = vec![w, b];
        let ps = g.params();
        gs.extend(ps.into_iter().skip(2).map(|p| p.grad.to_vec()));
        (loss, gs)
    };
    let (l32, g32) = grads(false);
    let (l16, g16) = grads(true);
    assert!((l32 - l16).abs() < 1e-2 * l32.abs(), "loss {l32} vs {l16}");
    assert_eq!(g32.len(), 6);
    for (i, (a, b)) in g32.iter().zip(&g16).enumerate() {
        let (diff, norm) = diff_and_norm(a, b);
        assert!(
            diff <= 3e-2 * norm,
            "parameter {i}: |diff| {diff}, |grad| {norm}"
        );
    }
}

/// A recurrent layer switches to bf16 where its kernel beats f32 (planned
/// again with blocks of 32: 28 features padded to one block), trains with
/// gradients near the f32 ones, and switching back gives the f32 graph's
/// loss exactly.
#[test]
fn recurrent_layers_switch_to_bf16_and_back() {
    use brgemm::bf16::Bf16Isa;
    use brgemm_nn::Recurrent;
    let pool = Pool::new(2).unwrap();
    let (n, feats, steps, hidden) = (8, 28, 5, 32);
    let x = Lcg(7).tensor(Shape::new(n, feats, steps, 1));
    let labels = [0, 1, 2, 0, 1, 2, 0, 1];
    let graph = || {
        let mut b = GraphBuilder::new(Shape::new(n, feats, steps, 1));
        let h = b
            .layer(b.input(), Recurrent::lstm(feats, hidden, 3).last_only())
            .unwrap();
        let out = b
            .layer(h, Linear::new(hidden, 3, Activation::Identity, 4))
            .unwrap();
        b.build(out).unwrap()
    };
    let loss = |g: &mut Graph| {
        g.compute_gradients_with(&pool, &x, &labels, &mut |_, _| {})
            .unwrap()
    };
    let mut a = graph();
    let la = loss(&mut a);
    let mut b = graph();
    let on = b.set_bf16(true).unwrap();
    let lstm_on = forced() || Bf16Isa::Amx.is_supported() || avx512bf16_pays();
    assert_eq!(on, usize::from(lstm_on) + linears_in_bf16(&b));
    let lb = loss(&mut b);
    assert!(
        (la - lb).abs() < 1e-2 * la.abs(),
        "loss f32 {la} vs bf16 {lb}"
    );
    b.set_bf16(false).unwrap();
    assert_eq!(loss(&mut b), la);
}

/// Inference folds a batch norm into the convolution before it; where the
/// layer runs bf16 the folded convolution does too, and the outputs stay
/// within bf16 rounding of f32's.
#[test]
fn folded_convolutions_infer_in_bf16_near_f32() {
    use brgemm_nn::Mode;
    let pool = Pool::new(2).unwrap();
    let stage = |channels| StageSpec {
        channels,
        kernel: 3,
        batchnorm: true,
        pool: 1,
    };
    let spec = CnnSpec {
        input: (32, 8, 8),
        stages: vec![stage(32), stage(64)],
        hidden: vec![],
        classes: 3,
        dropout: 0.0,
    };
    let x = Lcg(3).tensor(Shape::new(4, 32, 8, 8));
    let labels = [0, 1, 2, 1];
    let out = |bf: bool| {
        let mut g = spec.graph(4, 5).unwrap();
        g.set_bf16(bf).unwrap();
        // One step so the batch norms hold statistics to fold.
        g.train_step(&pool, &x, &labels, &Optimizer::adam(1e-3))
            .unwrap();
        g.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec()
    };
    let (y32, y16) = (out(false), out(true));
    let (diff, norm) = diff_and_norm(&y32, &y16);
    assert!(diff <= 3e-2 * norm, "|diff| {diff}, |y| {norm}");
}

/// Inference after every training step folds the current weights and
/// statistics: in bf16 the folded filter is packed again each time. A
/// graph built without fusions (no folds) is the reference.
#[test]
fn bf16_folds_follow_the_weights_step_after_step() {
    use brgemm_nn::{BatchNorm2d, Conv2d, GlobalAvgPool, Mode, Relu};
    let pool = Pool::new(2).unwrap();
    let s = Shape::new(4, 32, 8, 8);
    let x = Lcg(12).tensor(s);
    let labels = [0, 1, 2, 1];
    let net = |fuse: bool| {
        let id = Activation::Identity;
        let mut b = GraphBuilder::new(s);
        let c1 = b.layer(b.input(), Conv2d::new(32, 64, (3, 3), 1, 1, id, 7));
        let n1 = b.layer(c1.unwrap(), BatchNorm2d::new(64)).unwrap();
        let r1 = b.layer(n1, Relu::new()).unwrap();
        let c2 = b.layer(r1, Conv2d::new(64, 64, (3, 3), 1, 1, id, 8));
        let n2 = b.layer(c2.unwrap(), BatchNorm2d::new(64)).unwrap();
        let p = b.layer(n2, GlobalAvgPool::new()).unwrap();
        let out = b.layer(p, Linear::new(64, 3, id, 9)).unwrap();
        let mut g = b.fuse(fuse).build(out).unwrap();
        g.set_bf16(true).unwrap();
        g
    };
    let (mut folded, mut plain) = (net(true), net(false));
    let opt = Optimizer::Sgd {
        lr: 0.5,
        momentum: 0.0,
    };
    let mut before: Option<Vec<f32>> = None;
    for step in 0..3 {
        folded.train_step(&pool, &x, &labels, &opt).unwrap();
        plain.train_step(&pool, &x, &labels, &opt).unwrap();
        let yf = folded
            .forward(&pool, &x, Mode::Eval)
            .unwrap()
            .data()
            .to_vec();
        let yp = plain
            .forward(&pool, &x, Mode::Eval)
            .unwrap()
            .data()
            .to_vec();
        let (diff, norm) = diff_and_norm(&yf, &yp);
        assert!(
            diff <= 3e-2 * norm,
            "step {step}: |diff| {diff}, |y| {norm}"
        );
        // The steps move the outputs by more than that, so a fold of the
        // last step's weights would fail above.
        if let Some(b) = &before {
            let (moved, _) = diff_and_norm(b, &yp);
            assert!(
                moved > 1e-1 * norm,
                "step {step}: moved {moved}, |y| {norm}"
            );
        }
        before = Some(yp);
    }
}

/// A residual CNN block and an MLP head in bf16: batch norm hands its
/// output (to a 1x1 convolution, which reads it in place) and its input
/// gradient (to a 1x1 convolution's backward-data) over in bf16, and the
/// first linear layer its output to the second; each reader then rounds
/// nothing itself. Training with the handoffs gives the bits of training
/// without them (both round to nearest even), step after step.
#[test]
fn bf16_handoffs_between_layers_change_no_bit() {
    use brgemm_nn::{BatchNorm2d, Conv2d, GlobalAvgPool, Relu};
    let pool = Pool::new(2).unwrap().always_parallel();
    let s = Shape::new(4, 32, 8, 8);
    let x = Lcg(8).tensor(s);
    let labels = [0, 1, 2, 1];
    let net = || {
        let id = Activation::Identity;
        let mut b = GraphBuilder::new(s);
        let c1 = b.layer(b.input(), Conv2d::new(32, 64, (1, 1), 1, 0, id, 1));
        let n1 = b.layer(c1.unwrap(), BatchNorm2d::new(64)).unwrap();
        let r1 = b.layer(n1, Relu::new()).unwrap();
        let c2 = b.layer(r1, Conv2d::new(64, 64, (1, 1), 1, 0, id, 2));
        let n2 = b.layer(c2.unwrap(), BatchNorm2d::new(64)).unwrap();
        let j = b.add(n2, r1).unwrap();
        let j = b.layer(j, Relu::new()).unwrap();
        let c3 = b.layer(j, Conv2d::new(64, 64, (3, 3), 1, 1, id, 3));
        let n3 = b.layer(c3.unwrap(), BatchNorm2d::new(64)).unwrap();
        let r3 = b.layer(n3, Relu::new()).unwrap();
        let p = b.layer(r3, GlobalAvgPool::new()).unwrap();
        let h = b.layer(p, Linear::new(64, 64, Activation::Relu, 4));
        let out = b.layer(h.unwrap(), Linear::new(64, 3, id, 5)).unwrap();
        let mut g = b.build(out).unwrap();
        g.set_bf16(true).unwrap();
        g
    };
    let (mut on, mut off) = (net(), net());
    // Outputs in bf16 alone round what batch norm sees: a test of their own.
    on.set_bf16_only_outputs(false);
    off.set_bf16_only_outputs(false);
    off.set_bf16_handoff(false);
    assert_eq!(off.bf16_handoffs(), 0);
    if forced() {
        // The first norm's output, the second's input gradient, the first
        // linear layer's output (the 3x3 layer pads what it reads; the
        // first convolution reads the graph's input).
        assert_eq!(on.bf16_handoffs(), 3);
    }
    let opt = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    for step in 0..3 {
        let a = on.train_step(&pool, &x, &labels, &opt).unwrap();
        let b = off.train_step(&pool, &x, &labels, &opt).unwrap();
        assert_eq!(a.to_bits(), b.to_bits(), "step {step}: loss {a} vs {b}");
    }
    let bits = |g: &mut Graph| -> Vec<u32> {
        g.params()
            .iter()
            .flat_map(|p| p.value.iter().map(|v| v.to_bits()))
            .collect()
    };
    assert_eq!(bits(&mut on), bits(&mut off));
    // Off again: nothing is handed over.
    on.set_bf16(false).unwrap();
    assert_eq!(on.bf16_handoffs(), 0);
}

/// A bf16 convolution whose only reader is a batch norm writes its output
/// in bf16 alone, which the batch norm reads in forward and backward
/// (with its fused ReLU, and with the residual join); one whose input
/// comes from a batch norm alone writes its input gradient in bf16 alone,
/// which the norm's backward reads: half the bytes on those edges.
/// Without ReLUs the gradients stay those of the graph that hands them
/// over in f32, to bf16 rounding (0.1-1.3% here; behind a ReLU the
/// rounding flips units near zero: 6% on a norm's scale, as in the test
/// above); a convolution that feeds a non-norm layer keeps f32;
/// inference, with the norms folded in, gives the same bits either way;
/// training brings the loss down.
#[test]
fn convolutions_write_bf16_alone_for_the_batch_norm_after_them() {
    use brgemm::bf16::Bf16Isa;
    use brgemm_nn::{BatchNorm2d, Conv2d, GlobalAvgPool, Mode, Relu};
    let pool = Pool::new(2).unwrap().always_parallel();
    let s = Shape::new(4, 32, 8, 8);
    let x = Lcg(9).tensor(s);
    let labels = [0, 1, 2, 1];
    let net = |alone: bool, relu: bool| {
        let id = Activation::Identity;
        let act = |b: &mut GraphBuilder, from| match relu {
            true => b.layer(from, Relu::new()).unwrap(),
            false => from,
        };
        let mut b = GraphBuilder::new(s);
        let c1 = b.layer(b.input(), Conv2d::new(32, 64, (3, 3), 1, 1, id, 1));
        let n1 = b.layer(c1.unwrap(), BatchNorm2d::new(64)).unwrap();
        let r1 = act(&mut b, n1);
        let c2 = b.layer(r1, Conv2d::new(64, 64, (3, 3), 1, 1, id, 2));
        let n2 = b.layer(c2.unwrap(), BatchNorm2d::new(64)).unwrap();
        let r2 = act(&mut b, n2);
        // Its input gradient goes to the second norm alone: bf16 too.
        let c4 = b.layer(r2, Conv2d::new(64, 64, (3, 3), 1, 1, id, 4));
        let n4 = b.layer(c4.unwrap(), BatchNorm2d::new(64)).unwrap();
        let j = b.add(n4, r1).unwrap();
        let j = act(&mut b, j);
        // Read by the pooling, not a norm: stays f32.
        let c3 = b.layer(j, Conv2d::new(64, 64, (3, 3), 1, 1, id, 3));
        let p = b.layer(c3.unwrap(), GlobalAvgPool::new()).unwrap();
        let out = b.layer(p, Linear::new(64, 3, id, 5)).unwrap();
        let mut g = b.build(out).unwrap();
        g.set_bf16(true).unwrap();
        g.set_bf16_only_outputs(alone);
        g
    };
    let amx = Bf16Isa::Amx.is_supported()
        && std::env::var("BRGEMM_BF16_ISA").map_or(true, |v| v.trim().is_empty() || v == "amx");
    // 576 flops per activation element: bf16 wherever a bf16 kernel runs.
    let convs_bf16 = amx || forced() || avx512bf16_pays_for_conv(576.0);
    let (mut on, mut off) = (net(true, false), net(false, false));
    assert_eq!(off.bf16_only_outputs(), 0);
    // Three outputs, one convolution's input gradient (the first one's
    // input is the graph's, the second's feeds the residual too); where
    // the convolutions update in bf16, the norms' input gradients for the
    // three before them and the second norm's output for the third.
    let alone = on.bf16_only_outputs();
    assert!(
        if convs_bf16 {
            (4..=8).contains(&alone)
        } else {
            alone == 0
        },
        "{alone}"
    );
    let grads = |g: &mut Graph| {
        let loss = g
            .compute_gradients_with(&pool, &x, &labels, &mut |_, _| {})
            .unwrap();
        let gs: Vec<Vec<f32>> = g.params().into_iter().map(|p| p.grad.to_vec()).collect();
        (loss, gs)
    };
    let (l_on, g_on) = grads(&mut on);
    let (l_off, g_off) = grads(&mut off);
    assert!(
        (l_on - l_off).abs() < 1e-2 * l_off.abs(),
        "loss {l_on} vs {l_off}"
    );
    assert_eq!(g_on.len(), 16);
    // (A convolution's bias before a norm has no gradient but rounding
    // noise: 1e-7, or 1e-4 summed from dZ in bf16 alone, against gradients
    // of 0.1-10.)
    for (i, (a, b)) in g_on.iter().zip(&g_off).enumerate() {
        let (diff, norm) = diff_and_norm(a, b);
        assert!(
            diff <= 3e-2 * norm + 1e-3,
            "parameter {i}: |diff| {diff}, |grad| {norm}"
        );
    }
    // With ReLUs (fused into the first norm, after the join of the
    // second): inference folds the norms into the convolutions, f32
    // outputs, the same bits; training brings the loss down.
    let (mut on, mut off) = (net(true, true), net(false, true));
    assert_eq!(on.bf16_only_outputs(), alone);
    let y_on = on.forward(&pool, &x, Mode::Eval).unwrap().clone();
    let y_off = off.forward(&pool, &x, Mode::Eval).unwrap().clone();
    assert_eq!(y_on.data(), y_off.data());
    let opt = Optimizer::Sgd {
        lr: 0.01,
        momentum: 0.9,
    };
    let (mut first, mut last) = (0.0, [0.0; 2]);
    for step in 0..15 {
        last = [
            on.train_step(&pool, &x, &labels, &opt).unwrap(),
            off.train_step(&pool, &x, &labels, &opt).unwrap(),
        ];
        if step == 0 {
            first = last[0];
        }
    }
    assert!(last[0] < 0.2 * first, "loss {first} -> {last:?}");
    assert!(last[1] < 0.2 * first, "loss {first} -> {last:?}");
    // Mixed precision off: no output in bf16 alone.
    on.set_bf16(false).unwrap();
    assert_eq!(on.bf16_only_outputs(), 0);
}
