//! AVX512-BF16 microkernels (`vdpbf16ps`): bf16 pairs in, f32 accumulators.
//!
//! ```text
//!   one zmm of A = 16 rows x one k-pair (VNNI), one broadcast = B[p..p+2, j]
//!
//!            b0(pair) b1 ... b(NR-1)         acc[j][v] += A_pairs[v] . bcast(B pair j)
//!   A0 zmm  [c0 ][c2 ] ...                   (vdpbf16ps: 2 products per lane)
//!   A1 zmm  [c1 ][c3 ] ...                   MV <= 2, NR <= 12: 24 acc + 2 A + 1 B
//! ```
//!
//! The main tile is 2 x 12 unless the plan gives another: the CPU policy's
//! `avx512bf16_tile` (4 x 4 on Zen 4, for C blocks of whole 64-row columns:
//! each k-pair step then reads whole 256-byte rows of packed A, and the
//! tile stores whole columns; docs/tuning-notes.md).
//!
//! Measured on Sapphire Rapids: `vdpbf16ps` issues once per two cycles (an
//! asm probe with 12 chains: ~70 GFLOP/s, about the fp32 FMA rate), and the
//! kernel reaches 57-68 GFLOP/s, 85-95% of that; there it is the fallback
//! for shapes AMX cannot take, and halves the memory traffic of fp32, not
//! its compute time. On Zen 5, which has no AMX, it issues twice as often:
//! the FC passes run at 1.7-1.9x the f32 kernel (`bench -- fc`).
//!
//! With [`Prefetch::NextPair`] each k-pair step also asks for the lines of
//! A_{i+1} it will load at the same step (one line per vector, prefetcht0),
//! as the f32 kernel does. The tiles walk C column-block by column-block,
//! each over the whole batch, so the first tile of a call streams all of A
//! at several times the call's average rate, and the L2 prefetchers alone
//! leave it waiting on memory. Measured on Zen 5 (FC passes, same process,
//! alternating): (64,4096,4096) fwd/bwd x1.96/x1.87 on one thread and
//! x1.72/x1.69 on two, (128,4096,4096) x1.40-1.50, (512,2048,2048)
//! x1.04-1.09; calls of 256 KiB or less (L2-resident A) x0.99-1.00.
//!
//! A call given the next call's first B (`Kernel::execute_raw_then`) also
//! asks for each next pair's B, one line per k-pair step, and on its last
//! pair for that one's: the 1x1 convolutions' input rows, which stream
//! from memory (Zen 4, minibatch 16, two threads, alternated in one
//! process: four-pair calls x1.12-1.16, two-pair x1.07-1.10; the bf16
//! ResNet-50 step 11.90 -> 12.11 images/s). Calls without it (3x3 layers,
//! whose rows come back from L2 for the taps: x0.98-1.00 with it) keep to A.
//!
//! Handles any shape: m tails by masked loads and stores (free on AVX-512),
//! n tails by smaller unrolled tiles, an odd k by a last half pair whose B
//! value is zero-extended (the VNNI pad of A is zero too), so nothing past
//! the end of B is read.

use crate::batch::BatchSrc;
use crate::blocking::RegisterTile;
use crate::desc::{Activation, Beta, Descriptor, Prefetch};
use core::arch::x86_64::*;
use half::bf16;

/// Per-call arguments.
pub(crate) struct Call<'a> {
    pub d: &'a Descriptor,
    pub count: usize,
    pub c: *mut f32,
    pub bias: *const f32,
    /// The next call's first B (null: none), walked by the last pair.
    pub next_b: *const bf16,
}

