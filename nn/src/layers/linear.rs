//! Fully connected: `y = act(x W^T + b)` on inputs flattened in NCHW order,
//! over [`brgemm_primitives::Fc`].
//!
//! The layer flattens by itself: a blocked input (a convolution's or
//! pooling's output) goes into the FC layout in one pass, and the gradient
//! goes back in the input's own blocked layout, so `conv -> pool -> linear`
//! converts nothing twice. The output travels in the FC layout, which the
//! next linear layer reads as it is when their blockings agree (an MLP's
//! layers pass buffers, not copies, as the fixed template does).

use super::{expect_values, need_training, weight_and_bias, Bf16Operands, State};
use crate::error::{Error, Result};
use crate::layer::{Layer, Mode, Param};
use crate::tensor::{same_layout, Buf, RowBuf, Shape, Tensor, TwinBuf};
use brgemm::bf16::{bf16, Bf16Isa};
use brgemm::{Activation, AlignedVec};
use brgemm_primitives::eltwise::{flatten, unflatten};
use brgemm_primitives::fc_bf16::{to_bf16, FcBf16};
use brgemm_primitives::init::{weights, Init, Rng};
use brgemm_primitives::optim::{OptState, Optimizer};
use brgemm_primitives::{Blocked, Fc, FcTuning, Pool};

/// A fully connected layer with a fused activation. Weights are PyTorch's
/// `nn.Linear.weight` order, `[outputs][inputs]` row-major; the bias is
/// `[outputs]`.
pub struct Linear {
    inputs: usize,
    outputs: usize,
    act: Activation,
    /// Mixed precision asked for ([`Layer::set_bf16`]).
    bf16: bool,
    /// A bf16 layer reads the output: the bf16 forward writes it in bf16
    /// too ([`Layer::write_bf16`]).
    bf16_out: bool,
    /// The input arrives in a blocked NCHW layout ([`Layer::input_block`]),
    /// whose bf16 copy this layer cannot read in place.
    blocked_input: bool,
    /// The optimizer step is fused into backward
    /// ([`Layer::plan_fused_update`]): bf16 pays from fewer rows.
    fused: bool,
    /// Blocking and loop orders (None: the heuristic for the shape).
    tuning: Option<FcTuning>,
    state: State<Plan>,
}

/// The bf16 side of mixed precision: the passes, the packed weights, and
/// the step's input, output and output gradient rounded (the FC passes
/// read bf16 operands in their blocked layouts; dZ is rounded as the
/// activation's gradient makes it, the output for a bf16 reader as the
/// forward writes it).
struct Bf16Side {
    fc: FcBf16,
    ops: Bf16Operands,
    xb: AlignedVec<bf16>,
    dzb: AlignedVec<bf16>,
    yb: TwinBuf,
}

impl Bf16Side {
    fn new(fc: &Fc) -> brgemm_primitives::Result<Bf16Side> {
        let buf = || AlignedVec::new(brgemm::buffer::ALIGN);
        Ok(Bf16Side {
            fc: FcBf16::new(fc)?,
            ops: Bf16Operands::new(),
            xb: buf(),
            dzb: buf(),
            yb: TwinBuf::default(),
        })
    }
}

impl Plan {
    /// dZ = dY * act'(.) from dY (taken in) and the forward's output,
    /// rounded to bf16 in the same pass under mixed precision.
    fn activation_grad(&mut self, pool: &Pool) -> Result<()> {
        let z = (self.fc.act() == Activation::Gelu).then_some(&self.z);
        let dzb = self.bf.as_mut().map(|b| {
            b.dzb.resize(self.dz.data().len(), bf16::ZERO);
            &mut b.dzb[..]
        });
        let (dy, y) = (self.dy.get(), self.y.get());
        Ok(self
            .fc
            .activation_backward(pool, dy, y, z, &mut self.dz, dzb)?)
    }

