//! A CNN trained on the device: stages of [`GpuConv2d`] (with ReLU) and
//! max pooling, then a [`GpuMlp`] head (softmax cross-entropy, its loss
//! ring); the optimizer on every parameter. Built from the CPU graph of
//! [`brgemm_nn::models::CnnSpec`] so both start from the same seeded
//! weights; the images live on the device in NHWC order ([`GpuCnn::dataset`]).

use crate::codegen::ElementwiseKernel as EK;
use crate::conv::{ConvShape, GpuConv2d};
use crate::desc::GpuDtype;
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
use crate::mlp::{gather_rows, step, GpuDataset, GpuMlp};
use crate::norm::GpuBatchNorm;
use crate::pool::{maxpool_backward, maxpool_forward, PoolShape};
use brgemm::Activation;
use brgemm_nn::models::{CnnSpec, LayerSpec};
use brgemm_nn::{BatchNorm2d, Conv2d, Graph, Layer, Linear};
use brgemm_primitives::optim::Optimizer;

struct Stage {
    conv: GpuConv2d,
    pool: usize,
    w: Buffer,
    b: Buffer,
    dw: Buffer,
    db: Buffer,
    mw: Buffer,
    vw: Buffer,
    mb: Buffer,
    vb: Buffer,
    /// Convolution output and its gradient (NHWC).
    y: Buffer,
    dy: Buffer,
    /// Pooled output and the max positions.
    py: Buffer,
    arg: Buffer,
    /// Gradient of this stage's input (stages after the first).
    dx: Option<Buffer>,
    /// Batch norm (with the ReLU) after the convolution, where the spec
    /// has one.
    bn: Option<Bn>,
}

impl Stage {
    /// The pooling after the convolution: windows of `pool` at stride
    /// `pool` (1: a copy).
    fn pool_shape(&self) -> PoolShape {
        let sh = self.conv.shape;
        PoolShape {
            n: sh.n,
            h: sh.h,
            w: sh.w,
            c: sh.k,
            win: self.pool,
            stride: self.pool,
            pad: 0,
        }
    }
}

struct Bn {
    norm: GpuBatchNorm,
    /// Its output (what the pooling reads) and the convolution output's
    /// gradient.
    z: Buffer,
    dconv: Buffer,
    moments: [(Buffer, Buffer); 2],
}

/// A CNN on the device.
pub struct GpuCnn {
    stages: Vec<Stage>,
    head: GpuMlp,
    batch: usize,
    /// (channels, height, width) of the images.
    dims: (usize, usize, usize),
    input: Buffer,
    idx: Buffer,
    /// Gradient of the head's input.
    dhead: Buffer,
    t: u32,
}

