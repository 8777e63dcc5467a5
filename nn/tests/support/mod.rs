//! Deterministic test data for the layer-graph tests.
#![allow(dead_code)]

use brgemm_nn::{Shape, Tensor};

/// A linear congruential generator of values in [-1, 1).
pub struct Lcg(pub u64);

impl Lcg {
    /// The next value.
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// `n` values.
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
    /// A tensor of `s` filled with values.
    pub fn tensor(&mut self, s: Shape) -> Tensor {
        Tensor::from_vec(s, self.vec(s.len())).unwrap()
    }
}
