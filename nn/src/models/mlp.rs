//! The MLP as a layer graph ([`mlp`]), and the fixed template [`Mlp`] (a
//! sequence of [`Fc`] layers owning their blocked weights, gradients,
//! activations and optimizer state) that remains as the head of
//! [`super::SeqClassifier`].
//!
//! The minibatch size is fixed when the model is planned (the layouts and
//! loop nests depend on it); a shorter last batch uses the first rows only.

use super::shape;
use crate::modelfile::{check_counts, get_size, put_u64, Bytes, ModelFile, Values};
use brgemm::Activation;
use brgemm_primitives::error::{Error, Result};
use brgemm_primitives::fc::{Fc, FcTuning};
use brgemm_primitives::init::{self, Init, Rng};
use brgemm_primitives::layout::Blocked;
use brgemm_primitives::loss;
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::threads::Pool;

/// One layer of an [`Mlp`]: output features and activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Output features.
    pub out: usize,
    /// Activation.
    pub act: Activation,
}

impl LayerSpec {
    /// A classifier head: `hidden` ReLU layers, then `classes` logits
    /// (identity).
    pub fn classifier(hidden: &[usize], classes: usize) -> Vec<LayerSpec> {
        let relu = hidden.iter().map(|&out| LayerSpec {
            out,
            act: Activation::Relu,
        });
        relu.chain([LayerSpec {
            out: classes,
            act: Activation::Identity,
        }])
        .collect()
    }
}

struct Layer {
    fc: Fc,
    w: Blocked,
    wt: Blocked,
    b: Vec<f32>,
    dw: Blocked,
    db: Vec<f32>,
    y: Blocked,
    z: Option<Blocked>,
    dz: Blocked,
    /// Gradient w.r.t. this layer's input (the previous layer's dY).
    dx: Blocked,
    ow: OptState,
    ob: OptState,
}

/// A multi-layer perceptron on blocked layouts.
pub struct Mlp {
    inputs: usize,
    batch: usize,
    layers: Vec<Layer>,
    dlogits: Blocked,
    input_grad: bool,
}

fn act_code(a: Activation) -> u8 {
    match a {
        Activation::Identity => 0,
        Activation::Relu => 1,
        Activation::Sigmoid => 2,
        Activation::Tanh => 3,
        Activation::Gelu => 4,
        _ => 255,
    }
}

fn act_from(c: u8) -> Result<Activation> {
    Ok(match c {
        0 => Activation::Identity,
        1 => Activation::Relu,
        2 => Activation::Sigmoid,
        3 => Activation::Tanh,
        4 => Activation::Gelu,
        _ => return Err(Error::Io(format!("unknown activation code {c}"))),
    })
}

impl Mlp {
    /// Plans the layers for `inputs` features and minibatch `batch`, with
    /// weights drawn from `seed` (Kaiming for ReLU/GELU layers, Xavier for
    /// the others) and zero biases.
    pub fn new(inputs: usize, batch: usize, specs: &[LayerSpec], seed: u64) -> Result<Mlp> {
        Mlp::with_tunings(inputs, batch, specs, seed, &[])
    }

    /// As [`Mlp::new`], with an explicit tuning per layer (missing entries
    /// use the heuristic). Adjacent layers must agree on the block of the
    /// features between them.
    pub fn with_tunings(
        inputs: usize,
        batch: usize,
        specs: &[LayerSpec],
        seed: u64,
        tunings: &[FcTuning],
    ) -> Result<Mlp> {
        if specs.is_empty() {
            return Err(shape("layers", 0, "an MLP needs at least one layer"));
        }
        let mut rng = Rng::new(seed);
        let mut layers: Vec<Layer> = Vec::new();
        let mut c = inputs;
        for (i, s) in specs.iter().enumerate() {
            let t = tunings
                .get(i)
                .cloned()
                .unwrap_or_else(|| FcTuning::heuristic(batch, c, s.out));
            let fc = Fc::with_tuning(batch, c, s.out, s.act, t)?;
            if let Some(prev) = layers.last() {
                if prev.y.bc() != fc.x_layout().bc() || prev.y.br() != fc.x_layout().br() {
                    return Err(shape(
                        format!("layer {i} blocking"),
                        format!("bn={} bc={}", fc.tuning().bn, fc.tuning().bc),
                        format!(
                            "must match layer {} output blocks bn={} bk={}",
                            i - 1,
                            prev.y.br(),
                            prev.y.bc()
                        ),
                    ));
                }
            }
            let kind = if matches!(s.act, Activation::Relu | Activation::Gelu) {
                Init::Kaiming
            } else {
                Init::Xavier
            };
            let mut w = fc.w_layout();
            w.set_plain(&init::weights(kind, s.out, c, &mut rng))?;
            layers.push(Layer {
                wt: fc.wt_layout(),
                b: vec![0.0; fc.padded_k()],
                dw: fc.w_layout(),
                db: vec![0.0; fc.padded_k()],
                y: fc.y_layout(),
                z: (s.act == Activation::Gelu).then(|| fc.y_layout()),
                dz: fc.y_layout(),
                dx: fc.x_layout(),
                ow: OptState::default(),
                ob: OptState::default(),
                w,
                fc,
            });
            c = s.out;
        }
        let dlogits = layers.last().unwrap().fc.y_layout();
        Ok(Mlp {
            inputs,
            batch,
            layers,
            dlogits,
            input_grad: false,
        })
    }