impl GpuCnn {
    /// The network of `spec` with the weights of its CPU graph `cpu` (as
    /// [`CnnSpec::graph`] built it), GEMM inputs in `dtype`; batch norm
    /// (with its ReLU) where the spec has it. Dropout is not on the device
    /// yet: a spec with it is refused.
    pub fn from_cpu(dev: &Device, cpu: &Graph, spec: &CnnSpec, dtype: GpuDtype) -> Result<GpuCnn> {
        if spec.dropout > 0.0 {
            return Err(invalid(
                "dropout",
                spec.dropout,
                "the GPU CNN has no dropout yet",
            ));
        }
        let convs = cpu.layers_of::<Conv2d>();
        let mut bns = cpu.layers_of::<BatchNorm2d>().into_iter();
        if convs.len() != spec.stages.len() {
            return Err(invalid(
                "stages",
                spec.stages.len(),
                format!("the CPU graph has {} convolutions", convs.len()),
            ));
        }
        let batch = cpu.input_shape().n;
        let (mut c, mut h, mut w) = spec.input;
        let dims = spec.input;
        let f = |n: usize| dev.alloc(n * 4);
        let mut stages = Vec::with_capacity(convs.len());
        for (i, (st, cv)) in spec.stages.iter().zip(&convs).enumerate() {
            let k = st.channels;
            let sh = ConvShape {
                n: batch,
                h,
                w,
                c,
                k,
                r: st.kernel,
                s: st.kernel,
                stride: 1,
            };
            // With batch norm the ReLU follows it, as in the CPU graph.
            let act = if st.batchnorm {
                Activation::Identity
            } else {
                Activation::Relu
            };
            let conv = GpuConv2d::new(dev, sh, act, dtype)?;
            let bn = match (st.batchnorm, st.batchnorm.then(|| bns.next()).flatten()) {
                (false, _) => None,
                (true, None) => {
                    return Err(invalid(
                        format!("stage {i} batchnorm"),
                        true,
                        "the CPU graph has no batch norm there",
                    ))
                }
                (true, Some(l)) => {
                    let v = l.export();
                    let get = |name: &str| {
                        v.iter()
                            .find(|(n, _)| *n == name)
                            .map(|(_, x)| x.as_slice())
                            .unwrap_or(&[])
                    };
                    let px = batch * h * w;
                    let zeros = || dev.upload(&vec![0.0f32; k]);
                    Some(Bn {
                        // eps and momentum: the CPU layer's (PyTorch's defaults).
                        norm: GpuBatchNorm::new(
                            dev,
                            k,
                            px,
                            true,
                            [
                                get("gamma"),
                                get("beta"),
                                get("running_mean"),
                                get("running_var"),
                            ],
                            1e-5,
                            0.1,
                        )?,
                        z: f(px * k)?,
                        dconv: f(px * k)?,
                        moments: [(zeros()?, zeros()?), (zeros()?, zeros()?)],
                    })
                }
            };
            let taps = st.kernel * st.kernel;
            // CPU [k][c][r][s] -> tap-major, each tap k x c column-major.
            let kcrs = cv.weights();
            if kcrs.len() != k * c * taps {
                return Err(invalid(
                    format!("stage {i} weights"),
                    kcrs.len(),
                    format!("expected {k} x {c} x {taps}"),
                ));
            }
            let mut wt = vec![0.0f32; taps * k * c];
            for ko in 0..k {
                for ci in 0..c {
                    for t in 0..taps {
                        wt[t * k * c + ko + ci * k] = kcrs[(ko * c + ci) * taps + t];
                    }
                }
            }
            let px = batch * h * w;
            let p = st.pool.max(1);
            let (oh, ow) = (h / p, w / p);
            stages.push(Stage {
                conv,
                pool: p,
                w: dev.upload(&wt)?,
                b: dev.upload(&cv.bias())?,
                dw: f(wt.len())?,
                db: f(k)?,
                mw: f(wt.len())?,
                vw: f(wt.len())?,
                mb: f(k)?,
                vb: f(k)?,
                y: f(px * k)?,
                dy: f(px * k)?,
                py: f(batch * oh * ow * k)?,
                arg: f(batch * oh * ow * k)?,
                dx: if i > 0 { Some(f(px * c)?) } else { None },
                bn,
            });
            (c, h, w) = (k, oh, ow);
        }
        // The head reads NHWC features; the CPU flattens NCHW.
        let feats = c * h * w;
        let perm: Vec<usize> = (0..feats)
            .map(|g| {
                let (ch, pix) = (g % c, g / c);
                ch * h * w + pix
            })
            .collect();
        let linears: Vec<&Linear> = cpu.layers_of::<Linear>();
        let specs = LayerSpec::classifier(&spec.hidden, spec.classes);
        let head = GpuMlp::from_linears(dev, &linears, &specs, feats, batch, Some(&perm), dtype)?;
        let (ic, ih, iw) = dims;
        Ok(GpuCnn {
            stages,
            head,
            batch,
            dims,
            input: f(batch * ic * ih * iw)?,
            idx: f(batch)?,
            dhead: f(batch * feats)?,
            t: 0,
        })
    }

    /// Minibatch size.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Uploads images given as rows of `c*h*w` features in NCHW order
    /// (the CPU data sets') in the NHWC order the device layers read.
    pub fn dataset(&self, dev: &Device, x: &[f32], labels: &[usize]) -> Result<GpuDataset> {
        let (c, h, w) = self.dims;
        let f = c * h * w;
        if x.len() != labels.len() * f {
            return Err(invalid(
                "images",
                x.len(),
                format!("needs {f} values per label"),
            ));
        }
        let nhwc: Vec<f32> = x
            .chunks(f)
            .flat_map(|img| (0..f).map(move |g| img[(g % c) * h * w + g / c]))
            .collect();
        GpuDataset::upload(dev, &nhwc, labels, f)
    }

    fn forward(&mut self, dev: &Device, train: bool) -> Result<()> {
        for i in 0..self.stages.len() {
            let (before, rest) = self.stages.split_at_mut(i);
            let st = &mut rest[0];
            let x = if i == 0 {
                &self.input
            } else {
                &before[i - 1].py
            };
            st.conv.forward(dev, x, &st.w, &st.b, &mut st.y)?;
            let ps = st.pool_shape();
            let out = match &mut st.bn {
                Some(bn) if train => {
                    bn.norm.forward_train(dev, &st.y, &mut bn.z)?;
                    &bn.z
                }
                Some(bn) => {
                    bn.norm.forward_infer(dev, &st.y, &mut bn.z)?;
                    &bn.z
                }
                None => &st.y,
            };
            maxpool_forward(dev, &ps, out, &st.py, &st.arg)?;
        }
        let last = self.stages.last().expect("at least one stage");
        let (hx, _) = self.head.input_buffers();
        let n = self.head.inputs() * self.batch;
        dev.launch_elementwise(
            EK::CopySlot,
            n,
            &[
                Arg::Buf(&last.py),
                Arg::Buf(hx),
                Arg::I32(n as i32),
                Arg::I32(0),
                Arg::I32(0),
            ],
        )
    }

