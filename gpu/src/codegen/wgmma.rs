//! The sm_90a kernel (see [`crate::hopper`] for the design): TMA into a
//! ring of 128-byte-swizzled stages, `mbarrier` hand-offs between one
//! producer warpgroup and two consumers, `wgmma` from shared-memory
//! descriptors, and the same epilogue and split-K partials as the
//! `mma.sync` kernel.
//!
//! Shared-memory layouts, as `wgmma`'s canonical 128-byte-swizzle forms:
//! - A (m contiguous: "M-major", `imm-trans-a` = 1): each consumer's 64
//!   rows are a `[64 k][64 m]` tile, 128 bytes per k row, atoms of 8 k rows
//!   (1024 bytes, the descriptor's stride byte offset); a k16 step is 2048
//!   bytes further.
//! - B (k contiguous: "K-major"): `[bn][64 k]`, 128 bytes per column of C,
//!   atoms of 8 columns (1024 bytes); a k16 step is 32 bytes further inside
//!   the swizzled row (the swizzle is a function of the address, which TMA
//!   and `wgmma` apply alike on the 1024-byte aligned ring).

use super::{activation_expr, epilogue_value, prelude};
use crate::desc::{GpuBatch, GpuDescriptor, GpuDtype};
use crate::hopper::{batch_inner, HopperTiling};
use std::fmt::Write;

/// Name of the sm_90a kernel of `d` with tiling `h`.
pub fn wgmma_name(d: &GpuDescriptor, h: &HopperTiling) -> String {
    format!("{}_sm90a_n{}s{}", super::kernel_names(d).0, h.bn, h.stages)
}

