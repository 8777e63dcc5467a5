//! Run-time measurement of this core's FMA throughput.
//!
//! Benchmarks report "% of peak" against a number measured in the same process,
//! because this machine's speed changes between processes (and, under load
//! from neighbours, within one). The probe runs independent FMA chains (more
//! than latency x ports, in `asm!` on x86 so nothing but the FMA ports limits
//! it). [`fma_peak_gflops`] keeps the best of several slices over ~0.1 s; a
//! [`Probe`] gives single slices to interleave with the work being measured,
//! so both see the same clock.
//!
//! A register-only probe shows what the FMA ports can do, not what a kernel
//! that also loads its operands can do on a core whose load ports a
//! neighbour may be sharing (presumably another VM on the sibling hyperthread): the same
//! L1-resident kernel loop measured 94% of the probe in one minute and 73-77% in
//! the next, while the probe itself stayed put. [`TileCeiling`] measures that
//! second figure in the same run: the ISA's own main tile on operands that
//! stay in L1, the most any primitive built on it can reach at that moment.

use crate::error::{Error, Result};
use crate::kernels::IsaKernels;
use crate::{aligned_vec, AlignedVec, BatchForm, Descriptor, Isa, Kernel, KernelOptions, RawBatch};
use std::cell::RefCell;
use std::time::{Duration, Instant};

/// A calibrated FMA-peak probe for one ISA: each [`Probe::sample`] runs one
/// slice of a chosen length and returns its GFLOP/s.
#[derive(Debug, Clone)]
pub struct Probe {
    isa: Isa,
    iters: u64,
}

fn run_slice(isa: Isa, iters: u64) -> f64 {
    fn go<K: IsaKernels>(iters: u64) -> f64 {
        let t = Instant::now();
        // SAFETY: `Probe::new` checked that the ISA is supported.
        std::hint::black_box(unsafe { K::fma_probe(iters) });
        let s = t.elapsed().as_secs_f64();
        2.0 * (iters * K::PROBE_FMAS_PER_ITER) as f64 / s / 1e9
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => go::<crate::kernels::avx512_f32::Kernels>(iters),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => go::<crate::kernels::avx2_f32::Kernels>(iters),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => go::<crate::kernels::neon_f32::Kernels>(iters),
        _ => go::<crate::kernels::portable_f32::Kernels>(iters),
    }
}

impl Probe {
    /// Calibrates a probe whose slices take about `slice`.
    ///
    /// For `Reference` this probes the portable kernel: there is no separate
    /// scalar figure worth comparing against.
    pub fn new(isa: Isa, slice: Duration) -> Result<Probe> {
        if !isa.is_supported() {
            return Err(Error::IsaUnsupported { isa });
        }
        // Warm up (clock licence changes take a few ms), then size the slice.
        let mut iters = 1u64 << 12;
        let warm = Instant::now();
        while warm.elapsed() < Duration::from_millis(5) {
            run_slice(isa, iters);
        }
        loop {
            let t = Instant::now();
            run_slice(isa, iters);
            let e = t.elapsed();
            if e >= slice / 2 || iters > (1 << 40) {
                let scale = slice.as_secs_f64() / e.as_secs_f64().max(1e-9);
                iters = ((iters as f64 * scale) as u64).max(1);
                break;
            }
            iters *= 2;
        }
        Ok(Probe { isa, iters })
    }

    /// The ISA probed.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Runs one slice; returns its GFLOP/s.
    pub fn sample(&self) -> f64 {
        run_slice(self.isa, self.iters)
    }
}

/// Measures the fp32 FMA peak of one core for `isa`, in GFLOP/s (~0.1 s):
/// the best of eight slices, which filters out preemption.
pub fn fma_peak_gflops(isa: Isa) -> Result<f64> {
    fma_peak_gflops_for(isa, Duration::from_millis(100))
}

/// As [`fma_peak_gflops`], spending about `total` on the measurement.
pub fn fma_peak_gflops_for(isa: Isa, total: Duration) -> Result<f64> {
    let p = Probe::new(isa, total / 8)?;
    Ok((0..8).map(|_| p.sample()).fold(0.0, f64::max))
}

/// The L1 ceiling of the ISA's main register tile (the one a 64 x 64 x 64
/// BRGEMM runs): one BRGEMM of exactly that tile's rows by a multiple of its
/// columns (about 28) by k = 64, with a batch of 2 (A, B and C together at
/// most ~45 KiB, inside a 48 KiB L1d), called repeatedly on the same
/// operands. Each [`TileCeiling::sample`] runs one slice and returns its
/// GFLOP/s; interleave it with a measurement to see how much of a shortfall
/// is the machine's at that moment rather than the primitive's.
#[derive(Debug)]
pub struct TileCeiling {
    kernel: Kernel,
    reps: usize,
}

