//! An LSTM or tanh RNN over a whole sequence, over
//! [`brgemm_primitives::Rnn`], with its final states and their gradients
//! reachable from outside (an encoder hands its state to a decoder).

use super::{expect_values, need_training, unbuilt};
use crate::error::{Error, Result};
use crate::layer::{Layer, Mode, Param};
use crate::tensor::{Shape, Tensor};
use brgemm_primitives::init::Rng;
use brgemm_primitives::rnn::{RnnBf16, RnnBf16Weights};
use brgemm_primitives::{Blocked, CellKind, Pool, Rnn, RnnGrads, RnnState, RnnTuning};

/// A recurrent layer over sequences.
///
/// A sequence is a tensor `(n, features, steps, 1)`: per sample, per
/// feature, the steps in order (PyTorch's `(N, C, L)` of `Conv1d`; a
/// `batch_first` LSTM input `(N, L, C)` is its transpose). The output is
/// the hidden state of every step, `(n, hidden, steps, 1)`, or with
/// [`Recurrent::last_only`] the last step's, `(n, hidden, 1, 1)`.
///
/// Weights import from PyTorch's `nn.LSTM` (`nn.RNN` with tanh) in its
/// order: `weight_ih_l0` `[gates*hidden][features]`, `weight_hh_l0`
/// `[gates*hidden][hidden]`, gates i, f, g, o (the same order here), and
/// one bias `[gates*hidden]` that is PyTorch's `bias_ih_l0 + bias_hh_l0`
/// (the two are only ever added).
///
/// The initial state (h_0, c_0; zero unless set), the final state (h_T,
/// c_T) of the last forward, a gradient for the final state added to the
/// next backward, and the gradient reaching the initial state are all
/// plain `[n][hidden]`.
pub struct Recurrent {
    kind: CellKind,
    features: usize,
    hidden: usize,
    last_only: bool,
    /// W, R (PyTorch order) and the bias until built.
    values: Option<[Vec<f32>; 3]>,
    initial: Option<(Vec<f32>, Vec<f32>)>,
    final_grad: Option<(Vec<f32>, Vec<f32>)>,
    /// Mixed precision asked for ([`Layer::set_bf16`]).
    bf16: bool,
    plan: Option<Plan>,
}

/// The bf16 side of mixed precision: the passes, W and R packed from the
/// f32 masters, and whether the packed copies are current.
struct Bf16Side {
    rnn: RnnBf16,
    packed: RnnBf16Weights,
    current: bool,
}

impl Bf16Side {
    /// The bf16 passes of `rnn` where their kernel beats f32 on this CPU
    /// ([`brgemm::bf16::Bf16Isa::beats_f32`]), else None.
    fn new(rnn: &Rnn) -> Option<Bf16Side> {
        let m = RnnBf16::new(rnn).ok()?;
        m.isa().beats_f32().then(|| Bf16Side {
            rnn: m,
            packed: RnnBf16Weights::default(),
            current: false,
        })
    }
}

struct Plan {
    rnn: Rnn,
    n: usize,
    steps: usize,
    x: Blocked,
    w: Blocked,
    r: Blocked,
    b: Vec<f32>,
    st: RnnState,
    gr: RnnGrads,
    dh: Blocked,
    h0: Blocked,
    c0: Blocked,
    dc_last: Blocked,
    trained: bool,
    /// Mixed precision, where on and paying.
    bf: Option<Bf16Side>,
}

impl Recurrent {
    /// An LSTM `features -> hidden`: weights uniform in ±1/sqrt(hidden)
    /// (PyTorch's initialisation) from `seed`, forget-gate bias 1.
    pub fn lstm(features: usize, hidden: usize, seed: u64) -> Recurrent {
        Recurrent::new(CellKind::Lstm, features, hidden, seed)
    }

    /// A tanh RNN `features -> hidden`, initialised as [`Recurrent::lstm`]
    /// (zero bias).
    pub fn rnn(features: usize, hidden: usize, seed: u64) -> Recurrent {
        Recurrent::new(CellKind::Rnn, features, hidden, seed)
    }

