//! An MLP trained on the device: [`GpuFc`] layers, softmax cross-entropy and
//! the optimizer all run there. A training set uploaded once
//! ([`GpuDataset`]) is gathered into minibatches on the device from the
//! indices of each step; the per-sample losses go to a device ring of
//! [`GpuMlp::LOSS_WINDOW`] steps, which the host reads when it asks
//! ([`GpuMlp::losses`]) or when the ring is full: no blocking read per step.

use crate::codegen::ElementwiseKernel as EK;
use crate::desc::GpuDtype;
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
use crate::fc::GpuFc;
use brgemm_nn::models::LayerSpec;
use brgemm_nn::{Graph, Linear};
use brgemm_primitives::optim::Optimizer;

struct Layer {
    fc: GpuFc,
    w: Buffer,
    b: Buffer,
    dw: Buffer,
    db: Buffer,
    y: Buffer,
    /// Gradient at this layer's output.
    dy: Buffer,
    /// Optimizer moments of w and b, and the step count.
    mw: Buffer,
    vw: Buffer,
    mb: Buffer,
    vb: Buffer,
    t: u32,
}

/// A multi-layer perceptron on a [`Device`].
pub struct GpuMlp {
    layers: Vec<Layer>,
    inputs: usize,
    batch: usize,
    x: Buffer,
    labels: Buffer,
    /// The minibatch's rows of a device data set (i32).
    idx: Buffer,
    /// Per-sample losses of up to LOSS_WINDOW steps, `batch` slots each.
    losses: Buffer,
    /// Rows of each step whose losses are in `losses`, oldest first.
    pending: Vec<usize>,
    /// Step losses read back and not yet taken.
    ready: Vec<f32>,
}

/// A data set on the device, uploaded once: features row-major (one
/// sample's features contiguous) and labels as i32.
pub struct GpuDataset {
    pub(crate) x: Buffer,
    pub(crate) labels: Buffer,
    pub(crate) len: usize,
    pub(crate) features: usize,
    /// One past the largest label.
    pub(crate) classes: usize,
}

impl GpuDataset {
    /// Uploads `labels.len()` samples of `features` values each.
    pub fn upload(
        dev: &Device,
        x: &[f32],
        labels: &[usize],
        features: usize,
    ) -> Result<GpuDataset> {
        if features == 0 || x.len() != labels.len() * features {
            return Err(invalid(
                "data set",
                format!("{} values, {} labels", x.len(), labels.len()),
                format!("needs {features} values (at least 1) per label"),
            ));
        }
        if labels.len() > i32::MAX as usize {
            return Err(invalid("data set length", labels.len(), "exceeds i32"));
        }
        let classes = labels.iter().max().map_or(0, |&l| l + 1);
        let lab = labels
            .iter()
            .map(|&l| i32::try_from(l).map_err(|_| invalid("label", l, "exceeds i32")))
            .collect::<Result<Vec<i32>>>()?;
        Ok(GpuDataset {
            x: dev.upload(if x.is_empty() { &[0.0f32][..] } else { x })?,
            labels: dev.upload(if lab.is_empty() { &[0i32][..] } else { &lab })?,
            len: labels.len(),
            features,
            classes,
        })
    }
    /// Samples.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it holds no sample.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl GpuMlp {
    /// A model with the shape and weights of a CPU MLP graph
    /// ([`brgemm_nn::models::mlp`]: its [`Linear`] layers, in order, are the
    /// layers of `specs`), so both start from the same seeded
    /// initialisation; GEMM inputs in `dtype`.
    pub fn from_cpu(
        dev: &Device,
        cpu: &Graph,
        specs: &[LayerSpec],
        dtype: GpuDtype,
    ) -> Result<GpuMlp> {
        let linears = cpu.layers_of::<Linear>();
        if specs.len() != linears.len() || linears.len() != cpu.layer_names().len() {
            return Err(invalid(
                "specs",
                specs.len(),
                format!(
                    "the CPU model has {} layers, {} of them linear",
                    cpu.layer_names().len(),
                    linears.len()
                ),
            ));
        }
        let (inputs, batch) = (cpu.input_shape().features(), cpu.input_shape().n);
        Self::from_linears(dev, &linears, specs, inputs, batch, None, dtype)
    }

