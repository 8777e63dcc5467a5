//! The plain bf16 reference: bf16 inputs widened to f32, multiplied and
//! accumulated in plain loops, the epilogue in f32; the fallback for any
//! CPU and the oracle the bf16 kernels are tested against.

use crate::batch::BatchSrc;
use crate::bf16::bf16;
use crate::desc::{Beta, Descriptor};

/// Runs `d` (dtype Bf16, A_i VNNI-packed) on `count` pairs of `src` into
/// the f32 C at `c`.
///
/// # Safety
/// As [`crate::Kernel::execute_raw`] for a bf16 descriptor.
pub(crate) unsafe fn run<B: BatchSrc<bf16>>(
    d: &Descriptor,
    src: &B,
    count: usize,
    c: *mut f32,
    bias: *const f32,
) {
    for j in 0..d.n {
        for r in 0..d.m {
            let mut s = 0.0f32;
            for i in 0..count {
                let (a, b) = (src.a(i), src.b(i));
                for p in 0..d.k {
                    let av = (*a.add((p / 2) * 2 * d.lda + 2 * r + p % 2)).to_f32();
                    s += av * (*b.add(p + j * d.ldb)).to_f32();
                }
            }
            let cp = c.add(j * d.ldc + r);
            let mut x = d.alpha * s;
            if d.beta == Beta::One {
                x += *cp;
            }
            if !bias.is_null() {
                x += *bias.add(r);
            }
            *cp = d.epilogue.activation.apply(x);
        }
    }
}
