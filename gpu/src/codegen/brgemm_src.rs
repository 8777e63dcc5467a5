//! The BRGEMM skeleton (see the module above for what is shared).

use super::fragment;
use super::{activation_expr, emulates_mma, epilogue_value, kernel_names, prelude, Target};
use crate::desc::{GpuBatch, GpuDescriptor, GpuDtype};
use std::fmt::Write;

/// Source of the kernel for a validated descriptor, and its function name.
///
/// Kernel arguments, in order: `A`, `B`, `C` (f32), `bias` (f32, length m;
/// any buffer when the epilogue has none), `ta`, `tb` (the offset or address
/// tables; any buffer in the stride form), `batch` (int), `P` (f32).
///
/// Split over the batch-reduce axis: the grid's z dimension cuts the
/// `batch x k` tiles into that many contiguous slices. With one slice the
/// block stores its C tile through the epilogue; with more, slice z stores
/// its raw partial sums to `P[z][n][m]` (dense, column-major), and
/// [`split_reduce_source`]'s kernel adds the slices in order and applies the
/// epilogue: deterministic, the same for any timing.
pub fn brgemm_source(d: &GpuDescriptor, target: Target) -> (String, String) {
    let t = d.tiling.expect("validated descriptor");
    let name = kernel_names(d).0;
    let cuda = target == Target::Cuda;
    let tensor_cores = cuda && d.dtype != GpuDtype::F32;
    // The OpenCL twin of the tensor-core path: the same fragments, moved
    // through local memory.
    let emulated = emulates_mma(target, d.dtype);
    let et = if d.dtype == GpuDtype::F32 {
        "float"
    } else {
        "u16"
    };
    let (va, vb) = (d.vec_a(), d.vec_b());
    let v = crate::dtype::vec16(d.dtype);
    // Whole tiles on CUDA: each thread's 16-byte chunks sit at fixed
    // offsets from the tile's corner, so their addresses are worked out
    // once, not per chunk and tile (the divisions and edge tests cost more
    // issue slots than the mma they feed).
    let threads = t.threads();
    let whole = |per_row: usize, rows: usize| {
        per_row > 0 && threads.is_multiple_of(per_row) && (rows * per_row).is_multiple_of(threads)
    };
    let fast = (
        cuda && va && whole(t.bm / v, t.bk),
        cuda && vb && whole(t.bk / v, t.bn),
    );
    let mut s = String::new();
    s.push_str(prelude(target));
    let defs: [(&str, usize); 18] = [
        ("M", d.m),
        ("N", d.n),
        ("K", d.k),
        ("LDA", d.lda),
        ("LDB", d.ldb),
        ("LDC", d.ldc),
        ("BM", t.bm),
        ("BN", t.bn),
        ("BK", t.bk),
        ("KT", d.k.div_ceil(t.bk)),
        ("WM", t.bm / t.warps_m),
        ("WN", t.bn / t.warps_n),
        ("WARPS_N", t.warps_n),
        ("FM", t.frag_m()),
        ("FN", t.frag_n()),
        ("STAGES", t.stages),
        ("THREADS", t.threads()),
        ("VEC", v),
    ];
    for (k, val) in defs {
        writeln!(s, "#define {k} {val}").unwrap();
    }
    writeln!(s, "#define AROW {}\n#define BROW {}", t.a_row(), t.b_row()).unwrap();
    s.push_str(&fragment::macros());
    writeln!(s, "#define ESZ {}", d.dtype.size()).unwrap();
    if let GpuBatch::Stride { a, b } = d.batch_form {
        writeln!(s, "#define SA ((idx_t){a})\n#define SB ((idx_t){b})").unwrap();
    }
    // Scalar reads of the shared tiles (OpenCL, and CUDA f32).
    let ld = match d.dtype {
        GpuDtype::F32 => "(x)",
        GpuDtype::Bf16 => "BF16_TO_F32(x)",
        GpuDtype::F16 => "f16_to_f32(x)",
    };
    writeln!(s, "#define TO_F32(x) {ld}").unwrap();
    if cuda {
        s.push_str(CUDA_HELPERS);
        if tensor_cores {
            let ty = if d.dtype == GpuDtype::Bf16 {
                "bf16"
            } else {
                "f16"
            };
            writeln!(
                s,
                "__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {{\n  \
                 asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\\n\"\n    \
                 : \"+f\"(c[0]), \"+f\"(c[1]), \"+f\"(c[2]), \"+f\"(c[3])\n    \
                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b[0]), \"r\"(b[1]));\n}}"
            )
            .unwrap();
        }
        writeln!(
            s,
            "extern \"C\" __global__ void __launch_bounds__({}, {}) {name}(",
            t.threads(),
            t.min_blocks(d.dtype)
        )
        .unwrap();
    } else {
        writeln!(
            s,
            "__kernel __attribute__((reqd_work_group_size({}, 1, 1))) void {name}(",
            t.threads()
        )
        .unwrap();
    }
    let tab = match (d.batch_form, target) {
        (GpuBatch::Address, _) => "u64",
        _ => "idx_t",
    };
    writeln!(
        s,
        "    GLOBAL const {et}* __restrict__ A, GLOBAL const {et}* __restrict__ B, GLOBAL float* __restrict__ C,\n    \
         GLOBAL const float* __restrict__ bias, GLOBAL const {tab}* __restrict__ ta, GLOBAL const {tab}* __restrict__ tb, int batch,\n    \
         GLOBAL float* __restrict__ P)\n{{"
    )
    .unwrap();
    s = s.replace(
        "__restrict__",
        if cuda { "__restrict__" } else { "restrict" },
    );
    if cuda {
        // Dynamic shared memory (the opt-in attribute lets the ring go past
        // 48 KiB), 16-byte aligned: cp.async destinations, ldmatrix rows.
        writeln!(
            s,
            "  extern __shared__ __align__(16) unsigned char smem_dyn[];\n  \
             {et} (*As)[BK][AROW] = reinterpret_cast<{et} (*)[BK][AROW]>(smem_dyn);\n  \
             {et} (*Bs)[BN][BROW] = reinterpret_cast<{et} (*)[BN][BROW]>(smem_dyn + (idx_t)STAGES * BK * AROW * ESZ);"
        )
        .unwrap();
    } else {
        writeln!(
            s,
            "  SHARED ALIGN16 {et} As[STAGES][BK][AROW];\n  SHARED ALIGN16 {et} Bs[STAGES][BN][BROW];"
        )
        .unwrap();
    }
    writeln!(
        s,
        "  \
         const int tid = TID, lane = tid & 31, warp = tid >> 5;\n  \
         const int wm = warp / WARPS_N, wn = warp % WARPS_N;\n  \
         const int g = lane >> 2, tg = lane & 3;\n  \
         const int m0 = BY * BM, n0 = BX * BN;\n  \
         const int all = batch * KT;\n  \
         const int t_lo = (int)(((idx_t)all * BZ) / GZ);\n  \
         const int total = (int)(((idx_t)all * (BZ + 1)) / GZ) - t_lo;\n  \
         float acc[FM][FN][4];\n  \
         #pragma unroll\n  for (int i = 0; i < FM; ++i)\n    #pragma unroll\n    for (int j = 0; j < FN; ++j)\n      #pragma unroll\n      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;"
    )
    .unwrap();
    if fast.0 {
        s.push_str(
            "  const int a_kk = tid / (BM / VEC), a_mm = (tid % (BM / VEC)) * VEC;\n  \
             const bool a_full = m0 + BM <= M && K % BK == 0;\n  \
             const idx_t a_off = m0 + a_mm + (idx_t)a_kk * LDA;\n",
        );
    }
    if fast.1 {
        s.push_str(
            "  const int b_nn = tid / (BK / VEC), b_kk = (tid % (BK / VEC)) * VEC;\n  \
             const bool b_full = n0 + BN <= N && K % BK == 0;\n  \
             const idx_t b_off = b_kk + (idx_t)(n0 + b_nn) * LDB;\n",
        );
    }
    if emulated {
        // Each warp's A and B fragments, lane by lane and slot by slot, as
        // the tensor core holds them in registers.
        s.push_str(
            "  SHARED float FRA[THREADS / 32][FM][32][8];\n  \
             SHARED float FRB[THREADS / 32][FN][32][4];\n",
        );
    }
    let load = |tt: &str, st: &str| load_tile(d, target, tt, st, (va, vb), fast, et);
    writeln!(
        s,
        "  for (int s0 = 0; s0 < STAGES - 1; ++s0) {{\n    if (s0 < total) {}\n    {}\n  }}",
        load("s0", "s0"),
        if cuda { "CP_ASYNC_COMMIT();" } else { "" }
    )
    .unwrap();
    writeln!(
        s,
        "  for (int t = 0; t < total; ++t) {{\n    {}\n    SYNC();\n    {{\n      const int tn = t + STAGES - 1;\n      \
         if (tn < total) {}\n      {}\n    }}\n    const int st = t % STAGES;",
        if cuda { "CP_ASYNC_WAIT(STAGES - 2);" } else { "" },
        load("tn", "tn % STAGES"),
        if cuda { "CP_ASYNC_COMMIT();" } else { "" }
    )
    .unwrap();
    if tensor_cores {
        // B fragments two n8 columns per ldmatrix.x4 where the warp has an
        // even number of them (lanes 16-31 address the second).
        let b_frags = if t.frag_n().is_multiple_of(2) {
            "      #pragma unroll\n      for (int fn = 0; fn < FN; fn += 2) {\n        \
             const int j = lane >> 3, r = lane & 7;\n        unsigned q[4];\n        \
             ldsm_x4(q, &Bs[st][wn * WN + (fn + (j >> 1)) * 8 + r][ks * 16 + (j & 1) * 8]);\n        \
             bfg[fn][0] = q[0]; bfg[fn][1] = q[1]; bfg[fn + 1][0] = q[2]; bfg[fn + 1][1] = q[3];\n      }\n"
        } else {
            "      #pragma unroll\n      for (int fn = 0; fn < FN; ++fn) {\n        \
             const int j = (lane >> 3) & 1, r = lane & 7;\n        \
             ldsm_x2(bfg[fn], &Bs[st][wn * WN + fn * 8 + r][ks * 16 + j * 8]);\n      }\n"
        };
        s.push_str(
            "    #pragma unroll\n    for (int ks = 0; ks < BK / 16; ++ks) {\n      \
             unsigned af[FM][4], bfg[FN][2];\n      \
             #pragma unroll\n      for (int fm = 0; fm < FM; ++fm) {\n        \
             const int j = lane >> 3, r = lane & 7;\n        \
             ldsm_x4_trans(af[fm], &As[st][ks * 16 + (j >> 1) * 8 + r][wm * WM + fm * 16 + (j & 1) * 8]);\n      }\n",
        );
        s.push_str(b_frags);
        s.push_str(
            "      #pragma unroll\n      for (int fm = 0; fm < FM; ++fm)\n        \
             #pragma unroll\n        for (int fn = 0; fn < FN; ++fn) mma16816(acc[fm][fn], af[fm], bfg[fn]);\n    }\n",
        );
    } else if emulated {
        // mma.m16n8k16 step by step: each lane loads its A and B slots
        // through the layout macros, and each C slot sums a row of A and a
        // column of B gathered from the lanes and slots that hold them.
        s.push_str(
            "    for (int ks = 0; ks < BK / 16; ++ks) {\n      \
             for (int fm = 0; fm < FM; ++fm)\n        \
             for (int s = 0; s < 8; ++s)\n          \
             FRA[warp][fm][lane][s] = TO_F32(As[st][ks * 16 + FA_K(s)][wm * WM + fm * 16 + FA_ROW(s)]);\n      \
             for (int fn = 0; fn < FN; ++fn)\n        \
             for (int s = 0; s < 4; ++s)\n          \
             FRB[warp][fn][lane][s] = TO_F32(Bs[st][wn * WN + fn * 8 + FB_COL(s)][ks * 16 + FB_K(s)]);\n      \
             SYNC();\n      \
             for (int fm = 0; fm < FM; ++fm)\n        \
             for (int fn = 0; fn < FN; ++fn)\n          \
             for (int s = 0; s < 4; ++s) {\n            \
             const int i = FC_ROW(s), j = FC_COL(s);\n            \
             float sum = 0.0f;\n            \
             for (int k = 0; k < 16; ++k)\n              \
             sum += FRA[warp][fm][FA_LANE(i, k)][FA_SLOT(i, k)] * FRB[warp][fn][FB_LANE(k, j)][FB_SLOT(k, j)];\n            \
             acc[fm][fn][s] += sum;\n          }\n      \
             SYNC();\n    }\n",
        );
    } else {
        // The same fragment elements as mma.m16n8k16: rows g and g+8 of each
        // m16 fragment, columns 2*tg and 2*tg+1 of each n8 fragment.
        s.push_str(
            "    #pragma unroll 4\n    for (int kk = 0; kk < BK; ++kk) {\n      \
             float a0[FM], a1[FM], b0[FN], b1[FN];\n      \
             #pragma unroll\n      for (int fm = 0; fm < FM; ++fm) {\n        \
             const int r = wm * WM + fm * 16 + g;\n        \
             a0[fm] = TO_F32(As[st][kk][r]);\n        a1[fm] = TO_F32(As[st][kk][r + 8]);\n      }\n      \
             for (int fn = 0; fn < FN; ++fn) {\n        \
             const int c = wn * WN + fn * 8 + 2 * tg;\n        \
             b0[fn] = TO_F32(Bs[st][c][kk]);\n        b1[fn] = TO_F32(Bs[st][c + 1][kk]);\n      }\n      \
             #pragma unroll\n      for (int fm = 0; fm < FM; ++fm)\n        #pragma unroll\n        for (int fn = 0; fn < FN; ++fn) {\n          \
             acc[fm][fn][0] += a0[fm] * b0[fn];\n          acc[fm][fn][1] += a0[fm] * b1[fn];\n          \
             acc[fm][fn][2] += a1[fm] * b0[fn];\n          acc[fm][fn][3] += a1[fm] * b1[fn];\n        }\n    }\n",
        );
    }
    s.push_str("  }\n");
    if cuda {
        // Drain the (empty) trailing groups before the block exits.
        s.push_str("  CP_ASYNC_WAIT(0);\n");
    }
    let v_expr = epilogue_value(d, "acc[fm][fn][s]");
    writeln!(
        s,
        "  #pragma unroll\n  for (int fm = 0; fm < FM; ++fm)\n    #pragma unroll\n    for (int fn = 0; fn < FN; ++fn)\n      \
         #pragma unroll\n      for (int s = 0; s < 4; ++s) {{\n          \
         const int r = m0 + wm * WM + fm * 16 + FC_ROW(s);\n          \
         const int c = n0 + wn * WN + fn * 8 + FC_COL(s);\n          \
         if (r < M && c < N) {{\n            if (GZ > 1) {{\n              \
         P[(idx_t)BZ * M * N + r + (idx_t)c * M] = acc[fm][fn][s];\n              continue;\n            }}\n            \
         const idx_t ci = r + (idx_t)c * LDC;\n            \
         const float v = {v_expr};\n            C[ci] = {};\n          }}\n        }}\n}}",
        activation_expr(d.epilogue.activation, "v")
    )
    .unwrap();
    (s, name)
}