    /// Input features.
    pub fn inputs(&self) -> usize {
        self.inputs
    }
    /// Minibatch size the model was planned for.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Output classes.
    pub fn outputs(&self) -> usize {
        self.layers.last().unwrap().fc.k()
    }
    /// The planned layers.
    pub fn layers(&self) -> impl Iterator<Item = &Fc> {
        self.layers.iter().map(|l| &l.fc)
    }
    /// A zero input minibatch in the layout [`Mlp::forward`] reads.
    pub fn input_layout(&self) -> Blocked {
        self.layers[0].fc.x_layout()
    }
    /// Floating-point operations of one training step (3 passes per layer).
    pub fn train_flops(&self) -> f64 {
        self.layers.iter().map(|l| 3.0 * l.fc.flops()).sum()
    }

    /// Forward pass; returns the logits (N x classes, blocked).
    pub fn forward(&mut self, pool: &Pool, x: &Blocked) -> Result<&Blocked> {
        for i in 0..self.layers.len() {
            let (done, rest) = self.layers.split_at_mut(i);
            let l = &mut rest[0];
            let input = if i == 0 { x } else { &done[i - 1].y };
            l.fc.forward(pool, input, &l.w, &l.b, &mut l.y, l.z.as_mut())?;
        }
        Ok(&self.layers.last().unwrap().y)
    }

    /// Gradients of all weights and biases for the current forward state,
    /// given dL/dlogits (in `self.dlogits`). `ready(i, dw, db)` runs as soon
    /// as layer `i`'s gradients are complete (last layer first), while the
    /// earlier layers are still to come: the place to start communication.
    fn backward(
        &mut self,
        pool: &Pool,
        x: &Blocked,
        ready: &mut dyn FnMut(usize, &mut Blocked, &mut [f32]),
    ) -> Result<()> {
        for i in (0..self.layers.len()).rev() {
            let (done, rest) = self.layers.split_at_mut(i);
            let (l, above) = rest.split_first_mut().unwrap();
            let dy = if let Some(a) = above.first() {
                &a.dx
            } else {
                &self.dlogits
            };
            l.fc.activation_backward(pool, dy, &l.y, l.z.as_ref(), &mut l.dz)?;
            let input = if i == 0 { x } else { &done[i - 1].y };
            l.fc.backward_weights(pool, &l.dz, input, &mut l.dw, &mut l.db)?;
            ready(i, &mut l.dw, &mut l.db);
            if i > 0 || self.input_grad {
                l.fc.transpose_weights(pool, &l.w, &mut l.wt)?;
                l.fc.backward_data(pool, &l.dz, &l.wt, &mut l.dx)?;
            }
        }
        Ok(())
    }

    /// Forward, loss and backward on the first `labels.len()` rows of `x`;
    /// leaves the gradients in the model and returns the mean loss.
    pub fn compute_gradients(&mut self, pool: &Pool, x: &Blocked, labels: &[usize]) -> Result<f32> {
        self.compute_gradients_with(pool, x, labels, |_, _, _| {})
    }

