//! The GPU descriptor: what is baked into one generated kernel.

use crate::dtype::vec16;
use crate::error::{invalid, Error, Result};
use crate::tiling::Tiling;
use brgemm::{Activation, Beta, Descriptor, Epilogue};

pub use crate::dtype::GpuDtype;

/// How A_i and B_i are found: the CPU kernel's [`brgemm::BatchForm`].
/// `Stride` bakes the strides into the kernel; `Offset` reads element
/// offsets from device tables (see [`crate::BatchTable`]); `Address` reads
/// addresses from device tables (device pointers on CUDA; on OpenCL, with
/// no pointers across buffers, byte addresses within the A and B buffers);
/// `Packed` is resolved to strides by validation.
pub type GpuBatch = brgemm::BatchForm;

/// A GPU BRGEMM: a [`brgemm::Descriptor`] (the same fields and the same
/// validation as on the CPU: `C[m x n] = act(alpha * sum_i A_i[m x k]
/// B_i[k x n] + beta*C + bias)`, column-major, with plain column-major A
/// for every dtype) plus what only the GPU kernel fixes: the tables'
/// alignment and the block tiling. The batch count is a launch argument;
/// everything here is a compile-time constant of the generated source.
/// Reads of the CPU fields go through `Deref` (`d.m`, `d.lda`, `d.dtype`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuDescriptor {
    /// The BRGEMM itself.
    pub desc: Descriptor,
    /// Offset/address tables promise this alignment (elements); the 16-byte
    /// `cp.async` path needs one 16-byte vector. Set 1 for arbitrary offsets.
    pub table_align: usize,
    /// Block tiling; `None` takes [`Tiling::heuristic`].
    pub tiling: Option<Tiling>,
}

impl std::ops::Deref for GpuDescriptor {
    type Target = Descriptor;
    fn deref(&self) -> &Descriptor {
        &self.desc
    }
}

