//! The pinned thread pool the loop nests run on.
//!
//! One pool per process, one thread per core of the process's affinity mask
//! (so ranks bound by `mpirun` keep to their cores). The thread that calls
//! into the pool is thread 0 of every parallel region and runs its share
//! itself; the other threads are rayon workers, each pinned to its own
//! core with `core_affinity` (worker i to the (i+1)-th core of the mask,
//! leaving the first to the caller). `BRGEMM_NUM_THREADS` sets the count.
//! Ranks of one node that share a mask (`mpirun --bind-to none`) split it by
//! their local rank (`OMPI_COMM_WORLD_LOCAL_RANK`/`_SIZE`), so two ranks never
//! pin threads to the same core while there are enough cores.
//! Other pools (say, with fewer threads for a scaling test) can be built with
//! [`Pool::new`].
//!
//! Why the caller works: with rayon's own `broadcast` it slept on a latch
//! while the workers ran every share, and took ~9 us to wake after the
//! last one finished: an empty region cost 11 us, and a 1 MFLOP FC
//! forward took 21 us on two threads against 4 us on one. Now the caller
//! runs share 0 and, done first, spins up to 50 us for the workers: an
//! empty region costs 0.5-1.3 us while the workers are awake (~30 us when
//! they have gone to sleep, which the caller spends on its own share).
//! Measured on two threads, FC forward alternating in one process: 16.8
//! MFLOP 1.22x -> 1.91x over one thread, 33.6 MFLOP 1.46x -> 1.95x; the
//! bench layers (FC, conv, LSTM) 1.00-1.03x faster than before.
//!
//! Small work still runs on the calling thread alone: each layer asks
//! [`Pool::for_work`] for the pool to run a pass on, which is the caller
//! below [`MIN_PARALLEL_FLOPS`] (FC forward, two threads against one,
//! every region handed to the pool: 1 MFLOP 0.90x, 2.1 MFLOP 1.22x, 8.4
//! MFLOP 1.68x), and
//! [`Pool::for_slices`] runs element-wise steps of fewer than
//! [`MIN_PARALLEL_ELEMS`] elements on the caller. `BRGEMM_MIN_PARALLEL_FLOPS`
//! moves the first threshold for pools built afterwards (another machine,
//! another hand-off cost); [`Pool::always_parallel`] turns both off, as
//! the tests do to run the parallel paths on small shapes.

use crate::error::{shape, Result};
use brgemm::env::Setting;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// How long the caller, done with its share, spins for the workers before
/// it sleeps on the scope's latch.
const CALLER_SPIN: Duration = Duration::from_micros(50);

/// Floating-point operations below which [`Pool::for_work`] keeps a pass on
/// the calling thread (the default; see the module docs).
pub const MIN_PARALLEL_FLOPS: f64 = 4e6;

/// Elements below which [`Pool::for_slices`] runs on the calling thread
/// (ReLU forward, two threads against one, awake workers: 32 Ki elements
/// 1.00x, 64 Ki 1.19x, 128 Ki 1.81x; a sleeping worker costs ~30 us more).
pub const MIN_PARALLEL_ELEMS: usize = 1 << 16;

/// A pinned pool of worker threads.
pub struct Pool {
    /// None for one thread: everything runs on the caller.
    pool: Option<rayon::ThreadPool>,
    threads: usize,
    min_flops: f64,
    min_elems: usize,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("threads", &self.threads)
            .field("min_flops", &self.min_flops)
            .field("min_elems", &self.min_elems)
            .finish()
    }
}

/// A variable of the MPI launcher's (mpirun sets them for each rank), not
/// a setting of ours ([`brgemm::env`]).
fn launcher_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// `name` parsed, when set; a set value that does not parse or fails `ok`
/// is an error naming the variable, its value and `expected` (a setting the
/// user asked for is never silently replaced by the default).
fn env_setting<T: std::str::FromStr>(
    setting: Setting,
    ok: fn(&T) -> bool,
    expected: &str,
) -> crate::Result<Option<T>> {
    parse_setting(setting.name(), setting.value(), ok, expected)
}

