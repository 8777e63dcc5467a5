//! What the training examples share (they include this file by path): one
//! strict option parser (`lexopt`) with the common options every training
//! example takes, and the epoch-by-epoch report.
//!
//! Unknown options, missing or unparsable values and stray arguments end
//! the process with status 2 and a message naming the option; `--help`
//! lists every option.

#![allow(dead_code)] // each example uses its own subset

use brgemm_dl::train::EpochReport;
use std::collections::{HashMap, HashSet};
use std::time::Instant;

/// An option: `--name VALUE` when `value` names the value, else a flag.
pub struct Opt {
    pub name: &'static str,
    pub value: Option<&'static str>,
    pub help: &'static str,
}

/// `--name VALUE`.
pub const fn value(name: &'static str, v: &'static str, help: &'static str) -> Opt {
    Opt {
        name,
        value: Some(v),
        help,
    }
}

/// `--name`.
pub const fn flag(name: &'static str, help: &'static str) -> Opt {
    Opt {
        name,
        value: None,
        help,
    }
}

/// `--dtype f32|bf16` of the CPU training examples ([`Args::bf16`]).
pub const DTYPE: Opt = value(
    "dtype",
    "T",
    "f32 or bf16 (bf16 operands where they beat f32 here, f32 master weights)",
);

/// The options every training example takes.
pub const COMMON: &[Opt] = &[
    value(
        "epochs",
        "N",
        "passes over the training set (0 with --load: evaluate only)",
    ),
    value("batch", "B", "minibatch rows"),
    value("lr", "LR", "learning rate (Adam)"),
    value("seed", "S", "seed of the weights, shuffles and dropout"),
    value(
        "save",
        "FILE",
        "save the trained model (checked before training starts)",
    ),
    value(
        "load",
        "FILE",
        "start from a saved model: resume training, or evaluate with --epochs 0",
    ),
    value("data", "DIR", "data directory"),
    flag(
        "no-finite-check",
        "keep training when a loss or gradient is NaN or infinite",
    ),
    flag(
        "fused-update",
        "step the linear layers' weights inside backward (needs --no-finite-check)",
    ),
    flag("help", "print this help"),
];

/// Parsed options.
pub struct Args {
    values: HashMap<&'static str, String>,
    flags: HashSet<&'static str>,
}

/// Ends the process with status 2 and `msg`.
pub fn usage_error(msg: impl std::fmt::Display) -> ! {
    eprintln!("error: {msg} (see --help)");
    std::process::exit(2)
}

/// Parses the process's arguments against [`COMMON`] and `extra`;
/// `usage` is the first line of `--help`.
pub fn parse(usage: &str, extra: &[Opt]) -> Args {
    parse_from(usage, extra, std::env::args_os().skip(1)).unwrap_or_else(|e| usage_error(e))
}

/// [`parse`] over given arguments, returning the error.
pub fn parse_from(
    usage: &str,
    extra: &[Opt],
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Result<Args, String> {
    use lexopt::prelude::*;
    let all: Vec<&Opt> = COMMON.iter().chain(extra).collect();
    let mut p = lexopt::Parser::from_args(args);
    let mut out = Args {
        values: HashMap::new(),
        flags: HashSet::new(),
    };
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        match arg {
            Long(name) => {
                let opt = all
                    .iter()
                    .find(|o| o.name == name)
                    .ok_or_else(|| format!("unknown option --{name}"))?;
                if opt.name == "help" {
                    print_help(usage, &all);
                    std::process::exit(0);
                }
                match opt.value {
                    Some(_) => {
                        let v = p.value().map_err(|e| e.to_string())?;
                        let v = v
                            .into_string()
                            .map_err(|v| format!("--{}: {v:?} is not UTF-8", opt.name))?;
                        if v.starts_with("--") {
                            return Err(format!("--{} needs a value, got {v}", opt.name));
                        }
                        out.values.insert(opt.name, v);
                    }
                    None => {
                        out.flags.insert(opt.name);
                    }
                }
            }
            Short('h') => {
                print_help(usage, &all);
                std::process::exit(0);
            }
            other => return Err(other.unexpected().to_string()),
        }
    }
    Ok(out)
}

fn print_help(usage: &str, all: &[&Opt]) {
    println!("{usage}\n\noptions:");
    for o in all {
        let left = match o.value {
            Some(v) => format!("--{} {v}", o.name),
            None => format!("--{}", o.name),
        };
        println!("  {left:<22} {}", o.help);
    }
}

