//! Shared by the GPU tests: problem generation, the f64 reference, device
//! and tool discovery.
#![allow(dead_code)]

use brgemm::{Activation, Beta};
use brgemm_gpu::{
    Backend, BatchTable, Buffer, Device, GpuBatch, GpuBrgemm, GpuDescriptor, GpuDtype, HopperTiling,
};
use half::{bf16, f16};
use std::sync::OnceLock;

/// The OpenCL device, shared by the tests of one binary (opening PoCL
/// from several test threads at once can fail); `None` with a plain line
/// saying why, or a failure when `BRGEMM_REQUIRE_OPENCL=1` (the test script).
pub fn opencl() -> Option<&'static Device> {
    static DEV: OnceLock<Option<Device>> = OnceLock::new();
    DEV.get_or_init(|| {
        open(
            Backend::OpenCl,
            Some("BRGEMM_REQUIRE_OPENCL"),
            "no OpenCL device",
        )
    })
    .as_ref()
}

/// The CUDA device, or `None` with a plain line saying the numeric CUDA
/// tests were skipped (a failure when `BRGEMM_REQUIRE_CUDA=1`: the GPU
/// machine's script).
pub fn cuda() -> Option<&'static Device> {
    static DEV: OnceLock<Option<Device>> = OnceLock::new();
    DEV.get_or_init(|| {
        open(
            Backend::Cuda,
            Some("BRGEMM_REQUIRE_CUDA"),
            "numeric CUDA tests need a CUDA device",
        )
    })
    .as_ref()
}

