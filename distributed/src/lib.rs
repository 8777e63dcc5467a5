//! # brgemm-distributed: data-parallel training over MPI
//!
//! Each rank holds a full replica of a model (a [`Replica`]: any layer
//! [`Graph`](brgemm_nn::Graph), or a model of the user's that implements the trait); every global minibatch is
//! split across the ranks ([`DataParallel::shard`], uneven splits allowed).
//! [`DataParallel::train_step`] runs forward and backward on the local shard
//! and, as soon as a layer's weight gradient is complete (the model's
//! `compute_gradients_with` hook, last layer first), copies it into a bucket;
//! a full bucket starts a non-blocking all-reduce (`MPI_Iallreduce` through
//! rsmpi's `immediate_all_reduce_into`) while backward goes on for the
//! earlier layers. The optimizer step waits for all buckets. (With batch
//! norm each rank normalises with its own shard's statistics, as
//! unsynchronised data-parallel batch norm does: the one-rank equivalence
//! below holds for models without it.)
//!
//! Each rank scales its local mean gradient by `local_rows / global_rows`
//! before the sum, so the result is the gradient of the mean loss over the
//! whole global batch, exactly what one rank computes on the whole batch:
//! N ranks end with the same weights as one (to rounding).
//!
//! [`install_abort_on_panic`] makes a panic on any rank abort the whole job
//! (`MPI_Abort`) instead of leaving the other ranks in a collective forever.
//!
//! Run with `mpirun -np N` (as root add `--allow-run-as-root`; more ranks
//! than cores need `--oversubscribe`).

#![deny(missing_docs)]

mod overlap;
mod replica;
mod wire;

use overlap::Gate;
pub use overlap::Progress;
use replica::gradient_norm;
pub use replica::Replica;
pub use wire::GradDtype;
use wire::{by_bucket, to_bf16, widen, Bf16Wire};

/// The rsmpi crate this one is built on (initialise with `mpi::initialize()`).
pub use mpi;

use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::progress;
use brgemm_primitives::{Error, Pool, Result};
use mpi::collective::{SystemOperation, UnsafeUserOperation};
use mpi::request::{LocalScope, Request};
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Instant;

/// The environment variable that picks OpenMPI's `MPI_Iallreduce`
/// algorithm (libnbc), which [`initialize`] sets when the user has not.
pub const IALLREDUCE_ALGORITHM: &str = "OMPI_MCA_coll_libnbc_iallreduce_algorithm";

/// Initialises MPI for data-parallel training (`threading`: what the
/// process needs; [`Progress::Thread`] needs `Threading::Serialized`).
///
/// With OpenMPI it first makes the non-blocking all-reduce a ring (setting
/// [`IALLREDUCE_ALGORITHM`] to 1 unless the user has set it): for fewer than
/// four ranks libnbc's default is a binomial reduce and then a broadcast,
/// so every byte crosses the link twice, one direction at a time. Measured
/// on the emulated cluster at 1 Gb/s, the CNN's 1.6 MB of gradients: a
/// training step of 30.8 ms with the default, 18.3 ms with the ring (2
/// ranks). Other MPIs ignore the variable. Call it before any thread of the
/// process reads the environment (first thing in `main`).
pub fn initialize(
    threading: mpi::Threading,
) -> Option<(mpi::environment::Universe, mpi::Threading)> {
    if std::env::var_os(IALLREDUCE_ALGORITHM).is_none() {
        std::env::set_var(IALLREDUCE_ALGORITHM, "1");
    }
    mpi::initialize_with_threading(threading)
}

/// Makes any panic abort every rank of the job: the default hook prints the
/// message, then `MPI_Abort(MPI_COMM_WORLD, 1)` ends all processes.
pub fn install_abort_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        eprintln!("brgemm-distributed: panic on this rank, aborting the MPI job");
        // SAFETY: MPI is initialised before any rank-level work can panic;
        // MPI_Abort does not return.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 1);
        }
    }));
}

