//! # brgemm-distributed: data-parallel training over MPI
//!
//! Each rank holds a full replica of a model (a [`Replica`]: any layer
//! [`Graph`], or a model of the user's that implements the trait); every global minibatch is
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

/// The rsmpi crate this one is built on (initialise with `mpi::initialize()`).
pub use mpi;

use brgemm_nn::{Graph, Tensor as NnTensor};
use brgemm_primitives::optim::Optimizer;
use brgemm_primitives::{Error, Pool, Result};
use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::ops::Range;
use std::time::Instant;

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

/// A model [`DataParallel`] can train: parameter groups whose gradients
/// become ready one group at a time during backward, highest group first.
pub trait Replica {
    /// What one minibatch looks like.
    type Input;
    /// Number of parameter groups.
    fn groups(&self) -> usize;
    /// Parameter buffers of group `g`.
    fn parameters_mut(&mut self, g: usize) -> Vec<&mut [f32]>;
    /// Gradient buffers of group `g` (same lengths as its parameters).
    fn gradients_mut(&mut self, g: usize) -> Vec<&mut [f32]>;
    /// Forward, loss and backward on the first `labels.len()` rows, calling
    /// `ready(g, grads)` as each group's gradients complete.
    fn compute_gradients_with(
        &mut self,
        pool: &Pool,
        x: &Self::Input,
        labels: &[usize],
        ready: &mut dyn FnMut(usize, &mut [&mut [f32]]),
    ) -> Result<f32>;
    /// The optimizer step on the stored gradients.
    fn apply_gradients(&mut self, opt: &Optimizer) -> Result<()>;
}

/// A layer graph's error as the primitives' (the trainer's error type):
/// the primitive's own error when it is one, else a setting named by it.
fn from_nn(e: brgemm_nn::Error) -> Error {
    match e {
        brgemm_nn::Error::Primitive(p) => p,
        other => Error::Setting {
            what: "layer graph".into(),
            value: other.to_string(),
            reason: "refused the step".into(),
        },
    }
}

/// Any layer graph, its layers with parameters as the groups (in order of
/// evaluation; backward completes the highest first).
impl Replica for Graph {
    type Input = NnTensor;
    fn groups(&self) -> usize {
        self.param_groups()
    }
    fn parameters_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        self.group_params_mut(g)
    }
    fn gradients_mut(&mut self, g: usize) -> Vec<&mut [f32]> {
        self.group_grads_mut(g)
    }
    fn compute_gradients_with(
        &mut self,
        pool: &Pool,
        x: &NnTensor,
        labels: &[usize],
        ready: &mut dyn FnMut(usize, &mut [&mut [f32]]),
    ) -> Result<f32> {
        Graph::compute_gradients_with(self, pool, x, labels, ready).map_err(from_nn)
    }
    fn apply_gradients(&mut self, opt: &Optimizer) -> Result<()> {
        self.step(opt).map_err(from_nn)
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

impl Slot {
    fn len(&self) -> usize {
        self.lens.iter().sum()
    }
}

/// How gradients travel between ranks ([`DataParallel::set_grad_dtype`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradDtype {
    /// As computed: f32.
    #[default]
    F32,
    /// Rounded to bf16 (nearest even), summed in bf16 steps (each partial
    /// sum widened, added in f32, rounded again), widened at the end: half
    /// the bytes on the wire, 8 bits of mantissa in the sum.
    Bf16,
}

/// The MPI reduction of [`GradDtype::Bf16`]: `inout[i] = bf16(in[i] + inout[i])`
/// on bf16 bit patterns carried as 16-bit integers.
///
/// # Safety
/// MPI calls it with `invec` and `inoutvec` pointing at `*len` elements of
/// the datatype of the reduction, which [`DataParallel`] makes `u16`
/// (`MPI_UNSIGNED_SHORT`) for every reduction it uses this operation in;
/// the two buffers do not overlap (MPI's contract for user operations).
unsafe extern "C" fn bf16_sum(
    invec: *mut std::ffi::c_void,
    inoutvec: *mut std::ffi::c_void,
    len: *mut std::ffi::c_int,
    _datatype: *mut mpi::ffi::MPI_Datatype,
) {
    let n = usize::try_from(*len).unwrap_or(0);
    let a = std::slice::from_raw_parts(invec as *const u16, n);
    let b = std::slice::from_raw_parts_mut(inoutvec as *mut u16, n);
    for (x, y) in a.iter().zip(b) {
        *y = to_bf16(widen(*x) + widen(*y));
    }
}

/// bf16 bits, rounded to nearest even (NaN kept).
fn to_bf16(v: f32) -> u16 {
    brgemm_primitives::fc_bf16::round_bf16(v).to_bits()
}

/// bf16 bits widened to f32 (exact).
fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// The bf16 wire: the gradients' bf16 copies, sent and received, and the
/// reduction that sums them.
struct Bf16Wire {
    send: Vec<u16>,
    recv: Vec<u16>,
    op: mpi::collective::UnsafeUserOperation,
}

impl Bf16Wire {
    fn new(n: usize) -> Bf16Wire {
        Bf16Wire {
            send: vec![0; n],
            recv: vec![0; n],
            // SAFETY: `bf16_sum` reads and writes `*len` u16 values, and this
            // operation reduces only the u16 buffers `send`/`recv`.
            op: unsafe { mpi::collective::UnsafeUserOperation::commutative(bf16_sum) },
        }
    }
}

