//! The tuning-file reader and the plan it feeds: any text is parsed or
//! refused, and any tuning it yields is planned into an FC layer or refused,
//! never a panic.
#![no_main]

use brgemm_primitives::tuning::parse;
use brgemm_primitives::{Activation, Fc};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for (n, c, k) in [(8, 8, 8), (3, 5, 7), (64, 64, 64)] {
        if let Ok(Some(t)) = parse(text, n, c, k) {
            // Refuse tunings that would plan enormous buffers: they are
            // errors or allocations, not parser bugs.
            if t.bn.max(t.bc).max(t.bk) > 4096 {
                continue;
            }
            let _ = Fc::with_tuning(n, c, k, Activation::Relu, t);
        }
    }
});
