//! The IDX reader (Fashion-MNIST files): any bytes are parsed or refused
//! with an error, and what parses holds exactly the elements its dims say.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(a) = brgemm_dl::idx::parse_idx(data, "fuzz") {
        let n: usize = a.dims.iter().product();
        assert_eq!(a.data.len(), n);
    }
});