/// [`env_setting`] on the value `value` of the variable `name`.
fn parse_setting<T: std::str::FromStr>(
    name: &str,
    value: Option<String>,
    ok: fn(&T) -> bool,
    expected: &str,
) -> crate::Result<Option<T>> {
    let Some(s) = value else {
        return Ok(None);
    };
    match s.trim().parse::<T>().ok().filter(ok) {
        Some(v) => Ok(Some(v)),
        None => Err(crate::error::setting(
            name,
            format!("{s:?}"),
            format!("expected {expected}"),
        )),
    }
}

/// The cores this process may use: its affinity mask, or this local rank's
/// share of it when several MPI ranks of the node share one mask.
pub fn process_cores() -> Vec<core_affinity::CoreId> {
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    split_for_local_rank(
        cores,
        launcher_usize("OMPI_COMM_WORLD_LOCAL_RANK"),
        launcher_usize("OMPI_COMM_WORLD_LOCAL_SIZE"),
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
    /// process may run on. One thread means no workers: everything runs on
    /// the calling thread.
    ///
    /// # Errors
    /// `threads` is 0, `BRGEMM_MIN_PARALLEL_FLOPS` is set but is not a
    /// non-negative number, or `BRGEMM_DENORMALS` is set to something
    /// other than `flush` or `keep`.
    pub fn new(threads: usize) -> Result<Pool> {
        if threads == 0 {
            return Err(shape("threads", 0, "need at least one thread"));
        }
        env_setting(
            Setting::Denormals,
            |v: &String| v == "flush" || v == "keep",
            "flush or keep",
        )?;
        let min_flops = env_setting(
            Setting::MinParallelFlops,
            |v: &f64| *v >= 0.0,
            "a non-negative number",
        )?
        .unwrap_or(MIN_PARALLEL_FLOPS);
        let pool = (threads > 1).then(|| Pool::workers(threads)).transpose()?;
        Ok(Pool {
            pool,
            threads,
            min_flops,
            min_elems: MIN_PARALLEL_ELEMS,
        })
    }

    /// The rayon workers of a `threads`-thread pool.
    fn workers(threads: usize) -> Result<rayon::ThreadPool> {
        let cores = process_cores();
        // The caller is thread 0 of every broadcast: the pool holds the
        // other `threads - 1`, worker i pinned to the (i + 1)-th core.
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads - 1)
            .thread_name(|i| format!("brgemm-{}", i + 1))
            .start_handler(move |i| {
                crate::engine::fpenv::flush_forever();
                if !cores.is_empty() {
                    core_affinity::set_for_current(cores[(i + 1) % cores.len()]);
                }
            })
            .build()
            .map_err(|e| shape("threads", threads, e.to_string()))
    }

    /// This pool with the small-work rule off: every pass and element-wise
    /// step goes to all its threads, however small (tests of the parallel
    /// paths, scaling experiments on small shapes).
    pub fn always_parallel(mut self) -> Pool {
        self.min_flops = 0.0;
        self.min_elems = 0;
        self
    }

    /// The calling thread as a pool of one (no workers, no hand-off).
    pub fn caller() -> &'static Pool {
        static CALLER: OnceLock<Pool> = OnceLock::new();
        CALLER.get_or_init(|| Pool {
            pool: None,
            threads: 1,
            min_flops: 0.0,
            min_elems: 0,
        })
    }

    /// The pool to run a pass of `flops` floating-point operations on: this
    /// one, or below its threshold ([`MIN_PARALLEL_FLOPS`] by default) the
    /// calling thread alone, where the pass is faster than the hand-off.
    pub fn for_work(&self, flops: f64) -> &Pool {
        if self.threads > 1 && flops < self.min_flops {
            Pool::caller()
        } else {
            self
        }
    }

    /// The process-wide pool: `BRGEMM_NUM_THREADS` threads, else one per core
    /// of the affinity mask.
    ///
    /// # Panics
    /// If `BRGEMM_NUM_THREADS` is set but is not a positive integer: programs
    /// that read user settings call [`Pool::try_global`] and report the error.
    pub fn global() -> &'static Pool {
        Pool::try_global().unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Pool::global`], with a bad `BRGEMM_NUM_THREADS` (`0`, `abc`) as an
    /// error naming the variable and its value.
    pub fn try_global() -> crate::Result<&'static Pool> {
        static POOL: OnceLock<crate::Result<Pool>> = OnceLock::new();
        POOL.get_or_init(|| {
            let n = env_setting(
                Setting::NumThreads,
                |&n: &usize| n > 0,
                "a positive integer",
            )?
            .unwrap_or_else(|| process_cores().len().max(1));
            Pool::new(n)
        })
        .as_ref()
        .map_err(Clone::clone)
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
    /// `out` (`part` starts at element `offset`) and waits; with fewer than
    /// [`MIN_PARALLEL_ELEMS`] elements (unless [`Pool::always_parallel`]),
    /// `f(0, out)` on the calling thread.
    pub fn for_slices<T: Send, F: Fn(usize, &mut [T]) + Sync>(&self, out: &mut [T], f: F) {
        if out.len() < self.min_elems {
            let _flush = crate::engine::fpenv::flush();
            return f(0, out);
        }
        let (base, n) = (out.as_mut_ptr() as usize, out.len());
        self.for_ranges(n, |r| {
            // SAFETY: the shares of `0..n` are disjoint, so each thread
            // borrows its own part of `out`, which outlives the call.
            let part =
                unsafe { std::slice::from_raw_parts_mut((base as *mut T).add(r.start), r.len()) };
            f(r.start, part)
        })
    }

    /// Runs `f(i, part)` for every `len`-element part `i` of `out` (a
    /// tail shorter than `len` is left out), parts split over the threads
    /// in contiguous shares: the planes of a blocked tensor, one per item.
    pub fn for_slices_of<T: Send, F: Fn(usize, &mut [T]) + Sync>(
        &self,
        out: &mut [T],
        len: usize,
        f: F,
    ) {
        if len == 0 {
            return;
        }
        let (base, n) = (out.as_mut_ptr() as usize, out.len() / len);
        self.for_ranges(n, |r| {
            for i in r {
                // SAFETY: part i is elements i*len..(i+1)*len of `out`, in
                // bounds, and each i belongs to one thread's share.
                let part =
                    unsafe { std::slice::from_raw_parts_mut((base as *mut T).add(i * len), len) };
                f(i, part)
            }
        })
    }

    /// Runs `f(i)` for every `i` in `0..n`, each thread its contiguous share.
    pub fn for_each<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        self.for_ranges(n, |r| r.for_each(&f))
    }

    /// Runs `f(thread_index)` once on every thread of the pool and waits.
    pub fn broadcast<F: Fn(usize) + Sync>(&self, f: F) {
        // The workers flush subnormals from their start; the caller while
        // it runs its share (`fpenv`).
        let _flush = crate::engine::fpenv::flush();
        let Some(p) = &self.pool else {
            // No hand-off for a single thread: run on the caller.
            return f(0);
        };
        // The caller runs share 0 itself instead of sleeping on rayon's latch
        // while the workers run all of them: asleep, it took ~9 us to wake
        // after the last worker finished, and it had no work meanwhile.
        let left = AtomicUsize::new(self.threads - 1);
        p.in_place_scope(|s| {
            s.spawn_broadcast(|_, ctx| {
                f(ctx.index() + 1);
                left.fetch_sub(1, Ordering::Release);
            });
            f(0);
            // Done first: wait awake for a while (this is the caller's own
            // core), then on the scope's latch. A worker that panicked never
            // counts down; the scope re-raises its panic after the wait.
            let start = Instant::now();
            let mut spins = 0u32;
            while left.load(Ordering::Acquire) != 0 {
                std::hint::spin_loop();
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(256) && start.elapsed() > CALLER_SPIN {
                    break;
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{
        parse_setting, split_for_local_rank, Pool, MIN_PARALLEL_ELEMS, MIN_PARALLEL_FLOPS,
    };
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Which threads ran: a bit per thread index seen, and the number of calls.
    fn seen(pool: &Pool) -> (usize, usize) {
        let (mask, calls) = (AtomicUsize::new(0), AtomicUsize::new(0));
        pool.broadcast(|t| {
            mask.fetch_or(1 << t, Ordering::Relaxed);
            calls.fetch_add(1, Ordering::Relaxed);
        });
        (mask.into_inner(), calls.into_inner())
    }

    #[test]
    fn bad_env_settings_are_errors_naming_the_value() {
        // The values as the environment would give them (tests run in
        // parallel: none sets a variable another reads).
        for (v, ok) in [("0", false), ("abc", false), ("3", true)] {
            let name = "BRGEMM_NUM_THREADS";
            let r = parse_setting(
                name,
                Some(v.into()),
                |&n: &usize| n > 0,
                "a positive integer",
            );
            match (r, ok) {
                (Ok(Some(3)), true) => {}
                (Err(e), false) => {
                    let e = e.to_string();
                    assert!(e.contains(name) && e.contains(v), "{e}");
                }
                (r, _) => panic!("{v}: {r:?}"),
            }
        }
        assert_eq!(parse_setting::<usize>("X", None, |_| true, "x"), Ok(None));
    }

    #[test]
    fn small_work_runs_on_the_caller_and_large_work_on_every_thread() {
        let pool = Pool::new(2).unwrap();
        let small = pool.for_work(MIN_PARALLEL_FLOPS / 2.0);
        assert_eq!(small.threads(), 1);
        let caller = std::thread::current().id();
        small.broadcast(|t| {
            assert_eq!(t, 0);
            assert_eq!(std::thread::current().id(), caller);
        });
        let large = pool.for_work(MIN_PARALLEL_FLOPS);
        assert_eq!(large.threads(), 2);
        assert_eq!(seen(large), (0b11, 2));
        // Forced: every pass goes to the workers, however small.
        let forced = Pool::new(2).unwrap().always_parallel();
        assert_eq!(forced.for_work(1.0).threads(), 2);
        assert_eq!(seen(forced.for_work(0.0)), (0b11, 2));
        // One thread: always itself, never a hand-off.
        let one = Pool::new(1).unwrap();
        assert_eq!(seen(one.for_work(1e12)), (1, 1));
    }

    #[test]
    fn a_panic_in_any_share_reaches_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(3).unwrap();
        for bad in 0..3 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.broadcast(|t| {
                    if t == bad {
                        panic!("share {t} failed");
                    }
                })
            }));
            assert!(r.is_err(), "the panic of share {bad} was lost");
            assert_eq!(seen(&pool), (0b111, 3));
        }
    }

    #[test]
    fn for_slices_covers_every_element_above_and_below_the_threshold() {
        for pool in [
            Pool::new(2).unwrap(),
            Pool::new(2).unwrap().always_parallel(),
        ] {
            for len in [
                0,
                1,
                7,
                MIN_PARALLEL_ELEMS - 1,
                MIN_PARALLEL_ELEMS,
                3 * MIN_PARALLEL_ELEMS + 5,
            ] {
                let mut v = vec![0usize; len];
                let parts = AtomicUsize::new(0);
                pool.for_slices(&mut v, |lo, part| {
                    parts.fetch_add(1, Ordering::Relaxed);
                    for (i, x) in part.iter_mut().enumerate() {
                        *x += lo + i + 1;
                    }
                });
                assert!(v.iter().enumerate().all(|(i, &x)| x == i + 1), "len {len}");
                let parallel = len >= MIN_PARALLEL_ELEMS || pool.min_elems == 0;
                assert_eq!(
                    parts.into_inner(),
                    if parallel { 2 } else { 1 },
                    "len {len}"
                );
            }
        }
    }

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
