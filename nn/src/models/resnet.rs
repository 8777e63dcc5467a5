//! Residual networks on the graph: basic and bottleneck blocks, a small
//! ResNet for 28x28 images and ResNet-50.

use crate::error::Result;
use crate::graph::{Graph, GraphBuilder, NodeId};
use crate::layers::{BatchNorm2d, Conv2d, GlobalAvgPool, Linear, Pool2dLayer, Relu};
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

/// A bottleneck block of ResNet-50 v1.5: 1x1 conv to `width` -> BN -> ReLU
/// -> 3x3 conv with `stride` -> BN -> ReLU -> 1x1 conv to `4 * width` ->
/// BN, plus the shortcut (identity, or a 1x1 projection with `stride` and
/// BN when the shape changes), then ReLU.
pub fn bottleneck(
    g: &mut GraphBuilder,
    from: NodeId,
    width: usize,
    stride: usize,
    seed: u64,
) -> Result<NodeId> {
    let (in_c, out_c) = (g.shape(from).c, 4 * width);
    let conv = |i, o, k, s, p, n| Conv2d::new(i, o, (k, k), s, p, Activation::Identity, seed + n);
    let mut h = from;
    for (i, (ci, co, k, s, p)) in [
        (in_c, width, 1, 1, 0),
        (width, width, 3, stride, 1),
        (width, out_c, 1, 1, 0),
    ]
    .into_iter()
    .enumerate()
    {
        h = g.layer(h, conv(ci, co, k, s, p, i as u64))?;
        h = g.layer(h, BatchNorm2d::new(co))?;
        if i < 2 {
            h = g.layer(h, Relu::new())?;
        }
    }
    let shortcut = if stride == 1 && in_c == out_c {
        from
    } else {
        let p = g.layer(from, conv(in_c, out_c, 1, stride, 0, 3))?;
        g.layer(p, BatchNorm2d::new(out_c))?
    };
    let sum = g.add(h, shortcut)?;
    g.layer(sum, Relu::new())
}

/// ResNet-50 v1.5 (He et al. 2016; the stride on the 3x3 convolution) for
/// `batch` RGB images of `size x size` (224 in the paper): a 7x7 stride-2
/// stem with BN, ReLU and 3x3 stride-2 max pooling, bottleneck stages of
/// 3, 4, 6 and 3 blocks (widths 64, 128, 256, 512), global average
/// pooling and a linear classifier.
pub fn resnet50(batch: usize, size: usize, classes: usize, seed: u64) -> Result<Graph> {
    let (g, out) = resnet50_layers(batch, size, classes, seed)?;
    g.build(out)
}

/// [`resnet50`] before [`GraphBuilder::build`]: the builder and the output
/// node, to build with other options (e.g. [`GraphBuilder::fuse`]).
pub fn resnet50_layers(
    batch: usize,
    size: usize,
    classes: usize,
    seed: u64,
) -> Result<(GraphBuilder, NodeId)> {
    let mut g = GraphBuilder::new(Shape::new(batch, 3, size, size));
    let x = g.input();
    let s = g.layer(
        x,
        Conv2d::new(3, 64, (7, 7), 2, 3, Activation::Identity, seed),
    )?;
    let s = g.layer(s, BatchNorm2d::new(64))?;
    let s = g.layer(s, Relu::new())?;
    let mut h = g.layer(s, Pool2dLayer::max(3, 2, 1))?;
    let mut block = 0u64;
    for (width, blocks, stride) in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)] {
        for b in 0..blocks {
            block += 1;
            let st = if b == 0 { stride } else { 1 };
            h = bottleneck(&mut g, h, width, st, seed + 10 * block)?;
        }
    }
    let p = g.layer(h, GlobalAvgPool::new())?;
    let out = g.layer(
        p,
        Linear::new(2048, classes, Activation::Identity, seed + 9999),
    )?;
    Ok((g, out))
}
