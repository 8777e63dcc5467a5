//! Planning: a validated descriptor becomes a [`Kernel`] once; calls are cheap.

use crate::batch::{AddrSrc, Batch, BatchSrc, OffsetSrc, RawBatch, StrideSrc};
use crate::blocking::{self, RegisterTile};
use crate::desc::{BatchForm, Beta, Descriptor, Prefetch};
use crate::error::{Error, Result};
use crate::kernel::Kernel;
use crate::kernels::{self, IsaKernels, TileFamily};
use crate::tile::{TileCall, TileSet};
use crate::Isa;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

/// Optional overrides for planning; the defaults suit almost every use.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct KernelOptions {
    /// Force this ISA instead of [`Isa::selected`] (error if unsupported).
    pub isa: Option<Isa>,
    /// Force this register tile instead of the model's choice (tuning
    /// experiments; error if the ISA has no such tile). For a bf16
    /// descriptor, the AVX512-BF16 kernel's main tile (error on the other
    /// bf16 kernels, which have none to choose).
    pub tile: Option<RegisterTile>,
    /// For a bf16 descriptor: force this bf16 kernel instead of the CPU
    /// policy's order (error if unsupported or the shape does not fit).
    pub bf16: Option<crate::bf16::Bf16Isa>,
}

enum Runner<B> {
    Tiles(TileSet<B>),
    Reference,
}

impl<B> Runner<B> {
    /// Register tiles per call (1 for the reference kernel).
    fn tiles(&self) -> usize {
        match self {
            Runner::Tiles(t) => t.count().max(1),
            Runner::Reference => 1,
        }
    }
}

enum Exec {
    Stride(Runner<StrideSrc<f32>>),
    Offset(Runner<OffsetSrc<f32>>),
    Address(Runner<AddrSrc<f32>>),
}

/// The f32 plan behind a [`Kernel`]: validated, dispatched to one ISA and
/// register tile.
pub(crate) struct F32Plan {
    desc: Descriptor,
    isa: Isa,
    tile: Option<RegisterTile>,
    exec: Exec,
    /// The same tiles in the instances that walk the next call's first B
    /// ([`Kernel::execute_raw_then`]), where the ISA has them: AVX-512
    /// plans with `Prefetch::NextPair` and the pipelined tiles.
    then: Option<Exec>,
    /// Register tiles per call (for spreading `execute_raw_ahead`'s region).
    tiles: usize,
}

// SAFETY: a plan holds only plain data and function pointers.
unsafe impl Send for F32Plan {}
unsafe impl Sync for F32Plan {}

impl std::fmt::Debug for F32Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("F32Plan")
            .field("desc", &self.desc)
            .field("isa", &self.isa)
            .field("tile", &self.tile)
            .finish()
    }
}

fn build_tiles<K: IsaKernels, B: BatchSrc<f32>>(
    d: &Descriptor,
    forced: Option<RegisterTile>,
    then: bool,
) -> Result<(TileSet<B>, RegisterTile)> {
    let lanes = K::LANES;
    let family = TileFamily {
        prefetch: d.prefetch == Prefetch::NextPair,
        pipelined: pipeline_enabled(),
        then,
    };
    let t = match forced {
        Some(t) => {
            if t.mv == 0 || t.mv > K::GRID.len() || t.nr == 0 || t.nr > K::GRID[t.mv - 1] {
                return Err(Error::InvalidDescriptor {
                    field: "tile",
                    value: format!("{}x{}", t.mv, t.nr),
                    reason: format!("not in this ISA's grid (max NR per MV: {:?})", K::GRID),
                });
            }
            t
        }
        None => blocking::choose(d.m, d.n, d.k, lanes, K::choice_grid(family)),
    };
    let mb = t.mv * lanes;
    let (m_full, m_rem) = (d.m / mb, d.m % mb);
    let (n_full, n_rem) = (d.n / t.nr, d.n % t.nr);
    let mv_t = m_rem.div_ceil(lanes);
    let tail_masked = m_rem % lanes != 0;
    let get = |mv: usize, nr: usize, masked: bool| {
        K::tile_fn::<B>(mv, nr, masked || K::ALWAYS_MASK, family)
            .expect("grid covers every smaller tile")
    };
    let set = TileSet {
        lanes,
        mv: t.mv,
        nr: t.nr,
        m_full,
        n_full,
        m_tail_rows: if tail_masked { m_rem % lanes } else { lanes },
        main: (m_full > 0 && n_full > 0).then(|| get(t.mv, t.nr, false)),
        m_tail: (m_rem > 0 && n_full > 0).then(|| get(mv_t, t.nr, tail_masked)),
        n_tail: (m_full > 0 && n_rem > 0).then(|| get(t.mv, n_rem, false)),
        mn_tail: (m_rem > 0 && n_rem > 0).then(|| get(mv_t, n_rem, tail_masked)),
    };
    Ok((set, t))
}