/// Communication figures of the steps so far.
///
/// "Hidden" is measured, not inferred from when requests started: the
/// gradient all-reduce of one step is timed on its own, blocking
/// ([`DataParallel::calibrate`]); what a step waits after its backward has
/// finished is the part that was not hidden.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommStats {
    /// Steps measured.
    pub steps: usize,
    /// Seconds of one step's gradient all-reduce run alone (calibrated).
    pub standalone_s: f64,
    /// Seconds the steps waited for communication after backward ended.
    pub exposed_s: f64,
    /// Seconds in forward and backward (with the bucket copies and the
    /// MPI calls made during them).
    pub backward_s: f64,
    /// Seconds after the wait: gradients copied back, the non-finite
    /// guard and the optimizer.
    pub finish_s: f64,
}

impl CommStats {
    /// Share of the standalone all-reduce time that was not spent waiting
    /// after backward: `1 - exposed / (steps * standalone)`, in [0, 1].
    ///
    /// An upper bound on what was really hidden: where the reduction is CPU
    /// work on the cores that also compute (shared memory, no offloading
    /// NIC), it slows backward without being waited for. `bench mpi` reports
    /// the hidden share from step times instead.
    pub fn hidden_fraction(&self) -> f64 {
        let total = self.steps as f64 * self.standalone_s;
        if total > 0.0 {
            (1.0 - self.exposed_s / total).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }
}

/// Where one group's gradients sit in the flat communication buffer.
#[derive(Debug, Clone)]
struct Slot {
    group: usize,
    offset: usize,
    /// Length of each of the group's buffers.
    lens: Vec<usize>,
    bucket: usize,
}

/// The slot of parameter group `group` (slots run from the last group down,
/// one per group).
fn slot_of(slots: &[Slot], group: usize) -> &Slot {
    let slot = &slots[slots.len() - 1 - group];
    debug_assert_eq!(slot.group, group);
    slot
}

impl Slot {
    fn len(&self) -> usize {
        self.lens.iter().sum()
    }
    /// The group's gradients times `scale` into `dst` (from its start).
    fn put(&self, grads: &[&mut [f32]], dst: &mut [f32], scale: f32) {
        let mut at = 0;
        for g in grads {
            for (d, v) in dst[at..at + g.len()].iter_mut().zip(g.iter()) {
                *d = v * scale;
            }
            at += g.len();
        }
    }
    /// The group's gradients from `src` (from its start).
    fn take<R: Replica>(&self, model: &mut R, src: &[f32]) {
        let mut at = 0;
        for g in model.gradients_mut(self.group) {
            let n = g.len();
            g.copy_from_slice(&src[at..at + n]);
            at += n;
        }
    }
}

/// One step's times on this rank with the trainer's own bucket copies but
/// no communication ([`DataParallel::local_step_times`]): what the scaling
/// model (`brgemm_dl::scaling::Timeline`) predicts a step from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimes {
    /// Per parameter group, in the order backward completes them: seconds
    /// from the start of the step (forward included) until its gradients
    /// were in their bucket, and their bytes.
    pub ready: Vec<(f64, usize)>,
    /// Seconds from the start of the step to the end of backward.
    pub backward_end: f64,
    /// Seconds of the step's tail: gradients copied back from the buckets,
    /// the non-finite guard, the optimizer.
    pub finish: f64,
}

/// A full bucket's send and receive slices, ready to start.
enum Ready<'b> {
    F32(&'b [f32], &'b mut [f32]),
    Bf16(&'b [u16], &'b mut [u16]),
}

/// The step's all-reduces in flight, in one request scope.
struct Inflight<'a, 's> {
    world: &'a SimpleCommunicator,
    scope: &'s LocalScope<'a>,
    op16: Option<&'a UnsafeUserOperation>,
    f32s: Vec<Request<'a, [f32], &'s LocalScope<'a>>>,
    u16s: Vec<Request<'a, [u16], &'s LocalScope<'a>>>,
    loss: Option<Request<'a, f32, &'s LocalScope<'a>>>,
}

