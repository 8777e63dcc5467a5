//! Loop nests as data, after PARLOOPER (Georganas et al.).
//!
//! A nest is a list of logical loops ([`LoopDef`]: start, end, step and the
//! block sizes of its outer blocking levels) plus a spec string. Letter `a`
//! is loop 0, `b` loop 1, and so on:
//!
//! - the order of letters is the nesting order, outermost first;
//! - a letter repeated adds a blocking level: with `blocks = [B1, B2]` the
//!   string `a..a..a` walks loop a in steps of B1, then B2 inside each B1
//!   block, then `step` inside each B2 block;
//! - a loop of a single iteration may be left out (it then runs outermost);
//! - an upper-case letter runs in parallel. All upper-case letters must be
//!   adjacent: that group is collapsed into one iteration space and split
//!   statically, in contiguous chunks, over the pool's threads. Serial loops
//!   outside the group run on every thread.
//!
//! How the chunks are then run is the nest's [`Schedule`]:
//!
//! - [`Schedule::Static`]: each thread runs its own chunk and nothing else.
//!   Every thread owns the same chunk at every outer iteration, so each index
//!   of the group always belongs to one thread and no barrier is needed
//!   between outer iterations.
//! - [`Schedule::Steal`] (the default): each thread starts on the same chunk,
//!   front to back; one that finishes early takes the remaining iterations of
//!   the others one at a time from the back of their chunks. One
//!   compare-and-swap per iteration, and a barrier after each instance of the
//!   group (each outer iteration), which keeps reductions in outer serial
//!   loops in order. Why: a static split waits for the slowest thread, and on
//!   a shared machine the cores are not equally fast. Measured here, the L1
//!   tile on both vCPUs at once ran at 80-92 GFLOP/s on one and 120-128 on
//!   the other in most slices (median static/sum 0.85), while the register-only
//!   FMA probe was even.
//!
//! A loop marked [`LoopDef::ordered`] (the time steps of a recurrence, whose
//! every iteration reads all of the previous one's results) must sit outside
//! the parallel group, and the group inside it ends with a barrier under
//! either schedule. A whole sequence is then one nest run, one hand-off to
//! the pool, instead of one per step (1-30 us each here, see [`crate::threads`]).
//!
//! `BRGEMM_SCHEDULE=static` or `=steal`, read once per process (when the
//! first nest is built), sets the default of every nest;
//! [`LoopNest::with_schedule`] sets one nest's.
//!
//! The body is a closure over the logical indices (`idx[0]` for loop a, ...).
//! Specs are interpreted, never compiled: a nest is parsed and checked once
//! ([`LoopNest::new`]) and then run many times ([`LoopNest::run`]). The cost
//! per body call is a few nanoseconds (see `bench -- loops`, Zen 5 VM:
//! 2.7-2.8 ns of thread time on one and two threads, 13 ns for `cAB` on
//! two threads, where every iteration of the group is one body call and
//! the group, with its barrier, runs 64 times), noise next to a BRGEMM
//! call of a few microseconds.

use crate::error::{shape, Error, Result};
use crate::threads::Pool;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Largest number of logical loops in one nest.
pub const MAX_LOOPS: usize = 8;

/// One logical loop of a nest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDef {
    /// What the loop walks, for error messages (e.g. `"N blocks"`).
    pub name: &'static str,
    /// First index.
    pub start: usize,
    /// One past the last index.
    pub end: usize,
    /// Step of the innermost level.
    pub step: usize,
    /// Steps of the outer blocking levels, outermost first. A spec that uses
    /// the letter L times uses the first L-1 of them.
    pub blocks: Vec<usize>,
    /// Whether iterations of this loop may run on different threads (false for
    /// a reduction into the same output).
    pub parallel_ok: bool,
    /// Whether each iteration needs all of the previous one's results (the
    /// time steps of a recurrence): the loop must be outside the parallel
    /// group, and every instance of the group inside it ends with a barrier
    /// under either schedule.
    pub ordered: bool,
}

