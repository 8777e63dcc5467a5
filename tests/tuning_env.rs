//! `BRGEMM_TUNING`'s file reaches the MLP: the examples read the variable
//! once into `TrainConfig::tuning_file` (it was once documented but never
//! read), and `train::build` plans every layer with the stored tuning for
//! its shape, the heuristic for shapes the file lacks.

use brgemm_dl::nn::Linear;
use brgemm_dl::{data, train};
use brgemm_primitives::tuning::TunedFc;
use brgemm_primitives::{FcTuning, PassConfig};

#[test]
fn the_mlp_plans_with_the_tuning_file_of_the_config() {
    let (tr, _) = data::digits().unwrap().split(0.2, 42);
    let cfg = train::TrainConfig::default();
    let (n, c, k) = (cfg.batch, tr.features, cfg.hidden[0]);
    let tuned = FcTuning {
        // Layer 0's input blocking is free (the data's layout follows
        // it); its bn and bk must chain into layer 1's.
        bc: 32,
        fwd: PassConfig {
            chunk: 1,
            ..PassConfig::spec("BAc")
        },
        ..FcTuning::heuristic(n, c, k)
    };
    assert_ne!(tuned, FcTuning::heuristic(n, c, k));
    let path = std::env::temp_dir().join(format!("brgemm-tuning-env-{}.json", std::process::id()));
    let entry = TunedFc {
        n,
        c,
        k,
        tuning: tuned.clone(),
    };
    std::fs::write(&path, serde_json::to_string(&vec![entry]).unwrap()).unwrap();
    let with = train::TrainConfig {
        tuning_file: Some(path.clone()),
        ..cfg.clone()
    };
    let m = train::build(&with, &tr).unwrap();
    let layers = m.layers_of::<Linear>();
    assert_eq!(layers[0].tuning(), Some(&tuned));
    let (c1, k1) = (k, cfg.hidden[1]);
    assert_eq!(layers[1].tuning(), Some(&FcTuning::heuristic(n, c1, k1)));
    // A malformed file is an error naming it, not a silent default.
    std::fs::write(&path, "[{").unwrap();
    let e = train::build(&with, &tr).err().unwrap().to_string();
    std::fs::remove_file(&path).ok();
    assert!(e.contains("brgemm-tuning-env"), "{e}");
}
