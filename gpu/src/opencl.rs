//! The OpenCL backend (any OpenCL 1.2+ device; PoCL on the CPU in CI).

use crate::error::{Error, Result};
use opencl3::command_queue::CommandQueue;
use opencl3::context::Context;
use opencl3::kernel::{ExecuteKernel, Kernel};
use opencl3::memory::{Buffer, CL_MEM_READ_WRITE};
use opencl3::program::Program;
use opencl3::types::CL_BLOCKING;
use std::collections::HashMap;
use std::sync::Mutex;

fn cl(e: impl std::fmt::Display) -> Error {
    Error::OpenCl(e.to_string())
}

/// An OpenCL device with its context, in-order queue and program cache.
pub struct OpenClBackend {
    name: String,
    // Field order: kernels and programs are released before the queue and
    // the context.
    /// Kernels by program key, then function name: a launch finds its
    /// kernel without building a string.
    kernels: Mutex<HashMap<String, HashMap<String, Kernel>>>,
    programs: Mutex<HashMap<String, Program>>,
    queue: CommandQueue,
    context: Context,
}

/// A kernel argument.
pub(crate) enum ClArg<'a> {
    Buf(&'a Buffer<u8>),
    I32(i32),
    F32(f32),
}

impl OpenClBackend {
    /// The first device of the first platform that has one; errors when the
    /// OpenCL loader or any device is missing.
    pub fn new() -> Result<Self> {
        if !cl3::is_opencl_runtime_available() {
            return Err(Error::NoOpenCl(
                "libOpenCL.so.1 not found: install an ICD loader and a driver \
                 (Debian: ocl-icd-libopencl1 pocl-opencl-icd)"
                    .into(),
            ));
        }
        let platforms = opencl3::platform::get_platforms().map_err(cl)?;
        for p in platforms {
            let ids = p
                .get_devices(opencl3::device::CL_DEVICE_TYPE_ALL)
                .unwrap_or_default();
            if let Some(&id) = ids.first() {
                let device = opencl3::device::Device::new(id);
                let name = format!(
                    "{} ({})",
                    device.name().unwrap_or_default(),
                    p.name().unwrap_or_default()
                );
                let context = Context::from_device(&device).map_err(cl)?;
                #[allow(deprecated)]
                let queue = CommandQueue::create_default(&context, 0).map_err(cl)?;
                return Ok(OpenClBackend {
                    name,
                    kernels: Mutex::default(),
                    programs: Mutex::default(),
                    queue,
                    context,
                });
            }
        }
        Err(Error::NoOpenCl(
            "no OpenCL device on any platform (Debian: pocl-opencl-icd runs on the CPU)".into(),
        ))
    }

    /// Device and platform name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The context's device.
    fn device(&self) -> Result<opencl3::device::Device> {
        let id = *self
            .context
            .devices()
            .first()
            .ok_or_else(|| Error::NoOpenCl("the context has no device".into()))?;
        Ok(opencl3::device::Device::new(id))
    }

    /// Compute units (`CL_DEVICE_MAX_COMPUTE_UNITS`).
    pub fn compute_units(&self) -> Result<usize> {
        let n = self.device()?.max_compute_units().map_err(cl)?;
        Ok((n as usize).max(1))
    }

    /// Local memory per work-group (`CL_DEVICE_LOCAL_MEM_SIZE`).
    pub fn local_memory(&self) -> Result<usize> {
        let n = self.device()?.local_mem_size().map_err(cl)?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<Buffer<u8>> {
        // SAFETY: no host pointer; zero-filled below before any use, so a
        // fresh buffer reads as zeros, as on CUDA.
        let mut b = unsafe {
            Buffer::<u8>::create(
                &self.context,
                CL_MEM_READ_WRITE,
                bytes.max(1),
                std::ptr::null_mut(),
            )
        }
        .map_err(cl)?;
        // SAFETY: a one-byte pattern over the whole buffer, which exists.
        unsafe {
            self.queue
                .enqueue_fill_buffer(&mut b, &[0u8], 0, bytes.max(1), &[])
        }
        .map_err(cl)?;
        Ok(b)
    }

    pub(crate) fn write(&self, b: &mut Buffer<u8>, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: blocking write of `data.len()` bytes, which the caller
        // checked against the buffer's size.
        unsafe {
            self.queue
                .enqueue_write_buffer(b, CL_BLOCKING, 0, data, &[])
        }
        .map_err(cl)?;
        Ok(())
    }

    pub(crate) fn read(&self, b: &Buffer<u8>, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: blocking read into `out`, sized by the caller within the buffer.
        unsafe { self.queue.enqueue_read_buffer(b, CL_BLOCKING, 0, out, &[]) }.map_err(cl)?;
        Ok(())
    }

    /// Builds `source` once per `key` and launches its kernel `name`.
    pub(crate) fn launch(
        &self,
        key: &str,
        source: impl FnOnce() -> String,
        name: &str,
        global: [usize; 3],
        local: [usize; 3],
        args: &[ClArg],
    ) -> Result<()> {
        let mut kernels = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if !kernels.get(key).is_some_and(|m| m.contains_key(name)) {
            let mut programs = self.programs.lock().unwrap_or_else(|e| e.into_inner());
            if !programs.contains_key(key) {
                let src = source();
                let p = Program::create_and_build_from_source(&self.context, &src, "-cl-std=CL1.2")
                    .map_err(|log| Error::Compile {
                        name: key.to_string(),
                        log,
                    })?;
                programs.insert(key.to_string(), p);
            }
            let k = Kernel::create(&programs[key], name).map_err(cl)?;
            kernels
                .entry(key.to_string())
                .or_default()
                .insert(name.to_string(), k);
        }
        let k = &kernels[key][name];
        let mut ex = ExecuteKernel::new(k);
        for a in args {
            // SAFETY: the argument list matches the generated signature
            // (built by this crate next to the source).
            unsafe {
                match a {
                    ClArg::Buf(b) => ex.set_arg(*b),
                    ClArg::I32(v) => ex.set_arg(v),
                    ClArg::F32(v) => ex.set_arg(v),
                };
            }
        }
        ex.set_global_work_sizes(&global)
            .set_local_work_sizes(&local);
        // SAFETY: all arguments are set; buffers were bounds-checked by the
        // caller against the descriptor.
        unsafe { ex.enqueue_nd_range(&self.queue) }.map_err(cl)?;
        Ok(())
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.queue.finish().map_err(cl)
    }
}
