//! The convolution layer's passes: forward (with the residual join) and
//! backward, each over its groups, f32 or bf16 as the layer is planned,
//! with the values in the layouts the neighbouring layers read.

use super::Conv2d;
use crate::error::Result;
use crate::layer::Mode;
use crate::layers::need_training;
use crate::tensor::{channels_from_nchw, channels_to_nchw, Shape, Tensor};
use brgemm::Activation;
use brgemm_primitives::conv::{AddResidual, Operand};
use brgemm_primitives::{Pool, Tensor4};

impl Conv2d {
    /// Backward: dW and db, and dX when `data` (the weight transpose and
    /// backward-data pass are skipped without it).
    pub(super) fn backward_pass(
        &mut self,
        pool: &Pool,
        dy: &Tensor,
        data: bool,
    ) -> Result<Option<Tensor>> {
        let identity = self.act == Activation::Identity;
        let (c_all, k_all) = (self.in_c, self.out_c);
        let ps = self.state.plan("backward")?;
        let single = ps.len() == 1;
        let mut dx_plain = (!single && data).then(|| vec![0.0; ps[0].input.len() * ps.len()]);
        let mut dx_bf16 = false;
        for (j, p) in ps.iter_mut().enumerate() {
            need_training(p.trained, "conv2d")?;
            let (bc, bk) = p.blocks();
            // dZ = dY in bf16 alone (a batch norm's dx), in this layer's
            // blocks, where the bf16 passes read it so; else f32.
            let alone =
                single && identity && p.bf.is_some() && dy.bf16_only_into(pool, bk, &mut p.dyb)?;
            match alone {
                true => {}
                false if single => dy.blocked_into(pool, bk, &mut p.dy)?,
                false => {
                    let t = p.dy.get_mut(p.output, bk)?;
                    channels_from_nchw(pool, dy.data(), k_all, j * p.output.c, t);
                }
            }
            if !identity {
                let dz = p.dz.get_mut(p.output, bk)?;
                p.conv
                    .activation_backward(pool, p.dy.get(), p.y.get(), dz)?;
            }
            let dz = if identity { &p.dy } else { &p.dz };
            // dZ as the bf16 passes read it: in bf16 alone, or f32 with the
            // copy the layer that wrote it made.
            let dz_op = match alone {
                true => Operand::Bf16(p.dyb.get()),
                false => {
                    let dzb = dy.bf16_blocked_as(bk).filter(|_| single && identity);
                    Operand::F32(dz.get(), dzb)
                }
            };
            // dX in bf16 alone for the layer that reads it so.
            dx_bf16 = data && single && self.dx_alone && p.bf.is_some();
            if dx_bf16 {
                let b = p.bf.as_ref().expect("checked");
                let dx = p.dxb.get_mut(p.input, bc)?;
                b.conv
                    .backward_data_bf16(pool, &p.conv, dz_op, &b.ops.wtv, dx)?;
            } else if data {
                let dx = p.dx.get_mut(p.input, bc)?;
                match &mut p.bf {
                    // The filter was packed for both passes by the forward.
                    Some(b) => {
                        let wtv = &b.ops.wtv;
                        b.conv.backward_data(pool, &p.conv, dz_op, wtv, dx)?;
                    }
                    _ => {
                        p.conv.transpose_filter(pool, &p.w, &mut p.wt)?;
                        p.conv.backward_data(pool, dz.get(), &p.wt, dx)?;
                    }
                }
                if let Some(out) = &mut dx_plain {
                    channels_to_nchw(dx, c_all, j * p.input.c, out);
                }
            }
            match &p.bf {
                Some(b) => {
                    let x = match p.x_alone {
                        true => Operand::Bf16(p.xa.get()),
                        false => Operand::F32(p.x.get(), p.x_copy.as_deref().map(|v| &v[..])),
                    };
                    let (dw, db) = (&mut p.dw, &mut p.db);
                    b.conv.backward_weights(pool, &p.conv, dz_op, x, dw, db)?
                }
                _ => p
                    .conv
                    .backward_weights(pool, dz.get(), p.x.get(), &mut p.dw, &mut p.db)?,
            }
            // The input and the gradient were kept for this backward only.
            p.x.release();
            p.xa.release();
            p.x_copy = None;
            p.dy.release();
            p.dyb.release();
            p.trained = false;
        }
        Ok(match dx_plain {
            Some(v) => {
                let s = ps[0].input;
                Some(Tensor::from_vec(Shape::new(s.n, c_all, s.h, s.w), v)?)
            }
            None if dx_bf16 => Some(ps[0].dxb.tensor()),
            None if data => Some(ps[0].dx.tensor()),
            None => None,
        })
    }

