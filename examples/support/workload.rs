//! Shared set-up for the benchmarks (`benches/brgemm.rs`, `examples/bench.rs`
//! and `examples/tune.rs` include this file by path; it needs the
//! dev-dependency `gemm`): the L2-sized BRGEMM workload, and timing with the
//! reference probes sampled between the samples.
//!
//! A BRGEMM benchmark that calls one kernel on one block measures a hot L1
//! loop no primitive ever runs. [`BrgemmWorkload`] instead holds several
//! distinct blocks (each its own batch of A_i, B_i and its own C) sized so the
//! whole set lives in L2, and one pass calls the kernel once per block, as a
//! primitive's loop nest does. Its buffers are 64-byte aligned
//! ([`brgemm::AlignedVec`]), as the primitives' packed operands are.

use brgemm::{AlignedVec, BatchForm, Descriptor, Kernel, RawBatch};
use brgemm_primitives::Pool;
use std::time::{Duration, Instant};

/// Several independent BRGEMM problems of one shape, together about `l2_bytes`.
pub struct BrgemmWorkload {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Pairs per call.
    pub batch: usize,
    /// Distinct C blocks per pass.
    pub blocks: usize,
    a: AlignedVec<f32>,
    b: AlignedVec<f32>,
    c: AlignedVec<f32>,
    a_offs: Vec<usize>,
    b_offs: Vec<usize>,
    a_ptrs: Vec<*const f32>,
    b_ptrs: Vec<*const f32>,
}

impl BrgemmWorkload {
    /// Builds the blocks, filled with small deterministic values.
    pub fn new(m: usize, n: usize, k: usize, batch: usize, l2_bytes: usize) -> Self {
        let per_block = 4 * (batch * (m * k + k * n) + m * n);
        let blocks = (l2_bytes / per_block).clamp(2, 512);
        let (sa, sb) = (m * k, k * n);
        let fill = |len: usize, seed: usize| {
            AlignedVec::from_iter(
                brgemm::buffer::ALIGN,
                (0..len).map(|i| (((i * 7 + seed) % 13) as f32 - 6.0) / 8.0),
            )
        };
        let a = fill(blocks * batch * sa, 1);
        let b = fill(blocks * batch * sb, 5);
        let c = brgemm::aligned_vec(blocks * m * n, 0.0);
        let a_offs = (0..batch).map(|i| i * sa).collect();
        let b_offs = (0..batch).map(|i| i * sb).collect();
        let mut w = BrgemmWorkload {
            m,
            n,
            k,
            batch,
            blocks,
            a,
            b,
            c,
            a_offs,
            b_offs,
            a_ptrs: vec![],
            b_ptrs: vec![],
        };
        for j in 0..blocks {
            for i in 0..batch {
                w.a_ptrs.push(w.a[(j * batch + i) * sa..].as_ptr());
                w.b_ptrs.push(w.b[(j * batch + i) * sb..].as_ptr());
            }
        }
        w
    }

    /// The descriptor of every block for `form` (beta = 0, no epilogue).
    pub fn descriptor(&self, form: BatchForm) -> Descriptor {
        Descriptor::new(self.m, self.n, self.k).batch_form(form)
    }

    /// Floating-point operations of one [`BrgemmWorkload::pass`].
    pub fn flops_per_pass(&self) -> f64 {
        2.0 * (self.m * self.n * self.k * self.batch * self.blocks) as f64
    }

