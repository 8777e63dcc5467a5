//! 2-D convolution with fused bias and activation, over
//! [`brgemm_primitives::Conv`]: per-axis stride, padding and dilation, and
//! grouped (down to depthwise) convolution as one primitive per group.

mod passes;

use super::{expect_values, Bf16Operands, State};
use crate::error::{Error, Result};
use crate::layer::{Affine, Layer, Mode, Param};
use crate::tensor::{BfBuf, Buf, Shape, Tensor};
use brgemm::bf16::bf16;
use brgemm::{Activation, AlignedVec};
use brgemm_primitives::conv::ConvBf16;
use brgemm_primitives::init::{weights, Init, Rng};
use brgemm_primitives::{Conv, ConvParams, Filter, Pool};
use std::sync::Arc;

/// A convolution layer's definition ([`Conv2d::geometry`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConvGeometry {
    /// Input channels.
    pub in_c: usize,
    /// Output channels.
    pub out_c: usize,
    /// Filter (rows, columns).
    pub rs: (usize, usize),
    /// Stride (rows, columns).
    pub stride: (usize, usize),
    /// Padding (rows, columns).
    pub pad: (usize, usize),
    /// Dilation (rows, columns).
    pub dilation: (usize, usize),
    /// Groups.
    pub groups: usize,
    /// Activation after the bias.
    pub act: Activation,
}

/// A convolution `in_c -> out_c` with an `r x s` filter and a fused
/// activation. Stride, padding and dilation are per axis (rows, columns):
/// [`Conv2d::new`] sets one stride and padding for both, the builder
/// methods each axis. With `groups` g, input channel group j (of in_c / g)
/// feeds only output channel group j (of out_c / g); g = in_c is a
/// depthwise convolution. Weights are PyTorch's `nn.Conv2d.weight` order,
/// `[out_c][in_c / groups][r][s]`; the bias is `[out_c]`.
///
/// A grouped convolution runs one primitive per group, on copies of the
/// group's channels: correct, but the BRGEMM kernel is at its best on
/// many channels, and a depthwise layer gives each call one.
pub struct Conv2d {
    in_c: usize,
    out_c: usize,
    rs: (usize, usize),
    stride: (usize, usize),
    pad: (usize, usize),
    dil: (usize, usize),
    groups: usize,
    act: Activation,
    /// Mixed precision asked for ([`Layer::set_bf16`]).
    bf16: bool,
    /// The input arrives blocked ([`Layer::input_block`]): a bf16 copy of
    /// it would be in a layout this layer reads.
    blocked_input: bool,
    /// Every reader takes the output, and the input's layer the input
    /// gradient, in bf16 alone ([`Layer::write_bf16_only`]).
    out_alone: bool,
    dx_alone: bool,
    /// The weights and bias in PyTorch's order until built; then one plan
    /// per group.
    state: State<Vec<Plan>>,
    /// The next layer's inference map folded in, for inference forwards.
    fold: Option<Fold>,
}

/// Weights and bias with a batch norm folded in: `w * scale`, `b * scale +
/// shift`, and its ReLU as the convolution's activation.
struct Fold {
    conv: Conv,
    w: Filter,
    bias: Vec<f32>,
    /// Its bf16 forward where the layer runs bf16 (packed on first use).
    bf: Option<Bf16Side>,
}

/// The bf16 side of mixed precision: the passes and their operands.
struct Bf16Side {
    conv: ConvBf16,
    ops: Bf16Operands,
}

impl Bf16Side {
    /// The bf16 passes of `conv` where they beat its f32 ones on this CPU
    /// ([`ConvBf16::pays`]: AMX, a bf16 kernel the CPU policy measured
    /// faster than f32 on layers of this much work per activation element,
    /// or one forced by name) once the input is rounded; None where they do
    /// not, or where the blocks cannot pair. On Zen 4 the 1x1 layers of 64
    /// channels at 56x56 stay f32 (cold caches, as in a training step,
    /// alternated: 64->64 0.90x forward and 0.92x backward-data in bf16,
    /// 64->256 and 256->64 0.97-1.04x; 256->128 1.18-1.32x and the 3x3
    /// layers 1.8x stay bf16). 1x1 convolutions too, since the rounding loops run in
    /// AVX-512: with them scalar, a 1x1 layer's rounded input cost what
    /// bf16 saved and they stayed f32 (ResNet-50 training, batch 16,
    /// Sapphire Rapids with AMX, alternated in one session: bf16 over f32
    /// 1.24-1.28x with the 3x3 layers alone in bf16, 1.49-1.62x with the 1x1
    /// layers as well; inference 24-25 -> 39-41 img/s on one thread).
    fn new(conv: &Conv) -> Option<Bf16Side> {
        let cb = ConvBf16::new(conv).ok()?;
        let pays = cb.pays();
        pays.then(|| Bf16Side {
            conv: cb,
            ops: Bf16Operands::new(),
        })
    }
}

