//! Batch normalisation and max/average pooling, over the primitives'
//! `BatchNorm` and `Pool2d`.

use super::{expect_values, need_training, unbuilt};
use crate::error::{Error, Result};
use crate::layer::{Affine, Layer, Mode, Param};
use crate::tensor::{BfBuf, Buf, Shape, Tensor, TwinBuf};
use brgemm::bf16::bf16;
use brgemm_primitives::engine::bf16::Widen;
use brgemm_primitives::{BatchNorm, Pool, Pool2d, PoolKind, Tensor4};

/// The channel block when no producer names one (the graph's input).
fn channel_block(c: usize) -> usize {
    c.min(64)
}

/// Batch normalisation over (N, H, W) per channel: learned scale and shift,
/// batch statistics in training, running statistics in inference.
pub struct BatchNorm2d {
    c: usize,
    /// The block its input arrives in (adopted for the output).
    block: Option<usize>,
    /// A ReLU on the output, fused by the graph.
    relu: bool,
    /// The output and dx also in bf16, for the bf16 layers reading them.
    bf16: (bool, bool),
    /// y in bf16 alone, for the bf16 convolutions after it, and dx, for
    /// the one before it ([`Layer::write_bf16_only`]).
    out_alone: bool,
    dx_alone: bool,
    plan: Option<BnPlan>,
}

struct BnPlan {
    bn: BatchNorm,
    shape: Shape,
    bc: usize,
    x: Buf,
    /// The input when it came in bf16 alone (then `x` is not used).
    xb: BfBuf,
    x_bf16: bool,
    y: Buf,
    dy: Buf,
    /// The output gradient when it came in bf16 alone.
    dyb: BfBuf,
    dx: Buf,
    /// The bf16 copies of y and dx, when asked for.
    yb: TwinBuf,
    dxb: TwinBuf,
    /// y in bf16 alone, when asked for (then `y` is not written).
    ya: BfBuf,
    y_alone: bool,
    /// dx in bf16 alone, when asked for.
    dxa: BfBuf,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
    trained: bool,
}

impl BatchNorm2d {
    /// `c` channels: scale 1, shift 0, running mean 0 and variance 1.
    pub fn new(c: usize) -> BatchNorm2d {
        BatchNorm2d {
            c,
            block: None,
            relu: false,
            bf16: (false, false),
            out_alone: false,
            dx_alone: false,
            plan: None,
        }
    }
}

impl BatchNorm2d {
    /// The forward, with the residual join when `res` is given.
    fn forward_with(
        &mut self,
        pool: &Pool,
        x: &Tensor,
        res: Option<(&Tensor4, bool)>,
        mode: Mode,
    ) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("forward"))?;
        // An input in bf16 alone (a bf16 convolution's output) is read as
        // it is, here and in backward.
        p.x_bf16 = match x.bf16_only_as(p.bc) {
            Some(t) => {
                p.xb.share(t);
                p.x.release();
                true
            }
            None => {
                x.blocked_into(pool, p.bc, &mut p.x)?;
                p.xb.release();
                false
            }
        };
        // y in bf16 alone for readers that take it so (not with a residual
        // join, whose backward reads y).
        let alone = self.out_alone && res.is_none();
        let y = match alone {
            true => Y::Alone(p.ya.get_mut(p.shape, p.bc)?),
            false => {
                let y = p.y.get_mut(p.shape, p.bc)?;
                let yb = p.yb.get_mut_if(self.bf16.0, y.data().len())?;
                Y::F32(y, yb)
            }
        };
        let bn = &mut p.bn;
        match p.x_bf16 {
            false => y.run(bn, pool, p.x.get(), res, mode)?,
            true => y.run(bn, pool, p.xb.get(), res, mode)?,
        }
        p.y_alone = alone;
        p.trained = mode == Mode::Train;
        if !p.trained {
            p.x.release();
            p.xb.release();
        }
        Ok(match alone {
            true => p.ya.tensor(),
            false => p.y.tensor().with_bf16(self.bf16.0.then_some(&p.yb)),
        })
    }
}

