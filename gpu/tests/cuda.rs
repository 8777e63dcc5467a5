//! Numeric CUDA tests: the same sweep as on OpenCL, on a real GPU. Without a
//! CUDA device they print one line saying they were skipped.

mod common;
use common::*;

#[test]
fn sweep_matches_reference_on_cuda() {
    let Some(dev) = cuda() else { return };
    println!("CUDA device: {}", dev.name());
    let mut cases = sweep();
    cases.extend((0..32).map(|s| random_case(2000 + s)));
    for (i, (d, batch)) in cases.into_iter().enumerate() {
        let p = Problem::new(&d, batch, i as u64 + 7);
        let got = p.run(dev).unwrap_or_else(|e| panic!("{d:?}: {e}"));
        p.check(&got).unwrap();
    }
}
