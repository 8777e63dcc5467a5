//! Optimizers: SGD with momentum and Adam, on flat parameter buffers.
//!
//! Parameters and gradients are the blocked buffers themselves: the update
//! is element-wise, so the layout does not matter, and zero padding stays
//! zero (its gradient is always zero).

use crate::math::widest;

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

    /// Checks the hyper-parameters: a NaN or infinite learning rate would
    /// train "successfully" into all-NaN weights.
    pub fn validate(&self) -> crate::Result<()> {
        use crate::error::setting;
        let finite_pos = |what: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(setting(what, v, "must be finite and above 0"))
            }
        };
        let unit = |what: &str, v: f32| {
            if (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(setting(what, v, "must be in [0, 1)"))
            }
        };
        match *self {
            Optimizer::Sgd { lr, momentum } => {
                finite_pos("learning rate", lr)?;
                unit("momentum", momentum)
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => {
                finite_pos("learning rate", lr)?;
                unit("beta1", beta1)?;
                unit("beta2", beta2)?;
                finite_pos("eps", eps)
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
    /// The state as it stands: first and second moments (empty before the
    /// first step; SGD keeps its momentum in the first) and the step count.
    pub fn parts(&self) -> (&[f32], &[f32], u32) {
        (&self.m, &self.v, self.t)
    }

    /// A state from [`OptState::parts`] (a checkpoint's). The moments must
    /// have the length of the parameter they follow, or be empty.
    pub fn from_parts(m: Vec<f32>, v: Vec<f32>, t: u32) -> OptState {
        OptState { m, v, t }
    }

    /// Applies one step of `opt` to `param` with gradient `grad`.
    ///
    /// # Panics
    /// If `param` and `grad` differ in length (buffers of one layer, sized
    /// together by the caller).
    pub fn step(&mut self, opt: &Optimizer, param: &mut [f32], grad: &[f32]) {
        assert_eq!(param.len(), grad.len(), "parameter and gradient lengths");
        let rule = self.begin(opt, param.len());
        // Moments of a converged model go subnormal (`fpenv`).
        let _flush = crate::engine::fpenv::flush();
        // SAFETY: the whole parameter, on this thread alone.
        unsafe { rule.apply(0, param, grad) };
    }

    /// [`OptState::step`] split over `pool`'s threads in contiguous shares
    /// (on the caller alone below the pool's small-work size): the update
    /// streams the parameter, its gradient and its moments from memory,
    /// and two cores draw more bandwidth than one.
    ///
    /// # Panics
    /// As [`OptState::step`].
    pub fn step_on(
        &mut self,
        pool: &crate::threads::Pool,
        opt: &Optimizer,
        param: &mut [f32],
        grad: &[f32],
    ) {
        assert_eq!(param.len(), grad.len(), "parameter and gradient lengths");
        let rule = self.begin(opt, param.len());
        pool.for_slices(param, |at, part| {
            // SAFETY: the shares of one parameter are disjoint, each on
            // one thread; `at + part.len()` stays inside it.
            unsafe { rule.apply(at, part, &grad[at..at + part.len()]) }
        });
    }

    /// Starts one step of `opt` on a parameter of `len` elements (moments
    /// sized and the step counted once), to be applied block by block as
    /// the gradient's blocks complete ([`BlockStep::apply`]): the fused
    /// update of a backward-weights pass, whose gradient never goes to
    /// memory whole.
    pub(crate) fn begin(&mut self, opt: &Optimizer, len: usize) -> BlockStep<'_> {
        if self.m.len() != len {
            self.m = vec![0.0; len];
            self.v = vec![0.0; len];
            self.t = 0;
        }
        self.t += 1;
        BlockStep {
            opt: *opt,
            step: opt.adam_step_size(self.t),
            m: self.m.as_mut_ptr(),
            v: self.v.as_mut_ptr(),
            len,
            _state: std::marker::PhantomData,
        }
    }
}

/// One optimizer step under way on one parameter ([`OptState::begin`]):
/// applied to disjoint ranges of it, from any threads.
pub(crate) struct BlockStep<'a> {
    opt: Optimizer,
    step: f32,
    m: *mut f32,
    v: *mut f32,
    len: usize,
    _state: std::marker::PhantomData<&'a mut OptState>,
}

// SAFETY: the moments are written through `apply` only, whose callers give
// each range to one thread.
unsafe impl Send for BlockStep<'_> {}
unsafe impl Sync for BlockStep<'_> {}

