//! bf16 BRGEMM: bf16 inputs, f32 accumulation and output.
//!
//! A_i is read in VNNI layout: consecutive pairs along k for each row, so
//! element (r, p) of A_i sits at `(p / 2) * 2 * lda + 2 * r + p % 2` (`lda` >=
//! m counts pairs per k-pair row). [`pack_a_vnni`] builds it from plain
//! column-major data, padding an odd k with zeros. B_i and C keep the plain
//! column-major layout of the f32 kernel.
//!
//! Kernels, strongest first ([`Bf16Isa`]): AMX (`tdpbf16ps` on resident tiles;
//! m and k multiples of 32, any n), AVX512-BF16 (`vdpbf16ps`; any shape), the f32
//! BRGEMM on inputs widened per call (any shape, any CPU), then the
//! reference (bf16 widened to f32 in plain loops).
//! `BRGEMM_BF16_ISA=amx|avx512bf16|fp32|reference` forces one.
//!
//! Any address works, but AMX loads whole 64-byte tile rows: with operands
//! 64-byte aligned ([`crate::AlignedVec`], which [`pack_a_vnni`] returns)
//! and leading dimensions multiples of 32 elements, each row is one cache
//! line, and the kernel runs about 1.4x faster than 16 bytes off.
//!
//! C is f32, or bf16 with `Descriptor::c_dtype(DataType::Bf16)`: the sum,
//! alpha, beta (the old bf16 C widened), bias and activation are computed in
//! f32 on an L1-hot scratch block, then rounded to nearest even
//! ([`crate::Kernel::execute_bf16_out`]).

use crate::batch::{AddrSrc, BatchSrc, OffsetSrc, RawBatch, StrideSrc};
use crate::blocking::RegisterTile;
use crate::buffer::{aligned_vec, AlignedVec};
use crate::desc::{Activation, BatchForm, Beta, DataType, Descriptor};
use crate::error::{invalid, Error, Result};
#[cfg(target_arch = "x86_64")]
use crate::kernels::amx_bf16 as amx;
pub use half::bf16;
use std::sync::OnceLock;

/// The bf16 kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bf16Isa {
    /// AMX tiles (`tdpbf16ps`), for m and k multiples of 32, any n.
    Amx,
    /// AVX512-BF16 (`vdpbf16ps`), any shape.
    Avx512Bf16,
    /// The f32 BRGEMM (the best f32 ISA here) on inputs widened per call:
    /// any shape, any CPU, no bf16 arithmetic needed.
    Fp32,
    /// Plain loops on widened values: any shape, any CPU.
    Reference,
}

impl Bf16Isa {
    /// All bf16 kernels, strongest first.
    pub const ALL: [Bf16Isa; 4] = [
        Bf16Isa::Amx,
        Bf16Isa::Avx512Bf16,
        Bf16Isa::Fp32,
        Bf16Isa::Reference,
    ];

    /// Name as `BRGEMM_BF16_ISA` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Isa::Amx => "amx",
            Bf16Isa::Avx512Bf16 => "avx512bf16",
            Bf16Isa::Fp32 => "fp32",
            Bf16Isa::Reference => "reference",
        }
    }
    /// Whether this CPU and OS can run it (AMX: CPU support, OS tile state
    /// and the permission granted; `BRGEMM_AMX_DENY` simulates a refusal).
    pub fn is_supported(self) -> bool {
        crate::kernels::available(self.name(), DataType::Bf16)
    }
    /// Whether a layer should run its bf16 passes on this kernel rather
    /// than stay f32: the kernel was forced with `BRGEMM_BF16_ISA` (asked
    /// for by name: tests, experiments), or the CPU policy measured it
    /// faster than the f32 kernel ([`crate::Policy::bf16_beats_f32`]).
    pub fn beats_f32(self) -> bool {
        matches!(Self::forced(), Ok(Some(_)))
            || crate::policy().is_ok_and(|p| p.bf16_beats_f32(self))
    }

    /// Whether `BRGEMM_BF16_ISA` names a kernel (which then runs wherever
    /// bf16 is asked for).
    pub fn is_forced() -> bool {
        matches!(Self::forced(), Ok(Some(_)))
    }

    /// `BRGEMM_BF16_ISA` if set (error if unknown or unsupported), else None.
    fn forced() -> Result<Option<Bf16Isa>> {
        static F: OnceLock<Result<Option<Bf16Isa>>> = OnceLock::new();
        F.get_or_init(|| match crate::env::Setting::Bf16Isa.value() {
            Some(s) if !s.trim().is_empty() => {
                let isa = Bf16Isa::ALL
                    .into_iter()
                    .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
                    .ok_or_else(|| Error::UnknownIsa { value: s.clone() })?;
                if isa.is_supported() {
                    Ok(Some(isa))
                } else {
                    Err(invalid(
                        "BRGEMM_BF16_ISA",
                        s,
                        "not supported on this machine",
                    ))
                }
            }
            _ => Ok(None),
        })
        .clone()
    }
}

