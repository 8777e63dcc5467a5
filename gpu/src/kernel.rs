//! A planned GPU BRGEMM and the device tables of the offset and address forms.

use crate::codegen::{brgemm_source, emulates_mma, kernel_names, split_reduce_source, Target};
use crate::cuda::{CuArg, LaunchOpts, TmaOperand};
use crate::desc::{GpuBatch, GpuDescriptor};
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
use crate::hopper::{batch_inner, hopper_ineligible, GpuPath, HopperTiling};
use crate::tiling::Tiling;

/// The A_i/B_i tables of the offset or address form, checked against the
/// descriptor (bounds and alignment) when built and uploaded once.
pub struct BatchTable {
    a: Buffer,
    b: Buffer,
    len: usize,
    form: GpuBatch,
    /// Elements of A and B the entries reach (for the check at execute).
    a_reach: usize,
    b_reach: usize,
    /// Device addresses of the buffers an address table points into.
    bases: Option<(u64, u64)>,
}

impl BatchTable {
    /// Offset form: A_i = A + `a[i]`, B_i = B + `b[i]` (elements).
    pub fn offsets(
        dev: &Device,
        d: &GpuDescriptor,
        a: &[usize],
        b: &[usize],
    ) -> Result<BatchTable> {
        let (_, a_reach, b_reach) = Self::check(d, GpuBatch::Offset, a, b)?;
        let to = |v: &[usize]| v.iter().map(|&x| x as i64).collect::<Vec<i64>>();
        Ok(BatchTable {
            a: dev.upload(&to(a))?,
            b: dev.upload(&to(b))?,
            len: a.len(),
            form: GpuBatch::Offset,
            a_reach,
            b_reach,
            bases: None,
        })
    }

    /// Address form: A_i and B_i are the elements `a[i]`, `b[i]` of the
    /// buffers `a_buf` and `b_buf`, stored as addresses (device pointers on
    /// CUDA, byte offsets on OpenCL). Execute with the same two buffers.
    pub fn addresses(
        dev: &Device,
        d: &GpuDescriptor,
        a_buf: &Buffer,
        a: &[usize],
        b_buf: &Buffer,
        b: &[usize],
    ) -> Result<BatchTable> {
        let (d, a_reach, b_reach) = Self::check(d, GpuBatch::Address, a, b)?;
        let es = d.dtype.size();
        for (what, buf, reach) in [("A buffer", a_buf, a_reach), ("B buffer", b_buf, b_reach)] {
            if !buf.holds(reach, es) {
                return Err(invalid(
                    what,
                    format!("{} bytes", buf.bytes()),
                    format!("the table reaches {reach} elements"),
                ));
            }
        }
        let (ba, bb) = (dev.address(a_buf), dev.address(b_buf));
        let addr = |base: u64, v: &[usize]| {
            v.iter()
                .map(|&x| base + (x * es) as u64)
                .collect::<Vec<u64>>()
        };
        Ok(BatchTable {
            a: dev.upload(&addr(ba, a))?,
            b: dev.upload(&addr(bb, b))?,
            len: a.len(),
            form: GpuBatch::Address,
            a_reach,
            b_reach,
            bases: Some((ba, bb)),
        })
    }

    /// Validates `d`, that it is of `form`, and the entries; returns the
    /// resolved descriptor and how far the entries reach into A and B.
    fn check(
        d: &GpuDescriptor,
        form: GpuBatch,
        a: &[usize],
        b: &[usize],
    ) -> Result<(GpuDescriptor, usize, usize)> {
        let d = d.validate()?;
        if d.batch_form != form {
            return Err(invalid(
                "batch form",
                format!("{:?}", d.batch_form),
                format!("this table needs GpuBatch::{form:?}"),
            ));
        }
        if a.len() != b.len() {
            return Err(invalid(
                "table lengths",
                format!("{} and {}", a.len(), b.len()),
                "A and B need one entry per pair",
            ));
        }
        let align = d.table_align;
        for (what, v) in [("a", a), ("b", b)] {
            if let Some((i, x)) = v.iter().enumerate().find(|(_, &x)| x % align != 0) {
                return Err(invalid(
                    format!("offset {what}[{i}]"),
                    x,
                    format!(
                        "the descriptor's table_align is {align} elements (set 1 for any offset)"
                    ),
                ));
            }
        }
        let reach = |v: &[usize], ext: usize| v.iter().map(|&x| x + ext).max().unwrap_or(0);
        Ok((d, reach(a, d.a_extent()), reach(b, d.b_extent())))
    }

