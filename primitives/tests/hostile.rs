//! Hostile inputs to the primitives: each case the safety review found
//! panicking or corrupting memory now returns an error naming the value.

use brgemm_primitives::fc::load_tuning;
use brgemm_primitives::{Activation, Fc, FcTuning, LoopDef, LoopNest};

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
