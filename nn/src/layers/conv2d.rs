//! 2-D convolution with fused bias and activation, over
//! [`brgemm_primitives::Conv`].

use super::{expect_values, need_training, weight_and_bias, State};
use crate::error::{Error, Result};
use crate::layer::{Layer, Mode, Param};
use crate::tensor::{Buf, Shape, Tensor};
use brgemm::Activation;
use brgemm_primitives::init::{weights, Init, Rng};
use brgemm_primitives::{Conv, ConvParams, Filter, Pool};

/// A convolution `in_c -> out_c` with an `r x s` filter, one stride and
/// padding for both axes, and a fused activation. Weights are PyTorch's
/// `nn.Conv2d.weight` order, KCRS; the bias is `[out_c]`.
pub struct Conv2d {
    in_c: usize,
    out_c: usize,
    rs: (usize, usize),
    stride: usize,
    pad: usize,
    act: Activation,
    state: State<Plan>,
}

struct Plan {
    conv: Conv,
    w: Filter,
    wt: Filter,
    bias: Vec<f32>,
    dw: Filter,
    db: Vec<f32>,
    /// The input of the last forward (shared with its producer when it
    /// came in this layer's layout).
    x: Buf,
    y: Buf,
    dy: Buf,
    /// dL/d(pre-activation); unused without an activation (dZ = dY).
    dz: Buf,
    dx: Buf,
    input: Shape,
    output: Shape,
    trained: bool,
}

impl Conv2d {
    /// `in_c -> out_c`, filter `r x s`, `stride`, zero `pad` on every side,
    /// activation `act`; He-initialised weights from `seed`, zero bias.
    pub fn new(
        in_c: usize,
        out_c: usize,
        (r, s): (usize, usize),
        stride: usize,
        pad: usize,
        act: Activation,
        seed: u64,
    ) -> Conv2d {
        let fan_in = (in_c * r * s).max(1);
        let w = weights(Init::Kaiming, out_c, fan_in, &mut Rng::new(seed));
        Conv2d {
            in_c,
            out_c,
            rs: (r, s),
            stride,
            pad,
            act,
            state: State::Plain(w, vec![0.0; out_c]),
        }
    }

    /// The weights, KCRS (PyTorch's order).
    pub fn weights(&self) -> Vec<f32> {
        match &self.state {
            State::Built(p) => p.w.to_kcrs(),
            State::Plain(w, _) => w.clone(),
        }
    }
    /// The bias, `[out_c]`.
    pub fn bias(&self) -> Vec<f32> {
        match &self.state {
            State::Built(p) => p.bias[..self.out_c].to_vec(),
            State::Plain(_, b) => b.clone(),
        }
    }
    /// Sets weights (KCRS, PyTorch's `weight`) and bias (`[out_c]`).
    pub fn set_weights(&mut self, w: &[f32], b: &[f32]) -> Result<()> {
        let want = self.out_c * self.in_c * self.rs.0 * self.rs.1;
        if w.len() != want || b.len() != self.out_c {
            return Err(Error::Graph(format!(
                "{}: weight has {} values (expected {want}), bias {} (expected {})",
                self.name(),
                w.len(),
                b.len(),
                self.out_c
            )));
        }
        match &mut self.state {
            State::Built(p) => {
                p.w.set_kcrs(w)?;
                p.bias[..b.len()].copy_from_slice(b);
            }
            State::Plain(..) => self.state = State::Plain(w.to_vec(), b.to_vec()),
        }
        Ok(())
    }
}

