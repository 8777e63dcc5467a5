//! CPUID facts beyond the ISA, read only by [`crate::policy`] to choose
//! this core's row.

/// The CPUID vendor string and display family of this core.
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn vendor_family() -> ([u8; 12], u32) {
    use std::arch::x86_64::__cpuid;
    let (l0, l1) = (__cpuid(0), __cpuid(1));
    let mut v = [0u8; 12];
    v[..4].copy_from_slice(&l0.ebx.to_le_bytes());
    v[4..8].copy_from_slice(&l0.edx.to_le_bytes());
    v[8..].copy_from_slice(&l0.ecx.to_le_bytes());
    let base = (l1.eax >> 8) & 0xf;
    let family = if base == 0xf {
        base + ((l1.eax >> 20) & 0xff)
    } else {
        base
    };
    (v, family)
}

/// Whether this core is an AMD Zen 4 (family 0x19 with AVX-512 and
/// AVX512-BF16, which the Zen 3 cores of that family lack).
pub(crate) fn is_zen4() -> bool {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        let (v, family) = vendor_family();
        &v == b"AuthenticAMD"
            && family == 0x19
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    false
}

/// Whether this core is an AMD Zen 5 (family 0x1a).
pub(crate) fn is_zen5() -> bool {
    // Miri has no CPUID: it runs as a generic core.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        let (v, family) = vendor_family();
        &v == b"AuthenticAMD" && family == 0x1a
    }
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    false
}

#[cfg(all(test, target_arch = "x86_64", not(miri)))]
mod tests {
    use super::*;

    #[test]
    fn reads_a_known_vendor() {
        let (v, family) = vendor_family();
        let v = std::str::from_utf8(&v).expect("ASCII vendor");
        assert!(!v.trim().is_empty());
        assert!(family >= 6, "{v} family {family:#x}");
    }
}
