//! The graph-file reader: any bytes load as the values of a small CNN
//! graph with batch norm (running statistics in the file) or of a stacked
//! bidirectional LSTM classifier, or are refused with an error that leaves
//! the graph's values as they were; what loads saves back to the same bytes.
#![no_main]

use brgemm_nn::models::{CnnSpec, SeqSpec, StageSpec};
use brgemm_nn::Graph;
use brgemm_primitives::CellKind;
use libfuzzer_sys::fuzz_target;
use std::sync::Mutex;

/// The graphs, built once.
static GRAPHS: Mutex<Vec<Graph>> = Mutex::new(Vec::new());

fn graphs() -> Vec<Graph> {
    let stage = |channels, batchnorm| StageSpec {
        channels,
        kernel: 3,
        batchnorm,
        pool: 2,
    };
    let cnn = CnnSpec {
        input: (1, 4, 4),
        stages: vec![stage(2, true), stage(3, false)],
        hidden: vec![],
        classes: 2,
        dropout: 0.0,
    };
    let seq = SeqSpec {
        kind: CellKind::Lstm,
        steps: 2,
        features: 2,
        hidden: 2,
        layers: 2,
        bidirectional: true,
        head: vec![],
        classes: 2,
    };
    vec![cnn.graph(2, 1).unwrap(), seq.graph(2, 1).unwrap()]
}

fuzz_target!(|data: &[u8]| {
    let mut all = GRAPHS.lock().unwrap();
    if all.is_empty() {
        *all = graphs();
    }
    for g in all.iter_mut() {
        let before = g.to_bytes();
        match g.from_bytes(data) {
            Ok(()) => assert_eq!(g.to_bytes(), data),
            Err(_) => assert_eq!(g.to_bytes(), before, "a refused file changed the values"),
        }
    }
});