    /// A model of the CPU `linears` (the layers of `specs`) on `inputs`
    /// features and minibatches of `batch`; `perm[g]`, where given, is the
    /// CPU input feature that device feature g is (a CNN's head reads NHWC
    /// where the CPU flattens NCHW).
    pub(crate) fn from_linears(
        dev: &Device,
        linears: &[&Linear],
        specs: &[LayerSpec],
        inputs: usize,
        batch: usize,
        perm: Option<&[usize]>,
        dtype: GpuDtype,
    ) -> Result<GpuMlp> {
        let mut layers = Vec::with_capacity(specs.len());
        let mut c = inputs;
        for (i, s) in specs.iter().enumerate() {
            let k = s.out;
            let mut fc = GpuFc::new(dev, c, k, batch, s.act, dtype)?;
            let (w_rm, b) = (linears[i].weights(), linears[i].bias());
            if w_rm.len() != k * c {
                return Err(invalid(
                    format!("layer {i} weights"),
                    w_rm.len(),
                    format!("expected {k} x {c}"),
                ));
            }
            let w_rm = match (i, perm) {
                (0, Some(p)) => (0..k)
                    .flat_map(|o| p.iter().map(move |&f| (o, f)))
                    .map(|(o, f)| w_rm[o * c + f])
                    .collect(),
                _ => w_rm,
            };
            // Host row-major [K][C] is device column-major C x K: transpose.
            let w = transpose(&w_rm, c, k);
            let f = |n: usize| dev.alloc(n * 4);
            let w = dev.upload(&w)?;
            fc.pack_weights(dev, &w)?;
            layers.push(Layer {
                fc,
                w,
                b: dev.upload(&b)?,
                dw: f(k * c)?,
                db: f(k)?,
                y: f(k * batch)?,
                dy: f(k * batch)?,
                mw: f(k * c)?,
                vw: f(k * c)?,
                mb: f(k)?,
                vb: f(k)?,
                t: 0,
            });
            c = k;
        }
        Ok(GpuMlp {
            layers,
            inputs,
            batch,
            x: dev.alloc(inputs * batch * 4)?,
            labels: dev.alloc(batch * 4)?,
            idx: dev.alloc(batch * 4)?,
            losses: dev.alloc(Self::LOSS_WINDOW * batch * 4)?,
            pending: Vec::with_capacity(Self::LOSS_WINDOW),
            ready: Vec::new(),
        })
    }

    /// Steps whose losses the device holds before the host reads them.
    pub const LOSS_WINDOW: usize = 16;

    /// Minibatch size.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Input features.
    pub fn inputs(&self) -> usize {
        self.inputs
    }

    /// Weights (host row-major `[K][C]`, as [`Linear::weights`]) and biases
    /// of layer `i`.
    pub fn parameters(&self, dev: &Device, i: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let l = self
            .layers
            .get(i)
            .ok_or_else(|| invalid("layer", i, "no such layer"))?;
        let (c, k) = (l.fc.c, l.fc.k);
        Ok((
            transpose(&dev.download(&l.w, k * c)?, k, c),
            dev.download(&l.b, k)?,
        ))
    }

    fn load_x(&mut self, dev: &Device, x: &[f32], rows: usize) -> Result<()> {
        let need = rows * self.inputs;
        if rows == 0 || rows > self.batch || x.len() != need {
            return Err(invalid(
                "x",
                format!("{} values for {rows} rows", x.len()),
                format!("need 1..={} rows of {} features", self.batch, self.inputs),
            ));
        }
        let mut padded = x.to_vec();
        padded.resize(self.batch * self.inputs, 0.0);
        dev.write(&mut self.x, &padded)
    }

    fn forward(&mut self, dev: &Device) -> Result<()> {
        for i in 0..self.layers.len() {
            let (before, rest) = self.layers.split_at_mut(i);
            let l = &mut rest[0];
            let x = if i == 0 { &self.x } else { &before[i - 1].y };
            l.fc.forward_packed(dev, x, &l.w, &l.b, &mut l.y)?;
        }
        Ok(())
    }

