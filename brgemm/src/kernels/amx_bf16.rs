//! AMX bf16 microkernel: `tdpbf16ps` on resident C tiles.
//!
//! ```text
//!   AMX computes C'[rows x cols] += A'[rows x 32 bf16] . B'[16 pairs x cols];
//!   with our column-major C this is C^T = B^T A^T:
//!
//!     C tile  (tmm0..3): 16 columns of C (rows) x 16 rows of C (f32)   = C^T
//!     A' tile (tmm4, 5): 16 columns of B (rows) x 32 k (bf16)          = B^T, B as is
//!     B' tile (tmm6, 7): 16 k-pairs (rows) x 16 rows of C x 2 (bf16)   = A in VNNI pairs
//!
//!              tmm6 (A rows m0..m0+16)   tmm7 (A rows m0+16..m0+32)
//!   tmm4 (B cols n0..+16)     tmm0                      tmm1
//!   tmm5 (B cols n0+16..+32)  tmm2                      tmm3
//! ```
//!
//! One 32x32 block of C stays in tmm0..3 for the whole batch and k loop and
//! is stored once. m and k must be multiples of 32; n is any: a last block
//! of `nb` < 32 columns runs on tiles configured with fewer rows
//! ([`config`]: tmm0, 1, 4 hold `min(nb, 16)` columns, tmm2, 3, 5 the rest;
//! with `nb` <= 16 the lower pair repeats the upper one's columns, computes
//! a copy of them and is not stored). A convolution's pixel runs (28, 56,
//! 14 or 7 per output row) need it; the configuration switches cost one
//! `ldtilecfg` each way per call with a tail block.
//!
//! Measured here (asm probes, same process): `tdpbf16ps` on resident tiles
//! 1.0-2.4 TFLOP/s (bimodal, as the recipes say), two accumulators already
//! saturate it; this 2x2 step on *L1-resident* tiles 440-470 GFLOP/s in a
//! slow phase of the VM (380-600 over several sessions), so tile loads, not
//! `tdpbf16ps`, set the pace (a double-buffered 1x2 layout, 2 C + 2x3 input
//! tiles, is worse: 290-360). Streamed from L2, as a primitive runs it, two
//! things matter, on (64,64,64,16) with 1 MiB of operands:
//! - every tile row one cache line: 64-byte aligned operands 292-336 vs
//!   203-220 GFLOP/s 16 bytes off (what a `Vec` gets); hence
//!   [`crate::AlignedVec`] for every packed operand;
//! - the next pair's four tiles (same k) prefetched into L1, 16 lines after
//!   each `tdpbf16ps`: 280-350 -> 405-490 GFLOP/s (old and new binaries
//!   alternated), above the L1-resident figure. The same 64 prefetches
//!   issued in one burst before the loads cost 17%, and prefetching the
//!   next k step instead of the next pair, or two pairs ahead, gains less.
//!
//! Not kept: interleaving the loads with the `tdpbf16ps` (x0.97), and
//! reversing the batch order on every other block so the next block starts
//! on L1-hot data (neutral).

use crate::batch::BatchSrc;
use half::bf16;
use std::cell::Cell;
use std::sync::OnceLock;

/// `ldtilecfg` operand: palette 1, 8 tiles of 16 rows x 64 bytes.
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// The configuration for blocks of `nb` (1..=32) columns of C.
    const fn for_cols(nb: usize) -> Self {
        let mut colsb = [0u16; 16];
        let mut rows = [0u8; 16];
        let upper = if nb < 16 { nb } else { 16 } as u8;
        let lower = if nb > 16 { (nb - 16) as u8 } else { upper };
        let mut i = 0;
        while i < 8 {
            colsb[i] = 64;
            rows[i] = match i {
                0 | 1 | 4 => upper,
                2 | 3 | 5 => lower,
                _ => 16,
            };
            i += 1;
        }
        TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb,
            rows,
        }
    }
}

/// The configurations of blocks of 1..=32 columns of C (index `nb - 1`).
static CONFIGS: [TileConfig; 32] = {
    let mut c = [const { TileConfig::for_cols(32) }; 32];
    let mut nb = 1;
    while nb < 32 {
        c[nb - 1] = TileConfig::for_cols(nb);
        nb += 1;
    }
    c
};

/// The configuration of blocks of `nb` (1..=32) columns of C.
pub(crate) fn config(nb: usize) -> &'static TileConfig {
    &CONFIGS[nb - 1]
}

thread_local! {
    /// Address of the configuration last loaded on this thread (0: none).
    static LOADED: Cell<usize> = const { Cell::new(0) };
}

/// Loads `cfg` unless it is what this thread loaded last.
///
/// # Safety
/// AMX usable (CPU support and OS permission).
#[inline]
pub(crate) unsafe fn ensure_config(cfg: &'static TileConfig) {
    let id = cfg as *const TileConfig as usize;
    if LOADED.with(|l| l.get()) != id {
        core::arch::asm!("ldtilecfg [{}]", in(reg) cfg, options(nostack, readonly));
        LOADED.with(|l| l.set(id));
    }
}

fn cpuid_amx_bf16() -> bool {
    // Miri has no CPUID or XGETBV: no AMX there.
    if cfg!(miri) {
        return false;
    }
    let r = core::arch::x86_64::__cpuid_count(7, 0);
    let tile = r.edx & (1 << 24) != 0;
    let bf16 = r.edx & (1 << 22) != 0;
    if !(tile && bf16) {
        return false;
    }
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS manages tile state.
    let (lo, _hi): (u32, u32);
    // SAFETY: OSXSAVE is implied by AMX support; xgetbv(0) reads XCR0.
    unsafe {
        core::arch::asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") _hi, options(nomem, nostack))
    };
    lo & (0b11 << 17) == (0b11 << 17)
}

