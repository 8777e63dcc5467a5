//! The model-file reader: any bytes load as an MLP, a CNN or a sequence
//! model, or are refused with an error; what loads saves back to the same
//! bytes.
#![no_main]

use brgemm_nn::models::{Cnn, Mlp, SeqClassifier};
use brgemm_nn::ModelFile;
use libfuzzer_sys::fuzz_target;

fn round_trip<M: ModelFile>(data: &[u8]) {
    if let Ok(m) = M::from_bytes(data, 2) {
        let p = std::env::temp_dir().join(format!("brgemm-fuzz-{}.bin", std::process::id()));
        m.save(&p).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), data);
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<Mlp>(data);
    round_trip::<Cnn>(data);
    round_trip::<SeqClassifier>(data);
});
