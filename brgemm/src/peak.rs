//! Run-time measurement of this core's FMA throughput.
//!
//! Benchmarks report "% of peak" against a number measured in the same process,
//! because this machine's speed changes between processes (and, under load
//! from neighbours, within one). The probe runs independent FMA chains (more
//! than latency x ports, in `asm!` on x86 so nothing but the FMA ports limits
//! it). [`fma_peak_gflops`] keeps the best of several slices over ~0.1 s; a
//! [`Probe`] gives single slices to interleave with the work being measured,
//! so both see the same clock.

use crate::error::{Error, Result};
use crate::kernels::IsaKernels;
use crate::Isa;
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