    /// Entries (the batch size).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A BRGEMM generated for one descriptor on one device (the source is built
/// and compiled on first use and cached by the device).
pub struct GpuBrgemm {
    desc: GpuDescriptor,
    /// The kernel's name and program key, and the split reduction's: made
    /// once here, not per launch.
    name: String,
    reduce_name: String,
    /// A forced split ([`GpuBrgemm::with_split`]).
    split: Option<usize>,
    /// Which CUDA kernel ([`GpuBrgemm::with_path`]).
    path: GpuPath,
    /// The `mma.sync` kernel's CUDA plan where it differs from the
    /// portable one: the tiling that opting into more shared memory allows
    /// ([`Tiling::heuristic_cuda`]: the same C tile, wider warp tiles or a
    /// deeper ring), and its kernel names.
    cuda: Option<(GpuDescriptor, String, String)>,
    /// The sm_90a kernel's tiling, and its name (made once here).
    hopper: HopperTiling,
    hopper_name: String,
    /// Whether TMA can read the descriptor's operands
    /// ([`crate::hopper::hopper_eligible`]), decided once.
    hopper_ok: bool,
}

impl GpuBrgemm {
    /// Validates the descriptor and resolves its tiling.
    pub fn new(d: &GpuDescriptor) -> Result<GpuBrgemm> {
        let desc = d.validate()?;
        let (name, reduce_name) = kernel_names(&desc);
        let hopper = HopperTiling::heuristic(desc.n);
        let deep = Tiling::heuristic_cuda(desc.m, desc.n, desc.dtype);
        let cuda = (d.tiling.is_none() && desc.tiling != Some(deep)).then(|| {
            // The launch grid comes from the portable tiling: same C tile.
            debug_assert!(desc
                .tiling
                .is_none_or(|t| (t.bm, t.bn) == (deep.bm, deep.bn)));
            let c = GpuDescriptor {
                tiling: Some(deep),
                ..desc
            };
            let (n, r) = kernel_names(&c);
            (c, n, r)
        });
        Ok(GpuBrgemm {
            cuda,
            name,
            reduce_name,
            hopper_name: crate::codegen::wgmma_name(&desc, &hopper),
            hopper_ok: crate::hopper::hopper_eligible(&desc),
            hopper,
            desc,
            split: None,
            path: GpuPath::Auto,
        })
    }

    /// Chooses the CUDA kernel: [`GpuPath::Auto`] (the default) takes the
    /// sm_90a kernel where it applies; forcing [`GpuPath::Wgmma`] makes
    /// every launch where it does not an error. OpenCL ignores it.
    pub fn with_path(mut self, path: GpuPath) -> GpuBrgemm {
        self.path = path;
        self
    }

    /// Sets the sm_90a kernel's tiling (default
    /// [`HopperTiling::heuristic`]), checked.
    pub fn with_hopper_tiling(mut self, h: HopperTiling) -> Result<GpuBrgemm> {
        h.validate()?;
        self.hopper_name = crate::codegen::wgmma_name(&self.desc, &h);
        self.hopper = h;
        Ok(self)
    }

    /// The sm_90a kernel's tiling.
    pub fn hopper_tiling(&self) -> HopperTiling {
        self.hopper
    }

