//! A sequence classifier as a layer graph ([`SeqSpec::graph`]): stacked,
//! optionally bidirectional LSTM/RNN layers whose final hidden states feed
//! an MLP head.
//!
//! Layer `l > 0` reads, at every step, the concatenated outputs of layer
//! `l - 1`'s directions (forward h_t, and the backward direction's output
//! for the same time t). The head reads the final state of each direction of
//! the top layer (forward: after step T-1; backward: after reading step 0).
//!
//! Until 2026-11 this was a template with its own buffers, backward order
//! and model file; on the graph it shares the training loop, the file and
//! the data-parallel replica of every graph, and runs as fast (`train_lstm`
//! alternated with the template build). Weights are drawn per direction
//! from its own seed, so a seed no longer gives the template's first
//! weights.

use crate::graph::{Graph, GraphBuilder};
use crate::layers::{Bidirectional, Linear, Recurrent};
use crate::tensor::Shape;
use brgemm::Activation;
use brgemm_primitives::rnn::CellKind;

/// What a sequence classifier looks like.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqSpec {
    /// LSTM or RNN cells.
    pub kind: CellKind,
    /// Steps per sequence.
    pub steps: usize,
    /// Features per step.
    pub features: usize,
    /// Hidden units per direction.
    pub hidden: usize,
    /// Stacked layers.
    pub layers: usize,
    /// Run every layer in both directions.
    pub bidirectional: bool,
    /// Hidden FC layers of the head (ReLU).
    pub head: Vec<usize>,
    /// Classes.
    pub classes: usize,
}

impl SeqSpec {
    /// The classifier as a layer graph for minibatch `batch`, reading
    /// sequences `(batch, features, steps, 1)`: `layers` stacked
    /// [`Recurrent`] layers (each a [`Bidirectional`] pair when
    /// `bidirectional`; every step's states feed the next layer, the top one
    /// hands on its final states), then the head's hidden FC layers (ReLU)
    /// and the classifier. Weights are drawn from `seed + i` for the i-th
    /// recurrent direction or linear layer.
    pub fn graph(&self, batch: usize, seed: u64) -> crate::Result<Graph> {
        if self.layers == 0 {
            return Err(crate::Error::Graph(
                "a sequence classifier needs at least one recurrent layer".into(),
            ));
        }
        let mut g = GraphBuilder::new(Shape::new(batch, self.features, self.steps, 1));
        let mut x = g.input();
        let mut seeds = seed..;
        let mut next = || seeds.next().expect("unbounded");
        let mut f = self.features;
        for l in 0..self.layers {
            let last = l + 1 == self.layers;
            let mut cell = |f| match self.kind {
                CellKind::Lstm => Recurrent::lstm(f, self.hidden, next()),
                CellKind::Rnn => Recurrent::rnn(f, self.hidden, next()),
            };
            x = if self.bidirectional {
                let b = Bidirectional::new(cell(f), cell(f));
                g.layer(x, if last { b.last_only() } else { b })?
            } else {
                let r = cell(f);
                g.layer(x, if last { r.last_only() } else { r })?
            };
            f = g.shape(x).c;
        }
        for (i, &out) in self.head.iter().chain([&self.classes]).enumerate() {
            let act = if i < self.head.len() {
                Activation::Relu
            } else {
                Activation::Identity
            };
            x = g.layer(x, Linear::new(f, out, act, next()))?;
            f = out;
        }
        g.build(x)
    }
}