    /// As [`Mlp::compute_gradients`], calling `ready(layer, dw, db)` as soon
    /// as each layer's weight and bias gradients are complete, last layer
    /// first, while backward goes on for the layers below. `dw` is the
    /// blocked gradient buffer (zero padding included) and `db` the padded
    /// bias gradient; the hook may rewrite them (e.g. scale, or replace with
    /// an all-reduced sum before [`Mlp::apply_gradients`]).
    pub fn compute_gradients_with(
        &mut self,
        pool: &Pool,
        x: &Blocked,
        labels: &[usize],
        mut ready: impl FnMut(usize, &mut Blocked, &mut [f32]),
    ) -> Result<f32> {
        self.forward(pool, x)?;
        let logits = &self.layers.last().unwrap().y;
        let loss = loss::softmax_cross_entropy(logits, labels, &mut self.dlogits)?;
        self.backward(pool, x, &mut ready)?;
        Ok(loss)
    }

    /// Whether backward also computes dL/dinput (for a network in front of
    /// this MLP, e.g. convolutions); off by default.
    pub fn set_input_gradient(&mut self, on: bool) {
        self.input_grad = on;
    }

    /// dL/dinput of the last backward (valid with [`Mlp::set_input_gradient`]),
    /// in the layout of [`Mlp::input_layout`].
    pub fn input_gradient(&self) -> &Blocked {
        &self.layers[0].dx
    }

    /// Mutable gradient buffers of layer `i` (blocked weights, padded bias),
    /// e.g. to write back all-reduced gradients.
    pub fn gradients_mut(&mut self, i: usize) -> (&mut Blocked, &mut [f32]) {
        let l = &mut self.layers[i];
        (&mut l.dw, &mut l.db)
    }

    /// Mutable parameter buffers of layer `i` (blocked weights, padded bias),
    /// e.g. to broadcast them.
    pub fn parameters_mut(&mut self, i: usize) -> (&mut Blocked, &mut [f32]) {
        let l = &mut self.layers[i];
        (&mut l.w, &mut l.b)
    }

    /// Applies the optimizer to every parameter with the stored gradients.
    pub fn apply_gradients(&mut self, opt: &Optimizer) {
        for l in &mut self.layers {
            l.ow.step(opt, l.w.data_mut(), l.dw.data());
            l.ob.step(opt, &mut l.b, &l.db);
        }
    }

    /// The L2 norm of every gradient of the last backward (weights and
    /// biases of all layers), for [`brgemm_primitives::guard::check_step`].
    pub fn gradient_norm(&self) -> f64 {
        brgemm_primitives::guard::norm(self.layers.iter().flat_map(|l| [l.dw.data(), &l.db[..]]))
    }

    /// Predicted classes of the first `rows` rows of `x`.
    pub fn predict(&mut self, pool: &Pool, x: &Blocked, rows: usize) -> Result<Vec<usize>> {
        let logits = self.forward(pool, x)?;
        loss::argmax_rows(logits, rows)
    }

    /// Weights (plain row-major `[K][C]`) and biases (length K) of layer `i`.
    pub fn parameters(&self, i: usize) -> (Vec<f32>, Vec<f32>) {
        let l = &self.layers[i];
        (l.w.to_plain(), l.b[..l.fc.k()].to_vec())
    }
    /// Gradients of layer `i`, plain, as [`Mlp::parameters`].
    pub fn gradients(&self, i: usize) -> (Vec<f32>, Vec<f32>) {
        let l = &self.layers[i];
        (l.dw.to_plain(), l.db[..l.fc.k()].to_vec())
    }
    /// Sets layer `i`'s weights and biases from plain buffers.
    pub fn set_parameters(&mut self, i: usize, w: &[f32], b: &[f32]) -> Result<()> {
        let l = self
            .layers
            .get_mut(i)
            .ok_or_else(|| shape("layer", i, "no such layer"))?;
        if b.len() != l.fc.k() {
            return Err(shape(
                "bias length",
                b.len(),
                format!("layer has {} outputs", l.fc.k()),
            ));
        }
        l.w.set_plain(w)?;
        l.b[..b.len()].copy_from_slice(b);
        Ok(())
    }
    /// Number of layers.
    pub fn depth(&self) -> usize {
        self.layers.len()
    }

    /// Appends every layer's plain weights and biases (what a model file
    /// stores; a CNN's or sequence model's head uses it too).
    pub(crate) fn write_values(&self, out: &mut Vec<f32>) {
        for i in 0..self.layers.len() {
            let (w, b) = self.parameters(i);
            out.extend_from_slice(&w);
            out.extend_from_slice(&b);
        }
    }

