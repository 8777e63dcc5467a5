//! Branch-free `exp`, `sigmoid` and `tanh` for the element-wise steps
//! (LSTM gates): plain f32 arithmetic that LLVM vectorises over a slice,
//! where the libm calls stay scalar. `exp` is the Cephes scheme (n = round(x
//! log2 e), a degree-6 polynomial on [-ln2/2, ln2/2], 2^n through the
//! exponent bits): relative error below 5e-7 on [-87, 88].
//!
//! `widest!` (crate-internal) compiles such a loop once per x86 vector ISA
//! and picks the one the kernels use at run time: the crate builds for
//! baseline x86-64, where LLVM vectorises with 4-lane SSE2 only.

/// e^x (x clamped to [-87.3, 88.3], so no infinities or denormals).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Plain `*` and `+` (no `mul_add`, no `round`): without a target
    // feature for FMA those become libm calls, and calls do not vectorise.
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.clamp(-87.3, 88.3);
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    // ln 2 split in a part exact in f32 and the rest.
    let r = (x - n * 0.693_359_4) + n * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    p = p * (r * r) + r + 1.0;
    // 2^n from the bits of t: its last mantissa bits hold n (|n| < 2^22,
    // same exponent as ROUND). `n as i32` would be a saturating, NaN-checked
    // conversion that LLVM leaves scalar, lane by lane, inside the vector loop.
    let e = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23;
    p * f32::from_bits(e)
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

/// `widest! { fn name / plain(args) { body } }` defines `plain`, the body
/// as an `#[inline(always)]` fn, and `name`, which runs that body compiled
/// for the ISA the kernels use ([`brgemm::Isa::selected`]: the best one, or
/// `BRGEMM_ISA`): AVX-512F, AVX2 with FMA, else the build target. So a
/// forced ISA covers the element-wise loops too, and the test script's runs
/// per ISA test every version. Plain `*` and `+` are never fused into FMAs,
/// so every version gives the same bits (the tests compare `name` with
/// `plain`).
macro_rules! widest {
    ($(#[$m:meta])* $vis:vis fn $name:ident / $plain:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        #[inline(always)]
        $(#[$m])*
        $vis fn $plain($($arg: $ty),*) $body

        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                /// # Safety
                /// The CPU has AVX-512F.
                #[target_feature(enable = "avx512f")]
                unsafe fn wide512($($arg: $ty),*) {
                    $plain($($arg),*)
                }
                /// # Safety
                /// The CPU has AVX2 and FMA.
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide256($($arg: $ty),*) {
                    $plain($($arg),*)
                }
                match brgemm::Isa::selected() {
                    // SAFETY: `selected` returns only ISAs this CPU supports
                    // (AVX-512F; AVX2 and FMA).
                    Ok(brgemm::Isa::Avx512) => return unsafe { wide512($($arg),*) },
                    // SAFETY: as above.
                    Ok(brgemm::Isa::Avx2) => return unsafe { wide256($($arg),*) },
                    _ => {}
                }
            }
            $plain($($arg),*)
        }
    };
}
pub(crate) use widest;

/// Runs `f` compiled for the ISA the kernels use, as [`widest!`] does for
/// a named fn: `f` (a closure over `#[inline(always)]` loops) is inlined
/// into a target-feature fn, so its loops vectorise for that ISA. For the
/// generic loops `widest!` cannot name (batch norm's, generic over f32 and
/// bf16 operands and their lane group).
#[inline(always)]
pub(crate) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        /// # Safety
        /// The CPU has AVX-512F.
        #[target_feature(enable = "avx512f")]
        unsafe fn wide512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        /// # Safety
        /// The CPU has AVX2 and FMA.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn wide256<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match brgemm::Isa::selected() {
            // SAFETY: `selected` returns only ISAs this CPU supports.
            Ok(brgemm::Isa::Avx512) => return unsafe { wide512(f) },
            // SAFETY: as above.
            Ok(brgemm::Isa::Avx2) => return unsafe { wide256(f) },
            _ => {}
        }
    }
    f()
}

widest! {
    /// `out += ` the sum of the rows of `src` (rows of `out.len()`, in
    /// order): a bias gradient's reduction over pixels or minibatch rows.
    ///
    /// For the common block widths the sums stay in registers (a fixed-size
    /// copy of `out`): summed through memory, every row waited for the
    /// previous row's store, 13% of a 1x1 convolution's backward-weights.
    /// The additions happen in the same order either way.
    pub(crate) fn add_rows / add_rows_plain(out: &mut [f32], src: &[f32]) {
        #[inline(always)]
        fn fixed<const N: usize>(out: &mut [f32], src: &[f32]) {
            let mut acc = [0.0f32; N];
            acc.copy_from_slice(out);
            for row in src.chunks_exact(N) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v;
                }
            }
            out.copy_from_slice(&acc);
        }
        match out.len() {
            64 => fixed::<64>(out, src),
            32 => fixed::<32>(out, src),
            16 => fixed::<16>(out, src),
            _ => {
                for row in src.chunks_exact(out.len()) {
                    for (o, v) in out.iter_mut().zip(row) {
                        *o += v;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn add_rows_dispatched_equals_plain() {
        for bk in [48, 64, 32, 16] {
            add_rows_case(bk);
        }
    }

    fn add_rows_case(bk: usize) {
        let src: Vec<f32> = (0..bk * 37)
            .map(|i| ((i * 37) % 101) as f32 / 7.0 - 6.0)
            .collect();
        let (mut a, mut b) = (vec![0.5f32; bk], vec![0.5f32; bk]);
        super::add_rows(&mut a, &src);
        super::add_rows_plain(&mut b, &src);
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let want: f64 = 0.5 + (0..37).map(|r| src[r * bk + 5] as f64).sum::<f64>();
        assert!((a[5] as f64 - want).abs() < 1e-4, "{} vs {want}", a[5]);
    }

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
