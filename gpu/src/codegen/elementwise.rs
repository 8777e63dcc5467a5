//! The small kernels around the BRGEMM that the GPU FC layers and MLP need:
//! conversion (with optional transpose) to the GEMM input type, activation
//! derivatives, bias gradients, softmax cross-entropy and the optimizers.
//! One source text serves both targets through the prelude's macros.

use super::{prelude, Target};
use crate::desc::GpuDtype;
use brgemm::Activation;

/// One element-wise kernel, by what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElementwiseKernel {
    /// `convert_<dtype>(x f32, y dtype, rows, cols, trans)`: y is rows x cols
    /// column-major; it reads x(i, j) at `i + j*rows`, or x(j, i) at
    /// `j + i*cols` when `trans` is set. bf16 rounds to nearest even.
    Convert(GpuDtype),
    /// `pack_<dtype>(x f32, y dtype, yt dtype, rows, cols, write_y)`: one
    /// pass over the rows x cols column-major x writing it in the GEMM type
    /// as it is (`y`, when `write_y`) and transposed (`yt`, cols x rows):
    /// a layer's weights for its forward and its backward-data products.
    Pack(GpuDtype),
    /// `act_bwd_<act>(y, dy, dz, n)`: dz = dy * act'(z), from the output y.
    ActBackward(Activation),
    /// `bias_grad(dz, db, rows, cols)`: `db[r]` = the sum of row r of dz.
    BiasGrad,
    /// `softmax_xent(logits, labels, dlogits, loss, classes, cols, n,
    /// loss_off)`: per column; the gradient of the mean over the first n
    /// columns (zeros in the others), each column's loss at
    /// `loss[loss_off + j]`.
    SoftmaxXent,
    /// `gather_rows(X, L, idx, x, labels, features, cols, n)`: minibatch
    /// column j (j < n) is row `idx[j]` of the device data set `X`
    /// (row-major, `features` wide) with label `L[idx[j]]`; columns n..cols
    /// are zeros with label 0.
    GatherRows,
    /// `pad_nhwc(x, xp, n, h, w, c, ph, pw, margin, s, gh, gw)`: the NHWC
    /// images x (h x w) on a grid of `gh x gw` pixels per image, pixel
    /// (y, x) at grid (y*s + ph, x*s + pw), zeros elsewhere, after and
    /// before `margin` pixels of zeros: the operand the convolution's taps
    /// read at a shift (s = 1), or a strided output's gradient spread over
    /// its input's grid.
    PadNhwc,
    /// `crop_nhwc(xp, x, n, h, w, c, ph, pw, margin, s, gh, gw)`: the
    /// inverse: pixel (y, x) of the h x w NHWC images from grid pixel
    /// (y*s + ph, x*s + pw).
    CropNhwc,
    /// `transpose_taps(w, wt, k, c, taps)`: each tap's `k x c`
    /// column-major block transposed to `c x k`.
    TransposeTaps,
    /// `copy_slot(src, dst, n, src_off, dst_off)`:
    /// `dst[dst_off + i] = src[src_off + i]`.
    CopySlot,
    /// `seq_time_major(x, y, n, t, f)`: n sequences of t steps of f
    /// features (each sequence contiguous) to step-major columns:
    /// column `step*n + sample`.
    SeqTimeMajor,
    /// `lstm_fwd(xp, rh, b, g, cs, hs, hq, h, n, step, has_rh, q)`: one
    /// LSTM step for every (unit, sample): gates i, f, g, o (PyTorch's
    /// order) from the input projection's column block `step` of xp, the
    /// recurrent product rh (when has_rh) and the bias; their activations to
    /// g's block `step`, c and h to block `step + 1` of cs and hs (block 0:
    /// the zero initial state), h also in the GEMM type to hq (q: 0 none,
    /// 1 bf16, 2 f16).
    LstmFwd,
    /// `rnn_fwd(xp, rh, b, g, cs, hs, hq, h, n, step, has_rh, q)`: one step
    /// of the plain cell, h = tanh(xp + rh + b), to block `step + 1` of hs
    /// (and hq); the LSTM kernel's arguments, g and cs unused.
    RnnFwd,
    /// `rnn_bwd(hs, cs, dha, dhb, dc, dz, dzq, h, n, step, has_a, has_b,
    /// first, q)`: dz = (dha + dhb) (1 - h^2) for the step's h (block
    /// `step + 1` of hs); the LSTM kernel's arguments, cs and dc unused.
    RnnBwd,
    /// `lstm_bwd(g, cs, dha, dhb, dc, dz, dzq, h, n, step, has_a, has_b,
    /// first, q)`: one step of BPTT: dh = dha + dhb (each when present),
    /// dc carried in place (zero at the first step taken), the gate
    /// pre-activation gradients to dz's block `step` (and dzq in the GEMM
    /// type).
    LstmBwd,
    /// `maxpool_fwd(x, y, arg, n, h, w, c, win, stride, pad, oh, ow)`:
    /// win x win windows at `stride` over NHWC x padded by `pad` (the
    /// padding never wins), the max and where it was.
    MaxPoolFwd,
    /// `maxpool_bwd(dy, arg, dx, ...)`: each input element the sum of the
    /// gradients of the outputs whose max it was (a gather over the windows
    /// that hold it, in a fixed order: no scatter, no atomics).
    MaxPoolBwd,
    /// `gavgpool_fwd(x, y, n, hw, c)`: the mean of each image's channel.
    GAvgPoolFwd,
    /// `gavgpool_bwd(dy, dx, n, hw, c)`: dy / hw to every pixel.
    GAvgPoolBwd,
    /// `add_act(a, b, y, n, relu)`: a residual join, y = a + b, then a
    /// ReLU when `relu`.
    AddAct,
    /// `relu_fwd(x, y, n)`: y = max(x, 0).
    ReluFwd,
    /// `dropout_fwd(x, y, mask, n, p, key_lo, key_hi)`: the CPU dropout's
    /// mask (SplitMix64 runs of 4096 elements keyed by the step's 64-bit
    /// key, element by element, so each is computed on its own), scaled by
    /// 1/(1-p); y = x * mask.
    DropoutFwd,
    /// `dropout_bwd(dy, mask, dx, n)`: dx = dy * mask.
    DropoutBwd,
    /// `bn_partial(x, part, pixels, c, chunk)`: per (chunk of pixels,
    /// channel) of NHWC x, the sums of d and d^2 for d = x - x[first pixel]
    /// (the shift keeps the one-pass variance free of cancellation).
    BnPartial,
    /// `bn_finish(x, part, chunks, c, pixels, gamma, beta, eps, momentum,
    /// mean, invstd, run_mean, run_var, scale, offset)`: per channel, the
    /// chunks' sums in order: the batch mean and 1/sqrt(var + eps), the
    /// running statistics (unbiased variance), and the affine map y = scale
    /// x + offset.
    BnFinish,
    /// `bn_infer(gamma, beta, run_mean, run_var, eps, c, scale, offset)`:
    /// the affine map of the running statistics.
    BnInfer,
    /// `bn_apply(x, y, scale, offset, c, n, relu)`: y = scale x + offset
    /// per channel, then a ReLU when `relu`.
    BnApply,
    /// `bn_grad_partial(x, y, dy, mean, invstd, part, pixels, c, chunk,
    /// relu)`: per (chunk, channel) the sums of dy and dy * xhat (dy
    /// through the ReLU where `relu`).
    BnGradPartial,
    /// `bn_grad_finish(part, chunks, c, dgamma, dbeta)`.
    BnGradFinish,
    /// `bn_dx(x, y, dy, mean, invstd, gamma, dgamma, dbeta, dx, pixels, c,
    /// relu)`: dx = gamma invstd (dy - (dbeta + xhat dgamma) / pixels).
    BnDx,
    /// `sgd(p, g, v, n, lr, momentum)`.
    Sgd,
    /// `adam(p, g, m, v, n, step, beta1, beta2, eps)` with the bias-corrected
    /// step size computed on the host.
    Adam,
}