    /// The kernel a launch on `dev` runs: `Mma` or `Wgmma` (never `Auto`);
    /// an error where `Wgmma` was forced and cannot run, saying why.
    pub fn path_on(&self, dev: &Device) -> Result<GpuPath> {
        let Some(cuda) = dev.cuda() else {
            return Ok(GpuPath::Mma);
        };
        // Checked on every launch: no string is built unless a forced
        // Wgmma cannot run.
        let runs = cuda.arch() == "sm_90" && self.hopper_ok;
        match (self.path, runs) {
            (GpuPath::Mma, _) | (GpuPath::Auto, false) => Ok(GpuPath::Mma),
            (_, true) => Ok(GpuPath::Wgmma),
            (GpuPath::Wgmma, false) => {
                let why = hopper_ineligible(&self.desc).unwrap_or_else(|| {
                    format!("the device is {} (the kernel needs sm_90)", cuda.arch())
                });
                Err(invalid("path", "Wgmma", why))
            }
        }
    }

    /// The resolved descriptor.
    pub fn descriptor(&self) -> &GpuDescriptor {
        &self.desc
    }

    /// The generated source for `target`.
    pub fn source(&self, target: Target) -> String {
        brgemm_source(&self.desc, target).0
    }

    /// `C = act(alpha * sum_i A_i B_i + beta*C + bias)` over `batch` pairs.
    /// Stride form: `table` is `None`. Offset and address forms: `batch`
    /// must equal the table's length. Every buffer is checked against what
    /// the kernel will touch before the launch.
    #[allow(clippy::too_many_arguments)] // the BLAS-style operand list
    pub fn execute(
        &self,
        dev: &Device,
        a: &Buffer,
        b: &Buffer,
        c: &mut Buffer,
        bias: Option<&Buffer>,
        table: Option<&BatchTable>,
        batch: usize,
    ) -> Result<()> {
        let d = &self.desc;
        let es = d.dtype.size();
        let target = target_of(dev);
        let path = self.path_on(dev)?;
        if batch > i32::MAX as usize / d.k.div_ceil(d.tiling.expect("validated").bk) {
            return Err(invalid("batch", batch, "too many pairs for one launch"));
        }
        let (a_reach, b_reach) = match (d.batch_form, table) {
            (GpuBatch::Stride { a: sa, b: sb }, None) => {
                if batch == 0 {
                    (0, 0)
                } else {
                    (
                        (batch - 1) * sa + d.a_extent(),
                        (batch - 1) * sb + d.b_extent(),
                    )
                }
            }
            (GpuBatch::Stride { .. }, Some(_)) => {
                return Err(invalid("table", "given", "the stride form takes no table"))
            }
            (form, Some(t)) => {
                if t.form != form {
                    return Err(invalid(
                        "table",
                        format!("{:?}", t.form),
                        format!("the kernel is {form:?}"),
                    ));
                }
                if t.len != batch {
                    return Err(invalid(
                        "batch",
                        batch,
                        format!("the table has {} entries", t.len),
                    ));
                }
                if let Some((ba, bb)) = t.bases {
                    if ba != dev.address(a) || bb != dev.address(b) {
                        return Err(invalid(
                            "A/B buffers",
                            "others",
                            "an address table runs on the buffers it was built for",
                        ));
                    }
                }
                (t.a_reach, t.b_reach)
            }
            (form, None) => {
                return Err(invalid(
                    "table",
                    "none",
                    format!("the {form:?} form needs a BatchTable"),
                ))
            }
        };
        if !a.holds(a_reach, es) {
            return Err(invalid(
                "A",
                format!("{} bytes", a.bytes()),
                format!("the batch reaches {a_reach} elements"),
            ));
        }
        if !b.holds(b_reach, es) {
            return Err(invalid(
                "B",
                format!("{} bytes", b.bytes()),
                format!("the batch reaches {b_reach} elements"),
            ));
        }
        if !c.holds(d.c_extent(), 4) {
            return Err(invalid(
                "C",
                format!("{} bytes", c.bytes()),
                format!("needs {} f32", d.c_extent()),
            ));
        }
        let bias = match (d.epilogue.bias, bias) {
            (true, Some(x)) if x.holds(d.m, 4) => x,
            (true, Some(x)) => {
                return Err(invalid(
                    "bias",
                    format!("{} bytes", x.bytes()),
                    format!("needs {} f32", d.m),
                ))
            }
            (true, None) => return Err(invalid("bias", "none", "the descriptor fuses a bias")),
            (false, _) => a,
        };
        if path == GpuPath::Wgmma {
            return self.execute_wgmma(dev, a, b, c, bias, batch);
        }
        let (ta, tb) = table.map(|t| (&t.a, &t.b)).unwrap_or((a, b));
        let (d, name, reduce_name, [gx, gy, splits]) = self.mma_launch(dev, target, batch)?;
        fits_shared(
            d,
            emulates_mma(target, d.dtype),
            dev.shared_memory(),
            dev.name(),
        )?;
        let t = d.tiling.expect("validated");
        let desc = *d;
        // C is written, but the launch API takes shared references (the
        // kernels write through device pointers); `&mut` here keeps the Rust
        // aliasing honest for callers.
        let c: &Buffer = c;
        let main = |p: &Buffer| {
            dev.launch_smem(
                name,
                |target| brgemm_source(&desc, target).0,
                name,
                [gx, gy, splits],
                t.threads(),
                &[
                    Arg::Buf(a),
                    Arg::Buf(b),
                    Arg::Buf(c),
                    Arg::Buf(bias),
                    Arg::Buf(ta),
                    Arg::Buf(tb),
                    Arg::I32(batch as i32),
                    Arg::Buf(p),
                ],
                t.shared_bytes(d.dtype),
            )
        };
        if splits == 1 {
            return main(c);
        }
        let partials = splits * d.m * d.n;
        let scratch = dev.scratch(partials * 4)?;
        let p = scratch.as_ref().expect("sized by scratch()");
        main(p)?;
        reduce_splits(dev, &desc, reduce_name, c, bias, p, splits)
    }