/// CUDA source of the sm_90a kernel for a validated, eligible descriptor
/// (see [`crate::hopper::hopper_eligible`]), and its function name.
///
/// Arguments, in order: the tensor maps of A and B (`CUtensorMap`, by
/// value), `C` (f32), `bias` (f32; any buffer without one), `batch` (int),
/// `P` (f32 partials of a split launch, as the `mma.sync` kernel's).
/// Launch: 384 threads, `h.shared_bytes()` of dynamic shared memory, grid
/// `(n / bn, m / 128, splits)`.
pub fn wgmma_source(d: &GpuDescriptor, h: &HopperTiling) -> (String, String) {
    let name = wgmma_name(d, h);
    let GpuBatch::Stride { a: sa, b: sb } = d.batch_form else {
        panic!("the sm_90a kernel takes the stride form (checked by hopper_eligible)");
    };
    let ty = if d.dtype == GpuDtype::Bf16 {
        "bf16"
    } else {
        "f16"
    };
    let bn = h.bn;
    let nacc = bn / 2;
    let mut s = String::new();
    s.push_str(prelude(super::Target::Cuda));
    let defs: [(&str, usize); 9] = [
        ("M", d.m),
        ("N", d.n),
        ("LDC", d.ldc),
        ("BN", bn),
        ("KT", d.k.div_ceil(HopperTiling::BK)),
        ("STAGES", h.stages),
        ("STAGE_BYTES", h.stage_bytes()),
        ("A_HALF", 64 * HopperTiling::BK * 2),
        ("B_OFF", HopperTiling::BM * HopperTiling::BK * 2),
    ];
    for (k, v) in defs {
        writeln!(s, "#define {k} {v}").unwrap();
    }
    // Tensor-map coordinates: (inner, rows-or-columns, batch entry), with
    // the two outer dimensions swapped where the batch stride is the
    // smaller (see hopper::batch_inner).
    let coords = |inner_first: &str, outer: &str, swap: bool| {
        if swap {
            format!("{inner_first}, bi, {outer}")
        } else {
            format!("{inner_first}, {outer}, bi")
        }
    };
    let a_xy = |mrow: &str| coords(mrow, "k0", batch_inner(d.lda, sa));
    let b_xy = coords("k0", "n0", batch_inner(d.ldb, sb));
    s.push_str(HOPPER_HELPERS);
    // The wgmma of one k16 step: BN/2 accumulators, A and B descriptors,
    // scale-d 1, A M-major (transposed), B K-major.
    let regs = (0..nacc)
        .map(|i| format!("%{i}"))
        .collect::<Vec<_>>()
        .join(",");
    let outs = (0..nacc)
        .map(|i| format!("\"+f\"(c[{i}])"))
        .collect::<Vec<_>>()
        .join(", ");
    writeln!(
        s,
        "__device__ __forceinline__ void wgmma_step(float* c, u64 da, u64 db) {{\n  \
         asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{p}, 0;\\n\"\n    \
         \"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ty}.{ty} {{{regs}}}, %{da}, %{db}, p, 1, 1, 1, 0;\\n}}\\n\"\n    \
         : {outs}\n    : \"l\"(da), \"l\"(db), \"r\"(1));\n}}",
        p = nacc + 2,
        da = nacc,
        db = nacc + 1,
    )
    .unwrap();
    let grow = if bn > 128 {
        // 128 accumulators per consumer thread: registers move from the
        // producer, which needs few, to the consumers.
        ("  setmaxnreg_dec40();\n", "    setmaxnreg_inc232();\n")
    } else {
        ("", "")
    };
    writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({threads}, 1) {name}(\n    \
         const __grid_constant__ TmaMap tA, const __grid_constant__ TmaMap tB,\n    \
         float* __restrict__ C, const float* __restrict__ bias, int batch, float* __restrict__ P)\n{{\n  \
         extern __shared__ unsigned char smem_raw[];\n  \
         const unsigned ring = (smem_u32(smem_raw) + 1023u) & ~1023u;\n  \
         const unsigned bars = ring + STAGES * STAGE_BYTES;\n  \
         const int tid = threadIdx.x, wg = tid >> 7;\n  \
         const int m0 = BY * 128, n0 = BX * BN;\n  \
         const int all = batch * KT;\n  \
         const int t_lo = (int)(((idx_t)all * BZ) / GZ);\n  \
         const int total = (int)(((idx_t)all * (BZ + 1)) / GZ) - t_lo;\n  \
         if (tid == 0) {{\n    \
         for (int s = 0; s < STAGES; ++s) {{ mbar_init(FULL(s), 1); mbar_init(EMPTY(s), 2); }}\n    \
         fence_barrier_init();\n  }}\n  \
         __syncthreads();\n  \
         if (wg == 0) {{\n{dec}    \
         if (tid == 0) {{\n      \
         for (int t = 0; t < total; ++t) {{\n        \
         const int s = t % STAGES;\n        \
         // Wait until both consumers released this stage's previous use.\n        \
         if (t >= STAGES) mbar_wait(EMPTY(s), ((t / STAGES) & 1) ^ 1);\n        \
         mbar_expect_tx(FULL(s), STAGE_BYTES);\n        \
         const int tile = t_lo + t, bi = tile / KT, k0 = (tile % KT) * 64;\n        \
         const unsigned st = ring + s * STAGE_BYTES;\n        \
         tma_load3(st, &tA, {a0}, FULL(s));\n        \
         tma_load3(st + A_HALF, &tA, {a1}, FULL(s));\n        \
         tma_load3(st + B_OFF, &tB, {b_xy}, FULL(s));\n      }}\n    }}\n  \
         }} else {{\n{inc}    \
         const int cg = wg - 1, lt = tid & 127;\n    \
         float acc[{nacc}];\n    \
         #pragma unroll\n    for (int i = 0; i < {nacc}; ++i) acc[i] = 0.0f;\n    \
         for (int t = 0; t < total; ++t) {{\n      \
         const int s = t % STAGES;\n      \
         mbar_wait(FULL(s), (t / STAGES) & 1);\n      \
         const unsigned st = ring + s * STAGE_BYTES;\n      \
         #pragma unroll\n      for (int i = 0; i < {nacc}; ++i) fence_reg(acc[i]);\n      \
         wgmma_fence();\n      \
         #pragma unroll\n      for (int ks = 0; ks < 4; ++ks)\n        \
         wgmma_step(acc, sw128_desc(st + cg * A_HALF + ks * 2048), sw128_desc(st + B_OFF + ks * 32));\n      \
         wgmma_commit();\n      \
         // The previous stage's wgmmas are done: hand it back.\n      \
         wgmma_wait1();\n      \
         #pragma unroll\n      for (int i = 0; i < {nacc}; ++i) fence_reg(acc[i]);\n      \
         if (t > 0 && lt == 0) mbar_arrive(EMPTY((t - 1) % STAGES));\n    }}\n    \
         wgmma_wait0();\n    \
         #pragma unroll\n    for (int i = 0; i < {nacc}; ++i) fence_reg(acc[i]);\n    \
         const int g = (lt & 31) >> 2, tg = lt & 3;\n    \
         const int rbase = m0 + cg * 64 + (lt >> 5) * 16 + g;",
        threads = HopperTiling::THREADS,
        a0 = a_xy("m0"),
        a1 = a_xy("m0 + 64"),
        dec = grow.0,
        inc = grow.1,
    )
    .unwrap();
    let v_expr = epilogue_value(d, "acc[i]");
    // Accumulator i of the m64nN fragment: n8 block i/4, row +8 for i%4 >= 2,
    // column +1 for odd i (the mma.m16n8 C layout, per warp of 16 rows).
    writeln!(
        s,
        "    #pragma unroll\n    for (int i = 0; i < {nacc}; ++i) {{\n      \
         const int r = rbase + 8 * ((i >> 1) & 1);\n      \
         const int c = n0 + 8 * (i >> 2) + 2 * tg + (i & 1);\n      \
         if (r < M && c < N) {{\n        \
         if (GZ > 1) {{\n          P[(idx_t)BZ * M * N + r + (idx_t)c * M] = acc[i];\n          continue;\n        }}\n        \
         const idx_t ci = r + (idx_t)c * LDC;\n        \
         const float v = {v_expr};\n        \
         C[ci] = {};\n      }}\n    }}\n  }}\n}}",
        activation_expr(d.epilogue.activation, "v")
    )
    .unwrap();
    (s, name)
}

/// Header-free PTX for the sm_90a kernel: the tensor-map parameter type,
/// mbarriers, the bulk tensor copy, wgmma fences and descriptors.
const HOPPER_HELPERS: &str = r#"struct __align__(64) TmaMap { u64 v[16]; };
#define FULL(s) (bars + 8u * (s))
#define EMPTY(s) (bars + 8u * (STAGES + (s)))
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_load3(unsigned dst, const TmaMap* map, int c0, int c1, int c2, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
    :: "r"(dst), "l"((u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
// Shared-memory matrix descriptor, 128-byte swizzle: start address,
// leading byte offset 16 (unused by these layouts), stride byte offset 1024
// (one 8-row atom), all in 16-byte units.
__device__ __forceinline__ u64 sw128_desc(unsigned addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
__device__ __forceinline__ void setmaxnreg_dec40() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;"); }
__device__ __forceinline__ void setmaxnreg_inc232() { asm volatile("setmaxnreg.inc.sync.aligned.u32 232;"); }
"#;