    /// Predicted classes of the first `rows` samples of `x` (row-major
    /// `[rows][inputs]`).
    pub fn predict(&mut self, dev: &Device, x: &[f32], rows: usize) -> Result<Vec<usize>> {
        self.load_x(dev, x, rows)?;
        self.forward(dev)?;
        self.argmax(dev, rows)
    }

    /// The largest logit's class of each of the first `rows` columns.
    fn argmax(&self, dev: &Device, rows: usize) -> Result<Vec<usize>> {
        let last = self.layers.last().expect("at least one layer");
        let k = last.fc.k;
        let y: Vec<f32> = dev.download(&last.y, k * rows)?;
        Ok(y.chunks(k)
            .map(|z| {
                z.iter()
                    .enumerate()
                    .fold(0, |best, (j, &v)| if v > z[best] { j } else { best })
            })
            .collect())
    }

    /// Gathers the rows `idx` of `data` (and their labels) into the
    /// minibatch buffers on the device, after checking them.
    fn gather(&mut self, dev: &Device, data: &GpuDataset, idx: &[usize]) -> Result<()> {
        let (x, labels, ix) = (&self.x, &self.labels, &mut self.idx);
        gather_rows(dev, data, idx, self.batch, self.inputs, x, labels, ix)
    }

    /// The minibatch input buffer (features x batch) and its labels.
    pub(crate) fn input_buffers(&self) -> (&Buffer, &Buffer) {
        (&self.x, &self.labels)
    }

    /// Forward, loss and backward on the minibatch already in the input
    /// buffers (its first `rows` columns).
    pub(crate) fn backprop_rows(
        &mut self,
        dev: &Device,
        rows: usize,
        dx0: Option<&mut Buffer>,
    ) -> Result<()> {
        self.backprop_into(dev, rows, dx0)
    }

    /// Forward on the minibatch already in the input buffers; the
    /// predicted classes of its first `rows` columns.
    pub(crate) fn predict_rows(&mut self, dev: &Device, rows: usize) -> Result<Vec<usize>> {
        self.forward(dev)?;
        self.argmax(dev, rows)
    }

    /// Forward, loss and backward for the minibatch `x` (row-major, one
    /// row per label) uploaded from the host; the gradients stay on the
    /// device for [`GpuMlp::apply_gradients`]. Returns the mean loss (a
    /// blocking read, which also reads the losses of earlier device-data
    /// steps; [`GpuMlp::losses`] then holds those).
    pub fn compute_gradients(&mut self, dev: &Device, x: &[f32], labels: &[usize]) -> Result<f32> {
        let rows = labels.len();
        self.load_x(dev, x, rows)?;
        let classes = self.classes();
        if let Some((i, &l)) = labels.iter().enumerate().find(|(_, &l)| l >= classes) {
            return Err(invalid(
                format!("labels[{i}]"),
                l,
                format!("must be below {classes} classes"),
            ));
        }
        let mut lab: Vec<i32> = labels.iter().map(|&l| l as i32).collect();
        lab.resize(self.batch, 0);
        dev.write(&mut self.labels, &lab)?;
        self.backprop(dev, rows)?;
        self.drain(dev)?;
        Ok(self.ready.pop().expect("this step's loss"))
    }

