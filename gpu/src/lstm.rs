//! A sequence classifier on the device: one recurrent layer, LSTM
//! (PyTorch's gates i, f, g, o) or the plain tanh cell, whose last hidden
//! state feeds a [`GpuMlp`] head, trained with BPTT; built from the CPU graph of [`brgemm_nn::models::SeqSpec`] so both
//! start from the same seeded weights.
//!
//! The products are generated BRGEMMs as on the CPU: the input projection
//! of every step at once (`4H x F` times `F x steps*N`), then per step the
//! recurrent product `R h_{t-1}` and an element-wise cell; BPTT runs the
//! cell backward per step with `R^T dz_t` for the previous step, and the
//! weight gradients are two batch-reduce GEMMs over all steps (`dW` over
//! blocks of the step x sample columns, `dR` over the steps). States live
//! in step-major blocks (block 0: the zero initial state), so each step's
//! operand is a fixed offset into one buffer (the offset batch form with
//! one pair).

use crate::codegen::ElementwiseKernel as EK;
use crate::desc::{GpuBatch, GpuDescriptor, GpuDtype};
use crate::device::{Arg, Buffer, Device};
use crate::error::{invalid, Result};
use crate::fc::reduce_block;
use crate::kernel::{BatchTable, GpuBrgemm};
use crate::mlp::{gather_rows, step, transpose, GpuDataset, GpuMlp};
use brgemm_nn::models::{LayerSpec, SeqSpec};
use brgemm_nn::{Graph, Linear, Recurrent};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::CellKind;

/// A recurrent sequence classifier on the device.
pub struct GpuSeqNet {
    /// Hidden units, minibatch, steps, features per step.
    h: usize,
    n: usize,
    t: usize,
    f: usize,
    dtype: GpuDtype,
    /// LSTM cells (4 gates), else the plain tanh cell (1).
    lstm: bool,
    gates: usize,
    head: GpuMlp,
    w: Buffer,
    r: Buffer,
    b: Buffer,
    grads: [Buffer; 3],
    moments: [(Buffer, Buffer); 3],
    steps_taken: u32,
    /// The minibatch (each sequence contiguous), its step-major form and
    /// GEMM-type copies.
    x: Buffer,
    xtm: Buffer,
    xtm_d: Option<Buffer>,
    xt_d: Buffer,
    wd: Option<Buffer>,
    rd: Option<Buffer>,
    rt_d: Buffer,
    /// Input projection, recurrent product, gate activations.
    xp: Buffer,
    rh: Buffer,
    g: Buffer,
    /// Cell and hidden states, step-major blocks of `H x N` (block 0: zero),
    /// h in the GEMM type, and h transposed for dR.
    cs: Buffer,
    hs: Buffer,
    hq: Option<Buffer>,
    hst_d: Buffer,
    /// Gate gradients (f32 and GEMM type), carried dc, dh from the next
    /// step and from the head.
    dz: Buffer,
    dzq: Option<Buffer>,
    dc: Buffer,
    dh_rec: Buffer,
    dh_head: Buffer,
    idx: Buffer,
    proj: GpuBrgemm,
    rec: GpuBrgemm,
    rec_tabs: Vec<BatchTable>,
    back: GpuBrgemm,
    back_tabs: Vec<BatchTable>,
    upd_w: GpuBrgemm,
    upd_w_batch: usize,
    upd_r: GpuBrgemm,
}

fn quant(dtype: GpuDtype) -> i32 {
    match dtype {
        GpuDtype::F32 => 0,
        GpuDtype::Bf16 => 1,
        GpuDtype::F16 => 2,
    }
}

