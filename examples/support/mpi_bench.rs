//! `bench mpi`: weak scaling of data-parallel training, one thread per rank
//! and a fixed batch per rank, for the MLP, the CNN and the small ResNet.
//!
//! ```text
//! mpirun -np R target/release/examples/bench mpi [--progress layers|loop[:US]|thread[:US]]
//!     [--bucket-kb N] [--models mlp,cnn,resnet] [--link-gbps G]
//! target/release/examples/bench mpi --cluster [--gbps 1,10,25] [--nodes 1,2] [--mtu M] [same flags]
//! ```
//!
//! Rank 0 prints a line per model: samples/s, the step and the same step
//! run without communication on every rank at once (`local_step_ms`), the
//! step's gradient all-reduce run alone (`allreduce_ms`) and the share of
//! it hidden under backward (`hidden` = 1 - (step - local step) /
//! all-reduce alone), and the step [`brgemm_dl::scaling`] predicts from
//! this rank's own measured timeline (when each gradient group was ready in
//! a local step) on the link as measured by MPI's all-reduce of one word
//! (latency) and of 4 MiB (bandwidth); `predicted_nominal_step_ms` uses the
//! link's nominal rate instead.
//!
//! `--cluster` (root) brings up the emulated cluster of
//! `scripts/cluster.sh` for each link rate and node count, runs the ranks
//! over it with mpirun (one rank per node, TCP only), passes its lines on
//! (2-node lines gain `vs_twice_one_node`: samples/s over twice the 1-node
//! line's at the same rate) and takes the cluster down, also on failure.

use std::time::{Duration, Instant};

/// The value after `--name`, if given.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).map(|i| {
        args.get(i + 1).map(String::as_str).unwrap_or_else(|| {
            eprintln!("bench mpi: {name} needs a value");
            std::process::exit(2)
        })
    })
}

/// A comma-separated list after `--name`, or `default`.
fn list<T: std::str::FromStr>(args: &[String], name: &str, default: &str) -> Vec<T> {
    flag(args, name)
        .unwrap_or(default)
        .split(',')
        .map(|v| {
            v.trim().parse().unwrap_or_else(|_| {
                eprintln!("bench mpi: {name} {v:?}: not a valid value");
                std::process::exit(2)
            })
        })
        .collect()
}

/// The flags the ranks take, passed on by the cluster driver.
const RANK_FLAGS: [&str; 3] = ["--progress", "--bucket-kb", "--models"];

pub fn bench(args: &[String]) {
    if args.iter().any(|a| a == "--cluster") && std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() {
        return drive_cluster(args);
    }
    ranks::run(args)
}

/// Takes the cluster down when dropped (also when a run fails).
struct Cluster(&'static str);

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::process::Command::new(self.0).arg("down").output();
    }
}

fn drive_cluster(args: &[String]) {
    use std::process::{Command, Stdio};
    let script: &'static str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/cluster.sh");
    let rates: Vec<f64> = list(args, "--gbps", "1,10,25");
    let nodes: Vec<usize> = list(args, "--nodes", "1,2");
    let exe = std::env::current_exe().expect("this program's path");
    let mut passed: Vec<String> = Vec::new();
    for f in RANK_FLAGS {
        if let Some(v) = flag(args, f) {
            passed.extend([f.to_string(), v.to_string()]);
        }
    }
    for &g in &rates {
        // samples/s of each model's 1-node line at this rate
        let mut one_node: Vec<(String, f64)> = Vec::new();
        for &n in &nodes {
            let mut up = Command::new(script);
            up.args(["up", &n.to_string(), "--gbps", &g.to_string()]);
            if let Some(m) = flag(args, "--mtu") {
                up.args(["--mtu", m]);
            }
            let up = up.stderr(Stdio::inherit()).output().unwrap_or_else(|e| {
                eprintln!("bench mpi --cluster: cannot run {script}: {e}");
                std::process::exit(2)
            });
            let _down = Cluster(script);
            let text = String::from_utf8_lossy(&up.stdout);
            let Some(margs) = text
                .lines()
                .rev()
                .find_map(|l| l.strip_prefix("mpirun_args="))
            else {
                eprintln!("bench mpi --cluster: `cluster.sh up {n} --gbps {g}` failed:\n{text}");
                std::process::exit(2)
            };
            let mut child = Command::new("mpirun")
                .args(margs.split_whitespace())
                .args(["-np", &n.to_string()])
                .arg(&exe)
                .args(["mpi", "--link-gbps", &g.to_string()])
                .args(&passed)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("mpirun (apt-get install openmpi-bin)");
            let out = wait_with_limit(&mut child, Duration::from_secs(600));
            for line in out.lines().filter(|l| l.starts_with('{')) {
                let model = field(line, "model").unwrap_or_default();
                let sps: f64 = field(line, "samples_per_s")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0.0);
                if n == 1 {
                    one_node.push((model, sps));
                    println!("{line}");
                } else if let Some((_, base)) = one_node.iter().find(|(m, _)| *m == model) {
                    let body = line.trim_end_matches('}');
                    println!(
                        r#"{body},"vs_twice_one_node":{:.3}}}"#,
                        sps / (n as f64 * base)
                    );
                } else {
                    println!("{line}");
                }
            }
        }
    }
}

