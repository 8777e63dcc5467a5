//! [`Cnn`]: convolution stages (conv, optional batch norm, ReLU, optional
//! pooling) followed by dropout and an [`Mlp`] head, trained end to end on
//! the blocked layouts.
//!
//! A stage is `conv -> ReLU` (fused into the convolution's epilogue) or
//! `conv -> batch norm -> ReLU`, then max pooling. Backward runs the same
//! chain in reverse: pooling, ReLU, batch norm, then the convolution's
//! backward-weights and (except for the first stage) backward-data.

use super::mlp::{LayerSpec, Mlp};
use super::shape;
use crate::modelfile::{
    check_counts, get_flag, get_head, get_size, put_head, put_u64, Bytes, ModelFile, Values,
};
use brgemm::Activation;
use brgemm_primitives::conv::{Conv, ConvParams, ConvTuning};
use brgemm_primitives::eltwise::{self, Dropout};
use brgemm_primitives::error::{Error, Result};
use brgemm_primitives::init::{self, Init, Rng};
use brgemm_primitives::layout::Blocked;
use brgemm_primitives::loss;
use brgemm_primitives::norm::BatchNorm;
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::pool2d::{Pool2d, PoolKind};
use brgemm_primitives::tensor::{Filter, Tensor4};
use brgemm_primitives::threads::Pool;

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

struct BnPart {
    bn: BatchNorm,
    z: Tensor4,
    a: Tensor4,
    dz: Tensor4,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
    og: OptState,
    ob: OptState,
}

struct PoolPart {
    pool: Pool2d,
    out: Tensor4,
    argmax: Vec<u32>,
}

struct Stage {
    conv: Conv,
    w: Filter,
    wt: Filter,
    b: Vec<f32>,
    dw: Filter,
    db: Vec<f32>,
    ow: OptState,
    ob: OptState,
    y: Tensor4,
    dy: Tensor4,
    bn: Option<BnPart>,
    pool: Option<PoolPart>,
    /// dL/d(ReLU output) (the pooling's input gradient).
    dact: Tensor4,
    /// dL/d(stage output).
    dout: Tensor4,
}

impl Stage {
    fn act(&self) -> &Tensor4 {
        self.bn.as_ref().map_or(&self.y, |b| &b.a)
    }
    fn out(&self) -> &Tensor4 {
        match &self.pool {
            Some(p) => &p.out,
            None => self.act(),
        }
    }
}

/// A planned CNN with its parameters, gradients and optimizer state.
pub struct Cnn {
    batch: usize,
    spec: CnnSpec,
    stages: Vec<Stage>,
    flat: Blocked,
    dropped: Blocked,
    dflat: Blocked,
    dropout: Option<Dropout>,
    mlp: Mlp,
}

