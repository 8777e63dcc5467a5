//! The plain reference kernel: the contract in its most obvious form.
//!
//! ```text
//!   for each C element (r, j):  s = sum_i sum_p A_i[r, p] * B_i[p, j]   (one scalar)
//!   C[r, j] = act(alpha * s + beta * C[r, j] + bias[r])
//! ```
//!
//! No blocking, no vectors: it is the fallback for any CPU and the oracle the
//! tuned kernels are tested against.

use crate::batch::BatchSrc;
use crate::tile::TileCall;

/// The plain reference kernel: same contract, scalar loops, no blocking.
///
/// # Safety
/// As for [`tile`], for an `m x n` C.
pub(crate) unsafe fn run<B: BatchSrc<f32>>(t: &TileCall, src: &B, m: usize, n: usize) {
    for j in 0..n {
        for r in 0..m {
            let mut s = 0.0f32;
            for i in 0..t.count {
                let (a, b) = (src.a(i), src.b(i));
                for p in 0..t.k {
                    s += *a.add(r + p * t.lda) * *b.add(p * t.b_step + j * t.b_col);
                }
            }
            let cp = t.c.add(j * t.ldc + r);
            let mut x = t.alpha * s;
            if t.beta_one {
                x += *cp;
            }
            if !t.bias.is_null() {
                x += *t.bias.add(r);
            }
            *cp = t.act.apply(x);
        }
    }
}
