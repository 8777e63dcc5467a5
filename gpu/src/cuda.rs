//! The CUDA backend: driver through cudarc, kernels compiled by NVRTC for
//! the device's architecture, cached per (source key, arch).

use crate::error::{Error, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::CompileOptions;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

fn cu(e: impl std::fmt::Debug) -> Error {
    Error::Cuda(format!("{e:?}"))
}

/// Whether `libnvrtc` can be loaded (probed before any NVRTC call: cudarc
/// panics on a missing library).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether `libcuda` (the driver) can be loaded.
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// `sm_XY` as the `'static` string NVRTC's options take.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 7) => "sm_87",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        // Rare: one small leak per new architecture name, once per process.
        _ => Box::leak(format!("sm_{major}{minor}").into_boxed_str()),
    }
}

fn need_nvrtc() -> Result<()> {
    if nvrtc_available() {
        return Ok(());
    }
    Err(Error::NoCuda(
        "libnvrtc.so.12 not found: pip install nvidia-cuda-nvrtc-cu12 and add its lib/ to LD_LIBRARY_PATH".into(),
    ))
}

/// Compiles CUDA C to PTX with NVRTC for `arch` (needs no GPU): the
/// fallback of [`compile_cubin`] (`BRGEMM_CUDA_PTX=1`), and what the ptxas
/// checks read.
pub fn compile_ptx(source: &str, name: &str, arch: &'static str) -> Result<String> {
    need_nvrtc()?;
    let opts = CompileOptions {
        arch: Some(arch),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| Error::Compile {
        name: name.to_string(),
        log: format!("{e:?}"),
    })?;
    Ok(ptx.to_src())
}

/// Compiles CUDA C with NVRTC into a cubin for exactly `arch` (`sm_XY`;
/// needs no GPU): machine code the driver loads as it is. PTX would be
/// compiled again by the driver's JIT, which refuses PTX of an ISA newer
/// than the driver (NVRTC 12.9 writes ISA 8.8); a cubin only needs a
/// driver that knows the architecture.
pub fn compile_cubin(source: &str, name: &str, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    need_nvrtc()?;
    let fail = |log: String| Error::Compile {
        name: name.to_string(),
        log,
    };
    let src = std::ffi::CString::new(source).map_err(|e| fail(e.to_string()))?;
    let file = std::ffi::CString::new(format!("{name}.cu")).map_err(|e| fail(e.to_string()))?;
    let prog = result::create_program(&src, Some(&file)).map_err(|e| fail(format!("{e:?}")))?;
    // SAFETY: `prog` comes from create_program, with `src` and `file` alive
    // until it is destroyed, once, at the end.
    unsafe {
        let out = match result::compile_program(prog, &[format!("--gpu-architecture={arch}")]) {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        // c_char: i8 on x86-64, u8 on aarch64.
                        let bytes: Vec<u8> = l.iter().map(|c| c.to_ne_bytes()[0]).collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(fail(format!("{e:?}: {log}")))
            }
            Ok(()) => {
                let mut size = 0usize;
                let mut cubin = Vec::new();
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .and_then(|()| {
                        cubin.resize(size, 0u8);
                        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()).result()
                    })
                    .map(|()| cubin)
                    .map_err(|e| fail(format!("{e:?}")))
            }
        };
        let _ = result::destroy_program(prog);
        out
    }
}

/// Whether kernels are loaded as PTX for the driver to compile
/// (`BRGEMM_CUDA_PTX=1`) instead of cubins: for a device whose
/// architecture this NVRTC cannot target.
fn load_ptx() -> bool {
    brgemm::env::Setting::CudaPtx
        .value()
        .is_some_and(|v| v.trim() == "1")
}