pub(crate) type TileFn<B> = unsafe fn(&Call<'_>, &B, usize, usize, usize);

/// Returns `p` through an empty `asm!` so LLVM keeps it a plain base
/// register (see the f32 tile: indexed FMA operands un-laminate).
#[inline(always)]
fn opaque(p: *const bf16) -> *const bf16 {
    let mut addr = p.addr();
    // SAFETY: empty template; pins the address in a register.
    unsafe {
        core::arch::asm!("/* {0} */", inout(reg) addr, options(pure, nomem, nostack, preserves_flags))
    };
    p.with_addr(addr)
}

/// # Safety
/// AVX-512F and AVX512-BF16 available; the tile's rows `m0..`, columns
/// `n0..n0+NR` inside the planned shape; pointers valid as for the f32 kernel.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile<
    B: BatchSrc<bf16>,
    const MV: usize,
    const NR: usize,
    const PF: bool,
    const PB: bool,
>(
    t: &Call<'_>,
    src: &B,
    m0: usize,
    n0: usize,
    last_rows: usize,
) {
    let d = t.d;
    let last: __mmask16 = (((1u32 << last_rows) - 1) & 0xffff) as u16;
    let mut masks = [0xffffu16; MV];
    masks[MV - 1] = last;
    let (lda2, ldb) = (2 * d.lda, d.ldb);
    let (kp, odd) = (d.k / 2, d.k % 2 == 1);
    // Constant-bound index loops, no closures and no branches inside the k
    // loop: LLVM unrolls them and keeps every accumulator in a register.
    let mut acc = [[_mm512_setzero_ps(); MV]; NR];
    for i in 0..t.count {
        let mut a = src.a(i).add(2 * m0);
        let mut b = src.b(i).add(n0 * ldb);
        // The last pair prefetches itself: harmless, and no address past
        // the batch is formed.
        let mut pa = src.a(if i + 1 < t.count { i + 1 } else { i }).add(2 * m0);
        // With PB, the next pair's B too (the next call's first on the last
        // pair, where the caller named it): one line per k-pair step, column
        // by column of the tile, until all are asked for.
        let pb = match i + 1 < t.count {
            true => src.b(i + 1).add(n0 * ldb),
            false => t.next_b.wrapping_add(n0 * ldb),
        };
        let col_lines = (4 * kp).div_ceil(64);
        let (mut col, mut line) = (0usize, 0usize);
        for _ in 0..kp {
            if PF {
                for v in 0..MV {
                    _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(32 * v) as *const i8);
                }
                pa = pa.wrapping_add(lda2);
            }
            if PB && col < NR {
                _mm_prefetch::<_MM_HINT_T0>(pb.wrapping_add(col * ldb + 32 * line) as *const i8);
                line += 1;
                if line == col_lines {
                    (col, line) = (col + 1, 0);
                }
            }
            let mut av = [_mm512_setzero_si512(); MV];
            for v in 0..MV {
                av[v] = _mm512_maskz_loadu_epi32(masks[v], a.add(32 * v) as *const i32);
            }
            let mut bp = b;
            for j in 0..NR {
                let bj: __m512bh = core::mem::transmute(_mm512_set1_epi32(
                    core::ptr::read_unaligned(bp as *const i32),
                ));
                for v in 0..MV {
                    acc[j][v] = _mm512_dpbf16_ps(
                        acc[j][v],
                        core::mem::transmute::<__m512i, __m512bh>(av[v]),
                        bj,
                    );
                }
                bp = opaque(bp.wrapping_add(ldb));
            }
            a = a.add(lda2);
            b = b.add(2);
        }
        if odd {
            // Last half pair: B[k-1, j] only (zero-extended); A's pad is zero.
            let mut av = [_mm512_setzero_si512(); MV];
            for v in 0..MV {
                av[v] = _mm512_maskz_loadu_epi32(masks[v], a.add(32 * v) as *const i32);
            }
            for j in 0..NR {
                let bj: __m512bh =
                    core::mem::transmute(_mm512_set1_epi32((*b.add(j * ldb)).to_bits() as i32));
                for v in 0..MV {
                    acc[j][v] = _mm512_dpbf16_ps(
                        acc[j][v],
                        core::mem::transmute::<__m512i, __m512bh>(av[v]),
                        bj,
                    );
                }
            }
        }
    }
    // Epilogue in small passes (each unrolls): alpha, beta, bias, ReLU; other
    // activations on the stored, L1-hot tile.
    let alpha = _mm512_set1_ps(d.alpha);
    for j in 0..NR {
        for v in 0..MV {
            acc[j][v] = _mm512_mul_ps(acc[j][v], alpha);
        }
    }
    if d.beta == Beta::One {
        for j in 0..NR {
            let cp = t.c.add((n0 + j) * d.ldc + m0);
            for v in 0..MV {
                acc[j][v] =
                    _mm512_add_ps(acc[j][v], _mm512_maskz_loadu_ps(masks[v], cp.add(16 * v)));
            }
        }
    }
    if !t.bias.is_null() {
        for v in 0..MV {
            let bv = _mm512_maskz_loadu_ps(masks[v], t.bias.add(m0 + 16 * v));
            for j in 0..NR {
                acc[j][v] = _mm512_add_ps(acc[j][v], bv);
            }
        }
    }
    let act = d.epilogue.activation;
    if act == Activation::Relu {
        for j in 0..NR {
            for v in 0..MV {
                // vmaxps returns its second operand when either is NaN.
                acc[j][v] = _mm512_max_ps(_mm512_setzero_ps(), acc[j][v]);
            }
        }
    }
    for j in 0..NR {
        let cp = t.c.add((n0 + j) * d.ldc + m0);
        for v in 0..MV {
            _mm512_mask_storeu_ps(cp.add(16 * v), masks[v], acc[j][v]);
        }
    }
    if !matches!(act, Activation::Identity | Activation::Relu) {
        let rows = (MV - 1) * 16 + last_rows;
        for j in 0..NR {
            let col = std::slice::from_raw_parts_mut(t.c.add((n0 + j) * d.ldc + m0), rows);
            for x in col {
                *x = act.apply(*x);
            }
        }
    }
}

