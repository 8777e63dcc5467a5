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
//! `f32` arrays), and the CRC-32 of everything before it. Written to a
//! temporary file next to the target, synced, then renamed: a crash leaves
//! the previous checkpoint or the new one, never half of one.

use brgemm_nn::{Error, Graph, ParamState, Result};
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
        let mut out = MAGIC.to_vec();
        out.extend(CHECKPOINT_VERSION.to_le_bytes());
        for v in [
            self.epoch,
            self.steps,
            self.rng,
            self.global_batch,
            self.seed,
        ] {
            out.extend(v.to_le_bytes());
        }
        out.extend((self.model.len() as u64).to_le_bytes());
        out.extend(&self.model);
        out.extend((self.optimizer.len() as u32).to_le_bytes());
        for (t, m, v) in &self.optimizer {
            out.extend(t.to_le_bytes());
            for a in [m, v] {
                out.extend((a.len() as u64).to_le_bytes());
                a.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
        }
        let crc = crc32fast::hash(&out);
        out.extend(crc.to_le_bytes());
        out
    }

    /// Writes the checkpoint to `path` atomically (temporary file, sync,
    /// rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        brgemm_nn::file::write_atomically(path, &self.to_bytes()).map_err(|e| bad(path, e))
    }

    /// Reads a checkpoint file; a wrong magic, version or checksum, a short
    /// or long file is an error naming the file and what is wrong.
    pub fn load(path: &Path) -> Result<Checkpoint> {
        let bytes = std::fs::read(path).map_err(|e| bad(path, e))?;
        Checkpoint::from_bytes(&bytes).map_err(|e| bad(path, e))
    }

    /// [`Checkpoint::load`] from a file image.
    pub fn from_bytes(file: &[u8]) -> std::result::Result<Checkpoint, String> {
        if !file.starts_with(MAGIC) {
            return Err("not a brgemm checkpoint (no magic)".into());
        }
        if file.len() < MAGIC.len() + 8 {
            return Err(format!("truncated at byte {}", file.len()));
        }
        let version = u32::from_le_bytes(file[MAGIC.len()..][..4].try_into().expect("4"));
        if version != CHECKPOINT_VERSION {
            return Err(format!(
                "version {version}; this library reads version {CHECKPOINT_VERSION}"
            ));
        }
        let (body, crc) = file.split_at(file.len() - 4);
        let (want, got) = (
            u32::from_le_bytes(crc.try_into().expect("4")),
            crc32fast::hash(body),
        );
        if want != got {
            return Err(format!(
                "checksum {got:08x} does not match the file's {want:08x}: damaged or truncated"
            ));
        }
        let mut r = Reader {
            b: body,
            at: MAGIC.len() + 4,
        };
        let mut head = [0u64; 5];
        for h in &mut head {
            *h = r.u64()?;
        }
        let n = r.len(1)?;
        let model = r.take(n)?.to_vec();
        let count = r.u32()? as usize;
        let mut optimizer = Vec::with_capacity(count.min(1 << 16));
        for _ in 0..count {
            let t = r.u32()?;
            let m = r.f32s()?;
            let v = r.f32s()?;
            optimizer.push((t, m, v));
        }
        if r.at != body.len() {
            return Err(format!(
                "{} bytes after the optimizer state",
                body.len() - r.at
            ));
        }
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

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| format!("truncated at byte {}", self.b.len()))?;
        let out = &self.b[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    /// A `u64` count of items of `size` bytes that fits in what is left.
    fn len(&mut self, size: usize) -> std::result::Result<usize, String> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|n| {
                n.checked_mul(size)
                    .is_some_and(|b| b <= self.b.len() - self.at)
            })
            .ok_or_else(|| format!("a length of {n} at byte {} runs past the file", self.at))
    }
    fn f32s(&mut self) -> std::result::Result<Vec<f32>, String> {
        let n = self.len(4)?;
        Ok(self
            .take(4 * n)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    }
}