    /// Calls `kernel` once per block. The kernel must have been planned from
    /// [`BrgemmWorkload::descriptor`] (any form, any ISA).
    pub fn pass(&mut self, kernel: &Kernel) {
        let (sa, sb, sc) = (self.m * self.k, self.k * self.n, self.m * self.n);
        let form = kernel.descriptor().batch_form;
        for j in 0..self.blocks {
            let a = self.a[j * self.batch * sa..].as_ptr();
            let b = self.b[j * self.batch * sb..].as_ptr();
            let batch = match form {
                BatchForm::Offset => RawBatch::Offset {
                    a,
                    b,
                    a_offs: self.a_offs.as_ptr(),
                    b_offs: self.b_offs.as_ptr(),
                    count: self.batch,
                },
                BatchForm::Address => RawBatch::Address {
                    a: self.a_ptrs[j * self.batch..].as_ptr(),
                    b: self.b_ptrs[j * self.batch..].as_ptr(),
                    count: self.batch,
                },
                _ => RawBatch::Stride {
                    a,
                    b,
                    count: self.batch,
                },
            };
            // SAFETY: block j owns batch*sa elements of A, batch*sb of B and
            // sc of C, which is what a descriptor from `descriptor` touches.
            unsafe { kernel.execute_raw(batch, self.c[j * sc..].as_mut_ptr(), std::ptr::null()) };
        }
    }

    /// The same work as a loop of ordinary GEMM calls (the `gemm` crate, one
    /// thread): per block, C = A_0 B_0, then C += A_i B_i.
    pub fn pass_gemm_crate(&mut self) {
        let (m, n, k) = (self.m, self.n, self.k);
        let (sa, sb, sc) = (m * k, k * n, m * n);
        for j in 0..self.blocks {
            for i in 0..self.batch {
                let a = self.a[(j * self.batch + i) * sa..].as_ptr();
                let b = self.b[(j * self.batch + i) * sb..].as_ptr();
                let c = self.c[j * sc..].as_mut_ptr();
                // SAFETY: column-major m x k, k x n and m x n blocks inside the
                // vectors; gemm's (alpha, beta) = (scale of dst, of product).
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c,
                        m as isize,
                        1,
                        i > 0,
                        a,
                        m as isize,
                        1,
                        b,
                        k as isize,
                        1,
                        1.0f32,
                        1.0f32,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    )
                };
            }
        }
    }
}

/// The two references a bench line is compared with, sampled between the
/// samples of the work: the register-only FMA peak ([`Probe`]) and the L1
/// ceiling of the ISA's main tile ([`TileCeiling`]).
///
/// [`Probe`]: brgemm::peak::Probe
/// [`TileCeiling`]: brgemm::peak::TileCeiling
pub struct Probes {
    /// FMA-port peak.
    pub fma: brgemm::peak::Probe,
    /// Main tile on L1-resident operands.
    pub tile: brgemm::peak::TileCeiling,
    /// The best of a few one-thread FMA slices at start: what one core gives.
    one_core: f64,
}

/// A multi-thread sample counts only once the FMA probe on all the pool's
/// threads at once reads at least this share of `threads` x one core.
const ALL_CORES: f64 = 0.75;
/// How many probe rounds (of one slice each) to wait for that at most.
const MAX_WAIT_ROUNDS: usize = 200;

impl Probes {
    /// Both probes for `isa`, each slice lasting about `slice`.
    pub fn new(isa: brgemm::Isa, slice: Duration) -> Probes {
        let fma = brgemm::peak::Probe::new(isa, slice).expect("supported ISA");
        let one_core = (0..5).map(|_| fma.sample()).fold(0.0, f64::max);
        Probes {
            fma,
            tile: brgemm::peak::TileCeiling::new(isa, slice).expect("supported ISA"),
            one_core,
        }
    }
    /// Waits until every thread of `pool` has a core of its own: the FMA
    /// probe run on all of them at once reads at least [`ALL_CORES`] of the
    /// sum of single cores (at most [`MAX_WAIT_ROUNDS`] slices, ~2 s). The
    /// 2-core VM here at times loses its second vCPU to the host for
    /// seconds; a sample taken then measures the host's scheduling (a
    /// "2-thread" speed-up of 1.0), not the work. Returns the last reading.
    pub fn wait_for_cores(&self, pool: &Pool) -> f64 {
        let want = ALL_CORES * pool.threads() as f64 * self.one_core;
        let mut got = on_every_thread(pool, || self.fma.sample());
        for _ in 0..MAX_WAIT_ROUNDS {
            if pool.threads() == 1 || got >= want {
                break;
            }
            got = on_every_thread(pool, || self.fma.sample());
        }
        got
    }
    /// One slice of each on this thread: (FMA peak, tile ceiling) in GFLOP/s.
    pub fn sample(&self) -> (f64, f64) {
        (self.fma.sample(), self.tile.sample())
    }
    /// One slice of each on every thread of `pool` at once, summed: the
    /// references for work spread over those threads (the FMA units of two
    /// cores add up; a shared one would not).
    pub fn sample_pool(&self, pool: &Pool) -> (f64, f64) {
        (
            self.wait_for_cores(pool),
            on_every_thread(pool, || self.tile.sample()),
        )
    }
}

