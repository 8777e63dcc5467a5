//! bf16 kernels against an f64 reference computed from the same bf16 values.

use brgemm::bf16::{bf16, pack_a_vnni, Bf16Isa};
use brgemm::{
    Activation, Batch, BatchForm, Beta, DataType, Descriptor, Epilogue, Kernel, KernelOptions,
    Offsets, Prefetch, RegisterTile,
};

/// `d` (dtype Bf16) planned on the bf16 kernel `isa`.
fn with_isa(d: &Descriptor, isa: Bf16Isa) -> brgemm::Result<Kernel> {
    with_tile(d, isa, None)
}

/// `d` (dtype Bf16) planned on the bf16 kernel `isa` with main tile `tile`
/// where given.
fn with_tile(d: &Descriptor, isa: Bf16Isa, tile: Option<RegisterTile>) -> brgemm::Result<Kernel> {
    let opts = KernelOptions {
        bf16: Some(isa),
        tile,
        ..KernelOptions::default()
    };
    Kernel::with_options(d, opts)
}
use proptest::prelude::*;

fn rnd(seed: &mut u64, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bf16::from_f32(((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

#[derive(Clone)]
struct Case {
    m: usize,
    n: usize,
    k: usize,
    count: usize,
    lda: usize,
    a_plain: Vec<Vec<bf16>>,
    a_vnni: Vec<Vec<bf16>>,
    b: Vec<Vec<bf16>>,
    c0: Vec<f32>,
    bias: Vec<f32>,
    /// The AVX512-BF16 kernel's main tile, where forced.
    tile: Option<RegisterTile>,
}

impl Case {
    fn new(m: usize, n: usize, k: usize, count: usize, pad: usize, seed: u64) -> Case {
        let mut s = seed | 1;
        let lda = m + pad;
        let a_plain: Vec<Vec<bf16>> = (0..count).map(|_| rnd(&mut s, m * k)).collect();
        let a_vnni = a_plain
            .iter()
            .map(|a| pack_a_vnni(a, m, k, m, lda).unwrap().to_vec()) // any alignment
            .collect();
        let b = (0..count).map(|_| rnd(&mut s, k * n)).collect();
        let c0 = rnd(&mut s, m * n).iter().map(|x| x.to_f32()).collect();
        let bias = rnd(&mut s, m).iter().map(|x| x.to_f32()).collect();
        Case {
            m,
            n,
            k,
            count,
            lda,
            a_plain,
            a_vnni,
            b,
            c0,
            bias,
            tile: None,
        }
    }

    /// The same matrices, first `count` of them (0 allowed).
    fn with_count(mut self, count: usize) -> Case {
        self.count = count;
        self.a_plain.truncate(count);
        self.a_vnni.truncate(count);
        self.b.truncate(count);
        self
    }

    fn expected(&self, d: &Descriptor) -> Vec<f64> {
        let (m, n, k) = (self.m, self.n, self.k);
        let mut out = vec![0.0; m * n];
        for j in 0..n {
            for r in 0..m {
                let mut s = 0.0f64;
                for i in 0..self.count {
                    for p in 0..k {
                        s += self.a_plain[i][p * m + r].to_f64() * self.b[i][j * k + p].to_f64();
                    }
                }
                let mut x = d.alpha as f64 * s;
                if d.beta == Beta::One {
                    x += self.c0[j * m + r] as f64;
                }
                if d.epilogue.bias {
                    x += self.bias[r] as f64;
                }
                out[j * m + r] = d.epilogue.activation.apply(x as f32) as f64;
            }
        }
        out
    }

    fn run(&self, d: &Descriptor, isa: Bf16Isa, form: u8) -> Vec<f32> {
        let (asz, bsz) = (self.a_vnni.first().map_or(0, |a| a.len()), self.k * self.n);
        let flat_a: Vec<bf16> = self.a_vnni.iter().flatten().copied().collect();
        let flat_b: Vec<bf16> = self.b.iter().flatten().copied().collect();
        let mut c = self.c0.clone();
        let bias = d.epilogue.bias.then_some(&self.bias[..]);
        match form {
            0 => {
                let d = d.batch_form(BatchForm::Stride { a: asz, b: bsz });
                let kern = with_tile(&d, isa, self.tile).unwrap();
                kern.execute(
                    Batch::Stride {
                        a: &flat_a,
                        b: &flat_b,
                        count: self.count,
                    },
                    &mut c,
                    bias,
                )
                .unwrap();
            }
            1 => {
                let d = d.batch_form(BatchForm::Offset);
                let kern = with_tile(&d, isa, self.tile).unwrap();
                // Reversed order: offsets really are followed.
                let offs = Offsets::new(
                    (0..self.count).rev().map(|i| i * asz).collect(),
                    (0..self.count).rev().map(|i| i * bsz).collect(),
                )
                .unwrap();
                kern.execute(
                    Batch::Offset {
                        a: &flat_a,
                        b: &flat_b,
                        offsets: &offs,
                    },
                    &mut c,
                    bias,
                )
                .unwrap();
            }
            _ => {
                let d = d.batch_form(BatchForm::Address);
                let kern = with_tile(&d, isa, self.tile).unwrap();
                let a: Vec<&[bf16]> = self.a_vnni.iter().map(|v| &v[..]).collect();
                let b: Vec<&[bf16]> = self.b.iter().map(|v| &v[..]).collect();
                kern.execute(Batch::Address { a: &a, b: &b }, &mut c, bias)
                    .unwrap();
            }
        }
        c
    }

    fn check(&self, d: &Descriptor, isa: Bf16Isa, form: u8) -> Result<(), String> {
        let got = self.run(d, isa, form);
        let want = self.expected(d);
        let tol = 1e-5 * ((self.k * self.count) as f64).sqrt().max(1.0) * 8.0;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let e = (*g as f64 - w).abs();
            if e.is_nan() || e > tol * (1.0 + w.abs()) {
                return Err(format!(
                    "{isa:?} form {form}: C[{i}] = {g}, want {w} ({}x{}x{} x{})",
                    self.m, self.n, self.k, self.count
                ));
            }
        }
        Ok(())
    }
}

fn desc(c: &Case, beta: Beta, alpha: f32, ep: Epilogue) -> Descriptor {
    Descriptor::new(c.m, c.n, c.k)
        .lda(c.lda)
        .dtype(DataType::Bf16)
        .beta(beta)
        .alpha(alpha)
        .epilogue(ep)
}

#[test]
fn vnni_packing_pads_odd_k_with_zeros() {
    let a: Vec<bf16> = (0..15).map(|x| bf16::from_f32(x as f32 + 1.0)).collect(); // 5 x 3
    let v = pack_a_vnni(&a, 5, 3, 5, 6).unwrap();
    assert_eq!(v.len(), 2 * 6 * 2);
    for p in 0..3 {
        for r in 0..5 {
            assert_eq!(v[(p / 2) * 12 + 2 * r + p % 2], a[p * 5 + r]);
        }
    }
    // The pad column (k = 3) and the pad row (r = 5) are zero.
    assert!((0..6).all(|r| v[12 + 2 * r + 1] == bf16::ZERO));
    assert!(pack_a_vnni(&a, 5, 3, 5, 4).is_err());
    assert!(pack_a_vnni(&a[..12], 5, 3, 5, 5).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48)))]

    /// Reference and AVX512-BF16 kernels: any shape, odd k, tails, zero
    /// batch, all forms, with and without prefetching the next pair.
    #[test]
    fn any_shape_kernels_match_f64(m in 1usize..=40, n in 1usize..=40, k in 1usize..=40, count in 0usize..=5,
                             pad in 0usize..=3, form in 0u8..3, beta1 in any::<bool>(), relu in any::<bool>(),
                             pf in any::<bool>(), seed in any::<u64>()) {
        let c = Case::new(m, n, k, count.max(1), pad, seed);
        let c = c.with_count(count);
        let ep = Epilogue { bias: relu, activation: if relu { Activation::Relu } else { Activation::Identity } };
        let d = desc(&c, if beta1 { Beta::One } else { Beta::Zero }, 0.75, ep)
            .prefetch(if pf { Prefetch::NextPair } else { Prefetch::None });
        for isa in [Bf16Isa::Avx512Bf16, Bf16Isa::Fp32, Bf16Isa::Reference] {
            if isa.is_supported() {
                c.check(&d, isa, form).map_err(TestCaseError::fail)?;
            }
        }
    }

    /// AVX512-BF16 on C blocks of whole 64-row columns (rows 64-192, a
    /// last tile of 1-4 columns, odd k, padded lda, zero batch, every form
    /// and epilogue): forced 4 x 4 and 3 x 2 main tiles, and the CPU
    /// policy's (4 x 4 on Zen 4, else 2 x 12).
    #[test]
    fn avx512bf16_whole_column_tiles_match_f64(mt in 1usize..=3, n in 1usize..=13, k in 1usize..=40,
                             count in 0usize..=4, pad in 0usize..=3, form in 0u8..3, beta1 in any::<bool>(),
                             relu in any::<bool>(), pf in any::<bool>(), seed in any::<u64>()) {
        if !Bf16Isa::Avx512Bf16.is_supported() {
            return Ok(());
        }
        let c = Case::new(64 * mt, n, k, count.max(1), pad, seed).with_count(count);
        let ep = Epilogue { bias: relu, activation: if relu { Activation::Relu } else { Activation::Identity } };
        let d = desc(&c, if beta1 { Beta::One } else { Beta::Zero }, 0.75, ep)
            .prefetch(if pf { Prefetch::NextPair } else { Prefetch::None });
        for tile in [Some(RegisterTile { mv: 4, nr: 4 }), Some(RegisterTile { mv: 3, nr: 2 }), None] {
            let c = Case { tile, ..c.clone() };
            c.check(&d, Bf16Isa::Avx512Bf16, form).map_err(TestCaseError::fail)?;
        }
    }

    /// AMX (where the CPU has it): m and k multiples of 32, any n (tail
    /// blocks of 1..=31 columns, below and above 16), all forms and epilogues.
    #[test]
    fn amx_matches_f64(mt in 1usize..=3, n in prop_oneof![1usize..=80, Just(32), Just(64)], kt in 1usize..=3, count in 0usize..=4,
                       pad in prop_oneof![Just(0usize), Just(16), Just(3)], form in 0u8..3,
                       beta1 in any::<bool>(), alpha in prop_oneof![Just(1.0f32), Just(-0.5)],
                       bias in any::<bool>(), seed in any::<u64>()) {
        // Without AMX (or with BRGEMM_AMX_DENY) there is nothing to sweep;
        // `amx_is_used_where_available_...` fails if the CPU has it unused.
        if !Bf16Isa::Amx.is_supported() {
            return Ok(());
        }
        let c = Case::new(32 * mt, n, 32 * kt, count.max(1), pad, seed);
        let c = c.with_count(count);
        let ep = Epilogue { bias, activation: Activation::Identity };
        let d = desc(&c, if beta1 { Beta::One } else { Beta::Zero }, alpha, ep);
        c.check(&d, Bf16Isa::Amx, form).map_err(TestCaseError::fail)?;
    }
}

