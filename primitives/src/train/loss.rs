//! Softmax cross-entropy on blocked logits.

use crate::error::{check_buf, shape, Result};
use crate::layout::Blocked;

/// Mean softmax cross-entropy over the first `labels.len()` rows of `logits`
/// (N x K, blocked), and its gradient `dlogits` = (softmax - onehot) / rows,
/// zero in the unused rows and in the padding
/// ([`softmax_cross_entropy_rows`] on the plain values).
pub fn softmax_cross_entropy(
    logits: &Blocked,
    labels: &[usize],
    dlogits: &mut Blocked,
) -> Result<f32> {
    if !dlogits.same_shape(logits) {
        return Err(shape(
            "dlogits",
            format!("{}x{}", dlogits.rows, dlogits.cols),
            "must match the logits",
        ));
    }
    let mut grad = vec![0.0; logits.rows * logits.cols];
    let loss = softmax_cross_entropy_rows(&logits.to_plain(), logits.cols, labels, &mut grad)?;
    dlogits.data.fill(0.0);
    dlogits.set_plain(&grad)?;
    Ok(loss)
}

/// Mean softmax cross-entropy over the first `labels.len()` rows of the
/// row-major `logits` (rows of `k` classes), and its gradient in `dlogits`
/// (the same layout): (softmax - onehot) / rows in those rows, zero in the
/// rows after them (a short minibatch's padding). The one implementation
/// the blocked version and the layer graph share.
pub fn softmax_cross_entropy_rows(
    logits: &[f32],
    k: usize,
    labels: &[usize],
    dlogits: &mut [f32],
) -> Result<f32> {
    if k == 0 || !logits.len().is_multiple_of(k) {
        return Err(shape(
            "classes",
            k,
            format!("must divide the {} logits", logits.len()),
        ));
    }
    check_buf("dlogits", dlogits.len(), logits.len())?;
    let n = logits.len() / k;
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
    let rows = labels.len();
    let mut loss = 0.0f64;
    for ((z, g), &l) in logits
        .chunks_exact(k)
        .zip(dlogits.chunks_exact_mut(k))
        .zip(labels)
    {
        let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f32 = z.iter().map(|&v| (v - max).exp()).sum();
        // log-softmax, not log(p): no clamp that would turn a NaN or an
        // underflowed probability into a finite-looking loss.
        loss += f64::from(sum.ln() + max - z[l]);
        for (g, &v) in g.iter_mut().zip(z) {
            *g = (v - max).exp() / sum / rows as f32;
        }
        g[l] -= 1.0 / rows as f32;
    }
    dlogits[rows * k..].fill(0.0);
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