/// The kernel that finishes a split launch: for each element of C, the
/// slices' partial sums of `P` added in slice order, then alpha, beta * C,
/// the bias and the activation, as the unsplit epilogue. Arguments: `C`,
/// `bias` (any buffer without one), `P`, `splits` (int); one work item per
/// element of the `m x n` C.
pub fn split_reduce_source(d: &GpuDescriptor, target: Target) -> (String, String) {
    let name = kernel_names(d).1;
    let mut s = String::new();
    s.push_str(prelude(target));
    writeln!(
        s,
        "#define M {}\n#define N {}\n#define LDC {}",
        d.m, d.n, d.ldc
    )
    .unwrap();
    let v = epilogue_value(d, "v");
    writeln!(
        s,
        "KERNEL {name}(GLOBAL float* C, GLOBAL const float* bias, GLOBAL const float* P, int splits) {{\n  \
         const idx_t i = GID;\n  if (i >= (idx_t)M * N) return;\n  \
         const int r = (int)(i % M), c = (int)(i / M);\n  float v = 0.0f;\n  \
         for (int z = 0; z < splits; ++z) v += P[(idx_t)z * M * N + i];\n  \
         const idx_t ci = r + (idx_t)c * LDC;\n  const float w = {v};\n  C[ci] = {};\n}}",
        activation_expr(d.epilogue.activation, "w")
    )
    .unwrap();
    (s, name)
}

