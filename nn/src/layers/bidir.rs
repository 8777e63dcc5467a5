//! A bidirectional recurrent layer: one [`Recurrent`] reads the sequence
//! forward, another reads it backward, and their hidden states are
//! concatenated per step (PyTorch's `bidirectional=True`).

use super::Recurrent;
use crate::error::{Error, Result};
use crate::layer::{Layer, Mode, Param};
use crate::tensor::{Shape, Tensor};
use brgemm_primitives::Pool;

/// Two recurrent layers over a sequence `(n, features, steps, 1)`, the
/// second on the steps in reverse. The output is `(n, 2 * hidden, steps, 1)`:
/// at step t the forward direction's `h_t` (channels `0..hidden`), then the
/// backward direction's state after reading steps `T-1 ..= t` (channels
/// `hidden..`). With [`Bidirectional::last_only`] it is `(n, 2 * hidden, 1,
/// 1)`: each direction's final state (the forward one after step T-1, the
/// backward one after step 0), what a classifier reads.
///
/// Values export as the forward layer's (`weight_ih`, `weight_hh`, `bias`)
/// then the backward one's with PyTorch's `_reverse` suffix.
pub struct Bidirectional {
    fwd: Recurrent,
    bwd: Recurrent,
    last_only: bool,
    /// The built input shape.
    input: Option<Shape>,
}

/// `t` with its steps (the `h` axis) in reverse order.
fn reversed(t: &Tensor) -> Result<Tensor> {
    let s = t.shape();
    let (steps, lane) = (s.h, s.w);
    let mut out = t.data().to_vec();
    for (row, src) in out
        .chunks_exact_mut(steps * lane)
        .zip(t.data().chunks_exact(steps * lane))
    {
        for (st, v) in row.chunks_exact_mut(lane).rev().zip(src.chunks_exact(lane)) {
            st.copy_from_slice(v);
        }
    }
    Tensor::from_vec(s, out)
}

/// `a` and `b` (same n, h, w) side by side along the channels.
fn concat(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (sa, sb) = (a.shape(), b.shape());
    let (ia, ib) = (sa.c * sa.h * sa.w, sb.c * sb.h * sb.w);
    let mut out = Vec::with_capacity(a.data().len() + b.data().len());
    for (x, y) in a.data().chunks_exact(ia).zip(b.data().chunks_exact(ib)) {
        out.extend_from_slice(x);
        out.extend_from_slice(y);
    }
    Tensor::from_vec(Shape::new(sa.n, sa.c + sb.c, sa.h, sa.w), out)
}

/// `t` split along the channels after the first `c`.
fn split(t: &Tensor, c: usize) -> Result<(Tensor, Tensor)> {
    let s = t.shape();
    let (img, first) = (s.c * s.h * s.w, c * s.h * s.w);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for x in t.data().chunks_exact(img) {
        a.extend_from_slice(&x[..first]);
        b.extend_from_slice(&x[first..]);
    }
    Ok((
        Tensor::from_vec(Shape::new(s.n, c, s.h, s.w), a)?,
        Tensor::from_vec(Shape::new(s.n, s.c - c, s.h, s.w), b)?,
    ))
}

impl Bidirectional {
    /// Wraps the two directions; they must have the same kind and sizes
    /// (checked when built). Use [`Recurrent::lstm`] or [`Recurrent::rnn`]
    /// with two seeds.
    pub fn new(forward: Recurrent, backward: Recurrent) -> Bidirectional {
        Bidirectional {
            fwd: forward,
            bwd: backward,
            last_only: false,
            input: None,
        }
    }

    /// Outputs each direction's final state only, `(n, 2 * hidden, 1, 1)`.
    pub fn last_only(mut self) -> Bidirectional {
        self.last_only = true;
        self.fwd = self.fwd.last_only();
        self.bwd = self.bwd.last_only();
        self
    }

    /// The forward and backward directions (their own methods: weights,
    /// states).
    pub fn directions(&self) -> (&Recurrent, &Recurrent) {
        (&self.fwd, &self.bwd)
    }
}

impl Layer for Bidirectional {
    fn name(&self) -> String {
        format!("bi{}", self.fwd.name())
    }

    fn build(&mut self, input: Shape) -> Result<Shape> {
        if self.fwd.name() != self.bwd.name() {
            return Err(Error::Shape {
                layer: self.name(),
                input,
                reason: format!("the backward direction is a {}", self.bwd.name()),
            });
        }
        let a = self.fwd.build(input)?;
        self.bwd.build(input)?;
        self.input = Some(input);
        Ok(Shape::new(a.n, 2 * a.c, a.h, a.w))
    }

    fn forward(&mut self, pool: &Pool, x: &Tensor, mode: Mode) -> Result<Tensor> {
        let yf = self.fwd.forward(pool, x, mode)?;
        let yb = self.bwd.forward(pool, &reversed(x)?, mode)?;
        let yb = if self.last_only { yb } else { reversed(&yb)? };
        concat(&yf, &yb)
    }

    fn backward(&mut self, pool: &Pool, dy: &Tensor) -> Result<Tensor> {
        let (dyf, dyb) = self.split_grad(dy)?;
        let dxf = self.fwd.backward(pool, &dyf)?;
        let dxb = reversed(&self.bwd.backward(pool, &dyb)?)?;
        let sum = dxf
            .data()
            .iter()
            .zip(dxb.data())
            .map(|(a, b)| a + b)
            .collect();
        Tensor::from_vec(dxf.shape(), sum)
    }

    fn backward_params(&mut self, pool: &Pool, dy: &Tensor) -> Result<()> {
        let (dyf, dyb) = self.split_grad(dy)?;
        self.fwd.backward_params(pool, &dyf)?;
        self.bwd.backward_params(pool, &dyb)
    }

    fn set_bf16(&mut self, on: bool) -> Result<bool> {
        let a = self.fwd.set_bf16(on)?;
        Ok(self.bwd.set_bf16(on)? || a)
    }

    fn params(&mut self) -> Vec<Param<'_>> {
        let mut p = self.fwd.params();
        p.extend(self.bwd.params());
        p
    }

    fn export(&self) -> Vec<(&'static str, Vec<f32>)> {
        let mut v = self.fwd.export();
        v.extend(self.bwd.export().into_iter().map(|(name, x)| {
            let name = match name {
                "weight_ih" => "weight_ih_reverse",
                "weight_hh" => "weight_hh_reverse",
                _ => "bias_reverse",
            };
            (name, x)
        }));
        v
    }

    fn import(&mut self, values: &[(String, Vec<f32>)]) -> Result<()> {
        let mid = values.len().min(3);
        let back: Vec<(String, Vec<f32>)> = values[mid..]
            .iter()
            .map(|(n, x)| {
                (
                    n.strip_suffix("_reverse").unwrap_or("?").to_string(),
                    x.clone(),
                )
            })
            .collect();
        self.fwd.import(&values[..mid])?;
        self.bwd.import(&back)
    }

    fn flops(&self) -> f64 {
        self.fwd.flops() + self.bwd.flops()
    }
}

impl Bidirectional {
    /// dL/dy split into the two directions' output gradients, the backward
    /// one back in its own (reversed) step order.
    fn split_grad(&self, dy: &Tensor) -> Result<(Tensor, Tensor)> {
        let k = dy.shape().c / 2;
        let (dyf, dyb) = split(dy, k)?;
        let dyb = if self.last_only { dyb } else { reversed(&dyb)? };
        Ok((dyf, dyb))
    }
}