/// A CUDA device: context, one stream, the kernel cache.
pub struct CudaBackend {
    name: String,
    arch: &'static str,
    /// Functions by program key, then name (this device's architecture
    /// is fixed): a launch finds its function without building a string.
    funcs: Mutex<HashMap<String, HashMap<String, CudaFunction>>>,
    cublas: Mutex<Option<cudarc::cublas::CudaBlas>>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

pub(crate) enum CuArg<'a> {
    Buf(&'a CudaSlice<u8>),
    I32(i32),
    F32(f32),
    Tma(&'a TmaMap),
}

/// A TMA tensor map (`CUtensorMap`: 128 opaque bytes the driver encodes),
/// passed to a kernel by value as a `__grid_constant__` parameter.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub(crate) struct TmaMap([u64; 16]);

// SAFETY: plain bytes, laid out as the kernel's `TmaMap` parameter.
unsafe impl cudarc::driver::DeviceRepr for TmaMap {}

/// One operand of the sm_90a kernel as TMA sees it: a rank-3 tensor of
/// 16-bit elements, `dims` innermost first, `strides` in elements of the
/// two outer dimensions, read in boxes of `boxes`, 128-byte swizzled.
pub(crate) struct TmaOperand {
    pub dims: [u64; 3],
    pub strides: [u64; 2],
    pub boxes: [u32; 3],
}

/// How a kernel is launched beyond its grid: the architecture it is
/// compiled for (`None`: the device's) and its dynamic shared memory.
#[derive(Clone, Copy, Default)]
pub(crate) struct LaunchOpts {
    pub arch: Option<&'static str>,
    pub dynamic_smem: u32,
}

impl CudaBackend {
    /// Device `ordinal`, after probing for the driver and NVRTC.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_available() {
            return Err(Error::NoCuda(
                "libcuda.so (the NVIDIA driver) not found".into(),
            ));
        }
        if !nvrtc_available() {
            return Err(Error::NoCuda(
                "libnvrtc.so.12 not found: install the CUDA toolkit or pip install nvidia-cuda-nvrtc-cu12 \
                 and add its lib/ to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(cu)?;
        let (major, minor) = ctx.compute_capability().map_err(cu)?;
        if major < 8 {
            return Err(Error::NoCuda(format!(
                "device {ordinal} is sm_{major}{minor}; the generated kernels need sm_80 or newer"
            )));
        }
        let name = ctx
            .name()
            .unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        let stream = ctx.default_stream();
        Ok(CudaBackend {
            name,
            arch: arch_name(major, minor),
            funcs: Mutex::default(),
            cublas: Mutex::default(),
            stream,
            ctx,
        })
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The architecture kernels are compiled for.
    pub fn arch(&self) -> &'static str {
        self.arch
    }
    /// Streaming multiprocessors.
    pub fn multiprocessors(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let n = self
            .ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cu)?;
        Ok(n.max(1) as usize)
    }
    /// Dynamic shared memory a block may opt into.
    pub fn shared_optin(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPTIN;
        Ok(self.ctx.attribute(OPTIN).map_err(cu)?.max(0) as usize)
    }
    /// cuBLAS `C = A B` (column-major, no transposes) with `dtype` inputs,
    /// f32 output and f32 accumulation (`cublasGemmEx`): the yardstick of
    /// `bench -- gpu`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cublas_gemm(
        &self,
        dtype: crate::GpuDtype,
        (m, n, k): (usize, usize, usize),
        a: &CudaSlice<u8>,
        lda: usize,
        b: &CudaSlice<u8>,
        ldb: usize,
        c: &mut CudaSlice<u8>,
        ldc: usize,
    ) -> Result<()> {
        use cudarc::cublas::sys;
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        // SAFETY: only tries to dlopen the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoCuda("libcublas.so.12 not found".into()));
        }
        let mut guard = self.cublas.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            *guard = Some(cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(cu)?);
        }
        let blas = guard.as_ref().expect("set above");
        let ty = match dtype {
            crate::GpuDtype::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            crate::GpuDtype::F16 => sys::cudaDataType::CUDA_R_16F,
            crate::GpuDtype::F32 => sys::cudaDataType::CUDA_R_32F,
        };
        let i = |x: usize| i32::try_from(x).map_err(|_| Error::Cuda(format!("{x} exceeds i32")));
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (pa, _ga) = a.device_ptr(&self.stream);
        let (pb, _gb) = b.device_ptr(&self.stream);
        let (pc, _gc) = c.device_ptr_mut(&self.stream);
        // SAFETY: the caller sized the buffers for these shapes and leading
        // dimensions; scalars are host f32 as CUBLAS_COMPUTE_32F expects.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_N,
                i(m)?,
                i(n)?,
                i(k)?,
                &alpha as *const f32 as *const _,
                pa as *const _,
                ty,
                i(lda)?,
                pb as *const _,
                ty,
                i(ldb)?,
                &beta as *const f32 as *const _,
                pc as *mut _,
                sys::cudaDataType::CUDA_R_32F,
                i(ldc)?,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cu)
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(cu)
    }
    pub(crate) fn write(&self, b: &mut CudaSlice<u8>, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut view = b.slice_mut(0..data.len());
        self.stream.memcpy_htod(data, &mut view).map_err(cu)
    }
    pub(crate) fn read(&self, b: &CudaSlice<u8>, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        let view = b.slice(0..out.len());
        self.stream.memcpy_dtoh(&view, out).map_err(cu)
    }
    pub(crate) fn address(&self, b: &CudaSlice<u8>) -> u64 {
        use cudarc::driver::DevicePtr;
        let (p, _sync) = b.device_ptr(&self.stream);
        p
    }

    /// Encodes the tensor map of `op` over the buffer `buf` (16-bit
    /// elements of `dtype`): the driver checks alignment, strides and box
    /// sizes, and its refusal comes back as an error naming the operand.
    pub(crate) fn tma_map(
        &self,
        what: &str,
        buf: &CudaSlice<u8>,
        dtype: crate::GpuDtype,
        op: &TmaOperand,
    ) -> Result<TmaMap> {
        use cudarc::driver::sys;
        let ty = match dtype {
            crate::GpuDtype::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            crate::GpuDtype::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            crate::GpuDtype::F32 => {
                return Err(Error::Cuda(format!(
                    "{what}: TMA path takes 16-bit operands"
                )))
            }
        };
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        let strides = [op.strides[0] * 2, op.strides[1] * 2];
        let ones = [1u32; 3];
        // SAFETY: every array has the rank's length (strides one less), the
        // address is a live allocation of this context, and `map` is an
        // aligned, writable CUtensorMap.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                ty,
                3,
                self.address(buf) as *mut std::ffi::c_void,
                op.dims.as_ptr(),
                strides.as_ptr(),
                op.boxes.as_ptr(),
                ones.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()
            .map_err(|e| {
                Error::Cuda(format!(
                    "{what}: tensor map of dims {:?}, strides {:?} elements, box {:?}: {e:?}",
                    op.dims, op.strides, op.boxes
                ))
            })?;
            Ok(TmaMap(map.assume_init().opaque))
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_with(
        &self,
        key: &str,
        source: impl FnOnce() -> String,
        name: &str,
        grid: [u32; 3],
        block: u32,
        args: &[CuArg],
        opts: LaunchOpts,
    ) -> Result<()> {
        let mut funcs = self.funcs.lock().unwrap_or_else(|e| e.into_inner());
        if !funcs.get(key).is_some_and(|m| m.contains_key(name)) {
            let arch = opts.arch.unwrap_or(self.arch);
            let image = if load_ptx() {
                cudarc::nvrtc::Ptx::from_src(compile_ptx(&source(), key, arch)?)
            } else {
                cudarc::nvrtc::Ptx::from_binary(compile_cubin(&source(), key, arch)?)
            };
            let module = self.ctx.load_module(image).map_err(cu)?;
            let f = module.load_function(name).map_err(cu)?;
            if opts.dynamic_smem > 48 * 1024 {
                use cudarc::driver::sys::CUfunction_attribute_enum as A;
                f.set_attribute(
                    A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    opts.dynamic_smem as i32,
                )
                .map_err(cu)?;
            }
            funcs
                .entry(key.to_string())
                .or_default()
                .insert(name.to_string(), f);
        }
        let f = &funcs[key][name];
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                CuArg::Buf(s) => b.arg(*s),
                CuArg::I32(v) => b.arg(v),
                CuArg::F32(v) => b.arg(v),
                CuArg::Tma(m) => b.arg(*m),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid[0], grid[1], grid[2]),
            block_dim: (block, 1, 1),
            shared_mem_bytes: opts.dynamic_smem,
        };
        // SAFETY: the argument list matches the generated signature, and the
        // caller bounds-checked every buffer against the descriptor.
        unsafe { b.launch(cfg) }.map_err(cu)?;
        Ok(())
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cu)
    }
}
