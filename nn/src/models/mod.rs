//! Ready-made networks.
//!
//! - On the layer graph: residual blocks, a small ResNet for 28x28 images,
//!   ResNet-50 ([`resnet50`]), the plain CNN of `train_cnn`
//!   ([`CnnSpec::graph`]) and the MLP ([`mlp`]).
//! - The fixed templates that own their layers' buffers directly: the
//!   stacked, bidirectional sequence classifier ([`SeqClassifier`]) and the
//!   MLP it uses as its head ([`Mlp`]), each with its parameters,
//!   gradients, optimizer state and model file ([`crate::modelfile`]); one
//!   training contract ([`Trainable`]) serves both. New code builds MLPs
//!   with [`mlp`].

mod cnn;
mod mlp;
mod resnet;
mod seqnet;
mod trainable;

pub use cnn::{CnnSpec, StageSpec};
pub use mlp::{mlp, mlp_with_tunings, LayerSpec, Mlp};
pub use resnet::{basic_block, bottleneck, resnet50, resnet50_layers, small_resnet};
pub use seqnet::{SeqClassifier, SeqSpec};
pub use trainable::Trainable;

/// The primitives' error for a bad size or setting of a template.
pub(crate) fn shape(
    what: impl Into<String>,
    value: impl ToString,
    reason: impl Into<String>,
) -> brgemm_primitives::Error {
    brgemm_primitives::Error::Shape {
        what: what.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}
