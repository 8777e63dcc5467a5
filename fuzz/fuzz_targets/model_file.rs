//! The model-file reader: any bytes load as an MLP or are refused with an
//! error; what loads saves back to the same bytes.
#![no_main]

use brgemm_primitives::Mlp;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Mlp::from_bytes(data, 2) {
        let p = std::env::temp_dir().join(format!("brgemm-fuzz-{}.bin", std::process::id()));
        m.save(&p).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), data);
    }
});
