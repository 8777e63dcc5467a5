//! The model-file readers: any bytes load as an MLP or a sequence model
//! (the templates' files), or as the values of a small CNN layer graph (the
//! graph's file), or are refused with an error; what loads saves back to
//! the same bytes.
#![no_main]

use brgemm_nn::models::{CnnSpec, Mlp, SeqClassifier, StageSpec};
use brgemm_nn::{Graph, ModelFile};
use libfuzzer_sys::fuzz_target;
use std::sync::Mutex;

fn round_trip<M: ModelFile>(data: &[u8]) {
    if let Ok(m) = M::from_bytes(data, 2) {
        let p = std::env::temp_dir().join(format!("brgemm-fuzz-{}.bin", std::process::id()));
        m.save(&p).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), data);
    }
}

/// A CNN with batch norm (running statistics in the file): built once.
static CNN: Mutex<Option<Graph>> = Mutex::new(None);

fn graph_round_trip(data: &[u8]) {
    let mut g = CNN.lock().unwrap();
    let g = g.get_or_insert_with(|| {
        let stage = |channels, batchnorm| StageSpec {
            channels,
            kernel: 3,
            batchnorm,
            pool: 2,
        };
        CnnSpec {
            input: (1, 4, 4),
            stages: vec![stage(2, true), stage(3, false)],
            hidden: vec![],
            classes: 2,
            dropout: 0.0,
        }
        .graph(2, 1)
        .unwrap()
    });
    let before = g.to_bytes();
    match g.from_bytes(data) {
        Ok(()) => assert_eq!(g.to_bytes(), data),
        Err(_) => assert_eq!(g.to_bytes(), before, "a refused file changed the values"),
    }
}

fuzz_target!(|data: &[u8]| {
    round_trip::<Mlp>(data);
    graph_round_trip(data);
    round_trip::<SeqClassifier>(data);
});