/// Copies tile `tt` (batch entry `tt / KT`, k-block `tt % KT`) of A and B
/// into stage `st`, zero-filling what lies outside the matrices.
///
/// `vec`: A and B copied as 16-byte vectors; `fast`: whole tiles of them
/// through each thread's precomputed offsets (`a_off`/`b_off`).
fn load_tile(
    d: &GpuDescriptor,
    target: Target,
    tt: &str,
    st: &str,
    (va, vb): (bool, bool),
    fast: (bool, bool),
    et: &str,
) -> String {
    let cuda = target == Target::Cuda;
    let base = |x: &str, tab: &str, stride: &str| match (d.batch_form, target) {
        (GpuBatch::Stride { .. }, _) => format!("{x} + (idx_t)bi * {stride}"),
        (GpuBatch::Offset, _) => format!("{x} + {tab}[bi]"),
        (GpuBatch::Address, Target::Cuda) => format!("(const {et}*){tab}[bi]"),
        (GpuBatch::Address, Target::OpenCl) => {
            format!("(GLOBAL const {et}*)((GLOBAL const uchar*){x} + {tab}[bi])")
        }
        (GpuBatch::Packed, _) => unreachable!("validation resolves Packed"),
    };
    let mut s = format!(
        "{{\n      const int bi = (t_lo + ({tt})) / KT, k0 = ((t_lo + ({tt})) % KT) * BK, sx = {st};\n      \
         GLOBAL const {et}* Ai = {};\n      GLOBAL const {et}* Bi = {};\n",
        base("A", "ta", "SA"),
        base("B", "tb", "SB")
    );
    // A tile [BK][BM]: m is contiguous in global and in shared memory.
    if fast.0 {
        s.push_str(
            "      if (a_full) {\n        \
             GLOBAL const void* src = Ai + (idx_t)k0 * LDA + a_off;\n        \
             #pragma unroll\n        for (int i = 0; i < BK * (BM / VEC) / THREADS; ++i)\n          \
             cp_async16(&As[sx][a_kk + i * (THREADS / (BM / VEC))][a_mm], \
             (const char*)src + (idx_t)i * (THREADS / (BM / VEC)) * LDA * ESZ, 16);\n      \
             } else\n",
        );
    }
    if va {
        s.push_str(
            "      for (int c = tid; c < BK * (BM / VEC); c += THREADS) {\n        \
             const int kk = c / (BM / VEC), mm = (c % (BM / VEC)) * VEC;\n        \
             const int gm = m0 + mm, gk = k0 + kk, rem = M - gm;\n        \
             const int valid = gk < K ? (rem <= 0 ? 0 : (rem < VEC ? rem : VEC)) : 0;\n",
        );
        if cuda {
            s.push_str(
                "        cp_async16(&As[sx][kk][mm], valid > 0 ? (const void*)(Ai + gm + (idx_t)gk * LDA) : (const void*)Ai, valid * ESZ);\n      }\n",
            );
        } else {
            writeln!(
                s,
                "        for (int e = 0; e < VEC; ++e) As[sx][kk][mm + e] = e < valid ? Ai[gm + e + (idx_t)gk * LDA] : ({et})0;\n      }}"
            )
            .unwrap();
        }
    } else {
        writeln!(
            s,
            "      for (int c = tid; c < BK * BM; c += THREADS) {{\n        \
             const int kk = c / BM, mm = c % BM, gm = m0 + mm, gk = k0 + kk;\n        \
             As[sx][kk][mm] = (gm < M && gk < K) ? Ai[gm + (idx_t)gk * LDA] : ({et})0;\n      }}"
        )
        .unwrap();
    }
    // B tile [BN][BK]: k is contiguous in global and in shared memory.
    if fast.1 {
        s.push_str(
            "      if (b_full) {\n        \
             GLOBAL const void* src = Bi + k0 + b_off;\n        \
             #pragma unroll\n        for (int i = 0; i < BN * (BK / VEC) / THREADS; ++i)\n          \
             cp_async16(&Bs[sx][b_nn + i * (THREADS / (BK / VEC))][b_kk], \
             (const char*)src + (idx_t)i * (THREADS / (BK / VEC)) * LDB * ESZ, 16);\n      \
             } else\n",
        );
    }
    if vb {
        s.push_str(
            "      for (int c = tid; c < BN * (BK / VEC); c += THREADS) {\n        \
             const int nn = c / (BK / VEC), kk = (c % (BK / VEC)) * VEC;\n        \
             const int gn = n0 + nn, gk = k0 + kk, rem = K - gk;\n        \
             const int valid = gn < N ? (rem <= 0 ? 0 : (rem < VEC ? rem : VEC)) : 0;\n",
        );
        if cuda {
            s.push_str(
                "        cp_async16(&Bs[sx][nn][kk], valid > 0 ? (const void*)(Bi + gk + (idx_t)gn * LDB) : (const void*)Bi, valid * ESZ);\n      }\n",
            );
        } else {
            writeln!(
                s,
                "        for (int e = 0; e < VEC; ++e) Bs[sx][nn][kk + e] = e < valid ? Bi[gk + e + (idx_t)gn * LDB] : ({et})0;\n      }}"
            )
            .unwrap();
        }
    } else {
        writeln!(
            s,
            "      for (int c = tid; c < BN * BK; c += THREADS) {{\n        \
             const int nn = c / BK, kk = c % BK, gn = n0 + nn, gk = k0 + kk;\n        \
             Bs[sx][nn][kk] = (gn < N && gk < K) ? Bi[gk + (idx_t)gn * LDB] : ({et})0;\n      }}"
        )
        .unwrap();
    }
    s.push_str("    }");
    s
}

/// Header-free PTX wrappers (NVRTC needs no CUDA headers for them).
const CUDA_HELPERS: &str = r#"__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
// 16-byte async copy; bytes past src_bytes are zero-filled (edge tiles).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
#define CP_ASYNC_COMMIT() asm volatile("cp.async.commit_group;\n" ::)
#define CP_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;\n" :: "n"(n))
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
    : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
    : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x2(unsigned* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
    : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(p)));
}
"#;
