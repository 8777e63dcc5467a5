//! [`SeqClassifier`]: stacked, optionally bidirectional LSTM/RNN layers
//! whose final hidden states feed an [`Mlp`] head, trained end to end.
//!
//! Layer `l > 0` reads, at every step, the concatenated outputs of layer
//! `l - 1`'s directions (forward h_t, and the backward direction's output
//! for the same time t). The head reads the final state of each direction of
//! the top layer (forward: after step T-1; backward: after reading step 0).

use super::mlp::{LayerSpec, Mlp};
use super::shape;
use crate::modelfile::{
    check_counts, get_flag, get_head, get_size, put_head, put_u64, Bytes, ModelFile, Values,
};
use brgemm_primitives::error::{Error, Result};
use brgemm_primitives::init::Rng;
use brgemm_primitives::layout::Blocked;
use brgemm_primitives::loss;
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::rnn::{CellKind, Rnn, RnnGrads, RnnState};
use brgemm_primitives::threads::Pool;

/// What a sequence classifier looks like.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqSpec {
    /// LSTM or RNN cells.
    pub kind: CellKind,
    /// Steps per sequence.
    pub steps: usize,
    /// Features per step.
    pub features: usize,
    /// Hidden units per direction.
    pub hidden: usize,
    /// Stacked layers.
    pub layers: usize,
    /// Run every layer in both directions.
    pub bidirectional: bool,
    /// Hidden FC layers of the head (ReLU).
    pub head: Vec<usize>,
    /// Classes.
    pub classes: usize,
}

struct Dir {
    rnn: Rnn,
    w: Blocked,
    r: Blocked,
    b: Vec<f32>,
    /// This direction's input sequence (reversed in time for backward).
    x: Blocked,
    st: RnnState,
    gr: RnnGrads,
    /// dL/dh for every step.
    dh: Blocked,
    ow: OptState,
    or: OptState,
    ob: OptState,
}

/// A planned sequence classifier with parameters, gradients and optimizer
/// state, for minibatch `batch`.
pub struct SeqClassifier {
    spec: SeqSpec,
    batch: usize,
    /// layers x directions.
    dirs: Vec<Vec<Dir>>,
    /// Head input: the final states.
    feat: Blocked,
    mlp: Mlp,
}

/// Copies the `rows x cols` region of `src` at `(src_row, src_col)` into
/// `dst` at `(dst_row, dst_col)` (plain indices: the layouts may block
/// differently).
fn copy_region(
    src: &Blocked,
    (src_row, src_col): (usize, usize),
    dst: &mut Blocked,
    (dst_row, dst_col): (usize, usize),
    (rows, cols): (usize, usize),
) {
    for i in 0..rows {
        for c in 0..cols {
            let v = src.data()[src.index(src_row + i, src_col + c)];
            let j = dst.index(dst_row + i, dst_col + c);
            dst.data_mut()[j] = v;
        }
    }
}