impl ElementwiseKernel {
    /// The generated function's name (static: launches look kernels up by
    /// it without building a string).
    pub fn name(self) -> &'static str {
        use brgemm::Activation as A;
        match self {
            ElementwiseKernel::Convert(GpuDtype::F32) => "convert_f32",
            ElementwiseKernel::Convert(GpuDtype::Bf16) => "convert_bf16",
            ElementwiseKernel::Convert(GpuDtype::F16) => "convert_f16",
            ElementwiseKernel::Pack(GpuDtype::F32) => "pack_f32",
            ElementwiseKernel::Pack(GpuDtype::Bf16) => "pack_bf16",
            ElementwiseKernel::Pack(GpuDtype::F16) => "pack_f16",
            ElementwiseKernel::ActBackward(A::Identity) => "act_bwd_identity",
            ElementwiseKernel::ActBackward(A::Relu) => "act_bwd_relu",
            ElementwiseKernel::ActBackward(A::Sigmoid) => "act_bwd_sigmoid",
            ElementwiseKernel::ActBackward(A::Tanh) => "act_bwd_tanh",
            ElementwiseKernel::ActBackward(A::Gelu) => "act_bwd_gelu",
            ElementwiseKernel::ActBackward(_) => "act_bwd_unknown",
            ElementwiseKernel::BiasGrad => "bias_grad",
            ElementwiseKernel::SoftmaxXent => "softmax_xent",
            ElementwiseKernel::GatherRows => "gather_rows",
            ElementwiseKernel::PadNhwc => "pad_nhwc",
            ElementwiseKernel::CropNhwc => "crop_nhwc",
            ElementwiseKernel::TransposeTaps => "transpose_taps",
            ElementwiseKernel::CopySlot => "copy_slot",
            ElementwiseKernel::SeqTimeMajor => "seq_time_major",
            ElementwiseKernel::LstmFwd => "lstm_fwd",
            ElementwiseKernel::LstmBwd => "lstm_bwd",
            ElementwiseKernel::RnnFwd => "rnn_fwd",
            ElementwiseKernel::RnnBwd => "rnn_bwd",
            ElementwiseKernel::MaxPoolFwd => "maxpool_fwd",
            ElementwiseKernel::MaxPoolBwd => "maxpool_bwd",
            ElementwiseKernel::GAvgPoolFwd => "gavgpool_fwd",
            ElementwiseKernel::GAvgPoolBwd => "gavgpool_bwd",
            ElementwiseKernel::AddAct => "add_act",
            ElementwiseKernel::ReluFwd => "relu_fwd",
            ElementwiseKernel::DropoutFwd => "dropout_fwd",
            ElementwiseKernel::DropoutBwd => "dropout_bwd",
            ElementwiseKernel::BnPartial => "bn_partial",
            ElementwiseKernel::BnFinish => "bn_finish",
            ElementwiseKernel::BnInfer => "bn_infer",
            ElementwiseKernel::BnApply => "bn_apply",
            ElementwiseKernel::BnGradPartial => "bn_grad_partial",
            ElementwiseKernel::BnGradFinish => "bn_grad_finish",
            ElementwiseKernel::BnDx => "bn_dx",
            ElementwiseKernel::Sgd => "sgd",
            ElementwiseKernel::Adam => "adam",
        }
    }
}

