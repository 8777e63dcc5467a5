//! A layer graph on the device: the nodes of a built [`brgemm_nn::Graph`]
//! (convolutions at any stride, batch norm, ReLU, residual adds, max and
//! global average pooling, dropout) in order of evaluation, then its trailing linear
//! layers as a [`GpuMlp`] head with the loss ring; trained with the
//! optimizer on every parameter, from the CPU graph's weights. The CNN of
//! `train_cnn` (with or without batch norm) and the small ResNet of
//! `train_resnet` are such graphs.
//!
//! Backward walks the nodes in reverse; a node whose output feeds several
//! others (a residual block's input) gets the sum of their gradients: the
//! first contribution is copied in, the others added, in node order.

use crate::codegen::ElementwiseKernel as EK;
use crate::conv::{ConvShape, GpuConv2d};
use crate::desc::GpuDtype;
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
use crate::mlp::{gather_rows, step, GpuDataset, GpuMlp};
use crate::nhwc::{kcrs_from_taps, nhwc_dataset, nhwc_to_nchw, taps_from_kcrs};
use crate::norm::GpuBatchNorm;
use crate::pool::{self, PoolShape};
use brgemm::Activation;
use brgemm_nn::models::LayerSpec;
use brgemm_nn::{
    BatchNorm2d, Conv2d, Dropout, GlobalAvgPool, Graph, Layer, Linear, NodeKind, Pool2dLayer, Relu,
};
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;

struct ConvNode {
    conv: GpuConv2d,
    w: Buffer,
    b: Buffer,
    dw: Buffer,
    db: Buffer,
    moments: [(Buffer, Buffer); 2],
}

struct BnNode {
    bn: GpuBatchNorm,
    moments: [(Buffer, Buffer); 2],
}

enum Op {
    Input,
    Conv(Box<ConvNode>),
    Bn(Box<BnNode>),
    Relu,
    Add,
    MaxPool(PoolShape, Buffer),
    /// Drop probability, the layer's key generator, the last mask.
    Dropout(f32, Rng, Buffer),
    GlobalAvg {
        hw: usize,
        c: usize,
    },
}

struct Node {
    op: Op,
    inputs: Vec<usize>,
    elems: usize,
    out: Buffer,
    grad: Buffer,
}

/// A layer graph on the device.
pub struct GpuGraph {
    nodes: Vec<Node>,
    /// Which nodes' gradients hold a contribution this step.
    grad_set: Vec<bool>,
    head: GpuMlp,
    batch: usize,
    dims: (usize, usize, usize),
    scratch: Buffer,
    idx: Buffer,
    t: u32,
}

fn unsupported(i: usize, what: &str) -> crate::Error {
    invalid(
        format!("node {i}"),
        what.to_string(),
        "the GPU graph runs convolutions (odd filters, padding r/2, one group), batch norm, \
         ReLU, residual adds, max and global average pooling, dropout, then linear layers",
    )
}

