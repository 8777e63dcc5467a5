//! `bench -- gpu [--device cuda|opencl] [--quick]`: the generated BRGEMM in
//! TFLOP/s and, on CUDA, cuBLAS (`cublasGemmEx`, same inputs, f32
//! accumulation) on the same work in the same run: the batch of k-deep
//! pairs is one GEMM with k*batch for cuBLAS (A_i side by side along k,
//! B_i stacked: B is (k*batch) x n with B_i = B + i*k).

use brgemm_dl::gpu::{Backend, Device, GpuBatch, GpuBrgemm, GpuDescriptor, GpuDtype};
use std::time::Instant;

const SHAPES: [(usize, usize, usize, usize); 3] =
    [(128, 128, 64, 64), (256, 128, 64, 32), (4096, 4096, 64, 64)];

/// Median seconds per call of `f` (after a warm-up), `reps` calls a sample.
fn time(dev: &Device, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    dev.synchronize().expect("sync");
    let mut s: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f();
            }
            dev.synchronize().expect("sync");
            t.elapsed().as_secs_f64() / reps as f64
        })
        .collect();
    s.sort_by(f64::total_cmp);
    s[2]
}

pub fn bench_gpu(args: &[String], quick: bool) {
    let device = args
        .iter()
        .position(|a| a == "--device")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
        .unwrap_or("cuda");
    let backend: Backend = device.parse().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let dev = match Device::open(backend) {
        Ok(d) => d,
        Err(e) => {
            println!(
                "{{\"bench\":\"gpu\",\"device\":\"{device}\",\"skipped\":\"{}\"}}",
                e.to_string().replace('"', "'")
            );
            return;
        }
    };
    let cuda = dev.backend() == Backend::Cuda;
    for dt in [GpuDtype::Bf16, GpuDtype::F16] {
        for &(m, n, k, batch) in &SHAPES {
            // The big shape takes seconds per call on a CPU OpenCL device.
            if (quick || !cuda) && m * n * k * batch > 1 << 28 {
                continue;
            }
            let kb = k * batch;
            let d = GpuDescriptor::new(m, n, k)
                .ldb(kb)
                .dtype(dt)
                .batch(GpuBatch::Stride { a: m * k, b: k });
            let kern = GpuBrgemm::new(&d).expect("descriptor");
            let fill = |len: usize| -> Vec<u16> {
                (0..len)
                    .map(|i| {
                        let x = ((i * 7919) % 201) as f32 / 100.0 - 1.0;
                        match dt {
                            GpuDtype::Bf16 => half::bf16::from_f32(x).to_bits(),
                            _ => half::f16::from_f32(x).to_bits(),
                        }
                    })
                    .collect()
            };
            let a = dev.upload(&fill(m * kb)).expect("upload");
            let b = dev.upload(&fill(kb * n)).expect("upload");
            let mut c = dev.alloc(m * n * 4).expect("alloc");
            let flops = d.flops(batch);
            let reps = if cuda {
                (2e10 / flops).clamp(3.0, 200.0) as usize
            } else {
                1
            };
            let t = time(&dev, reps, || {
                kern.execute(&dev, &a, &b, &mut c, None, None, batch)
                    .expect("launch");
            });
            let ours = flops / t / 1e12;
            let tiling = kern.descriptor().tiling.expect("resolved");
            let mut line = format!(
                "{{\"bench\":\"gpu\",\"device\":\"{}\",\"dtype\":\"{}\",\"m\":{m},\"n\":{n},\"k\":{k},\"batch\":{batch},\"tile\":\"{}x{}x{}/{}x{} warps/{} stages\",\"tflops\":{ours:.3}",
                dev.name(),
                dt.name(),
                tiling.bm,
                tiling.bn,
                tiling.bk,
                tiling.warps_m,
                tiling.warps_n,
                tiling.stages
            );
            if cuda {
                let mut c2 = dev.alloc(m * n * 4).expect("alloc");
                let tc = time(&dev, reps, || {
                    dev.cublas_gemm(dt, (m, n, kb), &a, m, &b, kb, &mut c2, m)
                        .expect("cublas");
                });
                let theirs = flops / tc / 1e12;
                // Same inputs, same f32 accumulation: the results agree to
                // summation-order rounding.
                let x: Vec<f32> = dev.download(&c, m * n).expect("download");
                let y: Vec<f32> = dev.download(&c2, m * n).expect("download");
                let err = x
                    .iter()
                    .zip(&y)
                    .map(|(p, q)| (p - q).abs())
                    .fold(0.0f32, f32::max);
                line += &format!(
                    ",\"cublas_tflops\":{theirs:.3},\"ratio\":{:.3},\"max_abs_diff\":{err:.2e}",
                    ours / theirs
                );
            }
            println!("{line}}}");
        }
    }
}
