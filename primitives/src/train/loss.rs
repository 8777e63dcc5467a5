//! Softmax cross-entropy on blocked logits.

use crate::error::{check_buf, shape, Result};
use crate::layout::Blocked;

/// Mean softmax cross-entropy over the first `labels.len()` rows of `logits`
/// (N x K, blocked), and its gradient `dlogits` = (softmax - onehot) / rows,
/// zero in the unused rows and in the padding.
pub fn softmax_cross_entropy(
    logits: &Blocked,
    labels: &[usize],
    dlogits: &mut Blocked,
) -> Result<f32> {
    let (n, k) = (logits.rows, logits.cols);
    if !dlogits.same_shape(logits) {
        return Err(shape(
            "dlogits",
            format!("{}x{}", dlogits.rows, dlogits.cols),
            "must match the logits",
        ));
    }
    if labels.is_empty() || labels.len() > n {
        return Err(shape(
            "labels",
            labels.len(),
            format!("need 1..={n} labels"),
        ));
    }
    if let Some((i, &l)) = labels.iter().enumerate().find(|(_, &l)| l >= k) {
        return Err(shape(
            format!("labels[{i}]"),
            l,
            format!("must be below {k} classes"),
        ));
    }
    dlogits.data.fill(0.0);
    let rows = labels.len();
    let mut loss = 0.0f64;
    let mut p = vec![0.0f32; k];
    for (r, &label) in labels.iter().enumerate() {
        let mut mx = f32::NEG_INFINITY;
        for (j, pj) in p.iter_mut().enumerate() {
            *pj = logits.data[logits.index(r, j)];
            mx = mx.max(*pj);
        }
        let mut sum = 0.0f32;
        for pj in p.iter_mut() {
            *pj = (*pj - mx).exp();
            sum += *pj;
        }
        // log-softmax, not log(p): no clamp that would turn a NaN or an
        // underflowed probability into a finite-looking loss.
        loss -= (logits.data[logits.index(r, label)] - mx) as f64 - (sum as f64).ln();
        for (j, pj) in p.iter().enumerate() {
            let g = pj / sum - if j == label { 1.0 } else { 0.0 };
            let i = dlogits.index(r, j);
            dlogits.data[i] = g / rows as f32;
        }
    }
    Ok((loss / rows as f64) as f32)
}

/// Index of the largest logit of each of the first `rows` rows.
pub fn argmax_rows(logits: &Blocked, rows: usize) -> Result<Vec<usize>> {
    check_buf("rows", rows.min(logits.rows), rows)?;
    Ok((0..rows)
        .map(|r| {
            (0..logits.cols)
                .max_by(|&a, &b| {
                    logits.data[logits.index(r, a)].total_cmp(&logits.data[logits.index(r, b)])
                })
                .unwrap_or(0)
        })
        .collect())
}