impl GpuGraph {
    /// The graph `cpu` on the device, GEMM inputs in `dtype`, starting from
    /// its weights and batch-norm statistics. Its last nodes must be linear
    /// layers (the head); a node the device cannot run is refused by index.
    pub fn from_cpu(dev: &Device, cpu: &Graph, dtype: GpuDtype) -> Result<GpuGraph> {
        let topo = cpu.topology();
        // Layer names, by node (the layers in order of evaluation).
        let mut names = cpu.layer_names().into_iter();
        let name: Vec<String> = topo
            .iter()
            .map(|n| match n.kind {
                NodeKind::Layer => names.next().unwrap_or_default(),
                NodeKind::Input => "input".into(),
                NodeKind::Add => "add".into(),
            })
            .collect();
        // The trailing linear layers, each reading the one before.
        let mut first = topo.len();
        while first > 1 {
            let n = &topo[first - 1];
            let linear = n.kind == NodeKind::Layer && cpu.layer::<Linear>(n.id).is_some();
            if !linear || n.inputs != [first - 2] {
                break;
            }
            first -= 1;
        }
        if first == topo.len() {
            return Err(invalid(
                "graph",
                "no linear head",
                "the GPU graph ends in linear layers",
            ));
        }
        let head_from = first - 1;
        let batch = topo[0].shape.n;
        let s0 = topo[0].shape;
        let dims = (s0.c, s0.h, s0.w);
        let f = |n: usize| dev.alloc(n.max(1) * 4);
        let zeros = |n: usize| dev.upload(&vec![0.0f32; n]);
        let pair = |n: usize| -> Result<(Buffer, Buffer)> { Ok((zeros(n)?, zeros(n)?)) };
        let mut nodes: Vec<Node> = Vec::with_capacity(first);
        for (i, n) in topo[..first].iter().enumerate() {
            let sh = n.shape;
            let elems = sh.n * sh.c * sh.h * sh.w;
            let input = n.inputs.first().map(|&j| topo[j].shape);
            let op = match n.kind {
                NodeKind::Input => Op::Input,
                NodeKind::Add => Op::Add,
                NodeKind::Layer => {
                    let x = input.expect("a layer has an input");
                    if let Some(l) = cpu.layer::<Conv2d>(n.id) {
                        let g = l.geometry();
                        let (r, s) = g.rs;
                        if g.groups != 1
                            || g.dilation != (1, 1)
                            || r % 2 == 0
                            || s % 2 == 0
                            || g.pad != (r / 2, s / 2)
                            || g.stride.0 != g.stride.1
                            || !matches!(g.act, Activation::Identity | Activation::Relu)
                        {
                            return Err(unsupported(i, &format!("{} {g:?}", name[i])));
                        }
                        let cs = ConvShape {
                            n: batch,
                            h: x.h,
                            w: x.w,
                            c: g.in_c,
                            k: g.out_c,
                            r,
                            s,
                            stride: g.stride.0,
                        };
                        if cs.out_hw() != (sh.h, sh.w) {
                            return Err(unsupported(
                                i,
                                &format!("{}: another output size", name[i]),
                            ));
                        }
                        let taps = r * s;
                        let wt = taps_from_kcrs(&l.weights(), g.out_c, g.in_c, taps);
                        let nw = wt.len();
                        Op::Conv(Box::new(ConvNode {
                            conv: GpuConv2d::new(dev, cs, g.act, dtype)?,
                            w: dev.upload(&wt)?,
                            b: dev.upload(&l.bias())?,
                            dw: f(nw)?,
                            db: f(g.out_c)?,
                            moments: [pair(nw)?, pair(g.out_c)?],
                        }))
                    } else if let Some(l) = cpu.layer::<BatchNorm2d>(n.id) {
                        let v = l.export();
                        let get = |name: &str| {
                            v.iter()
                                .find(|(k, _)| *k == name)
                                .map(|(_, x)| x.as_slice())
                                .unwrap_or(&[])
                        };
                        let vals = [
                            get("gamma"),
                            get("beta"),
                            get("running_mean"),
                            get("running_var"),
                        ];
                        // eps and momentum: the CPU layer's (PyTorch's defaults).
                        let bn = GpuBatchNorm::new(
                            dev,
                            sh.c,
                            batch * sh.h * sh.w,
                            false,
                            vals,
                            1e-5,
                            0.1,
                        )?;
                        Op::Bn(Box::new(BnNode {
                            bn,
                            moments: [pair(sh.c)?, pair(sh.c)?],
                        }))
                    } else if cpu.layer::<Relu>(n.id).is_some() {
                        Op::Relu
                    } else if let Some(l) = cpu.layer::<Pool2dLayer>(n.id) {
                        let (max, win, stride, pad) = l.geometry();
                        let ps = PoolShape {
                            n: batch,
                            h: x.h,
                            w: x.w,
                            c: x.c,
                            win,
                            stride,
                            pad,
                        };
                        if !max || ps.out_hw() != (sh.h, sh.w) {
                            return Err(unsupported(i, &name[i]));
                        }
                        Op::MaxPool(ps, f(elems)?)
                    } else if let Some(l) = cpu.layer::<Dropout>(n.id) {
                        let (p, seed) = l.rate();
                        Op::Dropout(p, Rng::new(seed), f(elems)?)
                    } else if cpu.layer::<GlobalAvgPool>(n.id).is_some() {
                        Op::GlobalAvg {
                            hw: x.h * x.w,
                            c: x.c,
                        }
                    } else {
                        return Err(unsupported(i, &name[i]));
                    }
                }
            };
            nodes.push(Node {
                op,
                inputs: n.inputs.clone(),
                elems,
                out: f(elems)?,
                grad: f(elems)?,
            });
        }
        let hs = topo[head_from].shape;
        let feats = hs.c * hs.h * hs.w;
        let linears: Vec<&Linear> = topo[first..]
            .iter()
            .filter_map(|n| cpu.layer::<Linear>(n.id))
            .collect();
        let specs: Vec<LayerSpec> = linears
            .iter()
            .map(|l| {
                let (_, out, act) = l.geometry();
                LayerSpec { out, act }
            })
            .collect();
        let perm = nhwc_to_nchw(hs.c, hs.h, hs.w);
        let head = GpuMlp::from_linears(dev, &linears, &specs, feats, batch, Some(&perm), dtype)?;
        let most = nodes.iter().map(|n| n.elems).max().unwrap_or(1);
        Ok(GpuGraph {
            grad_set: vec![false; nodes.len()],
            nodes,
            head,
            batch,
            dims,
            scratch: f(most)?,
            idx: f(batch)?,
            t: 0,
        })
    }

