//! Shared test support: a seeded RNG, problem builder and the f64 reference.
#![allow(dead_code)]

use brgemm::{Activation, Batch, BatchForm, Beta, Descriptor, Epilogue, Kernel, Offsets};

/// SplitMix64: tiny, seeded, good enough for test data.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Which batch form a case uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Form {
    Stride,
    Offset,
    Address,
}

/// One randomly generated BRGEMM problem with its own storage.
pub struct Case {
    pub desc: Descriptor,
    pub form: Form,
    pub count: usize,
    /// Storage of the A_i (stride / offset forms: one buffer).
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    /// Start of A_i / B_i in `a` / `b` (stride and offset forms) ...
    pub a_at: Vec<usize>,
    pub b_at: Vec<usize>,
    /// ... or one buffer per matrix (address form).
    pub a_list: Vec<Vec<f32>>,
    pub b_list: Vec<Vec<f32>>,
    pub offsets: Option<Offsets>,
    pub bias: Option<Vec<f32>>,
    pub c0: Vec<f32>,
}

pub const SENTINEL: f32 = 12345.0;

#[allow(clippy::too_many_arguments)]
impl Case {
    pub fn new(
        m: usize,
        n: usize,
        k: usize,
        count: usize,
        form: Form,
        beta: Beta,
        alpha: f32,
        pad: (usize, usize, usize),
        epilogue: Epilogue,
        seed: u64,
    ) -> Case {
        Case::with_b_layout(
            (m, n, k),
            count,
            form,
            beta,
            alpha,
            pad,
            epilogue,
            seed,
            false,
        )
    }

    /// The case the per-register-tile tests run: 3 pairs, beta = 1, padded
    /// leading dimensions, bias and ReLU, seeded by the tile.
    pub fn for_tile(
        (m, n, k): (usize, usize, usize),
        form: Form,
        (mv, nr): (usize, usize),
        b_row_major: bool,
    ) -> Case {
        let ep = Epilogue {
            bias: true,
            activation: Activation::Relu,
        };
        let seed = (mv * 100 + nr) as u64;
        Case::with_b_layout(
            (m, n, k),
            3,
            form,
            Beta::One,
            1.0,
            (1, 0, 2),
            ep,
            seed,
            b_row_major,
        )
    }

    /// As [`Case::new`] (dimensions as one tuple), with B_i row-major when
    /// `b_row_major`.
    pub fn with_b_layout(
        (m, n, k): (usize, usize, usize),
        count: usize,
        form: Form,
        beta: Beta,
        alpha: f32,
        pad: (usize, usize, usize),
        epilogue: Epilogue,
        seed: u64,
        b_row_major: bool,
    ) -> Case {
        let mut r = Rng(seed);
        let (b_outer, b_inner) = if b_row_major { (k, n) } else { (n, k) };
        let (lda, ldb, ldc) = (m + pad.0, b_inner + pad.1, m + pad.2);
        let (a_ext, b_ext) = (lda * (k - 1) + m, ldb * (b_outer - 1) + b_inner);
        let mut desc = Descriptor::new(m, n, k);
        if b_row_major {
            desc = desc.b_row_major();
        }
        let mut desc = desc
            .lda(lda)
            .ldb(ldb)
            .ldc(ldc)
            .alpha(alpha)
            .beta(beta)
            .epilogue(epilogue);
        let fill = |r: &mut Rng, len: usize| (0..len).map(|_| r.f32()).collect::<Vec<f32>>();
        let mut case = Case {
            desc,
            form,
            count,
            a: vec![],
            b: vec![],
            a_at: vec![],
            b_at: vec![],
            a_list: vec![],
            b_list: vec![],
            offsets: None,
            bias: epilogue.bias.then(|| fill(&mut r, m)),
            c0: vec![],
        };
        match form {
            Form::Stride => {
                // Gaps between matrices, so strides are not the packed ones.
                let (sa, sb) = (a_ext + r.below(5), b_ext + r.below(5));
                desc = desc.batch_form(BatchForm::Stride { a: sa, b: sb });
                case.a = fill(&mut r, sa * count.max(1));
                case.b = fill(&mut r, sb * count.max(1));
                case.a_at = (0..count).map(|i| i * sa).collect();
                case.b_at = (0..count).map(|i| i * sb).collect();
                // Trim to the exact length the kernel may touch.
                if count > 0 {
                    case.a.truncate((count - 1) * sa + a_ext);
                    case.b.truncate((count - 1) * sb + b_ext);
                }
            }
            Form::Offset => {
                // Matrices in a shuffled order, one reused twice when possible.
                desc = desc.batch_form(BatchForm::Offset);
                let slots = count.max(1);
                case.a = fill(&mut r, a_ext * slots + 3);
                case.b = fill(&mut r, b_ext * slots + 3);
                case.a_at = (0..count).map(|i| ((i * 7 + 3) % slots) * a_ext).collect();
                case.b_at = (0..count).map(|i| ((i * 5 + 1) % slots) * b_ext).collect();
                if count > 2 {
                    case.a_at[count - 1] = case.a_at[0];
                }
                case.offsets = Some(Offsets::new(case.a_at.clone(), case.b_at.clone()).unwrap());
            }
            Form::Address => {
                desc = desc.batch_form(BatchForm::Address);
                case.a_list = (0..count).map(|_| fill(&mut r, a_ext)).collect();
                case.b_list = (0..count).map(|_| fill(&mut r, b_ext)).collect();
            }
        }
        case.desc = desc;
        let c_len = ldc * n;
        case.c0 = match beta {
            // beta = 0: C must never be read, so NaN would poison any read.
            Beta::Zero => vec![f32::NAN; c_len],
            Beta::One => fill(&mut r, c_len),
        };
        // Padding rows (m..ldc) must come back untouched.
        for j in 0..n {
            for i in m..ldc {
                case.c0[j * ldc + i] = SENTINEL;
            }
        }
        case
    }