impl<'a, 's> Inflight<'a, 's> {
    fn new(
        world: &'a SimpleCommunicator,
        scope: &'s LocalScope<'a>,
        op16: Option<&'a UnsafeUserOperation>,
    ) -> Self {
        Inflight {
            world,
            scope,
            op16,
            f32s: Vec::new(),
            u16s: Vec::new(),
            loss: None,
        }
    }
    fn start(&mut self, b: Ready<'a>) {
        match b {
            Ready::F32(s, r) => self.f32s.push(self.world.immediate_all_reduce_into(
                self.scope,
                s,
                r,
                SystemOperation::sum(),
            )),
            Ready::Bf16(s, r) => {
                let op = self.op16.expect("a bf16 bucket has the bf16 sum");
                self.u16s
                    .push(self.world.immediate_all_reduce_into(self.scope, s, r, op))
            }
        }
    }
    /// Starts the loss's sum after the last bucket (the same order on every
    /// rank), so its round trip overlaps the buckets' tail.
    fn loss(&mut self, send: &'a f32, recv: &'a mut f32) {
        self.loss = Some(self.world.immediate_all_reduce_into(
            self.scope,
            send,
            recv,
            SystemOperation::sum(),
        ));
    }
    fn pending(&self) -> usize {
        self.f32s.len() + self.u16s.len()
    }
    /// One `MPI_Test` per request in flight: what moves the bytes.
    fn test(&mut self) {
        fn keep<R>(v: &mut Vec<R>, test: impl Fn(R) -> std::result::Result<(), R>) {
            *v = std::mem::take(v)
                .into_iter()
                .filter_map(|r| test(r).err())
                .collect();
        }
        keep(&mut self.f32s, |r| r.test().map(drop));
        keep(&mut self.u16s, |r| r.test().map(drop));
    }
    /// Waits for the buckets in flight.
    fn drain(&mut self) {
        for r in self.f32s.drain(..) {
            r.wait();
        }
        for r in self.u16s.drain(..) {
            r.wait();
        }
    }
    fn wait(mut self) {
        self.drain();
        if let Some(r) = self.loss {
            r.wait();
        }
    }
}

/// The communicator and the bf16 sum, lent to the communication thread.
struct Shared<'a>(&'a SimpleCommunicator, Option<&'a UnsafeUserOperation>);

// SAFETY: `set_progress` accepts `Progress::Thread` only where MPI was
// initialised with at least MPI_THREAD_SERIALIZED, and while the thread
// runs the lending thread makes no MPI call (it computes, then joins), so
// MPI calls never overlap.
unsafe impl Send for Shared<'_> {}

/// A data-parallel trainer bound to a communicator and a model's shape.
pub struct DataParallel {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// Slots in backward order (last layer first).
    slots: Vec<Slot>,
    /// Element range of each bucket in the flat buffer.
    buckets: Vec<Range<usize>>,
    send: Vec<f32>,
    recv: Vec<f32>,
    /// The bf16 wire, when gradients travel as bf16 ([`GradDtype::Bf16`]).
    bf16: Option<Bf16Wire>,
    /// Statistics of the steps so far.
    pub stats: CommStats,
    /// How the all-reduce progresses during backward.
    progress: Progress,
    /// Steps run so far (named by the non-finite guard).
    steps: u64,
    /// Whether a non-finite global loss or gradient stops training.
    check_finite: bool,
}

impl DataParallel {
    /// Plans the buckets for `model` (at least `bucket_bytes` per bucket, cut
    /// at group boundaries, in the order backward produces the gradients).
    pub fn new<R: Replica>(
        world: SimpleCommunicator,
        model: &mut R,
        bucket_bytes: usize,
    ) -> DataParallel {
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        let mut slots = Vec::new();
        let mut buckets = Vec::new();
        let (mut offset, mut start) = (0usize, 0usize);
        for group in (0..model.groups()).rev() {
            let lens: Vec<usize> = model.gradients_mut(group).iter().map(|g| g.len()).collect();
            let slot = Slot {
                group,
                offset,
                lens,
                bucket: buckets.len(),
            };
            offset += slot.len();
            slots.push(slot);
            if (offset - start) * 4 >= bucket_bytes || group == 0 {
                buckets.push(start..offset);
                start = offset;
            }
        }
        DataParallel {
            world,
            rank,
            size,
            slots,
            buckets,
            send: vec![0.0; offset],
            recv: vec![0.0; offset],
            bf16: None,
            stats: CommStats::default(),
            progress: Progress::default(),
            steps: 0,
            check_finite: true,
        }
    }