    /// Minibatch size.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Uploads images given in NCHW order (the CPU data sets').
    pub fn dataset(&self, dev: &Device, x: &[f32], labels: &[usize]) -> Result<GpuDataset> {
        nhwc_dataset(dev, self.dims, x, labels)
    }

    fn forward(&mut self, dev: &Device, train: bool) -> Result<()> {
        for i in 1..self.nodes.len() {
            let (before, rest) = self.nodes.split_at_mut(i);
            let nd = &mut rest[0];
            let x = &before[nd.inputs[0]].out;
            match &mut nd.op {
                Op::Input => {}
                Op::Conv(c) => c.conv.forward(dev, x, &c.w, &c.b, &mut nd.out)?,
                Op::Bn(b) if train => b.bn.forward_train(dev, x, &mut nd.out)?,
                Op::Bn(b) => b.bn.forward_infer(dev, x, &mut nd.out)?,
                Op::Relu => dev.launch_elementwise(
                    EK::ReluFwd,
                    nd.elems,
                    &[Arg::Buf(x), Arg::Buf(&nd.out), Arg::I32(nd.elems as i32)],
                )?,
                Op::Add => pool::add(dev, x, &before[nd.inputs[1]].out, &nd.out, nd.elems, false)?,
                Op::MaxPool(ps, arg) => pool::maxpool_forward(dev, ps, x, &nd.out, arg)?,
                Op::Dropout(p, keys, mask) if train => {
                    pool::dropout_forward(dev, x, &nd.out, mask, nd.elems, *p, keys.next_u64())?
                }
                Op::Dropout(..) => dev.launch_elementwise(
                    EK::CopySlot,
                    nd.elems,
                    &[
                        Arg::Buf(x),
                        Arg::Buf(&nd.out),
                        Arg::I32(nd.elems as i32),
                        Arg::I32(0),
                        Arg::I32(0),
                    ],
                )?,
                Op::GlobalAvg { hw, c } => {
                    pool::global_avgpool_forward(dev, (self.batch, *hw, *c), x, &nd.out)?
                }
            }
        }
        let last = self.nodes.last().expect("an input node");
        let (hx, _) = self.head.input_buffers();
        let n = last.elems;
        dev.launch_elementwise(
            EK::CopySlot,
            n,
            &[
                Arg::Buf(&last.out),
                Arg::Buf(hx),
                Arg::I32(n as i32),
                Arg::I32(0),
                Arg::I32(0),
            ],
        )
    }

    /// The images `idx` of `data` into the input node, their labels to the
    /// head.
    fn gather(&mut self, dev: &Device, data: &GpuDataset, idx: &[usize]) -> Result<()> {
        let (c, h, w) = self.dims;
        let (_, labels) = self.head.input_buffers();
        let x = &self.nodes[0].out;
        gather_rows(
            dev,
            data,
            idx,
            self.batch,
            c * h * w,
            x,
            labels,
            &mut self.idx,
        )
    }

    /// Adds `src` (`elems` values) into node `j`'s gradient (copies it in
    /// when it is the first contribution of the step).
    fn accumulate(&mut self, dev: &Device, j: usize, src: Src) -> Result<()> {
        let n = self.nodes[j].elems;
        let (lo, hi) = self.nodes.split_at_mut(j + 1);
        let dst = &lo[j].grad;
        let from = match src {
            Src::Scratch => &self.scratch,
            Src::GradOf(i) => &hi[i - j - 1].grad,
        };
        if self.grad_set[j] {
            pool::add(dev, dst, from, dst, n, false)
        } else {
            self.grad_set[j] = true;
            dev.launch_elementwise(
                EK::CopySlot,
                n,
                &[
                    Arg::Buf(from),
                    Arg::Buf(dst),
                    Arg::I32(n as i32),
                    Arg::I32(0),
                    Arg::I32(0),
                ],
            )
        }
    }