    /// dL/dx from dZ (already computed) and the weights as they are.
    fn input_grad(&mut self, pool: &Pool) -> Result<Tensor> {
        let dx = self.dx.get_mut(&self.x_like)?;
        match &mut self.bf {
            // The transposed weights were packed with the forward's, dZ
            // rounded with its activation gradient.
            Some(b) => b.fc.backward_data(pool, &b.dzb, &b.ops.wtv, dx)?,
            None => {
                self.fc
                    .backward_data(pool, &self.dz, &self.w, &mut self.dzt, dx)?;
            }
        }
        match (self.in_block, self.in_rows) {
            (Some(bc), _) => {
                unflatten(pool, self.dx.get(), self.dxbuf.get_mut(self.input, bc)?)?;
                Ok(self.dxbuf.tensor())
            }
            (None, true) => Ok(self.dx.tensor()),
            (None, false) => Tensor::from_vec(self.input, self.dx.get().to_plain()),
        }
    }
}

struct Plan {
    fc: Fc,
    w: Blocked,
    /// dZ with its blocks transposed: backward-data's workspace.
    dzt: Blocked,
    bias: Vec<f32>,
    dw: Blocked,
    db: Vec<f32>,
    /// The FC layouts of the input and the output (shapes to allocate by).
    x_like: Blocked,
    y_like: Blocked,
    /// The input and dL/dy as the passes read them: the previous linear
    /// layer's buffer itself when its layout matches, else a conversion.
    x: RowBuf,
    dy: RowBuf,
    y: RowBuf,
    z: Blocked,
    dz: Blocked,
    dx: RowBuf,
    trained: bool,
    /// The built input shape, and the layout of the last forward's input
    /// (an NCHW channel block, FC rows, or plain), for dx to go back in.
    input: Shape,
    in_block: Option<usize>,
    in_rows: bool,
    /// dx in the input's blocked NCHW layout.
    dxbuf: Buf,
    /// Mixed precision, when on.
    bf: Option<Bf16Side>,
}

