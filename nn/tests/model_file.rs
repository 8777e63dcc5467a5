//! Graph files: every corruption the hostile-input review found is an error
//! on load that leaves the graph as it was, saving is atomic, a bad save
//! path is found before training, and trained models round-trip exactly
//! (the CNN with its batch-norm statistics, the stacked bidirectional LSTM
//! at another batch size).

use brgemm_nn::models::{mlp, CnnSpec, LayerSpec, SeqSpec, StageSpec};
use brgemm_nn::{file, Graph, Tensor, FILE_VERSION};
use brgemm_primitives::init::Rng;
use brgemm_primitives::{Activation, CellKind, Optimizer, Pool};
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("brgemm-graphfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A small MLP graph (seed `seed`).
fn model(seed: u64) -> Graph {
    let specs = [
        LayerSpec {
            out: 5,
            act: Activation::Relu,
        },
        LayerSpec {
            out: 3,
            act: Activation::Identity,
        },
    ];
    mlp(7, 4, &specs, seed).unwrap()
}

/// The error of loading `bytes` into a fresh model, which must refuse them
/// and keep its own values.
fn refused(what: &str, bytes: &[u8]) -> String {
    let mut g = model(99);
    let before = g.to_bytes();
    let e = match g.from_bytes(bytes) {
        Ok(()) => panic!("{what}: a corrupt file loaded"),
        Err(e) => e.to_string(),
    };
    assert_eq!(
        g.to_bytes(),
        before,
        "{what}: a refused file changed values"
    );
    e
}

/// Rewrites the trailing CRC so that only the deliberate edit is wrong.
fn reseal(bytes: &mut [u8]) {
    let n = bytes.len() - 4;
    let crc = crc32(&bytes[..n]);
    bytes[n..].copy_from_slice(&crc.to_le_bytes());
}

/// CRC-32 (IEEE), bit by bit: an independent oracle for the format's.
fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[test]
fn round_trip_is_exact_and_sealed_by_the_standard_crc() {
    let m = model(11);
    let bytes = m.to_bytes();
    let mut back = model(12);
    assert_ne!(back.to_bytes(), bytes);
    back.from_bytes(&bytes).unwrap();
    assert_eq!(back.to_bytes(), bytes);
    let n = bytes.len() - 4;
    assert_eq!(crc32(&bytes[..n]).to_le_bytes(), bytes[n..]);
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = model(1).to_bytes();
    // Before the checksum, resealed: the parser sees them.
    let n = bytes.len() - 4;
    bytes.insert(n, 0);
    reseal(&mut bytes);
    let e = refused("trailing", &bytes);
    assert!(e.contains("after the last layer"), "{e}");
}

#[test]
fn truncation_anywhere_is_refused() {
    let bytes = model(1).to_bytes();
    for cut in [0, 3, 10, 14, 16, 30, bytes.len() / 2, bytes.len() - 1] {
        refused(&format!("cut at {cut}"), &bytes[..cut]);
    }
}

#[test]
fn every_flipped_byte_is_refused() {
    let bytes = model(1).to_bytes();
    for at in 0..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0x10;
        refused(&format!("flip at byte {at}"), &b);
    }
}

#[test]
fn another_shape_is_refused_even_with_a_valid_checksum() {
    let mut bytes = model(1).to_bytes();
    // Magic 10, version 4, then the input's channels (u64) at offset 14.
    assert_eq!(u64::from_le_bytes(bytes[14..22].try_into().unwrap()), 7);
    bytes[14] = 8;
    reseal(&mut bytes);
    let e = refused("channels", &bytes);
    assert!(e.contains("(c, h, w) = [8, 1, 1]"), "{e}");
}

#[test]
fn nan_weights_are_refused_even_with_a_valid_checksum() {
    let mut bytes = model(1).to_bytes();
    let n = bytes.len();
    // The last value (the output layer's last bias) before the checksum.
    bytes[n - 8..n - 4].copy_from_slice(&f32::NAN.to_le_bytes());
    reseal(&mut bytes);
    let e = refused("nan", &bytes);
    assert!(e.contains("bias[2] is NaN"), "{e}");
}

