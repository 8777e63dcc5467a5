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

/// The CNN trained on an OpenCL device (PoCL in CI) from the same seeds,
/// data order and minibatches as the CPU graph reaches the CPU run's test
/// accuracy within half a point (in f32 the two runs agree to rounding).
#[cfg(feature = "gpu")]
#[test]
fn cnn_on_opencl_matches_the_cpu_run() {
    use brgemm_dl::gpu::{Backend, Device, GpuDtype};
    let Some((mut tr, mut te)) = load() else {
        return;
    };
    if let Err(e) = Device::open(Backend::OpenCl) {
        assert!(
            std::env::var("BRGEMM_REQUIRE_OPENCL").as_deref() != Ok("1"),
            "BRGEMM_REQUIRE_OPENCL=1 but: {e}"
        );
        eprintln!("SKIPPED: no OpenCL device ({e})");
        return;
    }
    tr.data = tr.data.subset(&(0..1280).collect::<Vec<_>>());
    te.data = te.data.subset(&(0..1000).collect::<Vec<_>>());
    let cfg = train_cnn::CnnConfig {
        epochs: 1,
        ..Default::default()
    };
    let pool = Pool::new(2).unwrap();
    let (mut cpu, mut cpu_loss) = (0.0, 0.0);
    train_cnn::train(&cfg, &pool, &tr, &te, |r| {
        (cpu, cpu_loss) = (r.test_accuracy, r.loss)
    })
    .unwrap();
    let (mut gpu, mut gpu_loss) = (0.0, 0.0);
    brgemm_dl::train_gpu::train_cnn(&cfg, Backend::OpenCl, GpuDtype::F32, &tr, &te, |r| {
        (gpu, gpu_loss) = (r.test_accuracy, r.loss)
    })
    .unwrap();
    assert!(
        (gpu - cpu).abs() <= 0.005,
        "accuracy: opencl {gpu}, cpu {cpu}"
    );
    assert!(
        (gpu_loss - cpu_loss).abs() <= 1e-3 * cpu_loss.abs().max(1.0),
        "loss: opencl {gpu_loss}, cpu {cpu_loss}"
    );
}