impl LoopDef {
    /// A loop over `0..end` in steps of `step`, no blocking, parallel allowed.
    pub fn new(name: &'static str, end: usize, step: usize) -> Self {
        LoopDef {
            name,
            start: 0,
            end,
            step,
            blocks: vec![],
            parallel_ok: true,
            ordered: false,
        }
    }
    /// Sets the blocking levels.
    pub fn blocks(mut self, b: Vec<usize>) -> Self {
        self.blocks = b;
        self
    }
    /// Marks the loop as a reduction: it may not be parallel.
    pub fn reduction(mut self) -> Self {
        self.parallel_ok = false;
        self
    }
    /// Marks the loop as ordered (see [`LoopDef::ordered`]): serial, outside
    /// the parallel loops, a barrier between its iterations.
    pub fn ordered(mut self) -> Self {
        self.parallel_ok = false;
        self.ordered = true;
        self
    }
    /// Iterations of the innermost level over the whole range.
    pub fn trips(&self) -> usize {
        (self.end - self.start).div_ceil(self.step)
    }
}

#[derive(Debug, Clone, Copy)]
struct Level {
    lp: usize,
    step: usize,
    /// Step of the previous level of the same loop (None: first level).
    outer: Option<usize>,
}

/// How the threads share the parallel group's iterations (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Each thread runs its contiguous chunk; no barriers.
    Static,
    /// The same chunks, plus stealing from the back of others' chunks and
    /// a barrier after each instance of the group.
    Steal,
}

impl Schedule {
    /// `BRGEMM_SCHEDULE` (`static` or `steal`), else [`Schedule::Steal`]:
    /// the default of every nest, read once per process.
    ///
    /// # Errors
    /// If the variable is set to anything else.
    pub fn from_env() -> Result<Schedule> {
        static S: std::sync::OnceLock<Result<Schedule>> = std::sync::OnceLock::new();
        S.get_or_init(|| match brgemm::env::Setting::Schedule.value() {
            None => Ok(Schedule::Steal),
            Some(v) => Self::from_env_value(&v),
        })
        .clone()
    }

    fn from_env_value(v: &str) -> Result<Schedule> {
        match v.trim() {
            "static" => Ok(Schedule::Static),
            "steal" => Ok(Schedule::Steal),
            other => Err(shape(
                "BRGEMM_SCHEDULE",
                other,
                "expected \"static\" or \"steal\"",
            )),
        }
    }
}

/// A parsed, validated loop nest.
#[derive(Debug, Clone)]
pub struct LoopNest {
    loops: Vec<LoopDef>,
    spec: String,
    levels: Vec<Level>,
    /// Levels `par.0 .. par.1` form the parallel group (empty: all serial).
    par: (usize, usize),
    schedule: Schedule,
    /// An ordered loop encloses the parallel group: barrier after each
    /// instance whatever the schedule.
    ordered: bool,
}

/// One thread's chunk in one instance of the group: iterations taken from
/// the front (by the owner, high 32 bits) and from the back (by thieves, low
/// 32 bits). On its own cache line, so owners do not contend.
#[repr(align(128))]
#[derive(Default)]
struct Chunk(AtomicU64);

const BACK: u64 = 1;
const FRONT: u64 = 1 << 32;

impl Chunk {
    /// Takes the next iteration of a chunk of `len`, from the front or the
    /// back; returns its position in the chunk.
    fn take(&self, len: usize, front: bool) -> Option<usize> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let (f, b) = ((cur >> 32) as usize, (cur & 0xffff_ffff) as usize);
            if f + b >= len {
                return None;
            }
            let (next, pos) = if front {
                (cur + FRONT, f)
            } else {
                (cur + BACK, len - 1 - b)
            };
            match self
                .0
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Some(pos),
                Err(now) => cur = now,
            }
        }
    }
}

/// Shared state of one [`Schedule::Steal`] run: the chunks of two
/// consecutive instances (by parity; thread 0 clears the next one's while
/// the current one runs) and a barrier.
struct StealState {
    chunks: [Vec<Chunk>; 2],
    arrived: AtomicUsize,
    generation: AtomicUsize,
    threads: usize,
    /// Set when a thread's body panicked: it never reaches the barrier,
    /// so the others must stop waiting (and panic too, which the pool
    /// hands to the caller) instead of hanging.
    poisoned: AtomicBool,
}