fn build_runner<B: BatchSrc<f32>>(
    d: &Descriptor,
    isa: Isa,
    forced: Option<RegisterTile>,
    then: bool,
) -> Result<(Runner<B>, Option<RegisterTile>)> {
    fn wrap<B>(r: (TileSet<B>, RegisterTile)) -> (Runner<B>, Option<RegisterTile>) {
        (Runner::Tiles(r.0), Some(r.1))
    }
    Ok(match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => wrap(build_tiles::<kernels::avx512_f32::Kernels, B>(
            d, forced, then,
        )?),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => wrap(build_tiles::<kernels::avx2_f32::Kernels, B>(
            d, forced, then,
        )?),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => wrap(build_tiles::<kernels::neon_f32::Kernels, B>(
            d, forced, then,
        )?),
        Isa::Portable => wrap(build_tiles::<kernels::portable_f32::Kernels, B>(
            d, forced, then,
        )?),
        Isa::Reference => (Runner::Reference, None),
        #[allow(unreachable_patterns)]
        _ => return Err(Error::IsaUnsupported { isa }),
    })
}

impl F32Plan {
    /// Plans `desc` (dtype F32) with explicit overrides.
    pub(crate) fn with_options(desc: &Descriptor, opts: KernelOptions) -> Result<F32Plan> {
        let d = desc.validate()?;
        let isa = match opts.isa {
            Some(i) if !i.is_supported() => return Err(Error::IsaUnsupported { isa: i }),
            Some(i) => i,
            None => Isa::selected()?,
        };
        let build = |then: bool| -> Result<(Exec, Option<RegisterTile>)> {
            Ok(match d.batch_form {
                BatchForm::Stride { .. } => {
                    let (r, t) = build_runner(&d, isa, opts.tile, then)?;
                    (Exec::Stride(r), t)
                }
                BatchForm::Offset => {
                    let (r, t) = build_runner(&d, isa, opts.tile, then)?;
                    (Exec::Offset(r), t)
                }
                BatchForm::Address => {
                    let (r, t) = build_runner(&d, isa, opts.tile, then)?;
                    (Exec::Address(r), t)
                }
                BatchForm::Packed => unreachable!("validate resolves Packed"),
            })
        };
        let (exec, tile) = build(false)?;
        let has_then = isa == Isa::Avx512 && d.prefetch == Prefetch::NextPair && pipeline_enabled();
        let then = if has_then { Some(build(true)?.0) } else { None };
        let tiles = match &exec {
            Exec::Stride(r) => r.tiles(),
            Exec::Offset(r) => r.tiles(),
            Exec::Address(r) => r.tiles(),
        };
        Ok(F32Plan {
            desc: d,
            isa,
            tile,
            exec,
            then,
            tiles,
        })
    }

    pub(crate) fn descriptor(&self) -> &Descriptor {
        &self.desc
    }
    pub(crate) fn isa(&self) -> Isa {
        self.isa
    }
    pub(crate) fn register_tile(&self) -> Option<RegisterTile> {
        self.tile
    }

    /// See [`Kernel::execute_raw_ahead`].
    ///
    /// # Safety
    /// As [`Kernel::execute_raw_ahead`].
    #[inline]
    pub(crate) unsafe fn execute_raw_ahead(
        &self,
        batch: RawBatch,
        c: *mut f32,
        bias: *const f32,
        ahead: *const f32,
        ahead_len: usize,
    ) {
        self.call(&self.exec, batch, c, bias, ahead, ahead_len)
    }

    /// See [`Kernel::execute_raw_then`]: the `then` instances get the next
    /// call's first B where the plan has them; elsewhere a plain call.
    ///
    /// # Safety
    /// As [`Kernel::execute_raw_then`].
    #[inline]
    pub(crate) unsafe fn execute_raw_then(
        &self,
        batch: RawBatch,
        c: *mut f32,
        bias: *const f32,
        next_b: *const f32,
    ) {
        match &self.then {
            Some(exec) if !next_b.is_null() => self.call(exec, batch, c, bias, next_b, 0),
            _ => self.call(&self.exec, batch, c, bias, std::ptr::null(), 0),
        }
    }