impl Plan {
    /// `t` in the FC layout `like`, in `buf`: shared when `t` already is,
    /// else converted in one pass from its layout.
    fn take_in(pool: &Pool, t: &Tensor, like: &Blocked, buf: &mut RowBuf) -> Result<()> {
        if let Some(r) = t.rows().filter(|r| same_layout(r, like)) {
            buf.share(r);
            return Ok(());
        }
        let dst = buf.get_mut(like)?;
        match t.blocked() {
            Some(b) => flatten(pool, b, dst)?,
            None => dst.set_plain(t.data())?,
        }
        Ok(())
    }
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
            bf16: false,
            bf16_out: false,
            blocked_input: false,
            fused: false,
            tuning: None,
            state: State::Plain(w, vec![0.0; outputs]),
        }
    }

    /// Plans the passes with blocking and loop orders `t` (e.g. from a
    /// tuning file of `examples/tune`) instead of the heuristic's.
    pub fn with_tuning(mut self, t: FcTuning) -> Linear {
        self.tuning = Some(t);
        self
    }

    /// The blocking and loop orders the built layer runs with.
    pub fn tuning(&self) -> Option<&FcTuning> {
        self.state.built().map(|p| p.fc.tuning())
    }

    /// The bf16 kernel of the forward pass when mixed precision is on
    /// (e.g. `Amx`).
    pub fn bf16_isa(&self) -> Option<Bf16Isa> {
        self.state.built()?.bf.as_ref().map(|b| b.fc.isa())
    }

    /// Inputs, outputs and the activation.
    pub fn geometry(&self) -> (usize, usize, Activation) {
        (self.inputs, self.outputs, self.act)
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
    /// The gradients of the last backward, as [`Linear::weights`] and
    /// [`Linear::bias`] (empty before the layer is built).
    pub fn gradients(&self) -> (Vec<f32>, Vec<f32>) {
        match &self.state {
            State::Built(p) => (p.dw.to_plain(), p.db[..self.outputs].to_vec()),
            State::Plain(..) => (Vec::new(), Vec::new()),
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
                if let Some(bf) = &mut p.bf {
                    bf.ops.packed = false;
                }
            }
            State::Plain(..) => self.state = State::Plain(w.to_vec(), b.to_vec()),
        }
        Ok(())
    }

    /// Plans a built layer again after a setting changed (the blocks and
    /// the precision may change with it); where the new plan is refused,
    /// `undo` restores the setting and the old plan is made again.
    fn replan(&mut self, undo: impl FnOnce(&mut Linear)) -> Result<()> {
        if let Some(input) = self.state.built().map(|p| p.input) {
            if let Err(e) = self.build(input) {
                undo(self);
                self.build(input)?;
                return Err(e);
            }
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
        let name = self.name();
        let refuse = |reason: String| Error::Shape {
            layer: name.clone(),
            input,
            reason,
        };
        if input.features() != self.inputs {
            return Err(refuse(format!(
                "has {} features per sample, expected {}",
                input.features(),
                self.inputs
            )));
        }
        let plan = |bf16: bool| {
            let t = self.tuning.clone().unwrap_or_else(|| {
                let heuristic = match bf16 {
                    true => FcTuning::heuristic_bf16,
                    false => FcTuning::heuristic,
                };
                heuristic(input.n, self.inputs, self.outputs)
            });
            let fc = Fc::with_tuning(input.n, self.inputs, self.outputs, self.act, t)
                .map_err(|e| refuse(e.to_string()))?;
            let bf = bf16
                .then(|| Bf16Side::new(&fc))
                .transpose()
                .map_err(|e| refuse(format!("cannot run in bf16: {e}")))?;
            Ok::<_, Error>((fc, bf))
        };
        let (mut fc, mut bf) = plan(self.bf16)?;
        // Mixed precision only where its kernel beats f32 here, the
        // weights packed every step counted (else the layer stays f32,
        // planned for it).
        if bf.as_ref().is_some_and(|b| !b.fc.pays(self.fused)) {
            (fc, bf) = plan(false)?;
        }
        // The values move over only once the new plan stands: a refused
        // plan leaves the layer as it was.
        let (w0, b0) = match self.state.take() {
            State::Built(p) => (p.w.to_plain(), p.bias[..self.outputs].to_vec()),
            State::Plain(w, b) => (w, b),
        };
        let mut w = fc.w_layout();
        w.set_plain(&w0)?;
        let mut bias = vec![0.0; fc.padded_k()];
        bias[..self.outputs].copy_from_slice(&b0);
        self.state = State::Built(Plan {
            dzt: fc.dzt_layout(),
            dw: fc.w_layout(),
            db: vec![0.0; fc.padded_k()],
            x_like: fc.x_layout(),
            y_like: fc.y_layout(),
            x: RowBuf::default(),
            y: RowBuf::default(),
            z: fc.y_layout(),
            dy: RowBuf::default(),
            dz: fc.y_layout(),
            dx: RowBuf::default(),
            w,
            bias,
            fc,
            trained: false,
            input,
            in_block: None,
            in_rows: false,
            dxbuf: Buf::default(),
            bf,
        });
        Ok(Shape::flat(input.n, self.outputs))
    }

    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let p = self.state.plan("forward")?;
        Plan::take_in(pool, x, &p.x_like, &mut p.x)?;
        (p.in_block, p.in_rows) = (x.block(), x.rows().is_some());
        let y = p.y.get_mut(&p.y_like)?;
        match &mut p.bf {
            Some(b) => {
                let o = &mut b.ops;
                if !o.packed {
                    b.fc.pack_weights(pool, &p.w, &mut o.wv, &mut o.wtv)?;
                    o.packed = true;
                }
                // X already in bf16 where the layer that wrote it made a copy.
                let xb = match x.bf16_rows_like(&p.x_like) {
                    Some(xb) => xb,
                    None => {
                        to_bf16(pool, p.x.get().data(), &mut b.xb);
                        &b.xb[..]
                    }
                };
                let yb = b.yb.get_mut_if(self.bf16_out, y.data().len())?;
                b.fc.forward(pool, xb, &o.wv, &p.bias, y, yb)?;
            }
            None => {
                // The pre-activation only where its gradient needs it (GELU).
                let z = (p.fc.act() == Activation::Gelu).then_some(&mut p.z);
                p.fc.forward(pool, p.x.get(), &p.w, &p.bias, y, z)?;
            }
        }
        p.trained = mode == Mode::Train;
        if !p.trained {
            p.x.release();
        }
        let yb = p.bf.as_ref().filter(|_| self.bf16_out).map(|b| &b.yb);
        Ok(p.y.tensor().with_bf16(yb))
    }

    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        self.backward_params(pool, dy)?;
        self.state.plan("backward")?.input_grad(pool)
    }

    fn fuses_update(&self) -> bool {
        self.state.built().is_some()
    }

    fn backward_step(
        &mut self,
        pool: &Pool,
        dy: &Tensor,
        input: bool,
        opt: &Optimizer,
        states: &mut [OptState],
    ) -> Result<Option<Tensor>> {
        let p = self.state.plan("backward")?;
        if states.len() != 2 {
            return Err(Error::Graph(
                "linear: a fused step needs a state per parameter".into(),
            ));
        }
        need_training(p.trained, "linear")?;
        Plan::take_in(pool, dy, &p.y_like, &mut p.dy)?;
        p.activation_grad(pool)?;
        // dX from the weights as forward saw them, then the step.
        let dx = input.then(|| p.input_grad(pool)).transpose()?;
        let (ws, bs) = states.split_at_mut(1);
        let (dz, x) = (&p.dz, p.x.get());
        match &mut p.bf {
            // The next step's bf16 weights packed in the same pass.
            Some(b) => {
                let o = &mut b.ops;
                let packed = (&mut o.wv, &mut o.wtv);
                b.fc.backward_weights_step(
                    pool, &p.fc, dz, x, &mut p.w, &mut p.db, opt, &mut ws[0], packed,
                )?;
                o.packed = true;
            }
            None => {
                p.fc.backward_weights_step(pool, dz, x, &mut p.w, &mut p.db, opt, &mut ws[0])?
            }
        }
        bs[0].step(opt, &mut p.bias, &p.db);
        p.x.release();
        p.dy.release();
        Ok(dx)
    }

    fn backward_params(&mut self, pool: &Pool, dy: &Tensor) -> Result<()> {
        let p = self.state.plan("backward")?;
        need_training(p.trained, "linear")?;
        Plan::take_in(pool, dy, &p.y_like, &mut p.dy)?;
        p.activation_grad(pool)?;
        match &p.bf {
            // bf16 operands, f32 sums: 1.7-5.1x the f32 pass from 32 rows
            // up on AMX (1.05x at 16, 0.97x on 64x128x64); the plan runs
            // the f32 pass where bf16 would not pay on this CPU.
            Some(b) => {
                let (dz, x) = (&p.dz, p.x.get());
                b.fc.backward_weights(pool, &p.fc, dz, x, &mut p.dw, &mut p.db)?
            }
            None => {
                p.fc.backward_weights(pool, &p.dz, p.x.get(), &mut p.dw, &mut p.db)?
            }
        }
        // Their writers may fill them again in the next step.
        p.x.release();
        p.dy.release();
        Ok(())
    }

    fn flops(&self) -> f64 {
        self.state.built().map_or(0.0, |p| p.fc.flops())
    }

    fn reads_bf16(&self) -> (bool, bool) {
        let bf = self.state.built().is_some_and(|p| p.bf.is_some());
        (bf && !self.blocked_input, false)
    }

    fn input_block(&mut self, block: Option<usize>) {
        self.blocked_input = block.is_some();
    }

    fn write_bf16(&mut self, out: bool, _dx: bool) -> (bool, bool) {
        self.bf16_out = out;
        let bf = self.state.built().is_some_and(|p| p.bf.is_some());
        (out && bf, false)
    }

    fn set_bf16(&mut self, on: bool) -> Result<bool> {
        let was = std::mem::replace(&mut self.bf16, on);
        self.replan(|l| l.bf16 = was)?;
        match self.state.built() {
            Some(_) => Ok(self.bf16_isa().is_some()),
            None => Ok(on),
        }
    }

    fn plan_fused_update(&mut self, on: bool) -> Result<bool> {
        let was = std::mem::replace(&mut self.fused, on);
        if was == on || !self.bf16 || self.state.built().is_none() {
            return Ok(false);
        }
        // Only a change of precision moves the parameters' layout (and
        // the optimizer's moments with it); the same plan made again
        // keeps them.
        let before = self.bf16_isa();
        self.replan(|l| l.fused = was)?;
        Ok(self.bf16_isa() != before)
    }

    fn param_count(&mut self) -> usize {
        match self.state {
            State::Built(_) => 2,
            State::Plain(..) => 0,
        }
    }

    fn params(&mut self) -> Vec<Param<'_>> {
        match &mut self.state {
            State::Built(p) => {
                // The caller may write them: the bf16 copies repack.
                if let Some(b) = &mut p.bf {
                    b.ops.packed = false;
                }
                weight_and_bias(p.w.data_mut(), p.dw.data_mut(), &mut p.bias, &mut p.db)
            }
            State::Plain(..) => Vec::new(),
        }
    }
}