struct Plan {
    conv: Conv,
    /// Mixed precision, where on and paying.
    bf: Option<Bf16Side>,
    w: Filter,
    wt: Filter,
    bias: Vec<f32>,
    dw: Filter,
    db: Vec<f32>,
    /// The input of the last forward (shared with its producer when it
    /// came in this layer's layout).
    x: Buf,
    /// The input when it came in bf16 alone (then `x` is not used).
    xa: BfBuf,
    x_alone: bool,
    /// The bf16 copy of `x` its writer made, kept from a training forward
    /// for backward-weights.
    x_copy: Option<Arc<AlignedVec<bf16>>>,
    y: Buf,
    /// The output in bf16 alone, where the readers take it so.
    yb: BfBuf,
    dy: Buf,
    /// dY when it came in bf16 alone (then `dy` is not used).
    dyb: BfBuf,
    /// dL/d(pre-activation); unused without an activation (dZ = dY).
    dz: Buf,
    dx: Buf,
    /// dX in bf16 alone, where the input's layer takes it so.
    dxb: BfBuf,
    /// The group's input and output shapes.
    input: Shape,
    output: Shape,
    trained: bool,
}

impl Plan {
    fn blocks(&self) -> (usize, usize) {
        (self.conv.tuning().bc, self.conv.tuning().bk)
    }
}

impl Conv2d {
    /// `in_c -> out_c`, filter `r x s`, `stride` and zero `pad` on every
    /// side, activation `act`; He-initialised weights from `seed`, zero
    /// bias.
    pub fn new(
        in_c: usize,
        out_c: usize,
        (r, s): (usize, usize),
        stride: usize,
        pad: usize,
        act: Activation,
        seed: u64,
    ) -> Conv2d {
        let mut c = Conv2d {
            in_c,
            out_c,
            rs: (r, s),
            stride: (stride, stride),
            pad: (pad, pad),
            dil: (1, 1),
            groups: 1,
            act,
            bf16: false,
            blocked_input: false,
            out_alone: false,
            dx_alone: false,
            state: State::Plain(Vec::new(), vec![0.0; out_c]),
            fold: None,
        };
        c.init(seed);
        c
    }

    /// He initialisation over the (per-group) fan-in.
    fn init(&mut self, seed: u64) {
        let fan_in = (self.in_c / self.groups.max(1) * self.rs.0 * self.rs.1).max(1);
        let w = weights(Init::Kaiming, self.out_c, fan_in, &mut Rng::new(seed));
        self.state = State::Plain(w, vec![0.0; self.out_c]);
    }

    /// Strides between output rows and columns.
    pub fn strides(mut self, h: usize, w: usize) -> Conv2d {
        self.stride = (h, w);
        self
    }
    /// Zero padding on top and bottom (`h`), left and right (`w`).
    pub fn pads(mut self, h: usize, w: usize) -> Conv2d {
        self.pad = (h, w);
        self
    }
    /// Dilations of the filter's rows and columns.
    pub fn dilations(mut self, h: usize, w: usize) -> Conv2d {
        self.dil = (h, w);
        self
    }
    /// `groups` channel groups (checked when built: both channel counts
    /// must divide), weights drawn again from `seed` for the smaller
    /// fan-in; `in_c` groups is a depthwise convolution.
    pub fn groups(mut self, groups: usize, seed: u64) -> Conv2d {
        self.groups = groups;
        if groups > 0 && self.in_c.is_multiple_of(groups) && self.out_c.is_multiple_of(groups) {
            self.init(seed);
        }
        self
    }

