//! Exact tests with small integers: every product and partial sum is an
//! integer below 2^24, so every ISA must return the exact answer.

use brgemm::{Batch, Beta, Descriptor, Isa, Kernel, KernelOptions};

fn kernels(d: &Descriptor) -> Vec<Kernel> {
    Isa::supported()
        .into_iter()
        .map(|isa| {
            Kernel::with_options(
                d,
                KernelOptions {
                    isa: Some(isa),
                    tile: None,
                    bf16: None,
                },
            )
            .unwrap()
        })
        .collect()
}

fn ints(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 31 + seed * 17) % 9) as f32 - 4.0)
        .collect()
}

fn identity(n: usize) -> Vec<f32> {
    let mut v = vec![0.0; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    v
}

#[test]
fn a_times_identity_is_a() {
    for (m, k) in [(1, 1), (17, 5), (33, 33), (64, 14), (5, 29)] {
        let a = ints(m * k, m);
        let i = identity(k);
        for kern in kernels(&Descriptor::new(m, k, k)) {
            let mut c = vec![f32::NAN; m * k];
            kern.execute(
                Batch::Stride {
                    a: &a,
                    b: &i,
                    count: 1,
                },
                &mut c,
                None,
            )
            .unwrap();
            assert_eq!(c, a, "{} m={m} k={k}", kern.isa());
        }
    }
}

#[test]
fn identity_times_b_is_b() {
    for (k, n) in [(1, 1), (16, 3), (31, 17), (48, 9)] {
        let b = ints(k * n, n);
        let i = identity(k);
        for kern in kernels(&Descriptor::new(k, n, k)) {
            let mut c = vec![f32::NAN; k * n];
            kern.execute(
                Batch::Stride {
                    a: &i,
                    b: &b,
                    count: 1,
                },
                &mut c,
                None,
            )
            .unwrap();
            assert_eq!(c, b, "{} k={k} n={n}", kern.isa());
        }
    }
}

#[test]
fn batch_of_identities_sums_and_beta_one_accumulates() {
    // sum_{i<4} A_i * I + C0, exactly.
    let (m, k, count) = (23, 7, 4);
    let a = ints(m * k * count, 3);
    let mut b = Vec::new();
    for _ in 0..count {
        b.extend(identity(k));
    }
    let c0 = ints(m * k, 11);
    let mut want = c0.clone();
    for i in 0..count {
        for (w, x) in want.iter_mut().zip(&a[i * m * k..(i + 1) * m * k]) {
            *w += x;
        }
    }
    for kern in kernels(&Descriptor::new(m, k, k).beta(Beta::One)) {
        let mut c = c0.clone();
        kern.execute(
            Batch::Stride {
                a: &a,
                b: &b,
                count,
            },
            &mut c,
            None,
        )
        .unwrap();
        assert_eq!(c, want, "{}", kern.isa());
    }
}

/// The two layouts whose tile walk once stepped pointers past the operands
/// (undefined under Miri even though never read): a padded `lda > m` on
/// exactly-sized slices, and row-major B. Small integer data: exact on every
/// ISA, and small enough to run under Miri in CI.
#[test]
fn padded_lda_and_row_major_b_are_exact_and_stay_in_bounds() {
    let (m, n, k, lda) = (5, 3, 4, 9);
    // A is m x k column-major with leading dimension lda: the slice ends at
    // the last column's m-th row, so a step past it leaves the allocation.
    let a_len = lda * (k - 1) + m;
    let a = ints(a_len, 3);
    let b = ints(k * n, 5);
    let want = |row_major: bool| {
        let mut c = vec![0.0f32; m * n];
        for j in 0..n {
            for i in 0..m {
                c[j * m + i] = (0..k)
                    .map(|p| {
                        let bv = if row_major {
                            b[p * n + j]
                        } else {
                            b[j * k + p]
                        };
                        a[p * lda + i] * bv
                    })
                    .sum();
            }
        }
        c
    };
    for row_major in [false, true] {
        let mut d = Descriptor::new(m, n, k).lda(lda);
        if row_major {
            d = d.b_row_major();
        }
        for kern in kernels(&d) {
            let mut c = vec![f32::NAN; m * n];
            kern.execute(
                Batch::Stride {
                    a: &a,
                    b: &b,
                    count: 1,
                },
                &mut c,
                None,
            )
            .unwrap();
            assert_eq!(c, want(row_major), "{} row-major B {row_major}", kern.isa());
        }
    }
}
