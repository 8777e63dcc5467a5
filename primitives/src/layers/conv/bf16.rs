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
//! form) stays the f32 pass of the [`Conv`].
//!
//! Backward-weights at stride 1 (f32 accumulation into the f32 dW):
//! `dW[kb][cb][r][s] = sum_(n,p) dY[n][kb][p] X[n][cb][p + r][s..]^T` with
//! the pixels of a row as the reduction. The kernel wants both operands
//! with that reduction contiguous, so each call rounds dY into VNNI pairs
//! along the pixels (each row padded with zeros to `kq`, a multiple of 32)
//! and the zero-padded X into channel-major rows (`[n][cb][row][bc][wt]`,
//! `wt = kq + (S-1) dil`, tap s at column offset `s dil`): O(activations),
//! once per step. Items (K block, C block, r, s) are the threads' work;
//! each walks the (image, row) pairs in chunks, accumulating (beta = 1
//! after the first).

use super::gather::Gather;
use super::{Bwd, Conv, ConvParams};
use crate::engine::bf16::{pack_vnni, round_bf16, WeightGrid};
use crate::error::{check_buf, shape, Result};
use crate::layout::SyncPtr;
use crate::math::add_rows;
use crate::pass::Chunked;
use crate::tensor::{Filter, Tensor4};
use crate::threads::Pool;
use brgemm::bf16::{bf16, Bf16Isa};
use brgemm::{AlignedVec, BatchForm, DataType, Descriptor, Epilogue, RawBatch};
use std::sync::Mutex;

/// (image, row) pairs per backward-weights call.
const UPD_PAIRS: usize = 16;

/// The bf16 backward-weights plan (stride 1).
struct Upd {
    kernels: Chunked,
    /// Pixels per row in the VNNI dY (q rounded up to 32).
    kq: usize,
    /// Columns per channel row of the transposed X.
    wt: usize,
    /// Per (image, row) pair: its dY row in a K block's planes, its X row
    /// in a C block's planes.
    a_off: Vec<usize>,
    b_off: Vec<usize>,
    dyv: Mutex<AlignedVec<bf16>>,
    xt: Mutex<AlignedVec<bf16>>,
}