    /// Slices of the batch-reduce loop for `blocks` C tiles of `tiles`
    /// k tiles each: the forced split, else [`Tiling::split`] for `dev`.
    fn splits(&self, dev: &Device, blocks: usize, tiles: usize) -> Result<usize> {
        Ok(match self.split {
            Some(s) => s.clamp(1, tiles.max(1)),
            None => Tiling::split(blocks, tiles, dev.compute_units()?),
        })
    }

    /// The `mma.sync` kernel's launch of `batch` pairs on `dev`: its plan
    /// (descriptor, kernel and reduction names: the CUDA default's plan
    /// where the blocks' k loops are long) and grid (x, y, slices).
    /// The CUDA plan has the portable C tile: same grid, same split.
    #[allow(clippy::type_complexity)]
    fn mma_launch(
        &self,
        dev: &Device,
        target: Target,
        batch: usize,
    ) -> Result<(&GpuDescriptor, &str, &str, [usize; 3])> {
        let d = &self.desc;
        let t = d.tiling.expect("validated");
        let (gx, gy) = (d.n.div_ceil(t.bn), d.m.div_ceil(t.bm));
        let tiles = batch * d.k.div_ceil(t.bk);
        let splits = self.splits(dev, gx * gy, tiles)?;
        let (d, name, reduce) = match (&self.cuda, target) {
            (Some((cd, n, r)), Target::Cuda)
                if cuda_plan_pays(cd, tiles * t.bk / splits.max(1)) =>
            {
                (cd, n.as_str(), r.as_str())
            }
            _ => (&self.desc, self.name.as_str(), self.reduce_name.as_str()),
        };
        Ok((d, name, reduce, [gx, gy, splits]))
    }

    /// The tiling the `mma.sync` kernel runs `batch` pairs with on `dev`
    /// (the CUDA default's plan where the blocks' k loops are long).
    pub fn mma_tiling(&self, dev: &Device, batch: usize) -> Result<Tiling> {
        let (d, ..) = self.mma_launch(dev, target_of(dev), batch)?;
        Ok(d.tiling.expect("validated"))
    }

