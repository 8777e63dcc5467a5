//! Mixed precision across a graph: which layers run bf16, and which
//! values go from layer to layer as bf16 copies or in bf16 alone.

use super::{Graph, Op};
use crate::error::{Error, Result};
#[cfg(doc)]
use crate::layer::Layer;

impl Graph {
    /// Mixed precision on or off for every layer that has bf16 passes
    /// ([`Layer::set_bf16`]); returns how many run them. A layer that cannot
    /// is an error naming it (the layers before it are switched already).
    /// Layers may be planned again with other blocks, which reorders their
    /// parameters; the optimizer's moments start afresh, as after every
    /// change to the layers.
    pub fn set_bf16(&mut self, on: bool) -> Result<usize> {
        let mut n = 0;
        let set = self.layers_mut().try_for_each(|l| {
            n += usize::from(l.set_bf16(on)?);
            Ok::<_, Error>(())
        });
        self.link_bf16();
        set.map(|_| n)
    }

    /// Whether a layer whose output (or input gradient) a bf16 layer reads
    /// writes it in bf16 too, in its own pass (batch norm, and a bf16
    /// linear layer's forward), so that the reader runs no rounding sweep
    /// of its own and, without padding, reads it in place. On by default;
    /// the results are the same bits either way (both round to nearest
    /// even), off is for measuring what it saves.
    pub fn set_bf16_handoff(&mut self, on: bool) {
        self.handoff = on;
        self.link_bf16();
    }

    /// How many layers write bf16 copies for bf16 readers as the graph is
    /// planned now, an output and an input gradient counting one each.
    pub fn bf16_handoffs(&self) -> usize {
        self.handoffs
    }

    /// Whether a layer whose readers all take its output in bf16 alone
    /// writes only that, and a layer whose input gradient goes to a layer
    /// that reads it so writes only that ([`Layer::reads_bf16_only`],
    /// [`Layer::write_bf16_only`]): a bf16 convolution before its batch
    /// norm writes half the bytes, forward and backward (at stride 1),
    /// and the batch norm reads half. On by default. Unlike the copies of
    /// [`Graph::set_bf16_handoff`] it changes what the readers see: the
    /// batch norm normalises the convolution's output rounded to bf16, and
    /// its backward takes the gradient rounded (as PyTorch's autocast hands
    /// them over). Off keeps them f32.
    pub fn set_bf16_only_outputs(&mut self, on: bool) {
        self.bf16_alone = on;
        self.link_bf16();
    }

    /// How many outputs and input gradients layers write in bf16 alone, as
    /// the graph is planned now ([`Graph::set_bf16_only_outputs`]), an
    /// output and an input gradient counting one each.
    pub fn bf16_only_outputs(&self) -> usize {
        self.bf16_only
    }

    /// Tells each layer which bf16 copies its readers want
    /// ([`Layer::reads_bf16`], [`Layer::write_bf16`]): its output, where a
    /// reader takes bf16 input (through a fused ReLU, or an add the layer
    /// joins, its readers are theirs); its input gradient, where its sole
    /// input's sole reader is it and that input's layer reads its output
    /// gradient in bf16.
    pub(super) fn link_bf16(&mut self) {
        let n = self.nodes.len();
        let mut readers = vec![0usize; n];
        for node in &self.nodes {
            node.inputs.iter().for_each(|&j| readers[j] += 1);
        }
        // The node whose pass writes node j's output.
        let writer = |mut j: usize| loop {
            match (&self.nodes[j].op, self.nodes[j].join) {
                _ if self.nodes[j].fused => j = self.nodes[j].inputs[0],
                (Op::Add, Some((p, _))) => j = p,
                _ => return j,
            }
        };
        let reads = |i: usize| match &self.nodes[i].op {
            Op::Layer(l) if !self.nodes[i].fused => l.reads_bf16(),
            _ => (false, false),
        };
        let mut out = vec![false; n];
        for i in 1..n {
            out[writer(self.nodes[i].inputs[0])] |= reads(i).0 && self.handoff;
        }
        // Node i, j's sole reader, writes j's output gradient (unless j
        // reads the graph's input: a training step skips its backward-data).
        let dx: Vec<bool> = (0..n)
            .map(|i| {
                let j = self.nodes[i].inputs.first().copied().unwrap_or(0);
                let sole = readers[j] == 1 && j != 0 && self.nodes[j].inputs[0] != 0;
                let layer = matches!(self.nodes[i].op, Op::Layer(_)) && !self.nodes[i].fused;
                sole && layer && reads(j).1 && self.handoff
            })
            .collect();
        // Node j's output in bf16 alone where every reader takes it so
        // (a batch norm after a bf16 convolution, a convolution updating in
        // bf16 after a batch norm): no reader joins it, and there is one
        // (not the graph's output).
        // A ReLU fused into j passes j's output on: its readers count as
        // j's (readers come after, so they are settled first).
        let mut only = vec![self.bf16_alone; n];
        only[0] = false;
        for i in (1..n).rev() {
            let node = &self.nodes[i];
            let takes = match &node.op {
                _ if node.fused => only[i] && readers[i] > 0,
                Op::Layer(l) => l.reads_bf16_only().0,
                _ => false,
            };
            node.inputs.iter().for_each(|&j| only[j] &= takes);
        }
        // Node i's input gradient in bf16 alone where the layer that
        // receives it (through fused ReLUs) reads it so and nothing else
        // (a bf16 convolution's dX for the batch norm before it, a batch
        // norm's dx for the bf16 convolution before it).
        let takes_dx = |mut j: usize| {
            while self.nodes[j].fused && readers[j] == 1 {
                j = self.nodes[j].inputs[0];
            }
            let node = &self.nodes[j];
            j != 0
                && readers[j] == 1
                && !node.fused
                && matches!(&node.op, Op::Layer(l) if l.reads_bf16_only().1)
        };
        let dx_only: Vec<bool> = (0..n)
            .map(|i| {
                let j = self.nodes[i].inputs.first().copied().unwrap_or(0);
                self.bf16_alone && i > 0 && !self.nodes[i].fused && takes_dx(j)
            })
            .collect();
        self.handoffs = 0;
        self.bf16_only = 0;
        for (i, node) in self.nodes.iter_mut().enumerate() {
            if let Op::Layer(l) = &mut node.op {
                // Values in bf16 alone need no bf16 copy besides.
                let (oa, da) = l.write_bf16_only(only[i] && readers[i] > 0, dx_only[i]);
                self.bf16_only += usize::from(oa) + usize::from(da);
                let (o, d) = l.write_bf16(out[i] && !oa, dx[i] && !da);
                self.handoffs += usize::from(o) + usize::from(d);
            }
        }
    }
}
