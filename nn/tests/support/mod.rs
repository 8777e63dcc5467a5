//! Deterministic test data for the layer-graph tests.
#![allow(dead_code)]

use brgemm_nn::{Graph, Mode, Shape, Tensor};
use brgemm_primitives::Pool;

/// A linear congruential generator of values in [-1, 1).
pub struct Lcg(pub u64);

impl Lcg {
    /// The next value.
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `n` values.
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
    /// A tensor of `s` filled with values.
    pub fn tensor(&mut self, s: Shape) -> Tensor {
        Tensor::from_vec(s, self.vec(s.len())).unwrap()
    }
}

/// L = sum(y * r): dL/dy = r. In training mode, so batch norm uses the
/// batch's statistics, as the backward under test does.
pub fn loss(g: &mut Graph, pool: &Pool, x: &Tensor, r: &Tensor) -> f64 {
    let y = g.forward(pool, x, Mode::Train).unwrap();
    y.data()
        .iter()
        .zip(r.data())
        .map(|(a, b)| f64::from(*a) * f64::from(*b))
        .sum()
}

/// Central differences of L against dx and every parameter's gradient, on
/// `samples` positions of each.
pub fn check_gradients(g: Graph, seed: u64, samples: usize) {
    check_gradients_eps(g, seed, samples, 1e-2)
}

/// [`check_gradients`] with step `eps` (ReLU and max-pooling kinks ask for a
/// smaller one).
pub fn check_gradients_eps(mut g: Graph, seed: u64, samples: usize, eps: f32) {
    let pool = Pool::new(2).unwrap();
    let mut rng = Lcg(seed);
    let x = rng.tensor(g.input_shape());
    let r = rng.tensor(g.output_shape());
    g.forward(&pool, &x, Mode::Train).unwrap();
    let dx = g.backward(&pool, &r).unwrap();
    let grads: Vec<Vec<f32>> = g.params().iter().map(|p| p.grad.to_vec()).collect();
    let close = |a: f64, n: f64, what: &str| {
        assert!(
            (a - n).abs() <= 2e-2 * n.abs().max(0.05) + 2e-3,
            "{what}: analytic {a}, numeric {n}"
        );
    };
    let mut x2 = x.clone();
    for k in 0..samples {
        let i = (k * 7919 + 13) % x.shape().len();
        let v = x2.data()[i];
        x2.data_mut()[i] = v + eps;
        let lp = loss(&mut g, &pool, &x2, &r);
        x2.data_mut()[i] = v - eps;
        let lm = loss(&mut g, &pool, &x2, &r);
        x2.data_mut()[i] = v;
        close(
            f64::from(dx.data()[i]),
            (lp - lm) / f64::from(2.0 * eps),
            &format!("dx[{i}]"),
        );
    }
    for (pi, grad) in grads.iter().enumerate() {
        for k in 0..samples {
            let i = (k * 104729 + 3) % grad.len();
            let perturb = |g: &mut Graph, d: f32| {
                let mut ps = g.params();
                ps[pi].value[i] += d;
            };
            perturb(&mut g, eps);
            let lp = loss(&mut g, &pool, &x, &r);
            perturb(&mut g, -2.0 * eps);
            let lm = loss(&mut g, &pool, &x, &r);
            perturb(&mut g, eps);
            close(
                f64::from(grad[i]),
                (lp - lm) / f64::from(2.0 * eps),
                &format!("param {pi} [{i}]"),
            );
        }
    }
}

/// Three training steps of `a` (unfused) and `b` (`set_fused_update`) on
/// the same minibatch end bit for bit alike: losses, optimizer moments,
/// every parameter. With `all_weights_fused`, no weight gradient of `b`
/// was stored whole (every weighted layer stepped inside backward) while
/// `a` stored its own.
pub fn fused_steps_match(
    (mut a, mut b): (Graph, Graph),
    pool: &Pool,
    (x, labels): (&Tensor, &[usize]),
    opt: &brgemm_primitives::Optimizer,
    all_weights_fused: bool,
    what: &str,
) {
    b.set_fused_update(true).unwrap();
    for step in 0..3 {
        let la = a.train_step(pool, x, labels, opt).unwrap();
        let lb = b.train_step(pool, x, labels, opt).unwrap();
        assert_eq!(la, lb, "{what} {opt:?} step {step}: loss");
    }
    let (sa, sb) = (a.optimizer_state().unwrap(), b.optimizer_state().unwrap());
    assert_eq!(sa, sb, "{what} {opt:?}: moments");
    if all_weights_fused {
        let stored = |g: &mut Graph| {
            g.params()
                .iter()
                .filter(|p| p.name == "weight")
                .any(|p| p.grad.iter().any(|&v| v != 0.0))
        };
        assert!(
            stored(&mut a) && !stored(&mut b),
            "{what} {opt:?}: fused path taken"
        );
    }
    for (p, q) in a.params().iter().zip(b.params().iter()) {
        assert_eq!(p.value, q.value, "{what} {opt:?}: {}", p.name);
    }
}
