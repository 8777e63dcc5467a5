//! The RNN's layouts (input, state, weight and gradient buffers sized for
//! its plan), what forward keeps and backward returns ([`RnnState`],
//! [`RnnGrads`]), and the conversions from and to plain layouts.

use crate::error::{check_buf, shape, Result};
use crate::layout::{Blocked, Inner};

use super::{CellKind, Rnn};

/// What forward keeps for backward, and the outputs.
#[derive(Debug, Clone)]
pub struct RnnState {
    /// h_1 .. h_T (`T*Np x K`).
    pub(crate) h: Blocked,
    /// h_0 .. h_(T-1) (`T*Np x K`), the recurrent operand of each step.
    pub(crate) h_prev: Blocked,
    /// c_0 .. c_T (`(T+1)*Np x K`; LSTM only, else empty).
    pub(crate) c: Blocked,
    /// Activated gates of every step (`T*Np x g*Kp`).
    pub(crate) gates: Blocked,
}

/// Gradients of a backward pass.
#[derive(Debug, Clone)]
pub struct RnnGrads {
    /// dL/dX (`T*Np x C`).
    pub(crate) dx: Blocked,
    /// dL/dW (layout of W).
    pub(crate) dw: Blocked,
    /// dL/dR (layout of R).
    pub(crate) dr: Blocked,
    /// dL/db (length `g*Kp`).
    pub(crate) db: Vec<f32>,
    /// dL/dh_0 (`Np x K`).
    pub(crate) dh0: Blocked,
    /// dL/dc_0 (`Np x K`; LSTM only).
    pub(crate) dc0: Blocked,
    /// Scratch: dL/dG (`T*Np x g*Kp`).
    pub(crate) dg: Blocked,
    /// Scratch: dL/dh of the step being processed, accumulated (`T*Np x K`).
    pub(crate) dh: Blocked,
    /// Scratch: R transposed (`K x g*Kp` blocked as FC `wt`).
    pub(crate) rt: Blocked,
    /// Scratch: W transposed, for dX.
    pub(crate) wt: Blocked,
    /// Scratch: the recurrent FC's (duplicate) bias gradient.
    pub(crate) db_r: Vec<f32>,
}

impl RnnState {
    /// h_1 .. h_T (`T*Np x K`).
    pub fn h(&self) -> &Blocked {
        &self.h
    }
    /// h_0 .. h_(T-1) (`T*Np x K`), the recurrent operand of each step.
    pub fn h_prev(&self) -> &Blocked {
        &self.h_prev
    }
    /// c_0 .. c_T (`(T+1)*Np x K`; LSTM only, else empty).
    pub fn c(&self) -> &Blocked {
        &self.c
    }
    /// Activated gates of every step (`T*Np x g*Kp`).
    pub fn gates(&self) -> &Blocked {
        &self.gates
    }
}

impl RnnGrads {
    /// dL/dX (`T*Np x C`).
    pub fn dx(&self) -> &Blocked {
        &self.dx
    }
    /// dL/dW (layout of W).
    pub fn dw(&self) -> &Blocked {
        &self.dw
    }
    /// dL/dR (layout of R).
    pub fn dr(&self) -> &Blocked {
        &self.dr
    }
    /// dL/db (length `g*Kp`).
    pub fn db(&self) -> &[f32] {
        &self.db
    }
    /// dL/dh_0 (`Np x K`).
    pub fn dh0(&self) -> &Blocked {
        &self.dh0
    }
    /// dL/dc_0 (`Np x K`; LSTM only).
    pub fn dc0(&self) -> &Blocked {
        &self.dc0
    }
    /// dL/dW, dL/dR and dL/db together, writable (an optimizer holding
    /// them next to the weights).
    pub fn weights_mut(&mut self) -> (&mut Blocked, &mut Blocked, &mut [f32]) {
        (&mut self.dw, &mut self.dr, &mut self.db)
    }
}

