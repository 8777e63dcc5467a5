//! A tuning saved for a shape is what `Fc::new` plans with when
//! `BRGEMM_TUNING` names the file; other shapes keep the heuristic.
//! (Its own test binary: it sets a process-wide variable.)

use brgemm_primitives::fc::{load_tuning, PassConfig, TunedFc};
use brgemm_primitives::{Activation, Fc, FcTuning};

#[test]
fn fc_new_loads_the_saved_tuning() {
    let path = std::env::temp_dir().join(format!("brgemm-tuning-{}.json", std::process::id()));
    let tuned = FcTuning {
        bn: 16,
        bc: 32,
        bk: 16,
        fwd: PassConfig {
            chunk: 2,
            ..PassConfig::spec("BAc")
        },
        ..FcTuning::heuristic(64, 96, 48)
    };
    let entries = vec![TunedFc {
        n: 64,
        c: 96,
        k: 48,
        tuning: tuned.clone(),
    }];
    std::fs::write(&path, serde_json::to_string(&entries).unwrap()).unwrap();
    assert_eq!(load_tuning(&path, 64, 96, 48).unwrap(), Some(tuned.clone()));
    assert_eq!(load_tuning(&path, 1, 2, 3).unwrap(), None);
    std::env::set_var("BRGEMM_TUNING", &path);
    assert_eq!(
        Fc::new(64, 96, 48, Activation::Relu).unwrap().tuning(),
        &tuned
    );
    assert_eq!(
        Fc::new(64, 96, 64, Activation::Relu).unwrap().tuning(),
        &FcTuning::heuristic(64, 96, 64)
    );
    std::fs::write(&path, "{ not json").unwrap();
    let e = Fc::new(64, 96, 48, Activation::Relu)
        .unwrap_err()
        .to_string();
    std::env::remove_var("BRGEMM_TUNING");
    std::fs::remove_file(&path).ok();
    assert!(e.contains("brgemm-tuning-"), "{e}");
}
