//! One kernel front end for every data type: the descriptor's `dtype`
//! decides what a [`Kernel`] plans (the f32 register tiles of the selected
//! [`Isa`], or the bf16 kernel the CPU policy prefers), and one set of
//! entry points runs either, generic over the input [`Element`].

use crate::batch::{Batch, RawBatch};
use crate::bf16::{bf16, Bf16Isa, Bf16Plan};
use crate::desc::{DataType, Descriptor};
use crate::error::{invalid, Result};
use crate::plan::{checked_call, F32Plan, KernelOptions};
use crate::{Isa, RegisterTile};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// An input element type a kernel reads: `f32` or [`bf16`].
pub trait Element: sealed::Sealed + Copy + 'static {
    /// The descriptor `dtype` of this element.
    const DTYPE: DataType;

    /// Runs `k`'s plan for this element type.
    ///
    /// # Safety
    /// As [`Kernel::execute_raw_ahead`].
    #[doc(hidden)]
    unsafe fn run(
        k: &Kernel,
        batch: RawBatch<Self>,
        c: *mut f32,
        bias: *const f32,
        ahead: *const f32,
        ahead_len: usize,
    );

    /// Runs `k`'s plan, the last pair prefetching `next_b` (see
    /// [`Kernel::execute_raw_then`]).
    ///
    /// # Safety
    /// As [`Kernel::execute_raw_then`].
    #[doc(hidden)]
    unsafe fn run_then(
        k: &Kernel,
        batch: RawBatch<Self>,
        c: *mut f32,
        bias: *const f32,
        next_b: *const Self,
    );
}

impl Element for f32 {
    const DTYPE: DataType = DataType::F32;
    #[inline(always)]
    unsafe fn run(
        k: &Kernel,
        batch: RawBatch<f32>,
        c: *mut f32,
        bias: *const f32,
        ahead: *const f32,
        ahead_len: usize,
    ) {
        match &k.plan {
            Plan::F32(p) => p.execute_raw_ahead(batch, c, bias, ahead, ahead_len),
            Plan::Bf16(_) => panic!("an f32 batch given to a kernel planned for bf16"),
        }
    }
    #[inline(always)]
    unsafe fn run_then(
        k: &Kernel,
        batch: RawBatch<f32>,
        c: *mut f32,
        bias: *const f32,
        next_b: *const f32,
    ) {
        match &k.plan {
            Plan::F32(p) => p.execute_raw_then(batch, c, bias, next_b),
            Plan::Bf16(_) => panic!("an f32 batch given to a kernel planned for bf16"),
        }
    }
}

impl Element for bf16 {
    const DTYPE: DataType = DataType::Bf16;
    #[inline(always)]
    unsafe fn run(
        k: &Kernel,
        batch: RawBatch<bf16>,
        c: *mut f32,
        bias: *const f32,
        _ahead: *const f32,
        _ahead_len: usize,
    ) {
        match &k.plan {
            Plan::Bf16(p) => p.execute_raw(batch, c, bias),
            Plan::F32(_) => panic!("a bf16 batch given to a kernel planned for f32"),
        }
    }
    #[inline(always)]
    unsafe fn run_then(
        k: &Kernel,
        batch: RawBatch<bf16>,
        c: *mut f32,
        bias: *const f32,
        next_b: *const bf16,
    ) {
        match &k.plan {
            Plan::Bf16(p) => p.execute_raw_then(batch, c, bias, next_b),
            Plan::F32(_) => panic!("a bf16 batch given to a kernel planned for f32"),
        }
    }
}

#[derive(Debug)]
enum Plan {
    F32(F32Plan),
    Bf16(Bf16Plan),
}

/// A planned BRGEMM, f32 or bf16 by its descriptor's `dtype`: validated,
/// dispatched to one kernel, and called many times.
///
/// `Send + Sync`; share it between threads freely (calls take `&self`).
/// Calls do no planning work: [`Kernel::execute`] checks slice lengths in
/// O(1) (O(batch) for the address form) and [`Kernel::execute_raw`] nothing.
#[derive(Debug)]
pub struct Kernel {
    plan: Plan,
}

impl Kernel {
    /// Plans `desc`: for dtype F32 on the selected ISA (`BRGEMM_ISA` or the
    /// best one), for Bf16 on the CPU policy's preferred bf16 kernel
    /// (`BRGEMM_BF16_ISA` forces one).
    pub fn new(desc: &Descriptor) -> Result<Kernel> {
        Kernel::with_options(desc, KernelOptions::default())
    }

    /// Plans `desc` with explicit overrides.
    pub fn with_options(desc: &Descriptor, opts: KernelOptions) -> Result<Kernel> {
        let plan = match desc.dtype {
            DataType::F32 => Plan::F32(F32Plan::with_options(desc, opts)?),
            DataType::Bf16 => Plan::Bf16(Bf16Plan::with_options(desc, opts.bf16, opts.tile)?),
            DataType::F16 => {
                return Err(invalid(
                    "dtype",
                    "F16",
                    "no CPU kernel reads f16 (the GPU kernels do)",
                ))
            }
        };
        Ok(Kernel { plan })
    }

