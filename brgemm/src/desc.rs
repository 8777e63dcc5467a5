//! The kernel descriptor: everything that is fixed when a kernel is planned.

use crate::error::{invalid, Result};
use std::hash::{Hash, Hasher};

/// Element type of A, B and C.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DataType {
    /// IEEE binary32 inputs, accumulation and output.
    #[default]
    F32,
    /// bfloat16 inputs (`half::bf16`), f32 accumulation and f32 output.
    /// A_i is VNNI-packed (see [`crate::bf16::pack_a_vnni`]): element (r, p)
    /// at `(p / 2) * 2 * lda + 2 * r + p % 2`; B_i is plain column-major.
    /// Planned by [`crate::Kernel`] on a bf16 kernel.
    Bf16,
    /// IEEE binary16 inputs, f32 accumulation: the GPU kernels read it
    /// (plain column-major A); no CPU kernel does.
    F16,
}

impl DataType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::F32 => 4,
            DataType::Bf16 | DataType::F16 => 2,
        }
    }
    /// Lower-case name (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::Bf16 => "bf16",
            DataType::F16 => "f16",
        }
    }
}

/// How the batch of A_i and B_i is addressed at call time.
///
/// Fixed at plan time because each form is a differently specialised kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BatchForm {
    /// Each call passes one pointer (or slice) per A_i and per B_i.
    Address,
    /// Each call passes a base for A and for B plus a table of element offsets
    /// ([`crate::Offsets`]).
    Offset,
    /// A_i = A + i * `a`, B_i = B + i * `b` (element strides, fixed here).
    Stride {
        /// Elements between A_i and A_{i+1}.
        a: usize,
        /// Elements between B_i and B_{i+1}.
        b: usize,
    },
    /// The default: stride form with packed, back-to-back matrices
    /// (`a = lda*k`, `b = ldb*n`), resolved by [`Descriptor::validate`].
    #[default]
    Packed,
}

/// What C is multiplied by before the sum is added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Beta {
    /// C is overwritten and never read.
    #[default]
    Zero,
    /// The sum is added to C.
    One,
}

/// Element-wise function applied to the C tile after bias, before the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Activation {
    /// No activation.
    #[default]
    Identity,
    /// max(x, 0), in registers.
    Relu,
    /// 1 / (1 + exp(-x)), on the tile while it is in L1.
    Sigmoid,
    /// tanh(x), on the tile while it is in L1.
    Tanh,
    /// x * Phi(x) with the tanh approximation, on the tile while it is in L1.
    Gelu,
}

impl Activation {
    /// Applies the activation to one value (the definition every kernel follows).
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::Identity => x,
            // NaN stays NaN (f32::max would turn it into 0).
            Activation::Relu => {
                if x < 0.0 {
                    0.0
                } else {
                    x
                }
            }
            Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            Activation::Tanh => x.tanh(),
            Activation::Gelu => {
                const C: f32 = 0.797_884_6; // sqrt(2/pi)
                0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
            }
        }
    }

    /// Whether the vector kernels apply it in registers (otherwise a pass over
    /// the just-stored tile does it while the tile is hot in L1).
    pub(crate) fn in_registers(self) -> bool {
        matches!(self, Activation::Identity | Activation::Relu)
    }
}

/// Software prefetch strategy (a kernel-generation hint, as in LIBXSMM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Prefetch {
    /// None: best when the batch's A and B sit in L2.
    #[default]
    None,
    /// Prefetch A_{i+1} and B_{i+1} into L1 while computing A_i * B_i: for
    /// batches streamed from L3 or memory (AVX-512 kernels; others ignore it).
    /// Such kernels also take a region to prefetch for the next call
    /// ([`crate::Kernel::execute_raw_ahead`]) or the next call's first B
    /// ([`crate::Kernel::execute_raw_then`]). The AVX512-BF16 bf16 kernel
    /// prefetches A_{i+1} only (and B where a call names the next one's);
    /// the AMX one always prefetches its next tiles.
    NextPair,
}

/// Fused work on the C tile before its single store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Epilogue {
    /// Add a per-row bias (length m) passed at call time.
    pub bias: bool,
    /// Then apply this activation.
    pub activation: Activation,
}

