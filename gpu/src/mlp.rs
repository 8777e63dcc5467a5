//! An MLP trained on the device: [`GpuFc`] layers, softmax cross-entropy and
//! the optimizer all run there; the host uploads a minibatch and reads back
//! one loss per sample.

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
    loss: Buffer,
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
        let mut layers = Vec::with_capacity(specs.len());
        let mut c = inputs;
        for (i, s) in specs.iter().enumerate() {
            let k = s.out;
            let fc = GpuFc::new(dev, c, k, batch, s.act, dtype)?;
            let (w_rm, b) = (linears[i].weights(), linears[i].bias());
            if w_rm.len() != k * c {
                return Err(invalid(
                    format!("layer {i} weights"),
                    w_rm.len(),
                    format!("expected {k} x {c}"),
                ));
            }
            // Host row-major [K][C] is device column-major C x K: transpose.
            let w = transpose(&w_rm, c, k);
            let f = |n: usize| dev.alloc(n * 4);
            layers.push(Layer {
                fc,
                w: dev.upload(&w)?,
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
            loss: dev.alloc(batch * 4)?,
        })
    }

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
            l.fc.forward(dev, x, &l.w, &l.b, &mut l.y)?;
        }
        Ok(())
    }

    /// Predicted classes of the first `rows` samples of `x` (row-major
    /// `[rows][inputs]`).
    pub fn predict(&mut self, dev: &Device, x: &[f32], rows: usize) -> Result<Vec<usize>> {
        self.load_x(dev, x, rows)?;
        self.forward(dev)?;
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

    /// Forward, mean softmax cross-entropy and backward on `rows =
    /// labels.len()` samples of `x` (row-major `[rows][inputs]`), leaving the
    /// weight and bias gradients on the device. Returns the loss.
    pub fn compute_gradients(&mut self, dev: &Device, x: &[f32], labels: &[usize]) -> Result<f32> {
        let rows = labels.len();
        self.load_x(dev, x, rows)?;
        let classes = self.layers.last().expect("at least one layer").fc.k;
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
                    Arg::Buf(&self.loss),
                    Arg::I32(classes as i32),
                    Arg::I32(self.batch as i32),
                    Arg::I32(rows as i32),
                ],
            )?;
        }
        for i in (0..self.layers.len()).rev() {
            let (before, rest) = self.layers.split_at_mut(i);
            let l = &mut rest[0];
            let x = if i == 0 { &self.x } else { &before[i - 1].y };
            let dx = if i == 0 {
                None
            } else {
                Some(&mut before[i - 1].dy)
            };
            l.fc.backward(dev, &l.dy, &l.y, &l.w, dx)?;
            l.fc.update(dev, x, &mut l.dw, &mut l.db)?;
        }
        let loss: Vec<f32> = dev.download(&self.loss, rows)?;
        Ok((loss.iter().map(|&v| v as f64).sum::<f64>() / rows as f64) as f32)
    }

    /// One optimizer step on every layer with the gradients of
    /// [`GpuMlp::compute_gradients`].
    pub fn apply_gradients(&mut self, dev: &Device, opt: &Optimizer) -> Result<()> {
        for l in &mut self.layers {
            l.t += 1;
            let (kc, k) = (l.fc.k * l.fc.c, l.fc.k);
            step(dev, opt, l.t, &l.w, &l.dw, &l.mw, &l.vw, kc)?;
            step(dev, opt, l.t, &l.b, &l.db, &l.mb, &l.vb, k)?;
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

/// Column-major `rows x cols` to column-major `cols x rows` (equally:
/// device column-major `K x C` to host row-major `[K][C]` with rows = K, and
/// back with rows = C).
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
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
fn step(
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