    /// One call through `exec`. With the `then` instances, `ahead` is the
    /// next call's first B and `ahead_len` 0.
    #[inline(always)]
    unsafe fn call(
        &self,
        exec: &Exec,
        batch: RawBatch,
        c: *mut f32,
        bias: *const f32,
        ahead: *const f32,
        ahead_len: usize,
    ) {
        let d = &self.desc;
        let count = match batch {
            RawBatch::Stride { count, .. }
            | RawBatch::Offset { count, .. }
            | RawBatch::Address { count, .. } => count,
        };
        let t = TileCall {
            k: d.k,
            lda: d.lda,
            b_col: if d.b_row_major { 1 } else { d.ldb },
            b_step: if d.b_row_major { d.ldb } else { 1 },
            ldc: d.ldc,
            count,
            alpha: d.alpha,
            beta_one: d.beta == Beta::One,
            act: d.epilogue.activation,
            bias: if d.epilogue.bias {
                bias
            } else {
                std::ptr::null()
            },
            c,
            ahead,
            ahead_next: core::cell::Cell::new(0),
            ahead_end: ahead_len.div_ceil(16),
            ahead_per_pair: ahead_len.div_ceil(16).div_ceil(self.tiles * count.max(1)),
        };
        match (exec, batch, d.batch_form) {
            (
                Exec::Stride(r),
                RawBatch::Stride { a, b, .. },
                BatchForm::Stride { a: sa, b: sb },
            ) => run(r, &t, &StrideSrc { a, b, sa, sb }, d),
            (
                Exec::Offset(r),
                RawBatch::Offset {
                    a,
                    b,
                    a_offs,
                    b_offs,
                    ..
                },
                _,
            ) => run(
                r,
                &t,
                &OffsetSrc {
                    a,
                    b,
                    ao: a_offs,
                    bo: b_offs,
                },
                d,
            ),
            (Exec::Address(r), RawBatch::Address { a, b, .. }, _) => {
                run(r, &t, &AddrSrc { a, b }, d)
            }
            _ => panic!(
                "RawBatch form does not match the kernel's {} form",
                form_name(d.batch_form)
            ),
        }
    }
}

#[inline(always)]
unsafe fn run<B: BatchSrc<f32>>(r: &Runner<B>, t: &TileCall, src: &B, d: &Descriptor) {
    match r {
        Runner::Tiles(set) => set.run(t, src),
        Runner::Reference => kernels::reference_f32::run(t, src, d.m, d.n),
    }
}

/// Gathers the address-form pointers (on the stack for batches up to 64)
/// and hands them to `f`.
/// The checks of a safe call, shared by the f32 and bf16 kernels: C, bias
/// and every A_i/B_i long enough for `d` (A_i of `a_ext` elements, which the
/// bf16 VNNI layout makes differ from `d.a_extent()`), the batch of the
/// planned form; then `run` on the raw pointers, once.
pub(crate) fn checked_call<T, C>(
    d: &Descriptor,
    a_ext: usize,
    batch: Batch<'_, T>,
    c: &mut [C],
    bias: Option<&[f32]>,
    run: impl FnOnce(RawBatch<T>, *mut C, *const f32),
) -> Result<()> {
    check_len("C", c.len(), d.c_extent())?;
    let bias_ptr = match (d.epilogue.bias, bias) {
        (true, Some(b)) => {
            check_len("bias", b.len(), d.m)?;
            b.as_ptr()
        }
        (false, None) => std::ptr::null(),
        (want, _) => {
            return Err(Error::BatchMismatch(format!(
                "bias {} but the descriptor's epilogue {} one",
                if want { "missing" } else { "given" },
                if want { "has" } else { "has no" }
            )))
        }
    };
    let b_ext = d.b_extent();
    let raw = match (batch, d.batch_form) {
        (Batch::Stride { a, b, count }, BatchForm::Stride { a: sa, b: sb }) => {
            if count > 0 {
                check_len("A", a.len(), strided_need(sa, count, a_ext)?)?;
                check_len("B", b.len(), strided_need(sb, count, b_ext)?)?;
            }
            RawBatch::Stride {
                a: a.as_ptr(),
                b: b.as_ptr(),
                count,
            }
        }
        (Batch::Offset { a, b, offsets }, BatchForm::Offset) => {
            if !offsets.is_empty() {
                check_len("A", a.len(), offset_need(offsets.max_a(), a_ext)?)?;
                check_len("B", b.len(), offset_need(offsets.max_b(), b_ext)?)?;
            }
            RawBatch::Offset {
                a: a.as_ptr(),
                b: b.as_ptr(),
                a_offs: offsets.a().as_ptr(),
                b_offs: offsets.b().as_ptr(),
                count: offsets.len(),
            }
        }
        (Batch::Address { a, b }, BatchForm::Address) => {
            if a.len() != b.len() {
                return Err(Error::BatchMismatch(format!(
                    "address batch has {} A slices but {} B slices",
                    a.len(),
                    b.len()
                )));
            }
            for (i, (ai, bi)) in a.iter().zip(b).enumerate() {
                check_len_at("A", i, ai.len(), a_ext)?;
                check_len_at("B", i, bi.len(), b_ext)?;
            }
            // The kernel reads pointers: gather them once, on the stack for
            // the batch sizes primitives use.
            let count = a.len();
            return with_ptrs(a, b, |pa, pb| {
                run(
                    RawBatch::Address {
                        a: pa,
                        b: pb,
                        count,
                    },
                    c.as_mut_ptr(),
                    bias_ptr,
                );
                Ok(())
            });
        }
        (given, planned) => {
            let g = match given {
                Batch::Stride { .. } => "stride",
                Batch::Offset { .. } => "offset",
                Batch::Address { .. } => "address",
            };
            return Err(Error::BatchMismatch(format!(
                "{g} batch given to a kernel planned for the {} form",
                form_name(planned)
            )));
        }
    };
    run(raw, c.as_mut_ptr(), bias_ptr);
    Ok(())
}