    /// The sm_90a launch, after `execute`'s checks: tensor maps over A and
    /// B, then the same split and reduction as the `mma.sync` path.
    fn execute_wgmma(
        &self,
        dev: &Device,
        a: &Buffer,
        b: &Buffer,
        c: &Buffer,
        bias: &Buffer,
        batch: usize,
    ) -> Result<()> {
        let d = &self.desc;
        let cuda = dev.cuda().expect("path_on checked the backend");
        let GpuBatch::Stride { a: sa, b: sb } = d.batch_form else {
            unreachable!("path_on checked the form")
        };
        let h = self.hopper;
        let nb = batch.max(1) as u64;
        // (inner, outer, batch) or, where the batch stride is the smaller,
        // (inner, batch, outer): TMA wants growing strides.
        let op = |inner: usize, outer: usize, ld: usize, stride: usize, bx: [u32; 2]| {
            if batch_inner(ld, stride) {
                TmaOperand {
                    dims: [inner as u64, nb, outer as u64],
                    strides: [stride as u64, ld as u64],
                    boxes: [bx[0], 1, bx[1]],
                }
            } else {
                TmaOperand {
                    dims: [inner as u64, outer as u64, nb],
                    strides: [ld as u64, stride as u64],
                    boxes: [bx[0], bx[1], 1],
                }
            }
        };
        let bk = HopperTiling::BK as u32;
        let ma = cuda.tma_map(
            "A",
            a.cuda_slice("A")?,
            d.dtype,
            &op(d.m, d.k, d.lda, sa, [64, bk]),
        )?;
        let mb = cuda.tma_map(
            "B",
            b.cuda_slice("B")?,
            d.dtype,
            &op(d.k, d.n, d.ldb, sb, [bk, h.bn as u32]),
        )?;
        let (gx, gy) = (d.n.div_ceil(h.bn), d.m.div_ceil(HopperTiling::BM));
        let tiles = batch * d.k.div_ceil(HopperTiling::BK);
        let splits = self.splits(dev, gx * gy, tiles)?;
        if gx == 0 || gy == 0 {
            return Ok(());
        }
        let desc = *d;
        let opts = LaunchOpts {
            arch: Some("sm_90a"),
            dynamic_smem: h.shared_bytes() as u32,
        };
        let main = |p: &Buffer| -> Result<()> {
            cuda.launch_with(
                &self.hopper_name,
                || crate::codegen::wgmma_source(&desc, &h).0,
                &self.hopper_name,
                [gx as u32, gy as u32, splits as u32],
                HopperTiling::THREADS as u32,
                &[
                    CuArg::Tma(&ma),
                    CuArg::Tma(&mb),
                    CuArg::Buf(c.cuda_slice("C")?),
                    CuArg::Buf(bias.cuda_slice("bias")?),
                    CuArg::I32(batch as i32),
                    CuArg::Buf(p.cuda_slice("P")?),
                ],
                opts,
            )
        };
        if splits == 1 {
            return main(c);
        }
        let scratch = dev.scratch(splits * d.m * d.n * 4)?;
        let p = scratch.as_ref().expect("sized by scratch()");
        main(p)?;
        reduce_splits(dev, &desc, &self.reduce_name, c, bias, p, splits)
    }

