//! Non-finite detection for training loops: a diverged step (NaN or
//! infinite loss, or a gradient whose norm is not finite) stops training
//! with an error naming the step, before the optimizer writes the bad
//! values into the weights.
//!
//! The cost is one read of every gradient per step (a sum of squares), a
//! fraction of a percent of a step's time; training configs carry an
//! opt-out (`check_finite: false`) for experiments that want to watch a
//! divergence instead.

use crate::error::{Error, Result};

/// The L2 norm of all of `bufs` together, accumulated in f64 (so it
/// overflows only where the gradient itself is not finite).
pub fn norm<'a>(bufs: impl IntoIterator<Item = &'a [f32]>) -> f64 {
    bufs.into_iter().map(sum_squares).sum::<f64>().sqrt()
}

/// Sum of squares in f64 over 32 independent partial sums: one running sum
/// is a chain of dependent f64 adds the compiler may not reorder (4 ms
/// for the 3.2 M gradients of `bench mpi`'s MLP, more than its optimizer
/// step); 32 lanes vectorise and run at memory speed.
fn sum_squares(b: &[f32]) -> f64 {
    const LANES: usize = 32;
    let mut acc = [0.0f64; LANES];
    let mut chunks = b.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    acc.iter().sum::<f64>() + tail
}

/// `Ok` when `loss` and `grad_norm` are finite; else an
/// [`Error::NonFinite`] naming `step` (0-based over the whole run) and the
/// value.
pub fn check_step(step: u64, loss: f32, grad_norm: f64) -> Result<()> {
    if !loss.is_finite() {
        return Err(Error::NonFinite {
            step,
            what: "loss".into(),
            value: loss as f64,
        });
    }
    if !grad_norm.is_finite() {
        return Err(Error::NonFinite {
            step,
            what: "gradient norm".into(),
            value: grad_norm,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_step_and_the_value() {
        assert!(check_step(3, 0.5, 2.0).is_ok());
        let e = check_step(7, f32::NAN, 1.0).unwrap_err().to_string();
        assert!(
            e.contains("step 7") && e.contains("loss") && e.contains("NaN"),
            "{e}"
        );
        let e = check_step(9, 0.1, f64::INFINITY).unwrap_err().to_string();
        assert!(
            e.contains("step 9") && e.contains("gradient norm") && e.contains("inf"),
            "{e}"
        );
        assert!(norm([&[3.0f32][..], &[4.0][..]]) == 5.0);
        // Lanes and tail: 100 values 0..100 and a separate buffer.
        let v: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let want: f64 = (0..100).map(|i| (i * i) as f64).sum::<f64>() + 4.0;
        assert_eq!(norm([&v[..], &[2.0][..]]), want.sqrt());
        assert!(norm([&[f32::NAN][..]]).is_nan());
        assert!(norm([&[f32::MAX; 40][..]]).is_finite());
        assert!(norm([&[f32::MAX, f32::MAX][..]]).is_finite());
        assert!(norm([&[1.0, f32::NAN][..]]).is_nan());
    }
}