/// Requests the tile data permission from Linux once per process
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`). `BRGEMM_AMX_DENY`
/// set to anything simulates a refusal, to test the fallback.
fn request_permission() -> bool {
    if crate::env::Setting::AmxDeny.value_os().is_some() {
        return false;
    }
    if !cfg!(target_os = "linux") {
        return false;
    }
    let r: i64;
    // SAFETY: a plain syscall; arch_prctl = 158 on x86-64 Linux.
    unsafe {
        core::arch::asm!("syscall", inlateout("rax") 158i64 => r, in("rdi") 0x1023i64, in("rsi") 18i64,
            lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    r == 0
}

/// Whether AMX bf16 kernels can run in this process (CPU, OS state, permission).
pub(crate) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpuid_amx_bf16() && request_permission())
}

/// `prefetcht0` of the 16 rows of a tile at `base`, `stride` bytes apart.
#[inline(always)]
fn prefetch_rows(base: *const u8, stride: isize) {
    for r in 0..16 {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe {
            core::arch::asm!("prefetcht0 [{}]", in(reg) base.wrapping_offset(r * stride),
                options(nostack, readonly, preserves_flags))
        };
    }
}

/// One block of 32 rows and `nb` columns of C: `C[m0.., n0..] (+)= sum_i
/// A_i * B_i` over the whole batch, k in steps of 32. `load_c`: start from C
/// (beta = 1, alpha = 1), else from zero. Writes the block to `out` with
/// column stride `ldo` (f32).
///
/// # Safety
/// AMX available, [`config`]`(nb)` loaded on this thread; m0+32, n0+nb
/// and k within the planned shape; A_i VNNI with pair-row stride `lda2`
/// (bf16 elements), B_i column-major with `ldb`; `out` valid for the block.
#[allow(clippy::too_many_arguments)]
#[inline(never)]
pub(crate) unsafe fn block<B: BatchSrc<bf16>>(
    src: &B,
    count: usize,
    k: usize,
    lda2: usize,
    ldb: usize,
    m0: usize,
    n0: usize,
    nb: usize,
    load_c: bool,
    out: *mut f32,
    ldo: usize,
) {
    let sc = (ldo * 4) as isize;
    // The lower tiles' first column: 16, or 0 when they repeat the upper.
    let lo = if nb > 16 { 16 } else { 0 };
    let c_ptr = |j: usize, r: usize| out.add(j * ldo + r);
    if load_c {
        core::arch::asm!(
            "tileloadd tmm0, [{c00} + {s}*1]",
            "tileloadd tmm1, [{c01} + {s}*1]",
            "tileloadd tmm2, [{c10} + {s}*1]",
            "tileloadd tmm3, [{c11} + {s}*1]",
            c00 = in(reg) c_ptr(0, 0), c01 = in(reg) c_ptr(0, 16),
            c10 = in(reg) c_ptr(lo, 0), c11 = in(reg) c_ptr(lo, 16), s = in(reg) sc,
            options(nostack, readonly),
        );
    } else {
        core::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
    }
    let sa = (lda2 * 2 * 2) as isize; // bytes between k-pair rows of A
    let sb = (ldb * 2) as isize; // bytes between columns of B
    for i in 0..count {
        let a = src.a(i).add(2 * m0);
        let b = src.b(i).add(n0 * ldb);
        // The next pair's tiles at the same k go to L1 while this step
        // computes (the last pair re-touches its own: harmless).
        let nxt = if i + 1 < count { i + 1 } else { i };
        let pa = src.a(nxt).add(2 * m0) as *const u8;
        let pb = src.b(nxt).add(n0 * ldb) as *const u8;
        let mut p = 0;
        while p < k {
            core::arch::asm!(
                "tileloadd tmm4, [{b0} + {sb}*1]",
                "tileloadd tmm6, [{a0} + {sa}*1]",
                "tileloadd tmm5, [{b1} + {sb}*1]",
                "tileloadd tmm7, [{a1} + {sa}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                b0 = in(reg) b.add(p), b1 = in(reg) b.add(lo * ldb + p), sb = in(reg) sb,
                a0 = in(reg) a.add(p * lda2), a1 = in(reg) a.add(p * lda2 + 32), sa = in(reg) sa,
                options(nostack, readonly),
            );
            // 16 lines of one next tile after each tdpbf16ps: spread out
            // like this they gain 40-50%; issued all at once before the
            // loads they cost 17% (probes, same process).
            let (na, nb) = (pa.wrapping_add(2 * p * lda2), pb.wrapping_add(2 * p));
            prefetch_rows(na, sa);
            core::arch::asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem));
            prefetch_rows(na.wrapping_add(64), sa);
            core::arch::asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem));
            prefetch_rows(nb, sb);
            core::arch::asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem));
            prefetch_rows(nb.wrapping_offset(16 * sb), sb);
            p += 32;
        }
    }
    core::arch::asm!(
        "tilestored [{c00} + {s}*1], tmm0",
        "tilestored [{c01} + {s}*1], tmm1",
        c00 = in(reg) c_ptr(0, 0), c01 = in(reg) c_ptr(0, 16), s = in(reg) sc,
        options(nostack),
    );
    if nb > 16 {
        core::arch::asm!(
            "tilestored [{c10} + {s}*1], tmm2",
            "tilestored [{c11} + {s}*1], tmm3",
            c10 = in(reg) c_ptr(16, 0), c11 = in(reg) c_ptr(16, 16), s = in(reg) sc,
            options(nostack),
        );
    }
}