macro_rules! pick {
    ($B:ty, $mv:expr, $nr:expr, $pf:expr, $pb:expr; $($m:literal => [$($n:literal)*]),*) => {
        match ($mv, $nr, $pf, $pb) {
            $($(
                ($m, $n, false, _) => Some(tile::<$B, $m, $n, false, false> as TileFn<$B>),
                ($m, $n, true, false) => Some(tile::<$B, $m, $n, true, false> as TileFn<$B>),
                ($m, $n, true, true) => Some(tile::<$B, $m, $n, true, true> as TileFn<$B>),
            )*)*
            _ => None,
        }
    };
}

/// The `(mv, nr)` tile for batch form `B` (mv in 1..=2 with nr in 1..=12,
/// mv in 3..=4 with nr in 1..=4),
/// prefetching the next pair's A when `pf`.
pub(crate) fn tile_fn<B: BatchSrc<bf16>>(
    mv: usize,
    nr: usize,
    pf: bool,
    pb: bool,
) -> Option<TileFn<B>> {
    pick!(B, mv, nr, pf, pb;
        1 => [1 2 3 4 5 6 7 8 9 10 11 12],
        2 => [1 2 3 4 5 6 7 8 9 10 11 12],
        3 => [1 2 3 4],
        4 => [1 2 3 4])
}

/// The tile [`run`] covers C with unless told otherwise: 32 rows by 12
/// columns.
pub(crate) const DEFAULT_TILE: RegisterTile = RegisterTile { mv: 2, nr: 12 };

/// Whether [`run`] takes `t` as its main tile: it is instantiated (and so
/// is every smaller edge tile of it, the lists above being 1..=N).
pub(crate) fn has_tile(t: RegisterTile) -> bool {
    tile_fn::<crate::batch::StrideSrc<bf16>>(t.mv, t.nr, false, false).is_some()
}

/// Covers C with `main` tiles ([`has_tile`]) and their edges.
///
/// # Safety
/// As [`tile`], for the whole of C.
pub(crate) unsafe fn run<B: BatchSrc<bf16>>(t: &Call<'_>, src: &B, main: RegisterTile) {
    let (m, n) = (t.d.m, t.d.n);
    let (rows_max, nr_max) = (16 * main.mv, main.nr);
    let pf = t.d.prefetch == Prefetch::NextPair;
    // B of each next pair only where the caller named the next call's (a
    // pass whose rows stream: see the module doc).
    let pb = pf && !t.next_b.is_null();
    let mut n0 = 0;
    while n0 < n {
        let nr = nr_max.min(n - n0);
        let mut m0 = 0;
        while m0 < m {
            let rows = (m - m0).min(rows_max);
            let mv = rows.div_ceil(16);
            let last_rows = rows - (mv - 1) * 16;
            let f = tile_fn::<B>(mv, nr, pf, pb).expect("a main tile's edges are all instantiated");
            f(t, src, m0, n0, last_rows);
            m0 += rows_max;
        }
        n0 += nr_max;
    }
}

/// Whether this CPU runs the kernel.
pub(crate) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}
