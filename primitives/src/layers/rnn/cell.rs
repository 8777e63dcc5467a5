//! The element-wise part of a recurrent step: gate non-linearities and the
//! cell update (forward), the gate gradients (backward), on one block of
//! `bn x bk` values while it is hot in L1.
//!
//! Each loop is compiled for the widest vector ISA at run time (`widest!`):
//! at 4-lane SSE2 the LSTM forward cell cost about 24 ns per element here,
//! 13% of an LSTM forward at (T,N,C,K) = (50,64,512,512) on one thread;
//! with AVX-512 about 6 ns, and the same bits.

use crate::math::{sigmoid, tanh, widest};

widest! {
    /// LSTM step on one block: the gate pre-activations `gi, gf, gc, go`
    /// become the activated gates i, f, c~, o in place; `cnew = f cprev +
    /// i c~`, `h = o tanh(cnew)`. All slices as long as `gi`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lstm_fwd / lstm_fwd_plain(
        gi: &mut [f32],
        gf: &mut [f32],
        gc: &mut [f32],
        go: &mut [f32],
        cprev: &[f32],
        cnew: &mut [f32],
        h: &mut [f32],
    ) {
        let n = gi.len();
        // Equal lengths up front, so the loop below has no bounds checks.
        let (gf, gc, go, cprev, cnew, h) = (
            &mut gf[..n],
            &mut gc[..n],
            &mut go[..n],
            &cprev[..n],
            &mut cnew[..n],
            &mut h[..n],
        );
        for e in 0..n {
            let (i_, f_, c_, o_) = (sigmoid(gi[e]), sigmoid(gf[e]), tanh(gc[e]), sigmoid(go[e]));
            gi[e] = i_;
            gf[e] = f_;
            gc[e] = c_;
            go[e] = o_;
            let c = f_ * cprev[e] + i_ * c_;
            cnew[e] = c;
            h[e] = o_ * tanh(c);
        }
    }
}

widest! {
    /// Plain RNN step on one block: `z = tanh(z)` in place, `h = z`.
    pub(crate) fn rnn_fwd / rnn_fwd_plain(z: &mut [f32], h: &mut [f32]) {
        let h = &mut h[..z.len()];
        for (zv, hv) in z.iter_mut().zip(h.iter_mut()) {
            *zv = tanh(*zv);
            *hv = *zv;
        }
    }
}

/// The kept forward values of one LSTM block (activated gates and cell
/// states), read by its backward step.
pub(crate) struct LstmKept<'a> {
    pub gi: &'a [f32],
    pub gf: &'a [f32],
    pub gc: &'a [f32],
    pub go: &'a [f32],
    /// c_t.
    pub cnow: &'a [f32],
    /// c_(t-1).
    pub cprev: &'a [f32],
}

/// The gate gradients of one LSTM block, written by its backward step.
pub(crate) struct LstmGateGrads<'a> {
    pub di: &'a mut [f32],
    pub df: &'a mut [f32],
    pub dc: &'a mut [f32],
    pub dout: &'a mut [f32],
}

widest! {
    /// LSTM backward on one block: from dL/dh_t (`dht`), the running dL/dc
    /// (`dc`, updated in place to dL/dc_(t-1)) and the kept values, the
    /// gradients of the four gate pre-activations. All slices as long as `dc`.
    pub(crate) fn lstm_bwd / lstm_bwd_plain(
        k: &LstmKept,
        dht: &[f32],
        dc: &mut [f32],
        g: &mut LstmGateGrads,
    ) {
        let n = dc.len();
        let (gi, gf, gc, go, cnow, cprev, dht) = (
            &k.gi[..n],
            &k.gf[..n],
            &k.gc[..n],
            &k.go[..n],
            &k.cnow[..n],
            &k.cprev[..n],
            &dht[..n],
        );
        let (di, df, dcc, dout) = (
            &mut g.di[..n],
            &mut g.df[..n],
            &mut g.dc[..n],
            &mut g.dout[..n],
        );
        for e in 0..n {
            let (i_, f_, c_, o_) = (gi[e], gf[e], gc[e], go[e]);
            let tc = tanh(cnow[e]);
            let dct = dc[e] + dht[e] * o_ * (1.0 - tc * tc);
            di[e] = dct * c_ * i_ * (1.0 - i_);
            df[e] = dct * cprev[e] * f_ * (1.0 - f_);
            dcc[e] = dct * i_ * (1.0 - c_ * c_);
            dout[e] = dht[e] * tc * o_ * (1.0 - o_);
            dc[e] = dct * f_;
        }
    }
}