impl Rnn {
    fn seq(&self, cols: usize, bc: usize) -> Blocked {
        Blocked::zeros(
            self.t * self.padded_n(),
            cols,
            self.tuning.bn,
            bc,
            Inner::RowMajor,
        )
        .unwrap()
    }
    /// A zero input sequence (`T*Np x C`).
    pub fn x_layout(&self) -> Blocked {
        self.seq(self.c, self.tuning.bc)
    }
    /// A zero hidden sequence (`T*Np x K`), also the output gradient.
    pub fn h_layout(&self) -> Blocked {
        self.seq(self.k, self.tuning.bk)
    }
    /// A zero state (`Np x K`): h_0, c_0 and their gradients.
    pub fn state_layout(&self) -> Blocked {
        Blocked::zeros(
            self.padded_n(),
            self.k,
            self.tuning.bn,
            self.tuning.bk,
            Inner::RowMajor,
        )
        .unwrap()
    }
    /// Zero input weights W (`g*Kp x C`, gates stacked).
    pub fn w_layout(&self) -> Blocked {
        self.input.w_layout()
    }
    /// Zero recurrent weights R (`g*Kp x K`, gates stacked).
    pub fn r_layout(&self) -> Blocked {
        self.recur.w_layout()
    }
    /// Writes the plain `[T][N][cols]` sequence `plain` into `seq` (a
    /// buffer of [`Rnn::x_layout`] or [`Rnn::h_layout`]).
    pub fn set_sequence(&self, seq: &mut Blocked, plain: &[f32]) -> Result<()> {
        let cols = seq.cols;
        check_buf("plain sequence", plain.len(), self.t * self.n * cols)?;
        let np = self.padded_n();
        for (r, row) in plain.chunks_exact(cols).enumerate() {
            let (t, n) = (r / self.n, r % self.n);
            seq.put_row(t * np + n, row);
        }
        Ok(())
    }
    /// The plain `[T][N][cols]` sequence of `seq` (a buffer of
    /// [`Rnn::x_layout`] or [`Rnn::h_layout`] shape: `T*Np` rows). Another
    /// buffer (the cell states `c_0..c_T` of [`RnnState::c`] have `T+1`
    /// steps) is an error naming its rows, not a silent misreading.
    pub fn sequence(&self, seq: &Blocked) -> Result<Vec<f32>> {
        let (np, cols) = (self.padded_n(), seq.cols);
        if seq.rows != self.t * np {
            return Err(shape(
                "sequence rows",
                seq.rows,
                format!(
                    "a sequence of {} steps has T*Np = {} rows",
                    self.t,
                    self.t * np
                ),
            ));
        }
        let mut out = vec![0.0; self.t * self.n * cols];
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            let (t, n) = (r / self.n, r % self.n);
            seq.get_row(t * np + n, row);
        }
        Ok(out)
    }
    /// Sets gate `gate`'s block of a stacked weight matrix (W or R) from a
    /// plain row-major `[K][cols]` matrix.
    pub fn set_gate_weights(&self, w: &mut Blocked, gate: usize, plain: &[f32]) -> Result<()> {
        if gate >= self.kind.gates() {
            return Err(shape(
                "gate",
                gate,
                format!("a {:?} cell has {} gates", self.kind, self.kind.gates()),
            ));
        }
        check_buf("plain gate weights", plain.len(), self.k * w.cols)?;
        let kp = self.padded_k();
        for r in 0..self.k {
            for c in 0..w.cols {
                let i = w.index(gate * kp + r, c);
                w.data[i] = plain[r * w.cols + c];
            }
        }
        Ok(())
    }
    /// Gate `gate`'s block of a stacked weight matrix as plain `[K][cols]`.
    pub fn gate_weights(&self, w: &Blocked, gate: usize) -> Vec<f32> {
        let kp = self.padded_k();
        let mut out = vec![0.0; self.k * w.cols];
        for r in 0..self.k {
            for c in 0..w.cols {
                out[r * w.cols + c] = w.data[w.index(gate * kp + r, c)];
            }
        }
        out
    }

    /// Buffers for [`Rnn::forward`].
    pub fn state(&self) -> RnnState {
        RnnState {
            h: self.h_layout(),
            h_prev: self.h_layout(),
            c: match self.kind {
                CellKind::Lstm => Blocked::zeros(
                    (self.t + 1) * self.padded_n(),
                    self.k,
                    self.tuning.bn,
                    self.tuning.bk,
                    Inner::RowMajor,
                )
                .unwrap(),
                CellKind::Rnn => Blocked::zeros(1, 1, 1, 1, Inner::RowMajor).unwrap(),
            },
            gates: self.input.y_layout(),
        }
    }

    /// Buffers for [`Rnn::backward`].
    pub fn grads(&self) -> RnnGrads {
        RnnGrads {
            dx: self.x_layout(),
            dw: self.w_layout(),
            dr: self.r_layout(),
            db: vec![0.0; self.bias_len()],
            dh0: self.state_layout(),
            dc0: self.state_layout(),
            dg: self.input.y_layout(),
            dh: self.h_layout(),
            rt: self.recur.wt_layout(),
            wt: self.input.wt_layout(),
            db_r: vec![0.0; self.bias_len()],
        }
    }
}
