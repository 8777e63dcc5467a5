//! Softmax cross-entropy and the arg max on blocked logits against plain
//! f64 loops, on padded blocks, one row, one class, and a partial
//! minibatch; bad input gives errors that name the value.

use brgemm_primitives::layout::{Blocked, Inner};
use brgemm_primitives::loss::{argmax_rows, softmax_cross_entropy};

mod common;
use common::data_f64;

/// The mean loss and dL/dlogits of the first `labels.len()` rows, in f64.
fn reference(logits: &[f64], k: usize, labels: &[usize]) -> (f64, Vec<f64>) {
    let rows = labels.len() as f64;
    let mut grad = vec![0.0; logits.len()];
    let mut loss = 0.0;
    for (r, &l) in labels.iter().enumerate() {
        let z = &logits[r * k..][..k];
        let mx = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = z.iter().map(|v| (v - mx).exp()).sum();
        loss += sum.ln() - (z[l] - mx);
        for j in 0..k {
            let p = (z[j] - mx).exp() / sum;
            grad[r * k + j] = (p - f64::from(u8::from(j == l))) / rows;
        }
    }
    (loss / rows, grad)
}

#[test]
fn loss_gradient_and_arg_max_match_plain_loops() {
    // (rows, classes, row block, column block, labelled rows)
    for (n, k, br, bc, used) in [
        (13, 10, 4, 8, 13),
        (13, 10, 4, 8, 5),
        (1, 3, 1, 16, 1),
        (7, 1, 8, 8, 7),
        (32, 100, 16, 64, 32),
    ] {
        let plain = data_f64(n * k, (n * k) as u64, 8.0);
        let as_f32: Vec<f32> = plain.iter().map(|v| *v as f32).collect();
        let logits = Blocked::from_plain(&as_f32, n, k, br, bc, Inner::RowMajor).unwrap();
        let mut d = Blocked::zeros(n, k, br, bc, Inner::RowMajor).unwrap();
        d.data_mut().fill(f32::NAN);
        let labels: Vec<usize> = (0..used).map(|r| (r * 7 + 3) % k).collect();
        let loss = softmax_cross_entropy(&logits, &labels, &mut d).unwrap();
        let rounded: Vec<f64> = as_f32.iter().map(|v| f64::from(*v)).collect();
        let (want, grad) = reference(&rounded, k, &labels);
        let what = format!("{n}x{k} in {br}x{bc}, {used} rows");
        assert!(
            (f64::from(loss) - want).abs() < 1e-5 * (1.0 + want),
            "{what}: {loss} vs {want}"
        );
        let got = d.to_plain();
        for (i, (g, w)) in got.iter().zip(&grad).enumerate() {
            assert!(
                (f64::from(*g) - w).abs() < 1e-6,
                "{what}: dlogits[{i}] {g} vs {w}"
            );
        }
        // The padding (outside the n x k values) is zero, not left NaN.
        let nonzero = |v: &[f32]| v.iter().filter(|x| **x != 0.0).count();
        assert_eq!(nonzero(d.data()), nonzero(&got), "{what}: padding written");
        let top = argmax_rows(&logits, used).unwrap();
        for (r, t) in top.iter().enumerate() {
            let row = &rounded[r * k..][..k];
            let best = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(row[*t], best, "{what}: row {r}");
        }
    }
}

#[test]
fn bad_labels_and_rows_are_refused_by_name() {
    let logits = Blocked::zeros(4, 3, 4, 4, Inner::RowMajor).unwrap();
    let mut d = Blocked::zeros(4, 3, 4, 4, Inner::RowMajor).unwrap();
    let e = softmax_cross_entropy(&logits, &[0, 3], &mut d)
        .unwrap_err()
        .to_string();
    assert!(e.contains("labels[1]") && e.contains('3'), "{e}");
    let e = softmax_cross_entropy(&logits, &[], &mut d)
        .unwrap_err()
        .to_string();
    assert!(e.contains("labels"), "{e}");
    let e = softmax_cross_entropy(&logits, &[0; 5], &mut d)
        .unwrap_err()
        .to_string();
    assert!(e.contains('5'), "{e}");
    let mut other = Blocked::zeros(4, 5, 4, 4, Inner::RowMajor).unwrap();
    let e = softmax_cross_entropy(&logits, &[0], &mut other)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dlogits") && e.contains("4x5"), "{e}");
    let e = argmax_rows(&logits, 9).unwrap_err().to_string();
    assert!(e.contains("rows") && e.contains('9'), "{e}");
}
