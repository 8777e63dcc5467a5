//! The recurrent layer: gradients of the input, the weights and the initial
//! state against finite differences with a loss that also reads the final
//! state; weights in PyTorch's order against an f64 LSTM written out here;
//! misuse.

use brgemm_nn::models::SeqSpec;
use brgemm_nn::{Bidirectional, GraphBuilder, Layer, Mode, Recurrent, Shape, Tensor};
use brgemm_primitives::CellKind;
use brgemm_primitives::Pool;

mod support;
use support::{check_gradients_eps, Lcg};

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(*x) * f64::from(*y))
        .sum()
}

/// L = sum(y r) + sum(h_T a) + sum(c_T b), in training mode.
fn loss(l: &mut Recurrent, pool: &Pool, x: &Tensor, w: &[Vec<f32>; 3]) -> f64 {
    let y = l.forward(pool, x, Mode::Train).unwrap();
    let (h, c) = l.final_state().unwrap();
    dot(y.data(), &w[0]) + dot(&h, &w[1]) + dot(&c, &w[2])
}

#[test]
fn gradients_with_final_and_initial_states_match_finite_differences() {
    let pool = Pool::new(2).unwrap();
    let (n, feats, hidden, steps) = (3, 4, 5, 4);
    for lstm in [true, false] {
        for last_only in [false, true] {
            let mut l = if lstm {
                Recurrent::lstm(feats, hidden, 3)
            } else {
                Recurrent::rnn(feats, hidden, 3)
            };
            if last_only {
                l = l.last_only();
            }
            let out = l.build(Shape::new(n, feats, steps, 1)).unwrap();
            let mut rng = Lcg(17);
            let x = Tensor::from_vec(Shape::new(n, feats, steps, 1), rng.vec(n * feats * steps))
                .unwrap();
            let state = n * hidden;
            let c_len = if lstm { state } else { 0 };
            let (h0, c0) = (rng.vec(state), rng.vec(c_len));
            l.set_initial_state(&h0, &c0).unwrap();
            let w = [rng.vec(out.len()), rng.vec(state), rng.vec(c_len)];
            l.set_final_state_grad(&w[1], &w[2]).unwrap();
            l.forward(&pool, &x, Mode::Train).unwrap();
            let dy = Tensor::from_vec(out, w[0].clone()).unwrap();
            let dx = l.backward(&pool, &dy).unwrap().into_vec();
            let (dh0, dc0) = l.initial_state_grad().unwrap();
            let grads: Vec<Vec<f32>> = l.params().iter().map(|p| p.grad.to_vec()).collect();
            let eps = 1e-2f32;
            let what = format!("lstm {lstm} last_only {last_only}");
            let close = |an: f32, fd: f64, at: &str| {
                let an = f64::from(an);
                assert!(
                    (an - fd).abs() <= 2e-2 * fd.abs().max(0.05) + 2e-3,
                    "{what} {at}: analytic {an}, numeric {fd}"
                );
            };
            let mut xs = x.clone().into_vec();
            for i in (0..xs.len()).step_by(7) {
                let v = xs[i];
                xs[i] = v + eps;
                let up = loss(
                    &mut l,
                    &pool,
                    &Tensor::from_vec(x.shape(), xs.clone()).unwrap(),
                    &w,
                );
                xs[i] = v - eps;
                let down = loss(
                    &mut l,
                    &pool,
                    &Tensor::from_vec(x.shape(), xs.clone()).unwrap(),
                    &w,
                );
                xs[i] = v;
                close(
                    dx[i],
                    (up - down) / f64::from(2.0 * eps),
                    &format!("dx[{i}]"),
                );
            }
            for (which, grad) in [(0, &dh0), (1, &dc0)] {
                for i in (0..grad.len()).step_by(4) {
                    let mut probe = |d: f32| {
                        let (mut h, mut c) = (h0.clone(), c0.clone());
                        if which == 0 {
                            h[i] += d
                        } else {
                            c[i] += d
                        }
                        l.set_initial_state(&h, &c).unwrap();
                        loss(&mut l, &pool, &x, &w)
                    };
                    let (up, down) = (probe(eps), probe(-eps));
                    close(
                        grad[i],
                        (up - down) / f64::from(2.0 * eps),
                        &format!("state {which} [{i}]"),
                    );
                }
            }
            l.set_initial_state(&h0, &c0).unwrap();
            for (pi, grad) in grads.iter().enumerate() {
                for i in (0..grad.len()).step_by(11) {
                    if grad[i] == 0.0 {
                        continue; // padding of the blocked layout
                    }
                    let mut nudge = |d: f32| l.params()[pi].value[i] += d;
                    nudge(eps);
                    let up = loss(&mut l, &pool, &x, &w);
                    let mut nudge = |d: f32| l.params()[pi].value[i] += d;
                    nudge(-2.0 * eps);
                    let down = loss(&mut l, &pool, &x, &w);
                    l.params()[pi].value[i] += eps;
                    close(
                        grad[i],
                        (up - down) / f64::from(2.0 * eps),
                        &format!("param {pi} [{i}]"),
                    );
                }
            }
        }
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[test]
fn pytorch_order_weights_give_the_reference_lstm_output() {
    // torch.nn.LSTM(features, hidden, batch_first=False) semantics with
    // weight_ih [4h][f], weight_hh [4h][h], gates i, f, g, o and
    // bias = bias_ih + bias_hh, written out in f64.
    let (n, f, h, t) = (2, 3, 4, 5);
    let mut rng = Lcg(99);
    let (wi, wh, b) = (rng.vec(4 * h * f), rng.vec(4 * h * h), rng.vec(4 * h));
    let x = rng.vec(n * f * t); // (n, f, t)
    let mut l = Recurrent::lstm(f, h, 1);
    l.set_weights(&wi, &wh, &b).unwrap();
    let mut g = GraphBuilder::new(Shape::new(n, f, t, 1));
    let input = g.input();
    let id = g.layer(input, l).unwrap();
    let mut net = g.build(id).unwrap();
    let pool = Pool::new(1).unwrap();
    let xt = Tensor::from_vec(Shape::new(n, f, t, 1), x.clone()).unwrap();
    let y = net.forward(&pool, &xt, Mode::Eval).unwrap().data().to_vec();
    let layer: &Recurrent = net.layer(id).unwrap();
    let (h_last, c_last) = layer.final_state().unwrap();
    for s in 0..n {
        let (mut hs, mut cs) = (vec![0f64; h], vec![0f64; h]);
        for step in 0..t {
            let mut gates = vec![0f64; 4 * h];
            for (row, gate) in gates.iter_mut().enumerate() {
                *gate = f64::from(b[row])
                    + (0..f)
                        .map(|j| f64::from(wi[row * f + j]) * f64::from(x[(s * f + j) * t + step]))
                        .sum::<f64>()
                    + (0..h)
                        .map(|j| f64::from(wh[row * h + j]) * hs[j])
                        .sum::<f64>();
            }
            for k in 0..h {
                let (i, fg) = (sigmoid(gates[k]), sigmoid(gates[h + k]));
                let (gg, o) = (gates[2 * h + k].tanh(), sigmoid(gates[3 * h + k]));
                cs[k] = fg * cs[k] + i * gg;
                hs[k] = o * cs[k].tanh();
                let got = f64::from(y[(s * h + k) * t + step]);
                assert!(
                    (got - hs[k]).abs() < 1e-5,
                    "sample {s} step {step} unit {k}: {got} vs {}",
                    hs[k]
                );
            }
        }
        for k in 0..h {
            assert!((f64::from(h_last[s * h + k]) - hs[k]).abs() < 1e-5);
            assert!((f64::from(c_last[s * h + k]) - cs[k]).abs() < 1e-5);
        }
    }
    // The weights come back in PyTorch's order.
    let [w2, r2, b2] = net.layer::<Recurrent>(id).unwrap().weights();
    assert_eq!((w2, r2, b2), (wi, wh, b));
}

#[test]
fn recurrent_misuse_is_a_named_error() {
    let mut l = Recurrent::lstm(3, 4, 1);
    let e = l
        .set_initial_state(&[0.0; 8], &[0.0; 8])
        .unwrap_err()
        .to_string();
    assert!(e.contains("never built"), "{e}");
    let e = l.build(Shape::new(2, 3, 5, 2)).unwrap_err().to_string();
    assert!(
        e.contains("lstm 3->4") && e.contains("not a sequence"),
        "{e}"
    );
    let e = l.build(Shape::new(2, 4, 5, 1)).unwrap_err().to_string();
    assert!(e.contains("4 features, expected 3"), "{e}");
    l.build(Shape::new(2, 3, 5, 1)).unwrap();
    let e = l
        .set_initial_state(&[0.0; 7], &[0.0; 8])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("h0 has 7 values, expected n x hidden = 8"),
        "{e}"
    );
    let e = l.set_weights(&[0.0; 3], &[], &[]).unwrap_err().to_string();
    assert!(e.contains("W has 3 values, expected 48"), "{e}");
    let mut r = Recurrent::rnn(3, 4, 1);
    r.build(Shape::new(2, 3, 5, 1)).unwrap();
    let e = r
        .set_initial_state(&[0.0; 8], &[0.0; 8])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no c0"), "{e}");
    let pool = Pool::new(1).unwrap();
    let e = r
        .backward(&pool, &Tensor::zeros(Shape::new(2, 4, 5, 1)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("backward without a training forward"), "{e}");
}

/// The bidirectional layer is its two directions, the second over the
/// steps in reverse, side by side: against the two layers run alone.
#[test]
fn bidirectional_is_two_directions_over_reversed_steps() {
    let pool = Pool::new(2).unwrap();
    let (n, f, k, t) = (3, 4, 5, 6);
    let s = Shape::new(n, f, t, 1);
    let x = Lcg(3).tensor(s);
    let mut xr = x.clone();
    for (dst, src) in xr
        .data_mut()
        .chunks_exact_mut(t)
        .zip(x.data().chunks_exact(t))
    {
        dst.iter_mut()
            .zip(src.iter().rev())
            .for_each(|(d, v)| *d = *v);
    }
    for last in [false, true] {
        let mk = |seed| {
            let r = Recurrent::lstm(f, k, seed);
            if last {
                r.last_only()
            } else {
                r
            }
        };
        let mut bi = Bidirectional::new(Recurrent::lstm(f, k, 1), Recurrent::lstm(f, k, 2));
        if last {
            bi = bi.last_only();
        }
        let out = bi.build(s).unwrap();
        assert_eq!(out, Shape::new(n, 2 * k, if last { 1 } else { t }, 1));
        let y = bi.forward(&pool, &x, Mode::Eval).unwrap();
        let (mut a, mut b) = (mk(1), mk(2));
        a.build(s).unwrap();
        b.build(s).unwrap();
        let ya = a.forward(&pool, &x, Mode::Eval).unwrap();
        let yb = b.forward(&pool, &xr, Mode::Eval).unwrap();
        let steps = out.h;
        for ni in 0..n {
            for ki in 0..k {
                for st in 0..steps {
                    let fwd = y.data()[(ni * 2 * k + ki) * steps + st];
                    let bwd = y.data()[(ni * 2 * k + k + ki) * steps + st];
                    assert_eq!(fwd, ya.data()[(ni * k + ki) * steps + st]);
                    // Step st of the output is the backward layer's step
                    // steps-1-st (every step), or its last (last_only).
                    assert_eq!(bwd, yb.data()[(ni * k + ki) * steps + steps - 1 - st]);
                }
            }
        }
    }
}

/// A stacked bidirectional LSTM (and RNN) classifier as its builder makes
/// it, against finite differences of the input and every parameter.
#[test]
fn stacked_bidirectional_classifier_gradients_match_finite_differences() {
    for kind in [CellKind::Lstm, CellKind::Rnn] {
        let spec = SeqSpec {
            kind,
            steps: 4,
            features: 3,
            hidden: 5,
            layers: 2,
            bidirectional: true,
            head: vec![6],
            classes: 3,
        };
        // The head's ReLU is a kink a step of 1e-2 may cross.
        check_gradients_eps(spec.graph(2, 3).unwrap(), 13, 6, 1e-3);
    }
}
