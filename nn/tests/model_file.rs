//! Model files: every corruption the hostile-input review found is an error
//! on load, saving is atomic, and a bad save path is found before training.

use brgemm_nn::models::{CnnSpec, LayerSpec, Mlp, SeqClassifier, SeqSpec, StageSpec};
use brgemm_nn::Tensor;
use brgemm_nn::{modelfile, ModelFile};
use brgemm_primitives::init::Rng;
use brgemm_primitives::{Activation, CellKind, Optimizer, Pool};
use std::path::PathBuf;

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("brgemm-modelfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A small model and the bytes of its file (saved under `name`, so tests
/// running in parallel never share a file).
fn saved_as(name: &str) -> (Mlp, Vec<u8>) {
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
    let m = Mlp::new(7, 4, &specs, 11).unwrap();
    let p = tmp(name);
    m.save(&p).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    (m, bytes)
}

fn load_bytes(name: &str, bytes: &[u8]) -> Result<Mlp, String> {
    let p = tmp(&format!("{name}.{:?}", std::thread::current().id()).replace(' ', "_"));
    std::fs::write(&p, bytes).unwrap();
    Mlp::load(&p, 4).map_err(|e| e.to_string())
}

/// The error of loading `bytes` (a model must not load).
fn refused(name: &str, bytes: &[u8]) -> String {
    match load_bytes(name, bytes) {
        Ok(_) => panic!("{name}: a corrupt model loaded"),
        Err(e) => e,
    }
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
fn round_trip_is_exact() {
    let (m, bytes) = saved_as("model1.bin");
    let back = load_bytes("rt.bin", &bytes).unwrap_or_else(|e| panic!("{e}"));
    for i in 0..m.depth() {
        assert_eq!(back.parameters(i), m.parameters(i));
    }
    // The stored checksum is the standard CRC-32 of the body.
    let n = bytes.len() - 4;
    assert_eq!(crc32(&bytes[..n]).to_le_bytes(), bytes[n..]);
}

#[test]
fn trailing_bytes_are_refused() {
    let (_, mut bytes) = saved_as("model2.bin");
    bytes.push(0);
    let e = refused("trail.bin", &bytes);
    assert!(e.contains("not a valid model file"), "{e}");
}

#[test]
fn truncation_anywhere_is_refused() {
    let (_, bytes) = saved_as("model3.bin");
    for cut in [0, 3, 8, 12, 16, 30, bytes.len() / 2, bytes.len() - 1] {
        let e = refused("cut.bin", &bytes[..cut]);
        assert!(e.contains("not a valid model file"), "cut at {cut}: {e}");
    }
}

#[test]
fn every_flipped_byte_is_refused() {
    let (_, bytes) = saved_as("model4.bin");
    for at in 0..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0x10;
        refused(&format!("flip at byte {at}"), &b);
    }
}

#[test]
fn an_edited_width_is_refused_even_with_a_valid_checksum() {
    let (_, mut bytes) = saved_as("model5.bin");
    // Header: magic 8, version 4, kind 4, length 8, then inputs u64,
    // depth u64, layer 0's width u64 at offset 40.
    assert_eq!(u64::from_le_bytes(bytes[40..48].try_into().unwrap()), 5);
    bytes[40] = 6;
    reseal(&mut bytes);
    let e = refused("width.bin", &bytes);
    assert!(e.contains("shapes need"), "{e}");
}

#[test]
fn nan_weights_are_refused_even_with_a_valid_checksum() {
    let (_, mut bytes) = saved_as("model6.bin");
    let n = bytes.len();
    bytes[n - 8..n - 4].copy_from_slice(&f32::NAN.to_le_bytes());
    reseal(&mut bytes);
    let e = refused("nan.bin", &bytes);
    assert!(e.contains("NaN"), "{e}");
}

#[test]
fn another_kind_or_version_is_refused() {
    let (_, bytes) = saved_as("model7.bin");
    let mut k = bytes.clone();
    k[12..16].copy_from_slice(b"CNN\0");
    reseal(&mut k);
    let e = refused("kind.bin", &k);
    assert!(e.contains("CNN"), "{e}");
    let mut v = bytes.clone();
    v[8] = 9;
    reseal(&mut v);
    let e = refused("version.bin", &v);
    assert!(e.contains("version 9"), "{e}");
}

#[test]
fn saving_into_a_missing_directory_is_an_error_found_before_training() {
    let (m, _) = saved_as("model8.bin");
    let p = tmp("no-such-dir").join("model.bin");
    let e = modelfile::check_writable(&p).unwrap_err().to_string();
    assert!(e.contains("no-such-dir"), "{e}");
    assert!(m.save(&p).is_err());
    assert!(modelfile::check_writable(&tmp("ok.bin")).is_ok());
    assert!(!tmp("ok.bin").exists(), "the probe leaves no file behind");
}

#[test]
fn saving_replaces_atomically_and_leaves_no_temporary() {
    let (m, _) = saved_as("model9.bin");
    // A directory of its own: other tests' saves make temporaries too.
    let dir = tmp("atomic-dir");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("atomic.bin");
    std::fs::write(&p, b"old contents").unwrap();
    m.save(&p).unwrap();
    assert!(Mlp::load(&p, 4).is_ok());
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

/// Saves `m`, loads it back for minibatch `batch`, and checks that the
/// loaded model stores the same values and saves to the same bytes.
fn reload<M: ModelFile>(m: &M, name: &str, batch: usize) -> (M, Vec<u8>) {
    let p = tmp(name);
    m.save(&p).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let back = M::load(&p, batch).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(back.values(), m.values(), "{name}: values");
    let p2 = tmp(&format!("{name}.again"));
    back.save(&p2).unwrap();
    assert_eq!(std::fs::read(&p2).unwrap(), bytes, "{name}: bytes");
    (back, bytes)
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
fn a_bidirectional_lstm_classifier_round_trips_at_another_batch() {
    let spec = SeqSpec {
        kind: CellKind::Lstm,
        steps: 3,
        features: 5,
        hidden: 7,
        layers: 2,
        bidirectional: true,
        head: vec![4],
        classes: 3,
    };
    let pool = Pool::new(1).unwrap();
    let mut m = SeqClassifier::new(&spec, 2, 8).unwrap();
    assert_eq!(spec.parameter_count(), Some(m.values().len()));
    let (mut back, mut bytes) = reload(&m, "seq.bin", 5);
    assert_eq!(back.spec(), &spec);
    let plain = random(3 * 2 * 5, 4);
    let mut x = m.input_layout();
    m.set_input(&mut x, &plain).unwrap();
    let want = m.predict(&pool, &x, 2).unwrap();
    // The loaded model is planned for 5 rows; its first 2 give the same
    // answers.
    let mut plain5 = vec![0.0; 3 * 5 * 5];
    for t in 0..3 {
        plain5[t * 25..t * 25 + 10].copy_from_slice(&plain[t * 10..t * 10 + 10]);
    }
    let mut x5 = back.input_layout();
    back.set_input(&mut x5, &plain5).unwrap();
    assert_eq!(back.predict(&pool, &x5, 2).unwrap(), want);

    // The hidden width (file offset 24, header byte 1 + 2 * 8) edited and
    // resealed.
    assert_eq!(bytes[41], 7);
    bytes[41] = 6;
    reseal(&mut bytes);
    let e = SeqClassifier::from_bytes(&bytes, 2)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("shapes need"), "{e}");
}
