//! Fully connected: `y = act(x W^T + b)` on flattened inputs, over
//! [`brgemm_primitives::Fc`].

use super::{expect_values, need_training, weight_and_bias, State};
use crate::error::{Error, Result};
use crate::layer::{Layer, Mode, Param};
use crate::tensor::{Shape, Tensor};
use brgemm::Activation;
use brgemm_primitives::init::{weights, Init, Rng};
use brgemm_primitives::{Blocked, Fc, Pool};

/// A fully connected layer with a fused activation. Weights are PyTorch's
/// `nn.Linear.weight` order, `[outputs][inputs]` row-major; the bias is
/// `[outputs]`.
pub struct Linear {
    inputs: usize,
    outputs: usize,
    act: Activation,
    state: State<Plan>,
}

struct Plan {
    fc: Fc,
    w: Blocked,
    wt: Blocked,
    bias: Vec<f32>,
    dw: Blocked,
    db: Vec<f32>,
    x: Blocked,
    y: Blocked,
    z: Blocked,
    dy: Blocked,
    dz: Blocked,
    dx: Blocked,
    trained: bool,
}

impl Linear {
    /// `inputs -> outputs` with activation `act`; weights drawn with He
    /// initialisation for ReLU-family activations, Glorot otherwise, from
    /// `seed`; zero bias.
    pub fn new(inputs: usize, outputs: usize, act: Activation, seed: u64) -> Linear {
        let init = match act {
            Activation::Relu | Activation::Gelu => Init::Kaiming,
            _ => Init::Xavier,
        };
        let w = weights(init, outputs, inputs.max(1), &mut Rng::new(seed));
        Linear {
            inputs,
            outputs,
            act,
            state: State::Plain(w, vec![0.0; outputs]),
        }
    }

    /// The weights, `[outputs][inputs]` row-major (PyTorch's order).
    pub fn weights(&self) -> Vec<f32> {
        match &self.state {
            State::Built(p) => p.w.to_plain(),
            State::Plain(w, _) => w.clone(),
        }
    }
    /// The bias, `[outputs]`.
    pub fn bias(&self) -> Vec<f32> {
        match &self.state {
            State::Built(p) => p.bias[..self.outputs].to_vec(),
            State::Plain(_, b) => b.clone(),
        }
    }
    /// Sets weights (`[outputs][inputs]`, PyTorch's `weight`) and bias.
    pub fn set_weights(&mut self, w: &[f32], b: &[f32]) -> Result<()> {
        let name = self.name();
        let bad = |what: &str, got: usize, want: usize| {
            Error::Graph(format!("{name}: {what} has {got} values, expected {want}"))
        };
        if w.len() != self.inputs * self.outputs {
            return Err(bad("weight", w.len(), self.inputs * self.outputs));
        }
        if b.len() != self.outputs {
            return Err(bad("bias", b.len(), self.outputs));
        }
        match &mut self.state {
            State::Built(p) => {
                p.w.set_plain(w)?;
                p.bias[..b.len()].copy_from_slice(b);
            }
            State::Plain(..) => self.state = State::Plain(w.to_vec(), b.to_vec()),
        }
        Ok(())
    }
}

impl Layer for Linear {
    fn name(&self) -> String {
        format!("linear {}->{}", self.inputs, self.outputs)
    }

    fn export(&self) -> Vec<(&'static str, Vec<f32>)> {
        vec![("weight", self.weights()), ("bias", self.bias())]
    }

    fn import(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        let want = [
            ("weight", self.outputs * self.inputs),
            ("bias", self.outputs),
        ];
        let v = expect_values(&self.name(), values, &want)?;
        self.set_weights(v[0], v[1])
    }

    fn build(&mut self, input: Shape) -> Result<Shape> {
        let refuse = |reason: String| Error::Shape {
            layer: self.name(),
            input,
            reason,
        };
        if input.h != 1 || input.w != 1 {
            return Err(refuse("is not flat: put a Flatten in front".into()));
        }
        if input.c != self.inputs {
            return Err(refuse(format!(
                "has {} features, expected {}",
                input.c, self.inputs
            )));
        }
        let (w0, b0) = match self.state.take() {
            State::Built(p) => (p.w.to_plain(), p.bias[..self.outputs].to_vec()),
            State::Plain(w, b) => (w, b),
        };
        let fc = Fc::new(input.n, self.inputs, self.outputs, self.act)?;
        let mut w = fc.w_layout();
        w.set_plain(&w0)?;
        let mut bias = vec![0.0; fc.padded_k()];
        bias[..self.outputs].copy_from_slice(&b0);
        self.state = State::Built(Plan {
            wt: fc.wt_layout(),
            dw: fc.w_layout(),
            db: vec![0.0; fc.padded_k()],
            x: fc.x_layout(),
            y: fc.y_layout(),
            z: fc.y_layout(),
            dy: fc.y_layout(),
            dz: fc.y_layout(),
            dx: fc.x_layout(),
            w,
            bias,
            fc,
            trained: false,
        });
        Ok(Shape::flat(input.n, self.outputs))
    }

    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let p = self.state.plan("forward")?;
        p.x.set_plain(x.data())?;
        p.fc.forward(pool, &p.x, &p.w, &p.bias, &mut p.y, Some(&mut p.z))?;
        p.trained = mode == Mode::Train;
        Tensor::from_vec(Shape::flat(p.fc.n(), p.fc.k()), p.y.to_plain())
    }

    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let p = self.state.plan("backward")?;
        need_training(p.trained, "linear")?;
        p.dy.set_plain(dy.data())?;
        let z = (p.fc.act() == Activation::Gelu).then_some(&p.z);
        p.fc.activation_backward(pool, &p.dy, &p.y, z, &mut p.dz)?;
        p.fc.transpose_weights(pool, &p.w, &mut p.wt)?;
        p.fc.backward_data(pool, &p.dz, &p.wt, &mut p.dx)?;
        p.fc.backward_weights(pool, &p.dz, &p.x, &mut p.dw, &mut p.db)?;
        Tensor::from_vec(Shape::flat(p.fc.n(), p.fc.c()), p.dx.to_plain())
    }

    fn flops(&self) -> f64 {
        self.state.built().map_or(0.0, |p| p.fc.flops())
    }

    fn params(&mut self) -> Vec<Param<'_>> {
        match &mut self.state {
            State::Built(p) => {
                weight_and_bias(p.w.data_mut(), p.dw.data_mut(), &mut p.bias, &mut p.db)
            }
            State::Plain(..) => Vec::new(),
        }
    }
}