    /// The validated descriptor (with `Packed` resolved to strides).
    pub fn descriptor(&self) -> &Descriptor {
        match &self.plan {
            Plan::F32(p) => p.descriptor(),
            Plan::Bf16(p) => p.descriptor(),
        }
    }
    /// The ISA of the f32 tiles this kernel runs (a bf16 kernel: AMX and
    /// AVX512-BF16 count as AVX-512, the widening kernel as the f32 ISA it
    /// calls, the reference as the reference).
    pub fn isa(&self) -> Isa {
        match &self.plan {
            Plan::F32(p) => p.isa(),
            Plan::Bf16(p) => match p.isa() {
                Bf16Isa::Reference => Isa::Reference,
                Bf16Isa::Fp32 => Isa::selected().unwrap_or(Isa::Reference),
                _ => Isa::Avx512,
            },
        }
    }
    /// The bf16 kernel this kernel runs (`None` for an f32 descriptor).
    pub fn bf16_isa(&self) -> Option<Bf16Isa> {
        match &self.plan {
            Plan::F32(_) => None,
            Plan::Bf16(p) => Some(p.isa()),
        }
    }
    /// The register tile of the main tiles: of the f32 kernels but the
    /// reference, and of the AVX512-BF16 kernel (`None` for the others).
    pub fn register_tile(&self) -> Option<RegisterTile> {
        match &self.plan {
            Plan::F32(p) => p.register_tile(),
            Plan::Bf16(p) => p.register_tile(),
        }
    }
    /// Floating-point operations of one call with `count` batch elements.
    pub fn flops(&self, count: usize) -> f64 {
        let d = self.descriptor();
        2.0 * (d.m * d.n * d.k) as f64 * count as f64
    }
    /// Elements of each A_i a call reads (the VNNI extent for bf16).
    pub fn a_extent(&self) -> usize {
        match &self.plan {
            Plan::F32(p) => p.descriptor().a_extent(),
            Plan::Bf16(p) => p.a_extent(),
        }
    }

    /// The input type and an f32 C, else an error naming the mismatch.
    fn check_types(&self, given: DataType, c_dtype: DataType) -> Result<()> {
        let d = self.descriptor();
        if given != d.dtype {
            return Err(invalid(
                "dtype",
                format!("{given:?}"),
                format!("the kernel was planned for {:?} inputs", d.dtype),
            ));
        }
        if c_dtype != d.c_dtype {
            return Err(invalid(
                "c_dtype",
                format!("{c_dtype:?}"),
                format!(
                    "the kernel writes a {:?} C: use {}",
                    d.c_dtype,
                    if d.c_dtype == DataType::F32 {
                        "execute"
                    } else {
                        "execute_bf16_out"
                    }
                ),
            ));
        }
        Ok(())
    }

    /// Runs the kernel on checked slices, f32 C.
    ///
    /// `bias` must be `Some` (length >= m) exactly when the descriptor's
    /// epilogue has a bias. With `Beta::Zero`, `c` is only written. The
    /// element type must be the descriptor's `dtype` (an error otherwise).
    pub fn execute<T: Element>(
        &self,
        batch: Batch<'_, T>,
        c: &mut [f32],
        bias: Option<&[f32]>,
    ) -> Result<()> {
        self.check_types(T::DTYPE, DataType::F32)?;
        // SAFETY (of the callback): `checked_call` passes only pointers it
        // checked against the validated descriptor.
        checked_call(
            self.descriptor(),
            self.a_extent(),
            batch,
            c,
            bias,
            |raw, c, bias| unsafe { T::run(self, raw, c, bias, std::ptr::null(), 0) },
        )
    }

    /// Runs a bf16 kernel with a bf16 C (`c_dtype` Bf16) on checked
    /// slices: f32 epilogue, then rounding to nearest even.
    pub fn execute_bf16_out(
        &self,
        batch: Batch<'_, bf16>,
        c: &mut [bf16],
        bias: Option<&[f32]>,
    ) -> Result<()> {
        self.check_types(DataType::Bf16, DataType::Bf16)?;
        let Plan::Bf16(p) = &self.plan else {
            unreachable!("dtype Bf16 plans bf16")
        };
        // SAFETY (of the callback): as in `execute`.
        checked_call(
            self.descriptor(),
            self.a_extent(),
            batch,
            c,
            bias,
            |raw, c, bias| unsafe { p.execute_raw_bf16_out(raw, c, bias) },
        )
    }

