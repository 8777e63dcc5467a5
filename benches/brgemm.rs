//! Criterion benchmarks of the BRGEMM kernel on the shapes, one
//! thread, stride form, every supported SIMD ISA, against a loop of `gemm`
//! crate calls on the same blocks. Throughput is reported in elements = flops.

#[path = "../examples/support/workload.rs"]
#[allow(dead_code)]
mod workload;

use brgemm::{BatchForm, Isa, Kernel, KernelOptions};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use workload::BrgemmWorkload;

const SHAPES: [(usize, usize, usize, usize); 5] = [
    (64, 64, 64, 16),
    (32, 32, 32, 32),
    (16, 16, 16, 64),
    (64, 32, 128, 8),
    (128, 28, 64, 16),
];

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("brgemm");
    g.sample_size(20);
    for (m, n, k, batch) in SHAPES {
        let mut w = BrgemmWorkload::new(m, n, k, batch, 1 << 20);
        let id = format!("{m}x{n}x{k}x{batch}");
        g.throughput(Throughput::Elements(w.flops_per_pass() as u64));
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable] {
            if !isa.is_supported() {
                continue;
            }
            let opts = KernelOptions {
                isa: Some(isa),
                tile: None,
                bf16: None,
            };
            let kern = Kernel::with_options(&w.descriptor(BatchForm::Packed), opts).unwrap();
            g.bench_function(BenchmarkId::new(isa.name(), &id), |bch| {
                bch.iter(|| w.pass(&kern))
            });
        }
        g.bench_function(BenchmarkId::new("gemm-crate-loop", &id), |bch| {
            bch.iter(|| w.pass_gemm_crate())
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
