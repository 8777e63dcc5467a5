//! Every kernel against the f64 reference: proptest over awkward shapes,
//! all batch forms, beta 0/1, alpha != 1, padded leading dimensions and every
//! epilogue, for every ISA this machine supports.

mod common;

use brgemm::{Activation, Beta, Epilogue, Isa, Kernel, KernelOptions, Prefetch, RegisterTile};
use common::{Case, Form};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::collections::BTreeSet;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(96)
}

fn shape() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    // Dimensions biased towards edges: 1, primes, lanes +- 1, up to 96.
    let dim = prop_oneof![
        Just(1usize),
        Just(7),
        Just(15),
        Just(16),
        Just(17),
        Just(31),
        Just(33),
        Just(64),
        Just(96),
        1usize..=96
    ];
    (dim.clone(), dim.clone(), dim, 0usize..=20)
}

fn epilogue() -> impl Strategy<Value = Epilogue> {
    let act = prop_oneof![
        3 => Just(Activation::Identity),
        2 => Just(Activation::Relu),
        1 => Just(Activation::Sigmoid),
        1 => Just(Activation::Tanh),
        1 => Just(Activation::Gelu),
    ];
    (any::<bool>(), act).prop_map(|(bias, activation)| Epilogue { bias, activation })
}

fn form() -> impl Strategy<Value = Form> {
    prop_oneof![Just(Form::Stride), Just(Form::Offset), Just(Form::Address)]
}

fn run_isa(isa: Isa) {
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        ..Config::default()
    });
    let strat = (
        shape(),
        form(),
        prop_oneof![Just(Beta::Zero), Just(Beta::One)],
        prop_oneof![Just(1.0f32), Just(-0.5), Just(2.5)],
        (0usize..=5, 0usize..=5, 0usize..=5),
        epilogue(),
        (any::<u64>(), any::<bool>(), any::<bool>()),
    );
    runner
        .run(
            &strat,
            |((m, n, k, count), form, beta, alpha, pad, ep, (seed, pf, rm))| {
                let mut case =
                    Case::with_b_layout((m, n, k), count, form, beta, alpha, pad, ep, seed, rm);
                if pf {
                    case.desc = case.desc.prefetch(Prefetch::NextPair);
                }
                let kern = Kernel::with_options(
                    &case.desc,
                    KernelOptions {
                        isa: Some(isa),
                        tile: None,
                        bf16: None,
                    },
                )
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(kern.isa(), isa);
                let got = case
                    .run(&kern)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                case.check(&got).map_err(TestCaseError::fail)?;
                Ok(())
            },
        )
        .unwrap_or_else(|e| panic!("ISA {isa}: {e}"));
}

/// Runs the sweep on every supported ISA and fails if any supported ISA was
/// not exercised, or if an ISA the environment requires is missing
/// (`BRGEMM_REQUIRE_ISAS`, set by `scripts/test.sh` from /proc/cpuinfo, so a
/// broken detection cannot silently skip the tuned kernels).
#[test]
fn every_supported_isa_matches_f64_reference() {
    let mut exercised = BTreeSet::new();
    for isa in Isa::ALL {
        if !isa.is_supported() {
            println!("ISA {isa}: not supported on this machine, not run");
            continue;
        }
        run_isa(isa);
        println!("ISA {isa}: {} cases passed", cases());
        exercised.insert(isa);
    }
    let supported: BTreeSet<Isa> = Isa::supported().into_iter().collect();
    assert_eq!(exercised, supported, "a supported ISA was never exercised");
    if let Ok(req) = std::env::var("BRGEMM_REQUIRE_ISAS") {
        for name in req.split(',').filter(|s| !s.trim().is_empty()) {
            let isa = Isa::parse(name).expect("BRGEMM_REQUIRE_ISAS names a known ISA");
            assert!(
                exercised.contains(&isa),
                "required ISA {isa} was not exercised"
            );
        }
    }
}

