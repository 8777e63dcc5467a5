//! Layers without parameters: ReLU, global average pooling, flatten.

use crate::error::{Error, Result};
use crate::layer::{Layer, Mode};
use crate::tensor::{Shape, Tensor};
use brgemm_primitives::Pool;

/// `max(x, 0)`, element-wise; a NaN input stays NaN (it is not clamped to 0).
#[derive(Debug, Default)]
pub struct Relu {
    /// Where x > 0, from the last training forward.
    mask: Vec<bool>,
}

impl Relu {
    /// A ReLU.
    pub fn new() -> Relu {
        Relu::default()
    }
}

impl Layer for Relu {
    fn name(&self) -> String {
        "relu".into()
    }
    fn build(&mut self, input: Shape) -> Result<Shape> {
        Ok(input)
    }
    fn forward(&mut self, _pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let mut y = x.clone();
        for v in y.data_mut() {
            if *v <= 0.0 {
                *v = 0.0;
            }
        }
        if mode == Mode::Train {
            // Reuses the mask's allocation from step to step.
            self.mask.clear();
            self.mask.extend(x.data().iter().map(|&v| v > 0.0));
        }
        Ok(y)
    }
    fn backward(&mut self, _pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        if self.mask.len() != dy.shape().len() {
            return Err(Error::Graph(
                "relu: backward without a training forward".into(),
            ));
        }
        let mut dx = dy.clone();
        for (g, &m) in dx.data_mut().iter_mut().zip(&self.mask) {
            if !m {
                *g = 0.0;
            }
        }
        Ok(dx)
    }
}

/// The mean over each channel's pixels: `(n, c, h, w) -> (n, c, 1, 1)`.
#[derive(Debug, Default)]
pub struct GlobalAvgPool {
    input: Option<Shape>,
}

impl GlobalAvgPool {
    /// A global average pool.
    pub fn new() -> GlobalAvgPool {
        GlobalAvgPool::default()
    }
}

impl Layer for GlobalAvgPool {
    fn name(&self) -> String {
        "global average pool".into()
    }
    fn build(&mut self, input: Shape) -> Result<Shape> {
        self.input = Some(input);
        Ok(Shape::flat(input.n, input.c))
    }
    fn forward(&mut self, _pool: &Pool, x: &Tensor, _mode: Mode) -> Result<Tensor> {
        let s = x.shape();
        let hw = s.h * s.w;
        let out = x
            .data()
            .chunks_exact(hw)
            .map(|plane| plane.iter().sum::<f32>() / hw as f32)
            .collect();
        Tensor::from_vec(Shape::flat(s.n, s.c), out)
    }
    fn backward(&mut self, _pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let s = self
            .input
            .ok_or_else(|| Error::Graph("global average pool: never built".into()))?;
        let hw = s.h * s.w;
        let mut dx = Tensor::zeros(s);
        for (plane, &g) in dx.data_mut().chunks_exact_mut(hw).zip(dy.data()) {
            plane.fill(g / hw as f32);
        }
        Ok(dx)
    }
}

/// `(n, c, h, w) -> (n, c*h*w, 1, 1)`; the NCHW values in the same order.
#[derive(Debug, Default)]
pub struct Flatten {
    input: Option<Shape>,
}

impl Flatten {
    /// A flatten.
    pub fn new() -> Flatten {
        Flatten::default()
    }
}

impl Layer for Flatten {
    fn name(&self) -> String {
        "flatten".into()
    }
    fn build(&mut self, input: Shape) -> Result<Shape> {
        self.input = Some(input);
        Ok(Shape::flat(input.n, input.features()))
    }
    fn forward(&mut self, _pool: &Pool, x: &Tensor, _mode: Mode) -> Result<Tensor> {
        let s = x.shape();
        Ok(x.clone().reshaped(Shape::flat(s.n, s.features())))
    }
    fn backward(&mut self, _pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let s = self
            .input
            .ok_or_else(|| Error::Graph("flatten: never built".into()))?;
        Ok(dy.clone().reshaped(s))
    }
}
