//! A 3-layer MLP with its loss: analytic gradients against central finite
//! differences, and save/load.

use brgemm_nn::models::{LayerSpec, Mlp};
use brgemm_nn::{ModelFile, Trainable};
use brgemm_primitives::init::Rng;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Activation, Blocked, Inner, Pool};

fn setup(acts: [Activation; 3]) -> (Mlp, Blocked, Vec<usize>) {
    let specs = [
        LayerSpec {
            out: 9,
            act: acts[0],
        },
        LayerSpec {
            out: 7,
            act: acts[1],
        },
        LayerSpec {
            out: 4,
            act: acts[2],
        },
    ];
    let (n, c) = (6, 5);
    let m = Mlp::new(c, n, &specs, 11).unwrap();
    let mut r = Rng::new(5);
    let plain: Vec<f32> = (0..n * c).map(|_| 2.0 * r.uniform() - 1.0).collect();
    let t = m.layers().next().unwrap().tuning().clone();
    let x = Blocked::from_plain(&plain, n, c, t.bn, t.bc, Inner::RowMajor).unwrap();
    // Five labelled rows of six: the unlabelled row must not contribute.
    (m, x, vec![0, 3, 1, 2, 3])
}

fn loss_of(m: &mut Mlp, pool: &Pool, x: &Blocked, labels: &[usize]) -> f64 {
    m.compute_gradients(pool, x, labels).unwrap() as f64
}

#[test]
fn gradients_match_central_finite_differences() {
    let pool = Pool::new(2).unwrap().always_parallel();
    for acts in [
        [Activation::Tanh, Activation::Sigmoid, Activation::Identity],
        [Activation::Gelu, Activation::Tanh, Activation::Identity],
        [Activation::Relu, Activation::Gelu, Activation::Sigmoid],
    ] {
        let (mut m, x, labels) = setup(acts);
        loss_of(&mut m, &pool, &x, &labels);
        let grads: Vec<_> = (0..m.depth()).map(|i| m.gradients(i)).collect();
        let h = 1e-2f32;
        let mut checked = 0;
        for (li, (gw, gb)) in grads.iter().enumerate() {
            let (w0, b0) = m.parameters(li);
            // Every bias and every third weight, both signs of perturbation.
            let picks: Vec<(bool, usize)> = (0..b0.len())
                .map(|i| (false, i))
                .chain((0..w0.len()).step_by(3).map(|i| (true, i)))
                .collect();
            for (is_w, i) in picks {
                let eval = |m: &mut Mlp, d: f32| {
                    let (mut w, mut b) = (w0.clone(), b0.clone());
                    if is_w {
                        w[i] += d
                    } else {
                        b[i] += d
                    }
                    m.set_parameters(li, &w, &b).unwrap();
                    loss_of(m, &pool, &x, &labels)
                };
                let fd = (eval(&mut m, h) - eval(&mut m, -h)) / (2.0 * h as f64);
                m.set_parameters(li, &w0, &b0).unwrap();
                let an = if is_w { gw[i] } else { gb[i] } as f64;
                // ReLU kinks make FD unreliable right at zero crossings.
                let tol = 2e-3 + 2e-2 * an.abs().max(fd.abs());
                assert!(
                    (an - fd).abs() <= tol,
                    "{acts:?} layer {li} {} [{i}]: analytic {an}, finite difference {fd}",
                    if is_w { "w" } else { "b" }
                );
                checked += 1;
            }
        }
        assert!(checked > 40);
    }
}

#[test]
fn training_lowers_the_loss_and_save_load_round_trips() {
    let pool = Pool::new(1).unwrap();
    let (mut m, x, labels) = setup([Activation::Relu, Activation::Tanh, Activation::Identity]);
    let first = loss_of(&mut m, &pool, &x, &labels);
    for _ in 0..200 {
        m.train_step(&pool, &x, &labels, &Optimizer::adam(0.01))
            .unwrap();
    }
    let last = loss_of(&mut m, &pool, &x, &labels);
    assert!(last < first * 0.2, "loss {first} -> {last}");

    let path = std::env::temp_dir().join(format!("brgemm-mlp-{}.bin", std::process::id()));
    m.save(&path).unwrap();
    let mut back = Mlp::load(&path, m.batch()).unwrap();
    std::fs::remove_file(&path).ok();
    for i in 0..m.depth() {
        assert_eq!(back.parameters(i), m.parameters(i));
    }
    assert_eq!(
        back.predict(&pool, &x, 5).unwrap(),
        m.predict(&pool, &x, 5).unwrap()
    );
    let bad = std::env::temp_dir().join(format!("brgemm-bad-{}.bin", std::process::id()));
    std::fs::write(&bad, b"not a model").unwrap();
    let e = Mlp::load(&bad, 4).err().unwrap().to_string();
    std::fs::remove_file(&bad).ok();
    assert!(e.contains("not a valid model file"), "{e}");
}