    /// Forces the number of slices the batch-reduce loop is split into
    /// (`None`: [`Tiling::split`] for the device, the default); more slices
    /// than tiles of `bk` are clamped. For tests and measurements.
    pub fn with_split(mut self, splits: Option<usize>) -> GpuBrgemm {
        self.split = splits;
        self
    }
}

/// The source language of `dev`'s kernels.
fn target_of(dev: &Device) -> Target {
    match dev.backend() {
        crate::Backend::Cuda => Target::Cuda,
        crate::Backend::OpenCl => Target::OpenCl,
    }
}

/// Whether the CUDA plan `cuda` pays for a launch whose blocks each run
/// `k_per_block` of the batch-reduce depth: from 4 rounds of its whole
/// ring on. Measured on an H100 (one run, bf16 / f16) for the deeper ring:
/// 4096x4096 x (64x64), 128 tiles of 32 per block, 4 stages 207.3 / 210.6
/// TFLOP/s against 2 stages' 195.2 / 197.2; 128x128 x (64x64) split to one
/// tile per block, 4 stages 10.4 / 12.1 against 11.9 / 12.2 (more shared
/// memory per block, a longer prologue).
fn cuda_plan_pays(cuda: &GpuDescriptor, k_per_block: usize) -> bool {
    let t = cuda.tiling.expect("validated");
    k_per_block >= 4 * t.stages * t.bk
}

/// Finishes a split launch: the slices' partial sums in `p` added in
/// order into `c`, through `d`'s epilogue (the kernel `name`).
fn reduce_splits(
    dev: &Device,
    d: &GpuDescriptor,
    name: &str,
    c: &Buffer,
    bias: &Buffer,
    p: &Buffer,
    splits: usize,
) -> Result<()> {
    const BLOCK: usize = 256;
    let desc = *d;
    dev.launch(
        name,
        |target| split_reduce_source(&desc, target).0,
        name,
        [(d.m * d.n).div_ceil(BLOCK), 1, 1],
        BLOCK,
        &[
            Arg::Buf(c),
            Arg::Buf(bias),
            Arg::Buf(p),
            Arg::I32(splits as i32),
        ],
    )
}

/// The tiling was validated against [`crate::SHARED_MAX`]; a device
/// may have less (`have` bytes, read when it opened: an OpenCL device's
/// local memory per work-group, a CUDA device's opt-in maximum): a tiling
/// that needs more (with the `emulated` tensor core's fragment scratch) is
/// an error naming both.
fn fits_shared(d: &GpuDescriptor, emulated: bool, have: usize, device: &str) -> Result<()> {
    let t = d.tiling.expect("validated");
    let scratch = if emulated {
        t.fragment_scratch_bytes()
    } else {
        0
    };
    let need = t.shared_bytes(d.dtype) + scratch;
    if need > have {
        return Err(invalid(
            "tiling",
            format!("{need} bytes of shared memory"),
            format!("the device has {have} per block ({device})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::GpuDtype;

    /// The CUDA plan is taken for long k loops per block only, and only
    /// where the caller left the tiling to the planner.
    #[test]
    fn the_cuda_plan_is_for_long_k_loops() {
        let k = GpuBrgemm::new(&GpuDescriptor::new(4096, 4096, 64)).unwrap();
        let (cd, _, _) = k.cuda.as_ref().expect("a CUDA default");
        assert_eq!(cd.tiling.unwrap().bk * cd.tiling.unwrap().stages, 128);
        assert!(cuda_plan_pays(cd, 128 * 32));
        assert!(!cuda_plan_pays(cd, 32));
        assert!(!cuda_plan_pays(cd, 15 * 32));
        let f32 = GpuBrgemm::new(&GpuDescriptor::new(4096, 4096, 64).dtype(GpuDtype::F32)).unwrap();
        let (deep, _, _) = f32.cuda.as_ref().expect("a deeper f32 plan");
        let t = deep.tiling.unwrap();
        let ring = t.stages * t.bk;
        assert!(cuda_plan_pays(deep, 4 * ring) && !cuda_plan_pays(deep, 4 * ring - 1));
        let forced = GpuDescriptor::new(4096, 4096, 64).tiling(Tiling::heuristic(
            4096,
            4096,
            GpuDtype::Bf16,
        ));
        assert!(GpuBrgemm::new(&forced).unwrap().cuda.is_none());
    }

    /// A device with 32 KiB of local memory refuses a tiling of 40 KiB,
    /// naming both sizes and the device, and takes one that fits.
    #[test]
    fn a_tiling_larger_than_the_local_memory_is_refused() {
        let d = GpuDescriptor::new(128, 128, 64).validate().unwrap();
        let need = d.tiling.unwrap().shared_bytes(d.dtype);
        assert!(need > 32 << 10, "a big tiling: {need}");
        let e = fits_shared(&d, false, 32 << 10, "small GPU")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&need.to_string()) && e.contains("32768") && e.contains("small GPU"),
            "{e}"
        );
        assert!(fits_shared(&d, false, need, "exact").is_ok());
    }
}
