//! A convolution's geometry ([`ConvParams`]) and its blocking and loop
//! orders ([`ConvTuning`]) with the default heuristic.

use crate::error::{shape, Result};
use crate::pass::{pick_block, PassConfig};

/// The geometry of a convolution layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConvParams {
    /// Minibatch.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Output channels.
    pub k: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Filter height.
    pub r: usize,
    /// Filter width.
    pub s: usize,
    /// Stride between output rows.
    pub stride_h: usize,
    /// Stride between output columns.
    pub stride_w: usize,
    /// Zero padding on top and bottom.
    pub pad_h: usize,
    /// Zero padding left and right.
    pub pad_w: usize,
    /// Dilation of the filter's rows (1 = dense filter).
    pub dil_h: usize,
    /// Dilation of the filter's columns.
    pub dil_w: usize,
}

impl ConvParams {
    /// Stride 1, no padding, no dilation.
    pub fn new(n: usize, c: usize, k: usize, h: usize, w: usize, r: usize, s: usize) -> Self {
        ConvParams {
            n,
            c,
            k,
            h,
            w,
            r,
            s,
            stride_h: 1,
            stride_w: 1,
            pad_h: 0,
            pad_w: 0,
            dil_h: 1,
            dil_w: 1,
        }
    }
    /// Sets the same stride in both directions.
    pub fn stride(self, s: usize) -> Self {
        self.strides(s, s)
    }
    /// Sets the strides between output rows and columns.
    pub fn strides(mut self, h: usize, w: usize) -> Self {
        (self.stride_h, self.stride_w) = (h, w);
        self
    }
    /// Sets the same padding on all sides.
    pub fn pad(self, p: usize) -> Self {
        self.pads(p, p)
    }
    /// Sets the zero padding on top and bottom (`h`), left and right (`w`).
    pub fn pads(mut self, h: usize, w: usize) -> Self {
        (self.pad_h, self.pad_w) = (h, w);
        self
    }
    /// Sets the same dilation in both directions.
    pub fn dilation(self, d: usize) -> Self {
        self.dilations(d, d)
    }
    /// Sets the dilations of the filter's rows and columns.
    pub fn dilations(mut self, h: usize, w: usize) -> Self {
        (self.dil_h, self.dil_w) = (h, w);
        self
    }
    /// Output height (valid after [`ConvParams::validate`]).
    pub fn p(&self) -> usize {
        (self.h + 2 * self.pad_h - self.dil_h * (self.r - 1) - 1) / self.stride_h + 1
    }
    /// Output width.
    pub fn q(&self) -> usize {
        (self.w + 2 * self.pad_w - self.dil_w * (self.s - 1) - 1) / self.stride_w + 1
    }
    /// Floating-point operations of one pass (any of the three).
    pub fn flops(&self) -> f64 {
        2.0 * (self.n * self.k * self.c * self.r * self.s) as f64 * (self.p() * self.q()) as f64
    }
    /// Forward flops per element of the input and output together: low
    /// (a 1x1 layer of few channels) where the passes are bound by memory.
    pub fn flops_per_activation(&self) -> f64 {
        let elems = self.n * (self.c * self.h * self.w + self.k * self.p() * self.q());
        self.flops() / elems.max(1) as f64
    }
    /// Checks every size; the error names the bad one.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("n", self.n),
            ("c", self.c),
            ("k", self.k),
            ("h", self.h),
            ("w", self.w),
            ("r", self.r),
            ("s", self.s),
            ("stride_h", self.stride_h),
            ("stride_w", self.stride_w),
            ("dil_h", self.dil_h),
            ("dil_w", self.dil_w),
        ] {
            if v == 0 {
                return Err(shape(what, v, "must be at least 1"));
            }
        }
        // Sizes in checked arithmetic first: the extents below and every
        // buffer (the padded input, the filter, the output) must fit.
        let padded = |x: usize, p: usize| {
            p.checked_mul(2)
                .and_then(|p| p.checked_add(x))
                .ok_or_else(|| shape("padding", p, "too large"))
        };
        let (hp, wp) = (padded(self.h, self.pad_h)?, padded(self.w, self.pad_w)?);
        crate::error::elems("dilated filter rows", &[self.dil_h, self.r])?;
        crate::error::elems("dilated filter columns", &[self.dil_w, self.s])?;
        crate::error::elems(
            "input (n x c x padded h x padded w)",
            &[self.n, self.c, hp, wp],
        )?;
        crate::error::elems("filter (k x c x r x s)", &[self.k, self.c, self.r, self.s])?;
        crate::error::elems("output (n x k x h x w)", &[self.n, self.k, hp, wp])?;
        let (er, es) = (self.dil_h * (self.r - 1) + 1, self.dil_w * (self.s - 1) + 1);
        if er > self.h + 2 * self.pad_h {
            return Err(shape(
                "r",
                self.r,
                format!(
                    "the filter spans {er} rows (dilation {}), more than the padded input height {}",
                    self.dil_h,
                    self.h + 2 * self.pad_h
                ),
            ));
        }
        if es > self.w + 2 * self.pad_w {
            return Err(shape(
                "s",
                self.s,
                format!(
                    "the filter spans {es} columns (dilation {}), more than the padded input width {}",
                    self.dil_w,
                    self.w + 2 * self.pad_w
                ),
            ));
        }
        Ok(())
    }
    /// Whether the layer is a plain matrix product over the pixels (1x1,
    /// stride 1, no padding): forward and backward-data then treat an image
    /// as one row of H*W pixels.
    pub(super) fn pointwise(&self) -> bool {
        self.r == 1
            && self.s == 1
            && self.stride_h == 1
            && self.stride_w == 1
            && self.pad_h == 0
            && self.pad_w == 0
    }
}