impl GpuSeqNet {
    /// The classifier of `spec` with the weights of its CPU graph `cpu`
    /// ([`SeqSpec::graph`]); GEMM inputs in `dtype`. One unidirectional
    /// layer of LSTM or RNN cells for now: stacks and both directions are
    /// refused by name.
    pub fn from_cpu(
        dev: &Device,
        cpu: &Graph,
        spec: &SeqSpec,
        dtype: GpuDtype,
    ) -> Result<GpuSeqNet> {
        if spec.layers != 1 || spec.bidirectional {
            return Err(invalid(
                "recurrent layers",
                format!("{} (bidirectional: {})", spec.layers, spec.bidirectional),
                "the GPU sequence net has one unidirectional layer",
            ));
        }
        let rec = cpu.layers_of::<Recurrent>();
        let [wc, rc, bc] = match rec.first() {
            Some(l) if rec.len() == 1 => l.weights(),
            _ => {
                return Err(invalid(
                    "CPU graph",
                    rec.len(),
                    "needs exactly one recurrent layer",
                ))
            }
        };
        let (h, t, f, n) = (spec.hidden, spec.steps, spec.features, cpu.input_shape().n);
        let lstm = spec.kind == CellKind::Lstm;
        let gates = if lstm { 4 } else { 1 };
        let gh = gates * h;
        if wc.len() != gh * f || rc.len() != gh * h || bc.len() != gh {
            return Err(invalid(
                "LSTM weights",
                wc.len(),
                format!("expected {gh} x {f}"),
            ));
        }
        let nt = n * t;
        let ns = n * (t + 1);
        let es = dtype.size();
        let fl = |e: usize| dev.alloc(e * 4);
        let ty = |e: usize| -> Result<Option<Buffer>> {
            if dtype == GpuDtype::F32 {
                Ok(None)
            } else {
                dev.alloc(e * es).map(Some)
            }
        };
        let zeros = |e: usize| dev.upload(&vec![0.0f32; e]);
        let one = |d: GpuDescriptor| GpuBrgemm::new(&d.dtype(dtype));
        let proj = one(GpuDescriptor::new(gh, nt, f).lda(gh).ldb(f).ldc(gh))?;
        let rec_d = GpuDescriptor::new(gh, n, h)
            .lda(gh)
            .ldb(h)
            .ldc(gh)
            .dtype(dtype)
            .batch(GpuBatch::Offset)
            .table_align(1);
        let back_d = GpuDescriptor::new(h, n, gh)
            .lda(h)
            .ldb(gh)
            .ldc(h)
            .dtype(dtype)
            .batch(GpuBatch::Offset)
            .table_align(1);
        let blk = reduce_block(nt);
        let upd_w = one(GpuDescriptor::new(gh, f, blk)
            .lda(gh)
            .ldb(nt)
            .ldc(gh)
            .batch(GpuBatch::Stride {
                a: blk * gh,
                b: blk,
            }))?;
        let upd_r = one(GpuDescriptor::new(gh, h, n)
            .lda(gh)
            .ldb(ns)
            .ldc(gh)
            .batch(GpuBatch::Stride { a: gh * n, b: n }))?;
        let rec_tabs = (0..t)
            .map(|s| BatchTable::offsets(dev, &rec_d, &[0], &[s * h * n]))
            .collect::<Result<_>>()?;
        let back_tabs = (0..t)
            .map(|s| BatchTable::offsets(dev, &back_d, &[0], &[s * gh * n]))
            .collect::<Result<_>>()?;
        let linears: Vec<&Linear> = cpu.layers_of::<Linear>();
        let specs = LayerSpec::classifier(&spec.head, spec.classes);
        let head = GpuMlp::from_linears(dev, &linears, &specs, h, n, None, dtype)?;
        let pair = |e: usize| -> Result<(Buffer, Buffer)> { Ok((zeros(e)?, zeros(e)?)) };
        Ok(GpuSeqNet {
            h,
            n,
            t,
            f,
            dtype,
            lstm,
            gates,
            head,
            w: dev.upload(&transpose(&wc, f, gh))?,
            r: dev.upload(&transpose(&rc, h, gh))?,
            b: dev.upload(&bc)?,
            grads: [fl(gh * f)?, fl(gh * h)?, fl(gh)?],
            moments: [pair(gh * f)?, pair(gh * h)?, pair(gh)?],
            steps_taken: 0,
            x: fl(nt * f)?,
            xtm: fl(nt * f)?,
            xtm_d: ty(nt * f)?,
            xt_d: dev.alloc(nt * f * es)?,
            wd: ty(gh * f)?,
            rd: ty(gh * h)?,
            rt_d: dev.alloc(gh * h * es)?,
            xp: fl(gh * nt)?,
            rh: fl(gh * n)?,
            g: fl(gh * nt)?,
            cs: zeros(h * ns)?,
            hs: zeros(h * ns)?,
            hq: match dtype {
                GpuDtype::F32 => None,
                _ => Some(dev.upload(&vec![0u16; h * ns])?),
            },
            hst_d: dev.alloc(ns * h * es)?,
            dz: fl(gh * nt)?,
            dzq: ty(gh * nt)?,
            dc: fl(h * n)?,
            dh_rec: fl(h * n)?,
            dh_head: fl(h * n)?,
            idx: fl(n)?,
            proj,
            rec: GpuBrgemm::new(&rec_d)?,
            rec_tabs,
            back: GpuBrgemm::new(&back_d)?,
            back_tabs,
            upd_w,
            upd_w_batch: nt / blk,
            upd_r,
        })
    }

