//! Saving and loading a graph's values: every layer's [`Layer::export`]
//! (weights in PyTorch's layouts, batch-norm statistics), so a file does
//! not depend on the blocking this CPU chose.
//!
//! The format, little-endian: the magic `BRGEMM-NN\n`, a `u32` version
//! ([`FILE_VERSION`]), the input's channels, height and width (3 `u64`;
//! not the minibatch, so a file fits a graph of any batch size), the layer
//! count (`u32`), then per layer its name and tensor count (`u32`), per
//! tensor its name and length (`u64`) and the `f32` values, and last the
//! CRC-32 (IEEE) of every byte before it (`u32`). Strings are a `u32`
//! length and UTF-8 bytes. A load checks all of it against the graph and
//! names the first difference: a wrong magic or version, a checksum that
//! does not match (a flipped bit anywhere), a short file (naming the byte
//! where it ends), other layers or shapes, a value that is not finite,
//! trailing bytes. A save checks nothing it need not: it writes a
//! temporary file next to the target, syncs it and renames it.

use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::layer::Layer;
use std::path::Path;

const MAGIC: &[u8] = b"BRGEMM-NN\n";
/// The version of the file format this library writes and reads.
pub const FILE_VERSION: u32 = 2;

/// `e` with the file named in front (a graph error's own "graph: " prefix
/// not repeated).
fn file_error(path: &Path, e: impl std::fmt::Display) -> Error {
    let e = e.to_string();
    let reason = e.strip_prefix("graph: ").unwrap_or(&e);
    Error::Graph(format!("{}: {reason}", path.display()))
}

impl Graph {
    /// The graph's values as a file image (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let s = self.input_shape();
        for d in [s.c, s.h, s.w] {
            out.extend((d as u64).to_le_bytes());
        }
        let layers: Vec<&dyn Layer> = self.layers().collect();
        out.extend((layers.len() as u32).to_le_bytes());
        let text = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u32).to_le_bytes());
            out.extend(s.as_bytes());
        };
        for l in layers {
            text(&mut out, &l.name());
            let values = l.export();
            out.extend((values.len() as u32).to_le_bytes());
            for (name, v) in values {
                text(&mut out, name);
                put_f32s(&mut out, &v);
            }
        }
        seal(MAGIC, FILE_VERSION, &out)
    }

    /// Sets the values from a file image of [`Graph::to_bytes`] made by a
    /// graph of the same layers and input shape; anything else is an error
    /// naming what differs, and leaves the values as they were. The
    /// optimizer state starts again.
    pub fn from_bytes(&mut self, file: &[u8]) -> Result<()> {
        let mut r = unseal(file, MAGIC, FILE_VERSION, "brgemm-nn file")?;
        let s = self.input_shape();
        let chw = [r.u64()?, r.u64()?, r.u64()?];
        if chw != [s.c, s.h, s.w].map(|d| d as u64) {
            return Err(Error::Graph(format!(
                "the file is for inputs of (c, h, w) = {chw:?}, this graph takes {s}"
            )));
        }
        let names: Vec<String> = self.layers().map(|l| l.name()).collect();
        let count = r.u32()? as usize;
        if count != names.len() {
            return Err(Error::Graph(format!(
                "the file has {count} layers, this graph {}",
                names.len()
            )));
        }
        // Read and check everything before changing a value.
        let mut all = Vec::with_capacity(count);
        for (i, want) in names.iter().enumerate() {
            let name = r.text()?;
            if &name != want {
                return Err(Error::Graph(format!(
                    "layer {i} is `{name}` in the file, `{want}` in this graph"
                )));
            }
            let tensors = r.u32()? as usize;
            let mut values = Vec::with_capacity(tensors.min(16));
            for _ in 0..tensors {
                let what = r.text()?;
                let v = r.f32s()?;
                if let Some(j) = v.iter().position(|x| !x.is_finite()) {
                    return Err(Error::Graph(format!(
                        "layer {i} (`{name}`) {what}[{j}] is {}",
                        v[j]
                    )));
                }
                values.push((what, v));
            }
            all.push(values);
        }
        r.end("the last layer")?;
        let backup: Vec<Vec<(String, Vec<f32>)>> = self
            .layers()
            .map(|l| {
                l.export()
                    .into_iter()
                    .map(|(n, v)| (n.to_string(), v))
                    .collect()
            })
            .collect();
        let result = self
            .layers_mut()
            .zip(&all)
            .try_for_each(|(l, v)| l.import(v));
        if result.is_err() {
            // A layer refused its values: put back those already set.
            for (l, v) in self.layers_mut().zip(&backup) {
                l.import(v)?;
            }
        }
        result
    }

    /// Writes [`Graph::to_bytes`] to `path` atomically: a temporary file
    /// next to it, then a rename, so a crash never leaves half a file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        write_atomically(path, &self.to_bytes()).map_err(|e| file_error(path, e))
    }

    /// Reads a file of [`Graph::save`] into this graph
    /// ([`Graph::from_bytes`]); errors name the file.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| file_error(path, e))?;
        self.from_bytes(&bytes).map_err(|e| file_error(path, e))
    }
}

