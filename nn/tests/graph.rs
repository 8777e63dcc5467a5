//! The layer graph against finite differences and plain references, its
//! construction errors, and a small residual network that learns.

use brgemm::Activation;
use brgemm_nn::models::{mlp, CnnSpec, LayerSpec, StageSpec};
use brgemm_nn::{
    BatchNorm2d, Conv2d, Error, Flatten, GlobalAvgPool, Graph, GraphBuilder, Layer, Linear, Mode,
    Pool2dLayer, Relu, Shape, Tensor,
};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::Pool;

mod support;
use support::{check_gradients, check_gradients_eps, fused_steps_match, Lcg};

#[test]
fn conv_and_linear_chain_gradients_match_finite_differences() {
    let mut b = GraphBuilder::new(Shape::new(3, 3, 7, 7));
    let x = b.input();
    let c1 = b
        .layer(x, Conv2d::new(3, 5, (3, 3), 1, 1, Activation::Tanh, 1))
        .unwrap();
    let c2 = b
        .layer(c1, Conv2d::new(5, 4, (3, 3), 2, 1, Activation::Identity, 2))
        .unwrap();
    let f = b.layer(c2, Flatten::new()).unwrap();
    let out = b
        .layer(f, Linear::new(4 * 4 * 4, 6, Activation::Tanh, 3))
        .unwrap();
    check_gradients(b.build(out).unwrap(), 5, 12);
}

#[test]
fn residual_network_gradients_match_finite_differences() {
    // Two residual blocks (identity shortcut, then a 1x1 projection with
    // stride 2), global average pooling and a classifier.
    let mut b = GraphBuilder::new(Shape::new(2, 4, 6, 6));
    let x = b.input();
    let a = b
        .layer(x, Conv2d::new(4, 4, (3, 3), 1, 1, Activation::Tanh, 11))
        .unwrap();
    let a = b
        .layer(a, Conv2d::new(4, 4, (3, 3), 1, 1, Activation::Identity, 12))
        .unwrap();
    let s1 = b.add(a, x).unwrap();
    let c = b
        .layer(s1, Conv2d::new(4, 6, (3, 3), 2, 1, Activation::Tanh, 13))
        .unwrap();
    let c = b
        .layer(c, Conv2d::new(6, 6, (3, 3), 1, 1, Activation::Identity, 14))
        .unwrap();
    let proj = b
        .layer(
            s1,
            Conv2d::new(4, 6, (1, 1), 2, 0, Activation::Identity, 15),
        )
        .unwrap();
    let s2 = b.add(c, proj).unwrap();
    let p = b.layer(s2, GlobalAvgPool::new()).unwrap();
    let out = b
        .layer(p, Linear::new(6, 3, Activation::Identity, 16))
        .unwrap();
    let g = b.build(out).unwrap();
    assert_eq!(g.layer_names().len(), 7);
    check_gradients(g, 9, 10);
}

#[test]
fn batch_norm_and_pooling_gradients_match_finite_differences() {
    let mut b = GraphBuilder::new(Shape::new(3, 5, 6, 6));
    let x = b.input();
    let c = b
        .layer(x, Conv2d::new(5, 6, (3, 3), 1, 1, Activation::Identity, 21))
        .unwrap();
    let n = b.layer(c, BatchNorm2d::new(6)).unwrap();
    let t = b
        .layer(n, Conv2d::new(6, 6, (1, 1), 1, 0, Activation::Tanh, 22))
        .unwrap();
    let p = b.layer(t, Pool2dLayer::avg(3, 2, 1)).unwrap();
    let f = b.layer(p, Flatten::new()).unwrap();
    let out = b
        .layer(f, Linear::new(6 * 3 * 3, 4, Activation::Identity, 23))
        .unwrap();
    check_gradients(b.build(out).unwrap(), 31, 10);
}

#[test]
fn max_pooling_routes_the_gradient_to_the_maximum() {
    let pool = Pool::new(1).unwrap();
    let mut m = Pool2dLayer::max(2, 2, 0);
    let s = Shape::new(1, 1, 2, 4);
    assert_eq!(m.build(s).unwrap(), Shape::new(1, 1, 1, 2));
    let x = Tensor::from_vec(s, vec![1.0, 5.0, -1.0, -2.0, 3.0, 2.0, -3.0, -0.5]).unwrap();
    let y = m.forward(&pool, &x, Mode::Train).unwrap();
    assert_eq!(y.data(), &[5.0, -0.5]);
    let dy = Tensor::from_vec(y.shape(), vec![1.0, 2.0]).unwrap();
    let dx = m.backward(&pool, &dy).unwrap();
    assert_eq!(dx.data(), &[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]);
}

#[test]
fn relu_passes_gradients_where_positive_and_keeps_nan() {
    let pool = Pool::new(1).unwrap();
    let mut r = Relu::new();
    let s = Shape::flat(1, 4);
    assert_eq!(r.build(s).unwrap(), s);
    let x = Tensor::from_vec(s, vec![-1.0, 2.0, f32::NAN, 0.5]).unwrap();
    let y = r.forward(&pool, &x, Mode::Train).unwrap();
    assert_eq!(&y.data()[..2], &[0.0, 2.0]);
    assert!(y.data()[2].is_nan(), "a NaN input must not become 0");
    let dy = Tensor::from_vec(s, vec![1.0; 4]).unwrap();
    assert_eq!(
        r.backward(&pool, &dy).unwrap().data(),
        &[0.0, 1.0, 0.0, 1.0]
    );
}

