//! End to end on Fashion-MNIST: a short CNN run on a subset reaches a stated
//! accuracy. The data comes from the Debian package `dataset-fashion-mnist`;
//! `scripts/test.sh` installs it and sets `BRGEMM_REQUIRE_FASHION=1`, which
//! turns a missing data set into a failure instead of a skip.

use brgemm_dl::{data, train_cnn};
use brgemm_primitives::Pool;
use std::path::Path;

fn load() -> Option<(data::ImageSet, data::ImageSet)> {
    match data::fashion_mnist(Path::new(data::FASHION_MNIST_DIR)) {
        Ok(d) => Some(d),
        Err(e) if std::env::var_os("BRGEMM_REQUIRE_FASHION").is_some() => {
            panic!("BRGEMM_REQUIRE_FASHION is set but: {e}")
        }
        Err(e) => {
            eprintln!("SKIPPED: {e}");
            None
        }
    }
}

#[test]
fn short_cnn_run_on_a_subset_reaches_80_percent() {
    let Some((mut tr, mut te)) = load() else {
        return;
    };
    assert_eq!(
        (tr.data.len(), te.data.len(), tr.dims),
        (60000, 10000, (1, 28, 28))
    );
    tr.data = tr.data.subset(&(0..6400).collect::<Vec<_>>());
    te.data = te.data.subset(&(0..2000).collect::<Vec<_>>());
    let cfg = train_cnn::CnnConfig {
        epochs: 1,
        ..Default::default()
    };
    let pool = Pool::new(2).unwrap();
    let mut acc = 0.0;
    train_cnn::train(&cfg, &pool, &tr, &te, |r| acc = r.test_accuracy).unwrap();
    assert!(acc >= 0.80, "test accuracy {acc}");
}

/// Mixed precision (`--dtype bf16`) on the same seeds ends within one
/// point of f32 (the convolutions run bf16 where a bf16 kernel beats f32:
/// AMX, AVX512-BF16 on Zen 4; the linear
/// layers everywhere).
#[test]
fn bf16_cnn_run_is_within_a_point_of_f32() {
    let Some((mut tr, mut te)) = load() else {
        return;
    };
    tr.data = tr.data.subset(&(0..6400).collect::<Vec<_>>());
    te.data = te.data.subset(&(0..2000).collect::<Vec<_>>());
    let pool = Pool::new(2).unwrap();
    let acc = |bf16| {
        let cfg = train_cnn::CnnConfig {
            epochs: 1,
            bf16,
            ..Default::default()
        };
        let mut acc = 0.0;
        train_cnn::train(&cfg, &pool, &tr, &te, |r| acc = r.test_accuracy).unwrap();
        acc
    };
    let (a32, a16) = (acc(false), acc(true));
    assert!(
        (a32 - a16).abs() <= 0.01 && a16 >= 0.80,
        "f32 {a32}, bf16 {a16}"
    );
}

#[test]
fn batchnorm_and_dropout_variant_trains() {
    let Some((mut tr, mut te)) = load() else {
        return;
    };
    tr.data = tr.data.subset(&(0..3200).collect::<Vec<_>>());
    te.data = te.data.subset(&(0..1000).collect::<Vec<_>>());
    let mut cfg = train_cnn::CnnConfig {
        epochs: 1,
        dropout: 0.25,
        ..Default::default()
    };
    cfg.stages.iter_mut().for_each(|s| s.batchnorm = true);
    let pool = Pool::new(2).unwrap();
    let mut acc = 0.0;
    train_cnn::train(&cfg, &pool, &tr, &te, |r| acc = r.test_accuracy).unwrap();
    assert!(acc >= 0.75, "test accuracy {acc}");
}

#[test]
fn a_missing_data_set_names_the_package_and_the_flag() {
    let dir = std::env::temp_dir().join("brgemm-no-fashion-here");
    std::fs::create_dir_all(&dir).unwrap();
    let e = data::fashion_mnist(&dir).unwrap_err().to_string();
    assert!(
        e.contains("apt-get install dataset-fashion-mnist") && e.contains("--data DIR"),
        "{e}"
    );
}