/// Whether f32 -> bf16 rounding may use the AVX512-BF16 conversion
/// (`vcvtne2ps2bf16`, 32 values per instruction, with AVX512 BW, VL and DQ
/// for the masks and shuffles around it): the CPU has all four and
/// `BRGEMM_ISA` selects AVX-512 (a lower ISA asked for runs the portable
/// loops, which round to the same bits). Read once per process.
pub fn converts_in_hardware() -> bool {
    static HW: OnceLock<bool> = OnceLock::new();
    *HW.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            crate::Isa::selected() == Ok(crate::Isa::Avx512)
                && std::arch::is_x86_feature_detected!("avx512bf16")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512dq")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Packs a plain column-major `m x k` matrix (leading dimension `ld` >= m)
/// into VNNI layout with `lda` (>= m) pairs per k-pair row; an odd k is
/// padded with a zero column. The result is 64-byte aligned: with `lda` a
/// multiple of 32 every AMX tile row is one cache line.
pub fn pack_a_vnni(
    a: &[bf16],
    m: usize,
    k: usize,
    ld: usize,
    lda: usize,
) -> Result<AlignedVec<bf16>> {
    if m == 0 || k == 0 {
        return Err(invalid(
            if m == 0 { "m" } else { "k" },
            0,
            "must be at least 1",
        ));
    }
    if ld < m {
        return Err(invalid("ld", ld, format!("must be >= m = {m}")));
    }
    if lda < m {
        return Err(invalid("lda", lda, format!("must be >= m = {m}")));
    }
    let need = ld * (k - 1) + m;
    if a.len() < need {
        return Err(Error::ShortSlice {
            operand: "A".into(),
            needed: need,
            len: a.len(),
        });
    }
    let kp = k.div_ceil(2);
    let mut out = aligned_vec(2 * lda * kp, bf16::ZERO);
    for p in 0..k {
        for r in 0..m {
            out[(p / 2) * 2 * lda + 2 * r + p % 2] = a[p * ld + r];
        }
    }
    Ok(out)
}

/// The bf16 plan behind a [`crate::Kernel`] whose descriptor has dtype
/// Bf16 (see the module docs for the layouts).
#[derive(Debug)]
pub(crate) struct Bf16Plan {
    desc: Descriptor,
    isa: Bf16Isa,
    /// For a bf16 C: the same kernel with an f32 C of leading dimension m
    /// (the scratch block the result is rounded from).
    f32_twin: Option<Box<Bf16Plan>>,
    /// For [`Bf16Isa::Fp32`]: the f32 kernel over the widened, packed batch.
    fp32: Option<std::sync::Arc<crate::Kernel>>,
    /// For [`Bf16Isa::Avx512Bf16`]: its main register tile.
    tile: Option<RegisterTile>,
}

impl Bf16Plan {
    /// Plans `desc` (its `dtype` must be [`DataType::Bf16`]) for `isa`, else
    /// for the first kernel of the CPU policy's [`crate::Policy::bf16_order`]
    /// that runs here and fits the shape, or `BRGEMM_BF16_ISA`; the
    /// AVX512-BF16 kernel on `tile`, else on the policy's
    /// [`crate::Policy::avx512bf16_tile`] where C's rows are whole tiles of
    /// it, else on 2 x 12. Errors name a kernel that does not run here, a
    /// shape it cannot take, or a tile it does not have.
    pub(crate) fn with_options(
        desc: &Descriptor,
        isa: Option<Bf16Isa>,
        tile: Option<RegisterTile>,
    ) -> Result<Bf16Plan> {
        let isa = match (isa, Bf16Isa::forced()?) {
            (Some(i), _) | (None, Some(i)) => i,
            (None, None) => crate::policy()?
                .bf16_order
                .into_iter()
                .find(|&i| i.is_supported() && (i != Bf16Isa::Amx || Self::amx_fits(desc)))
                .unwrap_or(Bf16Isa::Fp32),
        };
        let tile = Self::tile(desc, isa, tile)?;
        Self::with_isa(desc, isa, tile)
    }

    /// The AVX512-BF16 kernel's main tile for `d` (see
    /// [`Bf16Plan::with_options`]); `None` for the other kernels.
    fn tile(
        d: &Descriptor,
        isa: Bf16Isa,
        forced: Option<RegisterTile>,
    ) -> Result<Option<RegisterTile>> {
        let name = |t: RegisterTile| format!("{}x{}", t.mv, t.nr);
        if isa != Bf16Isa::Avx512Bf16 {
            return match forced {
                Some(t) => Err(invalid(
                    "tile",
                    name(t),
                    format!(
                        "the {} bf16 kernel has no register tile to choose",
                        isa.name()
                    ),
                )),
                None => Ok(None),
            };
        }
        #[cfg(target_arch = "x86_64")]
        {
            use crate::kernels::avx512bf16_bf16 as k;
            match forced {
                Some(t) if !k::has_tile(t) => Err(invalid(
                    "tile",
                    name(t),
                    "not a tile of the AVX512-BF16 kernel (1-2 x 1-12 or 3-4 x 1-4)",
                )),
                Some(t) => Ok(Some(t)),
                None => Ok(Some(
                    crate::policy()?
                        .avx512bf16_tile
                        .filter(|t| d.m.is_multiple_of(16 * t.mv))
                        .unwrap_or(k::DEFAULT_TILE),
                )),
            }
        }
        // with_isa refused AVX512-BF16 off x86-64.
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (d, forced, name);
            Ok(None)
        }
    }

    fn amx_fits(d: &Descriptor) -> bool {
        d.m.is_multiple_of(32) && d.k.is_multiple_of(32)
    }

    /// Plans `desc` for `isa` on main tile `tile` ([`Bf16Plan::tile`]; error
    /// if `isa` is unsupported or the shape does not fit it).
    fn with_isa(desc: &Descriptor, isa: Bf16Isa, tile: Option<RegisterTile>) -> Result<Bf16Plan> {
        if desc.dtype != DataType::Bf16 {
            return Err(invalid(
                "dtype",
                format!("{:?}", desc.dtype),
                "a bf16 kernel needs DataType::Bf16",
            ));
        }
        let mut d = *desc;
        if let BatchForm::Packed = d.batch_form {
            let sa = 2 * d.lda * d.k.div_ceil(2);
            d.batch_form = BatchForm::Stride {
                a: sa,
                b: d.ldb * d.n,
            };
        }
        let d = d.validate()?;
        if !isa.is_supported() {
            return Err(invalid("isa", isa.name(), "not supported on this machine"));
        }
        if isa == Bf16Isa::Amx && !Self::amx_fits(&d) {
            return Err(invalid(
                "shape",
                format!("{}x{}x{}", d.m, d.n, d.k),
                "the AMX kernel needs m and k multiples of 32",
            ));
        }
        let f32_twin = (d.c_dtype == DataType::Bf16)
            .then(|| {
                let t = Descriptor {
                    ldc: d.m,
                    c_dtype: DataType::F32,
                    ..d
                };
                Ok::<_, Error>(Box::new(Bf16Plan {
                    desc: t,
                    isa,
                    f32_twin: None,
                    fp32: Self::fp32_kernel(&t, isa)?,
                    tile,
                }))
            })
            .transpose()?;
        Ok(Bf16Plan {
            desc: d,
            isa,
            f32_twin,
            fp32: Self::fp32_kernel(&d, isa)?,
            tile,
        })
    }

    /// The f32 kernel [`Bf16Isa::Fp32`] runs on the widened batch (packed
    /// back to back: A_i plain m x k, B_i k x n).
    fn fp32_kernel(d: &Descriptor, isa: Bf16Isa) -> Result<Option<std::sync::Arc<crate::Kernel>>> {
        if isa != Bf16Isa::Fp32 || d.c_dtype != DataType::F32 {
            return Ok(None);
        }
        let f = Descriptor::new(d.m, d.n, d.k)
            .ldc(d.ldc)
            .alpha(d.alpha)
            .beta(d.beta)
            .epilogue(d.epilogue)
            .batch_form(BatchForm::Stride {
                a: d.m * d.k,
                b: d.k * d.n,
            });
        crate::dispatch(&f).map(Some)
    }

    pub(crate) fn isa(&self) -> Bf16Isa {
        self.isa
    }
    pub(crate) fn register_tile(&self) -> Option<RegisterTile> {
        self.tile
    }
    pub(crate) fn descriptor(&self) -> &Descriptor {
        &self.desc
    }
    /// Elements of A_i read: `2 * lda * (ceil(k/2) - 1) + 2 * m`.
    pub(crate) fn a_extent(&self) -> usize {
        2 * self.desc.lda * (self.desc.k.div_ceil(2) - 1) + 2 * self.desc.m
    }

    /// As [`Bf16Plan::execute_raw`] with a bf16 C: the f32 result of the
    /// block (old C widened when beta = 1) is rounded to nearest even.
    ///
    /// # Safety
    /// As [`Bf16Plan::execute_raw`], C holding bf16 elements.
    ///
    /// # Panics
    /// If the descriptor's `c_dtype` is not Bf16, or the batch form differs.
    pub(crate) unsafe fn execute_raw_bf16_out(
        &self,
        batch: RawBatch<bf16>,
        c: *mut bf16,
        bias: *const f32,
    ) {
        thread_local! {
            static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let twin = self
            .f32_twin
            .as_ref()
            .expect("execute_raw_bf16_out needs a descriptor with c_dtype Bf16");
        let d = &self.desc;
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            s.resize(d.m * d.n, 0.0);
            if d.beta == Beta::One {
                for j in 0..d.n {
                    for r in 0..d.m {
                        s[j * d.m + r] = (*c.add(j * d.ldc + r)).to_f32();
                    }
                }
            }
            twin.execute_raw(batch, s.as_mut_ptr(), bias);
            for j in 0..d.n {
                for r in 0..d.m {
                    *c.add(j * d.ldc + r) = bf16::from_f32(s[j * d.m + r]);
                }
            }
        });
    }

    /// Runs with no checks, f32 C.
    ///
    /// # Safety
    /// As [`crate::Kernel::execute_raw`], with A_i valid for
    /// [`Bf16Plan::a_extent`] elements, and the descriptor's `c_dtype` F32
    /// (a bf16 C goes through [`Bf16Plan::execute_raw_bf16_out`]).
    ///
    /// # Panics
    /// If `batch` is not of the descriptor's form.
    pub(crate) unsafe fn execute_raw(&self, batch: RawBatch<bf16>, c: *mut f32, bias: *const f32) {
        self.execute_raw_then(batch, c, bias, std::ptr::null())
    }

    /// As [`Bf16Plan::execute_raw`]; a prefetching AVX512-BF16 call's last
    /// pair walks `next_b`, the next call's first B (see
    /// [`crate::Kernel::execute_raw_then`]; null: none).
    ///
    /// # Safety
    /// As [`Bf16Plan::execute_raw`]; `next_b` is only prefetched.
    pub(crate) unsafe fn execute_raw_then(
        &self,
        batch: RawBatch<bf16>,
        c: *mut f32,
        bias: *const f32,
        next_b: *const bf16,
    ) {
        match (batch, self.desc.batch_form) {
            (RawBatch::Stride { a, b, count }, BatchForm::Stride { a: sa, b: sb }) => {
                self.run(&StrideSrc { a, b, sa, sb }, count, c, bias, next_b)
            }
            (
                RawBatch::Offset {
                    a,
                    b,
                    a_offs,
                    b_offs,
                    count,
                },
                BatchForm::Offset,
            ) => self.run(
                &OffsetSrc {
                    a,
                    b,
                    ao: a_offs,
                    bo: b_offs,
                },
                count,
                c,
                bias,
                next_b,
            ),
            (RawBatch::Address { a, b, count }, BatchForm::Address) => {
                self.run(&AddrSrc { a, b }, count, c, bias, next_b)
            }
            _ => panic!("RawBatch form does not match the bf16 kernel's descriptor"),
        }
    }

    unsafe fn run<B: BatchSrc<bf16>>(
        &self,
        src: &B,
        count: usize,
        c: *mut f32,
        bias: *const f32,
        next_b: *const bf16,
    ) {
        // Only the AVX512-BF16 tiles walk the next call's B.
        #[cfg(not(target_arch = "x86_64"))]
        let _ = next_b;
        let d = &self.desc;
        // The bias is read only where the epilogue has one (as the f32
        // kernels do): a chunk before the last of a split reduction passes
        // the block's bias along with an epilogue without it.
        let bias = if d.epilogue.bias {
            bias
        } else {
            std::ptr::null()
        };
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            Bf16Isa::Amx => {
                // Straight into C when no epilogue arithmetic is needed;
                // else through an L1-hot 32x32 block on the stack, set up
                // (4 KiB zeroed) only on that path.
                let mut staged = if d.alpha != 1.0 {
                    Some([0.0f32; 32 * 32])
                } else {
                    None
                };
                for n0 in (0..d.n).step_by(32) {
                    let nb = (d.n - n0).min(32);
                    amx::ensure_config(amx::config(nb));
                    for m0 in (0..d.m).step_by(32) {
                        let cb = c.add(n0 * d.ldc + m0);
                        let (out, ldo, load_c) = match staged.as_mut() {
                            Some(t) => (t.as_mut_ptr(), 32, false),
                            None => (cb, d.ldc, d.beta == Beta::One),
                        };
                        amx::block(src, count, d.k, d.lda, d.ldb, m0, n0, nb, load_c, out, ldo);
                        epilogue(d, cb, d.ldc, m0, 32, nb, bias, staged.as_ref());
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            Bf16Isa::Avx512Bf16 => {
                use crate::kernels::avx512bf16_bf16 as k;
                let main = self.tile.unwrap_or(k::DEFAULT_TILE);
                let call = k::Call {
                    d,
                    count,
                    c,
                    bias,
                    next_b,
                };
                k::run(&call, src, main)
            }
            Bf16Isa::Fp32 => {
                thread_local! {
                    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
                }
                let (m, n, k) = (d.m, d.n, d.k);
                let kern = self.fp32.as_ref().expect("fp32 plan has its f32 kernel");
                WIDE.with(|w| {
                    let mut w = w.borrow_mut();
                    let (sa, sb) = (m * k, k * n);
                    w.resize(count * (sa + sb), 0.0);
                    let (wa, wb) = w.split_at_mut(count * sa);
                    for i in 0..count {
                        let (a, b) = (src.a(i), src.b(i));
                        let da = &mut wa[i * sa..][..sa];
                        for p in 0..k {
                            for r in 0..m {
                                da[p * m + r] =
                                    (*a.add((p / 2) * 2 * d.lda + 2 * r + p % 2)).to_f32();
                            }
                        }
                        let db = &mut wb[i * sb..][..sb];
                        for j in 0..n {
                            for p in 0..k {
                                db[j * k + p] = (*b.add(p + j * d.ldb)).to_f32();
                            }
                        }
                    }
                    kern.execute_raw(
                        RawBatch::Stride {
                            a: wa.as_ptr(),
                            b: wb.as_ptr(),
                            count,
                        },
                        c,
                        bias,
                    );
                });
            }
            _ => crate::kernels::reference_bf16::run(d, src, count, c, bias),
        }
    }
}

/// alpha, beta, bias and activation on a block of C after the AMX kernel.
/// With `acc`, C = alpha*acc (+ C if beta = 1); without, the block already
/// holds the (beta-applied) sum.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
unsafe fn epilogue(
    d: &Descriptor,
    cb: *mut f32,
    ldc: usize,
    m0: usize,
    rows: usize,
    cols: usize,
    bias: *const f32,
    acc: Option<&[f32; 1024]>,
) {
    let act = d.epilogue.activation;
    if acc.is_none() && bias.is_null() && act == Activation::Identity {
        return;
    }
    if acc.is_none() && matches!(act, Activation::Identity | Activation::Relu) {
        // Only the AMX kernel calls this, and every CPU with AMX has AVX-512.
        #[cfg(target_arch = "x86_64")]
        return bias_relu_avx512(cb, ldc, m0, rows, cols, bias, act == Activation::Relu);
        #[cfg(not(target_arch = "x86_64"))]
        return bias_relu(cb, ldc, m0, rows, cols, bias, act == Activation::Relu);
    }
    for j in 0..cols {
        let col = std::slice::from_raw_parts_mut(cb.add(j * ldc), rows);
        for (r, x) in col.iter_mut().enumerate() {
            let mut v = match acc {
                Some(a) => d.alpha * a[j * 32 + r] + if d.beta == Beta::One { *x } else { 0.0 },
                None => *x,
            };
            if !bias.is_null() {
                v += *bias.add(m0 + r);
            }
            *x = act.apply(v);
        }
    }
}

/// Bias and ReLU (or bias alone, or ReLU alone) on a block of C, in plain
/// loops that vectorise: an element-wise match per value cost more than the
/// AMX block itself on short reductions (pointwise convolutions).
#[inline(always)]
unsafe fn bias_relu(
    cb: *mut f32,
    ldc: usize,
    m0: usize,
    rows: usize,
    cols: usize,
    bias: *const f32,
    relu: bool,
) {
    let b = (!bias.is_null()).then(|| std::slice::from_raw_parts(bias.add(m0), rows));
    for j in 0..cols {
        let col = std::slice::from_raw_parts_mut(cb.add(j * ldc), rows);
        match (b, relu) {
            (Some(b), true) => col.iter_mut().zip(b).for_each(|(x, b)| {
                let v = *x + b;
                // NaN stays NaN, as `Activation::apply` has it.
                *x = if v < 0.0 { 0.0 } else { v };
            }),
            (Some(b), false) => col.iter_mut().zip(b).for_each(|(x, b)| *x += b),
            (None, _) => col.iter_mut().for_each(|x| {
                *x = if *x < 0.0 { 0.0 } else { *x };
            }),
        }
    }
}

/// [`bias_relu`] in AVX-512 intrinsics, 16 rows per vector (a masked one
/// for the tail), the bias loaded once per block. The plain loops compiled
/// for AVX-512 stayed scalar (the compiler cannot tell that C and the bias
/// do not overlap): one `vmovss`/`vaddss`/`vmaxss` per value, 18% of a
/// bf16 3x3 convolution's forward (64 channels, 56x56) against 52% in the
/// AMX block itself.
///
/// # Safety
/// As [`bias_relu`], on a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn bias_relu_avx512(
    cb: *mut f32,
    ldc: usize,
    m0: usize,
    rows: usize,
    cols: usize,
    bias: *const f32,
    relu: bool,
) {
    use std::arch::x86_64::*;
    if rows > 32 {
        return bias_relu(cb, ldc, m0, rows, cols, bias, relu);
    }
    let mask = |r0: usize| -> __mmask16 {
        let n = rows.saturating_sub(r0).min(16);
        ((1u32 << n) - 1) as __mmask16
    };
    let (k0, k1) = (mask(0), mask(16));
    let zero = _mm512_setzero_ps();
    let (b0, b1) = if bias.is_null() {
        (zero, zero)
    } else {
        (
            _mm512_maskz_loadu_ps(k0, bias.add(m0)),
            _mm512_maskz_loadu_ps(k1, bias.add(m0 + 16)),
        )
    };
    for j in 0..cols {
        let col = cb.add(j * ldc);
        for (k, b, off) in [(k0, b0, 0), (k1, b1, 16)] {
            if k == 0 {
                continue;
            }
            let mut v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, col.add(off)), b);
            if relu {
                // max(0, v) returns its second operand where either is NaN:
                // NaN stays NaN, as `Activation::apply` has it.
                v = _mm512_max_ps(zero, v);
            }
            _mm512_mask_storeu_ps(col.add(off), k, v);
        }
    }
}