    /// The forward, with the residual join (one group only) when `res` is
    /// given.
    pub(super) fn forward_with(
        &mut self,
        pool: &Pool,
        x: &Tensor,
        res: Option<(&Tensor4, bool)>,
        mode: Mode,
    ) -> Result<Tensor> {
        let (c_all, k_all) = (self.in_c, self.out_c);
        let ps = self.state.plan("forward")?;
        let single = ps.len() == 1;
        let mut out = (!single).then(|| vec![0.0; ps[0].output.len() * ps.len()]);
        let mut bf16_only = false;
        for (j, p) in ps.iter_mut().enumerate() {
            let (bc, bk) = p.blocks();
            let add = res.map(|(r, relu)| AddResidual { r, relu });
            // Inference runs the convolution with the batch norm folded in
            // where there is one; the bf16 passes where the layer has them.
            let folded = self.fold.is_some() && mode == Mode::Eval;
            let (conv, w, bias, bf) = match &mut self.fold {
                Some(f) if mode == Mode::Eval => (&f.conv, &f.w, &f.bias[..], &mut f.bf),
                _ => (&p.conv, &p.w, &p.bias[..], &mut p.bf),
            };
            // X in bf16 alone (a batch norm's output), in this layer's
            // blocks, where the bf16 passes read it, here and in
            // backward-weights; else f32.
            p.x_alone = single && bf.is_some() && x.bf16_only_into(pool, bc, &mut p.xa)?;
            match p.x_alone {
                true => p.x.release(),
                false if single => x.blocked_into(pool, bc, &mut p.x)?,
                false => {
                    let t = p.x.get_mut(p.input, bc)?;
                    channels_from_nchw(pool, x.data(), c_all, j * p.input.c, t);
                }
            }
            // X already in bf16 where the layer that wrote it made a copy.
            let xb = x.bf16_blocked_as(bc).filter(|_| single);
            p.x_copy = match mode == Mode::Train && single && !p.x_alone && bf.is_some() {
                true => x.bf16_copy_as(bc),
                false => None,
            };
            match bf {
                Some(b) => {
                    let o = &mut b.ops;
                    if !o.packed {
                        b.conv.pack_filter(pool, w, &mut o.wv, &mut o.wtv)?;
                        o.packed = true;
                    }
                    let x = match p.x_alone {
                        true => Operand::Bf16(p.xa.get()),
                        false => Operand::F32(p.x.get(), xb),
                    };
                    // The output in bf16 alone for readers that take it so
                    // (not the folded layer's: the batch norm is skipped).
                    bf16_only = self.out_alone && single && add.is_none() && !folded;
                    if bf16_only {
                        let yb = p.yb.get_mut(p.output, bk)?;
                        b.conv.forward_bf16(pool, conv, x, &o.wv, bias, yb)?;
                    } else {
                        let y = p.y.get_mut(p.output, bk)?;
                        match add {
                            Some(a) => b.conv.forward_add(pool, conv, x, &o.wv, bias, a, y)?,
                            None => b.conv.forward(pool, conv, x, &o.wv, bias, y)?,
                        }
                    }
                }
                None => {
                    let (x, y) = (p.x.get(), p.y.get_mut(p.output, bk)?);
                    match add {
                        Some(a) => conv.forward_add(pool, x, w, bias, a, y)?,
                        None => conv.forward(pool, x, w, bias, y)?,
                    }
                }
            }
            if let Some(out) = &mut out {
                channels_to_nchw(p.y.get(), k_all, j * p.output.c, out);
            }
            p.trained = mode == Mode::Train;
            if !p.trained {
                p.x.release();
                p.xa.release();
            }
        }
        match out {
            Some(v) => {
                let s = ps[0].output;
                Tensor::from_vec(Shape::new(s.n, k_all, s.h, s.w), v)
            }
            None if bf16_only => Ok(ps[0].yb.tensor()),
            None => Ok(ps[0].y.tensor()),
        }
    }
}