/// Every register tile of the grid, forced, on shapes that need every edge
/// tile (m and n tails), so no instantiated microkernel goes untested.
#[test]
fn every_register_tile_is_correct() {
    for isa in Isa::supported() {
        if isa == Isa::Reference {
            continue;
        }
        let lanes = isa.f32_lanes();
        let mut tested = 0;
        for mv in 1..=4 {
            for nr in 1..=16 {
                let t = RegisterTile { mv, nr };
                let (m, n) = (mv * lanes * 2 + 3, nr * 2 + 1);
                // k = 1, 2, 5: the pipelined tiles peel the last k step and
                // unroll by two, so both parities and the no-loop case count.
                for (k, form, pf, rm) in [
                    (5, Form::Stride, Prefetch::None, false),
                    (1, Form::Stride, Prefetch::None, false),
                    (2, Form::Offset, Prefetch::None, true),
                    (4, Form::Address, Prefetch::None, true),
                ]
                .into_iter()
                .chain(
                    [
                        (Form::Offset, Prefetch::None, false),
                        (Form::Address, Prefetch::None, false),
                        (Form::Stride, Prefetch::NextPair, false),
                        (Form::Offset, Prefetch::None, true),
                    ]
                    .map(|(f, p, r)| (5, f, p, r)),
                ) {
                    let mut case = Case::for_tile((m, n, k), form, (mv, nr), rm);
                    case.desc = case.desc.prefetch(pf);
                    let Ok(kern) = Kernel::with_options(
                        &case.desc,
                        KernelOptions {
                            isa: Some(isa),
                            tile: Some(t),
                            bf16: None,
                        },
                    ) else {
                        continue; // not in this ISA's grid
                    };
                    assert_eq!(kern.register_tile(), Some(t));
                    let got = case.run(&kern).unwrap();
                    case.check(&got)
                        .unwrap_or_else(|e| panic!("{isa} tile {mv}x{nr}: {e}"));
                    tested += 1;
                }
            }
        }
        // The smallest grid (portable) has 9 tiles, each run 8 times.
        assert!(
            tested >= 8 * 9,
            "{isa}: only {tested} tile variants exercised"
        );
    }
}

/// Zero batch: C = beta*C, then the epilogue; with beta = 0 C is never read.
#[test]
fn zero_batch_applies_beta_and_epilogue_only() {
    for isa in Isa::supported() {
        for beta in [Beta::Zero, Beta::One] {
            let ep = Epilogue {
                bias: true,
                activation: Activation::Identity,
            };
            let case = Case::new(19, 5, 3, 0, Form::Stride, beta, 2.0, (0, 0, 1), ep, 7);
            let kern = Kernel::with_options(
                &case.desc,
                KernelOptions {
                    isa: Some(isa),
                    tile: None,
                    bf16: None,
                },
            )
            .unwrap();
            let got = case.run(&kern).unwrap();
            case.check(&got).unwrap();
        }
    }
}

/// A prefetch region for the next call changes no result bit, whatever its
/// length (none, less than the k steps can carry, far more) or address (a
/// real buffer, or one never mapped: prefetches do not fault); nor does the
/// next call's first B ([`Kernel::execute_raw_then`]), on the blocking
/// model's tiles and the 4x4 whole-column tile.
#[test]
fn prefetching_ahead_changes_no_result() {
    use brgemm::{BatchForm, Descriptor, RawBatch};
    let (m, n, k, count) = (67, 45, 19, 5);
    let a: Vec<f32> = (0..m * k * count)
        .map(|i| ((i * 7) % 13) as f32 - 6.0)
        .collect();
    let b: Vec<f32> = (0..k * n * count)
        .map(|i| ((i * 5) % 11) as f32 - 5.0)
        .collect();
    let next = vec![1.0f32; 1 << 16];
    let tiles = [None, Some(brgemm::RegisterTile { mv: 4, nr: 4 })];
    for (isa, tile) in Isa::supported()
        .into_iter()
        .flat_map(|i| tiles.map(|t| (i, t)))
    {
        for pf in [Prefetch::None, Prefetch::NextPair] {
            let d = Descriptor::new(m, n, k)
                .batch_form(BatchForm::Stride { a: m * k, b: k * n })
                .prefetch(pf);
            let opts = KernelOptions {
                isa: Some(isa),
                tile,
                bf16: None,
            };
            // Not every ISA has the 4x4 tile.
            let Ok(kern) = Kernel::with_options(&d, opts) else {
                assert!(tile.is_some(), "{isa}: the model's tile plans");
                continue;
            };
            let batch = || RawBatch::Stride {
                a: a.as_ptr(),
                b: b.as_ptr(),
                count,
            };
            let mut want = vec![0.0f32; m * n];
            // SAFETY: A holds `count` m x k blocks, B `count` k x n blocks,
            // C one m x n block; no bias in the descriptor.
            unsafe { kern.execute_raw(batch(), want.as_mut_ptr(), std::ptr::null()) };
            for (ahead, len) in [
                (next.as_ptr(), 0),
                (next.as_ptr(), 100),
                (next.as_ptr(), next.len()),
                (64usize as *const f32, 1 << 20),
            ] {
                let mut got = vec![0.0f32; m * n];
                // SAFETY: as above; `ahead` is only prefetched.
                unsafe {
                    kern.execute_raw_ahead(batch(), got.as_mut_ptr(), std::ptr::null(), ahead, len)
                };
                assert_eq!(got, want, "{isa} {tile:?} {pf:?} ahead {len}");
            }
            for next_b in [next.as_ptr(), b.as_ptr(), 64usize as *const f32] {
                let mut got = vec![0.0f32; m * n];
                // SAFETY: as above; `next_b` is only prefetched.
                unsafe {
                    kern.execute_raw_then(batch(), got.as_mut_ptr(), std::ptr::null(), next_b)
                };
                assert_eq!(got, want, "{isa} {tile:?} {pf:?} next B {next_b:?}");
            }
        }
    }
}