/// PyTorch's layouts: Conv2d weight KCRS, Linear weight [out][in]. The
/// graph's output for imported weights equals a plain f64 evaluation of
/// the same formula.
#[test]
fn weights_in_pytorch_order_give_the_reference_output() {
    let (n, c, k, h, w) = (2, 3, 4, 5, 5);
    let mut rng = Lcg(77);
    let cw: Vec<f32> = (0..k * c * 9).map(|_| rng.next()).collect();
    let cb: Vec<f32> = (0..k).map(|_| rng.next()).collect();
    let lw: Vec<f32> = (0..2 * k * 9).map(|_| rng.next()).collect();
    let lb: Vec<f32> = vec![0.5, -0.25];
    let mut conv = Conv2d::new(c, k, (3, 3), 2, 1, Activation::Relu, 0);
    conv.set_weights(&cw, &cb).unwrap();
    let mut lin = Linear::new(k * 9, 2, Activation::Identity, 0);
    lin.set_weights(&lw, &lb).unwrap();
    let mut b = GraphBuilder::new(Shape::new(n, c, h, w));
    let x = b.input();
    let y = b.layer(x, conv).unwrap();
    let f = b.layer(y, Flatten::new()).unwrap();
    let out = b.layer(f, lin).unwrap();
    let mut g = b.build(out).unwrap();
    let xt = rng.tensor(Shape::new(n, c, h, w));
    let got = g.forward(&Pool::new(1).unwrap(), &xt, Mode::Eval).unwrap();
    // Reference: conv (stride 2, pad 1) + bias, ReLU, flatten NCHW, linear.
    let xs = xt.data();
    for ni in 0..n {
        let mut feat = vec![0.0f64; k * 9];
        for ki in 0..k {
            for p in 0..3 {
                for q in 0..3 {
                    let mut s = f64::from(cb[ki]);
                    for ci in 0..c {
                        for r in 0..3 {
                            for t in 0..3 {
                                let (yy, xx) = ((2 * p + r) as isize - 1, (2 * q + t) as isize - 1);
                                if yy < 0 || xx < 0 || yy >= h as isize || xx >= w as isize {
                                    continue;
                                }
                                let xv = xs[((ni * c + ci) * h + yy as usize) * w + xx as usize];
                                s += f64::from(cw[((ki * c + ci) * 3 + r) * 3 + t]) * f64::from(xv);
                            }
                        }
                    }
                    feat[(ki * 3 + p) * 3 + q] = s.max(0.0);
                }
            }
        }
        for o in 0..2 {
            let want: f64 = f64::from(lb[o])
                + (0..k * 9)
                    .map(|j| f64::from(lw[o * k * 9 + j]) * feat[j])
                    .sum::<f64>();
            let v = f64::from(got.data()[ni * 2 + o]);
            assert!(
                (v - want).abs() < 1e-4 * want.abs().max(1.0),
                "{ni},{o}: {v} vs {want}"
            );
        }
    }
}

#[test]
fn construction_errors_name_the_layer_and_the_shapes() {
    let mut b = GraphBuilder::new(Shape::new(2, 3, 8, 8));
    let x = b.input();
    let e = b
        .layer(x, Linear::new(190, 10, Activation::Identity, 0))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("linear 190->10") && e.contains("(2, 3, 8, 8)") && e.contains("192 features"),
        "{e}"
    );
    let e = b
        .layer(x, Conv2d::new(4, 8, (3, 3), 1, 1, Activation::Relu, 0))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("conv2d 3x3 4->8") && e.contains("3 channels, expected 4"),
        "{e}"
    );
    let a = b
        .layer(x, Conv2d::new(3, 8, (3, 3), 2, 1, Activation::Relu, 0))
        .unwrap();
    let e = b.add(a, x).err().unwrap();
    assert!(matches!(e, Error::Join { .. }));
    let e = e.to_string();
    assert!(
        e.contains("(2, 8, 4, 4)") && e.contains("(2, 3, 8, 8)"),
        "{e}"
    );
    // A filter larger than the padded input is refused when planned.
    let e = b
        .layer(x, Conv2d::new(3, 8, (11, 11), 1, 0, Activation::Relu, 0))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("conv2d 11x11"), "{e}");
    // A branch that does not reach the output would train on stale grads.
    let dead = b.layer(x, Relu::new()).unwrap();
    let f = b.layer(a, Flatten::new()).unwrap();
    let e = b.build(f).err().unwrap().to_string();
    assert!(e.contains("relu") && e.contains("does not reach"), "{e}");
    let _ = dead;
}