    /// Sets every layer's weights and biases from a model file's values, in
    /// [`Mlp::write_values`]' order.
    pub(crate) fn read_values(&mut self, v: &mut Values) -> Result<()> {
        let mut c = self.inputs;
        for i in 0..self.layers.len() {
            let k = self.layers[i].fc.k();
            let w = v.take(k * c, &format!("layer {i} weights"))?;
            let b = v.take(k, &format!("layer {i} bias"))?;
            self.set_parameters(i, w, b)?;
            c = k;
        }
        Ok(())
    }
}

impl ModelFile for Mlp {
    const KIND: [u8; 4] = *b"MLP\0";

    fn header(&self) -> Vec<u8> {
        let mut h = Vec::new();
        put_u64(&mut h, self.inputs);
        put_u64(&mut h, self.layers.len());
        for l in &self.layers {
            put_u64(&mut h, l.fc.k());
            h.push(act_code(l.fc.act()));
        }
        h
    }

    fn values(&self) -> Vec<f32> {
        let mut v = Vec::new();
        self.write_values(&mut v);
        v
    }

    fn from_parts(header: &[u8], values: &[f32], batch: usize) -> Result<Mlp> {
        let mut h = Bytes::new(header);
        let inputs = get_size(&mut h, "MLP inputs", 1 << 24)?;
        let depth = get_size(&mut h, "MLP depth", 1024)?;
        let mut specs = Vec::with_capacity(depth);
        for i in 0..depth {
            let out = get_size(&mut h, &format!("layer {i} outputs"), 1 << 24)?;
            let act = act_from(h.u8().map_err(Error::Io)?)?;
            specs.push(LayerSpec { out, act });
        }
        check_counts(&h, Some(param_count(inputs, &specs)), values.len())?;
        let mut m = Mlp::new(inputs, batch, &specs, 0)?;
        let mut v = Values::new(values);
        m.read_values(&mut v)?;
        v.finish()?;
        Ok(m)
    }
}

/// Weights and biases of a classifier head reading `inputs` features:
/// `hidden` layers, then `classes`; `None` on overflow.
pub(crate) fn head_parameter_count(
    inputs: usize,
    hidden: &[usize],
    classes: usize,
) -> Option<usize> {
    let (mut c, mut n) = (inputs, 0usize);
    for &out in hidden.iter().chain([&classes]) {
        n = n.checked_add(out.checked_mul(c)?.checked_add(out)?)?;
        c = out;
    }
    Some(n)
}

/// Weights and biases of an MLP of these layers (at most 1024 layers of
/// at most 2^24 wide each: no overflow).
fn param_count(inputs: usize, specs: &[LayerSpec]) -> usize {
    let mut c = inputs;
    let mut count = 0;
    for s in specs {
        count += s.out * c + s.out;
        c = s.out;
    }
    count
}

/// The MLP of `specs` on the layer graph, for minibatch `batch` and
/// `inputs` features per sample: one [`crate::layers::Linear`] per spec (the
/// activation fused), weights drawn from `seed + layer` (He initialisation
/// for ReLU and GELU layers, Glorot for the others), zero biases. It trains
/// with the graph's loop, file and data-parallel replica, in mixed bf16
/// precision after [`crate::Graph::set_bf16`].
pub fn mlp(
    inputs: usize,
    batch: usize,
    specs: &[LayerSpec],
    seed: u64,
) -> crate::Result<crate::Graph> {
    mlp_with_tunings(inputs, batch, specs, seed, &[])
}

/// [`mlp`] with the blocking and loop orders of layer `i` from
/// `tunings[i]` (missing entries: the heuristic's).
pub fn mlp_with_tunings(
    inputs: usize,
    batch: usize,
    specs: &[LayerSpec],
    seed: u64,
    tunings: &[FcTuning],
) -> crate::Result<crate::Graph> {
    if specs.is_empty() {
        return Err(crate::Error::Graph(
            "an MLP needs at least one layer".into(),
        ));
    }
    let mut g = crate::GraphBuilder::new(crate::Shape::flat(batch, inputs));
    let mut x = g.input();
    let mut c = inputs;
    for (i, s) in specs.iter().enumerate() {
        let mut l = crate::layers::Linear::new(c, s.out, s.act, seed + i as u64);
        if let Some(t) = tunings.get(i) {
            l = l.with_tuning(t.clone());
        }
        x = g.layer(x, l)?;
        c = s.out;
    }
    g.build(x)
}