/// The AMX kernels are exercised whenever the CPU has AMX (fails, not skips,
/// when /proc/cpuinfo lists amx_bf16 but the kernel is unavailable, unless the
/// refusal is simulated with BRGEMM_AMX_DENY).
#[test]
fn amx_is_used_where_available_and_falls_back_when_refused() {
    // /proc/cpuinfo speaks for the target only on x86-64 (under qemu it is the host's).
    let cpu_has = cfg!(target_arch = "x86_64")
        && std::fs::read_to_string("/proc/cpuinfo")
            .map(|s| s.contains(" amx_bf16"))
            .unwrap_or(false);
    let denied = std::env::var_os("BRGEMM_AMX_DENY").is_some();
    let c = Case::new(64, 64, 64, 2, 0, 1);
    let d = desc(&c, Beta::Zero, 1.0, Epilogue::default());
    let k = Kernel::new(&d).unwrap();
    // A kernel forced by name (`scripts/test.sh` runs suites once per
    // kernel) is what every plan gets: the choice under test is the
    // unforced one.
    let forced = std::env::var("BRGEMM_BF16_ISA").ok().and_then(|v| {
        Bf16Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(v.trim()))
    });
    if let Some(isa) = forced {
        assert_eq!(k.bf16_isa().unwrap(), isa, "forced by BRGEMM_BF16_ISA");
        c.check(&d, isa, 0).unwrap();
        return;
    }
    let next = if Bf16Isa::Avx512Bf16.is_supported() {
        Bf16Isa::Avx512Bf16
    } else {
        Bf16Isa::Fp32
    };
    if cpu_has && !denied {
        assert!(
            Bf16Isa::Amx.is_supported(),
            "CPU lists amx_bf16 but AMX is unavailable"
        );
        assert_eq!(k.bf16_isa().unwrap(), Bf16Isa::Amx);
    } else {
        assert!(!Bf16Isa::Amx.is_supported());
        assert_eq!(
            k.bf16_isa().unwrap(),
            next,
            "fallback when AMX is refused or absent"
        );
    }
    // A shape AMX cannot take goes to the next kernel.
    let odd = Case::new(33, 17, 7, 2, 1, 3);
    let dd = desc(&odd, Beta::Zero, 1.0, Epilogue::default());
    assert_eq!(Kernel::new(&dd).unwrap().bf16_isa().unwrap(), next);
    odd.check(&dd, next, 1).unwrap();
    c.check(&d, k.bf16_isa().unwrap(), 0).unwrap();
}