#[test]
fn wrong_inputs_and_order_are_errors() {
    let pool = Pool::new(1).unwrap();
    let mut b = GraphBuilder::new(Shape::flat(2, 3));
    let x = b.input();
    let out = b
        .layer(x, Linear::new(3, 2, Activation::Identity, 0))
        .unwrap();
    let mut g = b.build(out).unwrap();
    let e = g
        .backward(&pool, &Tensor::zeros(Shape::flat(2, 2)))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("before any forward"), "{e}");
    let e = g
        .forward(&pool, &Tensor::zeros(Shape::flat(3, 3)), Mode::Train)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("(2, 3, 1, 1)") && e.contains("(3, 3, 1, 1)"),
        "{e}"
    );
    let x = Tensor::zeros(Shape::flat(2, 3));
    let e = g
        .train_step(
            &pool,
            &x,
            &[0, 5],
            &Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.0,
            },
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("label 5"), "{e}");
    let e = g
        .train_step(
            &pool,
            &x,
            &[0, 1],
            &Optimizer::Sgd {
                lr: f32::NAN,
                momentum: 0.0,
            },
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("NaN"), "{e}");
}

/// A small residual network learns which quadrant of an 8x8 image is
/// bright: the loss falls and the training set is classified.
#[test]
fn a_residual_network_learns() {
    let pool = Pool::new(2).unwrap();
    let n = 16;
    let mut b = GraphBuilder::new(Shape::new(n, 1, 8, 8));
    let x = b.input();
    let c = b
        .layer(x, Conv2d::new(1, 8, (3, 3), 1, 1, Activation::Relu, 1))
        .unwrap();
    let r = b
        .layer(c, Conv2d::new(8, 8, (3, 3), 1, 1, Activation::Identity, 2))
        .unwrap();
    let s = b.add(r, c).unwrap();
    let s = b.layer(s, Relu::new()).unwrap();
    let d = b
        .layer(s, Conv2d::new(8, 8, (2, 2), 2, 0, Activation::Relu, 3))
        .unwrap();
    let f = b.layer(d, Flatten::new()).unwrap();
    let out = b
        .layer(f, Linear::new(8 * 16, 4, Activation::Identity, 4))
        .unwrap();
    let mut g = b.build(out).unwrap();
    let mut rng = Lcg(3);
    let mut data = vec![0.0f32; n * 64];
    let labels: Vec<usize> = (0..n).map(|i| i % 4).collect();
    for (i, &l) in labels.iter().enumerate() {
        for y in 0..8 {
            for xx in 0..8 {
                let q = (y / 4) * 2 + xx / 4;
                data[i * 64 + y * 8 + xx] = 0.2 * rng.next() + if q == l { 1.0 } else { 0.0 };
            }
        }
    }
    let xt = Tensor::from_vec(Shape::new(n, 1, 8, 8), data).unwrap();
    let opt = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let first = g.train_step(&pool, &xt, &labels, &opt).unwrap();
    let mut last = first;
    for _ in 0..60 {
        last = g.train_step(&pool, &xt, &labels, &opt).unwrap();
    }
    assert!(last < 0.2 * first, "loss {first} -> {last}");
    assert_eq!(g.predict(&pool, &xt).unwrap(), labels);
}

/// ResNet-50 v1.5 builds with the paper's shapes and about 4.1 G
/// multiply-adds per 224x224 image.
#[test]
fn resnet50_has_the_papers_shapes_and_work() {
    let g = brgemm_nn::models::resnet50(1, 224, 1000, 1).unwrap();
    assert_eq!(g.output_shape(), Shape::flat(1, 1000));
    let layers = g.layer_flops();
    let convs = layers
        .iter()
        .filter(|(n, _)| n.starts_with("conv2d"))
        .count();
    // 1 stem + 16 blocks x 3 + 4 projections.
    assert_eq!(convs, 53);
    let gmacs: f64 = layers.iter().map(|(_, f)| f).sum::<f64>() / 2e9;
    assert!((4.0..4.2).contains(&gmacs), "{gmacs} GMACs");
    assert!(
        layers[0].0.starts_with("conv2d 7x7 3->64 stride 2"),
        "{}",
        layers[0].0
    );
}

#[test]
fn outputs_held_by_the_caller_survive_the_next_forward() {
    // Layers hand out their blocked buffers and write them again in place
    // on the next step, but only once no one else holds them.
    let s = Shape::new(2, 5, 6, 6);
    let mut b = GraphBuilder::new(s);
    let x = b.input();
    let c = b
        .layer(x, Conv2d::new(5, 8, (3, 3), 1, 1, Activation::Identity, 41))
        .unwrap();
    let n = b.layer(c, BatchNorm2d::new(8)).unwrap();
    let r = b.layer(n, Relu::new()).unwrap();
    let out = b.add(r, n).unwrap();
    let mut g = b.build(out).unwrap();
    let pool = Pool::new(2).unwrap();
    let mut rng = Lcg(5);
    let (x1, x2) = (rng.tensor(s), rng.tensor(s));
    let held = g.forward(&pool, &x1, Mode::Eval).unwrap().clone();
    let before = held.data().to_vec();
    let other = g.forward(&pool, &x2, Mode::Eval).unwrap().data().to_vec();
    assert_ne!(before, other);
    let again = g.forward(&pool, &x1, Mode::Eval).unwrap().data().to_vec();
    assert_eq!(held.data(), &before[..], "a held output was overwritten");
    assert_eq!(again, before, "the same input gives the same output");
    // A training step in between does not disturb inference on x1 (no
    // optimizer step, so the weights are unchanged; batch norm in eval
    // mode reads the running statistics, which training moves).
    g.forward(&pool, &x2, Mode::Train).unwrap();
    let dy = Tensor::zeros(g.output_shape());
    g.backward(&pool, &dy).unwrap();
    assert_eq!(held.data(), &before[..]);
}

