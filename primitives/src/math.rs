//! Branch-free `exp`, `sigmoid` and `tanh` for the element-wise steps
//! (LSTM gates): plain f32 arithmetic that LLVM vectorises over a slice,
//! where the libm calls stay scalar. `exp` is the Cephes scheme (n = round(x
//! log2 e), a degree-6 polynomial on [-ln2/2, ln2/2], 2^n through the
//! exponent bits): relative error below 5e-7 on [-87, 88].

/// e^x (x clamped to [-87.3, 88.3], so no infinities or denormals).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Plain `*` and `+` (no `mul_add`, no `round`): without a target
    // feature for FMA those become libm calls, and calls do not vectorise.
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.clamp(-87.3, 88.3);
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    // ln 2 split in a part exact in f32 and the rest.
    let r = (x - n * 0.693_359_4) + n * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    p = p * (r * r) + r + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// 1 / (1 + e^-x).
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// tanh x = 1 - 2 / (e^(2x) + 1) (absolute error below 1e-6).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn close_to_libm() {
        let mut worst = (0.0f64, 0.0f64, 0.0f64);
        let mut x = -90.0f32;
        while x < 90.0 {
            let e = super::exp(x) as f64;
            let want = (x.clamp(-87.3, 88.3) as f64).exp();
            worst.0 = worst.0.max(((e - want) / want).abs());
            worst.1 = worst
                .1
                .max((super::tanh(x) as f64 - (x as f64).tanh()).abs());
            worst.2 = worst
                .2
                .max((super::sigmoid(x) as f64 - 1.0 / (1.0 + (-(x as f64)).exp())).abs());
            x += 0.0137;
        }
        assert!(worst.0 < 5e-7, "exp relative error {}", worst.0);
        assert!(worst.1 < 1e-6, "tanh error {}", worst.1);
        assert!(worst.2 < 1e-6, "sigmoid error {}", worst.2);
    }
}