    fn a_i(&self, i: usize) -> &[f32] {
        match self.form {
            Form::Address => &self.a_list[i],
            _ => &self.a[self.a_at[i]..],
        }
    }
    fn b_i(&self, i: usize) -> &[f32] {
        match self.form {
            Form::Address => &self.b_list[i],
            _ => &self.b[self.b_at[i]..],
        }
    }

    /// The f64 reference: the definition, in plain loops. Returns C and, per
    /// element, the magnitude sum used to scale the tolerance.
    pub fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let d = &self.desc;
        let mut c = vec![0.0f64; self.c0.len()];
        let mut mag = vec![0.0f64; self.c0.len()];
        for j in 0..d.n {
            for r in 0..d.m {
                let (mut s, mut g) = (0.0f64, 0.0f64);
                for i in 0..self.count {
                    let (a, b) = (self.a_i(i), self.b_i(i));
                    for p in 0..d.k {
                        let bv = if d.b_row_major {
                            b[p * d.ldb + j]
                        } else {
                            b[p + j * d.ldb]
                        };
                        let x = a[r + p * d.lda] as f64 * bv as f64;
                        s += x;
                        g += x.abs();
                    }
                }
                let idx = j * d.ldc + r;
                let mut x = d.alpha as f64 * s;
                g *= (d.alpha as f64).abs();
                if d.beta == Beta::One {
                    x += self.c0[idx] as f64;
                    g += (self.c0[idx] as f64).abs();
                }
                if let Some(bias) = &self.bias {
                    x += bias[r] as f64;
                    g += (bias[r] as f64).abs();
                }
                c[idx] = act64(d.epilogue.activation, x);
                mag[idx] = g;
            }
        }
        (c, mag)
    }

    /// Runs `kernel` through the safe API on a fresh copy of C.
    pub fn run(&self, kernel: &Kernel) -> Result<Vec<f32>, brgemm::Error> {
        let mut c = self.c0.clone();
        let a_refs: Vec<&[f32]> = self.a_list.iter().map(|v| v.as_slice()).collect();
        let b_refs: Vec<&[f32]> = self.b_list.iter().map(|v| v.as_slice()).collect();
        let batch = match self.form {
            Form::Stride => Batch::Stride {
                a: &self.a,
                b: &self.b,
                count: self.count,
            },
            Form::Offset => Batch::Offset {
                a: &self.a,
                b: &self.b,
                offsets: self.offsets.as_ref().unwrap(),
            },
            Form::Address => Batch::Address {
                a: &a_refs,
                b: &b_refs,
            },
        };
        kernel.execute(batch, &mut c, self.bias.as_deref())?;
        Ok(c)
    }

    /// Compares a result with the reference; `Err` describes the worst element.
    pub fn check(&self, got: &[f32]) -> Result<(), String> {
        let d = &self.desc;
        let (want, mag) = self.reference();
        for j in 0..d.n {
            for r in 0..d.ldc {
                let idx = j * d.ldc + r;
                if r >= d.m {
                    if got[idx] != SENTINEL {
                        return Err(format!("padding C[{r},{j}] overwritten with {}", got[idx]));
                    }
                    continue;
                }
                // f32 accumulation error grows with the number of terms.
                let terms = (d.k * self.count + 2) as f64;
                let tol = 4.0 * f32::EPSILON as f64 * terms.sqrt().max(4.0) * mag[idx] + 1e-6;
                let g = got[idx] as f64;
                let d = (g - want[idx]).abs();
                // NaN (e.g. a read of the NaN-filled C under beta = 0) must fail.
                if d.is_nan() || d > tol {
                    return Err(format!(
                        "C[{r},{j}] = {g}, want {} (tol {tol:e}) for {:?}, form {:?}, count {}",
                        want[idx], d, self.form, self.count
                    ));
                }
            }
        }
        Ok(())
    }
}

pub fn act64(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Identity => x,
        Activation::Relu => x.max(0.0),
        Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Activation::Tanh => x.tanh(),
        Activation::Gelu => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
        }
        _ => unreachable!("new activation: extend the reference"),
    }
}