impl SeqClassifier {
    /// Plans every layer; weights uniform in ±1/sqrt(hidden) (the usual
    /// LSTM initialisation), forget-gate bias 1, from `seed`.
    pub fn new(spec: &SeqSpec, batch: usize, seed: u64) -> Result<SeqClassifier> {
        if spec.layers == 0 {
            return Err(shape("layers", 0, "at least one recurrent layer"));
        }
        let mut rng = Rng::new(seed);
        let nd = if spec.bidirectional { 2 } else { 1 };
        let mut dirs = vec![];
        let mut inputs = spec.features;
        for _ in 0..spec.layers {
            let mut layer = vec![];
            for _ in 0..nd {
                let rnn = Rnn::new(spec.kind, spec.steps, batch, inputs, spec.hidden)?;
                let lim = 1.0 / (spec.hidden as f32).sqrt();
                let (mut w, mut r) = (rnn.w_layout(), rnn.r_layout());
                let mut b = vec![0.0; rnn.bias_len()];
                for g in 0..spec.kind.gates() {
                    let mut draw = |n: usize| {
                        (0..n)
                            .map(|_| lim * (2.0 * rng.uniform() - 1.0))
                            .collect::<Vec<f32>>()
                    };
                    let (pw, pr) = (draw(spec.hidden * inputs), draw(spec.hidden * spec.hidden));
                    rnn.set_gate_weights(&mut w, g, &pw)?;
                    rnn.set_gate_weights(&mut r, g, &pr)?;
                }
                if spec.kind == CellKind::Lstm {
                    let kp = rnn.padded_k();
                    b[kp..kp + spec.hidden].fill(1.0);
                }
                layer.push(Dir {
                    x: rnn.x_layout(),
                    st: rnn.state(),
                    gr: rnn.grads(),
                    dh: rnn.h_layout(),
                    ow: OptState::default(),
                    or: OptState::default(),
                    ob: OptState::default(),
                    w,
                    r,
                    b,
                    rnn,
                });
            }
            dirs.push(layer);
            inputs = nd * spec.hidden;
        }
        let head = LayerSpec::classifier(&spec.head, spec.classes);
        let mut mlp = Mlp::new(nd * spec.hidden, batch, &head, rng.next_u64())?;
        mlp.set_input_gradient(true);
        Ok(SeqClassifier {
            feat: mlp.input_layout(),
            spec: spec.clone(),
            batch,
            dirs,
            mlp,
        })
    }

    /// Minibatch size.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// The specification.
    pub fn spec(&self) -> &SeqSpec {
        &self.spec
    }
    /// A zero input sequence in the layout the first layer reads (see
    /// [`Rnn::set_sequence`] via [`SeqClassifier::set_input`]).
    pub fn input_layout(&self) -> Blocked {
        self.dirs[0][0].rnn.x_layout()
    }
    /// Writes a plain `[T][N][features]` minibatch into `x`.
    pub fn set_input(&self, x: &mut Blocked, plain: &[f32]) -> Result<()> {
        self.dirs[0][0].rnn.set_sequence(x, plain)
    }
    /// Floating-point operations of a training step (recurrent layers:
    /// forward plus twice that for backward; the head's own count).
    pub fn train_flops(&self) -> f64 {
        self.dirs
            .iter()
            .flatten()
            .map(|d| 3.0 * d.rnn.flops())
            .sum::<f64>()
            + self.mlp.train_flops()
    }

    /// Layer `l`, direction `d`'s input: x itself or reversed in time.
    fn fill_input(&mut self, l: usize, x: &Blocked) {
        let t = self.spec.steps;
        let (done, rest) = self.dirs.split_at_mut(l);
        for (d, dir) in rest[0].iter_mut().enumerate() {
            let np = dir.rnn.padded_n();
            let src_of = |s: usize| if d == 0 { s } else { t - 1 - s };
            if l == 0 {
                if d == 0 {
                    dir.x.data_mut().copy_from_slice(x.data());
                } else {
                    // Row blocks of one step are contiguous: copy them reversed.
                    let step = dir.x.data().len() / t;
                    for s in 0..t {
                        dir.x.data_mut()[s * step..][..step]
                            .copy_from_slice(&x.data()[src_of(s) * step..][..step]);
                    }
                }
            } else {
                // Concatenate the directions of layer l-1 at the same time.
                let k = self.spec.hidden;
                for s in 0..t {
                    let time = src_of(s);
                    for (pd, prev) in done[l - 1].iter().enumerate() {
                        let ps = if pd == 0 { time } else { t - 1 - time };
                        copy_region(
                            prev.st.h(),
                            (ps * np, 0),
                            &mut dir.x,
                            (s * np, pd * k),
                            (np, k),
                        );
                    }
                }
            }
        }
    }

    fn forward_layers(&mut self, pool: &Pool, x: &Blocked) -> Result<()> {
        for l in 0..self.dirs.len() {
            self.fill_input(l, x);
            for dir in &mut self.dirs[l] {
                dir.rnn.forward(
                    pool,
                    &dir.x,
                    &dir.w,
                    &dir.r,
                    &dir.b,
                    None,
                    None,
                    &mut dir.st,
                )?;
            }
        }
        let (t, k) = (self.spec.steps, self.spec.hidden);
        for (d, dir) in self.dirs.last().unwrap().iter().enumerate() {
            let np = dir.rnn.padded_n();
            let last = (t - 1) * np;
            copy_region(
                dir.st.h(),
                (last, 0),
                &mut self.feat,
                (0, d * k),
                (self.batch, k),
            );
        }
        Ok(())
    }