    /// [`GpuMlp::compute_gradients`] for the rows `idx` of a data set
    /// already on the device: only the indices travel, and the loss stays
    /// on the device until [`GpuMlp::losses`] (or a full ring) reads it.
    pub fn compute_gradients_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
    ) -> Result<()> {
        if data.classes > self.classes() {
            return Err(invalid(
                "data set labels",
                data.classes - 1,
                format!("must be below {} classes", self.classes()),
            ));
        }
        self.gather(dev, data, idx)?;
        self.backprop(dev, idx.len())
    }

    /// The mean loss of every step run since the last call, oldest first:
    /// one blocking read of the device's loss ring.
    pub fn losses(&mut self, dev: &Device) -> Result<Vec<f32>> {
        self.drain(dev)?;
        Ok(std::mem::take(&mut self.ready))
    }

    fn classes(&self) -> usize {
        self.layers.last().expect("at least one layer").fc.k
    }

    /// Forward, softmax cross-entropy into the loss ring and backward, on
    /// the minibatch in `x`/`labels` (its first `rows` columns).
    fn backprop(&mut self, dev: &Device, rows: usize) -> Result<()> {
        self.backprop_into(dev, rows, None)
    }

    /// [`GpuMlp::backprop`], writing the gradient of the input to `dx0`
    /// where given (a CNN's head hands it to the convolutions).
    pub(crate) fn backprop_into(
        &mut self,
        dev: &Device,
        rows: usize,
        mut dx0: Option<&mut Buffer>,
    ) -> Result<()> {
        if self.pending.len() == Self::LOSS_WINDOW {
            self.drain(dev)?;
        }
        let classes = self.classes();
        self.forward(dev)?;
        {
            let last = self.layers.last().expect("at least one layer");
            dev.launch_elementwise(
                EK::SoftmaxXent,
                self.batch,
                &[
                    Arg::Buf(&last.y),
                    Arg::Buf(&self.labels),
                    Arg::Buf(&last.dy),
                    Arg::Buf(&self.losses),
                    Arg::I32(classes as i32),
                    Arg::I32(self.batch as i32),
                    Arg::I32(rows as i32),
                    Arg::I32((self.pending.len() * self.batch) as i32),
                ],
            )?;
        }
        for i in (0..self.layers.len()).rev() {
            let (before, rest) = self.layers.split_at_mut(i);
            let l = &mut rest[0];
            let x = if i == 0 { &self.x } else { &before[i - 1].y };
            let dx = if i == 0 {
                dx0.take()
            } else {
                Some(&mut before[i - 1].dy)
            };
            l.fc.backward_packed(dev, &l.dy, &l.y, dx)?;
            l.fc.update(dev, x, &mut l.dw, &mut l.db)?;
        }
        self.pending.push(rows);
        Ok(())
    }

    /// Reads the loss ring: each pending step's mean into `ready`.
    fn drain(&mut self, dev: &Device) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let b = self.batch;
        let all: Vec<f32> = dev.download(&self.losses, self.pending.len() * b)?;
        for (s, &rows) in self.pending.iter().enumerate() {
            let sum: f64 = all[s * b..s * b + rows].iter().map(|&v| v as f64).sum();
            self.ready.push((sum / rows as f64) as f32);
        }
        self.pending.clear();
        Ok(())
    }

    /// One optimizer step on every layer with the gradients of
    /// [`GpuMlp::compute_gradients`].
    pub fn apply_gradients(&mut self, dev: &Device, opt: &Optimizer) -> Result<()> {
        for l in &mut self.layers {
            l.t += 1;
            let (kc, k) = (l.fc.k * l.fc.c, l.fc.k);
            step(dev, opt, l.t, &l.w, &l.dw, &l.mw, &l.vw, kc)?;
            step(dev, opt, l.t, &l.b, &l.db, &l.mb, &l.vb, k)?;
            // The GEMM copies of W, as they are and transposed: once per
            // step, not once per pass.
            l.fc.pack_weights(dev, &l.w)?;
        }
        Ok(())
    }

    /// [`GpuMlp::compute_gradients`] then [`GpuMlp::apply_gradients`].
    /// Returns the loss.
    pub fn train_step(
        &mut self,
        dev: &Device,
        x: &[f32],
        labels: &[usize],
        opt: &Optimizer,
    ) -> Result<f32> {
        let loss = self.compute_gradients(dev, x, labels)?;
        self.apply_gradients(dev, opt)?;
        Ok(loss)
    }

    /// [`GpuMlp::train_step`] on the rows `idx` of a device data set: the
    /// loss waits on the device for [`GpuMlp::losses`].
    pub fn train_step_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
        opt: &Optimizer,
    ) -> Result<()> {
        self.compute_gradients_on(dev, data, idx)?;
        self.apply_gradients(dev, opt)
    }

    /// Predicted classes of the rows `idx` of a device data set.
    pub fn predict_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
    ) -> Result<Vec<usize>> {
        self.gather(dev, data, idx)?;
        self.forward(dev)?;
        self.argmax(dev, idx.len())
    }

    /// Gradients of layer `i` from the last [`GpuMlp::compute_gradients`],
    /// laid out as [`GpuMlp::parameters`].
    pub fn gradients(&self, dev: &Device, i: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let l = self
            .layers
            .get(i)
            .ok_or_else(|| invalid("layer", i, "no such layer"))?;
        Ok((
            transpose(&dev.download(&l.dw, l.fc.k * l.fc.c)?, l.fc.k, l.fc.c),
            dev.download(&l.db, l.fc.k)?,
        ))
    }
}

