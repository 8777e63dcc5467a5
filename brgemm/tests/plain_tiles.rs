//! `BRGEMM_PIPELINE=0` plans the intrinsic tiles where pipelined assembly
//! ones exist (AVX-512, MV >= 2). One test in its own binary, so that
//! setting the variable races with nothing.

mod common;

use brgemm::{Isa, Kernel, KernelOptions, RegisterTile};
use common::{Case, Form};

#[test]
fn plain_and_pipelined_tiles_match_the_reference() {
    let isa = Isa::Avx512;
    if !isa.is_supported() {
        return;
    }
    for (mv, max_nr) in [(2, 14), (3, 9), (4, 6)] {
        for nr in 1..=max_nr {
            let t = RegisterTile { mv, nr };
            for (k, form, rm) in [(5, Form::Stride, false), (2, Form::Address, true)] {
                let case = Case::for_tile((mv * 32 + 3, nr * 2 + 1, k), form, (mv, nr), rm);
                let opts = KernelOptions {
                    isa: Some(isa),
                    tile: Some(t),
                    bf16: None,
                };
                std::env::set_var("BRGEMM_PIPELINE", "0");
                let plain = Kernel::with_options(&case.desc, opts).unwrap();
                std::env::remove_var("BRGEMM_PIPELINE");
                let pipe = Kernel::with_options(&case.desc, opts).unwrap();
                let got = case.run(&plain).unwrap();
                case.check(&got)
                    .unwrap_or_else(|e| panic!("plain {mv}x{nr} k={k}: {e}"));
                case.check(&case.run(&pipe).unwrap())
                    .unwrap_or_else(|e| panic!("pipelined {mv}x{nr} k={k}: {e}"));
            }
        }
    }
    // The default plan of a 64-block switches family with the variable.
    let d = brgemm::Descriptor::new(64, 64, 64);
    let opts = KernelOptions {
        isa: Some(Isa::Avx512),
        tile: None,
        bf16: None,
    };
    std::env::set_var("BRGEMM_PIPELINE", "0");
    let plain = Kernel::with_options(&d, opts).unwrap();
    std::env::remove_var("BRGEMM_PIPELINE");
    let pipe = Kernel::with_options(&d, opts).unwrap();
    assert_eq!(plain.register_tile(), Some(RegisterTile { mv: 2, nr: 14 }));
    assert_eq!(pipe.register_tile(), Some(RegisterTile { mv: 2, nr: 12 }));
}
