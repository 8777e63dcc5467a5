//! Networks as graphs of layers over the BRGEMM primitives.
//!
//! A [`Layer`] is planned once for its input shape ([`Layer::build`]) and
//! then runs forward and backward on plain NCHW [`Tensor`]s; the blocking,
//! padding and weight transposes of the primitive underneath stay inside
//! it. A [`Graph`] is built node by node ([`GraphBuilder`]): a chain of
//! layers, plus branches that join by addition (residual shortcuts). Shapes
//! are checked as the graph is built, and a mismatch is an error naming
//! the layer and the shapes.
//!
//! ```
//! use brgemm::Activation;
//! use brgemm_nn::{Conv2d, GlobalAvgPool, GraphBuilder, Linear, Relu, Shape};
//!
//! // A residual block on 8-channel 6x6 inputs, then a classifier.
//! let mut g = GraphBuilder::new(Shape::new(4, 8, 6, 6));
//! let x = g.input();
//! let a = g.layer(x, Conv2d::new(8, 8, (3, 3), 1, 1, Activation::Relu, 1))?;
//! let b = g.layer(a, Conv2d::new(8, 8, (3, 3), 1, 1, Activation::Identity, 2))?;
//! let sum = g.add(b, x)?;
//! let r = g.layer(sum, Relu::new())?;
//! let p = g.layer(r, GlobalAvgPool::new())?;
//! let out = g.layer(p, Linear::new(8, 10, Activation::Identity, 3))?;
//! let net = g.build(out)?;
//! assert_eq!(net.output_shape(), Shape::flat(4, 10));
//! # Ok::<(), brgemm_nn::Error>(())
//! ```
//!
//! Between layers a tensor travels in the producing layer's blocked
//! layout, shared rather than copied, and the builder tells each layer the
//! block its input will arrive in, so batch norm, ReLU, pooling and
//! dropout work on the convolution's layout with no conversion; plain
//! values are made only when someone reads them ([`Tensor::data`]).
//! [`GraphBuilder::build`] fuses a ReLU into the batch norm before it
//! ([`GraphBuilder::fuse`]). Under mixed precision ([`Graph::set_bf16`]) a
//! layer whose output or input gradient a bf16 layer reads also writes it
//! rounded to bf16 in its own pass, so the reader rounds nothing
//! ([`Graph::set_bf16_handoff`]). [`Graph::save`] and [`Graph::load`] keep the
//! values in PyTorch's layouts in a versioned, checked file.
#![deny(missing_docs)]

mod error;
pub mod file;
mod graph;
mod layer;
mod layers;
pub mod models;
mod tensor;

pub use error::{Error, Result};
pub use file::FILE_VERSION;
pub use graph::{
    softmax_cross_entropy, Graph, GraphBuilder, NodeId, NodeInfo, NodeKind, NodeTime, ParamState,
};
pub use layer::{Affine, Layer, Mode, Param};
pub use layers::{
    BatchNorm2d, Bidirectional, Conv2d, ConvGeometry, Dropout, Flatten, GlobalAvgPool, Linear,
    Pool2dLayer, Recurrent, Relu,
};
pub use tensor::{Shape, Tensor};