const CEIL_K: usize = 64;
const CEIL_BATCH: usize = 2;

/// A, B and C of the ceiling's BRGEMM, 64-byte aligned like the primitives'
/// operands (a `Vec` sits 16 bytes off a line: 2-3% lower here).
type CeilOperands = (AlignedVec<f32>, AlignedVec<f32>, AlignedVec<f32>);

thread_local! {
    /// Per-thread operands, so slices on several threads at once do not share lines.
    static CEIL_BUF: RefCell<Option<CeilOperands>> = const { RefCell::new(None) };
}

impl TileCeiling {
    /// Plans the kernel for `isa` and sizes a slice to take about `slice`.
    pub fn new(isa: Isa, slice: Duration) -> Result<TileCeiling> {
        let opts = KernelOptions {
            isa: Some(isa),
            ..KernelOptions::default()
        };
        let main = Kernel::with_options(&Descriptor::new(64, 64, CEIL_K), opts)?;
        // No edge tiles: m is the tile's rows, n a multiple of its columns.
        let (m, n) = match main.register_tile() {
            Some(t) => (t.mv * isa.f32_lanes(), t.nr * (28 / t.nr).max(1)),
            None => (32, 28),
        };
        let d = Descriptor::new(m, n, CEIL_K).batch_form(BatchForm::Stride {
            a: m * CEIL_K,
            b: CEIL_K * n,
        });
        // Forced: the model may prefer another tile for this smaller shape
        // (NEON picks 2x12 for 16 x 24, while 64-blocks run 4x6).
        let kernel = Kernel::with_options(
            &d,
            KernelOptions {
                tile: main.register_tile(),
                ..opts
            },
        )?;
        let mut c = TileCeiling { kernel, reps: 64 };
        let warm = Instant::now();
        while warm.elapsed() < Duration::from_millis(5) {
            c.sample();
        }
        let t = Instant::now();
        c.sample();
        let scale = slice.as_secs_f64() / t.elapsed().as_secs_f64().max(1e-9);
        c.reps = ((c.reps as f64 * scale) as usize).max(1);
        Ok(c)
    }

    /// The kernel that is measured (its ISA and register tile).
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// Runs one slice on this thread; returns its GFLOP/s.
    pub fn sample(&self) -> f64 {
        CEIL_BUF.with(|cell| {
            let mut buf = cell.borrow_mut();
            let (m, n) = (self.kernel.descriptor().m, self.kernel.descriptor().n);
            let fits = |b: &CeilOperands| {
                b.0.len() == m * CEIL_K * CEIL_BATCH && b.1.len() == CEIL_K * n * CEIL_BATCH
            };
            if !buf.as_ref().is_some_and(fits) {
                *buf = Some((
                    aligned_vec(m * CEIL_K * CEIL_BATCH, 0.01),
                    aligned_vec(CEIL_K * n * CEIL_BATCH, 0.02),
                    aligned_vec(m * n, 0.0),
                ));
            }
            let (a, b, c) = buf.as_mut().expect("just filled");
            let t = Instant::now();
            for _ in 0..self.reps {
                let batch = RawBatch::Stride {
                    a: a.as_ptr(),
                    b: b.as_ptr(),
                    count: CEIL_BATCH,
                };
                // SAFETY: A holds CEIL_BATCH blocks of m x k, B of k x n, C
                // one m x n block: exactly what the stride descriptor reads
                // and writes; the kernel has no bias.
                unsafe {
                    self.kernel
                        .execute_raw(batch, c.as_mut_ptr(), std::ptr::null())
                };
            }
            let s = t.elapsed().as_secs_f64();
            std::hint::black_box(&c);
            self.kernel.flops(CEIL_BATCH) * self.reps as f64 / s / 1e9
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_ceiling_runs_the_main_tile_of_64_blocks() {
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable] {
            if !isa.is_supported() {
                continue;
            }
            let c = TileCeiling::new(isa, Duration::from_millis(2)).unwrap();
            assert_eq!(c.kernel().isa(), isa);
            // The primitives block by 64: the ceiling must time the tile
            // their 64 x 64 x 64 BRGEMMs run, not some easier one, and
            // only that tile (no edge tiles).
            let opts = KernelOptions {
                isa: Some(isa),
                tile: None,
                bf16: None,
            };
            let main = Kernel::with_options(&Descriptor::new(64, 64, 64), opts).unwrap();
            assert_eq!(c.kernel().register_tile(), main.register_tile(), "{isa}");
            let (t, d) = (main.register_tile().unwrap(), c.kernel().descriptor());
            assert_eq!(d.m, t.mv * isa.f32_lanes(), "{isa}");
            assert_eq!(d.n % t.nr, 0, "{isa}");
            let g = c.sample();
            assert!(g.is_finite() && g > 0.0, "{isa}: {g}");
        }
    }
}