    /// Predicted classes of the first `rows` sequences of `x`.
    pub fn predict(&mut self, pool: &Pool, x: &Blocked, rows: usize) -> Result<Vec<usize>> {
        self.forward_layers(pool, x)?;
        let logits = self.mlp.forward(pool, &self.feat)?;
        loss::argmax_rows(logits, rows)
    }

    /// Forward, loss on the first `labels.len()` sequences, backward
    /// through time; leaves every gradient in the model and returns the
    /// mean loss.
    pub fn compute_gradients(&mut self, pool: &Pool, x: &Blocked, labels: &[usize]) -> Result<f32> {
        self.forward_layers(pool, x)?;
        let loss = self.mlp.compute_gradients(pool, &self.feat, labels)?;
        let (t, k) = (self.spec.steps, self.spec.hidden);
        let nl = self.dirs.len();
        // Top layer: only the final state of each direction is read.
        let dfeat = self.mlp.input_gradient();
        for (d, dir) in self.dirs[nl - 1].iter_mut().enumerate() {
            dir.dh.data_mut().fill(0.0);
            let np = dir.rnn.padded_n();
            copy_region(
                dfeat,
                (0, d * k),
                &mut dir.dh,
                ((t - 1) * np, 0),
                (self.batch, k),
            );
        }
        for l in (0..nl).rev() {
            for dir in &mut self.dirs[l] {
                dir.rnn
                    .backward(pool, &dir.dh, &dir.x, &dir.w, &dir.r, &dir.st, &mut dir.gr)?;
            }
            if l > 0 {
                // dL/d(layer l-1 outputs): sum over this layer's directions
                // of the matching columns of their dX, un-reversed.
                let (below, here) = self.dirs.split_at_mut(l);
                for prev in below[l - 1].iter_mut() {
                    prev.dh.data_mut().fill(0.0);
                }
                for (d, dir) in here[0].iter().enumerate() {
                    let np = dir.rnn.padded_n();
                    for s in 0..t {
                        let time = if d == 0 { s } else { t - 1 - s };
                        for (pd, prev) in below[l - 1].iter_mut().enumerate() {
                            let ps = if pd == 0 { time } else { t - 1 - time };
                            for n in 0..np {
                                for c in 0..k {
                                    let v = dir.gr.dx().data()
                                        [dir.gr.dx().index(s * np + n, pd * k + c)];
                                    let j = prev.dh.index(ps * np + n, c);
                                    prev.dh.data_mut()[j] += v;
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(loss)
    }

    /// Applies the optimizer to every parameter.
    pub fn apply_gradients(&mut self, opt: &Optimizer) {
        for dir in self.dirs.iter_mut().flatten() {
            dir.ow.step(opt, dir.w.data_mut(), dir.gr.dw().data());
            dir.or.step(opt, dir.r.data_mut(), dir.gr.dr().data());
            dir.ob.step(opt, &mut dir.b, dir.gr.db());
        }
        self.mlp.apply_gradients(opt);
    }

    /// Mutable W, R and bias of layer `l`, direction `d` (0 forward, 1
    /// backward), e.g. to load weights.
    pub fn parameters_mut(
        &mut self,
        l: usize,
        d: usize,
    ) -> (&mut Blocked, &mut Blocked, &mut [f32]) {
        let dir = &mut self.dirs[l][d];
        (&mut dir.w, &mut dir.r, &mut dir.b)
    }

    /// dW, dR and db of layer `l`, direction `d`, from the last backward.
    pub fn gradients(&self, l: usize, d: usize) -> (&Blocked, &Blocked, &[f32]) {
        let g = &self.dirs[l][d].gr;
        (g.dw(), g.dr(), g.db())
    }

    /// The L2 norm of every gradient of the last backward, for
    /// [`brgemm_primitives::guard::check_step`].
    pub fn gradient_norm(&self) -> f64 {
        let rnn = self
            .dirs
            .iter()
            .flatten()
            .flat_map(|d| [d.gr.dw().data(), d.gr.dr().data(), d.gr.db()]);
        let head = self.mlp.gradient_norm();
        (brgemm_primitives::guard::norm(rnn).powi(2) + head * head).sqrt()
    }
}

impl SeqSpec {
    /// Parameters a model of this spec holds (what its model file stores):
    /// every direction's W, R and bias, then the head. `None` on overflow.
    pub fn parameter_count(&self) -> Option<usize> {
        let (g, k) = (self.kind.gates(), self.hidden);
        let nd = if self.bidirectional { 2 } else { 1 };
        let mut n = 0usize;
        let mut inputs = self.features;
        for _ in 0..self.layers {
            let dir = g
                .checked_mul(k)?
                .checked_mul(inputs.checked_add(k)?.checked_add(1)?)?;
            n = n.checked_add(dir.checked_mul(nd)?)?;
            inputs = nd * k;
        }
        n.checked_add(super::mlp::head_parameter_count(
            nd * k,
            &self.head,
            self.classes,
        )?)
    }
}

impl ModelFile for SeqClassifier {
    const KIND: [u8; 4] = *b"SEQ\0";

    fn header(&self) -> Vec<u8> {
        let s = &self.spec;
        let mut h = vec![match s.kind {
            CellKind::Lstm => 0,
            CellKind::Rnn => 1,
        }];
        for v in [s.steps, s.features, s.hidden, s.layers] {
            put_u64(&mut h, v);
        }
        h.push(s.bidirectional as u8);
        put_head(&mut h, &s.head, s.classes);
        h
    }

    fn values(&self) -> Vec<f32> {
        let mut v = Vec::new();
        for d in self.dirs.iter().flatten() {
            let kp = d.rnn.padded_k();
            for g in 0..self.spec.kind.gates() {
                v.extend_from_slice(&d.rnn.gate_weights(&d.w, g));
                v.extend_from_slice(&d.rnn.gate_weights(&d.r, g));
                v.extend_from_slice(&d.b[g * kp..g * kp + self.spec.hidden]);
            }
        }
        self.mlp.write_values(&mut v);
        v
    }

    fn from_parts(header: &[u8], values: &[f32], batch: usize) -> Result<SeqClassifier> {
        let io = |e: String| Error::Io(format!("sequence-model header: {e}"));
        let mut h = Bytes::new(header);
        let kind = match h.u8().map_err(io)? {
            0 => CellKind::Lstm,
            1 => CellKind::Rnn,
            c => return Err(io(format!("cell kind {c}"))),
        };
        let dim = 1 << 16;
        let steps = get_size(&mut h, "steps", dim)?;
        let features = get_size(&mut h, "features", dim)?;
        let hidden = get_size(&mut h, "hidden", dim)?;
        let layers = get_size(&mut h, "layers", 256)?;
        let bidirectional = get_flag(&mut h, "bidirectional")?;
        let (head, classes) = get_head(&mut h)?;
        let spec = SeqSpec {
            kind,
            steps,
            features,
            hidden,
            layers,
            bidirectional,
            head,
            classes,
        };
        check_counts(&h, spec.parameter_count(), values.len())?;
        let mut m = SeqClassifier::new(&spec, batch, 0)?;
        let mut v = Values::new(values);
        for (i, d) in m.dirs.iter_mut().flatten().enumerate() {
            let kp = d.rnn.padded_k();
            for g in 0..kind.gates() {
                let what = format!("direction {i} gate {g}");
                let cols = d.w.cols();
                d.rnn
                    .set_gate_weights(&mut d.w, g, v.take(hidden * cols, &what)?)?;
                d.rnn
                    .set_gate_weights(&mut d.r, g, v.take(hidden * hidden, &what)?)?;
                d.b[g * kp..g * kp + hidden].copy_from_slice(v.take(hidden, &what)?);
            }
        }
        m.mlp.read_values(&mut v)?;
        v.finish()?;
        Ok(m)
    }
}