    /// Runs the kernel on raw pointers with no checks: the entry point for
    /// inner loops of primitives.
    ///
    /// # Safety
    /// - every A_i (B_i) addressed by `batch` is valid for reads of
    ///   [`Kernel::a_extent`] (`descriptor().b_extent()`) elements;
    /// - `c` is valid for reads and writes of `c_extent()` elements and does
    ///   not overlap any A_i or B_i;
    /// - `bias` is valid for `m` reads when the epilogue has a bias, and is
    ///   ignored (may be null) otherwise;
    /// - for the offset and address forms the tables hold `count` entries.
    ///
    /// # Panics
    /// If `batch` is not of the descriptor's batch form or element type (a
    /// programming error).
    #[inline]
    pub unsafe fn execute_raw<T: Element>(
        &self,
        batch: RawBatch<T>,
        c: *mut f32,
        bias: *const f32,
    ) {
        T::run(self, batch, c, bias, std::ptr::null(), 0)
    }

    /// As [`Kernel::execute_raw`], and with a prefetching f32 descriptor
    /// ([`crate::Prefetch::NextPair`]) also prefetches `ahead_len` elements
    /// from `ahead` while it computes, one line per k step spread over the
    /// tiles and pairs (as far as the k steps reach): meant for the next
    /// call's A. A call reads all of A in its first column of tiles and
    /// reuses it from cache for the others; when A streams from memory
    /// (weights larger than L2 used by one or two N blocks) that first
    /// column waits on memory unless the call before brought A in.
    /// Measured, FC forward with 4096 inputs and outputs, one thread,
    /// alternating in one process: N = 64 x1.14-1.20, N = 128 x1.05-1.07
    /// (with prefetcht1 instead: x1.09-1.11 and x1.04); LSTM forward with
    /// K = 1024 and 2048, N = 64: x1.04-1.06 (the recurrent half of its
    /// work).
    ///
    /// The AVX-512 pipelined tiles walk the next pair's B instead wherever
    /// their share of `ahead` is empty (no region, or used up), so with
    /// `ahead_len = 0` a B that streams is prefetched (see the primitives'
    /// convolution); the intrinsic tiles always prefetch a line of it too.
    /// bf16 kernels ignore `ahead`.
    ///
    /// # Safety
    /// As [`Kernel::execute_raw`]; `ahead` is only prefetched, never read,
    /// and may be any address.
    #[inline]
    pub unsafe fn execute_raw_ahead<T: Element>(
        &self,
        batch: RawBatch<T>,
        c: *mut f32,
        bias: *const f32,
        ahead: *const f32,
        ahead_len: usize,
    ) {
        T::run(self, batch, c, bias, ahead, ahead_len)
    }

    /// As [`Kernel::execute_raw`], naming `next_b`, the first B of the call
    /// that comes next (at this call's B offsets). With a prefetching
    /// descriptor ([`crate::Prefetch::NextPair`]) the call's last pair walks
    /// it as each other pair walks its successor's B, so a loop of calls of
    /// several pairs each has its next operand on the way at every pair, not
    /// only inside a call; the AVX512-BF16 kernel, which otherwise prefetches
    /// only A, then walks each next pair's B as well. The f32 plans run
    /// tile instances of their own for it (the pipelined AVX-512 tiles; the
    /// others run as [`Kernel::execute_raw`]), so the loop of every other
    /// call stays as it was: the extra branch in the tiles every f32 pass
    /// shares cost the 16-row FC passes 4-15%. Measured on Zen 4 (the
    /// 1x1 convolutions' gather passes, whose input rows stream from
    /// memory, minibatch 16, alternated in one process): four-pair calls
    /// x1.10-1.16, two-pair calls x1.01-1.10 (docs/tuning-notes.md). The
    /// AMX and reference kernels ignore `next_b`.
    ///
    /// # Safety
    /// As [`Kernel::execute_raw`]; `next_b` is only prefetched, never
    /// read, and may be any address.
    #[inline]
    pub unsafe fn execute_raw_then<T: Element>(
        &self,
        batch: RawBatch<T>,
        c: *mut f32,
        bias: *const f32,
        next_b: *const T,
    ) {
        T::run_then(self, batch, c, bias, next_b)
    }

    /// As [`Kernel::execute_raw`] with a bf16 C: the f32 result of the
    /// block (old C widened when beta = 1) is rounded to nearest even.
    ///
    /// # Safety
    /// As [`Kernel::execute_raw`], C holding bf16 elements.
    ///
    /// # Panics
    /// If the kernel is not a bf16 one with `c_dtype` Bf16, or the batch
    /// form differs.
    pub unsafe fn execute_raw_bf16_out(
        &self,
        batch: RawBatch<bf16>,
        c: *mut bf16,
        bias: *const f32,
    ) {
        match &self.plan {
            Plan::Bf16(p) => p.execute_raw_bf16_out(batch, c, bias),
            Plan::F32(_) => panic!("execute_raw_bf16_out on a kernel planned for f32"),
        }
    }
}
