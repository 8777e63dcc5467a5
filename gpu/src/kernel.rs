//! A planned GPU BRGEMM and the device tables of the offset and address forms.

use crate::codegen::{brgemm_source, emulates_mma, kernel_names, split_reduce_source, Target};
use crate::desc::{GpuBatch, GpuDescriptor};
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
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
}

impl GpuBrgemm {
    /// Validates the descriptor and resolves its tiling.
    pub fn new(d: &GpuDescriptor) -> Result<GpuBrgemm> {
        let desc = d.validate()?;
        let (name, reduce_name) = kernel_names(&desc);
        Ok(GpuBrgemm {
            name,
            reduce_name,
            desc,
            split: None,
        })
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
        let target = match dev.backend() {
            crate::Backend::Cuda => Target::Cuda,
            crate::Backend::OpenCl => Target::OpenCl,
        };
        fits_shared(
            d,
            emulates_mma(target, d.dtype),
            dev.shared_memory(),
            dev.name(),
        )?;
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
        let (ta, tb) = table.map(|t| (&t.a, &t.b)).unwrap_or((a, b));
        let t = d.tiling.expect("validated");
        let (gx, gy) = (d.n.div_ceil(t.bn), d.m.div_ceil(t.bm));
        let tiles = batch * d.k.div_ceil(t.bk);
        let splits = match self.split {
            Some(s) => s.clamp(1, tiles.max(1)),
            None => Tiling::split(gx * gy, tiles, dev.compute_units()?),
        };
        let desc = *d;
        // C is written, but the launch API takes shared references (the
        // kernels write through device pointers); `&mut` here keeps the Rust
        // aliasing honest for callers.
        let c: &Buffer = c;
        let main = |p: &Buffer| {
            dev.launch(
                &self.name,
                |target| brgemm_source(&desc, target).0,
                &self.name,
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
            )
        };
        if splits == 1 {
            return main(c);
        }
        let partials = splits * d.m * d.n;
        let scratch = dev.scratch(partials * 4)?;
        let p = scratch.as_ref().expect("sized by scratch()");
        main(p)?;
        const BLOCK: usize = 256;
        dev.launch(
            &self.reduce_name,
            |target| split_reduce_source(&desc, target).0,
            &self.reduce_name,
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

    /// Forces the number of slices the batch-reduce loop is split into
    /// (`None`: [`Tiling::split`] for the device, the default); more slices
    /// than tiles of `bk` are clamped. For tests and measurements.
    pub fn with_split(mut self, splits: Option<usize>) -> GpuBrgemm {
        self.split = splits;
        self
    }
}

/// The tiling was validated against the CUDA static limit; an OpenCL device
/// may have less local memory per work-group (`have` bytes, read when the
/// device opened): a tiling that needs more (with the `emulated` tensor
/// core's fragment scratch) is an error naming both.
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
