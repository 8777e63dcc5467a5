//! The fixed model templates built from the layers: [`model::Mlp`],
//! [`cnn::Cnn`] and [`seqnet::SeqClassifier`], each owning its parameters,
//! gradients and optimizer state.

pub mod cnn;
pub mod model;
pub mod seqnet;

use crate::error::Result;
use crate::optim::Optimizer;
use crate::threads::Pool;

/// A model a training loop steps: gradients of a minibatch, their norm (for
/// [`crate::guard::check_step`]), the optimizer step. Each model keeps these
/// as its own methods; the trait lets one loop (and [`Trainable::train_step`])
/// serve them all.
pub trait Trainable {
    /// What a minibatch is ([`crate::Blocked`] rows, a [`crate::Tensor4`]
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
    /// [`crate::Error::NonFinite`] naming the step, before the optimizer
    /// touches the weights ([`crate::guard::check_step`]).
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
            crate::guard::check_step(step, loss, self.gradient_norm())?;
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
    model::Mlp => crate::Blocked,
    cnn::Cnn => crate::Tensor4,
    seqnet::SeqClassifier => crate::Blocked
);
