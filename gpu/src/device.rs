//! One device type over both backends: buffers, uploads, launches.

use crate::cuda::{CuArg, CudaBackend};
use crate::error::{invalid, Result};
use crate::opencl::{ClArg, OpenClBackend};

/// Which backend to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CUDA device 0 (tensor cores, NVRTC).
    Cuda,
    /// The first OpenCL device.
    OpenCl,
}

impl std::str::FromStr for Backend {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "cuda" => Ok(Backend::Cuda),
            "opencl" => Ok(Backend::OpenCl),
            _ => Err(invalid("device", s, "expected cuda or opencl")),
        }
    }
}

pub(crate) enum Inner {
    Cuda(CudaBackend),
    OpenCl(OpenClBackend),
}

/// A GPU (or OpenCL device) with its kernel cache.
pub struct Device {
    pub(crate) inner: Inner,
    /// Scratch for the partial sums of split launches, grown as needed.
    scratch: std::sync::Mutex<Option<Buffer>>,
    /// Shared (local) memory per block, read once when opened.
    shared: usize,
}

enum BufInner {
    Cuda(cudarc::driver::CudaSlice<u8>),
    OpenCl(opencl3::memory::Buffer<u8>),
}

/// Device memory: one plain allocation (no managed memory), freed on drop.
/// Untyped; the kernels that use it fix the element type, and every entry
/// point checks the byte length against what it will touch.
pub struct Buffer {
    inner: BufInner,
    bytes: usize,
}

impl Buffer {
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Whether the buffer holds at least `n` elements of `size` bytes.
    pub(crate) fn holds(&self, n: usize, size: usize) -> bool {
        n.checked_mul(size).is_some_and(|b| b <= self.bytes)
    }
    /// An error naming the buffer `what` unless it holds `elems` 4-byte
    /// values (f32 or i32).
    pub(crate) fn need(&self, what: &str, elems: usize) -> Result<()> {
        if self.holds(elems, 4) {
            Ok(())
        } else {
            Err(invalid(
                what,
                format!("{} bytes", self.bytes),
                format!("needs {elems} f32"),
            ))
        }
    }

    /// The CUDA allocation, or an error naming the buffer.
    pub(crate) fn cuda_slice(&self, what: &str) -> Result<&cudarc::driver::CudaSlice<u8>> {
        match &self.inner {
            BufInner::Cuda(s) => Ok(s),
            BufInner::OpenCl(_) => Err(invalid(
                what,
                "an OpenCL buffer",
                "allocate it on this device",
            )),
        }
    }
}

/// A launch argument.
pub(crate) enum Arg<'a> {
    Buf(&'a Buffer),
    I32(i32),
    F32(f32),
}

impl Device {
    /// Opens a backend: CUDA device 0 or the first OpenCL device. Missing
    /// drivers or libraries give an error that says what to install.
    pub fn open(b: Backend) -> Result<Device> {
        let inner = match b {
            Backend::Cuda => Inner::Cuda(CudaBackend::new(0)?),
            Backend::OpenCl => Inner::OpenCl(OpenClBackend::new()?),
        };
        let shared = match &inner {
            Inner::Cuda(c) => c.shared_optin()?,
            Inner::OpenCl(c) => c.local_memory()?,
        };
        Ok(Device {
            inner,
            scratch: std::sync::Mutex::new(None),
            shared,
        })
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        match self.inner {
            Inner::Cuda(_) => Backend::Cuda,
            Inner::OpenCl(_) => Backend::OpenCl,
        }
    }

    /// Device name.
    pub fn name(&self) -> &str {
        match &self.inner {
            Inner::Cuda(c) => c.name(),
            Inner::OpenCl(c) => c.name(),
        }
    }

    /// The CUDA backend, if this is one (for cuBLAS comparisons).
    pub fn cuda(&self) -> Option<&CudaBackend> {
        match &self.inner {
            Inner::Cuda(c) => Some(c),
            Inner::OpenCl(_) => None,
        }
    }

    /// Multiprocessors (CUDA) or compute units (OpenCL): how many blocks
    /// run at once, at least.
    pub fn compute_units(&self) -> Result<usize> {
        match &self.inner {
            Inner::Cuda(c) => c.multiprocessors(),
            Inner::OpenCl(c) => c.compute_units(),
        }
    }

    /// Shared memory a block may use: the opt-in maximum of dynamic shared
    /// memory on CUDA (the kernels set the attribute), the device's local
    /// memory per work-group on OpenCL.
    pub fn shared_memory(&self) -> usize {
        self.shared
    }

