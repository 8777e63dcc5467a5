//! Network builders on the graph: residual blocks and a small ResNet.

use crate::error::Result;
use crate::graph::{Graph, GraphBuilder, NodeId};
use crate::layers::{BatchNorm2d, Conv2d, GlobalAvgPool, Linear, Relu};
use crate::tensor::Shape;
use brgemm::Activation;

/// A basic residual block (He et al. 2016): 3x3 conv (with `stride`) ->
/// batch norm -> ReLU -> 3x3 conv -> batch norm, plus the shortcut, then
/// ReLU. The shortcut is `from` itself when shapes agree, else a 1x1
/// projection with `stride` and batch norm. `seed` draws the weights.
pub fn basic_block(
    g: &mut GraphBuilder,
    from: NodeId,
    out_c: usize,
    stride: usize,
    seed: u64,
) -> Result<NodeId> {
    let in_c = g.shape(from).c;
    let conv = |i, o, k, s, p, n| Conv2d::new(i, o, (k, k), s, p, Activation::Identity, seed + n);
    let a = g.layer(from, conv(in_c, out_c, 3, stride, 1, 0))?;
    let a = g.layer(a, BatchNorm2d::new(out_c))?;
    let a = g.layer(a, Relu::new())?;
    let a = g.layer(a, conv(out_c, out_c, 3, 1, 1, 1))?;
    let a = g.layer(a, BatchNorm2d::new(out_c))?;
    let shortcut = if stride == 1 && in_c == out_c {
        from
    } else {
        let p = g.layer(from, conv(in_c, out_c, 1, stride, 0, 2))?;
        g.layer(p, BatchNorm2d::new(out_c))?
    };
    let sum = g.add(a, shortcut)?;
    g.layer(sum, Relu::new())
}

/// A small ResNet for 1-channel 28x28 images (Fashion-MNIST): a 3x3 stem of
/// 16 channels, three stages of one basic block each (16, 32 and 64
/// channels, the last two with stride 2 and a projection shortcut), global
/// average pooling and a linear classifier. Built for minibatches of
/// `batch`.
pub fn small_resnet(batch: usize, classes: usize, seed: u64) -> Result<Graph> {
    let mut g = GraphBuilder::new(Shape::new(batch, 1, 28, 28));
    let x = g.input();
    let s = g.layer(
        x,
        Conv2d::new(1, 16, (3, 3), 1, 1, Activation::Identity, seed),
    )?;
    let s = g.layer(s, BatchNorm2d::new(16))?;
    let mut h = g.layer(s, Relu::new())?;
    for (i, (c, stride)) in [(16, 1), (32, 2), (64, 2)].into_iter().enumerate() {
        h = basic_block(&mut g, h, c, stride, seed + 10 * (i as u64 + 1))?;
    }
    let p = g.layer(h, GlobalAvgPool::new())?;
    let out = g.layer(p, Linear::new(64, classes, Activation::Identity, seed + 99))?;
    g.build(out)
}
