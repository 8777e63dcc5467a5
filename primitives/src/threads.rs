//! The pinned thread pool the loop nests run on.
//!
//! One rayon pool per process, one thread per core of the process's affinity
//! mask (so ranks bound by `mpirun` keep to their cores), each thread pinned
//! to its core with `core_affinity`. `BRGEMM_NUM_THREADS` sets the count.
//! Ranks of one node that share a mask (`mpirun --bind-to none`) split it by
//! their local rank (`OMPI_COMM_WORLD_LOCAL_RANK`/`_SIZE`), so two ranks never
//! pin threads to the same core while there are enough cores.
//! Other pools (say, with fewer threads for a scaling test) can be built with
//! [`Pool::new`].

use crate::error::{shape, Result};
use std::sync::OnceLock;

/// A pinned pool of worker threads.
pub struct Pool {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .finish()
    }
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// The cores this process may use: its affinity mask, or this local rank's
/// share of it when several MPI ranks of the node share one mask.
pub fn process_cores() -> Vec<core_affinity::CoreId> {
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    split_for_local_rank(
        cores,
        env_usize("OMPI_COMM_WORLD_LOCAL_RANK"),
        env_usize("OMPI_COMM_WORLD_LOCAL_SIZE"),
    )
}

fn split_for_local_rank<T>(cores: Vec<T>, rank: Option<usize>, size: Option<usize>) -> Vec<T> {
    match (rank, size) {
        // A bound rank sees fewer cores than there are local ranks (usually
        // one): its mask is already its own.
        (Some(r), Some(n)) if n > 1 && r < n && cores.len() >= n => {
            let (lo, hi) = (r * cores.len() / n, (r + 1) * cores.len() / n);
            cores.into_iter().skip(lo).take(hi - lo).collect()
        }
        _ => cores,
    }
}

impl Pool {
    /// A pool of `threads` workers pinned round-robin to the cores this
    /// process may run on.
    pub fn new(threads: usize) -> Result<Pool> {
        if threads == 0 {
            return Err(shape("threads", 0, "need at least one thread"));
        }
        let cores = process_cores();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("brgemm-{i}"))
            .start_handler(move |i| {
                if !cores.is_empty() {
                    core_affinity::set_for_current(cores[i % cores.len()]);
                }
            })
            .build()
            .map_err(|e| shape("threads", threads, e.to_string()))?;
        Ok(Pool { pool, threads })
    }

    /// The process-wide pool: `BRGEMM_NUM_THREADS` threads, else one per core
    /// of the affinity mask.
    ///
    /// # Panics
    /// If `BRGEMM_NUM_THREADS` is set but is not a positive integer.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = match std::env::var("BRGEMM_NUM_THREADS") {
                Ok(s) => s
                    .trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n > 0)
                    .unwrap_or_else(|| {
                        panic!("BRGEMM_NUM_THREADS={s:?}: expected a positive integer")
                    }),
                Err(_) => process_cores().len().max(1),
            };
            Pool::new(n).expect("thread pool")
        })
    }

    /// Number of threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The contiguous share of `0..n` that thread `t` runs in
    /// [`Pool::for_each`] and [`Pool::for_ranges`] (shares differ by at most
    /// one; the same `t` always gets the same share).
    pub fn share(&self, t: usize, n: usize) -> std::ops::Range<usize> {
        (t * n / self.threads)..((t + 1) * n / self.threads)
    }

    /// Runs `f(range)` on every thread for its share of `0..n` and waits:
    /// the static split the element-wise steps use.
    pub fn for_ranges<F: Fn(std::ops::Range<usize>) + Sync>(&self, n: usize, f: F) {
        self.broadcast(|t| f(self.share(t, n)))
    }

    /// Runs `f(offset, part)` on every thread for its contiguous share of
    /// `out` (`part` starts at element `offset`) and waits.
    pub fn for_slices<T: Send, F: Fn(usize, &mut [T]) + Sync>(&self, out: &mut [T], f: F) {
        let (base, n) = (out.as_mut_ptr() as usize, out.len());
        self.for_ranges(n, |r| {
            // SAFETY: the shares of `0..n` are disjoint, so each thread
            // borrows its own part of `out`, which outlives the call.
            let part =
                unsafe { std::slice::from_raw_parts_mut((base as *mut T).add(r.start), r.len()) };
            f(r.start, part)
        })
    }

    /// Runs `f(i)` for every `i` in `0..n`, each thread its contiguous share.
    pub fn for_each<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        self.for_ranges(n, |r| r.for_each(&f))
    }

    /// Runs `f(thread_index)` once on every thread of the pool and waits.
    pub fn broadcast<F: Fn(usize) + Sync>(&self, f: F) {
        if self.threads == 1 {
            // No hand-off for a single thread: run on the caller.
            return f(0);
        }
        self.pool.broadcast(|ctx| f(ctx.index()));
    }
}

#[cfg(test)]
mod tests {
    use super::split_for_local_rank;

    #[test]
    fn shared_masks_are_split_by_local_rank_and_bound_ones_kept() {
        let all: Vec<usize> = (0..8).collect();
        assert_eq!(
            split_for_local_rank(all.clone(), Some(1), Some(2)),
            vec![4, 5, 6, 7]
        );
        assert_eq!(
            split_for_local_rank(all.clone(), Some(2), Some(3)),
            vec![5, 6, 7]
        );
        assert_eq!(split_for_local_rank(vec![3], Some(1), Some(2)), vec![3]);
        assert_eq!(split_for_local_rank(all.clone(), None, None), all);
        // More ranks than cores: nothing to split fairly, keep the mask.
        assert_eq!(
            split_for_local_rank(vec![0, 1], Some(2), Some(3)),
            vec![0, 1]
        );
    }
}