    fn new(kind: CellKind, features: usize, hidden: usize, seed: u64) -> Recurrent {
        let g = kind.gates();
        let mut rng = Rng::new(seed);
        let lim = 1.0 / (hidden.max(1) as f32).sqrt();
        let mut draw = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| lim * (2.0 * rng.uniform() - 1.0))
                .collect()
        };
        let w = draw(g * hidden * features);
        let r = draw(g * hidden * hidden);
        let mut b = vec![0.0; g * hidden];
        if kind == CellKind::Lstm {
            b[hidden..2 * hidden].fill(1.0);
        }
        Recurrent {
            kind,
            features,
            hidden,
            last_only: false,
            bf16: false,
            values: Some([w, r, b]),
            initial: None,
            final_grad: None,
            plan: None,
        }
    }

    /// Outputs only the last step's hidden state, `(n, hidden, 1, 1)`.
    pub fn last_only(mut self) -> Recurrent {
        self.last_only = true;
        self
    }

    fn gates(&self) -> usize {
        self.kind.gates()
    }

    fn is_lstm(&self) -> bool {
        self.kind == CellKind::Lstm
    }

    /// Checks that `v` is `[n][hidden]` for the built minibatch.
    fn check_state(&self, what: &str, v: &[f32]) -> Result<()> {
        let p = self.plan.as_ref().ok_or_else(|| unbuilt(what))?;
        if v.len() != p.n * self.hidden {
            return Err(Error::Graph(format!(
                "{}: {what} has {} values, expected n x hidden = {}",
                self.name(),
                v.len(),
                p.n * self.hidden
            )));
        }
        Ok(())
    }

    /// Sets the initial state for the following forwards (`[n][hidden]`
    /// each; `c0` must be empty for the tanh RNN).
    pub fn set_initial_state(&mut self, h0: &[f32], c0: &[f32]) -> Result<()> {
        self.check_pair(("h0", h0), ("c0", c0))?;
        self.initial = Some((h0.to_vec(), c0.to_vec()));
        Ok(())
    }

    /// Checks an (h, c) pair of `[n][hidden]` states (c empty for the tanh
    /// RNN), naming the one that does not fit.
    fn check_pair(&self, (hn, h): (&str, &[f32]), (cn, c): (&str, &[f32])) -> Result<()> {
        self.check_state(hn, h)?;
        if self.is_lstm() {
            self.check_state(cn, c)
        } else if c.is_empty() {
            Ok(())
        } else {
            Err(Error::Graph(format!(
                "{}: a tanh RNN has no {cn}",
                self.name()
            )))
        }
    }

    /// Back to a zero initial state.
    pub fn clear_initial_state(&mut self) {
        self.initial = None;
    }

    /// h_T and c_T of the last forward (`[n][hidden]`; c_T empty for the
    /// tanh RNN).
    pub fn final_state(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let p = self.plan.as_ref().ok_or_else(|| unbuilt("final_state"))?;
        let np = p.rnn.padded_n();
        let rows = |b: &Blocked, first: usize| get_rows(b, first, p.n, self.hidden);
        let h = rows(p.st.h(), (p.steps - 1) * np);
        let c = if self.is_lstm() {
            rows(p.st.c(), p.steps * np)
        } else {
            Vec::new()
        };
        Ok((h, c))
    }

    /// dL/dh_T and dL/dc_T, added by the following backwards to what the
    /// output gradient gives (`c` empty for the tanh RNN).
    pub fn set_final_state_grad(&mut self, dh: &[f32], dc: &[f32]) -> Result<()> {
        self.check_pair(("dh_T", dh), ("dc_T", dc))?;
        self.final_grad = Some((dh.to_vec(), dc.to_vec()));
        Ok(())
    }

    /// No gradient for the final state beyond the output's.
    pub fn clear_final_state_grad(&mut self) {
        self.final_grad = None;
    }

    /// dL/dh_0 and dL/dc_0 of the last backward (`[n][hidden]`; dc_0 empty
    /// for the tanh RNN).
    pub fn initial_state_grad(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let p = self
            .plan
            .as_ref()
            .ok_or_else(|| unbuilt("initial_state_grad"))?;
        let first = |b: &Blocked| get_rows(b, 0, p.n, self.hidden);
        let dc = if self.is_lstm() {
            first(p.gr.dc0())
        } else {
            Vec::new()
        };
        Ok((first(p.gr.dh0()), dc))
    }

    /// W, R and the bias in PyTorch's order (see the type's docs).
    pub fn weights(&self) -> [Vec<f32>; 3] {
        match (&self.plan, &self.values) {
            (Some(p), _) => {
                let g = self.gates();
                let (kp, k) = (p.rnn.padded_k(), self.hidden);
                let stack = |m: &Blocked| -> Vec<f32> {
                    (0..g).flat_map(|j| p.rnn.gate_weights(m, j)).collect()
                };
                let b = (0..g).flat_map(|j| p.b[j * kp..][..k].to_vec()).collect();
                [stack(&p.w), stack(&p.r), b]
            }
            (None, Some(v)) => v.clone(),
            (None, None) => unreachable!("values live in the plan once built"),
        }
    }

    /// Sets W (`[gates*hidden][features]`), R (`[gates*hidden][hidden]`) and
    /// the bias (`[gates*hidden]`, PyTorch's `bias_ih + bias_hh`).
    pub fn set_weights(&mut self, w: &[f32], r: &[f32], b: &[f32]) -> Result<()> {
        let (g, k, c) = (self.gates(), self.hidden, self.features);
        let want = [g * k * c, g * k * k, g * k];
        for ((what, got), want) in ["W", "R", "bias"]
            .iter()
            .zip([w.len(), r.len(), b.len()])
            .zip(want)
        {
            if got != want {
                return Err(Error::Graph(format!(
                    "{}: {what} has {got} values, expected {want}",
                    self.name()
                )));
            }
        }
        match &mut self.plan {
            Some(p) => write_weights(p, g, k, [w, r, b])?,
            None => self.values = Some([w.to_vec(), r.to_vec(), b.to_vec()]),
        }
        Ok(())
    }
}