/// Whether an OpenCL device is there (a failure when the test script
/// requires one, a skip line otherwise).
#[cfg(feature = "gpu")]
fn opencl_ready() -> bool {
    use brgemm_dl::gpu::{Backend, Device};
    match Device::open(Backend::OpenCl) {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var("BRGEMM_REQUIRE_OPENCL").as_deref() != Ok("1"),
                "BRGEMM_REQUIRE_OPENCL=1 but: {e}"
            );
            eprintln!("SKIPPED: no OpenCL device ({e})");
            false
        }
    }
}

/// The last epoch's (test accuracy, loss) of a run that reports epochs.
#[cfg(feature = "gpu")]
fn last_epoch<E: std::fmt::Debug, T>(
    run: impl FnOnce(&mut dyn FnMut(&brgemm_dl::train::EpochReport)) -> Result<T, E>,
) -> (f64, f32) {
    let mut last = (0.0, 0.0);
    run(&mut |r| last = (r.test_accuracy, r.loss)).unwrap();
    last
}

/// A device run's accuracy within half a point of the CPU run's, its loss
/// to rounding (the same seeds, data order and minibatches).
#[cfg(feature = "gpu")]
fn same_run(what: &str, gpu: (f64, f32), cpu: (f64, f32)) {
    assert!(
        (gpu.0 - cpu.0).abs() <= 0.005,
        "{what} accuracy: opencl {}, cpu {}",
        gpu.0,
        cpu.0
    );
    assert!(
        (gpu.1 - cpu.1).abs() <= 1e-3 * cpu.1.abs().max(1.0),
        "{what} loss: opencl {}, cpu {}",
        gpu.1,
        cpu.1
    );
}

/// The CNN trained on an OpenCL device (PoCL in CI) from the same seeds,
/// data order and minibatches as the CPU graph reaches the CPU run's test
/// accuracy within half a point (in f32 the two runs agree to rounding).
#[cfg(feature = "gpu")]
#[test]
fn cnn_on_opencl_matches_the_cpu_run() {
    use brgemm_dl::gpu::{Backend, GpuDtype};
    let Some((mut tr, mut te)) = load() else {
        return;
    };
    if !opencl_ready() {
        return;
    }
    tr.data = tr.data.subset(&(0..1280).collect::<Vec<_>>());
    te.data = te.data.subset(&(0..1000).collect::<Vec<_>>());
    let cfg = train_cnn::CnnConfig {
        epochs: 1,
        ..Default::default()
    };
    let pool = Pool::new(2).unwrap();
    let cpu = last_epoch(|r| train_cnn::train(&cfg, &pool, &tr, &te, r));
    let gpu = last_epoch(|r| {
        brgemm_dl::train_gpu::train_cnn(&cfg, Backend::OpenCl, GpuDtype::F32, &tr, &te, r)
    });
    same_run("cnn", gpu, cpu);
}

/// The LSTM classifier (Fashion-MNIST read row by row) trained on an
/// OpenCL device from the same seeds and data order as the CPU graph ends
/// with the CPU run's accuracy within half a point.
#[cfg(feature = "gpu")]
#[test]
fn lstm_on_opencl_matches_the_cpu_run() {
    use brgemm_dl::gpu::{Backend, GpuDtype};
    use brgemm_dl::train_lstm;
    let Some((mut tr, mut te)) = load() else {
        return;
    };
    if !opencl_ready() {
        return;
    }
    tr.data = tr.data.subset(&(0..1280).collect::<Vec<_>>());
    te.data = te.data.subset(&(0..1000).collect::<Vec<_>>());
    let cfg = train_lstm::SeqConfig {
        epochs: 1,
        ..train_lstm::SeqConfig::lstm(28)
    };
    let pool = Pool::new(2).unwrap();
    let cpu = last_epoch(|r| train_lstm::train(&cfg, &pool, &tr.data, &te.data, r));
    let gpu = last_epoch(|r| {
        brgemm_dl::train_gpu::train_lstm(
            &cfg,
            Backend::OpenCl,
            GpuDtype::F32,
            &tr.data,
            &te.data,
            r,
        )
    });
    same_run("lstm", gpu, cpu);
}