/// All element-wise kernels in one program.
pub fn elementwise_source(t: Target) -> String {
    let mut s = String::from(prelude(t));
    s.push_str(
        r#"
#define FLT_MIN_ 1.17549435e-38f
inline u16 f32_to_bf16(float f) {
  unsigned u = AS_UINT(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}
KERNEL convert_f32(GLOBAL const float* x, GLOBAL float* y, int rows, int cols, int trans) {
  const idx_t i = GID;
  if (i >= (idx_t)rows * cols) return;
  const int r = (int)(i % rows), c = (int)(i / rows);
  y[i] = trans ? x[c + (idx_t)r * cols] : x[i];
}
KERNEL convert_bf16(GLOBAL const float* x, GLOBAL u16* y, int rows, int cols, int trans) {
  const idx_t i = GID;
  if (i >= (idx_t)rows * cols) return;
  const int r = (int)(i % rows), c = (int)(i / rows);
  y[i] = f32_to_bf16(trans ? x[c + (idx_t)r * cols] : x[i]);
}
KERNEL convert_f16(GLOBAL const float* x, GLOBAL u16* y, int rows, int cols, int trans) {
  const idx_t i = GID;
  if (i >= (idx_t)rows * cols) return;
  const int r = (int)(i % rows), c = (int)(i / rows);
  y[i] = f32_to_f16(trans ? x[c + (idx_t)r * cols] : x[i]);
}
#define PACK(NAME, T, CVT) \
KERNEL NAME(GLOBAL const float* x, GLOBAL T* y, GLOBAL T* yt, int rows, int cols, int write_y) { \
  const idx_t i = GID; \
  if (i >= (idx_t)rows * cols) return; \
  const int r = (int)(i % rows), c = (int)(i / rows); \
  const T v = CVT(x[i]); \
  if (write_y) y[i] = v; \
  yt[c + (idx_t)r * cols] = v; \
}
#define SAME(v) (v)
PACK(pack_f32, float, SAME)
PACK(pack_bf16, u16, f32_to_bf16)
PACK(pack_f16, u16, f32_to_f16)
KERNEL act_bwd_identity(GLOBAL const float* y, GLOBAL const float* dy, GLOBAL float* dz, int n) {
  const idx_t i = GID; if (i < n) dz[i] = dy[i];
}
KERNEL act_bwd_relu(GLOBAL const float* y, GLOBAL const float* dy, GLOBAL float* dz, int n) {
  const idx_t i = GID; if (i < n) dz[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}
KERNEL act_bwd_sigmoid(GLOBAL const float* y, GLOBAL const float* dy, GLOBAL float* dz, int n) {
  const idx_t i = GID; if (i < n) dz[i] = dy[i] * y[i] * (1.0f - y[i]);
}
KERNEL act_bwd_tanh(GLOBAL const float* y, GLOBAL const float* dy, GLOBAL float* dz, int n) {
  const idx_t i = GID; if (i < n) dz[i] = dy[i] * (1.0f - y[i] * y[i]);
}
KERNEL bias_grad(GLOBAL const float* dz, GLOBAL float* db, int rows, int cols) {
  const idx_t r = GID;
  if (r >= rows) return;
  float s = 0.0f;
  for (int c = 0; c < cols; ++c) s += dz[r + (idx_t)c * rows];
  db[r] = s;
}
KERNEL softmax_xent(GLOBAL const float* logits, GLOBAL const int* labels, GLOBAL float* dlogits,
                    GLOBAL float* loss, int classes, int cols, int n, int loss_off) {
  const idx_t j = GID;
  if (j >= cols) return;
  GLOBAL const float* z = logits + j * classes;
  GLOBAL float* dz = dlogits + j * classes;
  if (j >= n) {
    for (int c = 0; c < classes; ++c) dz[c] = 0.0f;
    loss[loss_off + j] = 0.0f;
    return;
  }
  float mx = z[0];
  for (int c = 1; c < classes; ++c) mx = z[c] > mx ? z[c] : mx;
  float sum = 0.0f;
  for (int c = 0; c < classes; ++c) sum += EXPF(z[c] - mx);
  const int label = labels[j];
  for (int c = 0; c < classes; ++c) {
    const float p = EXPF(z[c] - mx) / sum;
    dz[c] = (p - (c == label ? 1.0f : 0.0f)) / (float)n;
  }
  const float pl = EXPF(z[label] - mx) / sum;
  loss[loss_off + j] = -LOGF(pl > FLT_MIN_ ? pl : FLT_MIN_);
}
KERNEL gather_rows(GLOBAL const float* X, GLOBAL const int* L, GLOBAL const int* idx,
                   GLOBAL float* x, GLOBAL int* labels, int features, int cols, int n) {
  const idx_t i = GID;
  if (i >= (idx_t)features * cols) return;
  const int j = (int)(i / features), f = (int)(i % features);
  const int row = j < n ? idx[j] : -1;
  x[i] = row >= 0 ? X[(idx_t)row * features + f] : 0.0f;
  if (f == 0) labels[j] = row >= 0 ? L[row] : 0;
}
KERNEL pad_nhwc(GLOBAL const float* x, GLOBAL float* xp, int n, int h, int w, int c,
                int ph, int pw, int margin, int s, int gh, int gw) {
  const idx_t i = GID;
  const idx_t grid = (idx_t)n * gh * gw;
  if (i >= (grid + 2 * (idx_t)margin) * c) return;
  const idx_t q = i / c - margin;
  const int ch = (int)(i % c);
  float v = 0.0f;
  if (q >= 0 && q < grid) {
    const int img = (int)(q / ((idx_t)gh * gw));
    const int rem = (int)(q % ((idx_t)gh * gw));
    const int yy = rem / gw - ph, xx = rem % gw - pw;
    if (yy >= 0 && xx >= 0 && yy % s == 0 && xx % s == 0 && yy / s < h && xx / s < w)
      v = x[(((idx_t)img * h + yy / s) * w + xx / s) * c + ch];
  }
  xp[i] = v;
}
KERNEL crop_nhwc(GLOBAL const float* xp, GLOBAL float* x, int n, int h, int w, int c,
                 int ph, int pw, int margin, int s, int gh, int gw) {
  const idx_t i = GID;
  if (i >= (idx_t)n * h * w * c) return;
  const int ch = (int)(i % c);
  const idx_t pix = i / c;
  const int xx = (int)(pix % w), yy = (int)((pix / w) % h), img = (int)(pix / ((idx_t)w * h));
  const idx_t q = margin + ((idx_t)img * gh + yy * s + ph) * gw + xx * s + pw;
  x[i] = xp[q * c + ch];
}
KERNEL transpose_taps(GLOBAL const float* w, GLOBAL float* wt, int k, int c, int taps) {
  const idx_t i = GID;
  const idx_t kc = (idx_t)k * c;
  if (i >= kc * taps) return;
  const idx_t t = i / kc, r = i % kc;
  const int kk = (int)(r % k), cc = (int)(r / k);
  wt[t * kc + cc + (idx_t)kk * c] = w[i];
}
KERNEL copy_slot(GLOBAL const float* src, GLOBAL float* dst, int n, int src_off, int dst_off) {
  const idx_t i = GID;
  if (i < n) dst[dst_off + i] = src[src_off + i];
}
KERNEL seq_time_major(GLOBAL const float* x, GLOBAL float* y, int n, int t, int f) {
  const idx_t i = GID;
  if (i >= (idx_t)n * t * f) return;
  const int ff = (int)(i % f);
  const idx_t col = i / f;
  const int step = (int)(col / n), s = (int)(col % n);
  y[i] = x[((idx_t)s * t + step) * f + ff];
}
inline float sigm_(float z) { return 1.0f / (1.0f + EXPF(-z)); }
inline void store_q(GLOBAL u16* q, idx_t i, float v, int kind) {
  if (kind == 1) q[i] = f32_to_bf16(v);
  else if (kind == 2) q[i] = f32_to_f16(v);
}
KERNEL lstm_fwd(GLOBAL const float* xp, GLOBAL const float* rh, GLOBAL const float* b,
                GLOBAL float* g, GLOBAL float* cs, GLOBAL float* hs, GLOBAL u16* hq,
                int h, int n, int step, int has_rh, int q) {
  const idx_t i = GID;
  if (i >= (idx_t)h * n) return;
  const int r = (int)(i % h), s = (int)(i / h);
  const idx_t col = (idx_t)step * n + s;
  float z[4];
  for (int j = 0; j < 4; ++j) {
    z[j] = xp[col * 4 * h + j * h + r] + b[j * h + r];
    if (has_rh) z[j] += rh[(idx_t)s * 4 * h + j * h + r];
  }
  const float ig = sigm_(z[0]), fg = sigm_(z[1]), gg = TANHF(z[2]), og = sigm_(z[3]);
  GLOBAL float* gc = g + col * 4 * h;
  gc[r] = ig; gc[h + r] = fg; gc[2 * h + r] = gg; gc[3 * h + r] = og;
  const idx_t here = col * h + r, next = ((idx_t)(step + 1) * n + s) * h + r;
  const float c = fg * cs[here] + ig * gg;
  const float hv = og * TANHF(c);
  cs[next] = c;
  hs[next] = hv;
  store_q(hq, next, hv, q);
}
KERNEL rnn_fwd(GLOBAL const float* xp, GLOBAL const float* rh, GLOBAL const float* b,
               GLOBAL float* g, GLOBAL float* cs, GLOBAL float* hs, GLOBAL u16* hq,
               int h, int n, int step, int has_rh, int q) {
  const idx_t i = GID;
  if (i >= (idx_t)h * n) return;
  const int r = (int)(i % h), s = (int)(i / h);
  const idx_t col = (idx_t)step * n + s;
  float z = xp[col * h + r] + b[r];
  if (has_rh) z += rh[(idx_t)s * h + r];
  const float hv = TANHF(z);
  const idx_t next = ((idx_t)(step + 1) * n + s) * h + r;
  hs[next] = hv;
  store_q(hq, next, hv, q);
}
KERNEL rnn_bwd(GLOBAL const float* hs, GLOBAL const float* cs, GLOBAL const float* dha,
               GLOBAL const float* dhb, GLOBAL float* dc, GLOBAL float* dz, GLOBAL u16* dzq,
               int h, int n, int step, int has_a, int has_b, int first, int q) {
  const idx_t i = GID;
  if (i >= (idx_t)h * n) return;
  const int r = (int)(i % h), s = (int)(i / h);
  const idx_t col = (idx_t)step * n + s;
  float dh = 0.0f;
  if (has_a) dh += dha[i];
  if (has_b) dh += dhb[i];
  const float hv = hs[((idx_t)(step + 1) * n + s) * h + r];
  const float d = dh * (1.0f - hv * hv);
  dz[col * h + r] = d;
  store_q(dzq, col * h + r, d, q);
}
KERNEL lstm_bwd(GLOBAL const float* g, GLOBAL const float* cs, GLOBAL const float* dha,
                GLOBAL const float* dhb, GLOBAL float* dc, GLOBAL float* dz, GLOBAL u16* dzq,
                int h, int n, int step, int has_a, int has_b, int first, int q) {
  const idx_t i = GID;
  if (i >= (idx_t)h * n) return;
  const int r = (int)(i % h), s = (int)(i / h);
  const idx_t col = (idx_t)step * n + s;
  GLOBAL const float* gc = g + col * 4 * h;
  const float ig = gc[r], fg = gc[h + r], gg = gc[2 * h + r], og = gc[3 * h + r];
  const float c = cs[((idx_t)(step + 1) * n + s) * h + r], cp = cs[col * h + r];
  float dh = 0.0f;
  if (has_a) dh += dha[i];
  if (has_b) dh += dhb[i];
  const float tc = TANHF(c);
  const float dct = (first ? 0.0f : dc[i]) + dh * og * (1.0f - tc * tc);
  float d[4];
  d[0] = dct * gg * ig * (1.0f - ig);
  d[1] = dct * cp * fg * (1.0f - fg);
  d[2] = dct * ig * (1.0f - gg * gg);
  d[3] = dh * tc * og * (1.0f - og);
  for (int j = 0; j < 4; ++j) {
    dz[col * 4 * h + j * h + r] = d[j];
    store_q(dzq, col * 4 * h + j * h + r, d[j], q);
  }
  dc[i] = dct * fg;
}
KERNEL maxpool_fwd(GLOBAL const float* x, GLOBAL float* y, GLOBAL int* arg, int n, int h, int w,
                   int c, int win, int st, int pad, int oh, int ow) {
  const idx_t i = GID;
  if (i >= (idx_t)n * oh * ow * c) return;
  const int ch = (int)(i % c);
  const idx_t pix = i / c;
  const int ox = (int)(pix % ow), oy = (int)((pix / ow) % oh), img = (int)(pix / ((idx_t)ow * oh));
  int bi = -1;
  float best = 0.0f;
  for (int dy = 0; dy < win; ++dy)
    for (int dx = 0; dx < win; ++dx) {
      const int yy = oy * st - pad + dy, xx = ox * st - pad + dx;
      if (yy < 0 || xx < 0 || yy >= h || xx >= w) continue;
      const int j = (int)((((idx_t)img * h + yy) * w + xx) * c + ch);
      if (bi < 0 || x[j] > best) { best = x[j]; bi = j; }
    }
  y[i] = best;
  arg[i] = bi;
}
KERNEL maxpool_bwd(GLOBAL const float* dy, GLOBAL const int* arg, GLOBAL float* dx, int n, int h,
                   int w, int c, int win, int st, int pad, int oh, int ow) {
  const idx_t i = GID;
  if (i >= (idx_t)n * h * w * c) return;
  const int ch = (int)(i % c);
  const idx_t pix = i / c;
  const int xx = (int)(pix % w), yy = (int)((pix / w) % h), img = (int)(pix / ((idx_t)w * h));
  // Every output whose window holds this input, in a fixed order.
  float g = 0.0f;
  const int y0 = (yy + pad - win + st) / st, x0 = (xx + pad - win + st) / st;
  for (int oy = y0 > 0 ? y0 : 0; oy <= (yy + pad) / st && oy < oh; ++oy)
    for (int ox = x0 > 0 ? x0 : 0; ox <= (xx + pad) / st && ox < ow; ++ox) {
      const idx_t o = (((idx_t)img * oh + oy) * ow + ox) * c + ch;
      if (arg[o] == (int)i) g += dy[o];
    }
  dx[i] = g;
}
KERNEL gavgpool_fwd(GLOBAL const float* x, GLOBAL float* y, int n, int hw, int c) {
  const idx_t i = GID;
  if (i >= (idx_t)n * c) return;
  const int ch = (int)(i % c), img = (int)(i / c);
  float s = 0.0f;
  for (int p = 0; p < hw; ++p) s += x[((idx_t)img * hw + p) * c + ch];
  y[i] = s / (float)hw;
}
KERNEL gavgpool_bwd(GLOBAL const float* dy, GLOBAL float* dx, int n, int hw, int c) {
  const idx_t i = GID;
  if (i >= (idx_t)n * hw * c) return;
  const int ch = (int)(i % c), img = (int)(i / ((idx_t)hw * c));
  dx[i] = dy[(idx_t)img * c + ch] / (float)hw;
}
KERNEL dropout_fwd(GLOBAL const float* x, GLOBAL float* y, GLOBAL float* mask, int n, float p,
                   int key_lo, int key_hi) {
  const idx_t i = GID;
  if (i >= n) return;
  const u64 golden = 0x9E3779B97F4A7C15UL;
  const u64 key = ((u64)(unsigned)key_hi << 32) | (u64)(unsigned)key_lo;
  const u64 run = (u64)(i / 4096), o = (u64)(i % 4096);
  u64 z = (key ^ (run * golden)) + (o + 1) * golden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
  z = z ^ (z >> 31);
  const float u = (float)(z >> 40) / 16777216.0f;
  const float m = u >= p ? 1.0f / (1.0f - p) : 0.0f;
  mask[i] = m;
  y[i] = x[i] * m;
}
KERNEL dropout_bwd(GLOBAL const float* dy, GLOBAL const float* mask, GLOBAL float* dx, int n) {
  const idx_t i = GID;
  if (i < n) dx[i] = dy[i] * mask[i];
}
KERNEL relu_fwd(GLOBAL const float* x, GLOBAL float* y, int n) {
  const idx_t i = GID;
  if (i < n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
KERNEL add_act(GLOBAL const float* a, GLOBAL const float* b, GLOBAL float* y, int n, int relu) {
  const idx_t i = GID;
  if (i >= n) return;
  const float v = a[i] + b[i];
  y[i] = relu && v < 0.0f ? 0.0f : v;
}
KERNEL bn_partial(GLOBAL const float* x, GLOBAL float* part, int pixels, int c, int chunk) {
  const idx_t i = GID;
  const int chunks = (pixels + chunk - 1) / chunk;
  if (i >= (idx_t)chunks * c) return;
  const int ch = (int)(i % c), j = (int)(i / c);
  const float k = x[ch];
  float s = 0.0f, q = 0.0f;
  const int end = (j + 1) * chunk < pixels ? (j + 1) * chunk : pixels;
  for (int p = j * chunk; p < end; ++p) {
    const float d = x[(idx_t)p * c + ch] - k;
    s += d;
    q += d * d;
  }
  part[2 * i] = s;
  part[2 * i + 1] = q;
}
KERNEL bn_finish(GLOBAL const float* x, GLOBAL const float* part, int chunks, int c, int pixels,
                 GLOBAL const float* gamma, GLOBAL const float* beta, float eps, float momentum,
                 GLOBAL float* mean_out, GLOBAL float* invstd, GLOBAL float* run_mean,
                 GLOBAL float* run_var, GLOBAL float* scale, GLOBAL float* offset) {
  const idx_t ch = GID;
  if (ch >= c) return;
  float s = 0.0f, q = 0.0f;
  for (int j = 0; j < chunks; ++j) {
    s += part[2 * ((idx_t)j * c + ch)];
    q += part[2 * ((idx_t)j * c + ch) + 1];
  }
  const float n = (float)pixels;
  const float m0 = s / n;
  float var = q / n - m0 * m0;
  var = var > 0.0f ? var : 0.0f;
  const float inv = 1.0f / SQRTF(var + eps);
  const float mean = m0 + x[ch];
  mean_out[ch] = mean;
  invstd[ch] = inv;
  const float unbiased = pixels > 1 ? var * n / (n - 1.0f) : var;
  run_mean[ch] = (1.0f - momentum) * run_mean[ch] + momentum * mean;
  run_var[ch] = (1.0f - momentum) * run_var[ch] + momentum * unbiased;
  scale[ch] = gamma[ch] * inv;
  offset[ch] = beta[ch] - mean * gamma[ch] * inv;
}
KERNEL bn_infer(GLOBAL const float* gamma, GLOBAL const float* beta, GLOBAL const float* run_mean,
                GLOBAL const float* run_var, float eps, int c, GLOBAL float* scale, GLOBAL float* offset) {
  const idx_t ch = GID;
  if (ch >= c) return;
  const float inv = 1.0f / SQRTF(run_var[ch] + eps);
  scale[ch] = gamma[ch] * inv;
  offset[ch] = beta[ch] - run_mean[ch] * gamma[ch] * inv;
}
KERNEL bn_apply(GLOBAL const float* x, GLOBAL float* y, GLOBAL const float* scale,
                GLOBAL const float* offset, int c, int n, int relu) {
  const idx_t i = GID;
  if (i >= n) return;
  const int ch = (int)(i % c);
  const float v = x[i] * scale[ch] + offset[ch];
  y[i] = relu && v < 0.0f ? 0.0f : v;
}
KERNEL bn_grad_partial(GLOBAL const float* x, GLOBAL const float* y, GLOBAL const float* dy,
                       GLOBAL const float* mean, GLOBAL const float* invstd, GLOBAL float* part,
                       int pixels, int c, int chunk, int relu) {
  const idx_t i = GID;
  const int chunks = (pixels + chunk - 1) / chunk;
  if (i >= (idx_t)chunks * c) return;
  const int ch = (int)(i % c), j = (int)(i / c);
  float sd = 0.0f, sx = 0.0f;
  const int end = (j + 1) * chunk < pixels ? (j + 1) * chunk : pixels;
  for (int p = j * chunk; p < end; ++p) {
    const idx_t e = (idx_t)p * c + ch;
    const float g = relu && y[e] <= 0.0f ? 0.0f : dy[e];
    sd += g;
    sx += g * (x[e] - mean[ch]) * invstd[ch];
  }
  part[2 * i] = sd;
  part[2 * i + 1] = sx;
}
KERNEL bn_grad_finish(GLOBAL const float* part, int chunks, int c, GLOBAL float* dgamma,
                      GLOBAL float* dbeta) {
  const idx_t ch = GID;
  if (ch >= c) return;
  float sd = 0.0f, sx = 0.0f;
  for (int j = 0; j < chunks; ++j) {
    sd += part[2 * ((idx_t)j * c + ch)];
    sx += part[2 * ((idx_t)j * c + ch) + 1];
  }
  dbeta[ch] = sd;
  dgamma[ch] = sx;
}
KERNEL bn_dx(GLOBAL const float* x, GLOBAL const float* y, GLOBAL const float* dy,
             GLOBAL const float* mean, GLOBAL const float* invstd, GLOBAL const float* gamma,
             GLOBAL const float* dgamma, GLOBAL const float* dbeta, GLOBAL float* dx,
             int pixels, int c, int relu) {
  const idx_t i = GID;
  if (i >= (idx_t)pixels * c) return;
  const int ch = (int)(i % c);
  const float g = relu && y[i] <= 0.0f ? 0.0f : dy[i];
  const float xh = (x[i] - mean[ch]) * invstd[ch];
  dx[i] = gamma[ch] * invstd[ch] * (g - (dbeta[ch] + xh * dgamma[ch]) / (float)pixels);
}
KERNEL sgd(GLOBAL float* p, GLOBAL const float* g, GLOBAL float* v, int n, float lr, float momentum) {
  const idx_t i = GID;
  if (i >= n) return;
  v[i] = momentum * v[i] + g[i];
  p[i] -= lr * v[i];
}
KERNEL adam(GLOBAL float* p, GLOBAL const float* g, GLOBAL float* m, GLOBAL float* v, int n,
            float step, float beta1, float beta2, float eps) {
  const idx_t i = GID;
  if (i >= n) return;
  m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];
  v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
  p[i] -= step * m[i] / (SQRTF(v[i]) + eps);
}
"#,
    );
    match t {
        Target::Cuda => s
            .replace("inline u16", "__device__ __forceinline__ u16")
            .replace("inline float", "__device__ __forceinline__ float")
            .replace("inline void", "__device__ __forceinline__ void")
            .replace("AS_UINT(f)", "__float_as_uint(f)"),
        Target::OpenCl => s.replace("AS_UINT(f)", "as_uint(f)"),
    }
}
