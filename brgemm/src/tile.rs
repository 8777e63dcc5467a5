//! The generic register-tile microkernel and the loop over tiles of C.
//!
//! A tile is `MV` vectors of rows by `NR` columns of C. Its accumulators stay in
//! registers for the whole batch and the whole k loop; C is read (beta = 1) and
//! written once, after the last A_i * B_i, with the epilogue applied in between.
//!
//! ```text
//!            B_i: NR columns, one broadcast each per k step
//!            b0  b1  b2 ... b(NR-1)
//!  A_i col  +---+---+---+---+
//!   a[0]    |c00|c01|c02|...|   each cell = one vector accumulator
//!   a[1]    |c10|c11|c12|...|   acc[j][v] += a[v] * bcast(B[p][j])
//!   ...     |   |   |   |   |
//!   a[MV-1] |   |   |   |   |   last vector masked for m tails
//!           +---+---+---+---+
//! ```

use crate::batch::BatchSrc;
use crate::desc::Activation;
use crate::simd::SimdF32;

/// How many pairs ahead the prefetching tiles also bring B into L2.
///
/// Prefetching only the next pair into L1 keeps about as many lines in
/// flight as L1 can track misses, which caps a stream from memory: FC
/// (16, 4096, 4096) backward-data, whose 1x16 tiles broadcast 64 MiB of W
/// from DRAM, ran at 55-58% of peak. With B_{i+4} also requested into L2
/// (where no pair that far exists, nothing): 1 thread 57.6 -> 74.2%, 2
/// threads 55.2 -> 69.1% (Zen 4, builds alternated, 2 rounds; 4 rounds of
/// the first version: 56.2 -> 71.7 and 58.8 -> 71.3); other FC and LSTM
/// lines unchanged within noise.
const FAR: usize = 4;

/// Per-call arguments shared by all tiles of one kernel call.
pub(crate) struct TileCall {
    pub k: usize,
    pub lda: usize,
    /// Elements between columns of B_i (ldb column-major, 1 row-major).
    pub b_col: usize,
    /// Elements between k steps of B_i (1 column-major, ldb row-major).
    pub b_step: usize,
    pub ldc: usize,
    pub count: usize,
    pub alpha: f32,
    pub beta_one: bool,
    pub act: Activation,
    /// Null when the descriptor has no bias.
    pub bias: *const f32,
    pub c: *mut f32,
    /// A region to bring into the cache during this call (the next call's
    /// A), spread over the k steps of the prefetching tile instances: the
    /// next cache line to ask for and one past the last (line indices from
    /// `ahead`; empty when there is none). The `then` tile instances
    /// ([`crate::Kernel::execute_raw_then`]) have no region and read the
    /// next call's first B here instead.
    pub ahead: *const f32,
    pub ahead_next: core::cell::Cell<usize>,
    pub ahead_end: usize,
    /// Lines of the region per (tile, pair).
    pub ahead_per_pair: usize,
}

/// Returns `p` unchanged through an empty `asm!`, so LLVM cannot see how it
/// was computed and has to use it as a plain base register. No instruction
/// is emitted.
#[inline(always)]
fn opaque(p: *const f32) -> *const f32 {
    // Miri cannot run `asm!`; the pointer is the same without it.
    #[cfg(all(any(target_arch = "x86_64", target_arch = "aarch64"), not(miri)))]
    {
        let mut addr = p.addr();
        // SAFETY: the template is empty; it only pins the address in a
        // register. The address goes through as an integer and comes back
        // with `p`'s provenance.
        unsafe {
            core::arch::asm!("/* {0} */", inout(reg) addr, options(pure, nomem, nostack, preserves_flags))
        };
        p.with_addr(addr)
    }
    #[cfg(any(not(any(target_arch = "x86_64", target_arch = "aarch64")), miri))]
    {
        p
    }
}

/// One specialised tile: `(call, batch, m0, n0, rows_in_last_vector)`.
pub(crate) type TileFn<B> = unsafe fn(&TileCall, &B, usize, usize, usize);

/// Computes the C tile at rows `m0..`, columns `n0..n0+NR`.
///
/// # Safety
/// The ISA of `S` is available; every A_i, B_i, C and bias address the tile
/// touches is valid (the plan checked the shapes, the caller the pointers).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
pub(crate) unsafe fn tile<
    S,
    B,
    const MV: usize,
    const NR: usize,
    const MASKED: bool,
    const PF: bool,