#[test]
fn another_version_or_no_magic_is_refused() {
    let bytes = model(1).to_bytes();
    let mut v = bytes.clone();
    v[10..14].copy_from_slice(&9u32.to_le_bytes());
    reseal(&mut v);
    let e = refused("version", &v);
    assert!(
        e.contains("version 9") && e.contains(&format!("version {FILE_VERSION}")),
        "{e}"
    );
    let e = refused("magic", b"PK\x03\x04 not ours");
    assert!(e.contains("no magic"), "{e}");
}

#[test]
fn saving_into_a_missing_directory_is_an_error_found_before_training() {
    let m = model(1);
    let p = tmp("no-such-dir").join("model.bin");
    let e = file::check_writable(&p).unwrap_err().to_string();
    assert!(e.contains("no-such-dir"), "{e}");
    assert!(m.save(&p).is_err());
    assert!(file::check_writable(&tmp("ok.bin")).is_ok());
    assert!(!tmp("ok.bin").exists(), "the probe leaves no file behind");
}

#[test]
fn saving_replaces_atomically_and_leaves_no_temporary() {
    let m = model(1);
    // A directory of its own: other tests' saves make temporaries too.
    let dir = tmp("atomic-dir");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("atomic.bin");
    std::fs::write(&p, b"old contents").unwrap();
    m.save(&p).unwrap();
    let mut back = model(2);
    back.load(&p).unwrap();
    assert_eq!(back.to_bytes(), m.to_bytes());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.normal()).collect()
}
#[test]
fn a_trained_cnn_round_trips_with_its_batch_norm_statistics() {
    let spec = CnnSpec {
        input: (3, 9, 9),
        stages: vec![
            StageSpec {
                channels: 5,
                kernel: 3,
                batchnorm: true,
                pool: 2,
            },
            StageSpec {
                channels: 6,
                kernel: 1,
                batchnorm: false,
                pool: 1,
            },
        ],
        hidden: vec![7],
        classes: 3,
        dropout: 0.25,
    };
    let pool = Pool::new(1).unwrap();
    let mut m = spec.graph(4, 3).unwrap();
    let x = Tensor::from_vec(m.input_shape(), random(4 * 3 * 81, 9)).unwrap();
    // One step moves the weights and the running moments off their
    // initial values, so the file has to carry them.
    m.train_step(&pool, &x, &[0, 1, 2, 1], &Optimizer::adam(0.01))
        .unwrap();
    let p = tmp("cnn.bin");
    m.save(&p).unwrap();
    // Another seed and another minibatch: the file's values replace the
    // seeded ones, and the running statistics come with them.
    let mut back = spec.graph(2, 77).unwrap();
    back.load(&p).unwrap();
    assert_eq!(back.to_bytes(), m.to_bytes());
    let x2 = Tensor::from_vec(back.input_shape(), x.data()[..2 * 3 * 81].to_vec()).unwrap();
    assert_eq!(
        back.predict(&pool, &x2).unwrap(),
        m.predict(&pool, &x).unwrap()[..2]
    );
    // A CNN of another shape refuses the file, naming the layer.
    let mut other = spec.clone();
    other.stages[0].channels = 4;
    let e = other
        .graph(4, 3)
        .unwrap()
        .load(&p)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("conv"), "{e}");
}