impl GpuDescriptor {
    /// A packed problem: `lda = m`, `ldb = k`, `ldc = m`, stride form with
    /// back-to-back matrices, beta 0, no epilogue, bf16 inputs.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        GpuDescriptor {
            desc: Descriptor::new(m, n, k)
                .dtype(GpuDtype::Bf16)
                .batch_form(GpuBatch::Stride { a: m * k, b: k * n }),
            table_align: 0,
            tiling: None,
        }
    }
    /// Sets the leading dimension of A.
    pub fn lda(mut self, v: usize) -> Self {
        self.desc = self.desc.lda(v);
        self
    }
    /// Sets the leading dimension of B.
    pub fn ldb(mut self, v: usize) -> Self {
        self.desc = self.desc.ldb(v);
        self
    }
    /// Sets the leading dimension of C.
    pub fn ldc(mut self, v: usize) -> Self {
        self.desc = self.desc.ldc(v);
        self
    }
    /// Sets the input type.
    pub fn dtype(mut self, d: GpuDtype) -> Self {
        self.desc = self.desc.dtype(d);
        self
    }
    /// Sets the batch form.
    pub fn batch(mut self, b: GpuBatch) -> Self {
        self.desc = self.desc.batch_form(b);
        self
    }
    /// Sets alpha.
    pub fn alpha(mut self, a: f32) -> Self {
        self.desc = self.desc.alpha(a);
        self
    }
    /// Sets beta.
    pub fn beta(mut self, b: Beta) -> Self {
        self.desc = self.desc.beta(b);
        self
    }
    /// Sets the epilogue.
    pub fn epilogue(mut self, bias: bool, activation: Activation) -> Self {
        self.desc = self.desc.epilogue(Epilogue { bias, activation });
        self
    }
    /// Sets the alignment (elements) that offset/address tables promise.
    pub fn table_align(mut self, a: usize) -> Self {
        self.table_align = a;
        self
    }
    /// Forces a tiling.
    pub fn tiling(mut self, t: Tiling) -> Self {
        self.tiling = Some(t);
        self
    }

    /// Checks every field once: the CPU descriptor's own validation (sizes,
    /// leading dimensions, overflow, alpha, `Packed` resolved to strides),
    /// then what the generated kernel adds (32-bit tile indices, f32 C,
    /// column-major B, the table alignment and the tiling). Returns the
    /// descriptor with the tiling and table alignment resolved.
    pub fn validate(&self) -> Result<GpuDescriptor> {
        let desc = self.desc.validate().map_err(Error::from)?;
        for (what, v) in [("m", desc.m), ("n", desc.n), ("k", desc.k)] {
            if v > i32::MAX as usize / 2 {
                return Err(invalid(what, v, "exceeds the kernel's 32-bit tile indices"));
            }
        }
        if desc.c_dtype != GpuDtype::F32 {
            return Err(invalid(
                "c_dtype",
                format!("{:?}", desc.c_dtype),
                "the GPU kernels write an f32 C",
            ));
        }
        if desc.b_row_major {
            return Err(invalid(
                "b_row_major",
                true,
                "the GPU kernels read column-major B",
            ));
        }
        let v = vec16(desc.dtype);
        let table_align = match (desc.batch_form, self.table_align) {
            (GpuBatch::Stride { .. }, _) => 1,
            (_, 0) => v,
            (_, a) if a == 1 || a == v => a,
            (_, a) => {
                return Err(invalid(
                    "table_align",
                    a,
                    format!(
                        "must be 1 or {v} (one 16-byte vector of {})",
                        desc.dtype.name()
                    ),
                ))
            }
        };
        let tiling = match self.tiling {
            Some(t) => {
                t.validate(desc.dtype)?;
                t
            }
            None => Tiling::heuristic(desc.m, desc.n, desc.dtype),
        };
        Ok(GpuDescriptor {
            desc,
            table_align,
            tiling: Some(tiling),
        })
    }

    /// Whether A tiles are copied as 16-byte vectors (`cp.async` on CUDA).
    pub(crate) fn vec_a(&self) -> bool {
        let v = vec16(self.dtype);
        self.lda.is_multiple_of(v)
            && match self.batch_form {
                GpuBatch::Stride { a, .. } => a % v == 0,
                _ => self.table_align == v,
            }
    }
    /// Whether B tiles are copied as 16-byte vectors.
    pub(crate) fn vec_b(&self) -> bool {
        let v = vec16(self.dtype);
        self.ldb.is_multiple_of(v)
            && match self.batch_form {
                GpuBatch::Stride { b, .. } => b % v == 0,
                _ => self.table_align == v,
            }
    }

    /// Floating-point operations of one call with `batch` pairs.
    pub fn flops(&self, batch: usize) -> f64 {
        2.0 * (self.m * self.n * self.k * batch) as f64
    }

    /// A name unique to everything baked into the kernel (the cache key and
    /// the generated function's name).
    pub fn kernel_name(&self) -> String {
        let t = self
            .tiling
            .unwrap_or_else(|| Tiling::heuristic(self.m, self.n, self.dtype));
        let form = match self.batch_form {
            GpuBatch::Stride { a, b } => format!("s{a}_{b}"),
            GpuBatch::Offset => format!("o{}", self.table_align),
            GpuBatch::Address => format!("p{}", self.table_align),
            GpuBatch::Packed => unreachable!("validation resolves Packed"),
        };
        let act = crate::codegen::act_name(self.epilogue.activation);
        format!(
            "brgemm_{}_m{}n{}k{}_ld{}_{}_{}_{}_a{:08x}_b{}_{}{}_t{}x{}x{}w{}x{}s{}",
            self.dtype.name(),
            self.m,
            self.n,
            self.k,
            self.lda,
            self.ldb,
            self.ldc,
            form,
            self.alpha.to_bits(),
            matches!(self.beta, Beta::One) as u8,
            if self.epilogue.bias { "bias_" } else { "" },
            act,
            t.bm,
            t.bn,
            t.bk,
            t.warps_m,
            t.warps_n,
            t.stages
        )
    }
}
