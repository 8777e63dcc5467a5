//! Mixed-precision convolution: forward and backward-data on bf16
//! operands, on the f32 layer's own gather loop nests and blocking, with f32
//! accumulation and f32 outputs (AMX tiles where the channel blocks are
//! multiples of 32, else the next bf16 kernel of the CPU policy).
//!
//! The f32 filter stays the master copy; [`ConvBf16::pack_filter`] rounds
//! it once per step into the VNNI A operands of both passes (pairs along the
//! input channels for forward, along the output channels for the
//! transposed filter of backward-data). Activations and output gradients
//! are rounded to bf16 in their blocked layouts (the pixel runs are the B
//! operands as in f32). Backward-data with strides above 1 (the scatter
//! form) and backward-weights stay f32 passes of the [`Conv`].

use super::gather::Gather;
use super::{Bwd, Conv, ConvParams};
use crate::engine::bf16::{pack_vnni, WeightGrid};
use crate::error::{check_buf, shape, Result};
use crate::tensor::{Filter, Tensor4};
use crate::threads::Pool;
use brgemm::bf16::{bf16, Bf16Isa};
use brgemm::{AlignedVec, Epilogue};

/// The bf16 forward and (stride-1) backward-data of a [`Conv`] layer.
pub struct ConvBf16 {
    fwd: Gather<bf16>,
    bwd: Option<Gather<bf16>>,
    params: ConvParams,
    bc: usize,
    bk: usize,
}

impl ConvBf16 {
    /// Plans the bf16 passes for `conv`'s shape, blocking and loop orders.
    /// The channel blocks bc and bk must be even (VNNI pairs).
    pub fn new(conv: &Conv) -> Result<ConvBf16> {
        let t = conv.tuning();
        for (what, v) in [("bc", t.bc), ("bk", t.bk)] {
            if v % 2 != 0 {
                return Err(shape(
                    what,
                    v,
                    "bf16 convolutions need even channel blocks (VNNI pairs)",
                ));
            }
        }
        let ep = Epilogue {
            bias: true,
            activation: conv.act,
        };
        let bwd = match &conv.bwd {
            Bwd::Gather(g) => Some(Gather::new("bwd", g.g, &t.bwd, Epilogue::default())?),
            Bwd::Scatter(_) => None,
        };
        Ok(ConvBf16 {
            fwd: Gather::new("fwd", conv.fwd.g, &t.fwd, ep)?,
            bwd,
            params: conv.params,
            bc: t.bc,
            bk: t.bk,
        })
    }

    /// The bf16 kernel of the forward pass, e.g. `Amx`.
    pub fn isa(&self) -> Bf16Isa {
        let k = self.fwd.main.pick(true, true);
        k.bf16_isa().expect("planned with a bf16 descriptor")
    }

    /// Whether backward-data runs here (stride 1: a gather); else the
    /// layer's f32 scatter pass computes it.
    pub fn has_backward_data(&self) -> bool {
        self.bwd.is_some()
    }

    /// Packs the f32 filter `w` into the VNNI operands of forward (`wv`)
    /// and backward-data (`wtv`).
    pub fn pack_filter(
        &self,
        pool: &Pool,
        w: &Filter,
        wv: &mut AlignedVec<bf16>,
        wtv: &mut AlignedVec<bf16>,
    ) -> Result<()> {
        let p = &self.params;
        if w.dims() != (p.k, p.c, p.r, p.s, self.bk, self.bc) {
            return Err(shape(
                "W",
                format!("(k, c, r, s, bk, bc) = {:?}", w.dims()),
                "does not match the layer",
            ));
        }
        let grid = WeightGrid {
            outer: p.k.div_ceil(self.bk),
            inner: p.c.div_ceil(self.bc),
            taps: p.r * p.s,
            bi: self.bc,
            bo: self.bk,
        };
        pack_vnni(pool.for_work(p.flops()), &w.data, grid, wv, wtv);
        Ok(())
    }

    /// Y = act(conv(X, W) + b) from bf16 X (the layer's input layout,
    /// rounded by [`crate::fc_bf16::to_bf16`]) and the packed filter.
    pub fn forward(
        &self,
        pool: &Pool,
        conv: &Conv,
        x: &[bf16],
        wv: &[bf16],
        bias: &[f32],
        y: &mut Tensor4,
    ) -> Result<()> {
        let pool = pool.for_work(self.params.flops());
        self.check(conv)?;
        let xl = conv.x_tensor().data.len();
        check_buf("bf16 X", x.len(), xl)?;
        check_buf("packed W", wv.len(), conv.filter().data.len())?;
        check_buf("bias", bias.len(), conv.padded_k())?;
        conv.check_y("Y", y)?;
        self.fwd.run(pool, &x[..xl], wv, Some(bias), &mut y.data);
        conv.clear_channel_tail(pool, y);
        Ok(())
    }

    /// dX = conv^T(dZ, W) from bf16 dZ (the layer's output layout) and the
    /// packed transposed filter; an error where the layer scatters
    /// ([`ConvBf16::has_backward_data`]).
    pub fn backward_data(
        &self,
        pool: &Pool,
        conv: &Conv,
        dz: &[bf16],
        wtv: &[bf16],
        dx: &mut Tensor4,
    ) -> Result<()> {
        let pool = pool.for_work(self.params.flops());
        self.check(conv)?;
        let Some(g) = &self.bwd else {
            return Err(shape(
                "stride",
                format!("({}, {})", self.params.stride_h, self.params.stride_w),
                "bf16 backward-data gathers at stride 1 only; the f32 pass scatters",
            ));
        };
        let zl = conv.y_tensor().data.len();
        check_buf("bf16 dZ", dz.len(), zl)?;
        check_buf("packed Wt", wtv.len(), conv.filter().data.len())?;
        conv.check_x("dX", dx)?;
        g.run(pool, &dz[..zl], wtv, None, &mut dx.data);
        Ok(())
    }

    fn check(&self, conv: &Conv) -> Result<()> {
        let t = conv.tuning();
        if conv.params != self.params || (t.bc, t.bk) != (self.bc, self.bk) {
            return Err(shape(
                "conv",
                format!("{:?}", conv.params),
                "is not the layer these bf16 passes were planned for",
            ));
        }
        Ok(())
    }
}
