//! Plain tensors: what layers take and return at the graph's edges.
//! Activations are NCHW, row-major, f32; a flattened feature vector is
//! `(n, features, 1, 1)`.

use crate::error::{Error, Result};
use std::fmt;

/// The shape of an activation: minibatch, channels, height, width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Minibatch.
    pub n: usize,
    /// Channels (features after a flatten).
    pub c: usize,
    /// Height (1 for feature vectors).
    pub h: usize,
    /// Width (1 for feature vectors).
    pub w: usize,
}

impl Shape {
    /// `(n, c, h, w)`.
    pub fn new(n: usize, c: usize, h: usize, w: usize) -> Shape {
        Shape { n, c, h, w }
    }
    /// Feature vectors: `(n, features, 1, 1)`.
    pub fn flat(n: usize, features: usize) -> Shape {
        Shape::new(n, features, 1, 1)
    }
    /// Elements, or None on overflow.
    pub fn checked_len(&self) -> Option<usize> {
        self.n
            .checked_mul(self.c)?
            .checked_mul(self.h)?
            .checked_mul(self.w)
    }
    /// Elements (shapes in a built graph never overflow).
    pub fn len(&self) -> usize {
        self.n * self.c * self.h * self.w
    }
    /// Whether the shape holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Features per sample (`c * h * w`).
    pub fn features(&self) -> usize {
        self.c * self.h * self.w
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {}, {}, {})", self.n, self.c, self.h, self.w)
    }
}

/// A plain NCHW tensor. The data length always matches the shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Shape,
    data: Vec<f32>,
}

impl Tensor {
    /// Zeros of `shape`.
    pub fn zeros(shape: Shape) -> Tensor {
        Tensor {
            shape,
            data: vec![0.0; shape.len()],
        }
    }
    /// `data` (NCHW) as a tensor of `shape`; an error names both lengths.
    pub fn from_vec(shape: Shape, data: Vec<f32>) -> Result<Tensor> {
        match shape.checked_len() {
            Some(n) if n == data.len() => Ok(Tensor { shape, data }),
            _ => Err(Error::Graph(format!(
                "{} values do not fill a tensor of shape {shape}",
                data.len()
            ))),
        }
    }
    /// The shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }
    /// The values, NCHW.
    pub fn data(&self) -> &[f32] {
        &self.data
    }
    /// The values, NCHW, to write in place (the length is fixed).
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
    /// The values.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
    /// The same values under another shape of equal size (a flatten).
    pub(crate) fn reshaped(self, shape: Shape) -> Tensor {
        debug_assert_eq!(shape.len(), self.data.len());
        Tensor {
            shape,
            data: self.data,
        }
    }
    /// An error unless the shape is `want`.
    pub(crate) fn expect(&self, what: &str, want: Shape) -> Result<()> {
        if self.shape == want {
            Ok(())
        } else {
            Err(Error::Tensor {
                what: what.into(),
                expected: want,
                got: self.shape,
            })
        }
    }
}