/// `f` on every thread of `pool` at once; the sum of what they return.
pub fn on_every_thread(pool: &Pool, f: impl Fn() -> f64 + Sync) -> f64 {
    let got = std::sync::Mutex::new(0.0f64);
    pool.broadcast(|_| {
        let g = f();
        *got.lock().unwrap() += g;
    });
    got.into_inner().unwrap()
}

/// A measurement: median seconds per call, and the medians of the probe
/// slices interleaved with the samples (same clock, same neighbours).
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Median seconds per call of the work.
    pub secs: f64,
    /// Median GFLOP/s of the FMA peak probe.
    pub peak_gflops: f64,
    /// Median GFLOP/s of the main tile on L1-resident operands.
    pub tile_l1_gflops: f64,
    /// Median over the samples of seconds x the tile slice just before it:
    /// the work's share of the ceiling is judged pair by pair, since the
    /// machine's state changes between samples (see [`Measured::pct_tile_l1`]).
    pub secs_x_tile: f64,
}

impl Measured {
    /// `gflops` (the work at [`Measured::secs`]) as a percentage of the L1
    /// tile ceiling: the median of the per-sample ratios.
    pub fn pct_tile_l1(&self, gflops: f64) -> f64 {
        100.0 * gflops * self.secs / self.secs_x_tile
    }
    /// `gflops` (the work at [`Measured::secs`]) as a percentage of the FMA peak.
    pub fn pct_peak(&self, gflops: f64) -> f64 {
        100.0 * gflops / self.peak_gflops
    }
    /// The bench lines' reference fields for `gflops` (the work at
    /// [`Measured::secs`]): `"peak_gflops":..,"pct_peak":..,"tile_l1_gflops":..,"pct_tile_l1":..`.
    pub fn json(&self, gflops: f64) -> String {
        format!(
            r#""peak_gflops":{:.1},"pct_peak":{:.1},"tile_l1_gflops":{:.1},"pct_tile_l1":{:.1}"#,
            self.peak_gflops,
            self.pct_peak(gflops),
            self.tile_l1_gflops,
            self.pct_tile_l1(gflops)
        )
    }
}

/// Per-sample seconds with the reference slices taken just before each.
struct Samples {
    secs: Vec<f64>,
    peaks: Vec<f64>,
    tiles: Vec<f64>,
}

impl Samples {
    fn new(n: usize) -> Samples {
        Samples {
            secs: Vec::with_capacity(n),
            peaks: Vec::with_capacity(n),
            tiles: Vec::with_capacity(n),
        }
    }
    fn push(&mut self, secs: f64, (peak, tile): (f64, f64)) {
        self.secs.push(secs);
        self.peaks.push(peak);
        self.tiles.push(tile);
    }
    fn measured(mut self) -> Measured {
        let mut pairs: Vec<f64> = self
            .secs
            .iter()
            .zip(&self.tiles)
            .map(|(s, t)| s * t)
            .collect();
        Measured {
            secs: median(&mut self.secs),
            peak_gflops: median(&mut self.peaks),
            tile_l1_gflops: median(&mut self.tiles),
            secs_x_tile: median(&mut pairs),
        }
    }
}