/// Where batch norm's forward writes y: f32 (with its bf16 copy when
/// asked), or bf16 alone.
enum Y<'a> {
    F32(&'a mut Tensor4, Option<&'a mut [bf16]>),
    Alone(&'a mut Tensor4<bf16>),
}

impl Y<'_> {
    /// The forward of `mode` into this y.
    fn run<X: Widen>(
        self,
        bn: &mut BatchNorm,
        pool: &Pool,
        x: &Tensor4<X>,
        res: Option<(&Tensor4, bool)>,
        mode: Mode,
    ) -> Result<()> {
        match (self, mode) {
            (Y::F32(y, yb), Mode::Train) => bn.forward_train_to(pool, x, res, y, yb)?,
            (Y::F32(y, yb), Mode::Eval) => bn.forward_infer_to(pool, x, res, y, yb)?,
            (Y::Alone(y), Mode::Train) => bn.forward_train_bf16(pool, x, res, y)?,
            (Y::Alone(y), Mode::Eval) => bn.forward_infer_bf16(pool, x, res, y)?,
        }
        Ok(())
    }
}

/// Where batch norm's backward writes dx: f32 (with its bf16 copy when
/// asked), or bf16 alone.
enum Dx<'a> {
    F32(&'a mut Tensor4, Option<&'a mut [bf16]>),
    Alone(&'a mut Tensor4<bf16>),
}

impl Dx<'_> {
    /// The backward into this dx, with the parameter gradients `g`.
    fn run<X: Widen, D: Widen>(
        self,
        bn: &BatchNorm,
        pool: &Pool,
        x: &Tensor4<X>,
        y: Option<&Tensor4>,
        dy: &Tensor4<D>,
        g: (&mut Vec<f32>, &mut Vec<f32>),
    ) -> Result<()> {
        match self {
            Dx::F32(dx, dxb) => bn.backward_to(pool, x, y, dy, (dx, dxb), g.0, g.1)?,
            Dx::Alone(dx) => bn.backward_to_bf16(pool, x, y, dy, dx, g.0, g.1)?,
        }
        Ok(())
    }
}

