//! The OpenCL twin's emulated tensor core reads A and B through the
//! `mma.m16n8k16` fragment layouts written once in the generator: a wrong
//! layout must give wrong results on PoCL. Its own test binary, since the
//! planted fault holds for every kernel generated in the process.

mod common;
use brgemm_gpu::codegen::{set_fragment_fault, FragmentFault};
use brgemm_gpu::{GpuBatch, GpuDescriptor, GpuDtype};
use common::*;

#[test]
fn a_wrong_fragment_layout_fails_and_the_right_one_passes() {
    let Some(dev) = opencl() else { return };
    for dt in [GpuDtype::Bf16, GpuDtype::F16] {
        let d = GpuDescriptor::new(64, 48, 64)
            .dtype(dt)
            .batch(GpuBatch::Stride {
                a: 64 * 64,
                b: 64 * 48,
            });
        let p = Problem::new(&d, 2, 7);
        for fault in [FragmentFault::SwapASlots, FragmentFault::BColumnFromTg] {
            set_fragment_fault(Some(fault));
            let got = p.run(dev).unwrap();
            set_fragment_fault(None);
            assert!(
                p.check(&got).is_err(),
                "{dt:?}: the planted {fault:?} went unnoticed"
            );
        }
        let got = p.run(dev).unwrap();
        p.check(&got)
            .unwrap_or_else(|e| panic!("{dt:?} without a fault: {e}"));
    }
}
