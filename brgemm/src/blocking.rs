//! Choice of the register tile for a shape, from a small throughput model.
//!
//! Per k step a tile of `MV` vectors by `NR` columns issues `MV*NR` FMAs,
//! `MV` vector loads and `NR` broadcast loads. With two FMA and two load ports
//! and a 4-cycle FMA latency (so at least 8 independent accumulators are needed
//! to keep both ports busy) one k step costs
//!
//! ```text
//!   cycles(MV, NR) = max(MV*NR / 2, (MV + NR) / 2, 4)
//! ```
//!
//! The model sums this over the main tile and the edge tiles that cover C and
//! adds a fixed cost per tile (set-up and the C load/store). Ties go to the
//! larger NR: each A vector is then reused across more columns, which halves
//! the A traffic from L2 that dominates once the batch does not fit in L1.

/// A register tile: `mv` vectors of rows by `nr` columns of C.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegisterTile {
    /// Vectors of rows (rows = `mv` x lanes).
    pub mv: usize,
    /// Columns.
    pub nr: usize,
}

fn step_cycles(mv: usize, nr: usize) -> f64 {
    let fma = (mv * nr) as f64 / 2.0;
    let loads = (mv + nr) as f64 / 2.0;
    fma.max(loads).max(4.0)
}

/// Modelled cycles for one batch element of an `m x n x k` problem.
pub(crate) fn model_cycles(m: usize, n: usize, k: usize, lanes: usize, t: RegisterTile) -> f64 {
    const TILE_OVERHEAD: f64 = 12.0;
    let mb = t.mv * lanes;
    let (m_full, m_rem) = (m / mb, m % mb);
    let mv_t = m_rem.div_ceil(lanes);
    let (n_full, n_rem) = (n / t.nr, n % t.nr);
    let col = |nr: usize| {
        let mut c = m_full as f64 * (k as f64 * step_cycles(t.mv, nr) + TILE_OVERHEAD);
        if m_rem > 0 {
            c += k as f64 * step_cycles(mv_t, nr) + TILE_OVERHEAD;
        }
        c
    };
    let mut c = n_full as f64 * col(t.nr);
    if n_rem > 0 {
        c += col(n_rem);
    }
    c
}

/// The best tile of `grid` (`grid[mv-1]` = largest NR for that MV) for the shape.
pub(crate) fn choose(m: usize, n: usize, k: usize, lanes: usize, grid: &[usize]) -> RegisterTile {
    let mut best = RegisterTile { mv: 1, nr: 1 };
    let mut best_c = f64::INFINITY;
    for (i, &nr_max) in grid.iter().enumerate() {
        let mv = i + 1;
        // A tile taller than m only adds masked lanes.
        if mv > 1 && (mv - 1) * lanes >= m {
            break;
        }
        for nr in 1..=nr_max.min(n) {
            let t = RegisterTile { mv, nr };
            let c = model_cycles(m, n, k, lanes, t);
            let better = c < best_c * (1.0 - 1e-9)
                || (c <= best_c * (1.0 + 1e-9)
                    && (nr > best.nr || (nr == best.nr && mv > best.mv)));
            if better {
                best = t;
                best_c = c;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn square_64_uses_a_full_fma_bound_tile() {
        let t = choose(64, 64, 64, 16, &[16, 14, 9, 6]);
        let ideal = 64.0 * 64.0 * 64.0 / 32.0;
        assert!(model_cycles(64, 64, 64, 16, t) < ideal * 1.1, "{t:?}");
    }

    #[test]
    fn tiny_m_never_picks_empty_vectors() {
        let t = choose(5, 7, 3, 16, &[16, 14, 9, 6]);
        assert_eq!(t.mv, 1);
        assert!(t.nr <= 7);
    }
}
