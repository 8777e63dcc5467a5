//! The model side of data parallelism: what a trainable replica offers
//! ([`Replica`]), the layer graph's implementation, and the gradient norm
//! the non-finite guard reads.

use brgemm_nn::{Graph, Tensor as NnTensor};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Error, Pool, Result};

/// A model [`DataParallel`](crate::DataParallel) can train: parameter groups whose gradients
/// become ready one group at a time during backward, highest group first.
pub trait Replica {
    /// What one minibatch looks like.
    type Input;
    /// Number of parameter groups.
    fn groups(&self) -> usize;
    /// Parameter buffers of group `g`.
    fn parameters_mut(&mut self, g: usize) -> Vec<&mut [f32]>;
    /// Gradient buffers of group `g` (same lengths as its parameters).
    fn gradients_mut(&mut self, g: usize) -> Vec<&mut [f32]>;
    /// Forward, loss and backward on the first `labels.len()` rows, calling
    /// `ready(g, grads)` as each group's gradients complete.
    fn compute_gradients_with(
        &mut self,
        pool: &Pool,
        x: &Self::Input,
        labels: &[usize],
        ready: &mut dyn FnMut(usize, &mut [&mut [f32]]),
    ) -> Result<f32>;
    /// The optimizer step on the stored gradients.
    fn apply_gradients(&mut self, opt: &Optimizer) -> Result<()>;
}

/// A layer graph's error as the primitives' (the trainer's error type):
/// the primitive's own error when it is one, else a setting named by it.
pub(crate) fn from_nn(e: brgemm_nn::Error) -> Error {
    match e {
        brgemm_nn::Error::Primitive(p) => p,
        other => Error::Setting {
            what: "layer graph".into(),
            value: other.to_string(),
            reason: "refused the step".into(),
        },
    }
}

/// Any layer graph, its layers with parameters as the groups (in order of
/// evaluation; backward completes the highest first).
impl Replica for Graph {
    type Input = NnTensor;
    fn groups(&self) -> usize {
        self.param_groups()
    }
    fn parameters_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        self.group_params_mut(g)
    }
    fn gradients_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        self.group_grads_mut(g)
    }
    fn compute_gradients_with(
        &mut self,
        pool: &Pool,
        x: &NnTensor,
        labels: &[usize],
        ready: &mut dyn FnMut(usize, &mut [&mut [f32]]),
    ) -> Result<f32> {
        Graph::compute_gradients_with(self, pool, x, labels, ready).map_err(from_nn)
    }
    fn apply_gradients(&mut self, opt: &Optimizer) -> Result<()> {
        self.step(opt).map_err(from_nn)
    }
}

/// The L2 norm of all of `model`'s gradients (the non-finite guard's).
pub(crate) fn gradient_norm<R: Replica>(model: &mut R) -> f64 {
    (0..model.groups())
        .map(|g| {
            let n = brgemm_primitives::guard::norm(model.gradients_mut(g).iter().map(|s| &**s));
            n * n
        })
        .sum::<f64>()
        .sqrt()
}