/// A BRGEMM problem: `C[m x n] = beta*C + alpha * sum_{i<batch} A_i[m x k] * B_i[k x n]`.
///
/// All matrices are column-major (m is the contiguous dimension of A and C,
/// k that of B). Build one with [`Descriptor::new`] and the setters, then plan
/// it with [`crate::Kernel::new`] or [`crate::dispatch`].
///
/// ```
/// use brgemm::{Beta, BatchForm, Descriptor};
/// let d = Descriptor::new(64, 64, 64).lda(80).beta(Beta::One).batch_form(BatchForm::Offset);
/// assert!(d.validate().is_ok());
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Descriptor {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// Columns of A, rows of B.
    pub k: usize,
    /// Leading dimension of A (>= m).
    pub lda: usize,
    /// Leading dimension of B (>= k; >= n when `b_row_major`).
    pub ldb: usize,
    /// B_i stored row-major (`k` rows of `n`, element (p, j) at `p*ldb + j`)
    /// instead of column-major: a product with B transposed in memory
    /// (BLAS `transb`), e.g. activations with the channels innermost as the
    /// right operand of a weight-gradient reduction over pixels. f32 only.
    pub b_row_major: bool,
    /// Leading dimension of C (>= m).
    pub ldc: usize,
    /// Element type of A and B.
    pub dtype: DataType,
    /// Element type of C: f32, or bf16 (with bf16 inputs) rounded to nearest
    /// even after the epilogue.
    pub c_dtype: DataType,
    /// How A_i and B_i are found.
    pub batch_form: BatchForm,
    /// Scale of the sum of products.
    pub alpha: f32,
    /// Scale of the old C (0 or 1).
    pub beta: Beta,
    /// Fused bias and activation.
    pub epilogue: Epilogue,
    /// Software prefetch strategy.
    pub prefetch: Prefetch,
}