/// Two AMX kernels of different shapes interleaved on one thread and on
/// several threads at once stay right (tile state is per thread).
#[test]
fn interleaved_kernels_on_threads_stay_right() {
    if !Bf16Isa::Amx.is_supported() {
        println!("AMX not available here: interleaving test exercises the reference only");
    }
    let isa = if Bf16Isa::Amx.is_supported() {
        Bf16Isa::Amx
    } else {
        Bf16Isa::Reference
    };
    let c1 = Case::new(32, 64, 32, 3, 0, 7);
    // A tail of 28 columns: the tile configuration switches between calls.
    let c2 = Case::new(64, 60, 96, 2, 5, 9);
    let d1 = desc(&c1, Beta::One, 1.0, Epilogue::default());
    let d2 = desc(
        &c2,
        Beta::Zero,
        -0.5,
        Epilogue {
            bias: true,
            activation: Activation::Relu,
        },
    );
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for _ in 0..20 {
                    c1.check(&d1, isa, 0).unwrap();
                    c2.check(&d2, isa, 2).unwrap();
                }
            });
        }
    });
}

/// The vdpbf16ps kernel must run where /proc/cpuinfo lists avx512_bf16.
#[test]
fn avx512bf16_is_detected_where_the_cpu_has_it() {
    let cpu_has = cfg!(target_arch = "x86_64")
        && std::fs::read_to_string("/proc/cpuinfo")
            .map(|s| s.contains(" avx512_bf16"))
            .unwrap_or(false);
    assert_eq!(Bf16Isa::Avx512Bf16.is_supported(), cpu_has);
}

