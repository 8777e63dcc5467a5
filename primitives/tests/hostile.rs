//! Hostile inputs to the primitives: each case the safety review found
//! panicking or corrupting memory now returns an error naming the value.

use brgemm_primitives::tuning::load as load_tuning;
use brgemm_primitives::{Activation, Blocked, Fc, FcTuning, Inner, LoopDef, LoopNest};

#[test]
fn tuning_file_with_zero_blocks_is_an_error() {
    let t = FcTuning::heuristic(64, 64, 64);
    for (field, patch) in [
        ("bn", r#""bn":0"#),
        ("blocks_a", r#""blocks_a":[0]"#),
        ("blocks_b", r#""blocks_b":[0]"#),
    ] {
        let mut json = serde_json::to_value(vec![serde_json::json!({
            "n": 64, "c": 64, "k": 64, "tuning": t
        })])
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&format!("{{{patch}}}")).unwrap();
        let (k, val) = v.as_object().unwrap().iter().next().unwrap();
        let tun = json[0]["tuning"].as_object_mut().unwrap();
        if tun.contains_key(k) {
            tun.insert(k.clone(), val.clone());
        } else {
            for pass in ["fwd", "bwd", "upd"] {
                let p = tun[pass].as_object_mut().unwrap();
                p.insert(k.clone(), val.clone());
                if k.starts_with("blocks") {
                    p.insert("spec".into(), serde_json::json!("aaBc"));
                }
            }
        }
        let path = std::env::temp_dir().join(format!(
            "brgemm-hostile-{}-{field}.json",
            std::process::id()
        ));
        std::fs::write(&path, json.to_string()).unwrap();
        let r = load_tuning(&path, 64, 64, 64)
            .and_then(|t| Fc::with_tuning(64, 64, 64, Activation::Relu, t.unwrap()));
        std::fs::remove_file(&path).ok();
        let e = r
            .err()
            .unwrap_or_else(|| panic!("{field} = 0 accepted"))
            .to_string();
        assert!(e.contains('0'), "{field}: {e}");
    }
}

#[test]
fn a_zero_loop_step_is_an_error() {
    let e = LoopNest::new(vec![LoopDef::new("rows", 8, 0)], "a").unwrap_err();
    assert!(e.to_string().contains("step 0"), "{e}");
    let l = LoopDef::new("rows", 8, 1).blocks(vec![0]);
    let e = LoopNest::new(vec![l], "aa").unwrap_err();
    assert!(e.to_string().contains("block 0"), "{e}");
}

#[test]
fn block_products_that_overflow_are_errors() {
    let big = 1usize << 33;
    let t = FcTuning {
        bn: big,
        bc: big,
        bk: 64,
        ..FcTuning::heuristic(64, 64, 64)
    };
    let e = Fc::with_tuning(big, big, 64, Activation::Relu, t).unwrap_err();
    assert!(e.to_string().contains(&big.to_string()), "{e}");
    // 4 * k * c once overflowed before validation.
    let e = brgemm_primitives::Rnn::new(brgemm_primitives::CellKind::Lstm, 1, 1, 1 << 62, 1 << 62)
        .unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
    let p = brgemm_primitives::ConvParams::new(1, 1, 1, 1 << 40, 1 << 40, 1, 1);
    let e = brgemm_primitives::Conv::new(p, Activation::Relu).unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
    let p = brgemm_primitives::ConvParams::new(1, 1, 1, 8, 8, 3, 3).pad(usize::MAX / 2);
    assert!(brgemm_primitives::Conv::new(p, Activation::Relu).is_err());
}

/// The overflow reproductions of the review: a pass handed an output
/// buffer of another (smaller) shape once wrote past it. Buffers can no
/// longer be swapped under a tensor (private storage, `compile_fail`
/// doctests on `Blocked`, `Tensor4`, `Filter`); a buffer of the wrong shape
/// is an error naming it, for every pass that reaches a raw kernel.
#[test]
fn a_buffer_of_another_shape_is_an_error_not_an_overflow() {
    use brgemm_primitives::{BatchNorm, CellKind, Conv, ConvParams, Rnn};
    let pool = brgemm_primitives::Pool::new(1).unwrap();
    let fc = Fc::new(16, 32, 32, Activation::Relu).unwrap();
    let small = Fc::new(4, 32, 32, Activation::Relu).unwrap();
    let (x, w) = (fc.x_layout(), fc.w_layout());
    let mut y = small.y_layout();
    let e = fc
        .forward(&pool, &x, &w, &[0.0; 32], &mut y, None)
        .unwrap_err();
    assert!(e.to_string().contains("Y"), "{e}");
    let mut dx = small.x_layout();
    let e = fc
        .backward_data(&pool, &fc.y_layout(), &w, &mut fc.dzt_layout(), &mut dx)
        .unwrap_err();
    assert!(e.to_string().contains("dX"), "{e}");
    let e = fc
        .backward_data_wt(&pool, &fc.y_layout(), &fc.wt_layout(), &mut dx)
        .unwrap_err();
    assert!(e.to_string().contains("dX"), "{e}");
    let e = fc
        .backward_data(
            &pool,
            &fc.y_layout(),
            &w,
            &mut small.dzt_layout(),
            &mut fc.x_layout(),
        )
        .unwrap_err();
    assert!(e.to_string().contains("dZt"), "{e}");
    let mut dw = Blocked::zeros(8, 8, 8, 8, Inner::ColMajor).unwrap();
    let e = fc
        .backward_weights(&pool, &fc.y_layout(), &x, &mut dw, &mut [0.0; 32])
        .unwrap_err();
    assert!(e.to_string().contains("dW"), "{e}");

    let conv = Conv::new(
        ConvParams::new(2, 8, 8, 8, 8, 3, 3).pad(1),
        Activation::Relu,
    )
    .unwrap();
    let other = Conv::new(
        ConvParams::new(1, 8, 8, 4, 4, 3, 3).pad(1),
        Activation::Relu,
    )
    .unwrap();
    let mut y = other.y_tensor();
    let e = conv
        .forward(
            &pool,
            &conv.x_tensor(),
            &conv.filter(),
            &vec![0.0; conv.padded_k()],
            &mut y,
        )
        .unwrap_err();
    assert!(e.to_string().contains("Y"), "{e}");

    let rnn = Rnn::new(CellKind::Lstm, 3, 4, 8, 8).unwrap();
    let short = Rnn::new(CellKind::Lstm, 1, 4, 8, 8).unwrap();
    let mut st = short.state();
    let e = rnn
        .forward(
            &pool,
            &rnn.x_layout(),
            &rnn.w_layout(),
            &rnn.r_layout(),
            &vec![0.0; rnn.bias_len()],
            None,
            None,
            &mut st,
        )
        .unwrap_err();
    assert!(e.to_string().contains("state"), "{e}");

    let mut bn = BatchNorm::new(8, 8).unwrap();
    let x = brgemm_primitives::Tensor4::zeros(2, 8, 4, 4, 8).unwrap();
    let mut y = brgemm_primitives::Tensor4::zeros(1, 8, 4, 4, 8).unwrap();
    assert!(bn.forward_train(&pool, &x, &mut y).is_err());
}