/// Times `f`: calibrates a repetition count so a sample lasts `min_sample`,
/// then takes `samples` samples, each preceded by one peak-probe slice.
pub fn measure(
    mut f: impl FnMut(),
    probe: &Probes,
    min_sample: Duration,
    samples: usize,
) -> Measured {
    let mut reps = 1usize;
    loop {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        if t.elapsed() >= min_sample {
            break;
        }
        reps *= 2;
    }
    let mut out = Samples::new(samples.max(1));
    for _ in 0..samples.max(1) {
        let refs = probe.sample();
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        out.push(t.elapsed().as_secs_f64() / reps as f64, refs);
    }
    out.measured()
}

/// Times `f`, work spread over `pool`: one warm-up call (first touch of
/// buffers, kernel caches), then `samples` single calls, each preceded by
/// the references on all of the pool's threads at once and then by one
/// untimed call, so that the timed one finds its operands where the call
/// before it left them, as a pass in a training loop does.
///
/// Without that call a short pass pays for the reference slices: after an
/// FMA or a tile slice of a few milliseconds (no memory traffic of their
/// own) the weights of FC (16, 1024, 1024), 4 MiB, no longer come from the
/// shared L3 of this VM. fwd/bwd/upd on 2 threads (Zen 4, three runs each,
/// alternating in one session): 44-71% of peak timed right after the
/// references, 72-94% with the untimed call between; waking the pool's
/// workers instead of that call: 49-60%; the call and then a slice again:
/// 50-75%. Passes of a few milliseconds and more moved within noise.
/// Calls of 20 ms and more (the ResNet-50 step) skip the untimed call: it
/// would double their bench time for nothing measurable.
pub fn measure_pool(mut f: impl FnMut(), pool: &Pool, probe: &Probes, samples: usize) -> Measured {
    let t = Instant::now();
    f();
    let short = t.elapsed() < Duration::from_millis(20);
    let mut out = Samples::new(samples.max(1));
    for _ in 0..samples.max(1) {
        let refs = probe.sample_pool(pool);
        if short {
            f();
        }
        let t = Instant::now();
        f();
        out.push(t.elapsed().as_secs_f64(), refs);
    }
    out.measured()
}

/// The speed-up of `many` over `one` thread at the same moments: `f` runs
/// on each pool in turn, `samples` pairs (each once [`Probes::wait_for_cores`]
/// sees all of `many`'s cores), and the median of the per-pair time ratios
/// is returned. Two lines measured minutes apart on this machine can differ
/// by 20-50% whatever the thread count, so a ratio of their GFLOP/s says
/// little about scaling.
///
/// Each timed call follows an untimed one on the same pool, so it runs as
/// one pass of a loop on that pool does: the pool's workers awake, its
/// threads' shares of the operands in their own caches. Timing the first
/// call after the switch instead charges the many-thread call with waking a
/// worker that slept through the one-thread call (~30 us on this VM) and
/// with fetching what the single thread last wrote from its core; on
/// (256, 1024, 1024) that read 1.89/1.91/1.93 where this reads
/// 1.95/1.97/1.98 (fwd/bwd/upd, medians of 8 rounds alternating the two
/// ways in one process).
pub fn speedup(
    mut f: impl FnMut(&Pool),
    one: &Pool,
    many: &Pool,
    probe: &Probes,
    samples: usize,
) -> f64 {
    let mut r: Vec<f64> = (0..samples.max(1))
        .map(|_| {
            probe.wait_for_cores(many);
            f(one);
            let t = Instant::now();
            f(one);
            let s1 = t.elapsed().as_secs_f64();
            f(many);
            let t = Instant::now();
            f(many);
            s1 / t.elapsed().as_secs_f64()
        })
        .collect();
    median(&mut r)
}

/// The median (upper median for even lengths).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
