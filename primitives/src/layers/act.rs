//! Activation gradients: `dz = dy * act'(z)`, from the outputs where the
//! derivative is a function of them (ReLU, sigmoid, tanh), from the
//! pre-activations for GELU. Shared by the FC, convolution and element-wise
//! backward passes.

use crate::math::widest;
use brgemm::Activation;

widest! {
    /// `out = dy * act'(y)` for the activations whose derivative is a
    /// function of the output y (ReLU, sigmoid, tanh); others leave `out`.
    /// The match sits outside the loops, so each loop vectorises.
    fn grad_from_y / grad_from_y_plain(act: Activation, out: &mut [f32], dy: &[f32], y: &[f32]) {
        let (dy, y) = (&dy[..out.len()], &y[..out.len()]);
        match act {
            Activation::Relu => {
                for i in 0..out.len() {
                    out[i] = dy[i] * if y[i] > 0.0 { 1.0 } else { 0.0 };
                }
            }
            Activation::Sigmoid => {
                for i in 0..out.len() {
                    out[i] = dy[i] * (y[i] * (1.0 - y[i]));
                }
            }
            Activation::Tanh => {
                for i in 0..out.len() {
                    out[i] = dy[i] * (1.0 - y[i] * y[i]);
                }
            }
            _ => {}
        }
    }
}

/// `out = dy * act'` element-wise, from the outputs `y` (GELU: from the
/// pre-activations `z`, which it then needs, as long as `out`). Per
/// element, [`act_grad`] was a call (it does not inline, GELU's `tanh` makes it
/// large): 5% of a CNN training step. Same bits as `dy * act_grad(..)`.
pub(crate) fn mul_act_grad(act: Activation, out: &mut [f32], dy: &[f32], y: &[f32], z: &[f32]) {
    match act {
        Activation::Relu | Activation::Sigmoid | Activation::Tanh => grad_from_y(act, out, dy, y),
        Activation::Gelu => {
            debug_assert_eq!(z.len(), out.len(), "GELU backward without Z");
            for ((o, g), zv) in out.iter_mut().zip(dy).zip(z) {
                *o = g * act_grad(act, 0.0, *zv);
            }
        }
        _ => {
            for (o, g) in out.iter_mut().zip(dy) {
                *o = g * act_grad(act, 0.0, 0.0);
            }
        }
    }
}

/// d act / d z, from the output y (or the pre-activation z for GELU).
#[inline]
pub(crate) fn act_grad(act: Activation, y: f32, z: f32) -> f32 {
    match act {
        Activation::Relu => {
            if y > 0.0 {
                1.0
            } else {
                0.0
            }
        }
        Activation::Sigmoid => y * (1.0 - y),
        Activation::Tanh => 1.0 - y * y,
        Activation::Gelu => {
            const C: f32 = 0.797_884_6;
            let u = C * (z + 0.044715 * z * z * z);
            let th = u.tanh();
            0.5 * (1.0 + th) + 0.5 * z * (1.0 - th * th) * C * (1.0 + 3.0 * 0.044715 * z * z)
        }
        _ => 1.0,
    }
}