    /// Minibatch size.
    pub fn batch(&self) -> usize {
        self.n
    }

    /// Uploads sequences (`steps * features` values each, step by step).
    pub fn dataset(&self, dev: &Device, x: &[f32], labels: &[usize]) -> Result<GpuDataset> {
        GpuDataset::upload(dev, x, labels, self.t * self.f)
    }

    /// The sequences `idx` of `data` into `x`, their labels to the head.
    fn gather(&mut self, dev: &Device, data: &GpuDataset, idx: &[usize]) -> Result<()> {
        let (_, labels) = self.head.input_buffers();
        let x = &self.x;
        gather_rows(
            dev,
            data,
            idx,
            self.n,
            self.t * self.f,
            x,
            labels,
            &mut self.idx,
        )
    }

    /// The recurrent layer over the minibatch in `x`, then the head's input.
    fn forward(&mut self, dev: &Device) -> Result<()> {
        let (h, n, t, f) = (self.h, self.n, self.t, self.f);
        let nt = n * t;
        dev.launch_elementwise(
            EK::SeqTimeMajor,
            nt * f,
            &[
                Arg::Buf(&self.x),
                Arg::Buf(&self.xtm),
                Arg::I32(n as i32),
                Arg::I32(t as i32),
                Arg::I32(f as i32),
            ],
        )?;
        let xo = dev.typed(self.dtype, &self.xtm, &self.xtm_d, nt * f)?;
        let wo = dev.typed(self.dtype, &self.w, &self.wd, self.gates * h * f)?;
        self.proj
            .execute(dev, wo, xo, &mut self.xp, None, None, 1)?;
        let ro = dev.typed(self.dtype, &self.r, &self.rd, self.gates * h * h)?;
        let ho = self.hq.as_ref().unwrap_or(&self.hs);
        for s in 0..t {
            if s > 0 {
                self.rec
                    .execute(dev, ro, ho, &mut self.rh, None, Some(&self.rec_tabs[s]), 1)?;
            }
            dev.launch_elementwise(
                if self.lstm { EK::LstmFwd } else { EK::RnnFwd },
                h * n,
                &[
                    Arg::Buf(&self.xp),
                    Arg::Buf(&self.rh),
                    Arg::Buf(&self.b),
                    Arg::Buf(&self.g),
                    Arg::Buf(&self.cs),
                    Arg::Buf(&self.hs),
                    Arg::Buf(ho),
                    Arg::I32(h as i32),
                    Arg::I32(n as i32),
                    Arg::I32(s as i32),
                    Arg::I32((s > 0) as i32),
                    Arg::I32(quant(self.dtype)),
                ],
            )?;
        }
        let (hx, _) = self.head.input_buffers();
        dev.launch_elementwise(
            EK::CopySlot,
            h * n,
            &[
                Arg::Buf(&self.hs),
                Arg::Buf(hx),
                Arg::I32((h * n) as i32),
                Arg::I32((t * h * n) as i32),
                Arg::I32(0),
            ],
        )
    }

