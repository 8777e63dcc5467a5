//! Test data shared by the primitives' integration tests.
#![allow(dead_code)]

/// `len` deterministic values in [-scale/2, scale/2) (xorshift from `seed`).
pub fn data_f64(len: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (((s >> 40) as f64 / (1u64 << 24) as f64) - 0.5) * scale
        })
        .collect()
}

/// As [`data_f64`] with scale 1, in f32 (the values are exact in both).
pub fn data(len: usize, seed: u64) -> Vec<f32> {
    data_f64(len, seed, 1.0)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// Central differences of `loss` at a sample of coordinates of `x`
/// against `grad`.
pub fn fd_check(
    what: &str,
    x: &mut [f32],
    grad: &[f32],
    eps: f32,
    tol: f64,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    let step = (x.len() / 40).max(1);
    for i in (0..x.len()).step_by(step) {
        let keep = x[i];
        x[i] = keep + eps;
        let up = loss(x);
        x[i] = keep - eps;
        let down = loss(x);
        x[i] = keep;
        let fd = (up - down) / (2.0 * eps as f64);
        let g = grad[i] as f64;
        assert!(
            (fd - g).abs() <= tol * (1.0 + g.abs().max(fd.abs())),
            "{what}[{i}]: finite difference {fd}, backward {g}"
        );
    }
}

/// The optimizers the fused-step tests run: SGD with momentum and Adam.
pub fn step_rules() -> [brgemm_primitives::Optimizer; 2] {
    [
        brgemm_primitives::Optimizer::Sgd {
            lr: 0.05,
            momentum: 0.9,
        },
        brgemm_primitives::Optimizer::adam(1e-2),
    ]
}