/// Blocking and loop orders of a convolution layer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConvTuning {
    /// Input-channel block.
    pub bc: usize,
    /// Output-channel block.
    pub bk: usize,
    /// Output pixels per BRGEMM call in forward and backward-data (BRGEMM n).
    pub bq: usize,
    /// Forward. Every pass uses the layer's letters: `a` images, `b` K
    /// blocks, `c` C blocks, `d` rows and `e` pixel blocks of the pass's
    /// output, `f` filter rows, `g` filter columns (`docs/loop-specs.md`).
    /// Forward reduces over c, `chunk` C blocks per call (0: all).
    pub fwd: PassConfig,
    /// Backward-data: reduces over b, `chunk` K blocks per call; at strides
    /// above 1 each phase of dX runs this nest over its own rows and pixels.
    pub bwd: PassConfig,
    /// Backward-weights: reduces over a, which walks (image, row) pairs,
    /// `chunk` per call (0: the heuristic's); d and e have one iteration.
    pub upd: PassConfig,
}

/// The pixel run per call: a whole row up to 64 pixels, else the largest
/// divisor of the row in 28..=64 (no tail call), else 64 with a tail.
pub(super) fn pixel_block(row: usize) -> usize {
    if row <= 64 {
        return row;
    }
    (28..=64)
        .rev()
        .find(|b| row.is_multiple_of(*b))
        .unwrap_or(64)
}

impl ConvTuning {
    /// The default. Channel blocks of 64 where they divide (else 48, 32, 16;
    /// fewer than 64 channels are one block; else 64 with zero padding): a
    /// 64-row output block is four AVX-512 vectors for the register tile;
    /// 32 where a filter block-row would pass 1 MiB.
    /// Pixel runs of up to 64 (see the module docs). Specs `ABdec` for
    /// forward and `ACdeb` for backward-data (images and output
    /// blocks parallel; output blocks outer, `BAdec`/`CAdeb`, when the
    /// filter exceeds 2 MiB; with rows and pixel blocks parallel too,
    /// `ABDEc`/`BADEc` and `ACDEb`/`CADEb`, when there are fewer than 64
    /// image x block items), `aBCFG` for the update
    /// with chunks of rows that keep a chunk's dY and X rows within about
    /// 256 KiB of L2.
    pub fn heuristic(p: &ConvParams) -> ConvTuning {
        let cands = [64, 48, 32, 16];
        let (mut bc, mut bk) = (pick_block(p.c, &cands), pick_block(p.k, &cands));
        // A forward call streams the block-row of the filter for one output
        // block (C*R*S*bk floats); above 1 MiB it no longer shares L2 with
        // the input rows, so halve the block (backward-data likewise).
        let taps = p.r * p.s * 4;
        if p.c * taps * bk > 1 << 20 && bk == 64 && p.k.is_multiple_of(32) {
            bk = 32;
        }
        if p.k * taps * bc > 1 << 20 && bc == 64 && p.c.is_multiple_of(32) {
            bc = 32;
        }
        // A filter larger than L2 re-streamed for every image (N outer)
        // costs more than the input planes re-read for every output block
        // (output blocks outer). Measured on 8x512x7x7 3x3 with the halved
        // blocks, alternating in one process: fwd 44 -> 63 GFLOP/s (1
        // thread), 66 -> 106 (2); bwd 39 -> 60, 59 -> 102; 8x256x14x14
        // +3-8%.
        let big = p.k * p.c * taps > 2 << 20;
        // Fewer than 64 (image, output block) items leave the threads, which
        // take the others' leftovers one item at a time (`Schedule::Steal`),
        // pieces too coarse to even out: a whole image of 56 rows is 1/8 of
        // res2's work. Output rows and pixel blocks then join the parallel
        // group (same contiguous chunks, finer pieces). Measured on 2 threads,
        // alternating in one process, 3 runs: 64->64 3x3 at 56x56 fwd
        // x0.98-1.04, bwd x1.01-1.07; 1x1 64->256 fwd x0.99-1.21;
        // 256->64 fwd x1.01-1.06, bwd x0.99-1.18; 128 at 28x28 x1.01-1.05;
        // 512 at 7x7 (128 items, unchanged) x0.97-1.03.
        let few = p.n * p.k.div_ceil(bk).min(p.c.div_ceil(bc)) < 64;
        let (fwd, bwd) = match (big, few) {
            (true, true) => ("BADEc", "CADEb"),
            (true, false) => ("BAdec", "CAdeb"),
            (false, true) => ("ABDEc", "ACDEb"),
            (false, false) => ("ABdec", "ACdeb"),
        };
        let row = if p.pointwise() { p.p() * p.q() } else { p.q() };
        ConvTuning {
            bc,
            bk,
            bq: pixel_block(row),
            fwd: PassConfig::spec(fwd),
            bwd: PassConfig::spec(bwd),
            upd: PassConfig {
                chunk: upd_chunk(p, bc, bk),
                ..PassConfig::spec("aBCFG")
            },
        }
    }
}

/// (image, row) pairs per update call whose dY and X rows take about
/// 256 KiB of L2, for the given blocks.
pub(super) fn upd_chunk(p: &ConvParams, bc: usize, bk: usize) -> usize {
    let row_bytes = (bk + bc * p.stride_w) * p.q() * 4;
    (256 * 1024 / row_bytes.max(1)).max(1)
}
