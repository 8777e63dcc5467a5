//! Deterministic benchmark data (the bench and tune examples include this
//! file by path): written values, never the zero page, small and signed.

/// `v[i] = ((i % m) - m/2) / div`.
pub fn fill(v: &mut [f32], m: usize, div: f32) {
    let half = (m / 2) as f32;
    for (i, x) in v.iter_mut().enumerate() {
        *x = ((i % m) as f32 - half) / div;
    }
}

/// Filled operands and scratch of an LSTM layer's forward and backward.
pub struct LstmData {
    pub x: brgemm_primitives::Blocked,
    pub w: brgemm_primitives::Blocked,
    pub r: brgemm_primitives::Blocked,
    pub bias: Vec<f32>,
    pub dh: brgemm_primitives::Blocked,
    pub st: brgemm_primitives::RnnState,
    pub gr: brgemm_primitives::RnnGrads,
}

impl LstmData {
    /// Operands of `rnn`, filled as every LSTM bench fills them.
    pub fn new(rnn: &brgemm_primitives::Rnn) -> LstmData {
        let mut d = LstmData {
            x: rnn.x_layout(),
            w: rnn.w_layout(),
            r: rnn.r_layout(),
            bias: vec![0.0; rnn.bias_len()],
            dh: rnn.h_layout(),
            st: rnn.state(),
            gr: rnn.grads(),
        };
        fill(d.x.data_mut(), 7, 8.0);
        fill(d.w.data_mut(), 5, 64.0);
        fill(d.r.data_mut(), 3, 64.0);
        fill(d.dh.data_mut(), 3, 4.0);
        d
    }
}
