//! Building a graph: nodes added after their inputs, shapes checked as
//! they come, and at the end the fusions the data allow (a ReLU into the
//! pass before it, batch norm folded into its convolution, a residual
//! join into the layer producing one of its inputs).

use super::{Graph, Node, NodeId, Op};
use crate::error::{Error, Result};
use crate::layer::Layer;
use crate::tensor::Shape;
use std::time::Duration;

/// Builds a [`Graph`]: every node is added after its inputs, so the order
/// of addition is an order of evaluation.
pub struct GraphBuilder {
    nodes: Vec<Node>,
    fuse: bool,
}

impl GraphBuilder {
    /// A graph whose input has `shape` (minibatch included).
    pub fn new(shape: Shape) -> GraphBuilder {
        GraphBuilder {
            nodes: vec![Node::new(Op::Input, vec![], shape, None)],
            fuse: true,
        }
    }

    /// Whether [`GraphBuilder::build`] fuses layers where the data allow
    /// it (on by default): a ReLU that alone reads a batch norm's output
    /// runs inside the batch norm's pass ([`Layer::fuse_relu`]), one that
    /// alone reads a residual join inside the add's pass, and in
    /// inference a batch norm that alone reads a convolution's output is
    /// folded into its weights ([`Layer::fold_affine`]). Off gives the same
    /// results (to rounding) from separate passes, to measure the gain.
    pub fn fuse(mut self, on: bool) -> GraphBuilder {
        self.fuse = on;
        self
    }

    /// The input node.
    pub fn input(&self) -> NodeId {
        NodeId(0)
    }

    /// The output shape of `node`.
    pub fn shape(&self, node: NodeId) -> Shape {
        self.nodes[node.0].shape
    }

    fn check(&self, node: NodeId) -> Result<()> {
        if node.0 < self.nodes.len() {
            Ok(())
        } else {
            Err(Error::Graph(format!(
                "node {} is not in this graph",
                node.0
            )))
        }
    }

    /// Adds `layer` fed by `from`, planned for `from`'s output shape; a
    /// shape the layer cannot take is an error naming both.
    pub fn layer(&mut self, from: NodeId, mut layer: impl Layer + 'static) -> Result<NodeId> {
        self.check(from)?;
        layer.input_block(self.nodes[from.0].block);
        let shape = layer.build(self.shape(from))?;
        let block = layer.output_block();
        self.nodes.push(Node::new(
            Op::Layer(Box::new(layer)),
            vec![from.0],
            shape,
            block,
        ));
        Ok(NodeId(self.nodes.len() - 1))
    }

    /// Adds `a + b` (the residual join); their shapes must be equal.
    pub fn add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.check(a)?;
        self.check(b)?;
        let (left, right) = (self.shape(a), self.shape(b));
        if left != right {
            return Err(Error::Join {
                node: self.nodes.len(),
                left,
                right,
            });
        }
        let (ba, bb) = (self.nodes[a.0].block, self.nodes[b.0].block);
        let block = if ba == bb { ba } else { None };
        self.nodes
            .push(Node::new(Op::Add, vec![a.0, b.0], left, block));
        Ok(NodeId(self.nodes.len() - 1))
    }

    /// The graph computing `output`. Every node must contribute to it (a
    /// layer that does not would train on stale gradients).
    pub fn build(self, output: NodeId) -> Result<Graph> {
        self.check(output)?;
        let mut used = vec![false; self.nodes.len()];
        used[output.0] = true;
        for i in (0..=output.0).rev() {
            if used[i] {
                for &j in &self.nodes[i].inputs {
                    used[j] = true;
                }
            }
        }
        if let Some(i) = used.iter().position(|u| !u) {
            let what = match &self.nodes[i].op {
                Op::Layer(l) => l.name(),
                Op::Add => "add".into(),
                Op::Input => "input".into(),
            };
            return Err(Error::Graph(format!(
                "node {i} ({what}) does not reach the output node {}",
                output.0
            )));
        }
        let n = output.0 + 1;
        let mut nodes = self.nodes;
        nodes.truncate(n);
        if self.fuse {
            fuse_relus(&mut nodes);
            mark_foldable(&mut nodes);
            mark_joins(&mut nodes);
        }
        let mut count = 0;
        let groups = nodes
            .iter_mut()
            .map(|n| match &mut n.op {
                Op::Layer(l) => (!l.params().is_empty()).then(|| {
                    count += 1;
                    count - 1
                }),
                _ => None,
            })
            .collect();
        let mut g = Graph {
            groups,
            nodes,
            acts: vec![None; n],
            opt: Vec::new(),
            times: vec![[Duration::ZERO; 2]; n],
            stale: true,
            fused_update: false,
            handoff: true,
            handoffs: 0,
            bf16_alone: true,
            bf16_only: 0,
        };
        g.link_bf16();
        Ok(g)
    }
}

/// Lets a layer apply the ReLU that alone reads its output (batch norm
/// then ReLU: one pass over the tensor instead of two, each way).
fn fuse_relus(nodes: &mut [Node]) {
    let mut readers = vec![0usize; nodes.len()];
    for n in nodes.iter() {
        n.inputs.iter().for_each(|&j| readers[j] += 1);
    }
    for i in 1..nodes.len() {
        let j = nodes[i].inputs[0];
        let relu = matches!(&nodes[i].op, Op::Layer(l) if l.is_relu());
        if !relu || readers[j] != 1 || nodes[j].fused {
            continue;
        }
        match &mut nodes[j].op {
            Op::Layer(producer) => nodes[i].fused = producer.fuse_relu(),
            Op::Add => {
                nodes[j].relu = true;
                nodes[i].fused = true;
            }
            Op::Input => {}
        }
    }
}

/// Marks the affine layers (batch norm) whose input layer alone feeds
/// them: candidates for folding into that layer in inference.
fn mark_foldable(nodes: &mut [Node]) {
    let mut readers = vec![0usize; nodes.len()];
    for n in nodes.iter() {
        n.inputs.iter().for_each(|&j| readers[j] += 1);
    }
    for i in 1..nodes.len() {
        let j = nodes[i].inputs[0];
        let affine = matches!(&nodes[i].op, Op::Layer(l) if l.affine().is_some());
        let producer = matches!(nodes[j].op, Op::Layer(_));
        nodes[i].foldable = affine && producer && readers[j] == 1 && !nodes[i].fused;
    }
}

/// Marks the adds whose join the layer producing one input may do in its
/// output pass: that input read by the add alone, the other computed
/// before the layer runs.
fn mark_joins(nodes: &mut [Node]) {
    let mut readers = vec![0usize; nodes.len()];
    for n in nodes.iter() {
        n.inputs.iter().for_each(|&j| readers[j] += 1);
    }
    for i in 1..nodes.len() {
        if !matches!(nodes[i].op, Op::Add) {
            continue;
        }
        let (a, b) = (nodes[i].inputs[0], nodes[i].inputs[1]);
        let can = |p: usize, r: usize| {
            let n = &nodes[p];
            p != 0 && r < p && readers[p] == 1 && !n.fused && matches!(n.op, Op::Layer(_))
        };
        nodes[i].join = if can(a, b) {
            Some((a, b))
        } else if can(b, a) {
            Some((b, a))
        } else {
            None
        };
    }
}
