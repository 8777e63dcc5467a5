//! Training checkpoints: a layer graph's values and optimizer state with
//! where the run stood (epochs done, steps, the shuffle generator's state)
//! and the settings a resumed run must share (global minibatch, seed), so
//! that a run stopped after epoch k and resumed ends with the weights of a
//! run that never stopped, on any rank count.
//!
//! The file, little-endian: the magic `BRGEMM-CKPT\n`, a `u32` version
//! ([`CHECKPOINT_VERSION`]), `u64` epochs done, steps, generator state,
//! global minibatch and seed, the graph file ([`Graph::to_bytes`], `u64`
//! length first), the optimizer state ([`Graph::optimizer_state`]: `u32`
//! count, then per parameter a `u32` step count and two `u64`-prefixed
//! `f32` arrays), and the CRC-32 of everything before it (the container of
//! [`brgemm_nn::file::seal`], as the graph file's). Written to a
//! temporary file next to the target, synced, then renamed: a crash leaves
//! the previous checkpoint or the new one, never half of one.

use brgemm_nn::{file, Error, Graph, ParamState, Result};
use std::path::Path;

const MAGIC: &[u8] = b"BRGEMM-CKPT\n";
/// The version of the checkpoint format this library writes and reads.
pub const CHECKPOINT_VERSION: u32 = 1;

/// Where a run stood, and what it needs to go on.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Epochs completed.
    pub epoch: u64,
    /// Optimizer steps taken.
    pub steps: u64,
    /// The shuffle generator's state ([`brgemm_primitives::init::Rng::state`]).
    pub rng: u64,
    /// The run's global minibatch (a resumed run must use the same).
    pub global_batch: u64,
    /// The run's seed (likewise).
    pub seed: u64,
    /// The graph's values ([`Graph::to_bytes`]).
    pub model: Vec<u8>,
    /// The optimizer's state ([`Graph::optimizer_state`]).
    pub optimizer: Vec<ParamState>,
}

fn bad(path: &Path, why: impl std::fmt::Display) -> Error {
    let why = why.to_string();
    let why = why.strip_prefix("graph: ").unwrap_or(&why);
    Error::Graph(format!("checkpoint {}: {why}", path.display()))
}

impl Checkpoint {
    /// The checkpoint of `g` after `epoch` epochs and `steps` steps.
    pub fn of(
        g: &mut Graph,
        epoch: u64,
        steps: u64,
        rng: u64,
        global_batch: u64,
        seed: u64,
    ) -> Result<Checkpoint> {
        Ok(Checkpoint {
            epoch,
            steps,
            rng,
            global_batch,
            seed,
            model: g.to_bytes(),
            optimizer: g.optimizer_state()?,
        })
    }

    /// Puts the values and the optimizer state into `g` (a graph of the same
    /// layers, any minibatch); on an error `g` keeps its values.
    pub fn restore(&self, g: &mut Graph) -> Result<()> {
        let before = g.to_bytes();
        g.from_bytes(&self.model)?;
        if let Err(e) = g.set_optimizer_state(&self.optimizer) {
            g.from_bytes(&before)?;
            return Err(e);
        }
        Ok(())
    }

    /// The file image (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut body = Vec::new();
        for v in [
            self.epoch,
            self.steps,
            self.rng,
            self.global_batch,
            self.seed,
        ] {
            body.extend(v.to_le_bytes());
        }
        body.extend((self.model.len() as u64).to_le_bytes());
        body.extend(&self.model);
        body.extend((self.optimizer.len() as u32).to_le_bytes());
        for (t, m, v) in &self.optimizer {
            body.extend(t.to_le_bytes());
            file::put_f32s(&mut body, m);
            file::put_f32s(&mut body, v);
        }
        file::seal(MAGIC, CHECKPOINT_VERSION, &body)
    }

    /// Writes the checkpoint to `path` atomically (temporary file, sync,
    /// rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        file::write_atomically(path, &self.to_bytes()).map_err(|e| bad(path, e))
    }

    /// Reads a checkpoint file; a wrong magic, version or checksum, a short
    /// or long file is an error naming the file and what is wrong.
    pub fn load(path: &Path) -> Result<Checkpoint> {
        let bytes = std::fs::read(path).map_err(|e| bad(path, e))?;
        Checkpoint::from_bytes(&bytes).map_err(|e| bad(path, e))
    }

    /// [`Checkpoint::load`] from a file image.
    pub fn from_bytes(file: &[u8]) -> Result<Checkpoint> {
        let mut r = file::unseal(file, MAGIC, CHECKPOINT_VERSION, "brgemm checkpoint")?;
        let mut head = [0u64; 5];
        for h in &mut head {
            *h = r.u64()?;
        }
        let model = r.bytes()?.to_vec();
        let count = r.u32()? as usize;
        let mut optimizer = Vec::with_capacity(count.min(1 << 16));
        for _ in 0..count {
            optimizer.push((r.u32()?, r.f32s()?, r.f32s()?));
        }
        r.end("the optimizer state")?;
        let [epoch, steps, rng, global_batch, seed] = head;
        Ok(Checkpoint {
            epoch,
            steps,
            rng,
            global_batch,
            seed,
            model,
            optimizer,
        })
    }
}
