//! Optimizers: SGD with momentum and Adam, on flat parameter buffers.
//!
//! Parameters and gradients are the blocked buffers themselves: the update
//! is element-wise, so the layout does not matter, and zero padding stays
//! zero (its gradient is always zero).

/// An optimizer and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// v = momentum * v + g; p -= lr * v.
    Sgd {
        /// Learning rate.
        lr: f32,
        /// Momentum (0 for plain SGD).
        momentum: f32,
    },
    /// Adam (Kingma and Ba), with bias correction.
    Adam {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Denominator guard.
        eps: f32,
    },
}

impl Optimizer {
    /// Adam's bias-corrected step size at step `t` (1-based):
    /// `lr * sqrt(1 - beta2^t) / (1 - beta1^t)`; `lr` for SGD.
    pub fn adam_step_size(&self, t: u32) -> f32 {
        match *self {
            Optimizer::Sgd { lr, .. } => lr,
            Optimizer::Adam {
                lr, beta1, beta2, ..
            } => {
                let c1 = 1.0 - beta1.powi(t as i32);
                let c2 = 1.0 - beta2.powi(t as i32);
                lr * c2.sqrt() / c1
            }
        }
    }

    /// Adam with the usual defaults and learning rate `lr`.
    pub fn adam(lr: f32) -> Self {
        Optimizer::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// Per-parameter optimizer state (moments and step count).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OptState {
    m: Vec<f32>,
    v: Vec<f32>,
    t: u32,
}

impl OptState {
    /// Applies one step of `opt` to `param` with gradient `grad`.
    ///
    /// # Panics
    /// If `param` and `grad` differ in length (buffers of one layer, sized
    /// together at plan time).
    pub fn step(&mut self, opt: &Optimizer, param: &mut [f32], grad: &[f32]) {
        assert_eq!(param.len(), grad.len(), "parameter and gradient lengths");
        if self.m.len() != param.len() {
            self.m = vec![0.0; param.len()];
            self.v = vec![0.0; param.len()];
            self.t = 0;
        }
        self.t += 1;
        match *opt {
            Optimizer::Sgd { lr, momentum } => {
                for ((p, g), v) in param.iter_mut().zip(grad).zip(&mut self.m) {
                    *v = momentum * *v + g;
                    *p -= lr * *v;
                }
            }
            Optimizer::Adam {
                beta1, beta2, eps, ..
            } => {
                let step = opt.adam_step_size(self.t);
                for (((p, g), m), v) in param.iter_mut().zip(grad).zip(&mut self.m).zip(&mut self.v)
                {
                    *m = beta1 * *m + (1.0 - beta1) * g;
                    *v = beta2 * *v + (1.0 - beta2) * g * g;
                    *p -= step * *m / (v.sqrt() + eps);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_minimise_a_quadratic() {
        for opt in [
            Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
            },
            Optimizer::adam(0.1),
        ] {
            let mut p = vec![3.0f32, -2.0];
            let mut s = OptState::default();
            for _ in 0..300 {
                let g: Vec<f32> = p.iter().map(|x| 2.0 * x).collect();
                s.step(&opt, &mut p, &g);
            }
            assert!(p.iter().all(|x| x.abs() < 1e-2), "{opt:?}: {p:?}");
        }
    }
}
