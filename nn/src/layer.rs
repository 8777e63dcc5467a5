//! The layer contract: plan for an input shape, forward, backward, and the
//! parameters with their gradients.

use crate::error::Result;
use crate::tensor::{Shape, Tensor};
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::Pool;

/// Training or inference: layers with state that differs between the two
/// (batch norm, dropout) read it; the others ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Keep what backward needs; batch statistics.
    Train,
    /// Inference.
    Eval,
}

/// A per-channel `y = x * scale + shift` (then ReLU when `relu`): what
/// batch norm computes in inference, which the convolution before it can
/// fold into its weights and bias ([`Layer::fold_affine`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Affine {
    /// Per channel.
    pub scale: Vec<f32>,
    /// Per channel.
    pub shift: Vec<f32>,
    /// A ReLU after the affine map.
    pub relu: bool,
}

/// One parameter tensor of a layer and its gradient, in the layer's own
/// storage (which may be blocked and zero-padded: an element-wise
/// optimizer step does not care, and the padding's gradient is zero).
#[derive(Debug)]
pub struct Param<'a> {
    /// What it is, e.g. `"weight"` or `"bias"`.
    pub name: &'static str,
    /// The values.
    pub value: &'a mut [f32],
    /// dL/d(values) of the last backward.
    pub grad: &'a mut [f32],
}

/// A layer of a network: one input, one output, planned once for an input
/// shape. Inputs and outputs are plain NCHW [`Tensor`]s; blocking, padding
/// and weight transposes stay inside.
///
/// `Any` as a supertrait lets a graph hand back a layer as its own type
/// ([`crate::Graph::layer_mut`]), e.g. to set a recurrent layer's state.
pub trait Layer: std::any::Any + Send {
    /// A short description for errors and tables, e.g. `conv2d 3x3 64->64`.
    fn name(&self) -> String;

    /// Plans the layer for inputs of `input` and returns its output shape.
    /// A shape the layer cannot take is an error naming the layer and the
    /// shape ([`crate::Error::Shape`]).
    fn build(&mut self, input: Shape) -> Result<Shape>;

    /// The output for `x` (of the built input shape). In [`Mode::Train`]
    /// the layer keeps what its backward needs.
    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor>;

    /// dL/dx for dL/dy of the last training forward; writes the parameter
    /// gradients (overwriting the previous step's).
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor>;

    /// Backward when dL/dx is not wanted (the layer reads the graph's
    /// input in a training step): the parameter gradients only. Layers
    /// that can skip their backward-data pass override it; by default it
    /// is [`Layer::backward`] with the result dropped.
    fn backward_params(&mut self, pool: &Pool, dy: &Tensor) -> Result<()> {
        self.backward(pool, dy).map(drop)
    }

    /// How many parameters [`Layer::params`] hands out, without handing
    /// them out (a layer that keeps derived copies of its weights, such as
    /// bf16 packings, makes them again after a `params` call, since the
    /// caller may have written them).
    fn param_count(&mut self) -> usize {
        self.params().len()
    }

    /// Whether [`Layer::backward_step`] fuses the optimizer step into this
    /// layer's backward as it is planned now. False by default.
    fn fuses_update(&self) -> bool {
        false
    }

    /// Told by [`crate::Graph::set_fused_update`] whether the optimizer
    /// step will be fused into backward ([`Layer::backward_step`]), for a
    /// layer whose choice of precision depends on it (a bf16 linear layer
    /// pays from fewer rows when the fused step packs its weights).
    /// Ok(true) when its plan changed, which moves its parameters' layout;
    /// false (the default) when it did not.
    fn plan_fused_update(&mut self, _on: bool) -> Result<bool> {
        Ok(false)
    }

    /// Backward with the optimizer step fused in ([`crate::Graph::set_fused_update`]):
    /// dL/dx when `input` (computed before any weight moves), and every
    /// parameter stepped by `opt` with its state in `states` (in
    /// [`Layer::params`] order) as its gradient completes, so no weight
    /// gradient goes to memory whole. Only where [`Layer::fuses_update`].
    fn backward_step(
        &mut self,
        _pool: &Pool,
        _dy: &Tensor,
        _input: bool,
        _opt: &Optimizer,
        _states: &mut [OptState],
    ) -> Result<Option<Tensor>> {
        Err(crate::Error::Graph(format!(
            "{} has no fused optimizer step",
            self.name()
        )))
    }

    /// Mixed precision on or off: bf16 operands in the layer's forward and
    /// backward-data passes, f32 master weights, weight gradients and
    /// optimizer. Ok(true) when the layer now runs them, Ok(false) when it
    /// has no such passes, none in bf16 yet, or none whose bf16 kernel beats
    /// f32 on this CPU ([`brgemm::bf16::Bf16Isa::beats_f32`]; it stays f32,
    /// the default), an error naming why when it cannot (e.g. odd blocks,
    /// GELU).
    fn set_bf16(&mut self, _on: bool) -> Result<bool> {
        Ok(false)
    }

    /// What the layer, as planned now, reads in bf16: its input in forward
    /// and its output gradient in backward. The graph asks the layers that
    /// write those to write them in bf16 too ([`Layer::write_bf16`]), so no
    /// rounding sweep runs between the two. (false, false) by default.
    fn reads_bf16(&self) -> (bool, bool) {
        (false, false)
    }