/// Writes PyTorch-order W, R and bias into a plan's blocked buffers.
fn write_weights(p: &mut Plan, g: usize, k: usize, [w, r, b]: [&[f32]; 3]) -> Result<()> {
    let (c, kp) = (w.len() / (g * k), p.rnn.padded_k());
    for j in 0..g {
        p.rnn
            .set_gate_weights(&mut p.w, j, &w[j * k * c..][..k * c])?;
        p.rnn
            .set_gate_weights(&mut p.r, j, &r[j * k * k..][..k * k])?;
        p.b[j * kp..][..k].copy_from_slice(&b[j * k..][..k]);
    }
    Ok(())
}

/// Rows `first..first + n` of `b` (`k` values each), plain.
fn get_rows(b: &Blocked, first: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0; n * k];
    for (i, row) in out.chunks_exact_mut(k).enumerate() {
        b.get_row(first + i, row);
    }
    out
}

/// `[n][k]` plain into the first `n` rows of a state buffer (`Np x K`).
fn set_rows(b: &mut Blocked, plain: &[f32], k: usize) -> Result<()> {
    for (r, row) in plain.chunks_exact(k).enumerate() {
        b.put_row(r, row);
    }
    Ok(())
}

impl Layer for Recurrent {
    fn name(&self) -> String {
        let cell = if self.is_lstm() { "lstm" } else { "rnn" };
        format!("{cell} {}->{}", self.features, self.hidden)
    }

