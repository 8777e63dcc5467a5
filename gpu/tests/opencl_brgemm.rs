//! The generated BRGEMM executed on OpenCL (PoCL in CI): every dtype, batch
//! form, beta, epilogue, edge tile and copy path against the f64 reference.

mod common;
use brgemm_gpu::{BatchTable, Error, GpuBatch, GpuBrgemm, GpuDescriptor, GpuDtype, Tiling};
use common::*;
use proptest::prelude::*;

#[test]
fn sweep_matches_reference() {
    let Some(dev) = opencl() else { return };
    println!("OpenCL device: {}", dev.name());
    for (i, (d, batch)) in sweep().into_iter().enumerate() {
        let p = Problem::new(&d, batch, i as u64 + 1);
        let got = p.run(dev).unwrap_or_else(|e| panic!("{d:?}: {e}"));
        p.check(&got).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
    #[test]
    fn random_shapes_match_reference(seed in any::<u64>()) {
        let Some(dev) = opencl() else { return Ok(()) };
        let (d, batch) = random_case(seed);
        let p = Problem::new(&d, batch, seed);
        let got = p.run(dev).map_err(|e| TestCaseError::fail(format!("{d:?}: {e}")))?;
        p.check(&got).map_err(TestCaseError::fail)?;
    }
}

fn err<T>(r: Result<T, Error>) -> String {
    r.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn split_batch_reduce_matches_reference() {
    // Slices of the batch x k tiles summed in order by the reduce kernel,
    // which then applies alpha, beta, bias and activation: every case of
    // the sweep (all forms, beta 0/1, epilogues, edge tiles, zero batch)
    // with 2, 3 and 7 slices (clamped to the tiles there are).
    let Some(dev) = opencl() else { return };
    for (i, (d, batch)) in sweep().into_iter().enumerate() {
        let p = Problem::new(&d, batch, i as u64 + 101);
        for s in [2, 3, 7] {
            let got = p
                .run_split(dev, Some(s))
                .unwrap_or_else(|e| panic!("{d:?} split {s}: {e}"));
            p.check(&got)
                .unwrap_or_else(|e| panic!("{d:?} batch {batch} split {s}: {e}"));
        }
    }
}

#[test]
fn bad_descriptors_and_buffers_are_named() {
    assert!(err(GpuDescriptor::new(0, 4, 4).validate()).contains("m = 0"));
    assert!(err(GpuDescriptor::new(8, 4, 4).lda(7).validate()).contains("lda = 7"));
    assert!(err(GpuDescriptor::new(8, 4, 4).ldb(3).validate()).contains("ldb = 3"));
    let t = Tiling {
        bm: 48,
        bn: 32,
        bk: 32,
        warps_m: 2,
        warps_n: 1,
        stages: 2,
    };
    assert!(err(GpuDescriptor::new(8, 4, 4).tiling(t).validate()).contains("tiling.bm = 48"));
    let t = Tiling {
        bm: 128,
        bn: 128,
        bk: 64,
        warps_m: 2,
        warps_n: 4,
        stages: 4,
    };
    assert!(err(GpuDescriptor::new(8, 4, 4)
        .dtype(GpuDtype::F32)
        .tiling(t)
        .validate())
    .contains("shared memory"));
    let Some(dev) = opencl() else { return };
    let d = GpuDescriptor::new(16, 8, 8).dtype(GpuDtype::F32);
    let k = GpuBrgemm::new(&d).unwrap();
    let a = dev.alloc(16 * 8 * 4).unwrap();
    let b = dev.alloc(8 * 8 * 4).unwrap();
    let mut c = dev.alloc(16 * 8 * 4).unwrap();
    // Two pairs need twice the A that was allocated.
    assert!(err(k.execute(dev, &a, &b, &mut c, None, None, 2)).contains("invalid A"));
    let mut small = dev.alloc(4).unwrap();
    assert!(err(k.execute(dev, &a, &b, &mut small, None, None, 1)).contains("invalid C"));
    let kb = GpuBrgemm::new(&d.epilogue(true, brgemm::Activation::Relu)).unwrap();
    assert!(err(kb.execute(dev, &a, &b, &mut c, None, None, 1)).contains("invalid bias"));
    let o = d.batch(GpuBatch::Offset);
    assert!(err(BatchTable::offsets(dev, &o, &[0, 3], &[0, 0])).contains("offset a[1] = 3"));
    let t = BatchTable::offsets(dev, &o, &[0], &[0]).unwrap();
    let ko = GpuBrgemm::new(&o).unwrap();
    assert!(err(ko.execute(dev, &a, &b, &mut c, None, Some(&t), 2)).contains("batch = 2"));
    assert!(err(ko.execute(dev, &a, &b, &mut c, None, None, 1)).contains("needs a BatchTable"));
}

/// The device's local memory is read when it opens, and every tiling the
/// sweep plans fits it (on PoCL: its reported size).
#[test]
fn the_device_reports_its_local_memory_and_the_tilings_fit() {
    let Some(dev) = opencl() else { return };
    let have = dev.shared_memory();
    println!(
        "{}: {have} bytes of local memory per work-group",
        dev.name()
    );
    assert!(have >= 16 << 10, "OpenCL 1.2 guarantees 16 KiB, got {have}");
    for (d, _) in sweep() {
        let d = d.validate().unwrap();
        let need = d.tiling.unwrap().shared_bytes(d.dtype);
        assert!(need <= have, "{need} > {have}");
    }
}
