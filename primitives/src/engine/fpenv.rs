//! Subnormal floats flushed to zero on the threads that compute.
//!
//! Late in training, gradients and Adam's moments of a converged model fall
//! below f32's normal range (1.2e-38), and on x86 every operation that
//! reads or makes a subnormal takes a microcode assist of a hundred cycles
//! or more: `train_mlp` ran at half speed from its 31st epoch on (0.51-0.55M
//! against 1.03-1.10M samples/s with flushing, the same accuracy; Sapphire
//! Rapids). So, as TensorFlow and the oneDNN-based frameworks do, the
//! library's passes run with flush-to-zero and denormals-are-zero (x86
//! MXCSR FTZ | DAZ; AArch64 FPCR.FZ): the pool's workers from their start,
//! the calling thread for the length of each pass or step (its own mode is
//! restored after). `BRGEMM_DENORMALS=keep` keeps IEEE subnormals.

use brgemm::env::Setting;
use std::sync::OnceLock;

/// Whether passes flush subnormals: `BRGEMM_DENORMALS` is not `keep`
/// ([`crate::threads::Pool::new`] rejects values other than `keep` and
/// `flush`, naming them).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        Setting::Denormals
            .value()
            .is_none_or(|v| v.trim() != "keep")
    })
}

/// The thread's floating-point control word as it was before [`flush`].
pub(crate) struct Restore(Option<u64>);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(old) = self.0 {
            // SAFETY: writes back the control word read on this thread.
            unsafe { write(old) };
        }
    }
}

/// Turns flushing on for the calling thread until the guard drops (a no-op
/// when it is off, already on, or on other architectures).
#[inline]
pub(crate) fn flush() -> Restore {
    if !enabled() {
        return Restore(None);
    }
    // SAFETY: reads and sets only the flush bits of this thread's control
    // register; every other mode (rounding, exception masks) is kept.
    unsafe {
        match read() {
            Some(old) if old | FLUSH != old => {
                write(old | FLUSH);
                Restore(Some(old))
            }
            _ => Restore(None),
        }
    }
}

/// Turns flushing on for the rest of the calling thread's life (the
/// pool's workers, which run nothing else).
pub(crate) fn flush_forever() {
    std::mem::forget(flush());
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
const FLUSH: u64 = 0x8040; // MXCSR FTZ (bit 15) | DAZ (bit 6)
#[cfg(all(target_arch = "aarch64", not(miri)))]
const FLUSH: u64 = 1 << 24; // FPCR.FZ
#[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))))]
const FLUSH: u64 = 0;

/// # Safety
/// Reads this thread's control register (always valid).
#[cfg(all(target_arch = "x86_64", not(miri)))]
unsafe fn read() -> Option<u64> {
    let mut csr = 0u32;
    core::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
    Some(csr as u64)
}

/// # Safety
/// `v` must be a valid MXCSR value (one read by [`read`], with flush bits).
#[cfg(all(target_arch = "x86_64", not(miri)))]
unsafe fn write(v: u64) {
    let csr = v as u32;
    core::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags, readonly));
}

/// # Safety
/// Reads this thread's control register (always valid).
#[cfg(all(target_arch = "aarch64", not(miri)))]
unsafe fn read() -> Option<u64> {
    let v: u64;
    core::arch::asm!("mrs {}, fpcr", out(reg) v, options(nomem, nostack, preserves_flags));
    Some(v)
}

/// # Safety
/// `v` must be a valid FPCR value (one read by [`read`], with FZ set).
#[cfg(all(target_arch = "aarch64", not(miri)))]
unsafe fn write(v: u64) {
    core::arch::asm!("msr fpcr, {}", in(reg) v, options(nomem, nostack, preserves_flags));
}

#[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))))]
unsafe fn read() -> Option<u64> {
    None
}

#[cfg(not(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri))))]
unsafe fn write(_: u64) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A subnormal product is zero inside the guard and back after it.
    #[test]
    fn subnormals_flush_inside_the_guard_only() {
        let tiny = std::hint::black_box(1e-30f32);
        let under = || std::hint::black_box(tiny) * std::hint::black_box(1e-10f32);
        assert!(under() > 0.0, "subnormal arithmetic before the guard");
        {
            let _g = flush();
            if enabled() && FLUSH != 0 {
                assert_eq!(under(), 0.0, "flushed inside the guard");
            }
        }
        assert!(under() > 0.0, "the thread's mode restored");
    }
}