    /// One training step on the rows `idx` of a device data set
    /// ([`GpuSeqNet::dataset`]); the loss waits for [`GpuSeqNet::losses`].
    pub fn train_step_on(
        &mut self,
        dev: &Device,
        data: &GpuDataset,
        idx: &[usize],
        opt: &Optimizer,
    ) -> Result<()> {
        let (h, n, t, f) = (self.h, self.n, self.t, self.f);
        let (gh, nt, ns) = (self.gates * h, n * t, n * (t + 1));
        self.gather(dev, data, idx)?;
        self.forward(dev)?;
        self.head
            .backprop_rows(dev, idx.len(), Some(&mut self.dh_head))?;
        dev.convert(self.dtype, &self.r, &self.rt_d, h, gh, true)?;
        let dzo = self.dzq.as_ref().unwrap_or(&self.dz);
        for s in (0..t).rev() {
            let last = s + 1 == t;
            // The RNN cell reads its h where the LSTM reads its gates.
            let (kernel, acts) = if self.lstm {
                (EK::LstmBwd, &self.g)
            } else {
                (EK::RnnBwd, &self.hs)
            };
            dev.launch_elementwise(
                kernel,
                h * n,
                &[
                    Arg::Buf(acts),
                    Arg::Buf(&self.cs),
                    Arg::Buf(&self.dh_head),
                    Arg::Buf(&self.dh_rec),
                    Arg::Buf(&self.dc),
                    Arg::Buf(&self.dz),
                    Arg::Buf(dzo),
                    Arg::I32(h as i32),
                    Arg::I32(n as i32),
                    Arg::I32(s as i32),
                    Arg::I32(last as i32),
                    Arg::I32(!last as i32),
                    Arg::I32(last as i32),
                    Arg::I32(quant(self.dtype)),
                ],
            )?;
            if s > 0 {
                self.back.execute(
                    dev,
                    &self.rt_d,
                    dzo,
                    &mut self.dh_rec,
                    None,
                    Some(&self.back_tabs[s]),
                    1,
                )?;
            }
        }
        dev.convert(self.dtype, &self.xtm, &self.xt_d, nt, f, true)?;
        dev.convert(self.dtype, &self.hs, &self.hst_d, ns, h, true)?;
        let [dw, dr, db] = &mut self.grads;
        self.upd_w
            .execute(dev, dzo, &self.xt_d, dw, None, None, self.upd_w_batch)?;
        self.upd_r
            .execute(dev, dzo, &self.hst_d, dr, None, None, t)?;
        let db: &Buffer = db;
        dev.launch_elementwise(
            EK::BiasGrad,
            gh,
            &[
                Arg::Buf(&self.dz),
                Arg::Buf(db),
                Arg::I32(gh as i32),
                Arg::I32(nt as i32),
            ],
        )?;
        self.head.apply_gradients(dev, opt)?;
        self.steps_taken += 1;
        for (p, (gr, (m, v))) in [&self.w, &self.r, &self.b]
            .into_iter()
            .zip(self.grads.iter().zip(&self.moments))
        {
            step(dev, opt, self.steps_taken, p, gr, m, v, p.bytes() / 4)?;
        }
        Ok(())
    }

    crate::mlp::head_readout!(|m: &mut Self, dev| m.forward(dev));

    /// W, R and the bias in the CPU layer's (PyTorch's) order.
    pub fn lstm_parameters(&self, dev: &Device) -> Result<[Vec<f32>; 3]> {
        let (h, f) = (self.h, self.f);
        let gh = self.gates * h;
        Ok([
            transpose(&dev.download(&self.w, gh * f)?, gh, f),
            transpose(&dev.download(&self.r, gh * h)?, gh, h),
            dev.download(&self.b, gh)?,
        ])
    }
}