/// The temporary file a save writes before its rename: next to `path`, so
/// the rename stays on one file system.
fn temp_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Writes `bytes` to `path` so that a crash leaves the old file or the new
/// one, never half of one: a temporary file next to it, synced, then
/// renamed over it (the temporary is removed on an error).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = temp_path(path);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().inspect_err(|_| {
        std::fs::remove_file(&tmp).ok();
    })
}

/// Checks that a file can be saved at `path` (its directory exists and
/// takes a new file) without touching `path` itself: run before a long
/// training run, so a typo costs seconds, not the run.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.file_name().is_none() || path.is_dir() {
        return Err(file_error(path, "not a file name"));
    }
    let tmp = temp_path(path);
    std::fs::File::create(&tmp).map_err(|e| file_error(path, format!("cannot save here: {e}")))?;
    std::fs::remove_file(&tmp).map_err(|e| file_error(&tmp, e))
}

/// `body` as a sealed file: `magic`, the `u32` `version`, the body, and
/// the CRC-32 (IEEE) of everything before it (little-endian). The graph file
/// and `brgemm_dl::checkpoint` are both this container.
pub fn seal(magic: &[u8], version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(magic.len() + 8 + body.len());
    out.extend(magic);
    out.extend(version.to_le_bytes());
    out.extend(body);
    let crc = crc32fast::hash(&out);
    out.extend(crc.to_le_bytes());
    out
}

/// The body of a file [`seal`] made, to read: a wrong magic (the file is
/// not a `what`), another version, a checksum that does not match (the
/// first check after the version: a damaged file is named as such, not by
/// the first field the damage breaks) or a short file is an error.
pub fn unseal<'a>(file: &'a [u8], magic: &[u8], version: u32, what: &str) -> Result<Reader<'a>> {
    if !file.starts_with(magic) && !magic.starts_with(file) {
        return Err(Error::Graph(format!("not a {what} (no magic)")));
    }
    let mut r = Reader { bytes: file, at: 0 };
    r.take(magic.len())?;
    let v = r.u32()?;
    if v != version {
        return Err(Error::Graph(format!(
            "file version {v}; this library reads version {version}"
        )));
    }
    if file.len() < r.at + 4 {
        return Err(r.short());
    }
    let (body, crc) = file.split_at(file.len() - 4);
    let (want, got) = (
        u32::from_le_bytes(crc.try_into().expect("4 bytes")),
        crc32fast::hash(body),
    );
    if want != got {
        return Err(Error::Graph(format!(
            "checksum {got:08x} does not match the file's {want:08x}: the file is damaged or truncated"
        )));
    }
    Ok(Reader {
        bytes: body,
        at: r.at,
    })
}

/// `v` as a `u64` count and the values, little-endian (what
/// [`Reader::f32s`] reads).
pub fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.extend((v.len() as u64).to_le_bytes());
    v.iter().for_each(|x| out.extend(x.to_le_bytes()));
}

/// Reads a sealed file's body front to back; every read past the end is an
/// error naming where the file ends.
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn short(&self) -> Error {
        Error::Graph(format!(
            "the file is truncated at byte {}",
            self.bytes.len()
        ))
    }
    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| self.short())?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    /// A `u32`.
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    /// A `u64`.
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// A `u64` count of bytes, then as many bytes.
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = usize::try_from(self.u64()?).map_err(|_| self.short())?;
        self.take(n)
    }
    /// A `u64` count of values, then the `f32`s ([`put_f32s`]).
    pub fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = usize::try_from(self.u64()?).map_err(|_| self.short())?;
        let raw = self.take(n.checked_mul(4).ok_or_else(|| self.short())?)?;
        Ok(raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    }
    fn text(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| Error::Graph(format!("a name before byte {} is not UTF-8", self.at)))
    }
    /// An error unless the body ends here (bytes after `last` are).
    pub fn end(&self, last: &str) -> Result<()> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            n => Err(Error::Graph(format!("{n} bytes after {last}"))),
        }
    }
}
