//! Facts about this core that the primitives' heuristics need beyond its ISA.
//!
//! The same kernels behave differently across microarchitectures; where a
//! choice was measured to flip between the machines this project runs on,
//! the choice is made here, from CPUID, with an environment override for
//! experiments.

use std::sync::OnceLock;

/// From where a streamed operand (a weight panel re-read on every call)
/// must come for [`crate::Prefetch::NextPair`] kernels to beat plain ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamPrefetch {
    /// Only operands streamed from L3 or memory. Measured on Intel Sapphire
    /// Rapids: prefetching an L2-resident panel cost 5-19%, since its own
    /// L2 prefetchers keep up. The default for cores not measured.
    BeyondL2,
    /// Also operands streamed from L2. Measured on AMD Zen 5 (same process,
    /// alternating): FC forward and backward-data +8-12% at (256,1024,1024)
    /// and (512,2048,2048), LSTM forward +11% at K = 512, where plain
    /// kernels wait on L2.
    BeyondL1,
}

impl StreamPrefetch {
    /// The variable's values: `l2` for [`StreamPrefetch::BeyondL1`] (prefetch
    /// from L2 on), `l3` for [`StreamPrefetch::BeyondL2`].
    fn parse(s: &str) -> Option<StreamPrefetch> {
        match s.trim().to_ascii_lowercase().as_str() {
            "l2" => Some(StreamPrefetch::BeyondL1),
            "l3" => Some(StreamPrefetch::BeyondL2),
            _ => None,
        }
    }
}

/// This core's [`StreamPrefetch`]: `BRGEMM_STREAM_PREFETCH=l2|l3` when set
/// to one of those, else from the CPU's vendor and family. The variable is
/// read on every call (plans read it when they are made), so one process can
/// compare plans made both ways.
pub fn stream_prefetch() -> StreamPrefetch {
    static NATIVE: OnceLock<StreamPrefetch> = OnceLock::new();
    std::env::var("BRGEMM_STREAM_PREFETCH")
        .ok()
        .and_then(|s| StreamPrefetch::parse(&s))
        .unwrap_or_else(|| {
            *NATIVE.get_or_init(|| {
                if is_zen5() {
                    StreamPrefetch::BeyondL1
                } else {
                    StreamPrefetch::BeyondL2
                }
            })
        })
}

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

fn is_zen5() -> bool {
    // Miri has no CPUID: it runs as a generic core.
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        let (v, family) = vendor_family();
        &v == b"AuthenticAMD" && family == 0x1a
    }
    #[cfg(any(not(target_arch = "x86_64"), miri))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_override() {
        assert_eq!(StreamPrefetch::parse("L2"), Some(StreamPrefetch::BeyondL1));
        assert_eq!(StreamPrefetch::parse(" l3"), Some(StreamPrefetch::BeyondL2));
        assert_eq!(StreamPrefetch::parse("on"), None);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn reads_a_known_vendor() {
        let (v, family) = vendor_family();
        let v = std::str::from_utf8(&v).expect("ASCII vendor");
        assert!(!v.trim().is_empty());
        assert!(family >= 6, "{v} family {family:#x}");
    }
}
