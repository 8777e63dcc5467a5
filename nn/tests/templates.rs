//! The sequence classifier template: gradients against finite differences, and learning.

use brgemm_nn::models::{SeqClassifier, SeqSpec};
use brgemm_primitives::{CellKind, Pool};

// The primitives' test helpers, shared rather than copied.
#[path = "../../primitives/tests/common/mod.rs"]
mod common;
use common::data_f64;

/// The stacked, bidirectional classifier's glue (reversal, concatenation,
/// final states, gradient routing) against finite differences of its loss.
#[test]
fn stacked_bidirectional_classifier_gradients() {
    let pool = Pool::new(2).unwrap().always_parallel();
    for kind in [CellKind::Lstm, CellKind::Rnn] {
        let spec = SeqSpec {
            kind,
            steps: 4,
            features: 3,
            hidden: 5,
            layers: 2,
            bidirectional: true,
            head: vec![],
            classes: 3,
        };
        let mut m = SeqClassifier::new(&spec, 3, 7).unwrap();
        let mut x = m.input_layout();
        let plain: Vec<f32> = data_f64(4 * 3 * 3, 3, 2.0)
            .iter()
            .map(|v| *v as f32)
            .collect();
        m.set_input(&mut x, &plain).unwrap();
        let labels = [0, 2, 1];
        m.compute_gradients(&pool, &x, &labels).unwrap();
        let mut checked = 0;
        for (l, d) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            let (gw, gr) = {
                let (a, b, _) = m.gradients(l, d);
                (a.clone(), b.clone())
            };
            for which in 0..2 {
                let grad = if which == 0 { &gw } else { &gr };
                let n = grad.data().len();
                for i in [0, n / 3, n / 2, n - 7] {
                    if grad.data()[i] == 0.0 {
                        continue; // padding
                    }
                    let at = |delta: f32, m: &mut SeqClassifier| {
                        let (w, r, _) = m.parameters_mut(l, d);
                        let p = if which == 0 { w } else { r };
                        p.data_mut()[i] += delta;
                    };
                    at(1e-2, &mut m);
                    let up = m.compute_gradients(&pool, &x, &labels).unwrap() as f64;
                    at(-2e-2, &mut m);
                    let down = m.compute_gradients(&pool, &x, &labels).unwrap() as f64;
                    at(1e-2, &mut m);
                    let fd = (up - down) / 2e-2;
                    let an = grad.data()[i] as f64;
                    assert!(
                        (fd - an).abs() < 2e-2 * (1.0 + an.abs()) + 1e-3,
                        "{kind:?} layer {l} dir {d} {} [{i}]: fd {fd} vs {an}",
                        if which == 0 { "W" } else { "R" }
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 12, "only {checked} entries checked");
    }
}
