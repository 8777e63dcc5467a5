//! A plain CNN on the layer graph: convolution stages (conv, optional batch
//! norm, ReLU, optional max pooling), flatten, optional dropout and a
//! fully connected head ([`CnnSpec::graph`]).
//!
//! Until 2026-11 this was a template owning its buffers and its own
//! backward order, model file and replica; on the graph it shares the
//! graph's training loop, file and data-parallel replica. The graph draws
//! each layer's weights from its own seed (`seed + layer`), so the same
//! seed no longer gives the template's first weights, and the head reads
//! the features in NCHW order (the template read them in the blocked
//! order): runs are as good, not bit for bit the same.

use crate::error::{Error, Result};
use crate::graph::{Graph, GraphBuilder};
use crate::layers::{BatchNorm2d, Conv2d, Dropout, Linear, Pool2dLayer, Relu};
use crate::tensor::Shape;
use brgemm::Activation;

/// One convolution stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StageSpec {
    /// Output channels.
    pub channels: usize,
    /// Square filter size (padding keeps the size: `kernel / 2`).
    pub kernel: usize,
    /// Batch normalisation between the convolution and the ReLU.
    pub batchnorm: bool,
    /// Max-pooling window and stride (0 or 1: none).
    pub pool: usize,
}

/// A CNN: input geometry, stages, FC head.
#[derive(Debug, Clone, PartialEq)]
pub struct CnnSpec {
    /// Input (channels, height, width).
    pub input: (usize, usize, usize),
    /// Convolution stages, first to last.
    pub stages: Vec<StageSpec>,
    /// Hidden FC layers (ReLU).
    pub hidden: Vec<usize>,
    /// Classes (the last FC layer, identity).
    pub classes: usize,
    /// Dropout probability before the FC head (0: none).
    pub dropout: f32,
}

impl CnnSpec {
    /// The network for minibatch `batch`: per stage a `kernel x kernel`
    /// convolution (stride 1, padding `kernel / 2`, bias) with the ReLU
    /// fused into it, or followed by batch norm and ReLU; then max pooling
    /// (window and stride `pool`) when `pool > 1`. Then dropout
    /// when `dropout > 0`, the hidden FC layers (ReLU; the first flattens its
    /// input in NCHW order) and the classifier.
    /// Weights are drawn from `seed` (He initialisation).
    pub fn graph(&self, batch: usize, seed: u64) -> Result<Graph> {
        if self.stages.is_empty() {
            return Err(Error::Graph(
                "a CNN needs at least one convolution stage".into(),
            ));
        }
        let (c, h, w) = self.input;
        let mut g = GraphBuilder::new(Shape::new(batch, c, h, w));
        let mut x = g.input();
        let mut seeds = seed..;
        let mut next = || seeds.next().expect("unbounded");
        for st in &self.stages {
            let c = g.shape(x).c;
            let act = if st.batchnorm {
                Activation::Identity
            } else {
                Activation::Relu
            };
            let k = st.kernel;
            x = g.layer(
                x,
                Conv2d::new(c, st.channels, (k, k), 1, k / 2, act, next()),
            )?;
            if st.batchnorm {
                x = g.layer(x, BatchNorm2d::new(st.channels))?;
                x = g.layer(x, Relu::new())?;
            }
            if st.pool > 1 {
                x = g.layer(x, Pool2dLayer::max(st.pool, st.pool, 0))?;
            }
        }
        // Linear flattens by itself, in one pass from the blocked layout.
        if self.dropout > 0.0 {
            x = g.layer(x, Dropout::new(self.dropout, next()))?;
        }
        for (i, &out) in self.hidden.iter().chain([&self.classes]).enumerate() {
            let act = if i < self.hidden.len() {
                Activation::Relu
            } else {
                Activation::Identity
            };
            let inputs = g.shape(x).features();
            x = g.layer(x, Linear::new(inputs, out, act, next()))?;
        }
        g.build(x)
    }
}