/// `buf` cut into the buckets' slices (none when `buf` is empty: an unused
/// wire).
fn by_bucket<'a, T>(mut buf: &'a mut [T], buckets: &[Range<usize>]) -> Vec<Option<&'a mut [T]>> {
    if buf.is_empty() {
        return Vec::new();
    }
    buckets
        .iter()
        .map(|b| {
            let (s, rest) = std::mem::take(&mut buf).split_at_mut(b.len());
            buf = rest;
            Some(s)
        })
        .collect()
}

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
                1 => (0..model.groups())
                    .map(|g| {
                        let n = brgemm_primitives::guard::norm(
                            model.gradients_mut(g).iter().map(|s| &**s),
                        );
                        n * n
                    })
                    .sum::<f64>()
                    .sqrt(),
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
        let mut buf = self.send.clone();
        let mut buf16 = self.bf16.as_ref().map_or(Vec::new(), |w| w.send.clone());
        let bf16 = self.bf16.as_ref().map(|w| &w.op);
        for _ in 0..reps.max(1) {
            self.world.barrier();
            let s = Instant::now();
            for b in &self.buckets {
                match bf16 {
                    None => {
                        let send = buf[b.clone()].to_vec();
                        self.world.all_reduce_into(
                            &send[..],
                            &mut buf[b.clone()],
                            SystemOperation::sum(),
                        );
                    }
                    Some(op) => {
                        let send = buf16[b.clone()].to_vec();
                        self.world
                            .all_reduce_into(&send[..], &mut buf16[b.clone()], op);
                    }
                }
            }
            t.push(s.elapsed().as_secs_f64());
        }
        t.sort_by(f64::total_cmp);
        self.stats = CommStats {
            standalone_s: t[t.len() / 2],
            ..CommStats::default()
        };
        self.stats.standalone_s
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
        let (slots, buckets) = (&self.slots, &self.buckets);
        let world = &self.world;
        let (send, recv) = (&mut self.send, &mut self.recv);
        let (bf16, send16, recv16) = match &mut self.bf16 {
            Some(w) => (Some(&w.op), &mut w.send[..], &mut w.recv[..]),
            None => (None, &mut [][..], &mut [][..]),
        };
        let mut first_start: Option<Instant> = None;
        let (mut backward_end, mut wait_end) = (Instant::now(), Instant::now());
        let loss = mpi::request::scope(|scope| -> Result<f32> {
            // Per bucket, its send and receive slices, taken when it starts
            // (the bf16 wire's too; none with f32).
            let (mut sends, mut recvs) = (by_bucket(send, buckets), by_bucket(recv, buckets));
            let (mut sends16, mut recvs16) =
                (by_bucket(send16, buckets), by_bucket(recv16, buckets));
            let (mut pending, mut pending16) = (Vec::new(), Vec::new());
            let mut filled = vec![0usize; buckets.len()];
            let loss = model.compute_gradients_with(pool, x, labels, &mut |group, grads| {
                let slot = slots
                    .iter()
                    .find(|s| s.group == group)
                    .expect("every group has a slot");
                let b = slot.bucket;
                let mut at = slot.offset - buckets[b].start;
                let dst = sends[b]
                    .as_mut()
                    .expect("bucket not started before its groups are in");
                for g in grads.iter() {
                    for (d, v) in dst[at..at + g.len()].iter_mut().zip(g.iter()) {
                        *d = v * scale;
                    }
                    at += g.len();
                }
                filled[b] += slot.len();
                if filled[b] == buckets[b].len() {
                    let s: &[f32] = sends[b].take().unwrap();
                    first_start.get_or_insert_with(Instant::now);
                    match bf16 {
                        None => {
                            let r = recvs[b].take().unwrap();
                            pending.push(world.immediate_all_reduce_into(
                                scope,
                                s,
                                r,
                                SystemOperation::sum(),
                            ));
                        }
                        Some(op) => {
                            let s16 = sends16[b].take().unwrap();
                            s16.iter_mut().zip(s).for_each(|(d, v)| *d = to_bf16(*v));
                            let r16 = recvs16[b].take().unwrap();
                            pending16.push(world.immediate_all_reduce_into(scope, &*s16, r16, op));
                        }
                    }
                }
                // Drive progress of the buckets already in flight.
                pending = std::mem::take(&mut pending)
                    .into_iter()
                    .filter_map(|r| r.test().err())
                    .collect();
                pending16 = std::mem::take(&mut pending16)
                    .into_iter()
                    .filter_map(|r| r.test().err())
                    .collect();
            })?;
            backward_end = Instant::now();
            for r in pending {
                r.wait();
            }
            for r in pending16 {
                r.wait();
            }
            wait_end = Instant::now();
            Ok(loss)
        })?;
        if first_start.is_some() {
            self.stats.steps += 1;
            self.stats.exposed_s += (wait_end - backward_end).as_secs_f64();
        }
        if let Some(w) = &self.bf16 {
            self.recv
                .iter_mut()
                .zip(&w.recv)
                .for_each(|(d, b)| *d = widen(*b));
        }
        // The summed (already scaled) gradients replace the local ones.
        for slot in &self.slots {
            let mut at = slot.offset;
            for g in model.gradients_mut(slot.group) {
                let n = g.len();
                g.copy_from_slice(&self.recv[at..at + n]);
                at += n;
            }
        }
        let mut global_loss = 0.0f32;
        self.world
            .all_reduce_into(&(loss * scale), &mut global_loss, SystemOperation::sum());
        let recv = std::mem::take(&mut self.recv);
        let out = self.finish_step(model, global_loss, &recv, opt);
        self.recv = recv;
        out
    }
}