>(
    t: &TileCall,
    src: &B,
    m0: usize,
    n0: usize,
    last_rows: usize,
) where
    S: SimdF32,
    B: BatchSrc<f32>,
{
    let l = S::LANES;
    let mask = S::mask(last_rows);
    let (lda, bcol, bstep) = (t.lda, t.b_col, t.b_step);
    let boff = n0 * bcol;
    // Constant-bound index loops (no iterators, no references into `acc`)
    // let LLVM unroll fully and keep every accumulator in a register.
    let mut acc = [[S::zero(); MV]; NR];
    for i in 0..t.count {
        let mut a = src.a(i).add(m0);
        let mut b = src.b(i).add(boff);
        // With PF, prefetch the next pair while this one computes: per k
        // step one line of A_{i+1} per vector at the same column, and one
        // 16-float line of B_{i+1}, cycling through its NR columns. Measured
        // (AVX-512, same process, alternating): +5-35% when A and B stream
        // from L3, -5-19% when they sit in L2 (the extra loads compete with
        // the kernel's own), so it is a plan-time choice (Descriptor::prefetch).
        let nxt = if i + 1 < t.count { i + 1 } else { i };
        // This tile's share of the ahead region, one line per k step.
        let (mut ah, ah_end) = if PF {
            let a0 = t.ahead_next.get();
            let a1 = (a0 + t.ahead_per_pair).min(t.ahead_end);
            t.ahead_next.set(a1);
            (a0, a1)
        } else {
            (0, 0)
        };
        let mut pa = src.a(nxt).add(m0);
        let pb = src.b(nxt).add(boff);
        // And B_{i+FAR} into L2 (see FAR).
        let far = (i + FAR < t.count).then(|| src.b(i + FAR).add(boff));
        for p in 0..t.k {
            if PF {
                for v in 0..MV {
                    S::prefetch(pa.wrapping_add(v * l));
                }
                pa = pa.wrapping_add(lda);
                let (j, row) = (p % NR, (p / NR) * 16);
                if row < t.k {
                    S::prefetch(pb.wrapping_add(j * bcol + row * bstep));
                    if let Some(f) = far {
                        S::prefetch_l2(f.wrapping_add(j * bcol + row * bstep));
                    }
                }
                if ah < ah_end {
                    S::prefetch(t.ahead.wrapping_add(ah * 16));
                    ah += 1;
                }
            }
            let mut av = [S::zero(); MV];
            for v in 0..MV {
                av[v] = if MASKED && v + 1 == MV {
                    S::load_m(a.add(v * l), mask)
                } else {
                    S::load(a.add(v * l))
                };
            }
            // One pointer walks the NR columns of B, so each broadcast is a
            // plain `[reg]` operand. LLVM otherwise forms `[base + index]`,
            // which Intel cores un-laminate into two uops when it is the memory
            // operand of a 3-operand FMA: 16 extra uops per k step on a 1x16
            // tile, enough to make rename (6 wide) the bottleneck.
            let mut bp = b;
            for j in 0..NR {
                let bj = S::splat(*bp);
                for v in 0..MV {
                    acc[j][v] = S::fma(av[v], bj, acc[j][v]);
                }
                bp = opaque(bp.wrapping_add(bcol));
            }
            // After the last k step these point past the operands (never
            // read): wrapping, so the arithmetic itself stays defined.
            a = a.wrapping_add(lda);
            b = b.wrapping_add(bstep);
        }
    }
    store_tile::<S, MV, NR, MASKED>(t, acc, m0, n0, mask, last_rows);
}

/// The epilogue: alpha, beta, bias, activation, one store per vector.
///
/// Written as separate passes with tiny bodies: each unrolls completely, so
/// `acc` never needs an address and stays in registers (one pass with all the
/// branches inside was not unrolled, and LLVM then kept `acc` on the stack
/// and stored it on every FMA of the hot loop).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
pub(crate) unsafe fn store_tile<
    S: SimdF32,
    const MV: usize,
    const NR: usize,
    const MASKED: bool,
