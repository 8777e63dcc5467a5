//! Layers without parameters: ReLU, global average pooling, flatten.

use crate::error::{Error, Result};
use crate::layer::{Layer, Mode};
use crate::tensor::{par_images, Buf, Shape, Tensor};
use brgemm_primitives::eltwise::{relu_backward, relu_forward};
use brgemm_primitives::Pool;

/// `max(x, 0)`, element-wise; a NaN input stays NaN (it is not clamped to 0).
/// Works in whatever layout its input arrives in.
#[derive(Default)]
pub struct Relu {
    /// Where x > 0, from the last training forward on a plain input.
    mask: Vec<bool>,
    /// The output of the last forward on a blocked input (backward reads
    /// it), and its channel block.
    y: Buf,
    block: Option<usize>,
    dy: Buf,
    dx: Buf,
    trained: bool,
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
    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        self.trained = mode == Mode::Train;
        self.block = x.block();
        if let Some(bc) = self.block {
            let src = x.blocked_as(bc).expect("has this block");
            let y = self.y.get_mut(x.shape(), bc)?;
            relu_forward(pool, src.data(), y.data_mut())?;
            return Ok(self.y.tensor());
        }
        let mut y = x.clone();
        for v in y.data_mut() {
            if *v <= 0.0 {
                *v = 0.0;
            }
        }
        if self.trained {
            // Reuses the mask's allocation from step to step.
            self.mask.clear();
            self.mask.extend(x.data().iter().map(|&v| v > 0.0));
        }
        Ok(y)
    }
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        super::need_training(self.trained, "relu")?;
        if let Some(bc) = self.block {
            dy.blocked_into(pool, bc, &mut self.dy)?;
            let dx = self.dx.get_mut(dy.shape(), bc)?;
            relu_backward(
                pool,
                self.dy.get().data(),
                self.y.get().data(),
                dx.data_mut(),
            )?;
            self.dy.release();
            return Ok(self.dx.tensor());
        }
        let mut dx = dy.clone();
        for (g, &m) in dx.data_mut().iter_mut().zip(&self.mask) {
            if !m {
                *g = 0.0;
            }
        }
        Ok(dx)
    }
    fn output_block(&self) -> Option<usize> {
        self.block
    }
    fn input_block(&mut self, block: Option<usize>) {
        self.block = block;
    }
    fn is_relu(&self) -> bool {
        true
    }
}

/// The mean over each channel's pixels: `(n, c, h, w) -> (n, c, 1, 1)`.
#[derive(Default)]
pub struct GlobalAvgPool {
    input: Option<Shape>,
    /// The channel block of the last input, when it came blocked.
    block: Option<usize>,
    dx: Buf,
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
        self.block = x.block();
        let out = match self.block {
            Some(bc) => {
                let t = x.blocked_as(bc).expect("has this block");
                let image = t.image_len();
                let mut out = vec![0.0; s.n * s.c];
                for (n, img) in t.data().chunks_exact(image).enumerate() {
                    for (c, o) in out[n * s.c..][..s.c].iter_mut().enumerate() {
                        let plane = (c / bc) * hw * bc + c % bc;
                        let sum: f32 = (0..hw).map(|p| img[plane + p * bc]).sum();
                        *o = sum / hw as f32;
                    }
                }
                out
            }
            None => x
                .data()
                .chunks_exact(hw)
                .map(|plane| plane.iter().sum::<f32>() / hw as f32)
                .collect(),
        };
        Tensor::from_vec(Shape::flat(s.n, s.c), out)
    }
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let s = self
            .input
            .ok_or_else(|| Error::Graph("global average pool: never built".into()))?;
        let hw = s.h * s.w;
        let g = dy.data();
        if let Some(bc) = self.block {
            let dx = self.dx.get_mut(s, bc)?;
            let image = dx.image_len();
            par_images(pool, dx.data_mut(), image, |n, img| {
                for c in 0..s.c {
                    let plane = (c / bc) * hw * bc + c % bc;
                    let v = g[n * s.c + c] / hw as f32;
                    for p in 0..hw {
                        img[plane + p * bc] = v;
                    }
                }
            });
            return Ok(self.dx.tensor());
        }
        let mut dx = Tensor::zeros(s);
        for (plane, &g) in dx.data_mut().chunks_exact_mut(hw).zip(g) {
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

/// Inverted dropout: in training each element is kept with probability
/// `1 - p` and scaled by `1 / (1 - p)`; in inference the layer passes its
/// input through. Works in whatever layout its input arrives in (the
/// mask is drawn over that layout; the padding stays zero).
pub struct Dropout {
    p: f32,
    seed: u64,
    drop: Option<brgemm_primitives::eltwise::Dropout>,
    /// The channel block of the last training input (None: plain).
    block: Option<usize>,
    y: Buf,
    dy: Buf,
    dx: Buf,
    trained: bool,
}

impl Dropout {
    /// Drop probability `p` (in [0, 1), checked when built), masks drawn
    /// from `seed`.
    pub fn new(p: f32, seed: u64) -> Dropout {
        Dropout {
            p,
            seed,
            drop: None,
            block: None,
            y: Buf::default(),
            dy: Buf::default(),
            dx: Buf::default(),
            trained: false,
        }
    }
}

impl Dropout {
    /// The drop probability and the seed of the masks (the layer draws one
    /// 64-bit step key per training forward from `seed`, as
    /// [`brgemm_primitives::eltwise::Dropout`] does).
    pub fn rate(&self) -> (f32, u64) {
        (self.p, self.seed)
    }
}

impl Layer for Dropout {
    fn name(&self) -> String {
        format!("dropout {}", self.p)
    }
    fn build(&mut self, input: Shape) -> Result<Shape> {
        let d = brgemm_primitives::eltwise::Dropout::new(self.p, self.seed).map_err(|e| {
            Error::Shape {
                layer: self.name(),
                input,
                reason: e.to_string(),
            }
        })?;
        // Rebuilt for another shape: the mask stream goes on.
        if self.drop.is_none() {
            self.drop = Some(d);
        }
        Ok(input)
    }
    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let d = self
            .drop
            .as_mut()
            .ok_or_else(|| super::unbuilt("forward"))?;
        self.trained = mode == Mode::Train;
        if !self.trained {
            return Ok(x.clone());
        }
        self.block = x.block();
        if let Some(bc) = self.block {
            let src = x.blocked_as(bc).expect("has this block");
            let y = self.y.get_mut(x.shape(), bc)?;
            d.forward_train(pool, src.data(), y.data_mut())?;
            return Ok(self.y.tensor());
        }
        let mut y = vec![0.0; x.shape().len()];
        d.forward_train(pool, x.data(), &mut y)?;
        Tensor::from_vec(x.shape(), y)
    }
    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        super::need_training(self.trained, "dropout")?;
        let d = self
            .drop
            .as_ref()
            .ok_or_else(|| super::unbuilt("backward"))?;
        if let Some(bc) = self.block {
            dy.blocked_into(pool, bc, &mut self.dy)?;
            let dx = self.dx.get_mut(dy.shape(), bc)?;
            d.backward(pool, self.dy.get().data(), dx.data_mut())?;
            self.dy.release();
            return Ok(self.dx.tensor());
        }
        let mut dx = vec![0.0; dy.shape().len()];
        d.backward(pool, dy.data(), &mut dx)?;
        Tensor::from_vec(dy.shape(), dx)
    }
    fn output_block(&self) -> Option<usize> {
        self.block
    }
    fn input_block(&mut self, block: Option<usize>) {
        self.block = block;
    }
}