widest! {
    /// Plain RNN backward on one block: `dz = dh (1 - h^2)`.
    pub(crate) fn rnn_bwd / rnn_bwd_plain(h: &[f32], dht: &[f32], dz: &mut [f32]) {
        let n = dz.len();
        let (h, dht) = (&h[..n], &dht[..n]);
        for e in 0..n {
            dz[e] = dht[e] * (1.0 - h[e] * h[e]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type FwdFn = fn(&mut [f32], &mut [f32], &mut [f32], &mut [f32], &[f32], &mut [f32], &mut [f32]);

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 4001)
            .map(|v| v as f32 / 400.0 - 5.0)
            .collect()
    }

    /// The dispatched (vector) versions give the bits of the plain bodies,
    /// and the forward cell matches its f64 definition.
    #[test]
    fn dispatched_equals_plain_and_definition() {
        let n = 1037; // not a multiple of any vector width: tails too
        let (gi, gf, gc, go, cp) = (
            values(n, 1),
            values(n, 2),
            values(n, 3),
            values(n, 4),
            values(n, 5),
        );
        let run = |f: FwdFn| {
            let (mut a, mut b, mut c, mut d) = (gi.clone(), gf.clone(), gc.clone(), go.clone());
            let (mut cn, mut h) = (vec![0.0; n], vec![0.0; n]);
            f(&mut a, &mut b, &mut c, &mut d, &cp, &mut cn, &mut h);
            (a, b, c, d, cn, h)
        };
        let wide = run(lstm_fwd);
        let plain = run(lstm_fwd_plain);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&wide.5), bits(&plain.5));
        assert_eq!(bits(&wide.4), bits(&plain.4));
        assert_eq!(bits(&wide.0), bits(&plain.0));
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        for e in 0..n {
            let (i_, f_, c_, o_) = (
                sig(gi[e] as f64),
                sig(gf[e] as f64),
                (gc[e] as f64).tanh(),
                sig(go[e] as f64),
            );
            let c = f_ * cp[e] as f64 + i_ * c_;
            assert!((wide.4[e] as f64 - c).abs() < 1e-5, "c at {e}");
            assert!((wide.5[e] as f64 - o_ * c.tanh()).abs() < 1e-5, "h at {e}");
        }

        let dht = values(n, 6);
        let cnow = values(n, 7);
        let bwd = |f: fn(&LstmKept, &[f32], &mut [f32], &mut LstmGateGrads)| {
            let kept = LstmKept {
                gi: &wide.0,
                gf: &wide.1,
                gc: &wide.2,
                go: &wide.3,
                cnow: &cnow,
                cprev: &cp,
            };
            let mut dc = values(n, 8);
            let (mut a, mut b, mut c, mut d) =
                (vec![0.0; n], vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            f(
                &kept,
                &dht,
                &mut dc,
                &mut LstmGateGrads {
                    di: &mut a,
                    df: &mut b,
                    dc: &mut c,
                    dout: &mut d,
                },
            );
            (dc, a, b, c, d)
        };
        let (w, p) = (bwd(lstm_bwd), bwd(lstm_bwd_plain));
        for (x, y) in [
            (&w.0, &p.0),
            (&w.1, &p.1),
            (&w.2, &p.2),
            (&w.3, &p.3),
            (&w.4, &p.4),
        ] {
            assert_eq!(bits(x), bits(y));
        }

        let (mut z1, mut h1) = (gc.clone(), vec![0.0; n]);
        let (mut z2, mut h2) = (gc.clone(), vec![0.0; n]);
        rnn_fwd(&mut z1, &mut h1);
        rnn_fwd_plain(&mut z2, &mut h2);
        assert_eq!(bits(&h1), bits(&h2));
        let (mut d1, mut d2) = (vec![0.0; n], vec![0.0; n]);
        rnn_bwd(&h1, &dht, &mut d1);
        rnn_bwd_plain(&h1, &dht, &mut d2);
        assert_eq!(bits(&d1), bits(&d2));
    }
}