#[test]
fn a_stacked_bidirectional_lstm_round_trips_at_another_batch() {
    let spec = SeqSpec {
        kind: CellKind::Lstm,
        steps: 5,
        features: 3,
        hidden: 4,
        layers: 2,
        bidirectional: true,
        head: vec![6],
        classes: 3,
    };
    let pool = Pool::new(1).unwrap();
    let mut m = spec.graph(3, 8).unwrap();
    let x = Tensor::from_vec(m.input_shape(), random(3 * 3 * 5, 4)).unwrap();
    m.train_step(&pool, &x, &[0, 2, 1], &Optimizer::adam(0.01))
        .unwrap();
    let names = m.layer_names();
    assert_eq!(names[0], "bilstm 3->4");
    assert_eq!(names[1], "bilstm 8->4");
    let p = tmp("bilstm.bin");
    m.save(&p).unwrap();
    let mut back = spec.graph(2, 1).unwrap();
    back.load(&p).unwrap();
    assert_eq!(back.to_bytes(), m.to_bytes());
    let x2 = Tensor::from_vec(back.input_shape(), x.data()[..2 * 3 * 5].to_vec()).unwrap();
    let (a, b) = (
        back.forward(&pool, &x2, brgemm_nn::Mode::Eval)
            .unwrap()
            .data()
            .to_vec(),
        m.forward(&pool, &x, brgemm_nn::Mode::Eval)
            .unwrap()
            .data()
            .to_vec(),
    );
    assert_eq!(a, b[..a.len()]);
    // A one-directional classifier refuses it by layer name.
    let mut uni = spec.clone();
    uni.bidirectional = false;
    let e = uni.graph(3, 8).unwrap().load(&p).err().unwrap().to_string();
    assert!(e.contains("bilstm 3->4") && e.contains("lstm 3->4"), "{e}");
}

/// A checkpoint's optimizer state: read out in the layers' export layouts,
/// set into a graph of another minibatch and read back the same; a graph
/// given the values and optimizer state of another after k steps trains on
/// exactly as that one does.
#[test]
fn optimizer_state_moves_between_graphs_and_training_goes_on_identically() {
    let stage = |channels, batchnorm| StageSpec {
        channels,
        kernel: 3,
        batchnorm,
        pool: 2,
    };
    let spec = CnnSpec {
        input: (2, 8, 8),
        stages: vec![stage(5, true), stage(6, false)],
        hidden: vec![7],
        classes: 3,
        dropout: 0.0,
    };
    let pool = Pool::new(2).unwrap();
    let opt = Optimizer::adam(0.01);
    let mut a = spec.graph(4, 1).unwrap();
    let x = Tensor::from_vec(a.input_shape(), random(4 * 2 * 64, 5)).unwrap();
    let labels = [0, 1, 2, 1];
    // Before any step: counts 0, no moments.
    assert!(a
        .optimizer_state()
        .unwrap()
        .iter()
        .all(|(t, m, v)| *t == 0 && m.is_empty() && v.is_empty()));
    for _ in 0..3 {
        a.train_step(&pool, &x, &labels, &opt).unwrap();
    }
    let (values, state) = (a.to_bytes(), a.optimizer_state().unwrap());
    assert!(state.iter().all(|(t, m, _)| *t == 3 && !m.is_empty()));

    // Another minibatch (other layouts of the activations): the same state.
    let mut other = spec.graph(2, 9).unwrap();
    other.set_optimizer_state(&state).unwrap();
    assert_eq!(other.optimizer_state().unwrap(), state);

    // Same minibatch: values and state moved over, then three more steps
    // each, bit for bit the same.
    let mut b = spec.graph(4, 2).unwrap();
    b.from_bytes(&values).unwrap();
    b.set_optimizer_state(&state).unwrap();
    for _ in 0..3 {
        let la = a.train_step(&pool, &x, &labels, &opt).unwrap();
        let lb = b.train_step(&pool, &x, &labels, &opt).unwrap();
        assert_eq!(la, lb);
    }
    assert_eq!(a.to_bytes(), b.to_bytes());

    // A state of another graph is refused and changes nothing.
    let mut small = mlp(
        7,
        4,
        &[LayerSpec {
            out: 3,
            act: Activation::Identity,
        }],
        1,
    )
    .unwrap();
    let before = small.to_bytes();
    assert!(small.set_optimizer_state(&state).is_err());
    assert_eq!(small.to_bytes(), before);
}