    /// One training step on the rows `idx` of a device data set
    /// ([`GpuCnn::dataset`]); the loss waits on the device for
    /// [`GpuCnn::losses`].
    pub fn train_step_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
        opt: &Optimizer,
    ) -> Result<()> {
        let (c, h, w) = self.dims;
        let (_, labels) = self.head.input_buffers();
        gather_rows(
            dev,
            data,
            idx,
            self.batch,
            c * h * w,
            &self.input,
            labels,
            &mut self.idx,
        )?;
        self.forward(dev, true)?;
        self.head
            .backprop_rows(dev, idx.len(), Some(&mut self.dhead))?;
        let count = self.stages.len();
        for i in (0..count).rev() {
            let (this, after) = self.stages[i..].split_at_mut(1);
            let st = &mut this[0];
            let dpy = if i + 1 == count {
                &self.dhead
            } else {
                after_dx(after)
            };
            maxpool_backward(dev, &st.pool_shape(), dpy, &st.arg, &st.dy)?;
            // st.dy: the gradient at what the pooling read.
            let dconv = match &mut st.bn {
                Some(bn) => {
                    bn.norm.backward(dev, &st.y, &bn.z, &st.dy, &mut bn.dconv)?;
                    &bn.dconv
                }
                None => &st.dy,
            };
            st.conv.backward(dev, dconv, &st.y, &st.w, st.dx.as_mut())?;
            st.conv.update(dev, &mut st.dw, &mut st.db)?;
        }
        self.head.apply_gradients(dev, opt)?;
        self.t += 1;
        for st in &self.stages {
            let (n, k) = (
                st.conv.shape.r * st.conv.shape.s * st.conv.shape.k * st.conv.shape.c,
                st.conv.shape.k,
            );
            step(dev, opt, self.t, &st.w, &st.dw, &st.mw, &st.vw, n)?;
            step(dev, opt, self.t, &st.b, &st.db, &st.mb, &st.vb, k)?;
            if let Some(bn) = &st.bn {
                let [(mg, vg), (mb, vb)] = &bn.moments;
                step(dev, opt, self.t, &bn.norm.gamma, &bn.norm.dgamma, mg, vg, k)?;
                step(dev, opt, self.t, &bn.norm.beta, &bn.norm.dbeta, mb, vb, k)?;
            }
        }
        Ok(())
    }

    /// The mean loss of every step since the last call, oldest first.
    pub fn losses(&mut self, dev: &Device) -> Result<Vec<f32>> {
        self.head.losses(dev)
    }

    /// Predicted classes of the rows `idx` of a device data set.
    pub fn predict_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
    ) -> Result<Vec<usize>> {
        let (c, h, w) = self.dims;
        let (_, labels) = self.head.input_buffers();
        gather_rows(
            dev,
            data,
            idx,
            self.batch,
            c * h * w,
            &self.input,
            labels,
            &mut self.idx,
        )?;
        self.forward(dev, false)?;
        self.head.predict_rows(dev, idx.len())
    }

    /// Stage `i`'s batch norm: scale, shift, running mean and variance
    /// (`None` without one).
    pub fn batchnorm_values(&self, dev: &Device, i: usize) -> Result<Option<[Vec<f32>; 4]>> {
        let st = self
            .stages
            .get(i)
            .ok_or_else(|| invalid("stage", i, "no such stage"))?;
        st.bn.as_ref().map(|bn| bn.norm.values(dev)).transpose()
    }

    /// Stage `i`'s weights (CPU order `[k][c][r][s]`) and bias.
    pub fn conv_parameters(&self, dev: &Device, i: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let st = self
            .stages
            .get(i)
            .ok_or_else(|| invalid("stage", i, "no such stage"))?;
        let sh = st.conv.shape;
        let taps = sh.r * sh.s;
        let wt: Vec<f32> = dev.download(&st.w, taps * sh.k * sh.c)?;
        let mut kcrs = vec![0.0f32; wt.len()];
        for ko in 0..sh.k {
            for ci in 0..sh.c {
                for t in 0..taps {
                    kcrs[(ko * sh.c + ci) * taps + t] = wt[t * sh.k * sh.c + ko + ci * sh.k];
                }
            }
        }
        Ok((kcrs, dev.download(&st.b, sh.k)?))
    }
}

/// The input gradient the stage after this one wrote (the gradient of
/// this stage's pooled output).
fn after_dx(rest: &[Stage]) -> &Buffer {
    rest[0].dx.as_ref().expect("stages after the first keep dx")
}