    /// Asked by the graph: write the output (`out`), and in backward the
    /// input gradient (`dx`), rounded to bf16 too, in the same pass, for
    /// the bf16 layer that reads it ([`Layer::reads_bf16`]); false turns it
    /// off. Returns which of the two the layer writes; (false, false) by
    /// default, where the reader rounds what it reads itself.
    fn write_bf16(&mut self, _out: bool, _dx: bool) -> (bool, bool) {
        (false, false)
    }

    /// Whether the layer reads its input in forward, and its output
    /// gradient in backward, in bf16 alone (a tensor whose values exist
    /// only in bf16, [`Tensor::is_bf16_only`]) as fast as f32: batch norm
    /// both (the same arithmetic on the widened values), a bf16
    /// convolution its output gradient where its backward-weights runs
    /// bf16 (its bf16 passes read dY rounded anyway). Other layers get such
    /// a tensor widened. (false, false) by default.
    fn reads_bf16_only(&self) -> (bool, bool) {
        (false, false)
    }

    /// Asked by the graph where the readers take bf16 alone
    /// ([`Layer::reads_bf16_only`]): write the output (`out`: every reader
    /// of it does), and in backward the input gradient (`dx`: the input's
    /// layer does, and reads nothing else), in bf16 only, rounded from the
    /// f32 sums in the same pass; false turns it off. Returns which of the
    /// two the layer, as planned now, does: a bf16 convolution, its output
    /// without an activation (whose backward would read it), its input
    /// gradient at stride 1. (false, false) by default.
    fn write_bf16_only(&mut self, _out: bool, _dx: bool) -> (bool, bool) {
        (false, false)
    }

    /// The parameters and their gradients, in the order backward completes
    /// them (weights, then bias). None by default.
    fn params(&mut self) -> Vec<Param<'_>> {
        Vec::new()
    }

    /// The channel block of the blocked layout the output travels in once
    /// built, or None for plain NCHW. The graph tells the next layer
    /// ([`Layer::input_block`]) so that the two agree and no conversion
    /// runs between them. None by default.
    fn output_block(&self) -> Option<usize> {
        None
    }

    /// Told before [`Layer::build`] which block the input will arrive in
    /// (the producer's [`Layer::output_block`]). Layers without a layout
    /// of their own (batch norm, ReLU, pooling) adopt it; any other input
    /// is still accepted, converted. Ignored by default.
    fn input_block(&mut self, _block: Option<usize>) {}

    /// The layer's learned values and statistics in plain layouts
    /// (PyTorch's order), by name: what a saved graph holds
    /// ([`crate::Graph::save`]). None by default.
    fn export(&self) -> Vec<(&'static str, Vec<f32>)> {
        Vec::new()
    }

    /// Sets what [`Layer::export`] gives, all of it, in its order; a
    /// missing or unknown name or a wrong length is an error naming it.
    fn import(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        match values.first() {
            None => Ok(()),
            Some((name, _)) => Err(crate::Error::Graph(format!(
                "{}: holds no values, got {name:?}",
                self.name()
            ))),
        }
    }

    /// Whether the layer is exactly `max(x, 0)` element-wise, so that the
    /// layer before it may apply it in its own output pass
    /// ([`Layer::fuse_relu`]). False by default.
    fn is_relu(&self) -> bool {
        false
    }

    /// Asks the layer to apply a ReLU to its output in the same pass (and
    /// its mask in backward); true when it does, and the graph then skips
    /// the ReLU layer that followed. Offered only when this layer's output
    /// feeds that ReLU alone. False by default.
    fn fuse_relu(&mut self) -> bool {
        false
    }

    /// The forward with the residual join that alone reads this layer's
    /// output done in the same pass: `layer(x) + r`, then a ReLU when
    /// `relu`. Ok(None) where the layer cannot (or `r` does not travel in
    /// its output layout), and the graph adds in a pass of its own. The
    /// layer's backward then receives the gradient through the join, which
    /// the graph forms as for a separate add. None by default.
    fn forward_add(
        &mut self,
        _pool: &Pool,
        _x: &Tensor,
        _r: &Tensor,
        _relu: bool,
        _mode: Mode,
    ) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// The inference-mode map of a per-channel affine layer (batch norm),
    /// for the layer before it to fold ([`Layer::fold_affine`]). None by
    /// default.
    fn affine(&self) -> Option<Affine> {
        None
    }

    /// Folds `affine` (the next layer's inference map, which alone reads
    /// this layer's output) into this layer for [`Mode::Eval`] forwards,
    /// or with None forgets a fold; true when the layer did. The graph
    /// then skips the affine layer in inference and folds again whenever
    /// weights or statistics may have changed. Training is not affected.
    /// False by default.
    fn fold_affine(&mut self, _affine: Option<&Affine>) -> bool {
        false
    }

    /// Floating-point operations of one forward of the built layer counted
    /// as multiply-adds x 2 (convolutions and linear layers; 0 for the
    /// element-wise ones, which bandwidth limits).
    fn flops(&self) -> f64 {
        0.0
    }
}