/// Conv, batch norm, ReLU (fusable), a second batch norm whose output two
/// nodes read (its ReLU not fusable), and a residual join with a ReLU
/// (fusable), fused or not as `fuse` says.
fn fusable_net(fuse: bool) -> Graph {
    let mut b = GraphBuilder::new(Shape::new(3, 5, 7, 7));
    let x = b.input();
    let c = b
        .layer(x, Conv2d::new(5, 8, (3, 3), 1, 1, Activation::Identity, 51))
        .unwrap();
    let n = b.layer(c, BatchNorm2d::new(8)).unwrap();
    let r = b.layer(n, Relu::new()).unwrap();
    let c2 = b
        .layer(r, Conv2d::new(8, 8, (3, 3), 1, 1, Activation::Identity, 52))
        .unwrap();
    let n2 = b.layer(c2, BatchNorm2d::new(8)).unwrap();
    let r2 = b.layer(n2, Relu::new()).unwrap();
    let s = b.add(r2, n2).unwrap();
    // Fused into the add's pass.
    let s = b.layer(s, Relu::new()).unwrap();
    let p = b.layer(s, GlobalAvgPool::new()).unwrap();
    let out = b
        .layer(p, Linear::new(8, 3, Activation::Identity, 53))
        .unwrap();
    b.fuse(fuse).build(out).unwrap()
}

#[test]
fn fused_batch_norm_and_relu_match_the_separate_passes() {
    let (mut fused, mut plain) = (fusable_net(true), fusable_net(false));
    let names: Vec<String> = fused.times().into_iter().map(|t| t.name).collect();
    assert_eq!(names[1], "batchnorm2d 8 + relu", "{names:?}");
    assert_eq!(names[2], "relu (fused)", "{names:?}");
    // The second batch norm's output is also read by the add: not fused.
    assert_eq!(names[4], "batchnorm2d 8", "{names:?}");
    assert_eq!(names[6], "add + relu", "{names:?}");
    assert_eq!(names[7], "relu (fused)", "{names:?}");
    assert!(plain.times().iter().all(|t| !t.name.contains("fused")));
    let pool = Pool::new(2).unwrap();
    let mut rng = Lcg(9);
    let x = rng.tensor(fused.input_shape());
    let r = rng.tensor(fused.output_shape());
    let run = |g: &mut Graph| {
        let y = g.forward(&pool, &x, Mode::Train).unwrap().data().to_vec();
        let dx = g.backward(&pool, &r).unwrap().into_vec();
        let grads: Vec<f32> = g.params().iter().flat_map(|p| p.grad.to_vec()).collect();
        let eval = g.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
        [y, dx, grads, eval]
    };
    let (a, b) = (run(&mut fused), run(&mut plain));
    // After an inference forward each batch norm, the only reader of its
    // convolution's output, is folded into that convolution (also the
    // second, whose own output two nodes read).
    let names: Vec<String> = fused.times().into_iter().map(|t| t.name).collect();
    assert_eq!(names[1], "batchnorm2d 8 (folded)", "{names:?}");
    assert_eq!(names[4], "batchnorm2d 8 (folded)", "{names:?}");
    for (what, (u, v)) in ["y", "dx", "grads", "eval"].iter().zip(a.iter().zip(&b)) {
        assert_eq!(u.len(), v.len());
        for (p, q) in u.iter().zip(v) {
            assert!(
                (p - q).abs() <= 1e-5 * (1.0 + p.abs()),
                "{what}: {p} vs {q}"
            );
        }
    }
}

/// A bottleneck-like block: the shortcut (a ReLU'd convolution) runs
/// before the branch, whose last batch norm (or, folded in inference, its
/// convolution) alone feeds the join; a second join whose producer also
/// feeds another node stays a separate add. Fused (`fuse`) or not.
fn joinable_net(fuse: bool) -> Graph {
    let mut b = GraphBuilder::new(Shape::new(2, 6, 6, 6));
    let x = b.input();
    let c0 = b
        .layer(x, Conv2d::new(6, 8, (1, 1), 1, 0, Activation::Identity, 71))
        .unwrap();
    let s = b.layer(c0, Relu::new()).unwrap();
    let c1 = b
        .layer(s, Conv2d::new(8, 8, (3, 3), 1, 1, Activation::Identity, 72))
        .unwrap();
    let n1 = b.layer(c1, BatchNorm2d::new(8)).unwrap();
    let r1 = b.layer(n1, Relu::new()).unwrap();
    let c2 = b
        .layer(
            r1,
            Conv2d::new(8, 8, (1, 1), 1, 0, Activation::Identity, 73),
        )
        .unwrap();
    let n2 = b.layer(c2, BatchNorm2d::new(8)).unwrap();
    let j = b.add(n2, s).unwrap();
    let j = b.layer(j, Relu::new()).unwrap();
    // Its producer (the first join) is read twice: a separate add.
    let j2 = b.add(j, j).unwrap();
    let p = b.layer(j2, GlobalAvgPool::new()).unwrap();
    let out = b
        .layer(p, Linear::new(8, 3, Activation::Identity, 74))
        .unwrap();
    b.fuse(fuse).build(out).unwrap()
}