    /// One training step on the rows `idx` of a device data set
    /// ([`GpuGraph::dataset`]); the loss waits for [`GpuGraph::losses`].
    pub fn train_step_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
        opt: &Optimizer,
    ) -> Result<()> {
        self.gather(dev, data, idx)?;
        self.forward(dev, true)?;
        self.grad_set.fill(false);
        let last = self.nodes.len() - 1;
        self.head
            .backprop_rows(dev, idx.len(), Some(&mut self.nodes[last].grad))?;
        self.grad_set[last] = true;
        for i in (1..self.nodes.len()).rev() {
            if !self.grad_set[i] {
                continue;
            }
            // An add has two inputs, every other node one.
            let (x, x2) = (
                self.nodes[i].inputs[0],
                self.nodes[i].inputs.get(1).copied(),
            );
            let first_is_input = matches!(self.nodes[x].op, Op::Input);
            let (lo, hi) = self.nodes.split_at_mut(i);
            let nd = &mut hi[0];
            let to_scratch = match &mut nd.op {
                Op::Input => false,
                Op::Conv(cn) => {
                    let dx = if first_is_input {
                        None
                    } else {
                        Some(&mut self.scratch)
                    };
                    let wrote = dx.is_some();
                    cn.conv.backward(dev, &nd.grad, &nd.out, &cn.w, dx)?;
                    cn.conv.update(dev, &mut cn.dw, &mut cn.db)?;
                    wrote
                }
                Op::Bn(b) => {
                    b.bn.backward(dev, &lo[x].out, &nd.out, &nd.grad, &mut self.scratch)?;
                    true
                }
                Op::Relu => {
                    dev.act_backward(Activation::Relu, &nd.out, &nd.grad, &self.scratch, nd.elems)?;
                    true
                }
                Op::Add => false,
                Op::MaxPool(ps, arg) => {
                    pool::maxpool_backward(dev, ps, &nd.grad, arg, &self.scratch)?;
                    true
                }
                Op::Dropout(_, _, mask) => {
                    pool::dropout_backward(dev, &nd.grad, mask, &self.scratch, nd.elems)?;
                    true
                }
                Op::GlobalAvg { hw, c } => {
                    pool::global_avgpool_backward(
                        dev,
                        (self.batch, *hw, *c),
                        &nd.grad,
                        &self.scratch,
                    )?;
                    true
                }
            };
            if let (Op::Add, Some(x2)) = (&self.nodes[i].op, x2) {
                self.accumulate(dev, x, Src::GradOf(i))?;
                self.accumulate(dev, x2, Src::GradOf(i))?;
            } else if to_scratch {
                self.accumulate(dev, x, Src::Scratch)?;
            }
        }
        self.head.apply_gradients(dev, opt)?;
        self.t += 1;
        for nd in &self.nodes {
            match &nd.op {
                Op::Conv(c) => {
                    let [(mw, vw), (mb, vb)] = &c.moments;
                    step(dev, opt, self.t, &c.w, &c.dw, mw, vw, c.w.bytes() / 4)?;
                    step(dev, opt, self.t, &c.b, &c.db, mb, vb, c.b.bytes() / 4)?;
                }
                Op::Bn(b) => {
                    let [(mg, vg), (mb, vb)] = &b.moments;
                    let k = b.bn.gamma.bytes() / 4;
                    step(dev, opt, self.t, &b.bn.gamma, &b.bn.dgamma, mg, vg, k)?;
                    step(dev, opt, self.t, &b.bn.beta, &b.bn.dbeta, mb, vb, k)?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    crate::mlp::head_readout!(|m: &mut Self, dev| m.forward(dev, false));

    /// The `i`-th convolution's weights (CPU order `[k][c][r][s]`) and
    /// bias, counting in node order.
    pub fn conv_parameters(&self, dev: &Device, i: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = self
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Conv(c) => Some(c),
                _ => None,
            })
            .nth(i)
            .ok_or_else(|| invalid("convolution", i, "no such convolution"))?;
        let sh = c.conv.shape;
        let taps = sh.r * sh.s;
        let wt: Vec<f32> = dev.download(&c.w, taps * sh.k * sh.c)?;
        Ok((
            kcrs_from_taps(&wt, sh.k, sh.c, taps),
            dev.download(&c.b, sh.k)?,
        ))
    }

    /// The `i`-th batch norm's scale, shift, running mean and variance.
    pub fn batchnorm_values(&self, dev: &Device, i: usize) -> Result<[Vec<f32>; 4]> {
        self.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Bn(b) => Some(b),
                _ => None,
            })
            .nth(i)
            .ok_or_else(|| invalid("batch norm", i, "no such batch norm"))?
            .bn
            .values(dev)
    }
}

/// Where a gradient contribution comes from.
#[derive(Clone, Copy)]
enum Src {
    Scratch,
    GradOf(usize),
}