    fn build(&mut self, input: Shape) -> Result<Shape> {
        let refuse = |reason: String| Error::Shape {
            layer: self.name(),
            input,
            reason,
        };
        if input.w != 1 {
            return Err(refuse("is not a sequence (n, features, steps, 1)".into()));
        }
        if input.c != self.features {
            return Err(refuse(format!(
                "has {} features, expected {}",
                input.c, self.features
            )));
        }
        let values = self.weights();
        let heuristic = match self.bf16 {
            true => RnnTuning::heuristic_bf16,
            false => RnnTuning::heuristic,
        };
        let tuning = heuristic(input.n, self.features, self.hidden);
        let rnn = Rnn::with_tuning(
            self.kind,
            input.h,
            input.n,
            self.features,
            self.hidden,
            tuning,
        )
        .map_err(|e| refuse(e.to_string()))?;
        let mut plan = Plan {
            n: input.n,
            steps: input.h,
            x: rnn.x_layout(),
            w: rnn.w_layout(),
            r: rnn.r_layout(),
            b: vec![0.0; rnn.bias_len()],
            st: rnn.state(),
            gr: rnn.grads(),
            dh: rnn.h_layout(),
            h0: rnn.state_layout(),
            c0: rnn.state_layout(),
            dc_last: rnn.state_layout(),
            trained: false,
            bf: self.bf16.then(|| Bf16Side::new(&rnn)).flatten(),
            rnn,
        };
        let [w, r, b] = &values;
        write_weights(&mut plan, self.gates(), self.hidden, [w, r, b])?;
        // A state set for another minibatch no longer fits.
        if self.plan.as_ref().is_some_and(|p| p.n != input.n) {
            self.initial = None;
            self.final_grad = None;
        }
        self.values = None;
        self.plan = Some(plan);
        let steps = if self.last_only { 1 } else { input.h };
        Ok(Shape::new(input.n, self.hidden, steps, 1))
    }

    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let (k, last_only) = (self.hidden, self.last_only);
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("forward"))?;
        let (n, t, c) = (p.n, p.steps, x.shape().c);
        // (n, c, t) NCHW -> row (t, n) of the blocked sequence.
        let (src, np) = (x.data(), p.rnn.padded_n());
        let mut row = vec![0.0; c];
        for ti in 0..t {
            for ni in 0..n {
                for (ci, v) in row.iter_mut().enumerate() {
                    *v = src[(ni * c + ci) * t + ti];
                }
                p.x.put_row(ti * np + ni, &row);
            }
        }
        let (h0, c0) = match &self.initial {
            Some((h, cs)) => {
                set_rows(&mut p.h0, h, k)?;
                if !cs.is_empty() {
                    set_rows(&mut p.c0, cs, k)?;
                }
                (Some(&p.h0), (!cs.is_empty()).then_some(&p.c0))
            }
            None => (None, None),
        };
        match &mut p.bf {
            Some(b) => {
                if !b.current {
                    b.rnn.pack_weights(pool, &p.w, &p.r, &mut b.packed)?;
                    b.current = true;
                }
                b.rnn
                    .forward(pool, &p.rnn, &p.x, &b.packed, &p.b, h0, c0, &mut p.st)?
            }
            None => p
                .rnn
                .forward(pool, &p.x, &p.w, &p.r, &p.b, h0, c0, &mut p.st)?,
        }
        p.trained = mode == Mode::Train;
        // Rows (t, n) of h -> (n, k, t), or (n, k, 1) from the last step only.
        let (first, steps) = if last_only { (t - 1, 1) } else { (0, t) };
        let mut out = vec![0.0; n * k * steps];
        let mut row = vec![0.0; k];
        for s in 0..steps {
            for ni in 0..n {
                p.st.h().get_row((first + s) * np + ni, &mut row);
                for (ki, v) in row.iter().enumerate() {
                    out[(ni * k + ki) * steps + s] = *v;
                }
            }
        }
        Tensor::from_vec(Shape::new(n, k, steps, 1), out)
    }

    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let (k, last_only, c) = (self.hidden, self.last_only, self.features);
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("backward"))?;
        need_training(p.trained, "recurrent")?;
        let (n, t) = (p.n, p.steps);
        // (n, k, steps) -> rows (t, n) of dh, zero where the output does
        // not read h_t; the final state's gradient joins step T-1.
        let (first, steps) = if last_only { (t - 1, 1) } else { (0, t) };
        let (g, np) = (dy.data(), p.rnn.padded_n());
        p.dh.data_mut().fill(0.0);
        let mut row = vec![0.0; k];
        for s in 0..steps {
            for ni in 0..n {
                for (ki, v) in row.iter_mut().enumerate() {
                    *v = g[(ni * k + ki) * steps + s];
                }
                if first + s == t - 1 {
                    if let Some((dht, _)) = &self.final_grad {
                        for (v, d) in row.iter_mut().zip(&dht[ni * k..][..k]) {
                            *v += d;
                        }
                    }
                }
                p.dh.put_row((first + s) * np + ni, &row);
            }
        }
        let dc_last = match &self.final_grad {
            Some((_, dct)) if !dct.is_empty() => {
                set_rows(&mut p.dc_last, dct, k)?;
                Some(&p.dc_last)
            }
            _ => None,
        };
        match &p.bf {
            // W and R were packed for both directions by the forward.
            Some(b) => b.rnn.backward_from_state(
                pool, &p.rnn, &p.dh, dc_last, &p.x, &b.packed, &p.st, &mut p.gr,
            )?,
            None => p
                .rnn
                .backward_from_state(pool, &p.dh, dc_last, &p.x, &p.w, &p.r, &p.st, &mut p.gr)?,
        }
        // Rows (t, n) of dx -> (n, c, t).
        let mut dx = vec![0.0; n * c * t];
        let mut row = vec![0.0; c];
        for ti in 0..t {
            for ni in 0..n {
                p.gr.dx().get_row(ti * np + ni, &mut row);
                for (ci, v) in row.iter().enumerate() {
                    dx[(ni * c + ci) * t + ti] = *v;
                }
            }
        }
        Tensor::from_vec(Shape::new(n, c, t, 1), dx)
    }

    fn set_bf16(&mut self, on: bool) -> Result<bool> {
        let was = std::mem::replace(&mut self.bf16, on);
        let Some(p) = &self.plan else {
            return Ok(false);
        };
        // Planned again: the blocks follow the precision.
        let input = Shape::new(p.n, self.features, p.steps, 1);
        if was != on {
            if let Err(e) = self.build(input) {
                self.bf16 = was;
                self.build(input)?;
                return Err(e);
            }
        }
        Ok(self.plan.as_ref().is_some_and(|p| p.bf.is_some()))
    }

    fn params(&mut self) -> Vec<Param<'_>> {
        let Some(p) = &mut self.plan else {
            return Vec::new();
        };
        // The caller may write them: the bf16 copies repack.
        if let Some(b) = &mut p.bf {
            b.current = false;
        }
        let (dw, dr, db) = p.gr.weights_mut();
        vec![
            Param {
                name: "weight_ih",
                value: p.w.data_mut(),
                grad: dw.data_mut(),
            },
            Param {
                name: "weight_hh",
                value: p.r.data_mut(),
                grad: dr.data_mut(),
            },
            Param {
                name: "bias",
                value: &mut p.b,
                grad: db,
            },
        ]
    }

    fn export(&self) -> Vec<(&'static str, Vec<f32>)> {
        let [w, r, b] = self.weights();
        vec![("weight_ih", w), ("weight_hh", r), ("bias", b)]
    }

    fn import(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        let (g, k, c) = (self.gates(), self.hidden, self.features);
        let want = [
            ("weight_ih", g * k * c),
            ("weight_hh", g * k * k),
            ("bias", g * k),
        ];
        let v = expect_values(&self.name(), values, &want)?;
        self.set_weights(v[0], v[1], v[2])
    }

    fn flops(&self) -> f64 {
        self.plan.as_ref().map_or(0.0, |p| p.rnn.flops())
    }
}
