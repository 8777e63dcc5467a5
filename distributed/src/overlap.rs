//! How the non-blocking all-reduce makes progress while backward computes
//! ([`Progress`]), and the rate limit of the loop-nest hook's MPI tests.

use std::time::{Duration, Instant};

/// How the gradient all-reduce makes progress while backward computes
/// ([`DataParallel::set_progress`](crate::DataParallel::set_progress)).
///
/// Over TCP, OpenMPI moves a non-blocking all-reduce only inside MPI calls
/// (see [`brgemm_primitives::progress`]); what differs is who makes them.
/// Measured on the emulated cluster (`bench mpi --cluster`, 2 nodes), the
/// loop-nest hook led or tied: at 1 Gb/s the CNN's step took 17.9 ms with
/// it, 17.6 with the thread and 20.6 testing between layers only; the
/// ResNet's 27.2, 27.9 and 27.2; at 10 Gb/s all three were within 2-7%
/// (the link's cost there is the cores' TCP work, not waiting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// `MPI_Test` only between layers, when a group's gradients come in.
    Layers,
    /// Also from inside the passes: the loop nests' progress hook tests the
    /// buckets in flight between kernel calls, at most every `interval_us`
    /// microseconds. No thread, no context switch; MPI is called from the
    /// thread that computes.
    LoopNest {
        /// Least time between two tests.
        interval_us: u32,
    },
    /// A communication thread owns the step's MPI calls: backward hands it
    /// each full bucket, it starts the all-reduce and tests it every
    /// `interval_us` (sleeping in between: on a core shared with compute a
    /// spinning thread would take half of it). Needs MPI initialised with
    /// at least `Threading::Serialized`.
    Thread {
        /// Time between two tests.
        interval_us: u32,
    },
}

impl Default for Progress {
    /// `LoopNest` every 100 us. An `MPI_Test` over TCP costs microseconds
    /// (a poll of the sockets), so testing every 20 us slowed the passes
    /// under a 1 Gb/s all-reduce by about 2 ms per MB; 100 us kept the
    /// data moving at 1-25 Gb/s (`bench mpi --cluster`, README).
    fn default() -> Self {
        Progress::LoopNest { interval_us: 100 }
    }
}

impl std::fmt::Display for Progress {
    /// The form [`Progress::from_str`](std::str::FromStr) reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Progress::Layers => write!(f, "layers"),
            Progress::LoopNest { interval_us } => write!(f, "loop:{interval_us}"),
            Progress::Thread { interval_us } => write!(f, "thread:{interval_us}"),
        }
    }
}

impl std::str::FromStr for Progress {
    type Err = String;
    /// `layers`, `loop[:US]` or `thread[:US]` (default interval 100 us).
    fn from_str(s: &str) -> std::result::Result<Progress, String> {
        let (kind, us) = s.split_once(':').unwrap_or((s, "100"));
        let interval_us =
            us.parse::<u32>().ok().filter(|&u| u > 0).ok_or_else(|| {
                format!("{s:?}: the interval {us:?} is not a positive number of us")
            })?;
        match kind {
            "layers" => Ok(Progress::Layers),
            "loop" => Ok(Progress::LoopNest { interval_us }),
            "thread" => Ok(Progress::Thread { interval_us }),
            _ => Err(format!("{s:?}: expected layers, loop[:US] or thread[:US]")),
        }
    }
}

/// At most one open per `every`, looking at the clock every 8th call only
/// (the hook runs between kernel calls of a microsecond or two).
pub(crate) struct Gate {
    pub(crate) every: Duration,
    pub(crate) last: Instant,
    pub(crate) calls: u32,
}

impl Gate {
    pub(crate) fn new(interval_us: u32) -> Gate {
        Gate {
            every: Duration::from_micros(u64::from(interval_us)),
            last: Instant::now(),
            calls: 0,
        }
    }
    pub(crate) fn open(&mut self) -> bool {
        self.calls = self.calls.wrapping_add(1);
        self.calls.is_multiple_of(8) && self.due()
    }
    /// Whether `every` has passed since the last open (and opens if so).
    pub(crate) fn due(&mut self) -> bool {
        let now = Instant::now();
        let open = now - self.last >= self.every;
        if open {
            self.last = now;
        }
        open
    }
}