#[test]
fn joins_done_in_the_producers_pass_match_the_separate_add() {
    let (mut fused, mut plain) = (joinable_net(true), joinable_net(false));
    let pool = Pool::new(2).unwrap();
    let mut rng = Lcg(17);
    let x = rng.tensor(fused.input_shape());
    let r = rng.tensor(fused.output_shape());
    let names = |g: &Graph| -> Vec<String> { g.times().into_iter().map(|t| t.name).collect() };
    let train = |g: &mut Graph| {
        let y = g.forward(&pool, &x, Mode::Train).unwrap().data().to_vec();
        let dx = g.backward(&pool, &r).unwrap().into_vec();
        let grads: Vec<f32> = g.params().iter().flat_map(|p| p.grad.to_vec()).collect();
        [y, dx, grads]
    };
    let (a, b) = (train(&mut fused), train(&mut plain));
    // In training the batch norm joins (its backward gets the gradient
    // through the join's ReLU).
    let n = names(&fused);
    assert_eq!(n[7], "add + relu (joined)", "{n:?}");
    assert_eq!(n[9], "add", "{n:?}");
    assert!(names(&plain).iter().all(|t| !t.contains("joined")));
    let ya = fused
        .forward(&pool, &x, Mode::Eval)
        .unwrap()
        .data()
        .to_vec();
    let yb = plain
        .forward(&pool, &x, Mode::Eval)
        .unwrap()
        .data()
        .to_vec();
    // In inference the batch norm is folded into its convolution, which
    // joins.
    let n = names(&fused);
    assert_eq!(n[6], "batchnorm2d 8 (folded)", "{n:?}");
    assert_eq!(n[7], "add + relu (joined)", "{n:?}");
    for (what, (u, v)) in ["y", "dx", "grads", "eval"]
        .iter()
        .zip(a.iter().chain([&ya]).zip(b.iter().chain([&yb])))
    {
        assert_eq!(u.len(), v.len());
        for (p, q) in u.iter().zip(v) {
            assert!(
                (p - q).abs() <= 1e-5 * (1.0 + p.abs()),
                "{what}: {p} vs {q}"
            );
        }
    }
}

#[test]
fn a_training_step_skipping_the_input_gradient_updates_as_backward_does() {
    // train_step does not compute dL/d(input) (the first convolution's
    // backward-data is skipped); the update must be the same.
    let (mut a, mut b) = (fusable_net(true), fusable_net(true));
    let pool = Pool::new(2).unwrap();
    let x = Lcg(3).tensor(a.input_shape());
    let labels = [0, 2, 1];
    let opt = Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
    };
    a.train_step(&pool, &x, &labels, &opt).unwrap();
    let logits = b.forward(&pool, &x, Mode::Train).unwrap().clone();
    let (_, dlogits) = brgemm_nn::softmax_cross_entropy(&logits, &labels).unwrap();
    b.backward(&pool, &dlogits).unwrap();
    b.step(&opt).unwrap();
    for (p, q) in a.params().iter().zip(b.params().iter()) {
        assert_eq!(p.name, q.name);
        assert_eq!(p.value, q.value, "{}", p.name);
    }
}

#[test]
fn dropout_scales_what_it_keeps_and_passes_through_in_inference() {
    use brgemm_nn::Dropout;
    let s = Shape::new(4, 16, 5, 5);
    let p = 0.25f32;
    for blocked in [false, true] {
        let mut b = GraphBuilder::new(s);
        let mut h = b.input();
        if blocked {
            // A convolution in front: the dropout works on its blocked output.
            h = b
                .layer(
                    h,
                    Conv2d::new(16, 16, (1, 1), 1, 0, Activation::Identity, 61),
                )
                .unwrap();
        }
        let d = b.layer(h, Dropout::new(p, 7)).unwrap();
        let mut g = b.build(d).unwrap();
        let pool = Pool::new(2).unwrap();
        let x = Lcg(11).tensor(s);
        let before = g.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
        let y = g.forward(&pool, &x, Mode::Train).unwrap().data().to_vec();
        let dy = Lcg(12).tensor(s);
        let dx = g.backward(&pool, &dy).unwrap();
        let dx = if blocked {
            None
        } else {
            Some(dx.data().to_vec())
        };
        let (mut kept, scale) = (0usize, 1.0 / (1.0 - p));
        for (i, (&yi, &bi)) in y.iter().zip(&before).enumerate() {
            if yi != 0.0 {
                kept += 1;
                assert!(
                    (yi - bi * scale).abs() <= 1e-5 * bi.abs().max(1.0),
                    "{yi} vs {bi}"
                );
            }
            if let Some(dx) = &dx {
                let want = if yi != 0.0 { dy.data()[i] * scale } else { 0.0 };
                assert_eq!(dx[i], want);
            }
        }
        let frac = kept as f64 / y.len() as f64;
        assert!((frac - 0.75).abs() < 0.05, "kept {frac}");
        // Inference is the identity.
        let after = g.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
        assert_eq!(after, before);
    }
    let mut b = GraphBuilder::new(s);
    let x = b.input();
    let e = b.layer(x, Dropout::new(1.0, 1)).unwrap_err().to_string();
    assert!(e.contains("dropout 1") && e.contains("[0, 1)"), "{e}");
}