>(
    t: &TileCall,
    mut acc: [[S::V; MV]; NR],
    m0: usize,
    n0: usize,
    mask: S::M,
    last_rows: usize,
) {
    let l = S::LANES;
    let zero = S::zero();
    let ld = |p: *const f32, v: usize| {
        if MASKED && v + 1 == MV {
            S::load_m(p, mask)
        } else {
            S::load(p)
        }
    };
    let cp = |j: usize, v: usize| t.c.add((n0 + j) * t.ldc + m0 + v * l);
    if t.alpha != 1.0 {
        let alpha = S::splat(t.alpha);
        for j in 0..NR {
            for v in 0..MV {
                acc[j][v] = S::fma(acc[j][v], alpha, zero);
            }
        }
    }
    if t.beta_one {
        for j in 0..NR {
            for v in 0..MV {
                acc[j][v] = S::add(acc[j][v], ld(cp(j, v), v));
            }
        }
    }
    if !t.bias.is_null() {
        let mut bias = [zero; MV];
        for v in 0..MV {
            bias[v] = ld(t.bias.add(m0 + v * l), v);
        }
        for j in 0..NR {
            for v in 0..MV {
                acc[j][v] = S::add(acc[j][v], bias[v]);
            }
        }
    }
    if t.act == Activation::Relu {
        for j in 0..NR {
            for v in 0..MV {
                acc[j][v] = S::relu(acc[j][v]);
            }
        }
    }
    for j in 0..NR {
        for v in 0..MV {
            if MASKED && v + 1 == MV {
                S::store_m(cp(j, v), acc[j][v], mask)
            } else {
                S::store(cp(j, v), acc[j][v])
            }
        }
    }
    if !t.act.in_registers() {
        let rows = if MASKED {
            (MV - 1) * l + last_rows
        } else {
            MV * l
        };
        apply_in_place(t, m0, n0, rows, NR);
    }
}

/// Applies a non-register activation to a just-stored, L1-hot block of C.
#[inline(never)]
unsafe fn apply_in_place(t: &TileCall, m0: usize, n0: usize, rows: usize, cols: usize) {
    for j in 0..cols {
        let col = std::slice::from_raw_parts_mut(t.c.add((n0 + j) * t.ldc + m0), rows);
        for x in col {
            *x = t.act.apply(*x);
        }
    }
}

/// The tiles that cover C for one plan: a main tile and up to three edge tiles.
pub(crate) struct TileSet<B> {
    pub lanes: usize,
    pub mv: usize,
    pub nr: usize,
    pub m_full: usize,
    pub n_full: usize,
    /// Rows in the last vector of an m-edge tile.
    pub m_tail_rows: usize,
    pub main: Option<TileFn<B>>,
    pub m_tail: Option<TileFn<B>>,
    pub n_tail: Option<TileFn<B>>,
    pub mn_tail: Option<TileFn<B>>,
}

impl<B> TileSet<B> {
    /// Tiles per call.
    pub(crate) fn count(&self) -> usize {
        let rows = self.m_full + usize::from(self.m_tail.is_some() || self.mn_tail.is_some());
        let cols = self.n_full + usize::from(self.n_tail.is_some() || self.mn_tail.is_some());
        rows * cols
    }

    /// Covers C: columns in steps of NR (outer), rows in steps of MV vectors.
    /// The B panel of one column step is reused from L1 across the row steps.
    ///
    /// # Safety
    /// As for [`tile`], for the whole of C.
    #[inline]
    pub(crate) unsafe fn run(&self, t: &TileCall, src: &B) {
        let mb = self.mv * self.lanes;
        let cols = |n0: usize, full: Option<TileFn<B>>, tail: Option<TileFn<B>>| {
            if let Some(f) = full {
                for i in 0..self.m_full {
                    f(t, src, i * mb, n0, self.lanes);
                }
            }
            if let Some(f) = tail {
                f(t, src, self.m_full * mb, n0, self.m_tail_rows);
            }
        };
        for jb in 0..self.n_full {
            cols(jb * self.nr, self.main, self.m_tail);
        }
        if self.n_tail.is_some() || self.mn_tail.is_some() {
            cols(self.n_full * self.nr, self.n_tail, self.mn_tail);
        }
    }
}
