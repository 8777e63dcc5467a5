//! Errors of the layer graph: each names the layer and the shapes involved.

use crate::tensor::Shape;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A layer cannot take an input of this shape.
    #[error("layer {layer}: input {input} {reason}")]
    Shape {
        /// The layer, as [`crate::Layer::name`] gives it.
        layer: String,
        /// The input shape it was given.
        input: Shape,
        /// Why it is refused.
        reason: String,
    },
    /// A residual join of two different shapes.
    #[error("add (node {node}): shapes {left} and {right} differ")]
    Join {
        /// The node the join would have been.
        node: usize,
        /// The first input's shape.
        left: Shape,
        /// The second input's shape.
        right: Shape,
    },
    /// A tensor handed to the graph does not have the shape it was built for.
    #[error("{what}: expected shape {expected}, got {got}")]
    Tensor {
        /// Which tensor.
        what: String,
        /// The shape the graph was built for.
        expected: Shape,
        /// The shape given.
        got: Shape,
    },
    /// The graph is used out of order (backward before forward, a node id
    /// of another graph).
    #[error("graph: {0}")]
    Graph(String),
    /// A primitive refused a plan or a call.
    #[error(transparent)]
    Primitive(#[from] brgemm_primitives::Error),
}
