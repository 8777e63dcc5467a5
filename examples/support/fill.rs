//! Deterministic benchmark data (the bench and tune examples include this
//! file by path): written values, never the zero page, small and signed.

/// `v[i] = ((i % m) - m/2) / div`.
pub fn fill(v: &mut [f32], m: usize, div: f32) {
    let half = (m / 2) as f32;
    for (i, x) in v.iter_mut().enumerate() {
        *x = ((i % m) as f32 - half) / div;
    }
}
