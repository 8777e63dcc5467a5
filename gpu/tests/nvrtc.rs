//! Every variant of the OpenCL sweep, generated as CUDA, compiles with NVRTC
//! for sm_80 and sm_90; ptxas assembles the PTX with `-v`: no spills, no
//! stack frame (the accumulators stay in registers) and at most the register
//! budget the tiling's `__launch_bounds__` assumes.
//!
//! Needs `libnvrtc.so.12` on the library path and `BRGEMM_PTXAS` pointing at
//! ptxas (the test script installs both from PyPI); without them it says it
//! skipped, unless `BRGEMM_REQUIRE_NVRTC=1`.

mod common;
use brgemm_gpu::ptxas::Usage;
use brgemm_gpu::{codegen, compile_cubin, compile_ptx, nvrtc_available, GpuDtype, Target};
use common::*;
use std::process::Command;

fn tools() -> Option<String> {
    let require = std::env::var("BRGEMM_REQUIRE_NVRTC").as_deref() == Ok("1");
    let ptxas = std::env::var("BRGEMM_PTXAS").ok();
    match (nvrtc_available(), ptxas) {
        (true, Some(p)) => Some(p),
        (have, p) => {
            let why = format!("libnvrtc found: {have}, BRGEMM_PTXAS: {p:?}");
            assert!(!require, "BRGEMM_REQUIRE_NVRTC=1 but {why}");
            println!("skipped: NVRTC/ptxas checks need libnvrtc.so.12 and BRGEMM_PTXAS ({why})");
            None
        }
    }
}

