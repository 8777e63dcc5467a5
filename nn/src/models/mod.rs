//! Ready-made networks, as layer graphs: residual blocks, a small ResNet
//! for 28x28 images, ResNet-50 ([`resnet50`]), the plain CNN of
//! `train_cnn` ([`CnnSpec::graph`]), the MLP ([`mlp`]) and the stacked,
//! optionally bidirectional sequence classifier ([`SeqSpec::graph`]).
//!
//! Every one is a [`crate::Graph`]: one training step, one file
//! ([`crate::Graph::save`]), one data-parallel replica.

mod cnn;
mod mlp;
mod resnet;
mod seqnet;

pub use cnn::{CnnSpec, StageSpec};
pub use mlp::{mlp, mlp_with_tunings, LayerSpec};
pub use resnet::{basic_block, bottleneck, resnet50, resnet50_layers, small_resnet};
pub use seqnet::SeqSpec;