/// The child's stdout; killed after `limit` (the job hung).
fn wait_with_limit(child: &mut std::process::Child, limit: Duration) -> String {
    use std::io::Read;
    let mut out = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                if !status.success() {
                    eprintln!("bench mpi --cluster: mpirun ended with {status}");
                }
                break;
            }
            Ok(None) if t.elapsed() > limit => {
                eprintln!("bench mpi --cluster: mpirun ran past {limit:?}; killed");
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    reader.join().unwrap_or_default()
}

/// A JSON line's value of `"key":` as text (strings without quotes).
fn field(line: &str, key: &str) -> Option<String> {
    let at = line.find(&format!("\"{key}\":"))? + key.len() + 3;
    let rest = &line[at..];
    Some(if let Some(s) = rest.strip_prefix('"') {
        s[..s.find('"')?].to_string()
    } else {
        rest[..rest.find([',', '}'])?].to_string()
    })
}

mod ranks {
    use super::{flag, list};
    use brgemm_distributed::mpi::traits::*;
    use brgemm_distributed::mpi::{self, topology::SimpleCommunicator};
    use brgemm_distributed::{install_abort_on_panic, DataParallel, Progress};
    use brgemm_dl::scaling::{Link, Timeline};
    use brgemm_nn::models::{mlp, small_resnet, CnnSpec, LayerSpec, StageSpec};
    use brgemm_nn::{Graph, Mode, Tensor};
    use brgemm_primitives::optim::Optimizer;
    use brgemm_primitives::{progress, Activation, Fc, Pool};
    use mpi::collective::SystemOperation;
    use std::time::Instant;