/// `losses` and `predict_on` of a model whose classifier is a [`GpuMlp`]
/// in its field `head`: the head's loss window, and the head's arg max
/// after the model gathers the rows and runs `$infer(self, dev)`, its
/// inference forward pass up to the head's logits.
macro_rules! head_readout {
    ($infer:expr) => {
        /// The mean loss of every step since the last call, oldest first.
        pub fn losses(&mut self, dev: &Device) -> Result<Vec<f32>> {
            self.head.losses(dev)
        }

        /// Predicted classes of the rows `idx` of a device data set (batch
        /// norm, where there is one, with its running statistics).
        pub fn predict_on(
            &mut self,
            dev: &Device,
            data: &GpuDataset,
            idx: &[usize],
        ) -> Result<Vec<usize>> {
            self.gather(dev, data, idx)?;
            ($infer)(&mut *self, dev)?;
            self.head.predict_rows(dev, idx.len())
        }
    };
}
pub(crate) use head_readout;

/// Column-major `rows x cols` to column-major `cols x rows` (equally:
/// device column-major `K x C` to host row-major `[K][C]` with rows = K, and
/// back with rows = C).
/// Gathers the rows `idx` of `data` (features wide) into `x` (features x
/// batch) and their labels into `labels`, through the index buffer `ix`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gather_rows(
    dev: &Device,
    data: &GpuDataset,
    idx: &[usize],
    batch: usize,
    features: usize,
    x: &Buffer,
    labels: &Buffer,
    ix: &mut Buffer,
) -> Result<()> {
    let rows = idx.len();
    if rows == 0 || rows > batch {
        return Err(invalid(
            "minibatch",
            rows,
            format!("needs 1..={batch} rows"),
        ));
    }
    if data.features != features {
        return Err(invalid(
            "data set features",
            data.features,
            format!("the model takes {features}"),
        ));
    }
    if let Some((i, &r)) = idx.iter().enumerate().find(|(_, &r)| r >= data.len) {
        return Err(invalid(
            format!("idx[{i}]"),
            r,
            format!("the data set has {} samples", data.len),
        ));
    }
    let mut v: Vec<i32> = idx.iter().map(|&r| r as i32).collect();
    v.resize(batch, -1);
    dev.write(ix, &v)?;
    dev.launch_elementwise(
        EK::GatherRows,
        features * batch,
        &[
            Arg::Buf(&data.x),
            Arg::Buf(&data.labels),
            Arg::Buf(ix),
            Arg::Buf(x),
            Arg::Buf(labels),
            Arg::I32(features as i32),
            Arg::I32(batch as i32),
            Arg::I32(rows as i32),
        ],
    )
}

pub(crate) fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c + r * cols] = v[r + c * rows];
        }
    }
    t
}

/// One optimizer step on the device, the same update as
/// [`brgemm_primitives::optim::OptState::step`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn step(
    dev: &Device,
    opt: &Optimizer,
    t: u32,
    p: &Buffer,
    g: &Buffer,
    m: &Buffer,
    v: &Buffer,
    n: usize,
) -> Result<()> {
    match *opt {
        Optimizer::Sgd { lr, momentum } => dev.launch_elementwise(
            EK::Sgd,
            n,
            &[
                Arg::Buf(p),
                Arg::Buf(g),
                Arg::Buf(m),
                Arg::I32(n as i32),
                Arg::F32(lr),
                Arg::F32(momentum),
            ],
        ),
        Optimizer::Adam {
            beta1, beta2, eps, ..
        } => {
            let s = opt.adam_step_size(t);
            dev.launch_elementwise(
                EK::Adam,
                n,
                &[
                    Arg::Buf(p),
                    Arg::Buf(g),
                    Arg::Buf(m),
                    Arg::Buf(v),
                    Arg::I32(n as i32),
                    Arg::F32(s),
                    Arg::F32(beta1),
                    Arg::F32(beta2),
                    Arg::F32(eps),
                ],
            )
        }
    }
}