    /// The device's scratch buffer, at least `bytes` long (contents
    /// undefined), locked for the caller.
    pub(crate) fn scratch(
        &self,
        bytes: usize,
    ) -> Result<std::sync::MutexGuard<'_, Option<Buffer>>> {
        let mut g = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_none_or(|b| b.bytes() < bytes) {
            *g = Some(self.alloc(bytes)?);
        }
        Ok(g)
    }

    /// A zero-filled buffer of `bytes` bytes.
    pub fn alloc(&self, bytes: usize) -> Result<Buffer> {
        let inner = match &self.inner {
            Inner::Cuda(c) => BufInner::Cuda(c.alloc(bytes)?),
            Inner::OpenCl(c) => BufInner::OpenCl(c.alloc(bytes)?),
        };
        Ok(Buffer { inner, bytes })
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<Buffer> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut b = self.alloc(bytes.len())?;
        self.write(&mut b, data)?;
        Ok(b)
    }

    /// Overwrites the start of `b` with `data`.
    pub fn write<T: bytemuck::Pod>(&self, b: &mut Buffer, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if bytes.len() > b.bytes {
            return Err(invalid(
                "upload length",
                bytes.len(),
                format!("buffer has {} bytes", b.bytes),
            ));
        }
        match (&self.inner, &mut b.inner) {
            (Inner::Cuda(c), BufInner::Cuda(s)) => c.write(s, bytes),
            (Inner::OpenCl(c), BufInner::OpenCl(s)) => c.write(s, bytes),
            _ => Err(invalid(
                "buffer",
                "of another backend",
                "allocate it on this device",
            )),
        }
    }

    /// Reads the first `n` elements of `b` (waits for queued work).
    pub fn download<T: bytemuck::Pod>(&self, b: &Buffer, n: usize) -> Result<Vec<T>> {
        let size = std::mem::size_of::<T>();
        if !b.holds(n, size) {
            return Err(invalid(
                "download length",
                n,
                format!("buffer has {} bytes", b.bytes),
            ));
        }
        let mut out = vec![T::zeroed(); n];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        match (&self.inner, &b.inner) {
            (Inner::Cuda(c), BufInner::Cuda(s)) => c.read(s, bytes)?,
            (Inner::OpenCl(c), BufInner::OpenCl(s)) => c.read(s, bytes)?,
            _ => {
                return Err(invalid(
                    "buffer",
                    "of another backend",
                    "allocate it on this device",
                ))
            }
        }
        Ok(out)
    }

    /// The address kernels see for byte 0 of `b`: the device pointer on CUDA,
    /// 0 on OpenCL (where address tables hold byte offsets into the buffer).
    pub fn address(&self, b: &Buffer) -> u64 {
        match (&self.inner, &b.inner) {
            (Inner::Cuda(c), BufInner::Cuda(s)) => c.address(s),
            _ => 0,
        }
    }

    /// cuBLAS `C = A B` on the same buffers (CUDA only): column-major,
    /// `dtype` inputs, f32 accumulation and output. For comparisons.
    #[allow(clippy::too_many_arguments)]
    pub fn cublas_gemm(
        &self,
        dtype: crate::GpuDtype,
        mnk: (usize, usize, usize),
        a: &Buffer,
        lda: usize,
        b: &Buffer,
        ldb: usize,
        c: &mut Buffer,
        ldc: usize,
    ) -> Result<()> {
        let (m, n, k) = mnk;
        let es = dtype.size();
        let fits = a.holds(lda * (k.max(1) - 1) + m, es)
            && b.holds(ldb * (n.max(1) - 1) + k, es)
            && c.holds(ldc * (n.max(1) - 1) + m, 4);
        if !fits || lda < m || ldb < k || ldc < m {
            return Err(invalid(
                "cublas_gemm buffers",
                format!("{mnk:?}"),
                "too small for the shape and leading dimensions",
            ));
        }
        match (&self.inner, &a.inner, &b.inner, &mut c.inner) {
            (Inner::Cuda(cu), BufInner::Cuda(a), BufInner::Cuda(b), BufInner::Cuda(c)) => {
                cu.cublas_gemm(dtype, mnk, a, lda, b, ldb, c, ldc)
            }
            _ => Err(invalid(
                "device",
                "not CUDA",
                "cuBLAS needs the CUDA backend",
            )),
        }
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        match &self.inner {
            Inner::Cuda(c) => c.synchronize(),
            Inner::OpenCl(c) => c.synchronize(),
        }
    }

    /// Launches kernel `name` of the program cached as `key` (built from
    /// `source` for this backend on first use) on a `grid` of blocks of
    /// `block` threads.
    pub(crate) fn launch(
        &self,
        key: &str,
        source: impl FnOnce(crate::codegen::Target) -> String,
        name: &str,
        grid: [usize; 3],
        block: usize,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_smem(key, source, name, grid, block, args, 0)
    }

    /// [`Device::launch`] of a kernel whose CUDA form takes `smem` bytes of
    /// dynamic shared memory (its OpenCL form declares its own).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_smem(
        &self,
        key: &str,
        source: impl FnOnce(crate::codegen::Target) -> String,
        name: &str,
        grid: [usize; 3],
        block: usize,
        args: &[Arg],
        smem: usize,
    ) -> Result<()> {
        if grid.contains(&0) {
            return Ok(());
        }
        match &self.inner {
            Inner::Cuda(c) => {
                let mut a = Vec::with_capacity(args.len());
                for x in args {
                    a.push(match x {
                        Arg::Buf(b) => match &b.inner {
                            BufInner::Cuda(s) => CuArg::Buf(s),
                            BufInner::OpenCl(_) => {
                                return Err(invalid(
                                    "buffer",
                                    "an OpenCL buffer",
                                    "allocate it on this CUDA device",
                                ))
                            }
                        },
                        Arg::I32(v) => CuArg::I32(*v),
                        Arg::F32(v) => CuArg::F32(*v),
                    });
                }
                let g = |x: usize| u32::try_from(x).map_err(|_| invalid("grid", x, "exceeds u32"));
                c.launch_with(
                    key,
                    || source(crate::codegen::Target::Cuda),
                    name,
                    [g(grid[0])?, g(grid[1])?, g(grid[2])?],
                    block as u32,
                    &a,
                    crate::cuda::LaunchOpts {
                        arch: None,
                        dynamic_smem: smem as u32,
                    },
                )
            }
            Inner::OpenCl(c) => {
                let mut a = Vec::with_capacity(args.len());
                for x in args {
                    a.push(match x {
                        Arg::Buf(b) => match &b.inner {
                            BufInner::OpenCl(s) => ClArg::Buf(s),
                            BufInner::Cuda(_) => {
                                return Err(invalid(
                                    "buffer",
                                    "a CUDA buffer",
                                    "allocate it on this OpenCL device",
                                ))
                            }
                        },
                        Arg::I32(v) => ClArg::I32(*v),
                        Arg::F32(v) => ClArg::F32(*v),
                    });
                }
                c.launch(
                    key,
                    || source(crate::codegen::Target::OpenCl),
                    name,
                    [grid[0] * block, grid[1], grid[2]],
                    [block, 1, 1],
                    &a,
                )
            }
        }
    }

    /// Runs an element-wise kernel over `n` work items.
    /// Writes the f32 `rows x cols` column-major `x` in `dtype` to `y`, as
    /// it is or (`trans`) transposed to `cols x rows`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn convert(
        &self,
        dtype: crate::GpuDtype,
        x: &Buffer,
        y: &Buffer,
        rows: usize,
        cols: usize,
        trans: bool,
    ) -> Result<()> {
        let i =
            |what: &str, v: usize| i32::try_from(v).map_err(|_| invalid(what, v, "exceeds i32"));
        self.launch_elementwise(
            crate::codegen::ElementwiseKernel::Convert(dtype),
            rows * cols,
            &[
                Arg::Buf(x),
                Arg::Buf(y),
                Arg::I32(i("rows", rows)?),
                Arg::I32(i("cols", cols)?),
                Arg::I32(trans as i32),
            ],
        )
    }

    /// `src` in `dtype` where `dst` is a buffer for it (converted, as it
    /// is, `elems` values), else `src` itself (f32 layers): a GEMM operand.
    pub(crate) fn typed<'a>(
        &self,
        dtype: crate::GpuDtype,
        src: &'a Buffer,
        dst: &'a Option<Buffer>,
        elems: usize,
    ) -> Result<&'a Buffer> {
        match dst {
            Some(d) => {
                self.convert(dtype, src, d, elems, 1, false)?;
                Ok(d)
            }
            None => Ok(src),
        }
    }

    /// dz = dy * act'(z) over `n` values, from the output `y` (activations
    /// without a register derivative count as identity).
    pub(crate) fn act_backward(
        &self,
        act: brgemm::Activation,
        y: &Buffer,
        dy: &Buffer,
        dz: &Buffer,
        n: usize,
    ) -> Result<()> {
        use brgemm::Activation as A;
        let a = match act {
            A::Relu | A::Sigmoid | A::Tanh => act,
            _ => A::Identity,
        };
        let n32 = i32::try_from(n).map_err(|_| invalid("elements", n, "exceeds i32"))?;
        self.launch_elementwise(
            crate::codegen::ElementwiseKernel::ActBackward(a),
            n,
            &[Arg::Buf(y), Arg::Buf(dy), Arg::Buf(dz), Arg::I32(n32)],
        )
    }

    pub(crate) fn launch_elementwise(
        &self,
        k: crate::ElementwiseKernel,
        n: usize,
        args: &[Arg],
    ) -> Result<()> {
        const BLOCK: usize = 256;
        self.launch(
            "elementwise",
            crate::codegen::elementwise_source,
            k.name(),
            [n.div_ceil(BLOCK), 1, 1],
            BLOCK,
            args,
        )
    }
}