#[test]
fn bad_bf16_plans_name_the_value() {
    // One front end: an f32 descriptor plans an f32 kernel, which refuses
    // bf16 operands by name (and the other way round).
    let d = Descriptor::new(32, 32, 32);
    let (a, b, mut c) = (
        vec![bf16::ZERO; 32 * 32],
        vec![bf16::ZERO; 32 * 32],
        vec![0.0; 32 * 32],
    );
    let batch = Batch::Stride {
        a: &a,
        b: &b,
        count: 1,
    };
    let e = Kernel::new(&d)
        .unwrap()
        .execute(batch, &mut c, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dtype") && e.contains("Bf16") && e.contains("F32"),
        "{e}"
    );
    let k16 = Kernel::new(&d.dtype(DataType::Bf16)).unwrap();
    let (a32, b32) = (vec![0.0f32; 32 * 32], vec![0.0f32; 32 * 32]);
    let batch = Batch::Stride {
        a: &a32,
        b: &b32,
        count: 1,
    };
    let e = k16.execute(batch, &mut c, None).unwrap_err().to_string();
    assert!(e.contains("dtype") && e.contains("planned for Bf16"), "{e}");
    // A tile the AVX512-BF16 kernel lacks, and a tile for a kernel with
    // none to choose, are refused by name.
    let d16 = d.dtype(DataType::Bf16);
    let tiled = |isa, mv, nr| with_tile(&d16, isa, Some(RegisterTile { mv, nr }));
    if Bf16Isa::Avx512Bf16.is_supported() {
        let e = tiled(Bf16Isa::Avx512Bf16, 4, 6).unwrap_err().to_string();
        assert!(e.contains("tile") && e.contains("4x6"), "{e}");
        let k = tiled(Bf16Isa::Avx512Bf16, 3, 4).unwrap();
        assert_eq!(k.register_tile(), Some(RegisterTile { mv: 3, nr: 4 }));
    }
    let e = tiled(Bf16Isa::Reference, 2, 4).unwrap_err().to_string();
    assert!(e.contains("2x4") && e.contains("no register tile"), "{e}");
    if Bf16Isa::Amx.is_supported() {
        let d = Descriptor::new(30, 32, 32).dtype(DataType::Bf16);
        let e = with_isa(&d, Bf16Isa::Amx).unwrap_err().to_string();
        assert!(
            e.contains("30x32x32") && e.contains("multiples of 32"),
            "{e}"
        );
    }
}

