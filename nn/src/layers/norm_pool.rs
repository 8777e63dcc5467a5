//! Batch normalisation and max/average pooling, over the primitives'
//! `BatchNorm` and `Pool2d`.

use super::{need_training, unbuilt};
use crate::error::{Error, Result};
use crate::layer::{Layer, Mode, Param};
use crate::tensor::{Shape, Tensor};
use brgemm_primitives::{BatchNorm, Pool, Pool2d, PoolKind, Tensor4};

/// The channel block of the blocked copies these layers work on.
fn channel_block(c: usize) -> usize {
    c.min(64)
}

fn blocked(s: Shape) -> Result<Tensor4> {
    Ok(Tensor4::zeros(s.n, s.c, s.h, s.w, channel_block(s.c))?)
}

fn plain(t: &Tensor4) -> Result<Tensor> {
    let (n, c, h, w, _) = t.dims();
    Tensor::from_vec(Shape::new(n, c, h, w), t.to_nchw())
}

/// Batch normalisation over (N, H, W) per channel: learned scale and shift,
/// batch statistics in training, running statistics in inference.
pub struct BatchNorm2d {
    c: usize,
    plan: Option<BnPlan>,
}

struct BnPlan {
    bn: BatchNorm,
    x: Tensor4,
    y: Tensor4,
    dy: Tensor4,
    dx: Tensor4,
    dgamma: Vec<f32>,
    dbeta: Vec<f32>,
    trained: bool,
}

impl BatchNorm2d {
    /// `c` channels: scale 1, shift 0, running mean 0 and variance 1.
    pub fn new(c: usize) -> BatchNorm2d {
        BatchNorm2d { c, plan: None }
    }
}

impl Layer for BatchNorm2d {
    fn name(&self) -> String {
        format!("batchnorm2d {}", self.c)
    }
    fn build(&mut self, input: Shape) -> Result<Shape> {
        if input.c != self.c {
            return Err(Error::Shape {
                layer: self.name(),
                input,
                reason: format!("has {} channels, expected {}", input.c, self.c),
            });
        }
        // Rebuilt for another shape: the learned values and statistics stay.
        let bn = match self.plan.take() {
            Some(p) => p.bn,
            None => BatchNorm::new(self.c, channel_block(self.c))?,
        };
        let len = bn.gamma().len();
        self.plan = Some(BnPlan {
            x: blocked(input)?,
            y: blocked(input)?,
            dy: blocked(input)?,
            dx: blocked(input)?,
            dgamma: vec![0.0; len],
            dbeta: vec![0.0; len],
            bn,
            trained: false,
        });
        Ok(input)
    }
    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("forward"))?;
        p.x.set_nchw(x.data())?;
        match mode {
            Mode::Train => p.bn.forward_train(pool, &p.x, &mut p.y)?,
            Mode::Eval => p.bn.forward_infer(pool, &p.x, &mut p.y)?,
        }
        p.trained = mode == Mode::Train;
        plain(&p.y)
    }
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("backward"))?;
        need_training(p.trained, "batchnorm2d")?;
        p.dy.set_nchw(dy.data())?;
        p.bn.backward(pool, &p.x, &p.dy, &mut p.dx, &mut p.dgamma, &mut p.dbeta)?;
        plain(&p.dx)
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
    plan: Option<PoolPlan>,
}

struct PoolPlan {
    pool: Pool2d,
    x: Tensor4,
    y: Tensor4,
    dy: Tensor4,
    dx: Tensor4,
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
            plan: None,
        }
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
        let x = blocked(input)?;
        let pool = Pool2d::new(self.kind, &x, self.window, self.stride, self.pad).map_err(|e| {
            Error::Shape {
                layer: self.name(),
                input,
                reason: e.to_string(),
            }
        })?;
        let y = pool.output();
        let (p, q) = pool.out_hw();
        self.plan = Some(PoolPlan {
            argmax: vec![0; y.data().len()],
            dy: pool.output(),
            dx: blocked(input)?,
            x,
            y,
            pool,
            trained: false,
        });
        Ok(Shape::new(input.n, input.c, p, q))
    }
    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("forward"))?;
        p.x.set_nchw(x.data())?;
        let keep = mode == Mode::Train && self.kind == PoolKind::Max;
        let argmax = keep.then_some(&mut p.argmax[..]);
        p.pool.forward(pool, &p.x, &mut p.y, argmax)?;
        p.trained = mode == Mode::Train;
        plain(&p.y)
    }
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let p = self.plan.as_mut().ok_or_else(|| unbuilt("backward"))?;
        need_training(p.trained, "pool")?;
        p.dy.set_nchw(dy.data())?;
        let argmax = (self.kind == PoolKind::Max).then_some(&p.argmax[..]);
        p.pool.backward(pool, &p.dy, argmax, &mut p.dx)?;
        plain(&p.dx)
    }
}