/// The bf16 forward and (stride-1) backward-data of a [`Conv`] layer.
pub struct ConvBf16 {
    fwd: Gather<bf16>,
    bwd: Option<Gather<bf16>>,
    upd: Option<Upd>,
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
        let p = conv.params;
        let upd = (p.stride_h == 1 && p.stride_w == 1)
            .then(|| -> Result<Upd> {
                let (kb, cb, hp) = (p.k.div_ceil(t.bk), p.c.div_ceil(t.bc), p.h + 2 * p.pad_h);
                let kq = p.q().next_multiple_of(32);
                let wt = kq + (p.s - 1) * p.dil_w;
                let (mut a_off, mut b_off) = (vec![], vec![]);
                for n in 0..p.n {
                    for r in 0..p.p() {
                        a_off.push((n * kb * p.p() + r) * kq * t.bk);
                        b_off.push((n * cb * hp + r) * t.bc * wt);
                    }
                }
                let d = Descriptor::new(t.bk, t.bc, kq)
                    .dtype(DataType::Bf16)
                    .ldb(wt)
                    .batch_form(BatchForm::Offset);
                Ok(Upd {
                    kernels: Chunked::new(d, Epilogue::default())?,
                    kq,
                    wt,
                    a_off,
                    b_off,
                    dyv: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
                    xt: Mutex::new(AlignedVec::new(brgemm::buffer::ALIGN)),
                })
            })
            .transpose()?;
        Ok(ConvBf16 {
            fwd: Gather::new("fwd", conv.fwd.g, &t.fwd, ep)?,
            bwd,
            upd,
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

    /// Whether backward-weights runs here (stride 1); else the layer's f32
    /// pass computes it.
    pub fn has_backward_weights(&self) -> bool {
        self.upd.is_some()
    }

    /// dW = sum over the minibatch of dZ (x) X and db = the sums of dZ per
    /// output channel, from the f32 dZ and X (rounded here), accumulated in
    /// f32; an error where the layer strides
    /// ([`ConvBf16::has_backward_weights`]).
    pub fn backward_weights(
        &self,
        pool: &Pool,
        conv: &Conv,
        dz: &Tensor4,
        x: &Tensor4,
        dw: &mut Filter,
        db: &mut [f32],
    ) -> Result<()> {
        let pool = pool.for_work(self.params.flops());
        self.check(conv)?;
        let Some(u) = &self.upd else {
            return Err(shape(
                "stride",
                format!("({}, {})", self.params.stride_h, self.params.stride_w),
                "bf16 backward-weights runs at stride 1 only; the f32 pass strides",
            ));
        };
        conv.check_y("dZ", dz)?;
        conv.check_x("X", x)?;
        conv.check_f("dW", dw, conv.filter())?;
        check_buf("db", db.len(), conv.padded_k())?;
        let pr = &self.params;
        let (bc, bk, kq, wt) = (self.bc, self.bk, u.kq, u.wt);
        let (p, q) = (pr.p(), pr.q());
        let (kb, cb) = (pr.k.div_ceil(bk), pr.c.div_ceil(bc));
        let (hp, wp) = (pr.h + 2 * pr.pad_h, pr.w + 2 * pr.pad_w);
        let mut dyv = u.dyv.lock().unwrap_or_else(|e| e.into_inner());
        let mut xt = u.xt.lock().unwrap_or_else(|e| e.into_inner());
        // dY rows as VNNI pairs along the pixels, zero beyond q.
        let row = kq * bk;
        dyv.resize(pr.n * kb * p * row, bf16::ZERO);
        let dp = SyncPtr(dyv.as_mut_ptr());
        pool.for_each(pr.n * kb * p, |i| {
            // SAFETY: row i belongs to this iteration alone.
            let out = unsafe { std::slice::from_raw_parts_mut(dp.get().add(i * row), row) };
            let src = &dz.data[i * q * bk..][..q * bk];
            let zero = vec![0.0f32; bk];
            for (qp, pair) in out.chunks_exact_mut(2 * bk).enumerate() {
                let px = |j: usize| src.get(j * bk..(j + 1) * bk).unwrap_or(&zero);
                let (r0, r1) = (px(2 * qp), px(2 * qp + 1));
                // Two pixels' channels interleaved: one 32-bit word per
                // channel, so the loop vectorises.
                for ((o, a), b) in pair.chunks_exact_mut(2).zip(r0).zip(r1) {
                    o[0] = round_bf16(*a);
                    o[1] = round_bf16(*b);
                }
            }
        });
        // X channel-major per padded row, zero in the padding and beyond.
        let xrow = bc * wt;
        xt.resize(pr.n * cb * hp * xrow, bf16::ZERO);
        let xp = SyncPtr(xt.as_mut_ptr());
        pool.for_each(pr.n * cb * hp, |i| {
            // SAFETY: padded row i belongs to this iteration alone.
            let out = unsafe { std::slice::from_raw_parts_mut(xp.get().add(i * xrow), xrow) };
            out.fill(bf16::ZERO);
            let (plane, y) = (i / hp, i % hp);
            if y < pr.pad_h || y >= pr.pad_h + pr.h {
                return;
            }
            let src = &x.data[(plane * pr.h + y - pr.pad_h) * pr.w * bc..][..pr.w * bc];
            // Channel rows written in turn (each a run of pixels).
            for (j, dst) in out.chunks_exact_mut(wt).enumerate() {
                let dst = &mut dst[pr.pad_w..pr.pad_w + pr.w];
                for (o, px) in dst.iter_mut().zip(src.chunks_exact(bc)) {
                    *o = round_bf16(px[j]);
                }
            }
        });
        debug_assert!(wp <= wt);
        let (dyp, xtp) = (dyv.as_ptr() as usize, xt.as_ptr() as usize);
        let rs = pr.r * pr.s;
        let blk = bc * bk;
        let dwp = SyncPtr(dw.data.as_mut_ptr());
        let pairs = pr.n * p;
        pool.for_each(kb * cb * rs, |i| {
            let (ki, ci, r, s) = (i / (cb * rs), i / rs % cb, i / pr.s % pr.r, i % pr.s);
            // SAFETY: the dW block (ki, ci, r, s) belongs to this item; the
            // offsets stay inside the two buffers made above.
            unsafe {
                let c = dwp.get().add(i * blk);
                let a = (dyp as *const bf16).add(ki * p * row);
                let b = (xtp as *const bf16).add((ci * hp + r * pr.dil_h) * xrow + s * pr.dil_w);
                for p0 in (0..pairs).step_by(UPD_PAIRS) {
                    let cnt = UPD_PAIRS.min(pairs - p0);
                    let batch = RawBatch::Offset {
                        a,
                        b,
                        a_offs: u.a_off[p0..].as_ptr(),
                        b_offs: u.b_off[p0..].as_ptr(),
                        count: cnt,
                    };
                    let k = u.kernels.pick(p0 == 0, false);
                    k.execute_raw(batch, c, std::ptr::null());
                }
            }
        });
        let dbp = SyncPtr(db.as_mut_ptr());
        pool.for_each(kb, |ki| {
            // SAFETY: db's block ki belongs to this iteration alone.
            let out = unsafe { std::slice::from_raw_parts_mut(dbp.get().add(ki * bk), bk) };
            out.fill(0.0);
            for n in 0..pr.n {
                add_rows(out, &dz.data[(n * kb + ki) * p * q * bk..][..p * q * bk]);
            }
        });
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