impl Layer for BatchNorm2d {
    fn name(&self) -> String {
        format!("batchnorm2d {}", self.c)
    }
    fn export(&self) -> Vec<(&'static str, Vec<f32>)> {
        let Some(p) = &self.plan else {
            return Vec::new();
        };
        let c = self.c;
        vec![
            ("gamma", p.bn.gamma()[..c].to_vec()),
            ("beta", p.bn.beta()[..c].to_vec()),
            ("running_mean", p.bn.running_mean()[..c].to_vec()),
            ("running_var", p.bn.running_var()[..c].to_vec()),
        ]
    }
    fn import(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        let c = self.c;
        let names = [
            ("gamma", c),
            ("beta", c),
            ("running_mean", c),
            ("running_var", c),
        ];
        let v = expect_values(&self.name(), values, &names)?;
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("import"))?;
        p.bn.gamma_mut()[..c].copy_from_slice(v[0]);
        p.bn.beta_mut()[..c].copy_from_slice(v[1]);
        p.bn.running_mean_mut()[..c].copy_from_slice(v[2]);
        p.bn.running_var_mut()[..c].copy_from_slice(v[3]);
        Ok(())
    }
    fn affine(&self) -> Option<Affine> {
        let p = self.plan.as_ref()?;
        let (bn, c) = (&p.bn, self.c);
        let scale: Vec<f32> = (0..c)
            .map(|i| bn.gamma()[i] / (bn.running_var()[i] + bn.eps).sqrt())
            .collect();
        let shift = (0..c)
            .map(|i| bn.beta()[i] - bn.running_mean()[i] * scale[i])
            .collect();
        Some(Affine {
            scale,
            shift,
            relu: self.relu,
        })
    }
    fn fuse_relu(&mut self) -> bool {
        self.relu = true;
        if let Some(p) = &mut self.plan {
            p.bn.relu = true;
        }
        true
    }
    fn build(&mut self, input: Shape) -> Result<Shape> {
        if input.c != self.c {
            return Err(Error::Shape {
                layer: self.name(),
                input,
                reason: format!("has {} channels, expected {}", input.c, self.c),
            });
        }
        let bc = self.block.unwrap_or(channel_block(self.c));
        let mut bn = BatchNorm::new(self.c, bc)?;
        bn.relu = self.relu;
        // Rebuilt for another shape: the learned values and statistics stay.
        if let Some(old) = self.plan.take() {
            let (c, o) = (self.c, &old.bn);
            bn.gamma_mut()[..c].copy_from_slice(&o.gamma()[..c]);
            bn.beta_mut()[..c].copy_from_slice(&o.beta()[..c]);
            bn.running_mean_mut()[..c].copy_from_slice(&o.running_mean()[..c]);
            bn.running_var_mut()[..c].copy_from_slice(&o.running_var()[..c]);
        }
        let len = bn.gamma().len();
        self.plan = Some(BnPlan {
            shape: input,
            bc,
            x: Buf::default(),
            xb: BfBuf::default(),
            x_bf16: false,
            y: Buf::default(),
            dy: Buf::default(),
            dyb: BfBuf::default(),
            dx: Buf::default(),
            yb: TwinBuf::default(),
            dxb: TwinBuf::default(),
            ya: BfBuf::default(),
            y_alone: false,
            dxa: BfBuf::default(),
            dgamma: vec![0.0; len],
            dbeta: vec![0.0; len],
            bn,
            trained: false,
        });
        Ok(input)
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
        let p = self.plan.as_ref().ok_or_else(|| unbuilt("forward"))?;
        // The residual in this layer's layout, read in place; a ReLU of the
        // layer's own would sit before the join.
        let Some(rt) = r.blocked_as(p.bc).filter(|_| !self.relu) else {
            return Ok(None);
        };
        self.forward_with(pool, x, Some((&**rt, relu)), mode)
            .map(Some)
    }
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("backward"))?;
        need_training(p.trained, "batchnorm2d")?;
        // An output gradient in bf16 alone (a bf16 convolution's dX) is
        // read as it is.
        let dy_bf16 = match dy.bf16_only_as(p.bc) {
            Some(t) => {
                p.dyb.share(t);
                true
            }
            None => {
                dy.blocked_into(pool, p.bc, &mut p.dy)?;
                false
            }
        };
        let (bn, g) = (&p.bn, (&mut p.dgamma, &mut p.dbeta));
        // The mask of a fused ReLU comes from x; y only after a join.
        let y = (bn.relu && !p.y_alone).then(|| p.y.get());
        let dx = match self.dx_alone {
            true => Dx::Alone(p.dxa.get_mut(p.shape, p.bc)?),
            false => {
                let dx = p.dx.get_mut(p.shape, p.bc)?;
                let dxb = p.dxb.get_mut_if(self.bf16.1, dx.data().len())?;
                Dx::F32(dx, dxb)
            }
        };
        match (p.x_bf16, dy_bf16) {
            (false, false) => dx.run(bn, pool, p.x.get(), y, p.dy.get(), g)?,
            (false, true) => dx.run(bn, pool, p.x.get(), y, p.dyb.get(), g)?,
            (true, false) => dx.run(bn, pool, p.xb.get(), y, p.dy.get(), g)?,
            (true, true) => dx.run(bn, pool, p.xb.get(), y, p.dyb.get(), g)?,
        }
        // The input and the gradient were kept for this backward only.
        p.x.release();
        p.xb.release();
        p.dy.release();
        p.dyb.release();
        p.trained = false;
        Ok(match self.dx_alone {
            true => p.dxa.tensor(),
            false => p.dx.tensor().with_bf16(self.bf16.1.then_some(&p.dxb)),
        })
    }
    fn write_bf16(&mut self, out: bool, dx: bool) -> (bool, bool) {
        self.bf16 = (out, dx);
        self.bf16
    }
    fn reads_bf16_only(&self) -> (bool, bool) {
        (true, true)
    }
    fn write_bf16_only(&mut self, out: bool, dx: bool) -> (bool, bool) {
        (self.out_alone, self.dx_alone) = (out, dx);
        (out, dx)
    }
    fn input_block(&mut self, block: Option<usize>) {
        self.block = block;
    }
    fn output_block(&self) -> Option<usize> {
        self.plan.as_ref().map(|p| p.bc)
    }
    fn params(&mut self) -> Vec<Param<'_>> {
        let Some(p) = &mut self.plan else {
            return Vec::new();
        };
        let (gamma, beta) = p.bn.gamma_beta_mut();
        vec![
            Param {
                name: "gamma",
                value: gamma,
                grad: &mut p.dgamma,
            },
            Param {
                name: "beta",
                value: beta,
                grad: &mut p.dbeta,
            },
        ]
    }
}

