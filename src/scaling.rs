//! The cost model of a data-parallel step: when each gradient bucket is
//! ready, what its all-reduce costs on a link, and what the step then takes.
//!
//! Ring all-reduce of `B` bytes over `p` nodes, one message in flight:
//!
//! ```text
//!   t(B, p) = 2 (p - 1) * latency + 2 (p - 1) / p * B / bandwidth
//! ```
//!
//! A step (weak scaling: the same rows per node) runs forward, then
//! backward from the last layer down; a bucket's all-reduce starts when its
//! last gradient is ready or when the link is free, whichever is later, and
//! the buckets cross the link one after another. The step ends when
//! backward and the last all-reduce have both finished, plus its tail (the
//! gradients copied back, the optimizer).
//! A link may also cost the nodes' cores time (`host_s_per_byte`: the
//! TCP/IP stack and MPI's copies and sums where no NIC offloads them): the
//! part of an all-reduce that runs while backward computes then delays
//! backward by that share of its host cost. `examples/scaling_model` projects measured
//! per-layer times to many nodes with it; `bench mpi --cluster` checks its
//! prediction against steps measured over the emulated cluster
//! (`scripts/cluster.sh`).

/// A link between nodes: latency per message and bandwidth each way.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Seconds per message (half a round trip of a small message).
    pub latency_s: f64,
    /// Bytes per second each way.
    pub bytes_per_s: f64,
    /// Seconds of a node's core per all-reduced byte, taken from the
    /// computation it overlaps (0: the NIC does the work).
    pub host_s_per_byte: f64,
}

impl Link {
    /// A link of `gbps` gigabits per second and `latency_us` microseconds.
    pub fn new(gbps: f64, latency_us: f64) -> Link {
        Link {
            latency_s: latency_us * 1e-6,
            bytes_per_s: gbps * 1e9 / 8.0,
            host_s_per_byte: 0.0,
        }
    }

    /// This link with a host cost of `us_per_mb` microseconds of a core
    /// per MB all-reduced.
    pub fn with_host_cost(self, us_per_mb: f64) -> Link {
        Link {
            host_s_per_byte: us_per_mb * 1e-12,
            ..self
        }
    }

    /// The bandwidth in Gb/s.
    pub fn gbps(&self) -> f64 {
        self.bytes_per_s * 8.0 / 1e9
    }

    /// Seconds of a ring all-reduce of `bytes` over `nodes` nodes (0 for
    /// one node).
    pub fn ring_allreduce_s(&self, bytes: f64, nodes: usize) -> f64 {
        if nodes <= 1 {
            return 0.0;
        }
        let p = nodes as f64;
        2.0 * (p - 1.0) * self.latency_s + 2.0 * (p - 1.0) / p * bytes / self.bytes_per_s
    }

    /// The smallest bucket whose all-reduce spends at most a tenth of its
    /// time on latency (`2 (p-1) lat <= 0.1 * 2 (p-1)/p * B / bw`, so
    /// `B >= 10 p lat bw`), at least 64 KiB: smaller buckets start sooner
    /// under backward, but each pays the latency.
    pub fn bucket_bytes(&self, nodes: usize) -> usize {
        let b = 10.0 * nodes.max(2) as f64 * self.latency_s * self.bytes_per_s;
        (b as usize).max(64 << 10)
    }
}

/// When one step's gradients are ready, measured on one node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timeline {
    /// Per gradient group in the order backward completes them: seconds
    /// from the start of the step (forward included) to its being ready,
    /// and its size in bytes.
    pub ready: Vec<(f64, f64)>,
    /// Seconds from the start of the step to the end of backward.
    pub backward_end: f64,
    /// Seconds of the step's tail after backward and the all-reduce: the
    /// gradients copied back, the optimizer.
    pub tail: f64,
}

/// What [`Timeline::predict`] expects of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Seconds per step.
    pub step_s: f64,
    /// Seconds the step waits for the link after backward.
    pub exposed_s: f64,
    /// Seconds backward is delayed by the host cost of the all-reduces it
    /// overlaps.
    pub host_delay_s: f64,
    /// The all-reduces of the buckets one after another, nothing else.
    pub allreduce_s: f64,
    /// Per bucket: whether its all-reduce ends after backward does.
    pub bucket_exposed: Vec<bool>,
}