/// ptxas's report on `ptx` for `arch` (the cubin is written and dropped).
fn ptxas_usage(ptxas: &str, ptx: &str, arch: &str, tag: &str) -> Usage {
    let dir = std::env::temp_dir().join(format!("brgemm-gpu-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!("{tag}_{arch}.ptx"));
    std::fs::write(&p, ptx).unwrap();
    let out = Command::new(ptxas)
        .args(["-v", &format!("-arch={arch}")])
        .arg(&p)
        .arg("-o")
        .arg(dir.join(format!("{tag}_{arch}.cubin")))
        .output()
        .expect("run ptxas");
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "ptxas failed for {tag} {arch}:\n{log}"
    );
    Usage::parse(&log).unwrap_or_else(|| panic!("no usage report in:\n{log}"))
}

#[test]
fn every_variant_compiles_without_spills() {
    let Some(ptxas) = tools() else { return };
    let mut cases = sweep();
    cases.extend((0..24).map(|s| random_case(1000 + s)));
    // The CUDA defaults, whose deeper rings take dynamic shared memory
    // past 48 KiB.
    for (m, n) in [(128, 128), (64, 64), (32, 32), (128, 32), (256, 200)] {
        for dt in [GpuDtype::Bf16, GpuDtype::F16, GpuDtype::F32] {
            let t = brgemm_gpu::Tiling::heuristic_cuda(m, n, dt);
            let d = brgemm_gpu::GpuDescriptor::new(m, n, 64).dtype(dt).tiling(t);
            cases.push((d, 1));
        }
    }
    // The tilings `bench gpu` measures on the large shape.
    for t in brgemm_gpu::MMA_CANDIDATES {
        for dt in [GpuDtype::Bf16, GpuDtype::F16] {
            let d = brgemm_gpu::GpuDescriptor::new(4096, 4096, 64)
                .dtype(dt)
                .tiling(t);
            cases.push((d, 1));
        }
    }
    let mut n = 0;
    for (d, _) in cases {
        let d = d.validate().unwrap();
        let t = d.tiling.unwrap();
        let (src, name) = codegen::brgemm_source(&d, Target::Cuda);
        for arch in ["sm_80", "sm_90"] {
            let ptx = compile_ptx(&src, &name, arch).unwrap_or_else(|e| panic!("{e}\n{src}"));
            if d.dtype != GpuDtype::F32 {
                let ty = d.dtype.name();
                let mma = format!("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32");
                assert!(ptx.contains(&mma), "{name}: no {mma}");
                assert!(
                    ptx.contains("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"),
                    "{name}: no ldmatrix"
                );
            }
            if d.lda % (16 / d.dtype.size()) == 0
                && matches!(d.batch_form, brgemm_gpu::GpuBatch::Stride { a, .. } if a % (16 / d.dtype.size()) == 0)
            {
                assert!(
                    ptx.contains("cp.async.cg.shared.global"),
                    "{name}: no cp.async on the aligned path"
                );
            }
            let u = ptxas_usage(&ptxas, &ptx, arch, &name);
            let budget = t.register_budget(d.dtype);
            println!(
                "{name} {arch}: {} registers (budget {budget}, {} accumulators), {u:?}",
                u.registers,
                t.accumulators()
            );
            assert!(u.in_registers(), "{name} {arch}: spills or stack: {u:?}");
            assert!(
                u.registers <= budget,
                "{name} {arch}: {} registers > budget {budget}",
                u.registers
            );
            n += 1;
        }
    }
    println!("{n} kernels compiled by NVRTC and assembled by ptxas: no spills, within budget");
}

/// The sm_90a kernel, for every tile width and both 16-bit types, over
/// the Hopper cases (edges, swapped batch dimensions, epilogues): NVRTC
/// compiles it for sm_90a, ptxas assembles it with no spill and no stack,
/// and the PTX holds the instructions the design rests on.
#[test]
fn wgmma_variants_compile_for_sm_90a() {
    let Some(ptxas) = tools() else { return };
    let mut n = 0;
    for seed in 0..12u64 {
        let (d, _, mut h, _) = hopper_case(300 + seed);
        h.bn = [64, 128, 256][seed as usize % 3];
        let d = d.validate().unwrap();
        let (src, name) = codegen::wgmma_source(&d, &h);
        let ptx = compile_ptx(&src, &name, "sm_90a").unwrap_or_else(|e| panic!("{e}\n{src}"));
        for needle in [
            format!("wgmma.mma_async.sync.aligned.m64n{}k16.f32", h.bn),
            "cp.async.bulk.tensor.3d".to_string(),
            "mbarrier.try_wait.parity".to_string(),
            "wgmma.wait_group.sync.aligned".to_string(),
        ] {
            assert!(ptx.contains(&needle), "{name}: no {needle}");
        }
        let u = ptxas_usage(&ptxas, &ptx, "sm_90a", &name);
        println!("{name} sm_90a: {u:?}");
        assert!(u.in_registers(), "{name}: spills or stack: {u:?}");
        n += 1;
    }
    println!("{n} sm_90a kernels: wgmma, TMA, mbarrier; no spills");
}

#[test]
fn elementwise_kernels_compile() {
    let Some(_) = tools() else { return };
    let src = codegen::elementwise_source(Target::Cuda);
    for arch in ["sm_80", "sm_90"] {
        compile_ptx(&src, "elementwise", arch).unwrap_or_else(|e| panic!("{e}\n{src}"));
    }
}

/// What the CUDA backend loads: NVRTC's cubin for the exact architecture,
/// an ELF for NVIDIA GPUs (machine EM_CUDA, 190) of that SM that holds the
/// kernel; a bad architecture or source is an error carrying NVRTC's log.
#[test]
fn kernels_compile_to_cubins_for_the_exact_architecture() {
    let Some(_) = tools() else { return };
    let (d, _) = sweep().into_iter().next().unwrap();
    let d = d.validate().unwrap();
    let (src, name) = codegen::brgemm_source(&d, Target::Cuda);
    for (arch, sm) in [("sm_80", 80u32), ("sm_90", 90)] {
        let cubin = compile_cubin(&src, &name, arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&cubin[..4], b"\x7fELF", "{arch}: not an ELF");
        assert_eq!(
            u16::from_le_bytes([cubin[18], cubin[19]]),
            190,
            "{arch}: not EM_CUDA"
        );
        // e_flags (64-bit ELF, offset 48) carry the SM in their low bits.
        let flags = u32::from_le_bytes(cubin[48..52].try_into().unwrap());
        assert!(
            flags & 0xff == sm || (flags >> 8) & 0xff == sm,
            "{arch}: e_flags {flags:#x}"
        );
        let has_name = cubin.windows(name.len()).any(|w| w == name.as_bytes());
        assert!(has_name, "{arch}: {name} not in the cubin");
    }
    let e = compile_cubin(&src, &name, "sm_1").unwrap_err().to_string();
    assert!(e.contains(&name), "{e}");
    let e = compile_cubin("this is not CUDA", "bad", "sm_90")
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad") && e.contains("error"), "{e}");
}