impl Cnn {
    /// Plans every layer for minibatch `batch`, weights drawn from `seed`
    /// (Kaiming for convolutions and hidden layers).
    pub fn new(spec: &CnnSpec, batch: usize, seed: u64) -> Result<Cnn> {
        if spec.stages.is_empty() {
            return Err(shape(
                "stages",
                0,
                "a CNN needs at least one convolution stage",
            ));
        }
        let mut rng = Rng::new(seed);
        let (mut c, mut h, mut w) = spec.input;
        let mut prev_block: Option<usize> = None;
        let mut stages = vec![];
        for (i, st) in spec.stages.iter().enumerate() {
            let params = ConvParams::new(batch, c, st.channels, h, w, st.kernel, st.kernel)
                .pad(st.kernel / 2);
            params.validate()?;
            let mut t = ConvTuning::heuristic(&params);
            if let Some(b) = prev_block {
                t.bc = b;
            }
            let act = if st.batchnorm {
                Activation::Identity
            } else {
                Activation::Relu
            };
            let conv = Conv::with_tuning(params, act, t)?;
            let mut wf = conv.filter();
            wf.set_kcrs(&init::weights(
                Init::Kaiming,
                st.channels,
                c * st.kernel * st.kernel,
                &mut rng,
            ))?;
            let y = conv.y_tensor();
            let bn = if st.batchnorm {
                Some(BnPart {
                    bn: BatchNorm::new(y.c(), y.bc())?,
                    z: y.clone(),
                    a: y.clone(),
                    dz: y.clone(),
                    dgamma: vec![0.0; y.padded_c()],
                    dbeta: vec![0.0; y.padded_c()],
                    og: OptState::default(),
                    ob: OptState::default(),
                })
            } else {
                None
            };
            let pool = if st.pool > 1 {
                let p = Pool2d::new(PoolKind::Max, &y, st.pool, st.pool, 0)
                    .map_err(|e| shape(format!("stage {i} pool"), st.pool, e.to_string()))?;
                let out = p.output();
                Some(PoolPart {
                    argmax: vec![0; out.data().len()],
                    pool: p,
                    out,
                })
            } else {
                None
            };
            let out_t = pool.as_ref().map_or(y.clone(), |p| p.out.clone());
            (c, h, w) = (out_t.c(), out_t.h(), out_t.w());
            prev_block = Some(out_t.bc());
            stages.push(Stage {
                wt: conv.filter_t(),
                b: vec![0.0; conv.padded_k()],
                dw: conv.filter(),
                db: vec![0.0; conv.padded_k()],
                ow: OptState::default(),
                ob: OptState::default(),
                dy: y.clone(),
                dact: y.clone(),
                dout: out_t,
                y,
                bn,
                pool,
                w: wf,
                conv,
            });
        }
        let feats = c * h * w;
        let layers = LayerSpec::classifier(&spec.hidden, spec.classes);
        let mut mlp = Mlp::new(feats, batch, &layers, rng.next_u64())?;
        mlp.set_input_gradient(true);
        let flat = mlp.input_layout();
        Ok(Cnn {
            batch,
            spec: spec.clone(),
            stages,
            dropped: flat.clone(),
            dflat: flat.clone(),
            flat,
            dropout: (spec.dropout > 0.0)
                .then(|| Dropout::new(spec.dropout, seed ^ 0xd20b))
                .transpose()?,
            mlp,
        })
    }

    /// Minibatch size.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// A zero input tensor in the layout the first convolution reads.
    pub fn input_tensor(&self) -> Tensor4 {
        self.stages[0].conv.x_tensor()
    }

    /// Floating-point operations of one training step (forward, backward-data
    /// and backward-weights of every convolution and FC layer; the first
    /// convolution has no backward-data).
    pub fn train_flops(&self) -> f64 {
        let conv: f64 = self.stages.iter().map(|s| s.conv.flops()).sum::<f64>() * 3.0
            - self.stages[0].conv.flops();
        conv + self.mlp.train_flops()
    }

    fn forward_stages(&mut self, pool: &Pool, x: &Tensor4, train: bool) -> Result<()> {
        for i in 0..self.stages.len() {
            let (done, rest) = self.stages.split_at_mut(i);
            let s = &mut rest[0];
            let input = if i == 0 { x } else { done[i - 1].out() };
            s.conv.forward(pool, input, &s.w, &s.b, &mut s.y)?;
            if let Some(b) = &mut s.bn {
                if train {
                    b.bn.forward_train(pool, &s.y, &mut b.z)?;
                } else {
                    b.bn.forward_infer(pool, &s.y, &mut b.z)?;
                }
                eltwise::relu_forward(pool, b.z.data(), b.a.data_mut())?;
            }
            if let Some(p) = &mut s.pool {
                let act = s.bn.as_ref().map_or(&s.y, |b| &b.a);
                p.pool
                    .forward(pool, act, &mut p.out, train.then_some(&mut p.argmax[..]))?;
            }
        }
        eltwise::flatten(pool, self.stages.last().unwrap().out(), &mut self.flat)
    }

    /// Logits of the minibatch `x` (inference mode: running batch-norm
    /// statistics, no dropout).
    pub fn forward(&mut self, pool: &Pool, x: &Tensor4) -> Result<&Blocked> {
        self.forward_stages(pool, x, false)?;
        self.mlp.forward(pool, &self.flat)
    }