fn form_name(f: BatchForm) -> &'static str {
    match f {
        BatchForm::Stride { .. } | BatchForm::Packed => "stride",
        BatchForm::Offset => "offset",
        BatchForm::Address => "address",
    }
}

pub(crate) fn with_ptrs<T, R>(
    a: &[&[T]],
    b: &[&[T]],
    f: impl FnOnce(*const *const T, *const *const T) -> R,
) -> R {
    const STACK: usize = 64;
    if a.len() <= STACK {
        let mut pa = [std::ptr::null::<T>(); STACK];
        let mut pb = [std::ptr::null::<T>(); STACK];
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            pa[i] = x.as_ptr();
            pb[i] = y.as_ptr();
        }
        f(pa.as_ptr(), pb.as_ptr())
    } else {
        let pa: Vec<*const T> = a.iter().map(|x| x.as_ptr()).collect();
        let pb: Vec<*const T> = b.iter().map(|x| x.as_ptr()).collect();
        f(pa.as_ptr(), pb.as_ptr())
    }
}

pub(crate) fn check_len(operand: &str, len: usize, needed: usize) -> Result<()> {
    if len < needed {
        return Err(Error::ShortSlice {
            operand: operand.to_string(),
            needed,
            len,
        });
    }
    Ok(())
}

pub(crate) fn check_len_at(operand: &str, i: usize, len: usize, needed: usize) -> Result<()> {
    if len < needed {
        return Err(Error::ShortSlice {
            operand: format!("{operand}[{i}]"),
            needed,
            len,
        });
    }
    Ok(())
}

pub(crate) fn strided_need(stride: usize, count: usize, extent: usize) -> Result<usize> {
    stride
        .checked_mul(count - 1)
        .and_then(|x| x.checked_add(extent))
        .ok_or(Error::Overflow {
            what: "batch",
            value: count,
        })
}

pub(crate) fn offset_need(max_off: usize, extent: usize) -> Result<usize> {
    max_off.checked_add(extent).ok_or(Error::Overflow {
        what: "offset",
        value: max_off,
    })
}

/// Whether plans may use the pipelined tiles: `BRGEMM_PIPELINE=0` turns them
/// off, read at each plan, so that one process can compare both.
pub(crate) fn pipeline_enabled() -> bool {
    crate::env::Setting::Pipeline.value().as_deref() != Some("0")
}

type CacheKey = (Descriptor, Isa, bool);

/// Plans `desc` for the selected ISA, or returns the kernel already planned
/// for it. The cache is process-wide and shared by all threads.
pub fn dispatch(desc: &Descriptor) -> Result<Arc<Kernel>> {
    dispatch_with(desc, Isa::selected()?)
}

/// As [`dispatch`], for an explicit ISA.
pub fn dispatch_with(desc: &Descriptor, isa: Isa) -> Result<Arc<Kernel>> {
    static CACHE: OnceLock<RwLock<HashMap<CacheKey, Arc<Kernel>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (*desc, isa, pipeline_enabled());
    if let Some(k) = cache.read().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(k.clone());
    }
    let k = Arc::new(Kernel::with_options(
        desc,
        KernelOptions {
            isa: Some(isa),
            ..KernelOptions::default()
        },
    )?);
    let mut w = cache.write().unwrap_or_else(|e| e.into_inner());
    Ok(w.entry(key).or_insert(k).clone())
}
