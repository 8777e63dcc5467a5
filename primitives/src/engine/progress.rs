//! A progress hook the loop nests call between kernel calls.
//!
//! Non-blocking communication over TCP (OpenMPI's `btl tcp`, libnbc's
//! `MPI_Iallreduce`) moves only inside MPI calls: a rendezvous waits for
//! its reply, a fragment for the socket to drain, until someone calls
//! `MPI_Test`. A gradient all-reduce started during backward therefore
//! stalls while the passes compute unless something calls into MPI from
//! inside them. [`with_hook`] installs a callback on the calling thread for
//! the duration of a closure; every [`LoopNest`](crate::LoopNest) run calls
//! it after each body (each kernel call) that runs on that thread, which is
//! thread 0 of every pass (the pool's caller runs share 0 itself).
//!
//! The hook is the caller's to keep cheap: it runs between kernel calls of
//! a few microseconds, so it should rate-limit itself (a call counter, a
//! clock) before doing real work. It must not run passes itself: while it
//! runs, it is taken out, so nested [`poll`]s are no-ops.

use std::cell::Cell;
use std::ptr::NonNull;

type Hook = NonNull<dyn FnMut() + 'static>;

thread_local! {
    static HOOK: Cell<Option<Hook>> = const { Cell::new(None) };
}

/// Puts the previous hook back when [`with_hook`] ends, also on a panic.
struct Restore(Option<Hook>);

impl Drop for Restore {
    fn drop(&mut self) {
        HOOK.with(|h| h.set(self.0));
    }
}

/// Runs `body` with `hook` installed on this thread: loop nests run during
/// `body` call it between kernel calls on this thread. Nested calls install
/// the inner hook until they return.
pub fn with_hook<R>(hook: &mut dyn FnMut(), body: impl FnOnce() -> R) -> R {
    let short: NonNull<dyn FnMut() + '_> = NonNull::from(hook);
    // SAFETY: only the lifetime is erased. The pointer is reachable through
    // HOOK only until `Restore` drops at the end of this call (also when
    // `body` unwinds), and `hook` outlives this call.
    let long: Hook = unsafe { std::mem::transmute(short) };
    let _restore = Restore(HOOK.with(|h| h.replace(Some(long))));
    body()
}

/// Calls this thread's hook, if one is installed (a thread-local read when
/// none is).
#[inline]
pub fn poll() {
    HOOK.with(|h| {
        if let Some(mut f) = h.take() {
            let _restore = Restore(Some(f));
            // SAFETY: `with_hook` keeps the pointee alive while it is
            // installed, and it is taken out of HOOK while it runs, so no
            // second `&mut` to it exists (a nested poll finds None).
            unsafe { f.as_mut()() };
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LoopDef, LoopNest, Pool};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    #[test]
    fn nests_call_the_hook_between_bodies_on_the_installing_thread_only() {
        let nest = LoopNest::new(vec![LoopDef::new("i", 64, 1)], "A").unwrap();
        let pool = Pool::new(2).unwrap().always_parallel();
        let mut calls = 0usize;
        let here = std::thread::current().id();
        let (all, mine) = (AtomicUsize::new(0), AtomicUsize::new(0));
        with_hook(&mut || calls += 1, || {
            nest.run(&pool, |_| {
                all.fetch_add(1, Relaxed);
                if std::thread::current().id() == here {
                    mine.fetch_add(1, Relaxed);
                }
            })
        });
        assert_eq!(all.into_inner(), 64);
        // Once per body run on this thread; the worker has no hook.
        assert_eq!(calls, mine.into_inner());
        assert!(calls >= 1);
        // Uninstalled after the call: polls reach nothing.
        let before = calls;
        nest.run(&pool, |_| {});
        poll();
        assert_eq!(calls, before);
    }

    #[test]
    fn nested_polls_and_panics_leave_no_hook_behind() {
        let mut outer = 0;
        let mut inner = 0;
        with_hook(&mut || outer += 1, || {
            with_hook(
                &mut || {
                    inner += 1;
                    poll(); // taken out while it runs: a no-op
                },
                poll,
            );
            poll();
        });
        assert_eq!((outer, inner), (1, 1));
        let r = std::panic::catch_unwind(|| with_hook(&mut || {}, || panic!("in body")));
        assert!(r.is_err());
        assert!(HOOK.with(|h| h.get()).is_none());
    }
}