    /// Sends gradients in `dtype` ([`GradDtype::Bf16`]: half the bytes). The
    /// same on every rank (a collective's datatypes must agree).
    pub fn set_grad_dtype(&mut self, dtype: GradDtype) {
        match dtype {
            GradDtype::F32 => self.bf16 = None,
            GradDtype::Bf16 => {
                let n = self.send.len();
                self.bf16.get_or_insert_with(|| Bf16Wire::new(n));
            }
        }
    }

    /// How the all-reduce makes progress during backward (default
    /// [`Progress::LoopNest`]).
    ///
    /// # Errors
    /// [`Progress::Thread`] where MPI was initialised below
    /// `Threading::Serialized` (use `mpi::initialize_with_threading`).
    pub fn set_progress(&mut self, progress: Progress) -> Result<()> {
        if let Progress::Thread { .. } = progress {
            let level = mpi::environment::threading_support();
            if level < mpi::Threading::Serialized {
                return Err(Error::Setting {
                    what: "progress".into(),
                    value: format!("{progress:?}"),
                    reason: format!(
                        "a communication thread needs MPI initialised with Threading::Serialized or more, this one has {level:?}"
                    ),
                });
            }
        }
        self.progress = progress;
        Ok(())
    }

    /// How the all-reduce makes progress during backward.
    pub fn progress(&self) -> Progress {
        self.progress
    }

    /// How gradients travel.
    pub fn grad_dtype(&self) -> GradDtype {
        match self.bf16 {
            Some(_) => GradDtype::Bf16,
            None => GradDtype::F32,
        }
    }

    /// Turns the non-finite guard off (on by default): with it on, a step
    /// whose global loss or all-reduced gradient norm is not finite returns
    /// [`Error::NonFinite`] on every rank alike, before the optimizer runs.
    pub fn set_check_finite(&mut self, on: bool) {
        self.check_finite = on;
    }

    /// The guard on the global (identical on every rank) loss and
    /// gradients, then the optimizer.
    fn finish_step<R: Replica>(
        &mut self,
        model: &mut R,
        loss: f32,
        grads: &[f32],
        opt: &Optimizer,
    ) -> Result<f32> {
        let index = self.steps;
        self.steps += 1;
        if self.check_finite {
            let norm = match self.size {
                1 => gradient_norm(model),
                _ => brgemm_primitives::guard::norm([grads]),
            };
            brgemm_primitives::guard::check_step(index, loss, norm)?;
        }
        model.apply_gradients(opt)?;
        Ok(loss)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }
    /// Number of all-reduce buckets per step.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }
    /// Per bucket, in the order they start: how many parameter groups it
    /// holds (groups in the order backward completes them, the last first).
    pub fn bucket_groups(&self) -> Vec<usize> {
        let mut n = vec![0; self.buckets.len()];
        self.slots.iter().for_each(|s| n[s.bucket] += 1);
        n
    }
    /// Bytes of f32 gradients per step.
    pub fn gradient_bytes(&self) -> usize {
        4 * self.send.len()
    }
    /// The communicator.
    pub fn world(&self) -> &SimpleCommunicator {
        &self.world
    }

    /// This rank's contiguous share of `global` rows (sizes differ by at most one).
    pub fn shard(&self, global: usize) -> Range<usize> {
        (self.rank * global / self.size)..((self.rank + 1) * global / self.size)
    }

    /// Copies rank 0's parameters to every rank.
    pub fn broadcast_parameters<R: Replica>(&self, model: &mut R) {
        let root = self.world.process_at_rank(0);
        for g in 0..model.groups() {
            for buf in model.parameters_mut(g) {
                root.broadcast_into(buf);
            }
        }
    }