    /// Weight values: `[out_c][in_c / groups][r][s]`.
    fn weight_len(&self) -> usize {
        self.out_c * (self.in_c / self.groups.max(1)) * self.rs.0 * self.rs.1
    }

    /// The layer's definition: channels in and out, filter size, stride,
    /// padding, dilation (each (rows, columns)), groups and activation.
    pub fn geometry(&self) -> ConvGeometry {
        ConvGeometry {
            in_c: self.in_c,
            out_c: self.out_c,
            rs: self.rs,
            stride: self.stride,
            pad: self.pad,
            dilation: self.dil,
            groups: self.groups,
            act: self.act,
        }
    }

    /// The weights, `[out_c][in_c / groups][r][s]` (PyTorch's order).
    pub fn weights(&self) -> Vec<f32> {
        match &self.state {
            State::Built(ps) => ps.iter().flat_map(|p| p.w.to_kcrs()).collect(),
            State::Plain(w, _) => w.clone(),
        }
    }
    /// The bias, `[out_c]`.
    pub fn bias(&self) -> Vec<f32> {
        match &self.state {
            State::Built(ps) => ps
                .iter()
                .flat_map(|p| p.bias[..p.output.c].to_vec())
                .collect(),
            State::Plain(_, b) => b.clone(),
        }
    }
    /// Sets weights (`[out_c][in_c / groups][r][s]`, PyTorch's `weight`)
    /// and bias (`[out_c]`).
    pub fn set_weights(&mut self, w: &[f32], b: &[f32]) -> Result<()> {
        let want = self.weight_len();
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
            State::Built(ps) => {
                let (wg, kg) = (want / ps.len(), self.out_c / ps.len());
                for (j, p) in ps.iter_mut().enumerate() {
                    p.w.set_kcrs(&w[j * wg..][..wg])?;
                    p.bias[..kg].copy_from_slice(&b[j * kg..][..kg]);
                }
            }
            State::Plain(..) => self.state = State::Plain(w.to_vec(), b.to_vec()),
        }
        Ok(())
    }
}

impl Layer for Conv2d {
    fn name(&self) -> String {
        let pair = |(a, b): (usize, usize)| {
            if a == b {
                a.to_string()
            } else {
                format!("({a}, {b})")
            }
        };
        let mut name = format!(
            "conv2d {}x{} {}->{} stride {} pad {}",
            self.rs.0,
            self.rs.1,
            self.in_c,
            self.out_c,
            pair(self.stride),
            pair(self.pad)
        );
        if self.dil != (1, 1) {
            name += &format!(" dilation {}", pair(self.dil));
        }
        if self.groups != 1 {
            name += &format!(" groups {}", self.groups);
        }
        name
    }