/// Two `#[test]`s running `f(dev)`, one on the OpenCL device and one on
/// the CUDA device: `on_devices!(f: name_on_opencl, name_on_cuda)`. Each
/// passes where this machine has no device of its kind, unless that kind's
/// `BRGEMM_REQUIRE_*` variable asks for one ([`opencl`], [`cuda`]).
#[allow(unused_macros)] // not every test file runs on both devices
macro_rules! on_devices {
    ($f:ident: $ocl:ident, $cuda:ident) => {
        #[test]
        fn $ocl() {
            if let Some(dev) = crate::common::opencl() {
                $f(dev)
            }
        }

        #[test]
        fn $cuda() {
            if let Some(dev) = crate::common::cuda() {
                $f(dev)
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_devices;

fn open(b: Backend, require: Option<&str>, what: &str) -> Option<Device> {
    match Device::open(b) {
        Ok(d) => Some(d),
        Err(e) => {
            if let Some(var) = require.filter(|v| std::env::var(v).as_deref() == Ok("1")) {
                panic!("{var}=1 but: {e}");
            }
            println!("skipped: {what} ({e})");
            None
        }
    }
}

/// Tiny deterministic generator (the tests must not depend on the clock).
pub struct Lcg(pub u64);
impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    pub fn f32(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Rounds to what `dt` can hold (the reference then sees the same inputs).
pub fn round(dt: GpuDtype, x: f32) -> f32 {
    match dt {
        GpuDtype::Bf16 => bf16::from_f32(x).to_f32(),
        GpuDtype::F16 => f16::from_f32(x).to_f32(),
        GpuDtype::F32 => x,
    }
}

/// Uploads `v` (already rounded) in the element type `dt`.
pub fn upload(dev: &Device, dt: GpuDtype, v: &[f32]) -> Buffer {
    match dt {
        GpuDtype::Bf16 => dev.upload(
            &v.iter()
                .map(|&x| bf16::from_f32(x).to_bits())
                .collect::<Vec<u16>>(),
        ),
        GpuDtype::F16 => dev.upload(
            &v.iter()
                .map(|&x| f16::from_f32(x).to_bits())
                .collect::<Vec<u16>>(),
        ),
        GpuDtype::F32 => dev.upload(v),
    }
    .unwrap()
}

/// A whole problem: inputs, where each pair starts, and the f64 result.
pub struct Problem {
    pub d: GpuDescriptor,
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub c0: Vec<f32>,
    pub bias: Vec<f32>,
    pub offs_a: Vec<usize>,
    pub offs_b: Vec<usize>,
    pub batch: usize,
}

impl Problem {
    /// Random inputs for `d` (validated) and `batch` pairs placed per its
    /// batch form: strided, or at shuffled aligned slots for tables.
    pub fn new(d: &GpuDescriptor, batch: usize, seed: u64) -> Problem {
        let d = d.validate().unwrap();
        let mut r = Lcg(seed);
        let (ae, be) = (d.a_extent(), d.b_extent());
        let (offs_a, offs_b, alen, blen) = match d.batch_form {
            GpuBatch::Stride { a, b } => (
                (0..batch).map(|i| i * a).collect::<Vec<_>>(),
                (0..batch).map(|i| i * b).collect::<Vec<_>>(),
                batch.saturating_sub(1) * a + ae,
                batch.saturating_sub(1) * b + be,
            ),
            _ => {
                let al = d.table_align;
                let slot = |e: usize| e.div_ceil(al) * al + al; // + al: not back to back
                let (sa, sb) = (slot(ae), slot(be));
                let mut pa: Vec<usize> = (0..batch).map(|i| i * sa).collect();
                let mut pb: Vec<usize> = (0..batch).map(|i| i * sb).collect();
                for i in (1..batch).rev() {
                    pa.swap(i, r.below(i + 1));
                    pb.swap(i, r.below(i + 1));
                }
                (pa, pb, batch * sa + 1, batch * sb + 1)
            }
        };
        let dt = d.dtype;
        let a = (0..alen.max(1)).map(|_| round(dt, r.f32())).collect();
        let b = (0..blen.max(1)).map(|_| round(dt, r.f32())).collect();
        let c0 = (0..d.c_extent()).map(|_| r.f32()).collect();
        let bias = (0..d.m).map(|_| r.f32()).collect();
        Problem {
            d,
            a,
            b,
            c0,
            bias,
            offs_a,
            offs_b,
            batch,
        }
    }

    /// act(alpha * sum + beta*C + bias) in f64, and per element the sum of
    /// |terms| (the scale of the rounding error).
    pub fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let d = &self.d;
        let mut out: Vec<f64> = self.c0.iter().map(|&x| x as f64).collect();
        let mut mag = vec![0.0f64; out.len()];
        for j in 0..d.n {
            for r in 0..d.m {
                let (mut s, mut m) = (0.0f64, 0.0f64);
                for i in 0..self.batch {
                    for p in 0..d.k {
                        let t = self.a[self.offs_a[i] + r + p * d.lda] as f64
                            * self.b[self.offs_b[i] + p + j * d.ldb] as f64;
                        s += t;
                        m += t.abs();
                    }
                }
                let ci = r + j * d.ldc;
                let mut v = d.alpha as f64 * s;
                if matches!(d.beta, Beta::One) {
                    v += self.c0[ci] as f64;
                }
                if d.epilogue.bias {
                    v += self.bias[r] as f64;
                }
                out[ci] = act64(d.epilogue.activation, v);
                mag[ci] = m * d.alpha.abs() as f64 + 1.0;
            }
        }
        (out, mag)
    }

    /// Runs the generated kernel on `dev`; returns C.
    pub fn run(&self, dev: &Device) -> brgemm_gpu::Result<Vec<f32>> {
        self.run_split(dev, None)
    }

    /// [`Problem::run`] with the batch-reduce loop split into `splits`
    /// slices (`None`: the device's default).
    pub fn run_split(&self, dev: &Device, splits: Option<usize>) -> brgemm_gpu::Result<Vec<f32>> {
        self.run_kernel(dev, GpuBrgemm::new(&self.d)?.with_split(splits))
    }

    /// Runs the planned kernel `k` (made for this problem's descriptor).
    pub fn run_kernel(&self, dev: &Device, k: GpuBrgemm) -> brgemm_gpu::Result<Vec<f32>> {
        let a = upload(dev, self.d.dtype, &self.a);
        let b = upload(dev, self.d.dtype, &self.b);
        let mut c = dev.upload(&self.c0)?;
        let bias = dev.upload(&self.bias)?;
        let table = match self.d.batch_form {
            GpuBatch::Stride { .. } | GpuBatch::Packed => None,
            GpuBatch::Offset => Some(BatchTable::offsets(
                dev,
                &self.d,
                &self.offs_a,
                &self.offs_b,
            )?),
            GpuBatch::Address => Some(BatchTable::addresses(
                dev,
                &self.d,
                &a,
                &self.offs_a,
                &b,
                &self.offs_b,
            )?),
        };
        k.execute(
            dev,
            &a,
            &b,
            &mut c,
            Some(&bias).filter(|_| self.d.epilogue.bias),
            table.as_ref(),
            self.batch,
        )?;
        dev.download(&c, self.c0.len())
    }

    /// Checks `got` against the reference; the error names the first bad
    /// element.
    pub fn check(&self, got: &[f32]) -> Result<(), String> {
        let (want, mag) = self.reference();
        for (i, ((&g, &w), &m)) in got.iter().zip(&want).zip(&mag).enumerate() {
            // f32 accumulation in any order: a few ulps of the term sum.
            let tol = 2e-6 * m * (self.d.k * self.batch.max(1)) as f64 + 1e-5;
            let diff = (g as f64 - w).abs();
            if diff > tol || diff.is_nan() {
                return Err(format!(
                    "{:?} batch {}: C[{i}] = {g}, want {w} (tol {tol})",
                    self.d, self.batch
                ));
            }
        }
        Ok(())
    }
}

pub fn act64(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Relu => x.max(0.0),
        Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Activation::Tanh => x.tanh(),
        Activation::Gelu => {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        }
        _ => x,
    }
}

/// A case for the sm_90a kernel: 16-bit operands in the stride form with
/// 16-byte aligned leading dimensions and strides (some batch strides below
/// the leading dimension, as in B_i = B + i*k), edges in m, n and k, zero
/// and odd batches, every tile width, and some forced splits.
pub fn hopper_case(seed: u64) -> (GpuDescriptor, usize, HopperTiling, Option<usize>) {
    let mut r = Lcg(seed);
    let dt = [GpuDtype::Bf16, GpuDtype::F16][r.below(2)];
    let pick = |r: &mut Lcg| [1, 8, 50, 64, 65, 128, 130, 200, 257][r.below(9)];
    let (m, n, k) = (pick(&mut r), pick(&mut r), pick(&mut r));
    let up = |x: usize| x.div_ceil(8) * 8;
    let batch = [0, 1, 2, 3, 5][r.below(5)];
    let (lda, ldc) = (up(m + r.below(9)), m + r.below(3));
    let (ldb, sb) = if r.below(3) == 0 {
        // B_i side by side along k inside one wide B.
        (up(k) * batch.max(1), up(k))
    } else {
        let ldb = up(k + r.below(9));
        (ldb, ldb * n + 8 * r.below(3))
    };
    let d = GpuDescriptor::new(m, n, k)
        .dtype(dt)
        .lda(lda)
        .ldb(ldb)
        .ldc(ldc)
        .alpha([1.0, 0.5, -2.0][r.below(3)])
        .beta(if r.below(2) == 1 {
            Beta::One
        } else {
            Beta::Zero
        })
        .epilogue(r.below(2) == 1, ACTS[r.below(5)])
        .batch(GpuBatch::Stride {
            a: lda * k + 8 * r.below(3),
            b: sb,
        });
    let bn = [64, 128, 256][r.below(3)];
    let stages = [2, 3, 4][r.below(3)];
    let split = [None, None, Some(2), Some(7)][r.below(4)];
    (d, batch, HopperTiling { bn, stages }, split)
}

/// Every activation the epilogue fuses.
pub const ACTS: [Activation; 5] = [
    Activation::Identity,
    Activation::Relu,
    Activation::Sigmoid,
    Activation::Tanh,
    Activation::Gelu,
];

/// The deterministic part of the sweep: every dtype x batch form, with beta,
/// epilogue, leading dimensions (aligned and not), edge tiles, zero batch and
/// forced tilings cycling through them.
pub fn sweep() -> Vec<(GpuDescriptor, usize)> {
    use brgemm_gpu::Tiling;
    let dts = [GpuDtype::Bf16, GpuDtype::F16, GpuDtype::F32];
    let shapes = [
        (1, 1, 1),
        (17, 9, 23),
        (64, 64, 64),
        (130, 72, 40),
        (33, 129, 16),
        (128, 8, 100),
    ];
    let tilings = [
        None,
        Some(Tiling {
            bm: 32,
            bn: 32,
            bk: 16,
            warps_m: 1,
            warps_n: 1,
            stages: 2,
        }),
        Some(Tiling {
            bm: 64,
            bn: 32,
            bk: 32,
            warps_m: 2,
            warps_n: 2,
            stages: 3,
        }),
        // 64x64 warp tiles: 128 accumulators, fewer resident blocks.
        Some(Tiling {
            bm: 128,
            bn: 128,
            bk: 16,
            warps_m: 2,
            warps_n: 2,
            stages: 2,
        }),
    ];
    let mut out = Vec::new();
    let mut i = 0usize;
    for dt in dts {
        for form in 0..3 {
            for _ in 0..2 {
                let (m, n, k) = shapes[i % shapes.len()];
                // Every third case pads the leading dimensions by an odd
                // amount (the element-wise copy path); the others by a
                // vector (the 16-byte path).
                let pad = if i.is_multiple_of(3) { 3 } else { 8 };
                let (lda, ldb, ldc) = (m + pad * (i % 2), k + pad, m + (i % 4));
                let mut d = GpuDescriptor::new(m, n, k)
                    .dtype(dt)
                    .lda(lda)
                    .ldb(ldb)
                    .ldc(ldc)
                    .alpha(if i % 4 == 1 { 0.5 } else { 1.0 })
                    .beta(if i % 2 == 1 { Beta::One } else { Beta::Zero })
                    .epilogue(i % 3 != 1, ACTS[i % ACTS.len()]);
                d = match form {
                    0 => d.batch(GpuBatch::Stride {
                        a: lda * k + 8 * (i % 2),
                        b: ldb * n + 16,
                    }),
                    1 => d
                        .batch(GpuBatch::Offset)
                        .table_align(if i.is_multiple_of(3) { 1 } else { 0 }),
                    _ => d.batch(GpuBatch::Address),
                };
                if let Some(t) = tilings[i % tilings.len()] {
                    d = d.tiling(t);
                }
                let batch = [3, 1, 0, 2, 5][i % 5];
                out.push((d, batch));
                i += 1;
            }
        }
    }
    out
}

/// A random case for the property tests.
pub fn random_case(seed: u64) -> (GpuDescriptor, usize) {
    let mut r = Lcg(seed);
    let dt = [GpuDtype::Bf16, GpuDtype::F16, GpuDtype::F32][r.below(3)];
    let pick = |r: &mut Lcg| [1, 2, 7, 13, 31, 47, 64, 97, 150][r.below(9)];
    let (m, n, k) = (pick(&mut r), pick(&mut r), pick(&mut r));
    let (lda, ldb, ldc) = (m + r.below(9), k + r.below(9), m + r.below(3));
    let mut d = GpuDescriptor::new(m, n, k)
        .dtype(dt)
        .lda(lda)
        .ldb(ldb)
        .ldc(ldc)
        .beta(if r.below(2) == 1 {
            Beta::One
        } else {
            Beta::Zero
        })
        .epilogue(r.below(2) == 1, ACTS[r.below(5)]);
    d = match r.below(3) {
        0 => d.batch(GpuBatch::Stride {
            a: lda * k + r.below(5),
            b: ldb * n + r.below(5),
        }),
        1 => d.batch(GpuBatch::Offset).table_align(1),
        _ => d.batch(GpuBatch::Address).table_align(1),
    };
    (d, r.below(5))
}