    /// Predicted classes of the first `rows` images of `x`.
    pub fn predict(&mut self, pool: &Pool, x: &Tensor4, rows: usize) -> Result<Vec<usize>> {
        let logits = self.forward(pool, x)?;
        loss::argmax_rows(logits, rows)
    }

    /// Forward (training mode), loss on the first `labels.len()` images and
    /// backward; leaves every gradient in the model and returns the mean loss.
    pub fn compute_gradients(&mut self, pool: &Pool, x: &Tensor4, labels: &[usize]) -> Result<f32> {
        self.compute_gradients_with(pool, x, labels, |_, _| {})
    }

    /// Parameter groups: one per convolution stage (filter, bias, and
    /// batch-norm gamma and beta when present), then one per FC layer of
    /// the head (weights, bias).
    pub fn param_groups(&self) -> usize {
        self.stages.len() + self.mlp.depth()
    }

    /// The parameter buffers of group `g` (blocked, padding included).
    pub fn group_parameters_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        let ns = self.stages.len();
        if g < ns {
            let s = &mut self.stages[g];
            let mut v: Vec<&mut [f32]> = vec![s.w.data_mut(), &mut s.b[..]];
            if let Some(b) = &mut s.bn {
                let (gamma, beta) = b.bn.gamma_beta_mut();
                v.push(gamma);
                v.push(beta);
            }
            v
        } else {
            let (w, b) = self.mlp.parameters_mut(g - ns);
            vec![w.data_mut(), b]
        }
    }

    /// The L2 norm of every gradient of the last backward, for
    /// [`brgemm_primitives::guard::check_step`].
    pub fn gradient_norm(&self) -> f64 {
        let convs = self.stages.iter().flat_map(|s| {
            let bn = s.bn.iter().flat_map(|b| [&b.dgamma[..], &b.dbeta[..]]);
            [s.dw.data(), &s.db[..]].into_iter().chain(bn)
        });
        let head = self.mlp.gradient_norm();
        (brgemm_primitives::guard::norm(convs).powi(2) + head * head).sqrt()
    }

    /// The gradient buffers of group `g`, matching
    /// [`Cnn::group_parameters_mut`].
    pub fn group_gradients_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        let ns = self.stages.len();
        if g < ns {
            let s = &mut self.stages[g];
            let mut v: Vec<&mut [f32]> = vec![s.dw.data_mut(), &mut s.db[..]];
            if let Some(b) = &mut s.bn {
                v.push(&mut b.dgamma[..]);
                v.push(&mut b.dbeta[..]);
            }
            v
        } else {
            let (w, b) = self.mlp.gradients_mut(g - ns);
            vec![w.data_mut(), b]
        }
    }

    /// As [`Cnn::compute_gradients`], calling `ready(group, grads)` as soon
    /// as a parameter group's gradients are complete (highest group first:
    /// the head's last layer, ..., the first convolution), while backward
    /// goes on below: the place to start communication. The hook may
    /// rewrite the gradients.
    pub fn compute_gradients_with(
        &mut self,
        pool: &Pool,
        x: &Tensor4,
        labels: &[usize],
        mut ready: impl FnMut(usize, &mut [&mut [f32]]),
    ) -> Result<f32> {
        self.forward_stages(pool, x, true)?;
        let head_in = match &mut self.dropout {
            Some(d) => {
                d.forward_train(pool, self.flat.data(), self.dropped.data_mut())?;
                &self.dropped
            }
            None => &self.flat,
        };
        let ns = self.stages.len();
        let loss = self
            .mlp
            .compute_gradients_with(pool, head_in, labels, |i, dw, db| {
                ready(ns + i, &mut [dw.data_mut(), db])
            })?;
        let dflat = match &self.dropout {
            Some(d) => {
                d.backward(
                    pool,
                    self.mlp.input_gradient().data(),
                    self.dflat.data_mut(),
                )?;
                &self.dflat
            }
            None => self.mlp.input_gradient(),
        };
        let last = self.stages.len() - 1;
        eltwise::unflatten(pool, dflat, &mut self.stages[last].dout)?;
        for i in (0..self.stages.len()).rev() {
            let (done, rest) = self.stages.split_at_mut(i);
            let s = &mut rest[0];
            let input = if i == 0 { x } else { done[i - 1].out() };
            let dact = match &s.pool {
                Some(p) => {
                    p.pool
                        .backward(pool, &s.dout, Some(&p.argmax), &mut s.dact)?;
                    &s.dact
                }
                None => &s.dout,
            };
            match &mut s.bn {
                Some(b) => {
                    eltwise::relu_backward(pool, dact.data(), b.a.data(), b.dz.data_mut())?;
                    b.bn.backward(pool, &s.y, &b.dz, &mut s.dy, &mut b.dgamma, &mut b.dbeta)?;
                }
                None => s.conv.activation_backward(pool, dact, &s.y, &mut s.dy)?,
            }
            s.conv
                .backward_weights(pool, &s.dy, input, &mut s.dw, &mut s.db)?;
            match &mut s.bn {
                Some(b) => ready(
                    i,
                    &mut [
                        s.dw.data_mut(),
                        &mut s.db[..],
                        &mut b.dgamma[..],
                        &mut b.dbeta[..],
                    ],
                ),
                None => ready(i, &mut [s.dw.data_mut(), &mut s.db[..]]),
            }
            if i > 0 {
                s.conv.transpose_filter(pool, &s.w, &mut s.wt)?;
                s.conv
                    .backward_data(pool, &s.dy, &s.wt, &mut done[i - 1].dout)?;
            }
        }
        Ok(loss)
    }

    /// Applies the optimizer to every parameter.
    pub fn apply_gradients(&mut self, opt: &Optimizer) {
        for s in &mut self.stages {
            s.ow.step(opt, s.w.data_mut(), s.dw.data());
            s.ob.step(opt, &mut s.b, &s.db);
            if let Some(b) = &mut s.bn {
                b.og.step(opt, b.bn.gamma_mut(), &b.dgamma);
                b.ob.step(opt, b.bn.beta_mut(), &b.dbeta);
            }
        }
        self.mlp.apply_gradients(opt);
    }

    /// Input (channels, height, width).
    pub fn input_dims(&self) -> (usize, usize, usize) {
        self.spec.input
    }

    /// The architecture this model was planned from.
    pub fn spec(&self) -> &CnnSpec {
        &self.spec
    }

    /// Convolution stages.
    pub fn depth(&self) -> usize {
        self.stages.len()
    }

    /// Mutable filter and bias of convolution stage `i` (blocked filter,
    /// padded bias), e.g. for tests or to load weights.
    pub fn conv_parameters_mut(&mut self, i: usize) -> (&mut Filter, &mut [f32]) {
        let s = &mut self.stages[i];
        (&mut s.w, &mut s.b)
    }

    /// Gradients of convolution stage `i`.
    pub fn conv_gradients(&self, i: usize) -> (&Filter, &[f32]) {
        let s = &self.stages[i];
        (&s.dw, &s.db)
    }

    /// The FC head.
    pub fn head(&mut self) -> &mut Mlp {
        &mut self.mlp
    }
}

