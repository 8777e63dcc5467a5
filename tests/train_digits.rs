//! End to end: a short training run on the embedded digits reaches 90% test
//! accuracy, and the data loader refuses malformed input.

use brgemm_dl::{data, train};
use brgemm_primitives::Pool;

#[test]
fn short_run_reaches_90_percent() {
    let all = data::digits().unwrap();
    assert_eq!((all.len(), all.features, all.classes), (1797, 64, 10));
    let (tr, te) = all.split(0.2, 42);
    assert_eq!((tr.len(), te.len()), (1438, 359));
    let cfg = train::TrainConfig {
        epochs: 8,
        ..Default::default()
    };
    let pool = Pool::new(2).unwrap();
    let mut acc = 0.0;
    train::train(&cfg, &pool, &tr, &te, |r| acc = r.test_accuracy).unwrap();
    assert!(acc >= 0.90, "test accuracy {acc}");
}

#[test]
fn malformed_csv_is_refused_with_its_line() {
    let e = data::parse_csv("1,2,3\n1,2\n", "t.csv", 2, 1.0, 10)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("t.csv line 2") && e.contains("expected 3 fields"),
        "{e}"
    );
    let e = data::parse_csv("1,2,11\n", "t.csv", 2, 1.0, 10)
        .unwrap_err()
        .to_string();
    assert!(e.contains("label 11"), "{e}");
}

#[test]
fn mixed_precision_training_is_within_one_point_of_f32() {
    let (tr, te) = data::digits().unwrap().split(0.2, 42);
    let pool = Pool::new(2).unwrap();
    let mut acc = [0.0; 2];
    for (i, bf16) in [false, true].into_iter().enumerate() {
        let cfg = train::TrainConfig {
            epochs: 12,
            bf16,
            ..Default::default()
        };
        train::train(&cfg, &pool, &tr, &te, |r| acc[i] = r.test_accuracy).unwrap();
    }
    assert!(acc[1] >= acc[0] - 0.01, "f32 {} vs bf16 {}", acc[0], acc[1]);
}