/// bf16 C: exactly the f32 result of the same kernel (old C widened from
/// bf16 when beta = 1), rounded to nearest even; every kernel, every form.
#[test]
fn bf16_output_is_the_f32_result_rounded_to_nearest_even() {
    let mut checked = 0;
    for (m, n, k, amx_shape) in [
        (7, 5, 9, false),
        (33, 17, 4, false),
        (64, 32, 32, true),
        (32, 64, 96, true),
    ] {
        for isa in Bf16Isa::ALL {
            if !isa.is_supported() || (isa == Bf16Isa::Amx && !amx_shape) {
                continue;
            }
            for (form, beta, relu) in [
                (0u8, Beta::Zero, false),
                (1, Beta::One, true),
                (2, Beta::One, false),
            ] {
                let mut c = Case::new(m, n, k, 3, 2, (m * 131 + n * 7 + k) as u64);
                let c_b16: Vec<bf16> = c.c0.iter().map(|v| bf16::from_f32(*v)).collect();
                c.c0 = c_b16.iter().map(|v| v.to_f32()).collect();
                let ep = Epilogue {
                    bias: relu,
                    activation: if relu {
                        Activation::Relu
                    } else {
                        Activation::Identity
                    },
                };
                let d = desc(&c, beta, 0.5, ep);
                let f32_out = c.run(&d, isa, form);
                // The same call with a bf16 C.
                let (asz, bsz) = (c.a_vnni[0].len(), c.k * c.n);
                let flat_a: Vec<bf16> = c.a_vnni.iter().flatten().copied().collect();
                let flat_b: Vec<bf16> = c.b.iter().flatten().copied().collect();
                let mut cb = c_b16.clone();
                let bias = relu.then_some(&c.bias[..]);
                let db = d.c_dtype(DataType::Bf16);
                match form {
                    0 => {
                        let kern =
                            with_isa(&db.batch_form(BatchForm::Stride { a: asz, b: bsz }), isa)
                                .unwrap();
                        kern.execute_bf16_out(
                            Batch::Stride {
                                a: &flat_a,
                                b: &flat_b,
                                count: c.count,
                            },
                            &mut cb,
                            bias,
                        )
                        .unwrap();
                    }
                    1 => {
                        let kern = with_isa(&db.batch_form(BatchForm::Offset), isa).unwrap();
                        let offs = Offsets::new(
                            (0..c.count).rev().map(|i| i * asz).collect(),
                            (0..c.count).rev().map(|i| i * bsz).collect(),
                        )
                        .unwrap();
                        kern.execute_bf16_out(
                            Batch::Offset {
                                a: &flat_a,
                                b: &flat_b,
                                offsets: &offs,
                            },
                            &mut cb,
                            bias,
                        )
                        .unwrap();
                        // An f32 C is refused by name for this plan, and vice versa.
                        let e = kern.execute(
                            Batch::Offset {
                                a: &flat_a,
                                b: &flat_b,
                                offsets: &offs,
                            },
                            &mut c.c0.clone(),
                            bias,
                        );
                        assert!(e.unwrap_err().to_string().contains("c_dtype"));
                    }
                    _ => {
                        let kern = with_isa(&db.batch_form(BatchForm::Address), isa).unwrap();
                        let a: Vec<&[bf16]> = c.a_vnni.iter().map(|v| &v[..]).collect();
                        let b: Vec<&[bf16]> = c.b.iter().map(|v| &v[..]).collect();
                        kern.execute_bf16_out(Batch::Address { a: &a, b: &b }, &mut cb, bias)
                            .unwrap();
                    }
                }
                for (i, (g, w)) in cb.iter().zip(&f32_out).enumerate() {
                    assert_eq!(
                        *g,
                        bf16::from_f32(*w),
                        "{isa:?} {m}x{n}x{k} form {form}: C[{i}]"
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 12, "only {checked} combinations ran");
    let e = Descriptor::new(4, 4, 4)
        .c_dtype(DataType::Bf16)
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("c_dtype"), "{e}");
}

/// A bias pointer passed to a kernel whose epilogue has no bias is ignored,
/// as the f32 kernels do (the chunks before the last of a split reduction
/// are called with the block's bias): on every bf16 kernel this CPU runs.
#[test]
fn a_bias_without_a_bias_epilogue_is_ignored() {
    let (m, n, k) = (32, 4, 8);
    let mut seed = 3;
    let (a, b) = (rnd(&mut seed, m * k), rnd(&mut seed, k * n));
    let a = pack_a_vnni(&a, m, k, m, m).unwrap();
    let d = Descriptor::new(m, n, k)
        .dtype(DataType::Bf16)
        .batch_form(BatchForm::Stride { a: 0, b: 0 });
    let bias = vec![1000.0f32; m];
    for isa in [
        Bf16Isa::Amx,
        Bf16Isa::Avx512Bf16,
        Bf16Isa::Fp32,
        Bf16Isa::Reference,
    ] {
        let Ok(kern) = with_isa(&d, isa) else {
            continue; // not on this CPU, or not for this shape
        };
        let run = |bias: *const f32| {
            let mut c = vec![0.0f32; m * n];
            let batch = brgemm::RawBatch::Stride {
                a: a.as_ptr(),
                b: b.as_ptr(),
                count: 1,
            };
            // SAFETY: A (packed) and B hold one pair of the descriptor's
            // shape, C m x n, the bias m floats.
            unsafe { kern.execute_raw(batch, c.as_mut_ptr(), bias) };
            c
        };
        assert_eq!(run(std::ptr::null()), run(bias.as_ptr()), "{isa:?}");
    }
}

/// Naming the next call's first B ([`Kernel::execute_raw_then`]), which
/// the AVX512-BF16 kernel then prefetches with each next pair's, changes
/// no result bit on any bf16 kernel, tile, batch length or address (a real
/// buffer, this call's own B, or one never mapped: prefetches do not fault).
#[test]
fn prefetching_the_next_calls_b_changes_no_bf16_result() {
    use brgemm::RawBatch;
    let (m, n, k) = (64, 13, 37);
    let mut s = 7u64;
    let next = rnd(&mut s, 1 << 14);
    let tiles = [None, Some(RegisterTile { mv: 4, nr: 4 })];
    for isa in [
        Bf16Isa::Amx,
        Bf16Isa::Avx512Bf16,
        Bf16Isa::Fp32,
        Bf16Isa::Reference,
    ] {
        if !isa.is_supported() {
            continue;
        }
        for (count, tile) in [1usize, 3].into_iter().flat_map(|c| tiles.map(|t| (c, t))) {
            let c = Case::new(m, n, k, count, 0, 11 + count as u64);
            let (asz, bsz) = (c.a_vnni[0].len(), k * n);
            let a: Vec<bf16> = c.a_vnni.iter().flatten().copied().collect();
            let b: Vec<bf16> = c.b.iter().flatten().copied().collect();
            let d = desc(&c, Beta::Zero, 1.0, Epilogue::default())
                .prefetch(Prefetch::NextPair)
                .batch_form(BatchForm::Stride { a: asz, b: bsz });
            // AMX refuses odd k, other kernels the 4x4 tile.
            let Ok(kern) = with_tile(&d, isa, tile.filter(|_| isa == Bf16Isa::Avx512Bf16)) else {
                continue;
            };
            let batch = || RawBatch::Stride {
                a: a.as_ptr(),
                b: b.as_ptr(),
                count,
            };
            let mut want = vec![0.0f32; m * n];
            // SAFETY: A holds `count` packed blocks, B `count` k x n blocks,
            // C one m x n block; no bias in the descriptor.
            unsafe { kern.execute_raw(batch(), want.as_mut_ptr(), std::ptr::null()) };
            for next_b in [next.as_ptr(), b.as_ptr(), 64usize as *const bf16] {
                let mut got = vec![0.0f32; m * n];
                // SAFETY: as above; `next_b` is only prefetched.
                unsafe {
                    kern.execute_raw_then(batch(), got.as_mut_ptr(), std::ptr::null(), next_b)
                };
                assert_eq!(got, want, "{isa:?} {tile:?} x{count} next B {next_b:?}");
            }
        }
    }
}