    /// Sums `buf` over all ranks in place, bucket by bucket with non-blocking
    /// all-reduces of at most `bucket_elems` elements (the path the gradient
    /// buckets take, exposed for tests and measurements).
    pub fn allreduce_sum(&self, buf: &mut [f32], bucket_elems: usize) {
        let send = buf.to_vec();
        mpi::request::scope(|scope| {
            let reqs: Vec<_> = send
                .chunks(bucket_elems.max(1))
                .zip(buf.chunks_mut(bucket_elems.max(1)))
                .map(|(s, r)| {
                    self.world
                        .immediate_all_reduce_into(scope, s, r, SystemOperation::sum())
                })
                .collect();
            for r in reqs {
                r.wait();
            }
        });
    }

    /// Times the gradient all-reduce of one step run alone (the same buckets,
    /// blocking on each), median of `reps`; stored in `stats.standalone_s`,
    /// and the step counters reset.
    pub fn calibrate(&mut self, reps: usize) -> f64 {
        let mut t = Vec::with_capacity(reps.max(1));
        let send = self.send.clone();
        let mut buf = self.send.clone();
        let send16 = self.bf16.as_ref().map_or(Vec::new(), |w| w.send.clone());
        let mut buf16 = send16.clone();
        let op16 = self.bf16.as_ref().map(|w| &w.op);
        for _ in 0..reps.max(1) {
            self.world.barrier();
            let s = Instant::now();
            // The step's own path (non-blocking all-reduce, then wait), one
            // bucket after another: blocking MPI_Allreduce takes other
            // algorithms than MPI_Iallreduce.
            mpi::request::scope(|scope| {
                let mut f = Inflight::new(&self.world, scope, op16);
                let mut recvs = by_bucket(&mut buf, &self.buckets);
                let mut recvs16 = by_bucket(&mut buf16, &self.buckets);
                for (b, range) in self.buckets.iter().enumerate() {
                    f.start(match op16 {
                        None => Ready::F32(&send[range.clone()], recvs[b].take().unwrap()),
                        Some(_) => Ready::Bf16(&send16[range.clone()], recvs16[b].take().unwrap()),
                    });
                    f.drain();
                }
            });
            t.push(s.elapsed().as_secs_f64());
        }
        t.sort_by(f64::total_cmp);
        self.stats = CommStats {
            standalone_s: t[t.len() / 2],
            ..CommStats::default()
        };
        self.stats.standalone_s
    }

    /// A step on this rank's rows as [`DataParallel::train_step`] runs it,
    /// its bucket copies included, with the all-reduce left out (the
    /// buckets come back as they went: this rank's gradient scaled by its
    /// share of `global_rows`), timed: when each group's gradients were in
    /// their bucket, the end of backward, the tail. Makes no MPI call.
    pub fn local_step_times<R: Replica>(
        &mut self,
        model: &mut R,
        pool: &Pool,
        x: &R::Input,
        labels: &[usize],
        global_rows: usize,
        opt: &Optimizer,
    ) -> Result<StepTimes> {
        let scale = labels.len() as f32 / global_rows.max(1) as f32;
        // One rank copies nothing (as in `train_step`).
        let copies = self.size > 1;
        let mut times = StepTimes::default();
        let (slots, send) = (&self.slots, &mut self.send);
        let t0 = Instant::now();
        model.compute_gradients_with(pool, x, labels, &mut |group, grads| {
            let slot = slot_of(slots, group);
            if copies {
                slot.put(grads, &mut send[slot.offset..], scale);
            }
            times
                .ready
                .push((t0.elapsed().as_secs_f64(), 4 * slot.len()));
        })?;
        times.backward_end = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        if copies {
            for slot in &self.slots {
                slot.take(model, &self.send[slot.offset..]);
            }
        }
        // The step's own tail: the guard (a step of its count) and the
        // optimizer.
        let send = std::mem::take(&mut self.send);
        let done = self.finish_step(model, 0.0, &send, opt);
        self.send = send;
        done?;
        times.finish = t1.elapsed().as_secs_f64();
        Ok(times)
    }