impl Descriptor {
    /// A descriptor with minimal leading dimensions, packed stride batch,
    /// alpha = 1, beta = 0 and no epilogue.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Descriptor {
            m,
            n,
            k,
            lda: m,
            ldb: k,
            b_row_major: false,
            ldc: m,
            dtype: DataType::F32,
            c_dtype: DataType::F32,
            batch_form: BatchForm::Packed,
            alpha: 1.0,
            beta: Beta::Zero,
            epilogue: Epilogue::default(),
            prefetch: Prefetch::None,
        }
    }
    /// Sets the prefetch strategy.
    pub fn prefetch(mut self, p: Prefetch) -> Self {
        self.prefetch = p;
        self
    }
    /// Sets the leading dimension of A.
    pub fn lda(mut self, lda: usize) -> Self {
        self.lda = lda;
        self
    }
    /// Sets the leading dimension of B.
    pub fn ldb(mut self, ldb: usize) -> Self {
        self.ldb = ldb;
        self
    }
    /// Stores B_i row-major (sets `ldb` to `n`, the packed row length; set
    /// another `ldb` after this call).
    pub fn b_row_major(mut self) -> Self {
        self.b_row_major = true;
        self.ldb = self.n;
        self
    }
    /// Sets the leading dimension of C.
    pub fn ldc(mut self, ldc: usize) -> Self {
        self.ldc = ldc;
        self
    }
    /// Sets alpha.
    pub fn alpha(mut self, alpha: f32) -> Self {
        self.alpha = alpha;
        self
    }
    /// Sets beta.
    pub fn beta(mut self, beta: Beta) -> Self {
        self.beta = beta;
        self
    }
    /// Sets the batch form.
    pub fn batch_form(mut self, f: BatchForm) -> Self {
        self.batch_form = f;
        self
    }
    /// Sets the epilogue.
    pub fn epilogue(mut self, e: Epilogue) -> Self {
        self.epilogue = e;
        self
    }
    /// Sets the element type of C (bf16 needs bf16 inputs).
    pub fn c_dtype(mut self, d: DataType) -> Self {
        self.c_dtype = d;
        self
    }
    /// Sets the element type.
    pub fn dtype(mut self, d: DataType) -> Self {
        self.dtype = d;
        self
    }

    /// Elements of A_i that the kernel touches: `lda*(k-1) + m`.
    pub fn a_extent(&self) -> usize {
        self.lda * (self.k - 1) + self.m
    }
    /// Elements of B_i that the kernel touches: `ldb*(n-1) + k`
    /// (row-major: `ldb*(k-1) + n`).
    pub fn b_extent(&self) -> usize {
        let (cols, rows) = self.b_outer_inner();
        self.ldb * (cols - 1) + rows
    }
    /// (outer, inner) dimensions of B_i in memory: (n, k) column-major,
    /// (k, n) row-major.
    fn b_outer_inner(&self) -> (usize, usize) {
        if self.b_row_major {
            (self.k, self.n)
        } else {
            (self.n, self.k)
        }
    }
    /// Elements of C that the kernel touches: `ldc*(n-1) + m`.
    pub fn c_extent(&self) -> usize {
        self.ldc * (self.n - 1) + self.m
    }

    /// Checks every field and returns the descriptor with `Packed` resolved
    /// to explicit strides. Errors name the field and its value.
    pub fn validate(&self) -> Result<Descriptor> {
        // Byte offsets must fit in isize for pointer arithmetic.
        const MAX_ELEMS: usize = (isize::MAX as usize) / 8;
        for (field, v) in [("m", self.m), ("n", self.n), ("k", self.k)] {
            if v == 0 {
                return Err(invalid(field, v, "must be at least 1"));
            }
            if v > MAX_ELEMS {
                return Err(invalid(field, v, "too large"));
            }
        }
        let (b_outer, b_inner) = self.b_outer_inner();
        let b_dim = if self.b_row_major {
            "n (row-major B)"
        } else {
            "k"
        };
        for (field, ld, dim, dname) in [
            ("lda", self.lda, self.m, "m"),
            ("ldb", self.ldb, b_inner, b_dim),
            ("ldc", self.ldc, self.m, "m"),
        ] {
            if ld < dim {
                return Err(invalid(field, ld, format!("must be >= {dname} = {dim}")));
            }
        }
        let extent = |field: &'static str, ld: usize, cols: usize, rows: usize| {
            ld.checked_mul(cols - 1)
                .and_then(|x| x.checked_add(rows))
                .filter(|&x| x <= MAX_ELEMS)
                .ok_or_else(|| invalid(field, ld, "matrix size overflows the address space"))
        };
        let a_ext = extent("lda", self.lda, self.k, self.m)?;
        let b_ext = extent("ldb", self.ldb, b_outer, b_inner)?;
        if self.c_dtype == DataType::Bf16 && self.dtype != DataType::Bf16 {
            return Err(invalid(
                "c_dtype",
                "Bf16",
                "a bf16 C needs bf16 inputs (dtype Bf16)",
            ));
        }
        if self.b_row_major && self.dtype != DataType::F32 {
            return Err(invalid(
                "b_row_major",
                true,
                "row-major B is supported for f32 only",
            ));
        }
        extent("ldc", self.ldc, self.n, self.m)?;
        if !self.alpha.is_finite() {
            return Err(invalid("alpha", self.alpha, "must be finite"));
        }
        let mut d = *self;
        if let BatchForm::Packed = self.batch_form {
            // Packed matrices sit back to back: stride = full column-major size.
            let sa = self.lda.checked_mul(self.k).filter(|&x| x <= MAX_ELEMS);
            let sb = self.ldb.checked_mul(b_outer).filter(|&x| x <= MAX_ELEMS);
            match (sa, sb) {
                (Some(a), Some(b)) => d.batch_form = BatchForm::Stride { a, b },
                _ => return Err(invalid("batch_form", "Packed", "packed stride overflows")),
            }
        }
        if let BatchForm::Stride { a, b } = d.batch_form {
            if a > MAX_ELEMS {
                return Err(invalid("stride_a", a, "too large"));
            }
            if b > MAX_ELEMS {
                return Err(invalid("stride_b", b, "too large"));
            }
        }
        let _ = (a_ext, b_ext);
        Ok(d)
    }
}

// alpha is an f32, so equality and hashing go through its bits; the cache
// keys on exactly what the caller wrote.
impl PartialEq for Descriptor {
    fn eq(&self, o: &Self) -> bool {
        (
            self.m,
            self.n,
            self.k,
            self.lda,
            self.ldb,
            self.ldc,
            self.b_row_major,
        ) == (o.m, o.n, o.k, o.lda, o.ldb, o.ldc, o.b_row_major)
            && self.dtype == o.dtype
            && self.c_dtype == o.c_dtype
            && self.batch_form == o.batch_form
            && self.alpha.to_bits() == o.alpha.to_bits()
            && self.beta == o.beta
            && self.epilogue == o.epilogue
            && self.prefetch == o.prefetch
    }
}
impl Eq for Descriptor {}
impl Hash for Descriptor {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (
            self.m,
            self.n,
            self.k,
            self.lda,
            self.ldb,
            self.ldc,
            self.b_row_major,
        )
            .hash(h);
        self.dtype.hash(h);
        self.c_dtype.hash(h);
        self.batch_form.hash(h);
        self.alpha.to_bits().hash(h);
        self.beta.hash(h);
        self.epilogue.hash(h);
        self.prefetch.hash(h);
    }
}