impl CnnSpec {
    /// Parameters and saved statistics a model of this spec holds (what its
    /// model file stores): filters, biases, batch-norm scale, shift and
    /// running moments, and the head. `None` if a stage shrinks the image
    /// to nothing or the count overflows.
    pub fn parameter_count(&self) -> Option<usize> {
        let (mut c, mut h, mut w) = self.input;
        let mut n = 0usize;
        for st in &self.stages {
            let k = st.channels;
            let p = ConvParams::new(1, c, k, h, w, st.kernel, st.kernel).pad(st.kernel / 2);
            p.validate().ok()?;
            let conv = k.checked_mul(c)?.checked_mul(st.kernel * st.kernel)? + k;
            n = n.checked_add(conv + if st.batchnorm { 4 * k } else { 0 })?;
            (c, h, w) = (k, p.p(), p.q());
            if st.pool > 1 {
                (h, w) = (
                    (h.checked_sub(st.pool)?) / st.pool + 1,
                    (w.checked_sub(st.pool)?) / st.pool + 1,
                );
            }
        }
        let feats = c.checked_mul(h)?.checked_mul(w)?;
        n.checked_add(super::mlp::head_parameter_count(
            feats,
            &self.hidden,
            self.classes,
        )?)
    }
}

impl ModelFile for Cnn {
    const KIND: [u8; 4] = *b"CNN\0";