impl Timeline {
    /// The step on `nodes` nodes over `link`, the groups sent in `buckets`
    /// (each a count of consecutive groups of [`Timeline::ready`]; they
    /// must add up to its length).
    ///
    /// # Panics
    /// If the bucket counts do not add up to the number of groups.
    pub fn predict(&self, buckets: &[usize], nodes: usize, link: &Link) -> Prediction {
        assert_eq!(
            buckets.iter().sum::<usize>(),
            self.ready.len(),
            "buckets must cover every group once"
        );
        let (mut net_free, mut first, mut alone) = (0.0f64, 0usize, 0.0);
        // Backward's delay so far: the host cost of the transfers it overlapped.
        let mut delay = 0.0f64;
        let mut ends = Vec::with_capacity(buckets.len());
        for &n in buckets {
            let groups = &self.ready[first..first + n];
            first += n;
            let ready = groups.iter().map(|g| g.0).fold(0.0, f64::max) + delay;
            let bytes: f64 = groups.iter().map(|g| g.1).sum();
            let t = link.ring_allreduce_s(bytes, nodes);
            alone += t;
            let start = ready.max(net_free);
            if t > 0.0 {
                let overlap = ((self.backward_end + delay - start) / t).clamp(0.0, 1.0);
                delay += overlap * link.host_s_per_byte * bytes;
            }
            net_free = start + t;
            ends.push(net_free);
        }
        let backward_end = self.backward_end + delay;
        let comm_end = if nodes > 1 { net_free } else { 0.0 };
        Prediction {
            step_s: backward_end.max(comm_end) + self.tail,
            exposed_s: (comm_end - backward_end).max(0.0),
            host_delay_s: delay,
            allreduce_s: alone,
            bucket_exposed: ends
                .iter()
                .map(|&e| nodes > 1 && e > backward_end + 1e-12)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_cost_and_bucket_size_follow_the_formula() {
        let l = Link::new(10.0, 50.0);
        assert_eq!(l.ring_allreduce_s(1e6, 1), 0.0);
        // p = 2: 2 lat + B / bw.
        let t = l.ring_allreduce_s(1.25e6, 2);
        assert!((t - (100e-6 + 1e-3)).abs() < 1e-12, "{t}");
        // p = 4: 6 lat + 1.5 B / bw.
        let t = l.ring_allreduce_s(1.25e6, 4);
        assert!((t - (300e-6 + 1.5e-3)).abs() < 1e-12, "{t}");
        assert_eq!(l.bucket_bytes(2), 1_250_000);
        assert_eq!(Link::new(0.1, 1.0).bucket_bytes(2), 64 << 10);
        assert!((l.gbps() - 10.0).abs() < 1e-12);
    }

    #[test]
    fn a_step_hides_what_fits_under_backward_and_waits_for_the_rest() {
        // Two groups ready at 2 ms and 5 ms, backward over at 6 ms.
        let tl = Timeline {
            ready: vec![(2e-3, 1.25e6), (5e-3, 1.25e6)],
            backward_end: 6e-3,
            tail: 1e-3,
        };
        let link = Link::new(10.0, 0.0); // 1 ms per 1.25 MB at p = 2
        let one = tl.predict(&[1, 1], 1, &link);
        assert_eq!(one.step_s, 7e-3);
        assert_eq!(one.bucket_exposed, vec![false, false]);
        // Separate buckets: 2-3 ms and 5-6 ms, both under backward.
        let p = tl.predict(&[1, 1], 2, &link);
        assert!((p.step_s - 7e-3).abs() < 1e-12 && p.exposed_s < 1e-12);
        assert!((p.allreduce_s - 2e-3).abs() < 1e-12);
        // One bucket: starts at 5 ms, ends at 7 ms, 1 ms past backward.
        let p = tl.predict(&[2], 2, &link);
        assert!((p.step_s - 8e-3).abs() < 1e-12, "{}", p.step_s);
        assert!((p.exposed_s - 1e-3).abs() < 1e-12);
        assert_eq!(p.bucket_exposed, vec![true]);
        // A slow link queues the second bucket behind the first.
        let slow = Link::new(2.5, 0.0); // 4 ms each
        let p = tl.predict(&[1, 1], 2, &slow);
        assert!((p.step_s - 11e-3).abs() < 1e-12, "{}", p.step_s);
        // A host cost of 400 us per MB: the first bucket (1.25 MB, 2-3 ms)
        // delays backward by 0.5 ms, so the second is ready at 5.5 ms and
        // runs (5.5-6.5 ms) wholly under backward, which it delays by 0.5 ms
        // more: backward ends at 7 ms.
        let p = tl.predict(&[1, 1], 2, &link.with_host_cost(400.0));
        assert!((p.host_delay_s - 1e-3).abs() < 1e-12, "{}", p.host_delay_s);
        assert!((p.step_s - 8e-3).abs() < 1e-12, "{}", p.step_s);
        assert_eq!(p.bucket_exposed, vec![false, false]);
        // Where the second starts past backward's end, none of it is charged.
        let late = Timeline {
            ready: vec![(2e-3, 1.25e6), (6e-3, 1.25e6)],
            ..tl.clone()
        };
        let p = late.predict(&[1, 1], 2, &link.with_host_cost(400.0));
        assert!(
            (p.host_delay_s - 0.5e-3).abs() < 1e-12,
            "{}",
            p.host_delay_s
        );
        assert_eq!(p.bucket_exposed, vec![false, true]);
    }
}