    pub fn run(args: &[String]) {
        let (universe, _) = brgemm_distributed::initialize(mpi::Threading::Serialized)
            .expect("MPI initialises once");
        install_abort_on_panic();
        let world = universe.world();
        let progress: Progress = flag(args, "--progress")
            .map(|p| {
                p.parse().unwrap_or_else(|e| {
                    eprintln!("bench mpi: --progress {e}");
                    std::process::exit(2)
                })
            })
            .unwrap_or_default();
        let bucket_kb: Option<usize> = flag(args, "--bucket-kb").map(|v| {
            v.parse().ok().filter(|&k| k > 0).unwrap_or_else(|| {
                eprintln!("bench mpi: --bucket-kb {v:?}: expected a positive number of KiB");
                std::process::exit(2)
            })
        });
        let nominal: Option<f64> = flag(args, "--link-gbps").map(|v| {
            v.parse()
                .ok()
                .filter(|&g: &f64| g > 0.0)
                .unwrap_or_else(|| {
                    eprintln!("bench mpi: --link-gbps {v:?}: expected a positive rate in Gb/s");
                    std::process::exit(2)
                })
        });
        let models: Vec<String> = list(args, "--models", "mlp,cnn,resnet");
        let link = measure_link(&world, progress);
        let rank = world.rank() as usize;
        for name in &models {
            let (mut model, rows, layers) = build(name);
            let mut x = Tensor::zeros(model.input_shape());
            x.data_mut()
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = ((i * 7 + rank) % 11) as f32 / 11.0);
            let labels: Vec<usize> = (0..rows).map(|i| (i + rank) % 10).collect();
            let bucket = bucket_kb.map_or_else(
                || link.map_or(1 << 20, |l| l.bucket_bytes(world.size() as usize)),
                |k| k << 10,
            );
            let mut dp = DataParallel::new(world.duplicate(), &mut model, bucket);
            dp.set_progress(progress).expect("progress strategy");
            let desc = Desc {
                model: name,
                layers,
                rows,
                bucket,
                nominal,
                link,
                progress,
            };
            line(&universe, &mut dp, &mut model, &x, &labels, &desc);
        }
    }

    /// A model of the bench, its rows per rank and a description.
    fn build(name: &str) -> (Graph, usize, &'static str) {
        match name {
            "mlp" => {
                let relu = |out| LayerSpec {
                    out,
                    act: Activation::Relu,
                };
                let specs = [
                    relu(1024),
                    relu(1024),
                    relu(1024),
                    LayerSpec {
                        out: 10,
                        act: Activation::Identity,
                    },
                ];
                (mlp(1024, 64, &specs, 1).expect("mlp"), 64, "1024-1024x3-10")
            }
            "cnn" => {
                // The CNN of train_cnn on 28x28 images.
                let spec = CnnSpec {
                    input: (1, 28, 28),
                    stages: [32, 64]
                        .iter()
                        .map(|&channels| StageSpec {
                            channels,
                            kernel: 3,
                            batchnorm: false,
                            pool: 2,
                        })
                        .collect(),
                    hidden: vec![128],
                    classes: 10,
                    dropout: 0.0,
                };
                (
                    spec.graph(32, 1).expect("cnn"),
                    32,
                    "conv3x3-32,pool,conv3x3-64,pool,fc128,fc10",
                )
            }
            "resnet" => (
                small_resnet(32, 10, 1).expect("resnet"),
                32,
                "small ResNet of train_resnet, 28x28",
            ),
            other => {
                eprintln!("bench mpi: --models {other:?}: expected mlp, cnn or resnet");
                std::process::exit(2)
            }
        }
    }

    /// The link as the trainer's all-reduce sees it (non-blocking, then
    /// wait): latency from one word (`t = 2 (p-1) lat`), bandwidth from
    /// 4 MiB (`t - 2 (p-1) lat = 2 (p-1)/p B / bw`), and the host cost: how
    /// much longer FC forward passes take while a 4 MiB all-reduce
    /// progresses under them, tested as `progress` tests (from the loop
    /// nests every interval; `layers`: not until they end), per byte. Medians of repeated runs, rank 0's figures on every
    /// rank. None on one rank.
    fn measure_link(world: &SimpleCommunicator, progress: Progress) -> Option<Link> {
        let p = world.size() as usize;
        if p == 1 {
            return None;
        }
        let agree = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let mut m = v[v.len() / 2];
            world.process_at_rank(0).broadcast_into(&mut m);
            m
        };
        let allreduce = |n: usize, reps: usize| {
            let send = vec![1.0f32; n];
            let mut recv = vec![0.0f32; n];
            agree(
                (0..reps)
                    .map(|_| {
                        world.barrier();
                        let s = Instant::now();
                        mpi::request::scope(|sc| {
                            world
                                .immediate_all_reduce_into(
                                    sc,
                                    &send[..],
                                    &mut recv[..],
                                    SystemOperation::sum(),
                                )
                                .wait();
                        });
                        s.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        };
        allreduce(1, 20);
        let pf = p as f64;
        let latency_s = allreduce(1, 101) / (2.0 * (pf - 1.0));
        let n = 1 << 20;
        let bytes = 4.0 * n as f64;
        let t = allreduce(n, 9);
        let wire = (t - 2.0 * (pf - 1.0) * latency_s).max(1e-9);

        // Host cost: k FC forwards (about 3x the all-reduce) alone and
        // with the all-reduce under them, in turn.
        let pool = Pool::new(1).expect("pool");
        let fc = Fc::new(64, 1024, 1024, Activation::Relu).expect("fc");
        let (mut x, mut w, mut y) = (fc.x_layout(), fc.w_layout(), fc.y_layout());
        x.data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 7) as f32 / 8.0);
        w.data_mut()
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = (i % 5) as f32 / 64.0);
        let b = vec![0.0; fc.padded_k()];
        let mut run = |k: usize| {
            for _ in 0..k {
                fc.forward(&pool, &x, &w, &b, &mut y, None)
                    .expect("fc forward");
            }
        };
        let s = Instant::now();
        run(20);
        let k = ((3.0 * t / (s.elapsed().as_secs_f64() / 20.0)).ceil() as usize).max(4);
        let (send, mut recv) = (vec![1.0f32; n], vec![0.0f32; n]);
        let (mut alone, mut with) = (vec![], vec![]);
        for _ in 0..5 {
            world.barrier();
            let s = Instant::now();
            run(k);
            alone.push(s.elapsed().as_secs_f64());
            world.barrier();
            mpi::request::scope(|sc| {
                let mut req = Some(world.immediate_all_reduce_into(
                    sc,
                    &send[..],
                    &mut recv[..],
                    SystemOperation::sum(),
                ));
                let every = match progress {
                    Progress::LoopNest { interval_us } | Progress::Thread { interval_us } => {
                        f64::from(interval_us) * 1e-6
                    }
                    Progress::Layers => f64::INFINITY,
                };
                let mut last = Instant::now();
                let mut hook = || {
                    if last.elapsed().as_secs_f64() >= every {
                        last = Instant::now();
                        if let Some(r) = req.take() {
                            req = r.test().err();
                        }
                    }
                };
                let s = Instant::now();
                progress::with_hook(&mut hook, || run(k));
                with.push(s.elapsed().as_secs_f64());
                if let Some(r) = req.take() {
                    r.wait();
                }
            });
        }
        let host = (agree(with) - agree(alone)).max(0.0) / bytes;
        Some(Link {
            latency_s,
            bytes_per_s: 2.0 * (pf - 1.0) / pf * bytes / wire,
            host_s_per_byte: host,
        })
    }

    struct Desc<'a> {
        model: &'a str,
        layers: &'static str,
        rows: usize,
        bucket: usize,
        nominal: Option<f64>,
        link: Option<Link>,
        progress: Progress,
    }

    /// One step of the trainer without its all-reduce, timed
    /// ([`DataParallel::local_step_times`]), as the model's timeline; and
    /// backward alone (its end less a forward run before it).
    fn timeline(
        dp: &mut DataParallel,
        model: &mut Graph,
        pool: &Pool,
        x: &Tensor,
        labels: &[usize],
        global: usize,
        opt: &Optimizer,
    ) -> (Timeline, f64) {
        let t = Instant::now();
        model.forward(pool, x, Mode::Train).expect("forward");
        let forward = t.elapsed().as_secs_f64();
        let st = dp
            .local_step_times(model, pool, x, labels, global, opt)
            .expect("local step");
        let tl = Timeline {
            ready: st.ready.iter().map(|&(t, b)| (t, b as f64)).collect(),
            backward_end: st.backward_end,
            tail: st.finish,
        };
        (tl, st.backward_end - forward)
    }

    fn line(
        universe: &mpi::environment::Universe,
        dp: &mut DataParallel,
        model: &mut Graph,
        x: &Tensor,
        labels: &[usize],
        d: &Desc,
    ) {
        let world = universe.world();
        let size = world.size() as usize;
        let pool = Pool::new(1).expect("pool");
        dp.broadcast_parameters(model);
        let opt = Optimizer::Sgd {
            lr: 1e-3,
            momentum: 0.9,
        };
        let global = d.rows * size;
        // The single-process step, guard and all: the same trainer over a
        // communicator of this rank alone.
        let alone_comm = world
            .split_by_color(mpi::topology::Color::with_value(world.rank()))
            .expect("a communicator of one");
        let mut solo = DataParallel::new(alone_comm, model, d.bucket);
        for _ in 0..3 {
            dp.train_step(model, &pool, x, labels, global, &opt)
                .expect("step");
            solo.train_step(model, &pool, x, labels, d.rows, &opt)
                .expect("step");
        }
        let alone = if size > 1 { dp.calibrate(9) } else { 0.0 };
        // DDP step, local step and a timeline run in turn, each on every
        // rank at once (same core and memory contention), medians of each:
        // this machine's speed drifts by more than a small all-reduce takes.
        let rounds = 25;
        let (mut ddp_t, mut local_t, mut runs) = (vec![], vec![], vec![]);
        for _ in 0..rounds {
            world.barrier();
            let t = Instant::now();
            dp.train_step(model, &pool, x, labels, global, &opt)
                .expect("step");
            ddp_t.push(t.elapsed().as_secs_f64());
            world.barrier();
            let t = Instant::now();
            solo.train_step(model, &pool, x, labels, d.rows, &opt)
                .expect("step");
            local_t.push(t.elapsed().as_secs_f64());
            world.barrier();
            runs.push(timeline(dp, model, &pool, x, labels, global, &opt));
        }
        let med = |mut v: Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (ddp, local) = (med(ddp_t), med(local_t));
        let backward = med(runs.iter().map(|r| r.1).collect());
        let tl = Timeline {
            ready: (0..runs[0].0.ready.len())
                .map(|g| {
                    (
                        med(runs.iter().map(|r| r.0.ready[g].0).collect()),
                        runs[0].0.ready[g].1,
                    )
                })
                .collect(),
            backward_end: med(runs.iter().map(|r| r.0.backward_end).collect()),
            tail: med(runs.iter().map(|r| r.0.tail).collect()),
        };
        if world.rank() != 0 {
            return;
        }
        let groups = dp.bucket_groups();
        let ms = |s: f64| format!("{:.3}", 1e3 * s);
        let opt_ms = |v: Option<f64>| v.map_or("null".into(), ms);
        let host = d.link.map_or("null".into(), |l| {
            format!("{:.0}", l.host_s_per_byte * 1e12)
        });
        let (hidden, predicted, predicted_ar, predicted_nominal, wire, lat) = match d.link {
            Some(link) => {
                let p = tl.predict(&groups, size, &link);
                let nominal = d.nominal.map(|g| {
                    let nominal = Link {
                        bytes_per_s: g * 1e9 / 8.0,
                        ..link
                    };
                    tl.predict(&groups, size, &nominal).step_s
                });
                (
                    format!("{:.2}", (1.0 - (ddp - local) / alone).clamp(0.0, 1.0)),
                    ms(p.step_s),
                    ms(p.allreduce_s),
                    opt_ms(nominal),
                    format!("{:.2}", link.gbps()),
                    format!("{:.1}", link.latency_s * 1e6),
                )
            }
            None => {
                let p = ms(tl.predict(&groups, 1, &Link::new(1.0, 0.0)).step_s);
                (
                    "null".into(),
                    p.clone(),
                    "0.000".into(),
                    p,
                    "null".into(),
                    "null".into(),
                )
            }
        };
        let s = dp.stats;
        println!(
            r#"{{"bench":"mpi","model":"{}","layers":"{}","link_gbps":{},"ranks":{size},"threads":1,"batch_per_rank":{},"progress":"{}","buckets":{},"bucket_kb":{},"samples_per_s":{:.1},"step_ms":{},"local_step_ms":{},"backward_ms":{},"allreduce_ms":{},"hidden":{hidden},"predicted_step_ms":{predicted},"predicted_allreduce_ms":{predicted_ar},"predicted_nominal_step_ms":{predicted_nominal},"wire_gbps":{wire},"latency_us":{lat},"host_us_per_mb":{host},"waited_after_backward_ms":{},"ddp_backward_ms":{},"ddp_finish_ms":{}}}"#,
            d.model,
            d.layers,
            d.nominal.map_or("null".into(), |g| g.to_string()),
            d.rows,
            d.progress,
            dp.buckets(),
            d.bucket >> 10,
            global as f64 / ddp,
            ms(ddp),
            ms(local),
            ms(backward),
            ms(alone),
            ms(s.exposed_s / s.steps.max(1) as f64),
            ms(s.backward_s / s.steps.max(1) as f64),
            ms(s.finish_s / s.steps.max(1) as f64),
        );
    }
}
