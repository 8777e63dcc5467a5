//! A tuning saved for a shape is what `Fc::new` plans with when
//! `BRGEMM_TUNING` names the file; other shapes keep the heuristic.
//! (Its own test binary: it sets a process-wide variable.)

use brgemm_primitives::tuning::{load as load_tuning, TunedFc};
use brgemm_primitives::PassConfig;
use brgemm_primitives::{Activation, Fc, FcTuning};

#[test]
fn a_saved_tuning_loads_and_plans_and_the_environment_is_not_read() {
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
    let loaded = load_tuning(&path, 64, 96, 48).unwrap();
    assert_eq!(loaded, Some(tuned.clone()));
    assert_eq!(load_tuning(&path, 1, 2, 3).unwrap(), None);
    let fc = Fc::with_tuning(64, 96, 48, Activation::Relu, loaded.unwrap()).unwrap();
    assert_eq!(fc.tuning(), &tuned);
    // A constructor never reads BRGEMM_TUNING (the examples read it once,
    // into their config): Fc::new plans the heuristic.
    std::env::set_var("BRGEMM_TUNING", &path);
    let fc = Fc::new(64, 96, 48, Activation::Relu).unwrap();
    std::env::remove_var("BRGEMM_TUNING");
    assert_eq!(fc.tuning(), &FcTuning::heuristic(64, 96, 48));
    std::fs::write(&path, "{ not json").unwrap();
    let e = load_tuning(&path, 64, 96, 48).unwrap_err().to_string();
    std::fs::remove_file(&path).ok();
    assert!(e.contains("brgemm-tuning-"), "{e}");
}