    /// One data-parallel step on this rank's rows: `x` holds them in its
    /// first `labels.len()` rows, `global_rows` is the size of the global
    /// minibatch. Returns the mean loss over the global minibatch.
    pub fn train_step<R: Replica>(
        &mut self,
        model: &mut R,
        pool: &Pool,
        x: &R::Input,
        labels: &[usize],
        global_rows: usize,
        opt: &Optimizer,
    ) -> Result<f32> {
        if labels.is_empty() || global_rows < labels.len() {
            return Err(Error::Shape {
                what: "rows on this rank".into(),
                value: labels.len().to_string(),
                reason: format!(
                    "need 1..={global_rows}: use fewer ranks than rows per global batch"
                ),
            });
        }
        if self.size == 1 {
            // Nothing to reduce: exactly the single-process step, so weak
            // scaling is measured against the real one-rank baseline.
            let loss = model.compute_gradients_with(pool, x, labels, &mut |_, _| {})?;
            return self.finish_step(model, loss, &[], opt);
        }
        let scale = labels.len() as f32 / global_rows as f32;
        let (slots, buckets, progress) = (&self.slots, &self.buckets, self.progress);
        let world = &self.world;
        let (send, recv) = (&mut self.send, &mut self.recv);
        let (op16, send16, recv16) = match &mut self.bf16 {
            Some(w) => (Some(&w.op), &mut w.send[..], &mut w.recv[..]),
            None => (None, &mut [][..], &mut [][..]),
        };
        let mut started = false;
        let step_start = Instant::now();
        let (mut backward_end, mut wait_end) = (Instant::now(), Instant::now());
        let (mut local_loss, mut global_loss) = (0.0f32, 0.0f32);
        let (loss_send, loss_recv) = (&mut local_loss, &mut global_loss);
        // Per bucket, its send and receive slices, taken when it starts
        // (the bf16 wire's too; none with f32).
        let (mut sends, mut recvs) = (by_bucket(send, buckets), by_bucket(recv, buckets));
        let (mut sends16, mut recvs16) = (by_bucket(send16, buckets), by_bucket(recv16, buckets));
        let mut filled = vec![0usize; buckets.len()];
        // Copies a completed group into its bucket; a full bucket's slices
        // come back, ready to start.
        let mut fill = |group: usize, grads: &mut [&mut [f32]]| -> Option<Ready<'_>> {
            let slot = slot_of(slots, group);
            let b = slot.bucket;
            let dst = sends[b]
                .as_mut()
                .expect("bucket not started before its groups are in");
            slot.put(grads, &mut dst[slot.offset - buckets[b].start..], scale);
            filled[b] += slot.len();
            if filled[b] < buckets[b].len() {
                return None;
            }
            let s: &[f32] = sends[b].take().unwrap();
            let r = recvs[b].take().unwrap();
            Some(match op16 {
                None => Ready::F32(s, r),
                Some(_) => {
                    let s16 = sends16[b].take().unwrap();
                    s16.iter_mut().zip(s).for_each(|(d, v)| *d = to_bf16(*v));
                    Ready::Bf16(s16, recvs16[b].take().unwrap())
                }
            })
        };
        match progress {
            Progress::Layers | Progress::LoopNest { .. } => {
                mpi::request::scope(|scope| -> Result<f32> {
                    let inflight = RefCell::new(Inflight::new(world, scope, op16));
                    // With the loop-nest hook, tests between layers are
                    // rate-limited too (a ResNet has dozens of groups).
                    let gate = RefCell::new(match progress {
                        Progress::LoopNest { interval_us } => Some(Gate::new(interval_us)),
                        _ => None,
                    });
                    let mut ready = |group: usize, grads: &mut [&mut [f32]]| {
                        let mut f = inflight.borrow_mut();
                        let started_now = fill(group, grads).map(|b| f.start(b)).is_some();
                        started |= started_now;
                        if started_now || gate.borrow_mut().as_mut().is_none_or(|g| g.due()) {
                            f.test();
                        }
                    };
                    let loss = match progress {
                        Progress::LoopNest { .. } => {
                            let mut hook = || {
                                // Nothing in flight (most kernel calls of a
                                // step): no clock, no MPI.
                                let Ok(mut f) = inflight.try_borrow_mut() else {
                                    return;
                                };
                                if f.pending() > 0
                                    && gate.borrow_mut().as_mut().is_some_and(Gate::open)
                                {
                                    f.test();
                                }
                            };
                            progress::with_hook(&mut hook, || {
                                model.compute_gradients_with(pool, x, labels, &mut ready)
                            })
                        }
                        _ => model.compute_gradients_with(pool, x, labels, &mut ready),
                    }?;
                    backward_end = Instant::now();
                    let mut f = inflight.into_inner();
                    *loss_send = loss * scale;
                    f.loss(loss_send, loss_recv);
                    f.wait();
                    wait_end = Instant::now();
                    Ok(loss)
                })?
            }
            Progress::Thread { interval_us } => std::thread::scope(|threads| -> Result<f32> {
                let (tx, rx) = std::sync::mpsc::channel::<Ready<'_>>();
                let comm = Shared(world, op16);
                let (ltx, lrx) = std::sync::mpsc::channel::<f32>();
                let thread = threads.spawn(move || {
                    let comm = comm;
                    mpi::request::scope(|scope| {
                        let mut f = Inflight::new(comm.0, scope, comm.1);
                        let tick = std::time::Duration::from_micros(u64::from(interval_us));
                        loop {
                            let next = if f.pending() == 0 {
                                rx.recv().ok()
                            } else {
                                match rx.recv_timeout(tick) {
                                    Ok(b) => Some(b),
                                    Err(RecvTimeoutError::Timeout) => {
                                        f.test();
                                        continue;
                                    }
                                    Err(RecvTimeoutError::Disconnected) => None,
                                }
                            };
                            match next {
                                Some(b) => {
                                    f.start(b);
                                    f.test();
                                }
                                None => break,
                            }
                        }
                        // Backward is over: the loss rides with the tail.
                        if let Ok(l) = lrx.recv() {
                            *loss_send = l;
                            f.loss(loss_send, loss_recv);
                        }
                        f.wait();
                    })
                });
                let mut ready = |group: usize, grads: &mut [&mut [f32]]| {
                    if let Some(b) = fill(group, grads) {
                        started = true;
                        tx.send(b).expect("the communication thread runs");
                    }
                };
                let loss = model.compute_gradients_with(pool, x, labels, &mut ready);
                backward_end = Instant::now();
                drop(tx);
                let _ = ltx.send(loss.as_ref().map_or(0.0, |l| l * scale));
                drop(ltx);
                thread
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p));
                wait_end = Instant::now();
                loss
            })?,
        };
        if started {
            self.stats.steps += 1;
            self.stats.exposed_s += (wait_end - backward_end).as_secs_f64();
            self.stats.backward_s += (backward_end - step_start).as_secs_f64();
        }
        if let Some(w) = &self.bf16 {
            self.recv
                .iter_mut()
                .zip(&w.recv)
                .for_each(|(d, b)| *d = widen(*b));
        }
        // The summed (already scaled) gradients replace the local ones.
        for slot in &self.slots {
            slot.take(model, &self.recv[slot.offset..]);
        }
        let recv = std::mem::take(&mut self.recv);
        let out = self.finish_step(model, global_loss, &recv, opt);
        if started {
            self.stats.finish_s += wait_end.elapsed().as_secs_f64();
        }
        self.recv = recv;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn progress_strategies_read_back_what_they_print_and_name_bad_values() {
        for p in [
            Progress::Layers,
            Progress::LoopNest { interval_us: 7 },
            Progress::Thread { interval_us: 250 },
            Progress::default(),
        ] {
            assert_eq!(p.to_string().parse::<Progress>(), Ok(p));
        }
        assert_eq!("loop".parse(), Ok(Progress::LoopNest { interval_us: 100 }));
        let e = "loop:0".parse::<Progress>().unwrap_err();
        assert!(e.contains("\"0\""), "{e}");
        let e = "spin".parse::<Progress>().unwrap_err();
        assert!(e.contains("spin") && e.contains("thread"), "{e}");
    }
}