/// Max or average pooling with a square window, one stride and padding.
pub struct Pool2dLayer {
    kind: PoolKind,
    window: usize,
    stride: usize,
    pad: usize,
    /// The block its input arrives in (adopted for the output).
    block: Option<usize>,
    plan: Option<PoolPlan>,
}

struct PoolPlan {
    pool: Pool2d,
    input: Shape,
    output: Shape,
    bc: usize,
    x: Buf,
    y: Buf,
    dy: Buf,
    dx: Buf,
    argmax: Vec<u32>,
    trained: bool,
}

impl Pool2dLayer {
    /// Max pooling.
    pub fn max(window: usize, stride: usize, pad: usize) -> Pool2dLayer {
        Pool2dLayer {
            kind: PoolKind::Max,
            window,
            stride,
            pad,
            block: None,
            plan: None,
        }
    }
    /// Whether it takes the maximum (else the mean), and its window,
    /// stride and padding.
    pub fn geometry(&self) -> (bool, usize, usize, usize) {
        (
            self.kind == PoolKind::Max,
            self.window,
            self.stride,
            self.pad,
        )
    }
    /// Average pooling (over the real inputs of each window).
    pub fn avg(window: usize, stride: usize, pad: usize) -> Pool2dLayer {
        Pool2dLayer {
            kind: PoolKind::Avg,
            ..Pool2dLayer::max(window, stride, pad)
        }
    }
}

impl Layer for Pool2dLayer {
    fn name(&self) -> String {
        format!(
            "{} pool {}x{} stride {} pad {}",
            if self.kind == PoolKind::Max {
                "max"
            } else {
                "avg"
            },
            self.window,
            self.window,
            self.stride,
            self.pad
        )
    }
    fn build(&mut self, input: Shape) -> Result<Shape> {
        let bc = self.block.unwrap_or(channel_block(input.c));
        let x = Tensor4::zeros(input.n, input.c, input.h, input.w, bc)?;
        let pool = Pool2d::new(self.kind, &x, self.window, self.stride, self.pad).map_err(|e| {
            Error::Shape {
                layer: self.name(),
                input,
                reason: e.to_string(),
            }
        })?;
        let (p, q) = pool.out_hw();
        let output = Shape::new(input.n, input.c, p, q);
        self.plan = Some(PoolPlan {
            argmax: vec![0; pool.output().data().len()],
            input,
            output,
            bc,
            x: Buf::default(),
            y: Buf::default(),
            dy: Buf::default(),
            dx: Buf::default(),
            pool,
            trained: false,
        });
        Ok(output)
    }
    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("forward"))?;
        x.blocked_into(pool, p.bc, &mut p.x)?;
        let keep = mode == Mode::Train && self.kind == PoolKind::Max;
        let argmax = keep.then_some(&mut p.argmax[..]);
        let y = p.y.get_mut(p.output, p.bc)?;
        p.pool.forward(pool, p.x.get(), y, argmax)?;
        // Backward needs the window maxima only, not the input.
        p.x.release();
        p.trained = mode == Mode::Train;
        Ok(p.y.tensor())
    }
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("backward"))?;
        need_training(p.trained, "pool")?;
        dy.blocked_into(pool, p.bc, &mut p.dy)?;
        let argmax = (self.kind == PoolKind::Max).then_some(&p.argmax[..]);
        let dx = p.dx.get_mut(p.input, p.bc)?;
        p.pool.backward(pool, p.dy.get(), argmax, dx)?;
        p.dy.release();
        Ok(p.dx.tensor())
    }
    fn input_block(&mut self, block: Option<usize>) {
        self.block = block;
    }
    fn output_block(&self) -> Option<usize> {
        self.plan.as_ref().map(|p| p.bc)
    }
}