impl Conv2d {
    /// Backward: dW and db, and dX when `data` (the weight transpose and
    /// backward-data pass are skipped without it).
    fn backward_pass(&mut self, pool: &Pool, dy: &Tensor, data: bool) -> Result<()> {
        let p = self.state.plan("backward")?;
        need_training(p.trained, "conv2d")?;
        let (bc, bk) = (p.conv.tuning().bc, p.conv.tuning().bk);
        dy.blocked_into(pool, bk, &mut p.dy)?;
        let dz = if self.act == Activation::Identity {
            &p.dy
        } else {
            let dz = p.dz.get_mut(p.output, bk)?;
            p.conv
                .activation_backward(pool, p.dy.get(), p.y.get(), dz)?;
            &p.dz
        };
        if data {
            p.conv.transpose_filter(pool, &p.w, &mut p.wt)?;
            let dx = p.dx.get_mut(p.input, bc)?;
            p.conv.backward_data(pool, dz.get(), &p.wt, dx)?;
        }
        p.conv
            .backward_weights(pool, dz.get(), p.x.get(), &mut p.dw, &mut p.db)?;
        // The input was kept for this backward only.
        p.x.release();
        p.dy.release();
        p.trained = false;
        Ok(())
    }
}

impl Layer for Conv2d {
    fn name(&self) -> String {
        format!(
            "conv2d {}x{} {}->{} stride {} pad {}",
            self.rs.0, self.rs.1, self.in_c, self.out_c, self.stride, self.pad
        )
    }

    fn build(&mut self, input: Shape) -> Result<Shape> {
        if input.c != self.in_c {
            return Err(Error::Shape {
                layer: self.name(),
                input,
                reason: format!("has {} channels, expected {}", input.c, self.in_c),
            });
        }
        let (r, s) = self.rs;
        let params = ConvParams::new(input.n, self.in_c, self.out_c, input.h, input.w, r, s)
            .stride(self.stride)
            .pad(self.pad);
        let conv = Conv::new(params, self.act).map_err(|e| Error::Shape {
            layer: self.name(),
            input,
            reason: e.to_string(),
        })?;
        let (w0, b0) = match self.state.take() {
            State::Built(p) => (p.w.to_kcrs(), p.bias[..self.out_c].to_vec()),
            State::Plain(w, b) => (w, b),
        };
        let mut w = conv.filter();
        w.set_kcrs(&w0)?;
        let mut bias = vec![0.0; conv.padded_k()];
        bias[..self.out_c].copy_from_slice(&b0);
        let out = Shape::new(input.n, self.out_c, params.p(), params.q());
        self.state = State::Built(Plan {
            wt: conv.filter_t(),
            dw: conv.filter(),
            db: vec![0.0; conv.padded_k()],
            x: Buf::default(),
            y: Buf::default(),
            dy: Buf::default(),
            dz: Buf::default(),
            dx: Buf::default(),
            input,
            output: out,
            w,
            bias,
            conv,
            trained: false,
        });
        Ok(out)
    }

    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let p = self.state.plan("forward")?;
        let (bc, bk) = (p.conv.tuning().bc, p.conv.tuning().bk);
        x.blocked_into(pool, bc, &mut p.x)?;
        let y = p.y.get_mut(p.output, bk)?;
        p.conv.forward(pool, p.x.get(), &p.w, &p.bias, y)?;
        p.trained = mode == Mode::Train;
        if !p.trained {
            p.x.release();
        }
        Ok(p.y.tensor())
    }

    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        self.backward_pass(pool, dy, true)?;
        Ok(self.state.plan("backward")?.dx.tensor())
    }

    fn backward_params(&mut self, pool: &Pool, dy: &Tensor) -> Result<()> {
        self.backward_pass(pool, dy, false)
    }

    fn output_block(&self) -> Option<usize> {
        self.state.built().map(|p| p.conv.tuning().bk)
    }

    fn export(&self) -> Vec<(&'static str, Vec<f32>)> {
        vec![("weight", self.weights()), ("bias", self.bias())]
    }

    fn import(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        let w = self.out_c * self.in_c * self.rs.0 * self.rs.1;
        let v = expect_values(&self.name(), values, &[("weight", w), ("bias", self.out_c)])?;
        self.set_weights(v[0], v[1])
    }

    fn flops(&self) -> f64 {
        self.state.built().map_or(0.0, |p| p.conv.flops())
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
