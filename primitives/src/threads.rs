//! The pinned thread pool the loop nests run on.
//!
//! One rayon pool per process, one thread per core of the process's affinity
//! mask (so ranks bound by `mpirun` keep to their cores), each thread pinned
//! to its core with `core_affinity`. `BRGEMM_NUM_THREADS` sets the count.
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

impl Pool {
    /// A pool of `threads` workers pinned round-robin to the cores this
    /// process may run on.
    pub fn new(threads: usize) -> Result<Pool> {
        if threads == 0 {
            return Err(shape("threads", 0, "need at least one thread"));
        }
        // get_core_ids reads the affinity mask (sched_getaffinity on Linux).
        let cores = core_affinity::get_core_ids().unwrap_or_default();
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
                Err(_) => core_affinity::get_core_ids()
                    .map(|c| c.len())
                    .unwrap_or(1)
                    .max(1),
            };
            Pool::new(n).expect("thread pool")
        })
    }

    /// Number of threads.
    pub fn threads(&self) -> usize {
        self.threads
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
