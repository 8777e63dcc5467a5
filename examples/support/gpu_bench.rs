//! `bench -- gpu [--device cuda|opencl] [--quick]`: the generated BRGEMM in
//! TFLOP/s and, on CUDA, cuBLAS (`cublasGemmEx`, same inputs, f32
//! accumulation) on the same work in the same run: the batch of k-deep
//! pairs is one GEMM with k*batch for cuBLAS (A_i side by side along k,
//! B_i stacked: B is (k*batch) x n with B_i = B + i*k).

use brgemm_dl::gpu::{
    Backend, Device, GpuBatch, GpuBrgemm, GpuDescriptor, GpuDtype, GpuPath, HopperTiling, Tiling,
};
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
            let flops = d.flops(batch);
            let reps = if cuda {
                (2e10 / flops).clamp(3.0, 200.0) as usize
            } else {
                1
            };
            // cuBLAS once per shape, the yardstick of every variant below.
            let mut yard = None;
            if cuda {
                let mut c2 = dev.alloc(m * n * 4).expect("alloc");
                let tc = time(&dev, reps, || {
                    dev.cublas_gemm(dt, (m, n, kb), &a, m, &b, kb, &mut c2, m)
                        .expect("cublas");
                });
                let y: Vec<f32> = dev.download(&c2, m * n).expect("download");
                yard = Some((flops / tc / 1e12, y));
            }
            // The mma.sync kernel, then (on sm_90) the sm_90a kernel with
            // its default tiling and, on the large shape, the others.
            // (path, sm_90a tiling, mma tiling); None: the default.
            let mut variants: Vec<(GpuPath, Option<HopperTiling>, Option<Tiling>)> =
                vec![(GpuPath::Mma, None, None)];
            let base = GpuBrgemm::new(&d).expect("descriptor");
            let portable = Tiling::heuristic(m, n, dt);
            let default = base.mma_tiling(&dev, batch).ok();
            if cuda && default != Some(portable) {
                // The CUDA default against the portable (48 KiB) tiling.
                variants.push((GpuPath::Mma, None, Some(portable)));
            }
            if cuda && m * n >= 1 << 20 {
                // Other warp tiles (64x64 of C: twice the mma per ldmatrix
                // of 64x32), k depths and rings.
                for t in brgemm_dl::gpu::MMA_CANDIDATES {
                    if Some(t) != default && t != portable {
                        variants.push((GpuPath::Mma, None, Some(t)));
                    }
                }
            }
            if cuda && base.path_on(&dev).ok() == Some(GpuPath::Mma) {
                // Auto chose mma: the sm_90a kernel does not apply here.
            } else if cuda {
                variants.push((GpuPath::Wgmma, None, None));
                if m * n >= 1 << 20 {
                    let default = base.hopper_tiling();
                    for (bn, stages) in [(128, 4), (128, 6), (256, 3), (256, 4)] {
                        let h = HopperTiling { bn, stages };
                        if h != default {
                            variants.push((GpuPath::Wgmma, Some(h), None));
                        }
                    }
                }
            }
            for (path, h, mt) in variants {
                let dv = match mt {
                    Some(t) => d.tiling(t),
                    None => d,
                };
                let mut kern = GpuBrgemm::new(&dv).expect("descriptor").with_path(path);
                if let Some(h) = h {
                    kern = kern.with_hopper_tiling(h).expect("tiling");
                }
                let mut c = dev.alloc(m * n * 4).expect("alloc");
                let run = |c: &mut brgemm_dl::gpu::Buffer| {
                    kern.execute(&dev, &a, &b, c, None, None, batch)
                };
                if let Err(e) = run(&mut c) {
                    println!(
                        "{{\"bench\":\"gpu\",\"dtype\":\"{}\",\"m\":{m},\"n\":{n},\"k\":{k},\"batch\":{batch},\"path\":\"{path:?}\",\"error\":\"{}\"}}",
                        dt.name(),
                        e.to_string().replace('"', "'")
                    );
                    continue;
                }
                let t = time(&dev, reps, || {
                    run(&mut c).expect("launch");
                });
                let ours = flops / t / 1e12;
                let tile = match kern.path_on(&dev).expect("path") {
                    GpuPath::Wgmma => {
                        let h = kern.hopper_tiling();
                        format!("128x{}x64/wgmma/{} stages", h.bn, h.stages)
                    }
                    _ => {
                        let t = kern.mma_tiling(&dev, batch).expect("tiling");
                        format!(
                            "{}x{}x{}/{}x{} warps/{} stages",
                            t.bm, t.bn, t.bk, t.warps_m, t.warps_n, t.stages
                        )
                    }
                };
                let mut line = format!(
                    "{{\"bench\":\"gpu\",\"device\":\"{}\",\"dtype\":\"{}\",\"m\":{m},\"n\":{n},\"k\":{k},\"batch\":{batch},\"path\":\"{:?}\",\"tile\":\"{tile}\",\"tflops\":{ours:.3}",
                    dev.name(),
                    dt.name(),
                    kern.path_on(&dev).expect("path"),
                );
                if let Some((theirs, y)) = &yard {
                    // Same inputs, same f32 accumulation: the results agree
                    // to summation-order rounding.
                    let x: Vec<f32> = dev.download(&c, m * n).expect("download");
                    let err = x
                        .iter()
                        .zip(y)
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
}