    fn header(&self) -> Vec<u8> {
        let s = &self.spec;
        let mut h = Vec::new();
        for v in [s.input.0, s.input.1, s.input.2, s.stages.len()] {
            put_u64(&mut h, v);
        }
        for st in &s.stages {
            put_u64(&mut h, st.channels);
            put_u64(&mut h, st.kernel);
            h.push(st.batchnorm as u8);
            put_u64(&mut h, st.pool);
        }
        put_head(&mut h, &s.hidden, s.classes);
        h.extend_from_slice(&s.dropout.to_le_bytes());
        h
    }

    fn values(&self) -> Vec<f32> {
        let mut v = Vec::new();
        for s in &self.stages {
            let k = s.conv.params().k;
            v.extend_from_slice(&s.w.to_kcrs());
            v.extend_from_slice(&s.b[..k]);
            if let Some(b) = &s.bn {
                for x in [
                    b.bn.gamma(),
                    b.bn.beta(),
                    b.bn.running_mean(),
                    b.bn.running_var(),
                ] {
                    v.extend_from_slice(&x[..k]);
                }
            }
        }
        self.mlp.write_values(&mut v);
        v
    }

    fn from_parts(header: &[u8], values: &[f32], batch: usize) -> Result<Cnn> {
        let io = |e: String| Error::Io(format!("CNN header: {e}"));
        let mut h = Bytes::new(header);
        let dim = 1 << 14;
        let input = (
            get_size(&mut h, "input channels", dim)?,
            get_size(&mut h, "input height", dim)?,
            get_size(&mut h, "input width", dim)?,
        );
        let mut stages = vec![];
        for i in 0..get_size(&mut h, "stages", 1024)? {
            let pool_at = |h: &mut Bytes| -> Result<usize> {
                match h.u64().map_err(io)? {
                    p if p <= dim as u64 => Ok(p as usize),
                    p => Err(io(format!("stage {i} pool window {p} (0..={dim})"))),
                }
            };
            stages.push(StageSpec {
                channels: get_size(&mut h, &format!("stage {i} channels"), dim)?,
                kernel: get_size(&mut h, &format!("stage {i} kernel"), 64)?,
                batchnorm: get_flag(&mut h, &format!("stage {i} batch norm"))?,
                pool: pool_at(&mut h)?,
            });
        }
        let (hidden, classes) = get_head(&mut h)?;
        let dropout = f32::from_le_bytes(h.take(4).map_err(io)?.try_into().unwrap());
        if !(0.0..1.0).contains(&dropout) {
            return Err(io(format!("dropout {dropout}")));
        }
        let spec = CnnSpec {
            input,
            stages,
            hidden,
            classes,
            dropout,
        };
        check_counts(&h, spec.parameter_count(), values.len())?;
        let mut m = Cnn::new(&spec, batch, 0)?;
        let mut v = Values::new(values);
        for (i, s) in m.stages.iter_mut().enumerate() {
            let p = s.conv.params();
            let k = p.k;
            s.w.set_kcrs(v.take(p.k * p.c * p.r * p.s, &format!("stage {i} filter"))?)?;
            s.b[..k].copy_from_slice(v.take(k, &format!("stage {i} bias"))?);
            if let Some(b) = &mut s.bn {
                let bn = &mut b.bn;
                let what = format!("stage {i} batch norm");
                bn.gamma_mut()[..k].copy_from_slice(v.take(k, &what)?);
                bn.beta_mut()[..k].copy_from_slice(v.take(k, &what)?);
                bn.running_mean_mut()[..k].copy_from_slice(v.take(k, &what)?);
                bn.running_var_mut()[..k].copy_from_slice(v.take(k, &what)?);
            }
        }
        m.mlp.read_values(&mut v)?;
        v.finish()?;
        Ok(m)
    }
}