impl Args {
    /// The value of `--name` parsed, if given; an unparsable value ends the
    /// process naming the option.
    pub fn get<T: std::str::FromStr>(&self, name: &str) -> Option<T>
    where
        T::Err: std::fmt::Display,
    {
        self.values.get(name).map(|v| {
            v.parse()
                .unwrap_or_else(|e| usage_error(format!("--{name} {v:?}: {e}")))
        })
    }
    /// [`Args::get`] or `default`.
    pub fn get_or<T: std::str::FromStr>(&self, name: &str, default: T) -> T
    where
        T::Err: std::fmt::Display,
    {
        self.get(name).unwrap_or(default)
    }
    /// A count that must be at least 1 (`--batch`, `--hidden`, ...).
    pub fn positive(&self, name: &str, default: usize) -> usize {
        let v = self.get_or(name, default);
        if v == 0 {
            usage_error(format!("--{name} 0: must be at least 1"));
        }
        v
    }
    /// A learning rate: finite and above 0.
    pub fn lr(&self, default: f32) -> f32 {
        let v: f32 = self.get_or("lr", default);
        if !(v.is_finite() && v > 0.0) {
            usage_error(format!("--lr {v}: must be finite and above 0"));
        }
        v
    }
    /// `--dtype`: f32 (false, the default) or bf16 (true); anything else
    /// ends the process naming the value.
    pub fn bf16(&self) -> bool {
        match self.values.get("dtype").map(String::as_str) {
            None | Some("f32") => false,
            Some("bf16") => true,
            Some(other) => usage_error(format!("--dtype {other:?}: expected f32 or bf16")),
        }
    }
    /// Whether `--name` was given.
    pub fn flag(&self, name: &str) -> bool {
        self.flags.contains(name)
    }
    /// `--save FILE`, checked writable now (not after training).
    pub fn save_path(&self) -> Option<std::path::PathBuf> {
        let p = std::path::PathBuf::from(self.values.get("save")?);
        if let Err(e) = brgemm_nn::file::check_writable(&p) {
            usage_error(format!("--save: {e}"));
        }
        Some(p)
    }
    /// `BRGEMM_TUNING`, the tuning file of `examples/tune --save`: the one
    /// place the examples read it.
    pub fn tuning_file(&self) -> Option<std::path::PathBuf> {
        brgemm::env::Setting::Tuning
            .value_os()
            .map(std::path::PathBuf::from)
    }
    /// Refuses `--save`/`--load` for a run that writes no model file (the
    /// data-parallel and GPU runs).
    pub fn no_model_files(&self, run: &str) {
        for o in ["save", "load"] {
            if self.values.contains_key(o) {
                usage_error(format!("--{o}: the {run} saves and loads no model file"));
            }
        }
    }
    /// `--epochs`: 0 means "evaluate the `--load` model", refused without one.
    pub fn epochs(&self, default: usize) -> usize {
        let e = self.get_or("epochs", default);
        if e == 0 && !self.values.contains_key("load") {
            usage_error("--epochs 0: nothing to train; add --load FILE to evaluate a saved model");
        }
        e
    }
}

impl Args {
    /// A layer graph from `build`, its values replaced by the `--load` file's
    /// (`Graph::load`: versioned, checked against the graph's shapes), then
    /// checked against the data by `fits`; a failure ends the process.
    pub fn graph(
        &self,
        build: impl FnOnce() -> brgemm_nn::Result<brgemm_nn::Graph>,
        fits: impl FnOnce(&brgemm_nn::Graph) -> brgemm_nn::Result<()>,
    ) -> brgemm_nn::Graph {
        let mut g = build().unwrap_or_else(|e| {
            eprintln!("model: {e}");
            std::process::exit(1)
        });
        if let Some(path) = self.values.get("load") {
            g.load(path).unwrap_or_else(|e| {
                eprintln!("--load: {e}");
                std::process::exit(1)
            });
            println!("loaded {path}");
        }
        fits(&g).unwrap_or_else(|e| {
            eprintln!("model: {e}");
            std::process::exit(1)
        });
        g
    }
}

/// Saves graph `g`'s values to `path` (from [`Args::save_path`], checked
/// before training); a failure ends the process.
pub fn save_graph(g: &brgemm_nn::Graph, path: Option<std::path::PathBuf>) {
    if let Some(path) = path {
        g.save(&path).unwrap_or_else(|e| {
            eprintln!("--save: {e}");
            std::process::exit(1)
        });
        println!("saved the model to {}", path.display());
    }
}

