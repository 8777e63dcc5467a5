//! Source generation: one generator, two targets.
//!
//! [`brgemm_source`] writes the BRGEMM for one descriptor as CUDA C (tensor
//! cores through header-free inline PTX: `cp.async`, `ldmatrix`,
//! `mma.sync.m16n8k16`) or as OpenCL C. Both come from the same skeleton:
//! the same block and warp tiling, the same shared-memory tiles and stage
//! ring, the same per-thread ownership of C (the `m16n8` accumulator
//! fragment layout of the tensor-core instruction), the same addressing of
//! the three batch forms and the same epilogue. They differ only where the
//! hardware does: how a tile reaches shared memory (`cp.async` with
//! zero-fill vs plain copies) and the innermost multiply-accumulate
//! (`ldmatrix` + `mma.sync` vs, for bf16 and f16, the same fragments moved
//! lane by lane through local memory by the layout macros of the
//! `fragment` module, and for f32 scalar FMAs over the C fragment elements).
//! So the OpenCL twin, which CI runs on PoCL, executes the tiling, edge
//! handling, batch addressing and epilogue that the CUDA kernel uses.
//!
//! [`wgmma_source`] writes the sm_90a kernel (TMA, `mbarrier`, `wgmma`;
//! see [`crate::hopper`]) with the same epilogue and split-K partials.

mod brgemm_src;
mod elementwise;
mod fragment;
mod wgmma;

pub use brgemm_src::{brgemm_source, split_reduce_source};
pub use elementwise::{elementwise_source, ElementwiseKernel};
#[doc(hidden)]
pub use fragment::{set_fragment_fault, FragmentFault};
pub use wgmma::{wgmma_name, wgmma_source};

/// The function names of `d`'s BRGEMM kernel and of its split reduction
/// (each also its program's cache key), with a planted fragment fault's
/// suffix: made once per plan, not per launch.
pub(crate) fn kernel_names(d: &crate::desc::GpuDescriptor) -> (String, String) {
    let main = format!("{}{}", d.kernel_name(), fragment::fault_suffix());
    let reduce = format!("{main}_reduce");
    (main, reduce)
}

/// Whether the `target` kernel of `dtype` emulates the tensor core (the
/// OpenCL twin of a bf16 or f16 kernel): its fragments go through local
/// memory, which its launch must have room for.
pub(crate) fn emulates_mma(target: Target, dtype: crate::desc::GpuDtype) -> bool {
    target == Target::OpenCl && dtype != crate::desc::GpuDtype::F32
}

/// Which language to emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// CUDA C++ for NVRTC, sm_80 and up.
    Cuda,
    /// OpenCL C 1.2.
    OpenCl,
}

/// Writes a float so that both languages read back the same f32.
pub(crate) fn float_lit(x: f32) -> String {
    let s = format!("{x:?}");
    if s.contains('.') || s.contains('e') {
        format!("{s}f")
    } else {
        format!("{s}.0f")
    }
}

/// The target-specific macros every generated file starts with.
pub(crate) fn prelude(t: Target) -> &'static str {
    match t {
        Target::Cuda => {
            "typedef long long idx_t;\ntypedef unsigned short u16;\ntypedef unsigned long long u64;\n\
             #define KERNEL extern \"C\" __global__ void\n#define GLOBAL\n#define SHARED __shared__\n#define ALIGN16 __align__(16)\n\
             #define SYNC() __syncthreads()\n#define TID ((int)threadIdx.x)\n\
             #define GID ((idx_t)blockIdx.x * blockDim.x + threadIdx.x)\n\
             #define BX ((int)blockIdx.x)\n#define BY ((int)blockIdx.y)\n\
             #define BZ ((int)blockIdx.z)\n#define GZ ((int)gridDim.z)\n\
             #define EXPF(x) expf(x)\n#define TANHF(x) tanhf(x)\n#define SQRTF(x) sqrtf(x)\n#define LOGF(x) logf(x)\n\
             #define BF16_TO_F32(h) __uint_as_float(((unsigned)(h)) << 16)\n\
             __device__ __forceinline__ float f16_to_f32(u16 h) { float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(h)); return f; }\n\
             __device__ __forceinline__ u16 f32_to_f16(float f) { u16 h; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(h) : \"f\"(f)); return h; }\n"
        }
        Target::OpenCl => {
            "typedef long idx_t;\ntypedef ushort u16;\ntypedef ulong u64;\n\
             #define KERNEL __kernel void\n#define GLOBAL __global\n#define SHARED __local\n#define ALIGN16 __attribute__((aligned(16)))\n\
             #define SYNC() barrier(CLK_LOCAL_MEM_FENCE)\n#define TID ((int)get_local_id(0))\n\
             #define GID ((idx_t)get_global_id(0))\n\
             #define BX ((int)get_group_id(0))\n#define BY ((int)get_group_id(1))\n\
             #define BZ ((int)get_group_id(2))\n#define GZ ((int)get_num_groups(2))\n\
             #define EXPF(x) exp(x)\n#define TANHF(x) tanh(x)\n#define SQRTF(x) sqrt(x)\n#define LOGF(x) log(x)\n\
             #define BF16_TO_F32(h) as_float(((uint)(h)) << 16)\n\
             inline float f16_to_f32(u16 h) { return vload_half(0, (const half*)&h); }\n\
             inline u16 f32_to_f16(float f) { u16 h; vstore_half_rte(f, 0, (half*)&h); return h; }\n"
        }
    }
}

/// The epilogue's value before the activation, for the f32 sum `acc`:
/// `alpha * acc`, plus `C[ci]` with beta 1, plus `bias[r]` with a bias
/// (the names `C`, `ci`, `bias`, `r` are the kernels').
pub(crate) fn epilogue_value(d: &crate::desc::GpuDescriptor, acc: &str) -> String {
    let mut v = format!("{} * {acc}", float_lit(d.alpha));
    if matches!(d.beta, brgemm::Beta::One) {
        v = format!("{v} + C[ci]");
    }
    if d.epilogue.bias {
        v = format!("{v} + bias[r]");
    }
    v
}

/// The activation's name in generated kernel names.
pub(crate) fn act_name(a: brgemm::Activation) -> &'static str {
    use brgemm::Activation as A;
    match a {
        A::Identity => "identity",
        A::Relu => "relu",
        A::Sigmoid => "sigmoid",
        A::Tanh => "tanh",
        A::Gelu => "gelu",
        _ => "unknown",
    }
}

/// C expression applying `act` to the float expression `v`.
pub(crate) fn activation_expr(act: brgemm::Activation, v: &str) -> String {
    use brgemm::Activation as A;
    match act {
        A::Relu => format!("({v} > 0.0f ? {v} : 0.0f)"),
        A::Sigmoid => format!("(1.0f / (1.0f + EXPF(-({v}))))"),
        A::Tanh => format!("TANHF({v})"),
        A::Gelu => format!(
            "(0.5f * ({v}) * (1.0f + TANHF(0.7978846f * (({v}) + 0.044715f * ({v}) * ({v}) * ({v})))))"
        ),
        _ => v.to_string(),
    }
}
