//! Non-finite values are seen, not hidden: a NaN loss, a NaN or infinite
//! learning rate and a NaN input batch stop training with an error naming
//! the step; ReLU, max-pooling and the loss propagate NaN.

use brgemm_dl::nn::Error as NnError;
use brgemm_dl::{data, train};
use brgemm_primitives::eltwise::relu_forward;
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Activation, Blocked, Error, Fc, Inner, Pool, Pool2d, PoolKind, Tensor4};

fn digits() -> (data::Dataset, data::Dataset) {
    let (tr, te) = data::digits().unwrap().split(0.2, 42);
    (tr.subset(&(0..256).collect::<Vec<_>>()), te)
}

fn cfg(lr: f32) -> train::TrainConfig {
    train::TrainConfig {
        epochs: 2,
        optimizer: Optimizer::adam(lr),
        ..Default::default()
    }
}

#[test]
fn a_nan_or_infinite_learning_rate_is_refused_before_training() {
    let (tr, te) = digits();
    let pool = Pool::new(1).unwrap();
    for lr in [f32::NAN, f32::INFINITY, -1.0, 0.0] {
        let e = train::train(&cfg(lr), &pool, &tr, &te, |_| {})
            .err()
            .unwrap();
        assert!(e.to_string().contains("learning rate"), "{lr}: {e}");
    }
}

#[test]
fn a_nan_input_batch_stops_training_at_its_step() {
    let (mut tr, te) = digits();
    // One NaN pixel in one image: the step whose minibatch holds it fails.
    tr.x[5 * tr.features + 3] = f32::NAN;
    let pool = Pool::new(1).unwrap();
    let e = train::train(&cfg(1e-3), &pool, &tr, &te, |_| {})
        .err()
        .unwrap();
    match &e {
        NnError::Primitive(Error::NonFinite { step, what, .. }) => {
            assert!(*step < 4, "the first epoch's 4 steps hold image 5: {e}");
            assert_eq!(what, "loss", "{e}");
        }
        other => panic!("{other}"),
    }
    // The opt-out trains on (into NaN weights), as an experiment may want.
    let mut off = cfg(1e-3);
    off.check_finite = false;
    assert!(train::train(&off, &pool, &tr, &te, |_| {}).is_ok());
}

/// A fused update cannot wait for the check: the pair is refused before
/// training, naming both; without the check it trains as the unfused run
/// does (the same test accuracy, short last minibatch included).
#[test]
fn a_fused_update_needs_the_finite_check_off_and_trains_as_unfused() {
    let (tr, te) = digits();
    let tr = tr.subset(&(0..250).collect::<Vec<_>>());
    let pool = Pool::new(2).unwrap();
    let mut c = cfg(3e-3);
    c.fused_update = true;
    let e = train::train(&c, &pool, &tr, &te, |_| {}).err().unwrap();
    assert!(e.to_string().contains("finite check"), "{e}");
    c.check_finite = false;
    let acc = |c: &train::TrainConfig| {
        let mut last = 0.0;
        train::train(c, &pool, &tr, &te, |r| last = r.test_accuracy).unwrap();
        last
    };
    let fused = acc(&c);
    c.fused_update = false;
    assert_eq!(fused, acc(&c));
}

#[test]
fn a_huge_learning_rate_that_diverges_is_stopped_with_its_step() {
    let (tr, te) = digits();
    let pool = Pool::new(1).unwrap();
    let mut c = cfg(1e30);
    c.optimizer = Optimizer::Sgd {
        lr: 1e30,
        momentum: 0.0,
    };
    c.epochs = 5;
    let e = train::train(&c, &pool, &tr, &te, |_| {}).err().unwrap();
    assert!(
        matches!(e, NnError::Primitive(Error::NonFinite { step, .. }) if step > 0),
        "{e}"
    );
    assert!(e.to_string().contains("training stopped at step"), "{e}");
}

#[test]
fn relu_keeps_nan_in_the_pass_and_in_every_kernel_epilogue() {
    let pool = Pool::new(1).unwrap();
    let x = [f32::NAN, -1.0, 2.0, -0.0];
    let mut y = [0.0; 4];
    relu_forward(&pool, &x, &mut y).unwrap();
    assert!(
        y[0].is_nan() && y[1] == 0.0 && y[2] == 2.0 && y[3] == 0.0,
        "{y:?}"
    );
    // An FC layer with the fused ReLU epilogue: a NaN input reaches the
    // output rows that read it, whatever ISA the kernel runs on.
    let fc = Fc::new(4, 8, 16, Activation::Relu).unwrap();
    let mut xin = vec![0.5f32; 4 * 8];
    xin[8] = f32::NAN; // row 1
    let mut xl = fc.x_layout();
    xl.set_plain(&xin).unwrap();
    let mut w = fc.w_layout();
    w.set_plain(&vec![-1.0; 16 * 8]).unwrap(); // every pre-activation < 0
    let mut out = fc.y_layout();
    fc.forward(&pool, &xl, &w, &[0.0; 16], &mut out, None)
        .unwrap();
    let yp = out.to_plain();
    assert!(
        yp[16..32].iter().all(|v| v.is_nan()),
        "row 1: {:?}",
        &yp[16..32]
    );
    assert!(yp[..16].iter().all(|&v| v == 0.0), "row 0: {:?}", &yp[..16]);
}

#[test]
fn max_pool_keeps_nan() {
    let pool = Pool::new(1).unwrap();
    let mut plain = vec![1.0f32; 4 * 4];
    plain[5] = f32::NAN; // in the first 2x2 window (rows 0-1, cols 0-1)
    let x = Tensor4::from_nchw(&plain, 1, 1, 4, 4, 1).unwrap();
    let p = Pool2d::new(PoolKind::Max, &x, 2, 2, 0).unwrap();
    let mut y = p.output();
    let mut arg = vec![0u32; y.data().len()];
    p.forward(&pool, &x, &mut y, Some(&mut arg)).unwrap();
    let out = y.to_nchw();
    assert!(out[0].is_nan(), "{out:?}");
    assert_eq!(&out[1..], &[1.0, 1.0, 1.0]);
    assert_eq!(arg[0], 5, "the NaN's pixel wins the arg-max");
}

#[test]
fn the_loss_of_nan_logits_is_nan_not_a_clamped_number() {
    let mut logits = Blocked::zeros(2, 3, 2, 3, Inner::RowMajor).unwrap();
    logits
        .set_plain(&[0.1, f32::NAN, 0.3, 1.0, 2.0, 3.0])
        .unwrap();
    let mut d = logits.clone();
    let l = brgemm_primitives::loss::softmax_cross_entropy(&logits, &[0, 2], &mut d).unwrap();
    assert!(l.is_nan(), "{l}");
    // A finite but hopeless logit gap gives a large finite loss, exactly.
    logits.set_plain(&[0.0, 200.0, 0.0, 0.0, 0.0, 0.0]).unwrap();
    let l = brgemm_primitives::loss::softmax_cross_entropy(&logits, &[0], &mut d).unwrap();
    assert!((l - 200.0).abs() < 1e-3, "{l}");
}