    fn build(&mut self, input: Shape) -> Result<Shape> {
        let refuse = |reason: String| Error::Shape {
            layer: self.name(),
            input,
            reason,
        };
        if input.c != self.in_c {
            return Err(refuse(format!(
                "has {} channels, expected {}",
                input.c, self.in_c
            )));
        }
        let g = self.groups;
        if g == 0 || !self.in_c.is_multiple_of(g) || !self.out_c.is_multiple_of(g) {
            return Err(refuse(format!(
                "cannot split {} input and {} output channels into {g} groups",
                self.in_c, self.out_c
            )));
        }
        let (cg, kg) = (self.in_c / g, self.out_c / g);
        let (r, s) = self.rs;
        let params = ConvParams::new(input.n, cg, kg, input.h, input.w, r, s)
            .strides(self.stride.0, self.stride.1)
            .pads(self.pad.0, self.pad.1)
            .dilations(self.dil.0, self.dil.1);
        let (w0, b0) = (self.weights(), self.bias());
        let wg = w0.len() / g;
        let mut plans = Vec::with_capacity(g);
        for j in 0..g {
            let conv = Conv::new(params, self.act).map_err(|e| refuse(e.to_string()))?;
            let mut w = conv.filter();
            w.set_kcrs(&w0[j * wg..][..wg])?;
            let mut bias = vec![0.0; conv.padded_k()];
            bias[..kg].copy_from_slice(&b0[j * kg..][..kg]);
            plans.push(Plan {
                bf: self.bf16.then(|| Bf16Side::new(&conv)).flatten(),
                wt: conv.filter_t(),
                dw: conv.filter(),
                db: vec![0.0; conv.padded_k()],
                x: Buf::default(),
                xa: BfBuf::default(),
                x_alone: false,
                x_copy: None,
                y: Buf::default(),
                yb: BfBuf::default(),
                dy: Buf::default(),
                dyb: BfBuf::default(),
                dz: Buf::default(),
                dx: Buf::default(),
                dxb: BfBuf::default(),
                input: Shape::new(input.n, cg, input.h, input.w),
                output: Shape::new(input.n, kg, params.p(), params.q()),
                w,
                bias,
                conv,
                trained: false,
            });
        }
        self.state = State::Built(plans);
        Ok(Shape::new(input.n, self.out_c, params.p(), params.q()))
    }

    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        self.forward_with(pool, x, None, mode)
    }

    fn forward_add(
        &mut self,
        pool: &Pool,
        x: &Tensor,
        r: &Tensor,
        relu: bool,
        mode: Mode,
    ) -> Result<Option<Tensor>> {
        // One group, the residual in the output's layout, and in training an
        // identity activation (its backward would read the joined output).
        let Some(ps) = self.state.built().filter(|ps| ps.len() == 1) else {
            return Ok(None);
        };
        let train_ok = mode == Mode::Eval || self.act == Activation::Identity;
        match r.blocked_as(ps[0].blocks().1).filter(|_| train_ok) {
            Some(rt) => self
                .forward_with(pool, x, Some((&**rt, relu)), mode)
                .map(Some),
            None => Ok(None),
        }
    }

    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        Ok(self
            .backward_pass(pool, dy, true)?
            .expect("backward-data ran"))
    }

    fn backward_params(&mut self, pool: &Pool, dy: &Tensor) -> Result<()> {
        self.backward_pass(pool, dy, false).map(drop)
    }

    fn output_block(&self) -> Option<usize> {
        // A grouped convolution hands out plain values.
        match self.state.built() {
            Some(ps) if ps.len() == 1 => Some(ps[0].blocks().1),
            _ => None,
        }
    }

    fn export(&self) -> Vec<(&'static str, Vec<f32>)> {
        vec![("weight", self.weights()), ("bias", self.bias())]
    }

    fn import(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        let want = [("weight", self.weight_len()), ("bias", self.out_c)];
        let v = expect_values(&self.name(), values, &want)?;
        self.set_weights(v[0], v[1])
    }

    fn fold_affine(&mut self, affine: Option<&Affine>) -> bool {
        let Some(a) = affine else {
            self.fold = None;
            return true;
        };
        let (k, act) = (self.out_c, self.act);
        let Some([p]) = self.state.built().map(|ps| &ps[..]) else {
            return false; // not built, or grouped
        };
        if act != Activation::Identity || a.scale.len() != k || a.shift.len() != k {
            return false;
        }
        let relu = if a.relu {
            Activation::Relu
        } else {
            Activation::Identity
        };
        // The plan and buffers of the last fold serve again while the
        // layer's plan is the one they were made for: the first inference
        // after training steps refolds every layer (ResNet-50, Zen 4: 0.42 s
        // when each fold planned anew, converted the filter to KCRS and
        // back and allocated it; 7-9 ms reusing them).
        let fits = |f: &Fold| {
            f.conv.params() == p.conv.params()
                && f.conv.act() == relu
                && f.conv.tuning() == p.conv.tuning()
                && f.bf.is_some() == p.bf.is_some()
        };
        if !self.fold.as_ref().is_some_and(fits) {
            // The training layer's tuning: the same blocks, so the folded
            // filter is the layer's, scaled in place.
            let Ok(conv) = Conv::with_tuning(*p.conv.params(), relu, p.conv.tuning().clone())
            else {
                return false;
            };
            // bf16 inference where the layer trains in bf16.
            let bf = p.bf.as_ref().and_then(|_| Bf16Side::new(&conv));
            self.fold = Some(Fold {
                w: conv.filter(),
                bias: vec![0.0; conv.padded_k()],
                conv,
                bf,
            });
        }
        let f = self.fold.as_mut().expect("set above");
        scale_filter(&p.w, &a.scale, &mut f.w);
        for (ko, b) in f.bias.iter_mut().take(k).enumerate() {
            *b = p.bias[ko] * a.scale[ko] + a.shift[ko];
        }
        if let Some(b) = &mut f.bf {
            b.ops.packed = false;
        }
        true
    }

    fn flops(&self) -> f64 {
        self.state
            .built()
            .map_or(0.0, |ps| ps.iter().map(|p| p.conv.flops()).sum())
    }

    fn input_block(&mut self, block: Option<usize>) {
        self.blocked_input = block.is_some();
    }

    fn reads_bf16(&self) -> (bool, bool) {
        match self.state.built().map(|ps| &ps[..]) {
            // Only where the copy is read in place: with a border to pad,
            // the reader sweeps it anyway, and the writer's extra stores
            // cost more than the half-width read saves (ResNet-50, Zen 4).
            Some([p]) => p.bf.as_ref().map_or((false, false), |b| {
                let (fwd, bwd) = b.conv.reads_in_place();
                let identity = self.act == Activation::Identity;
                (fwd && self.blocked_input, bwd && identity)
            }),
            _ => (false, false),
        }
    }

    fn reads_bf16_only(&self) -> (bool, bool) {
        // X and dY in bf16 alone where every pass that reads them is bf16
        // (X: arriving in this layer's layout).
        match self.state.built().map(|ps| &ps[..]) {
            Some([p]) => {
                let identity = self.act == Activation::Identity;
                let upd = p.bf.as_ref().is_some_and(|b| b.conv.upd_isa().is_some());
                (upd && self.blocked_input, identity && upd)
            }
            _ => (false, false),
        }
    }

    fn write_bf16_only(&mut self, out: bool, dx: bool) -> (bool, bool) {
        let (o, d) = match self.state.built().map(|ps| &ps[..]) {
            Some([p]) => p.bf.as_ref().map_or((false, false), |b| {
                (self.act == Activation::Identity, b.conv.writes_dx_bf16())
            }),
            _ => (false, false),
        };
        (self.out_alone, self.dx_alone) = (out && o, dx && d);
        (self.out_alone, self.dx_alone)
    }

    fn set_bf16(&mut self, on: bool) -> Result<bool> {
        self.bf16 = on;
        let ps = match &mut self.state {
            State::Built(ps) => ps,
            State::Plain(..) => return Ok(false),
        };
        for p in ps.iter_mut() {
            p.bf = on.then(|| Bf16Side::new(&p.conv)).flatten();
        }
        Ok(ps.iter().any(|p| p.bf.is_some()))
    }

    fn params(&mut self) -> Vec<Param<'_>> {
        match &mut self.state {
            State::Built(ps) => ps
                .iter_mut()
                .flat_map(|p| {
                    // The caller may write them: the bf16 copies repack.
                    if let Some(b) = &mut p.bf {
                        b.ops.packed = false;
                    }
                    [
                        Param {
                            name: "weight",
                            value: p.w.data_mut(),
                            grad: p.dw.data_mut(),
                        },
                        Param {
                            name: "bias",
                            value: &mut p.bias,
                            grad: &mut p.db,
                        },
                    ]
                })
                .collect(),
            State::Plain(..) => Vec::new(),
        }
    }
}

/// `out = w` with output channel `ko` scaled by `scale[ko]`, in the blocked
/// layout both share (`[K/bk][C/bc][R][S][bc][bk]`, bk innermost); the
/// padding channels past `scale` stay zero.
fn scale_filter(w: &Filter, scale: &[f32], out: &mut Filter) {
    let bk = w.dims().4;
    let block = w.data().len() / w.dims().0.div_ceil(bk);
    let (src, dst) = (w.data(), out.data_mut());
    for (kb, (s, d)) in src.chunks(block).zip(dst.chunks_mut(block)).enumerate() {
        let mut sc = vec![0.0f32; bk];
        for (j, v) in sc.iter_mut().enumerate() {
            *v = scale.get(kb * bk + j).copied().unwrap_or(0.0);
        }
        for (s, d) in s.chunks_exact(bk).zip(d.chunks_exact_mut(bk)) {
            for j in 0..bk {
                d[j] = s[j] * sc[j];
            }
        }
    }
}
