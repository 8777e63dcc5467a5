//! The GPU descriptor: what is baked into one generated kernel.

use crate::error::{invalid, Result};
use crate::tiling::Tiling;
use brgemm::{Activation, Beta, Epilogue};

pub use crate::dtype::GpuDtype;

/// How A_i and B_i are found (as in the CPU kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpuBatch {
    /// A_i = A + i*a, B_i = B + i*b (elements; baked into the kernel).
    Stride {
        /// Elements between A_i and A_{i+1}.
        a: usize,
        /// Elements between B_i and B_{i+1}.
        b: usize,
    },
    /// `A_i = A + offs_a[i]`, `B_i = B + offs_b[i]`: element offsets in a device
    /// table (see [`crate::BatchTable`]).
    Offset,
    /// A_i and B_i are addresses read from device tables: device pointers on
    /// CUDA; on OpenCL (no pointers across buffers) byte addresses within the
    /// A and B buffers.
    Address,
}

/// A GPU BRGEMM: `C[m x n] = act(alpha * sum_{i<batch} A_i[m x k] B_i[k x n] + beta*C + bias)`,
/// column-major like the CPU kernel (m contiguous in A and C, k in B). The
/// batch count is a launch argument; everything here is a compile-time
/// constant of the generated source.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuDescriptor {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// Columns of A, rows of B.
    pub k: usize,
    /// Leading dimension of A (>= m).
    pub lda: usize,
    /// Leading dimension of B (>= k).
    pub ldb: usize,
    /// Leading dimension of C (>= m).
    pub ldc: usize,
    /// Input element type.
    pub dtype: GpuDtype,
    /// Batch addressing.
    pub batch: GpuBatch,
    /// Scale of the sum.
    pub alpha: f32,
    /// Scale of the old C.
    pub beta: Beta,
    /// Fused per-row bias and activation.
    pub epilogue: Epilogue,
    /// Offset/address tables promise this alignment (elements); the 16-byte
    /// `cp.async` path needs [`GpuDtype::vec`]. Set 1 for arbitrary offsets.
    pub table_align: usize,
    /// Block tiling; `None` takes [`Tiling::heuristic`].
    pub tiling: Option<Tiling>,
}

impl GpuDescriptor {
    /// A packed problem: `lda = m`, `ldb = k`, `ldc = m`, stride form with
    /// back-to-back matrices, beta 0, no epilogue, bf16 inputs.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        GpuDescriptor {
            m,
            n,
            k,
            lda: m,
            ldb: k,
            ldc: m,
            dtype: GpuDtype::Bf16,
            batch: GpuBatch::Stride { a: m * k, b: k * n },
            alpha: 1.0,
            beta: Beta::Zero,
            epilogue: Epilogue::default(),
            table_align: 0,
            tiling: None,
        }
    }
    /// Sets the leading dimension of A.
    pub fn lda(mut self, v: usize) -> Self {
        self.lda = v;
        self
    }
    /// Sets the leading dimension of B.
    pub fn ldb(mut self, v: usize) -> Self {
        self.ldb = v;
        self
    }
    /// Sets the leading dimension of C.
    pub fn ldc(mut self, v: usize) -> Self {
        self.ldc = v;
        self
    }
    /// Sets the input type.
    pub fn dtype(mut self, d: GpuDtype) -> Self {
        self.dtype = d;
        self
    }
    /// Sets the batch form.
    pub fn batch(mut self, b: GpuBatch) -> Self {
        self.batch = b;
        self
    }
    /// Sets alpha.
    pub fn alpha(mut self, a: f32) -> Self {
        self.alpha = a;
        self
    }
    /// Sets beta.
    pub fn beta(mut self, b: Beta) -> Self {
        self.beta = b;
        self
    }
    /// Sets the epilogue.
    pub fn epilogue(mut self, bias: bool, activation: Activation) -> Self {
        self.epilogue = Epilogue { bias, activation };
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

    /// Checks every field; returns the descriptor with the tiling and
    /// table alignment resolved.
    pub fn validate(&self) -> Result<GpuDescriptor> {
        let d = *self;
        for (what, v) in [("m", d.m), ("n", d.n), ("k", d.k)] {
            if v == 0 {
                return Err(invalid(what, v, "must be at least 1"));
            }
            if v > i32::MAX as usize / 2 {
                return Err(invalid(what, v, "exceeds the kernel's 32-bit tile indices"));
            }
        }
        if d.lda < d.m {
            return Err(invalid("lda", d.lda, format!("must be >= m = {}", d.m)));
        }
        if d.ldb < d.k {
            return Err(invalid("ldb", d.ldb, format!("must be >= k = {}", d.k)));
        }
        if d.ldc < d.m {
            return Err(invalid("ldc", d.ldc, format!("must be >= m = {}", d.m)));
        }
        if !d.alpha.is_finite() {
            return Err(invalid("alpha", d.alpha, "must be finite"));
        }
        let v = d.dtype.vec();
        let table_align = match (d.batch, d.table_align) {
            (GpuBatch::Stride { .. }, _) => 1,
            (_, 0) => v,
            (_, a) if a == 1 || a == v => a,
            (_, a) => {
                return Err(invalid(
                    "table_align",
                    a,
                    format!(
                        "must be 1 or {v} (one 16-byte vector of {})",
                        d.dtype.name()
                    ),
                ))
            }
        };
        let tiling = match d.tiling {
            Some(t) => {
                t.validate(d.dtype)?;
                t
            }
            None => Tiling::heuristic(d.m, d.n, d.dtype),
        };
        Ok(GpuDescriptor {
            table_align,
            tiling: Some(tiling),
            ..d
        })
    }

    /// Whether A tiles are copied as 16-byte vectors (`cp.async` on CUDA).
    pub(crate) fn vec_a(&self) -> bool {
        let v = self.dtype.vec();
        self.lda.is_multiple_of(v)
            && match self.batch {
                GpuBatch::Stride { a, .. } => a % v == 0,
                _ => self.table_align == v,
            }
    }
    /// Whether B tiles are copied as 16-byte vectors.
    pub(crate) fn vec_b(&self) -> bool {
        let v = self.dtype.vec();
        self.ldb.is_multiple_of(v)
            && match self.batch {
                GpuBatch::Stride { b, .. } => b % v == 0,
                _ => self.table_align == v,
            }
    }

    /// Elements A_i spans from its first element (`lda*(k-1) + m`).
    pub fn a_extent(&self) -> usize {
        self.lda * (self.k - 1) + self.m
    }
    /// Elements B_i spans.
    pub fn b_extent(&self) -> usize {
        self.ldb * (self.n - 1) + self.k
    }
    /// Elements C spans.
    pub fn c_extent(&self) -> usize {
        self.ldc * (self.n - 1) + self.m
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
        let form = match self.batch {
            GpuBatch::Stride { a, b } => format!("s{a}_{b}"),
            GpuBatch::Offset => format!("o{}", self.table_align),
            GpuBatch::Address => format!("p{}", self.table_align),
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
