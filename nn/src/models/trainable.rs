//! What the fixed model templates ([`super::Mlp`] and
//! [`super::SeqClassifier`]) share: one training-step contract.

use brgemm_primitives::error::Result;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::threads::Pool;

/// A model a training loop steps: gradients of a minibatch, their norm (for
/// [`brgemm_primitives::guard::check_step`]), the optimizer step. Each model keeps these
/// as its own methods; the trait lets one loop (and [`Trainable::train_step`])
/// serve them all.
pub trait Trainable {
    /// What a minibatch is ([`brgemm_primitives::Blocked`] rows, a [`brgemm_primitives::Tensor4`]
    /// of images, a blocked sequence).
    type Input;
    /// Forward, loss on the first `labels.len()` rows, backward; returns
    /// the loss.
    fn compute_gradients(&mut self, pool: &Pool, x: &Self::Input, labels: &[usize]) -> Result<f32>;
    /// Applies the optimizer to every parameter.
    fn apply_gradients(&mut self, opt: &Optimizer);
    /// The L2 norm of every gradient of the last backward.
    fn gradient_norm(&self) -> f64;
    /// One training step: gradients, then the optimizer. Returns the loss.
    fn train_step(
        &mut self,
        pool: &Pool,
        x: &Self::Input,
        labels: &[usize],
        opt: &Optimizer,
    ) -> Result<f32> {
        self.checked_step(pool, x, labels, opt, None)
    }
    /// [`Trainable::train_step`] with the non-finite guard when `step` is
    /// given: a loss or gradient norm that is not finite stops with
    /// [`brgemm_primitives::Error::NonFinite`] naming the step, before the optimizer
    /// touches the weights ([`brgemm_primitives::guard::check_step`]).
    fn checked_step(
        &mut self,
        pool: &Pool,
        x: &Self::Input,
        labels: &[usize],
        opt: &Optimizer,
        step: Option<u64>,
    ) -> Result<f32> {
        let loss = self.compute_gradients(pool, x, labels)?;
        if let Some(step) = step {
            brgemm_primitives::guard::check_step(step, loss, self.gradient_norm())?;
        }
        self.apply_gradients(opt);
        Ok(loss)
    }
}

macro_rules! trainable {
    ($($t:ty => $input:ty),*) => {$(
        impl Trainable for $t {
            type Input = $input;
            fn compute_gradients(&mut self, pool: &Pool, x: &$input, labels: &[usize]) -> Result<f32> {
                <$t>::compute_gradients(self, pool, x, labels)
            }
            fn apply_gradients(&mut self, opt: &Optimizer) {
                <$t>::apply_gradients(self, opt)
            }
            fn gradient_norm(&self) -> f64 {
                <$t>::gradient_norm(self)
            }
        }
    )*};
}
trainable!(
    super::Mlp => brgemm_primitives::Blocked,
    super::SeqClassifier => brgemm_primitives::Blocked
);
