//! Numeric CUDA tests: the same sweep as on OpenCL, on a real GPU, through
//! the `mma.sync` kernel and through whatever `Auto` picks; on an sm_90
//! device, the sm_90a kernel (TMA + wgmma) over the Hopper cases. Without a
//! CUDA device they print one line saying they were skipped, unless
//! `BRGEMM_REQUIRE_CUDA=1`.

mod common;
use brgemm_gpu::{GpuBrgemm, GpuPath};
use common::*;

#[test]
fn sweep_matches_reference_on_cuda() {
    let Some(dev) = cuda() else { return };
    println!("CUDA device: {}", dev.name());
    let mut cases = sweep();
    cases.extend((0..32).map(|s| random_case(2000 + s)));
    for (i, (d, batch)) in cases.into_iter().enumerate() {
        let p = Problem::new(&d, batch, i as u64 + 7);
        for path in [GpuPath::Mma, GpuPath::Auto] {
            let k = GpuBrgemm::new(&d).unwrap().with_path(path);
            let got = p
                .run_kernel(dev, k)
                .unwrap_or_else(|e| panic!("{d:?} {path:?}: {e}"));
            p.check(&got).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        }
    }
}

#[test]
fn wgmma_matches_reference_on_sm90() {
    let Some(dev) = cuda() else { return };
    let arch = dev.cuda().expect("a CUDA device").arch();
    if arch != "sm_90" {
        println!("skipped: the sm_90a kernel needs an sm_90 device, this is {arch}");
        return;
    }
    for seed in 0..60u64 {
        let (d, batch, h, split) = hopper_case(5000 + seed);
        let p = Problem::new(&d, batch, seed + 11);
        let k = GpuBrgemm::new(&d)
            .unwrap()
            .with_path(GpuPath::Wgmma)
            .with_hopper_tiling(h)
            .unwrap()
            .with_split(split);
        let got = p
            .run_kernel(dev, k)
            .unwrap_or_else(|e| panic!("{d:?} {h:?}: {e}"));
        p.check(&got)
            .unwrap_or_else(|e| panic!("{h:?} split {split:?}: {e}"));
    }
    println!("60 sm_90a cases match the f64 reference");
}