#[test]
fn a_saved_graph_loads_back_and_bad_files_are_named_errors() {
    let pool = Pool::new(2).unwrap();
    let (mut a, mut b) = (fusable_net(true), fusable_net(false));
    let x = Lcg(21).tensor(a.input_shape());
    let opt = Optimizer::Sgd {
        lr: 0.1,
        momentum: 0.9,
    };
    // Training moves the weights and the batch-norm statistics.
    for _ in 0..3 {
        a.train_step(&pool, &x, &[0, 1, 2], &opt).unwrap();
    }
    let want = a.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
    assert_ne!(b.forward(&pool, &x, Mode::Eval).unwrap().data(), &want[..]);
    let dir = std::env::temp_dir().join(format!("brgemm-nn-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("net.bin");
    a.save(&path).unwrap();
    // Loaded into the same layers built without fusion: the same output
    // (to rounding: inference folds the batch norms in one, not the other),
    // and exactly the same loaded into a graph built like the saved one.
    b.load(&path).unwrap();
    let got = b.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
    for (p, q) in got.iter().zip(&want) {
        assert!((p - q).abs() <= 1e-5 * (1.0 + q.abs()), "{p} vs {q}");
    }
    let mut c = fusable_net(true);
    c.load(&path).unwrap();
    assert_eq!(c.forward(&pool, &x, Mode::Eval).unwrap().data(), &want[..]);

    let bytes = std::fs::read(&path).unwrap();
    let err = |bytes: &[u8]| fusable_net(true).from_bytes(bytes).unwrap_err().to_string();
    let e = err(&bytes[..bytes.len() - 3]);
    assert!(e.contains("truncated"), "{e}");
    let mut newer = bytes.clone();
    newer[10] = 9;
    let e = err(&newer);
    assert!(
        e.contains("version 9") && e.contains(&format!("version {}", brgemm_nn::FILE_VERSION)),
        "{e}"
    );
    let e = err(b"PNG");
    assert!(e.contains("not a brgemm-nn file"), "{e}");
    // A byte more, or one flipped: the checksum no longer matches (the
    // corruption tests in model_file.rs reseal it to reach each check).
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(err(&longer).contains("checksum"));
    // Another architecture: the first differing layer is named.
    let mut other = GraphBuilder::new(a.input_shape());
    let i = other.input();
    let c = other
        .layer(i, Conv2d::new(5, 4, (3, 3), 1, 1, Activation::Identity, 1))
        .unwrap();
    let mut other = other.build(c).unwrap();
    let e = other.from_bytes(&bytes).unwrap_err().to_string();
    assert!(e.contains("layers"), "{e}");
    let e = b.load(dir.join("missing.bin")).unwrap_err().to_string();
    assert!(e.contains("missing.bin"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// PyTorch's grouped convolution with per-axis stride, padding and
/// dilation, written out in f64: weights `[k][c / groups][r][s]`.
#[allow(clippy::too_many_arguments)]
fn conv_reference(
    x: &Tensor,
    w: &[f32],
    b: &[f32],
    k: usize,
    (r, s): (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
    dil: (usize, usize),
    groups: usize,
) -> Vec<f64> {
    let sh = x.shape();
    let (cg, kg) = (sh.c / groups, k / groups);
    let p = (sh.h + 2 * pad.0 - dil.0 * (r - 1) - 1) / stride.0 + 1;
    let q = (sh.w + 2 * pad.1 - dil.1 * (s - 1) - 1) / stride.1 + 1;
    let mut y = vec![0f64; sh.n * k * p * q];
    for n in 0..sh.n {
        for ko in 0..k {
            let g = ko / kg;
            for oy in 0..p {
                for ox in 0..q {
                    let mut acc = f64::from(b[ko]);
                    for ci in 0..cg {
                        let c = g * cg + ci;
                        for ry in 0..r {
                            for sx in 0..s {
                                let iy = (oy * stride.0 + ry * dil.0) as isize - pad.0 as isize;
                                let ix = (ox * stride.1 + sx * dil.1) as isize - pad.1 as isize;
                                if iy < 0 || ix < 0 || iy as usize >= sh.h || ix as usize >= sh.w {
                                    continue;
                                }
                                let xv = x.data()
                                    [((n * sh.c + c) * sh.h + iy as usize) * sh.w + ix as usize];
                                let wv = w[((ko * cg + ci) * r + ry) * s + sx];
                                acc += f64::from(xv) * f64::from(wv);
                            }
                        }
                    }
                    y[((n * k + ko) * p + oy) * q + ox] = acc;
                }
            }
        }
    }
    y
}

#[test]
fn grouped_and_per_axis_convolutions_match_a_plain_reference() {
    let pool = Pool::new(2).unwrap();
    // (c, k, (r, s), stride, pad, dilation, groups)
    type Case = (
        usize,
        usize,
        (usize, usize),
        (usize, usize),
        (usize, usize),
        (usize, usize),
        usize,
    );
    let cases: [Case; 4] = [
        (4, 6, (3, 2), (1, 2), (1, 0), (2, 1), 1),
        (6, 4, (3, 3), (2, 1), (0, 2), (1, 2), 2),
        (6, 6, (3, 3), (1, 1), (1, 1), (1, 1), 6),
        (4, 8, (1, 3), (2, 2), (0, 1), (1, 1), 4),
    ];
    for (i, &(c, k, rs, st, pad, dil, groups)) in cases.iter().enumerate() {
        let s = Shape::new(2, c, 7, 8);
        let mut rng = Lcg(70 + i as u64);
        let x = rng.tensor(s);
        let conv = Conv2d::new(c, k, rs, 1, 0, Activation::Identity, 1)
            .strides(st.0, st.1)
            .pads(pad.0, pad.1)
            .dilations(dil.0, dil.1)
            .groups(groups, 5);
        let (w, b) = (rng.vec(k * c / groups * rs.0 * rs.1), rng.vec(k));
        let mut conv = conv;
        conv.set_weights(&w, &b).unwrap();
        let mut g = GraphBuilder::new(s);
        let input = g.input();
        let out = g.layer(input, conv).unwrap();
        let mut net = g.build(out).unwrap();
        let y = net.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
        let want = conv_reference(&x, &w, &b, k, rs, st, pad, dil, groups);
        assert_eq!(y.len(), want.len(), "case {i}");
        for (a, e) in y.iter().zip(&want) {
            assert!((f64::from(*a) - e).abs() < 1e-4, "case {i}: {a} vs {e}");
        }
        // The weights come back as they were given.
        let layer: &Conv2d = net.layer(out).unwrap();
        assert_eq!(layer.weights(), w);
    }
    let mut g = GraphBuilder::new(Shape::new(1, 6, 5, 5));
    let x = g.input();
    let e = g
        .layer(
            x,
            Conv2d::new(6, 4, (3, 3), 1, 1, Activation::Identity, 1).groups(4, 1),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("into 4 groups"), "{e}");
}

#[test]
fn grouped_and_depthwise_gradients_match_finite_differences() {
    let mut b = GraphBuilder::new(Shape::new(2, 4, 6, 5));
    let x = b.input();
    let c = b
        .layer(
            x,
            Conv2d::new(4, 6, (3, 3), 1, 1, Activation::Tanh, 81)
                .strides(2, 1)
                .groups(2, 81),
        )
        .unwrap();
    let d = b
        .layer(
            c,
            Conv2d::new(6, 6, (3, 1), 1, 0, Activation::Tanh, 82)
                .pads(1, 0)
                .dilations(1, 1)
                .groups(6, 82),
        )
        .unwrap();
    let p = b.layer(d, GlobalAvgPool::new()).unwrap();
    let out = b
        .layer(p, Linear::new(6, 3, Activation::Identity, 83))
        .unwrap();
    check_gradients(b.build(out).unwrap(), 41, 10);
}

#[test]
fn folds_follow_the_weights_and_statistics_as_they_change() {
    // Inference after training steps, after a load and after setting
    // weights by hand must see the current values, not an old fold.
    let pool = Pool::new(2).unwrap();
    let (mut a, mut b) = (fusable_net(true), fusable_net(false));
    let x = Lcg(33).tensor(a.input_shape());
    let opt = Optimizer::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let close = |u: &[f32], v: &[f32], what: &str| {
        for (p, q) in u.iter().zip(v) {
            assert!(
                (p - q).abs() <= 1e-4 * (1.0 + p.abs()),
                "{what}: {p} vs {q}"
            );
        }
    };
    for step in 0..3 {
        let ya = a.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
        let yb = b.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
        close(&ya, &yb, &format!("after {step} steps"));
        a.train_step(&pool, &x, &[0, 1, 2], &opt).unwrap();
        b.train_step(&pool, &x, &[0, 1, 2], &opt).unwrap();
    }
    for p in a.params() {
        p.value.iter_mut().for_each(|v| *v *= 0.5);
    }
    for p in b.params() {
        p.value.iter_mut().for_each(|v| *v *= 0.5);
    }
    let ya = a.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
    let yb = b.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
    close(&ya, &yb, "after halving every parameter");
    b.from_bytes(&fusable_net(false).to_bytes()).unwrap();
    a.from_bytes(&fusable_net(false).to_bytes()).unwrap();
    let ya = a.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
    let yb = b.forward(&pool, &x, Mode::Eval).unwrap().data().to_vec();
    close(&ya, &yb, "after a load");
}

/// The CNN of `train_cnn` as its builder makes it (two stages, with and
/// without batch norm, pooling, a hidden FC layer).
fn tiny_cnn(batchnorm: bool) -> Graph {
    let stage = |channels, pool| StageSpec {
        channels,
        kernel: 3,
        batchnorm,
        pool,
    };
    CnnSpec {
        input: (2, 6, 6),
        stages: vec![stage(4, 2), stage(5, 1)],
        hidden: vec![6],
        classes: 3,
        dropout: 0.0,
    }
    .graph(4, 3)
    .unwrap()
}

#[test]
fn the_cnn_builder_gradients_match_finite_differences() {
    // The fused ReLUs and the pooling are kinks a step of 1e-2 crosses.
    for bn in [false, true] {
        check_gradients_eps(tiny_cnn(bn), 17, 8, 1e-3);
    }
}

#[test]
fn the_cnn_builder_learns_a_toy_problem() {
    let pool = Pool::new(2).unwrap();
    let mut g = tiny_cnn(true);
    let x = Lcg(8).tensor(g.input_shape());
    let labels = [0, 2, 1, 2];
    let opt = Optimizer::adam(0.01);
    let first = g.train_step(&pool, &x, &labels, &opt).unwrap();
    let mut last = first;
    for _ in 0..60 {
        last = g.train_step(&pool, &x, &labels, &opt).unwrap();
    }
    assert!(last < 0.2 * first, "loss {first} -> {last}");
    assert_eq!(g.predict(&pool, &x).unwrap(), labels);
}

#[test]
fn the_mlp_builder_matches_a_plain_reference() {
    // 5 -> 4 (tanh) -> 3 (identity), in f64 from the layers' own weights.
    let specs = [
        LayerSpec {
            out: 4,
            act: Activation::Tanh,
        },
        LayerSpec {
            out: 3,
            act: Activation::Identity,
        },
    ];
    let pool = Pool::new(2).unwrap();
    let mut g = mlp(5, 2, &specs, 9).unwrap();
    // The same chain by hand, to read the weights in PyTorch's order.
    let mut b = GraphBuilder::new(Shape::flat(2, 5));
    let l1 = b
        .layer(b.input(), Linear::new(5, 4, Activation::Tanh, 9))
        .unwrap();
    let l2 = b
        .layer(l1, Linear::new(4, 3, Activation::Identity, 10))
        .unwrap();
    let h = b.build(l2).unwrap();
    let x = Lcg(4).tensor(g.input_shape());
    let mut want: Vec<Vec<f64>> = x
        .data()
        .chunks(5)
        .map(|r| r.iter().map(|&v| f64::from(v)).collect())
        .collect();
    for (layer, id) in [l1, l2].into_iter().enumerate() {
        let lin = h.layer::<Linear>(id).unwrap();
        let (w, b) = (lin.weights(), lin.bias());
        for row in &mut want {
            let out: Vec<f64> = (0..b.len())
                .map(|o| {
                    let z = f64::from(b[o])
                        + row
                            .iter()
                            .enumerate()
                            .map(|(i, v)| v * f64::from(w[o * row.len() + i]))
                            .sum::<f64>();
                    if layer == 0 {
                        z.tanh()
                    } else {
                        z
                    }
                })
                .collect();
            *row = out;
        }
    }
    let y = g.forward(&pool, &x, Mode::Eval).unwrap();
    for (got, want) in y.data().iter().zip(want.iter().flatten()) {
        assert!((f64::from(*got) - want).abs() < 1e-5, "{got} vs {want}");
    }
    assert!(mlp(5, 2, &[], 9).is_err());
}

#[test]
fn the_mlp_builder_gradients_match_finite_differences() {
    // Smooth activations (no kinks), and a ReLU layer with a smaller step;
    // the middle layer reads the first one's FC-layout output as it is.
    let act = |out, act| LayerSpec { out, act };
    let smooth = [
        act(9, Activation::Tanh),
        act(7, Activation::Sigmoid),
        act(4, Activation::Identity),
    ];
    check_gradients(mlp(6, 5, &smooth, 21).unwrap(), 3, 10);
    let relu = [act(8, Activation::Relu), act(3, Activation::Identity)];
    check_gradients_eps(mlp(6, 5, &relu, 22).unwrap(), 4, 10, 1e-3);
}

/// `set_fused_update`: the linear layers step inside backward, the rest
/// (convolutions, batch norm) after; after three steps every parameter and
/// optimizer moment is bit for bit the unfused run's, for SGD with momentum
/// and Adam, on an MLP (every layer fused, the first one's input gradient
/// skipped) and on a CNN (mixed).
#[test]
fn fused_update_steps_exactly_as_the_separate_step() {
    let pool = Pool::new(2).unwrap();
    type Net = fn() -> Graph;
    let nets: [(&str, Net); 2] = [
        ("mlp", || {
            mlp(37, 5, &LayerSpec::classifier(&[70, 19], 3), 4).unwrap()
        }),
        ("cnn", || tiny_cnn(true)),
    ];
    for (name, net) in nets {
        for opt in [
            Optimizer::Sgd {
                lr: 0.05,
                momentum: 0.9,
            },
            Optimizer::adam(1e-2),
        ] {
            let a = net();
            let x = Lcg(8).tensor(a.input_shape());
            let labels: Vec<usize> = (0..a.input_shape().n).map(|i| i % 3).collect();
            let data = (&x, &labels[..]);
            fused_steps_match((a, net()), &pool, data, &opt, name == "mlp", name);
        }
    }
}