impl BlockStep<'_> {
    /// Updates `param` (the parameter's elements `at..at + param.len()`)
    /// with their gradient `grad`, and the moments of those elements.
    ///
    /// # Safety
    /// `at + param.len()` is at most the parameter's length, `grad` is as
    /// long as `param`, and no other thread updates an overlapping range
    /// during the call.
    #[inline]
    pub(crate) unsafe fn apply(&self, at: usize, param: &mut [f32], grad: &[f32]) {
        let n = param.len();
        debug_assert!(at + n <= self.len && grad.len() == n);
        let m = std::slice::from_raw_parts_mut(self.m.add(at), n);
        match self.opt {
            Optimizer::Sgd { lr, momentum } => sgd(param, grad, m, lr, momentum),
            Optimizer::Adam {
                beta1, beta2, eps, ..
            } => {
                let v = std::slice::from_raw_parts_mut(self.v.add(at), n);
                adam(param, grad, m, v, [beta1, beta2, eps, self.step]);
            }
        }
    }
}

// The update loops, compiled per ISA: Adam's sqrt and division ran 4-wide
// (SSE2) in the baseline build.
widest! {
    /// v = momentum v + g; p -= lr v.
    fn sgd / sgd_plain(param: &mut [f32], grad: &[f32], vel: &mut [f32], lr: f32, momentum: f32) {
        let n = param.len();
        let (grad, vel) = (&grad[..n], &mut vel[..n]);
        for i in 0..n {
            vel[i] = momentum * vel[i] + grad[i];
            param[i] -= lr * vel[i];
        }
    }
}

widest! {
    /// Adam's moments and step; `h` = (beta1, beta2, eps, bias-corrected step size).
    fn adam / adam_plain(
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        h: [f32; 4],
    ) {
        let [beta1, beta2, eps, step] = h;
        let n = param.len();
        let (grad, m, v) = (&grad[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            let g = grad[i];
            m[i] = beta1 * m[i] + (1.0 - beta1) * g;
            v[i] = beta2 * v[i] + (1.0 - beta2) * g * g;
            param[i] -= step * m[i] / (v[i].sqrt() + eps);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update split over threads is the update on one, bit for bit.
    #[test]
    fn a_step_over_threads_equals_the_step_on_one() {
        let pool = crate::threads::Pool::new(2).unwrap().always_parallel();
        let n = 1001;
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 29) % 23) as f32 / 11.0 - 1.0)
            .collect();
        for opt in [
            Optimizer::Sgd {
                lr: 0.1,
                momentum: 0.9,
            },
            Optimizer::adam(0.01),
        ] {
            let mut p1: Vec<f32> = (0..n).map(|i| ((i * 7) % 13) as f32 / 4.0).collect();
            let mut p2 = p1.clone();
            let (mut s1, mut s2) = (OptState::default(), OptState::default());
            for _ in 0..3 {
                s1.step(&opt, &mut p1, &g);
                s2.step_on(&pool, &opt, &mut p2, &g);
            }
            assert_eq!(p1, p2, "{opt:?}");
            assert_eq!(s1, s2, "{opt:?}");
        }
    }

    #[test]
    fn dispatched_updates_equal_plain_loops() {
        let n = 1001;
        let g: Vec<f32> = (0..n).map(|i| ((i * 31) % 17) as f32 / 8.0 - 1.0).collect();
        let p0: Vec<f32> = (0..n).map(|i| ((i * 7) % 13) as f32 / 4.0 - 1.5).collect();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (mut p1, mut p2) = (p0.clone(), p0.clone());
        let (mut m1, mut m2) = (vec![0.1f32; n], vec![0.1f32; n]);
        let (mut v1, mut v2) = (vec![0.2f32; n], vec![0.2f32; n]);
        let h = [0.9, 0.999, 1e-8, 0.01];
        adam(&mut p1, &g, &mut m1, &mut v1, h);
        adam_plain(&mut p2, &g, &mut m2, &mut v2, h);
        assert_eq!(
            (bits(&p1), bits(&m1), bits(&v1)),
            (bits(&p2), bits(&m2), bits(&v2))
        );
        sgd(&mut p1, &g, &mut m1, 0.1, 0.9);
        sgd_plain(&mut p2, &g, &mut m2, 0.1, 0.9);
        assert_eq!((bits(&p1), bits(&m1)), (bits(&p2), bits(&m2)));
    }

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