/// At `epochs` 0, evaluates `model` (a loaded one) only; otherwise trains
/// it through [`run_training`]. Returns the model and its test accuracy.
pub fn train_or_evaluate<M, E: std::fmt::Display>(
    unit: &str,
    epochs: usize,
    mut model: M,
    evaluate: impl FnOnce(&mut M) -> Result<f64, E>,
    train: impl FnOnce(M, &mut dyn FnMut(&EpochReport)) -> Result<M, E>,
) -> (M, f64) {
    if epochs > 0 {
        return run_training(unit, |report| train(model, report));
    }
    let acc = evaluate(&mut model).unwrap_or_else(|e| {
        eprintln!("evaluation failed: {e}");
        std::process::exit(1)
    });
    (model, acc)
}

/// The process-wide pool; a bad `BRGEMM_NUM_THREADS` (`0`, `abc`) ends the
/// process with the error naming it.
pub fn pool() -> &'static brgemm_primitives::Pool {
    brgemm_primitives::Pool::try_global().unwrap_or_else(|e| usage_error(e))
}

/// Ends the process when a minibatch of `batch` rows, at `row_bytes` of
/// activations, gradients and scratch per row, cannot fit in the memory
/// available now (`MemAvailable`); a huge `--batch` otherwise allocates
/// until the kernel's OOM killer ends the process.
pub fn check_batch_memory(batch: usize, row_bytes: usize) {
    let need = (batch as u128) * (row_bytes as u128);
    let avail = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u128>().ok())
        })
        .map(|kib| kib * 1024);
    if let Some(avail) = avail {
        if need > avail {
            usage_error(format!(
                "--batch {batch}: needs about {} MiB of activations and gradients, {} MiB are available",
                need >> 20,
                avail >> 20
            ));
        }
    }
}

/// Runs `train` with a reporter printing one line per epoch (`unit` per
/// second), ends the process if training fails, prints the time taken, and
/// returns the model and the last test accuracy.
pub fn run_training<M, E: std::fmt::Display>(
    unit: &str,
    train: impl FnOnce(&mut dyn FnMut(&EpochReport)) -> Result<M, E>,
) -> (M, f64) {
    let t = Instant::now();
    let mut last = 0.0;
    let model = train(&mut |r: &EpochReport| {
        println!(
            "epoch {:3}  loss {:.4}  test_acc {:.4}  {:.0} {unit}/s",
            r.epoch, r.loss, r.test_accuracy, r.samples_per_s
        );
        last = r.test_accuracy;
    })
    .unwrap_or_else(|e| {
        eprintln!("training failed: {e}");
        std::process::exit(1)
    });
    println!("trained in {:.2} s", t.elapsed().as_secs_f64());
    (model, last)
}

/// `--device` and `--dtype` of a GPU run: the backend and the GEMM type, or
/// a usage error naming the bad value.
#[cfg(feature = "gpu")]
pub fn gpu_target(
    device: &str,
    dtype: &str,
) -> (brgemm_dl::gpu::Backend, brgemm_dl::gpu::GpuDtype) {
    use brgemm_dl::gpu::GpuDtype;
    let backend = device
        .parse()
        .unwrap_or_else(|e| usage_error(format!("--device: {e}")));
    let dt = match dtype {
        "f32" => GpuDtype::F32,
        "bf16" => GpuDtype::Bf16,
        "f16" => GpuDtype::F16,
        other => usage_error(format!("--dtype {other:?}: expected f32, bf16 or f16")),
    };
    (backend, dt)
}

/// Runs a GPU training run (`train` returns the model and the device),
/// printing the epochs, the device and the final accuracy.
#[cfg(feature = "gpu")]
pub fn run_gpu_training<M, E: std::fmt::Display>(
    unit: &str,
    train: impl FnOnce(&mut dyn FnMut(&EpochReport)) -> Result<(M, brgemm_dl::gpu::Device), E>,
) {
    let ((_, dev), last) = run_training(unit, train);
    println!("device: {}", dev.name());
    println!("test_accuracy={last:.4}");
}

/// `--device` on a build without GPU support: says how to get one, exits 2.
#[cfg(not(feature = "gpu"))]
pub fn no_gpu_build(example: &str, device: &str) -> ! {
    eprintln!(
        "--device {device}: this build has no GPU support; rebuild with --features cuda \
         (or --features opencl), e.g. cargo run --release --features cuda --example {example} -- --device {device}"
    );
    std::process::exit(2)
}