/// Poisons the run's barrier if this thread unwinds out of the nest.
struct PoisonOnPanic<'a>(Option<&'a StealState>);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if let (Some(st), true) = (self.0, std::thread::panicking()) {
            st.poisoned.store(true, Ordering::Release);
        }
    }
}

impl StealState {
    fn new(threads: usize) -> StealState {
        let v = || (0..threads).map(|_| Chunk::default()).collect();
        StealState {
            chunks: [v(), v()],
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            threads,
            poisoned: AtomicBool::new(false),
        }
    }

    /// Waits until every thread has arrived. Spins briefly, then yields, so
    /// an oversubscribed machine (tests running side by side) still moves.
    fn barrier(&self) {
        let g = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.threads {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.store(g + 1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == g {
            if self.poisoned.load(Ordering::Acquire) {
                panic!("another thread of this loop nest panicked");
            }
            if spins < 2000 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Per-thread view of a run: the shared state (None: one thread, or static
/// with no ordered loop) and how many instances of the group this thread
/// has entered.
struct RunCtx<'a> {
    shared: Option<&'a StealState>,
    instance: usize,
}

fn spec_err(spec: &str, reason: impl Into<String>) -> Error {
    Error::Spec {
        spec: spec.to_string(),
        reason: reason.into(),
    }
}

impl LoopNest {
    /// Parses and validates `spec` against `loops`.
    pub fn new(loops: Vec<LoopDef>, spec: &str) -> Result<LoopNest> {
        if loops.is_empty() || loops.len() > MAX_LOOPS {
            return Err(spec_err(
                spec,
                format!("a nest has 1..={MAX_LOOPS} loops, got {}", loops.len()),
            ));
        }
        for (i, l) in loops.iter().enumerate() {
            let letter = (b'a' + i as u8) as char;
            if l.step == 0 {
                return Err(spec_err(
                    spec,
                    format!("loop '{letter}' ({}) has step 0", l.name),
                ));
            }
            if l.end < l.start {
                return Err(spec_err(
                    spec,
                    format!("loop '{letter}' ({}) ends before it starts", l.name),
                ));
            }
        }
        let mut count = vec![0usize; loops.len()];
        let mut levels = Vec::new();
        let mut par_levels = Vec::new();
        for (pos, ch) in spec.chars().enumerate() {
            let lower = ch.to_ascii_lowercase();
            if !lower.is_ascii_lowercase() || (lower as usize - 'a' as usize) >= loops.len() {
                return Err(spec_err(
                    spec,
                    format!(
                        "unknown loop letter {ch:?} at position {pos}: this nest has loops a..{}",
                        (b'a' + loops.len() as u8 - 1) as char
                    ),
                ));
            }
            let lp = lower as usize - 'a' as usize;
            count[lp] += 1;
            if ch.is_ascii_uppercase() {
                if !loops[lp].parallel_ok {
                    return Err(spec_err(
                        spec,
                        format!(
                            "loop '{lower}' ({}) is a reduction into shared output and cannot run in parallel",
                            loops[lp].name
                        ),
                    ));
                }
                par_levels.push(levels.len());
            }
            levels.push(Level {
                lp,
                step: 0,
                outer: None,
            });
        }
        // A loop of one iteration may be left out: it runs outermost.
        for lp in (0..loops.len()).rev() {
            if count[lp] == 0 && loops[lp].trips() <= 1 {
                count[lp] = 1;
                levels.insert(
                    0,
                    Level {
                        lp,
                        step: 0,
                        outer: None,
                    },
                );
                par_levels.iter_mut().for_each(|x| *x += 1);
            }
        }
        for (lp, &c) in count.iter().enumerate() {
            let letter = (b'a' + lp as u8) as char;
            let l = &loops[lp];
            if c == 0 {
                return Err(spec_err(
                    spec,
                    format!("loop '{letter}' ({}) is missing", l.name),
                ));
            }
            if c - 1 > l.blocks.len() {
                return Err(spec_err(
                    spec,
                    format!(
                        "loop '{letter}' ({}) appears {c} times but has {} blocking level(s)",
                        l.name,
                        l.blocks.len()
                    ),
                ));
            }
            // Steps of the levels of this loop, outermost first.
            let steps: Vec<usize> = l.blocks[..c - 1].iter().copied().chain([l.step]).collect();
            let range = l.end - l.start;
            for w in steps.windows(2) {
                if w[0] == 0 || w[0] % w[1] != 0 {
                    return Err(spec_err(
                        spec,
                        format!(
                            "loop '{letter}' ({}): block {} is not a multiple of the inner step {}",
                            l.name, w[0], w[1]
                        ),
                    ));
                }
            }
            if c > 1 && !range.is_multiple_of(steps[0]) {
                return Err(spec_err(
                    spec,
                    format!(
                        "loop '{letter}' ({}): block {} does not divide the range {range}",
                        l.name, steps[0]
                    ),
                ));
            }
            for (k, lv) in levels.iter_mut().filter(|lv| lv.lp == lp).enumerate() {
                lv.step = steps[k];
                lv.outer = (k > 0).then(|| steps[k - 1]);
            }
        }
        let par = match (par_levels.first(), par_levels.last()) {
            (Some(&a), Some(&b)) => {
                if b - a + 1 != par_levels.len() {
                    return Err(spec_err(
                        spec,
                        "upper-case (parallel) loops must be adjacent: they are collapsed into one parallel loop",
                    ));
                }
                (a, b + 1)
            }
            _ => (0, 0),
        };
        if par.0 != par.1 {
            if let Some(lv) = levels[par.1..].iter().find(|lv| loops[lv.lp].ordered) {
                let l = &loops[lv.lp];
                return Err(spec_err(
                    spec,
                    format!(
                        "loop '{}' ({}) must be outside the parallel loops: each of its iterations needs all of the previous one's results",
                        (b'a' + lv.lp as u8) as char,
                        l.name
                    ),
                ));
            }
        }
        // Ordered loops nest in the order they are defined (a sequence's
        // steps outside the phases of one step).
        let firsts: Vec<usize> = (0..loops.len())
            .filter(|&lp| loops[lp].ordered)
            .map(|lp| levels.iter().position(|lv| lv.lp == lp).unwrap_or(0))
            .collect();
        if let Some(w) = firsts.windows(2).find(|w| w[0] > w[1]) {
            let (outer, inner) = (levels[w[1]].lp, levels[w[0]].lp);
            return Err(spec_err(
                spec,
                format!(
                    "loop '{}' ({}) must be inside loop '{}' ({})",
                    (b'a' + outer as u8) as char,
                    loops[outer].name,
                    (b'a' + inner as u8) as char,
                    loops[inner].name
                ),
            ));
        }
        let ordered = par.0 != par.1 && levels[..par.0].iter().any(|lv| loops[lv.lp].ordered);
        Ok(LoopNest {
            loops,
            spec: spec.to_string(),
            levels,
            par,
            schedule: Schedule::from_env()?,
            ordered,
        })
    }

    /// This nest with schedule `s`.
    pub fn with_schedule(mut self, s: Schedule) -> LoopNest {
        self.schedule = s;
        self
    }

    /// The schedule of the parallel group.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// As [`LoopNest::new`], with a spec error's reason prefixed by `pass`
    /// (e.g. `"conv fwd"`), so a bad spec in a tuning says which pass it
    /// belongs to.
    pub fn named(pass: &str, loops: Vec<LoopDef>, spec: &str) -> Result<LoopNest> {
        LoopNest::new(loops, spec).map_err(|e| match e {
            Error::Spec { spec, reason } => Error::Spec {
                spec,
                reason: format!("{pass}: {reason}"),
            },
            other => other,
        })
    }

    /// The spec string.
    pub fn spec(&self) -> &str {
        &self.spec
    }
    /// The logical loops.
    pub fn loops(&self) -> &[LoopDef] {
        &self.loops
    }

    /// Runs `body(idx)` for every point of the nest, on `pool`'s threads.
    pub fn run<F: Fn(&[usize]) + Sync>(&self, pool: &Pool, body: F) {
        let threads = if self.par.0 == self.par.1 {
            1
        } else {
            pool.threads()
        };
        let barriers = self.schedule == Schedule::Steal || self.ordered;
        let shared = (threads > 1 && barriers).then(|| StealState::new(threads));
        let go = |t: usize| {
            let _guard = PoisonOnPanic(shared.as_ref());
            let mut cur = [0usize; MAX_LOOPS];
            let mut ctx = RunCtx {
                shared: shared.as_ref(),
                instance: 0,
            };
            // Between kernel calls on the caller's thread: the progress
            // hook of non-blocking communication (`progress`).
            let polled = |idx: &[usize]| {
                body(idx);
                super::progress::poll();
            };
            self.level(0, &mut cur, t, threads, &polled, &mut ctx);
        };
        if threads == 1 {
            let _flush = super::fpenv::flush();
            go(0);
        } else {
            pool.broadcast(go);
        }
    }

    /// The point that follows `idx` in the nest's order, as one thread
    /// running the whole nest visits them (None after the last). Passes
    /// prefetch the next call's operands from it: inside a parallel group
    /// it is the same thread's next point except at the end of its share.
    pub fn successor(&self, idx: &[usize]) -> Option<[usize; MAX_LOOPS]> {
        // The start of the block of `step` that holds idx[lp].
        let start_of = |lp: usize, step: usize| {
            let l = &self.loops[lp];
            l.start + (idx[lp] - l.start) / step * step
        };
        for (i, lv) in self.levels.iter().enumerate().rev() {
            let l = &self.loops[lv.lp];
            let hi = match lv.outer {
                None => l.end,
                Some(o) => (start_of(lv.lp, o) + o).min(l.end),
            };
            let next = start_of(lv.lp, lv.step) + lv.step;
            if next < hi {
                // Levels inside level i restart at their enclosing block.
                let mut out = [0; MAX_LOOPS];
                for (lp, l) in self.loops.iter().enumerate() {
                    out[lp] = match self.levels[..i].iter().rev().find(|v| v.lp == lp) {
                        Some(v) => start_of(lp, v.step),
                        None => l.start,
                    };
                }
                out[lv.lp] = next;
                return Some(out);
            }
        }
        None
    }

    /// Runs the nest serially on the calling thread (the whole iteration space).
    pub fn run_serial<F: Fn(&[usize])>(&self, body: F) {
        let mut cur = [0usize; MAX_LOOPS];
        let mut ctx = RunCtx {
            shared: None,
            instance: 0,
        };
        self.level(0, &mut cur, 0, 1, &body, &mut ctx);
    }

    fn bounds(&self, lv: &Level, cur: &[usize; MAX_LOOPS]) -> (usize, usize) {
        let l = &self.loops[lv.lp];
        match lv.outer {
            None => (l.start, l.end),
            Some(o) => (cur[lv.lp], (cur[lv.lp] + o).min(l.end)),
        }
    }

    fn level<F: Fn(&[usize])>(
        &self,
        i: usize,
        cur: &mut [usize; MAX_LOOPS],
        t: usize,
        nt: usize,
        body: &F,
        ctx: &mut RunCtx,
    ) {
        if i == self.levels.len() {
            return body(&cur[..self.loops.len()]);
        }
        if i == self.par.0 && self.par.0 != self.par.1 {
            return self.parallel_group(cur, t, nt, body, ctx);
        }
        let lv = self.levels[i];
        let (lo, hi) = self.bounds(&lv, cur);
        let mut x = lo;
        while x < hi {
            cur[lv.lp] = x;
            self.level(i + 1, cur, t, nt, body, ctx);
            x += lv.step;
        }
        // Restore the block base for the levels outside this one.
        cur[lv.lp] = lo;
    }

    /// The collapsed parallel group: thread `t` of `nt` runs a contiguous
    /// chunk of its linearised iteration space (and, stealing, the ends of
    /// the others').
    fn parallel_group<F: Fn(&[usize])>(
        &self,
        cur: &mut [usize; MAX_LOOPS],
        t: usize,
        nt: usize,
        body: &F,
        ctx: &mut RunCtx,
    ) {
        let (g0, g1) = self.par;
        // Validation makes every blocked level divide its parent, so trip
        // counts inside the group do not depend on where a block starts.
        let mut trips = [0usize; MAX_LOOPS * 4];
        let mut total = 1usize;
        let mut probe = *cur;
        for (k, i) in (g0..g1).enumerate() {
            let (lo, hi) = self.bounds(&self.levels[i], &probe);
            trips[k] = (hi - lo).div_ceil(self.levels[i].step);
            probe[self.levels[i].lp] = lo;
            total *= trips[k];
        }
        let share = |t: usize| (t * total / nt, (t + 1) * total / nt);
        let saved = *cur;
        let mut visit = |lin: usize, ctx: &mut RunCtx| {
            // Mixed-radix decomposition, innermost level fastest.
            let mut rem = lin;
            let mut digits = [0usize; MAX_LOOPS * 4];
            for k in (0..g1 - g0).rev() {
                digits[k] = rem % trips[k];
                rem /= trips[k];
            }
            for (k, i) in (g0..g1).enumerate() {
                let lv = self.levels[i];
                let (lo, _) = self.bounds(&lv, cur);
                cur[lv.lp] = lo + digits[k] * lv.step;
            }
            self.level(g1, cur, t, nt, body, ctx);
            *cur = saved;
        };
        let (begin, end) = share(t);
        let st = match ctx.shared {
            Some(st) if self.schedule == Schedule::Steal => st,
            shared => {
                // Static: this thread's chunk, then the barrier of an
                // ordered loop if there is one.
                for lin in begin..end {
                    visit(lin, ctx);
                }
                if let Some(st) = shared {
                    st.barrier();
                }
                return;
            }
        };
        let inst = ctx.instance;
        ctx.instance += 1;
        if t == 0 {
            // Everyone left the previous instance (barrier), and nobody
            // enters the next before this one's barrier.
            for c in &st.chunks[(inst + 1) % 2] {
                c.0.store(0, Ordering::Relaxed);
            }
        }
        let chunks = &st.chunks[inst % 2];
        while let Some(p) = chunks[t].take(end - begin, true) {
            visit(begin + p, ctx);
        }
        for v in (1..nt).map(|d| (t + d) % nt) {
            let (b, e) = share(v);
            while let Some(p) = chunks[v].take(e - b, false) {
                visit(b + p, ctx);
            }
        }
        st.barrier();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    fn collect(nest: &LoopNest, pool: &Pool) -> Vec<Vec<usize>> {
        let a = collect_with(&nest.clone().with_schedule(Schedule::Static), pool);
        let b = collect_with(&nest.clone().with_schedule(Schedule::Steal), pool);
        assert_eq!(
            a,
            b,
            "{}: static and steal visit different points",
            nest.spec()
        );
        a
    }

    fn collect_with(nest: &LoopNest, pool: &Pool) -> Vec<Vec<usize>> {
        let out = Mutex::new(Vec::new());
        nest.run(pool, |i| out.lock().unwrap().push(i.to_vec()));
        let mut v = out.into_inner().unwrap();
        v.sort();
        v
    }

    #[test]
    fn every_spec_visits_every_point_once() {
        let pool = Pool::new(3).unwrap();
        let loops = || {
            vec![
                LoopDef::new("a", 8, 1).blocks(vec![4, 2]),
                LoopDef::new("b", 6, 2).blocks(vec![6]),
                LoopDef::new("c", 5, 1).reduction(),
            ]
        };
        let want = collect(&LoopNest::new(loops(), "abc").unwrap(), &pool);
        assert_eq!(want.len(), 8 * 3 * 5);
        for spec in [
            "abc", "cba", "ABc", "aBc", "aaBc", "AAbc", "aAbc", "bbAAc", "caaAB", "cAB", "aabBc",
        ] {
            let got = collect(&LoopNest::new(loops(), spec).unwrap(), &pool);
            assert_eq!(got, want, "{spec}");
        }
    }

    #[test]
    fn successor_follows_the_serial_order() {
        let loops = || {
            vec![
                LoopDef::new("a", 8, 1).blocks(vec![4, 2]),
                LoopDef::new("b", 8, 2).blocks(vec![4]),
                LoopDef::new("c", 5, 2).reduction(),
            ]
        };
        for spec in ["abc", "cba", "ABc", "aaBc", "aaaBBc", "caaAB", "bBaac"] {
            let nest = LoopNest::new(loops(), spec).unwrap();
            let order = std::cell::RefCell::new(Vec::new());
            nest.run_serial(|i| order.borrow_mut().push(i.to_vec()));
            let order = order.into_inner();
            for (k, p) in order.iter().enumerate() {
                let next = nest.successor(p).map(|n| n[..3].to_vec());
                assert_eq!(next.as_ref(), order.get(k + 1), "{spec} after {p:?}");
            }
        }
    }

    #[test]
    fn single_iteration_loops_may_be_left_out() {
        let loops = || {
            vec![
                LoopDef::new("a", 3, 1),
                LoopDef::new("one", 1, 1),
                LoopDef::new("c", 4, 2),
            ]
        };
        let pool = Pool::new(2).unwrap();
        let want = collect(&LoopNest::new(loops(), "abC").unwrap(), &pool);
        assert_eq!(collect(&LoopNest::new(loops(), "aC").unwrap(), &pool), want);
        assert_eq!(collect(&LoopNest::new(loops(), "CA").unwrap(), &pool), want);
        let e = LoopNest::new(loops(), "ab").unwrap_err().to_string();
        assert!(e.contains("loop 'c' (c) is missing"), "{e}");
    }

    #[test]
    fn ordered_loops_nest_in_their_order() {
        let loops = || {
            vec![
                LoopDef::new("n", 2, 1),
                LoopDef::new("steps", 3, 1).ordered(),
                LoopDef::new("phases", 2, 1).ordered(),
            ]
        };
        assert!(LoopNest::new(loops(), "bcA").is_ok());
        let e = LoopNest::new(loops(), "cbA").unwrap_err().to_string();
        assert!(
            e.contains("loop 'c' (phases) must be inside loop 'b' (steps)"),
            "{e}"
        );
    }

    #[test]
    fn stealing_keeps_outer_reductions_in_order() {
        // c is a serial reduction outside the parallel group: every (a, b)
        // must see c = 0, 1, 2, ... in order even when one thread is slow
        // and the others take its iterations.
        let pool = Pool::new(3).unwrap();
        let nest = LoopNest::new(
            vec![
                LoopDef::new("a", 7, 1),
                LoopDef::new("b", 5, 1),
                LoopDef::new("c", 6, 1).reduction(),
            ],
            "cAB",
        )
        .unwrap()
        .with_schedule(Schedule::Steal);
        let seen: Vec<Mutex<Vec<usize>>> = (0..35).map(|_| Mutex::new(vec![])).collect();
        let taken = AtomicUsize::new(0);
        nest.run(&pool, |i| {
            // The first iterations taken (whichever thread) are slow.
            if taken.fetch_add(1, Ordering::Relaxed).is_multiple_of(7) {
                std::thread::sleep(std::time::Duration::from_micros(300));
            }
            seen[i[0] * 5 + i[1]].lock().unwrap().push(i[2]);
        });
        for (ab, s) in seen.iter().enumerate() {
            assert_eq!(*s.lock().unwrap(), (0..6).collect::<Vec<_>>(), "block {ab}");
        }
    }

    /// Loops a, b and an ordered steps loop c.
    fn stepped(a: usize, b: usize, steps: usize) -> Vec<LoopDef> {
        vec![
            LoopDef::new("a", a, 1),
            LoopDef::new("b", b, 1),
            LoopDef::new("steps", steps, 1).ordered(),
        ]
    }

    /// `cAB` over [`stepped`] under each schedule.
    fn stepped_nests(a: usize, b: usize, steps: usize) -> [(Schedule, LoopNest); 2] {
        [Schedule::Static, Schedule::Steal].map(|s| {
            let nest = LoopNest::new(stepped(a, b, steps), "cAB").unwrap();
            (s, nest.with_schedule(s))
        })
    }

    #[test]
    fn ordered_loops_finish_each_step_before_the_next() {
        let pool = Pool::new(3).unwrap();
        for (sched, nest) in stepped_nests(5, 3, 8) {
            let done = AtomicUsize::new(0);
            let early = AtomicUsize::new(0);
            nest.run(&pool, |i| {
                if (i[0] + i[1]) % 4 == 0 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                if done.load(Ordering::SeqCst) < i[2] * 15 {
                    early.fetch_add(1, Ordering::SeqCst);
                }
                done.fetch_add(1, Ordering::SeqCst);
            });
            assert_eq!(done.into_inner(), 8 * 15);
            assert_eq!(early.into_inner(), 0, "{sched:?}: a step started early");
        }
        let e = LoopNest::new(stepped(5, 3, 8), "ABc")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'c' (steps) must be outside the parallel loops"),
            "{e}"
        );
        let e = LoopNest::new(stepped(5, 3, 8), "aCb")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot run in parallel"), "{e}");
    }

    #[test]
    fn a_panicking_body_panics_the_run_instead_of_hanging_the_barrier() {
        let pool = Pool::new(3).unwrap();
        for (sched, nest) in stepped_nests(6, 4, 5) {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                nest.run(&pool, |i| {
                    if i == [2, 1, 1] {
                        panic!("body failed at {i:?}");
                    }
                })
            }));
            assert!(r.is_err(), "{sched:?}: the panic was lost");
            // The pool is still usable afterwards.
            let n = AtomicUsize::new(0);
            nest.run(&pool, |_| {
                n.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(n.into_inner(), 6 * 4 * 5);
        }
    }

    #[test]
    fn a_chunk_is_taken_once_from_either_end() {
        let c = Chunk::default();
        let mut got = vec![];
        for front in [true, false, false, true, true, false, true] {
            if let Some(p) = c.take(5, front) {
                got.push(p);
            }
        }
        assert_eq!(got, vec![0, 4, 3, 1, 2]);
        assert_eq!(c.take(5, true), None);
        assert_eq!(c.take(5, false), None);
    }

    #[test]
    fn bad_schedule_names_the_value() {
        let e = Schedule::from_env_value("dynamic").unwrap_err().to_string();
        assert!(
            e.contains("dynamic") && e.contains("BRGEMM_SCHEDULE"),
            "{e}"
        );
        assert_eq!(
            Schedule::from_env_value(" static ").unwrap(),
            Schedule::Static
        );
        assert_eq!(Schedule::from_env_value("steal").unwrap(), Schedule::Steal);
    }

    #[test]
    fn blocking_orders_iterations() {
        let nest = LoopNest::new(
            vec![
                LoopDef::new("a", 4, 1).blocks(vec![2]),
                LoopDef::new("b", 2, 1),
            ],
            "aba",
        )
        .unwrap();
        let out = std::cell::RefCell::new(vec![]);
        nest.run_serial(|i| out.borrow_mut().push((i[0], i[1])));
        assert_eq!(
            out.into_inner(),
            vec![
                (0, 0),
                (1, 0),
                (0, 1),
                (1, 1),
                (2, 0),
                (3, 0),
                (2, 1),
                (3, 1)
            ]
        );
    }

    #[test]
    fn bad_specs_are_refused_with_reasons() {
        let loops = || {
            vec![
                LoopDef::new("N blocks", 8, 1).blocks(vec![3]),
                LoopDef::new("C blocks", 4, 1).reduction(),
            ]
        };
        for (spec, needle) in [
            ("ax", "unknown loop letter 'x'"),
            ("a", "loop 'b' (C blocks) is missing"),
            ("aB", "cannot run in parallel"),
            ("aab", "block 3 does not divide the range 8"),
            ("aaab", "appears 3 times but has 1 blocking level"),
            ("", "loop 'a' (N blocks) is missing"),
        ] {
            let e = LoopNest::new(loops(), spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
        let three = vec![
            LoopDef::new("a", 2, 1),
            LoopDef::new("b", 2, 1),
            LoopDef::new("c", 2, 1),
        ];
        let e = LoopNest::new(three, "AbC").unwrap_err().to_string();
        assert!(e.contains("must be adjacent"), "{e}");
        let e = LoopNest::new(vec![LoopDef::new("a", 4, 2).blocks(vec![3])], "aa")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a multiple"), "{e}");
    }
}
