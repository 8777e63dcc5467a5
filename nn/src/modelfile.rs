//! The model-file format every model saves to and loads from.
//!
//! ```text
//! magic    8 bytes  "BRGDLMDL"
//! version  u32      2
//! kind     4 bytes  the model's tag, e.g. "MLP\0"
//! header   u64 length, then that many bytes: the model's architecture
//!                   (shapes, activations), written and read by the model
//! values   u64 count, then that many f32: the parameters in the model's order
//! crc32    u32      CRC-32 (IEEE) of every byte before it
//! ```
//!
//! All integers little-endian. A file is accepted only whole: right magic,
//! version and kind, lengths that end exactly at the checksum, a matching
//! checksum, and finite values; the model then checks that the header's
//! shapes account for exactly the values given. Files are written to a
//! temporary name in the same directory, synced, and renamed over the
//! target, so a crash never leaves a half-written model under the real name.

use brgemm_primitives::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"BRGDLMDL";
const VERSION: u32 = 2;
/// Largest header a model writes (architecture only, never weights).
const MAX_HEADER: u64 = 1 << 20;

fn io_err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {what}", path.display()))
}

/// A fresh temporary name next to `path` (process id and a counter: two
/// threads saving the same path never share one).
fn temp_path(path: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}.{n}", std::process::id()));
    path.with_file_name(name)
}

/// Checks that a model can be saved at `path` (its directory exists and
/// takes a new file) without touching `path` itself: run before a long
/// training run, so a typo costs seconds, not the run.
pub fn check_writable(path: &Path) -> Result<()> {
    if path.file_name().is_none() || path.is_dir() {
        return Err(io_err(path, "not a file name"));
    }
    let tmp = temp_path(path);
    std::fs::File::create(&tmp).map_err(|e| io_err(path, format!("cannot save here: {e}")))?;
    std::fs::remove_file(&tmp).map_err(|e| io_err(&tmp, e))
}

/// Writes a model file atomically (temporary file, sync, rename).
pub fn write(path: &Path, kind: [u8; 4], header: &[u8], values: &[f32]) -> Result<()> {
    let mut out = Vec::with_capacity(40 + header.len() + 4 * values.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&kind);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    let tmp = temp_path(path);
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&out)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io_err(path, e)
    })
}

/// Reads and checks a model file of `kind`: returns its header bytes and
/// values. Every corruption (truncation, trailing bytes, a flipped bit, a
/// wrong kind or version, non-finite values) is an error naming the file.
pub fn read(path: &Path, kind: [u8; 4]) -> Result<(Vec<u8>, Vec<f32>)> {
    let buf = std::fs::read(path).map_err(|e| io_err(path, e))?;
    parse(&buf, kind).map_err(|why| io_err(path, format!("not a valid model file: {why}")))
}

/// [`read`] on bytes in memory (what the fuzz target drives).
pub fn parse(buf: &[u8], kind: [u8; 4]) -> std::result::Result<(Vec<u8>, Vec<f32>), String> {
    if buf.len() < 4 {
        return Err(format!("{} bytes, too short", buf.len()));
    }
    let (body, crc) = buf.split_at(buf.len() - 4);
    let mut r = Bytes { buf: body, pos: 0 };
    if r.take(8)? != MAGIC {
        return Err("wrong magic (not a brgemm-dl model)".into());
    }
    let version = r.u32()?;
    if version != VERSION {
        return Err(format!(
            "format version {version}, this build reads {VERSION}"
        ));
    }
    let k = r.take(4)?;
    if k != kind {
        return Err(format!(
            "holds a {:?} model, not a {:?}",
            String::from_utf8_lossy(k).trim_end_matches('\0'),
            String::from_utf8_lossy(&kind).trim_end_matches('\0')
        ));
    }
    let hlen = r.u64()?;
    if hlen > MAX_HEADER {
        return Err(format!("header of {hlen} bytes"));
    }
    let header = r.take(hlen as usize)?.to_vec();
    let n = r.u64()?;
    let rest = body.len() - r.pos;
    if n.checked_mul(4) != Some(rest as u64) {
        return Err(format!(
            "{n} values declared, {rest} bytes left before the checksum"
        ));
    }
    let want = u32::from_le_bytes(crc.try_into().unwrap());
    let got = crc32fast::hash(body);
    if want != got {
        return Err(format!("checksum {got:08x}, file says {want:08x}"));
    }
    let values: Vec<f32> = body[r.pos..]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!("value {i} is {}", values[i]));
    }
    Ok((header, values))
}

/// A cursor over a model's header bytes, with errors instead of panics.
pub struct Bytes<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Bytes<'a> {
    /// A cursor at the start of `buf`.
    pub fn new(buf: &'a [u8]) -> Self {
        Bytes { buf, pos: 0 }
    }
    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| format!("truncated at byte {}", self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    /// The next byte.
    pub fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    /// The next little-endian u32.
    pub fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    /// The next little-endian u64.
    pub fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    /// Whether every byte was read.
    pub fn is_done(&self) -> bool {
        self.pos == self.buf.len()
    }
}

/// A cursor over a model file's values: each parameter tensor takes its
/// length in turn, and the file must hold exactly what the shapes need.
pub struct Values<'a> {
    v: &'a [f32],
    pos: usize,
}

impl<'a> Values<'a> {
    /// A cursor at the first value.
    pub fn new(v: &'a [f32]) -> Self {
        Values { v, pos: 0 }
    }
    /// The next `n` values (`what` names them in the error).
    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [f32]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.v.len());
        let end = end.ok_or_else(|| {
            Error::Io(format!(
                "{what} needs {n} values, the file has {} left",
                self.v.len() - self.pos
            ))
        })?;
        let s = &self.v[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    /// Checks that every value was used.
    pub fn finish(&self) -> Result<()> {
        if self.pos != self.v.len() {
            return Err(Error::Io(format!(
                "the model's shapes need {} values, the file holds {}",
                self.pos,
                self.v.len()
            )));
        }
        Ok(())
    }
}

/// Appends a little-endian u64 to a header.
pub fn put_u64(out: &mut Vec<u8>, v: usize) {
    out.extend_from_slice(&(v as u64).to_le_bytes());
}

/// Reads a header count or size, refusing 0 or anything above `max` (a
/// corrupt header must not plan a model of absurd size).
pub fn get_size(h: &mut Bytes, what: &str, max: usize) -> Result<usize> {
    let v = h.u64().map_err(|e| Error::Io(format!("{what}: {e}")))?;
    if v == 0 || v > max as u64 {
        return Err(Error::Io(format!("{what} is {v} (1..={max})")));
    }
    Ok(v as usize)
}

/// Reads a 0/1 flag byte.
pub fn get_flag(h: &mut Bytes, what: &str) -> Result<bool> {
    match h.u8().map_err(|e| Error::Io(format!("{what}: {e}")))? {
        0 => Ok(false),
        1 => Ok(true),
        b => Err(Error::Io(format!("{what} flag is {b}"))),
    }
}

/// Appends a classifier head: hidden widths, then the class count.
pub fn put_head(out: &mut Vec<u8>, hidden: &[usize], classes: usize) {
    put_u64(out, hidden.len());
    for &v in hidden.iter().chain([&classes]) {
        put_u64(out, v);
    }
}

/// Reads what [`put_head`] wrote: `(hidden widths, classes)`.
pub fn get_head(h: &mut Bytes) -> Result<(Vec<usize>, usize)> {
    let n = h.u64().map_err(|e| Error::Io(format!("head depth: {e}")))?;
    if n > 1024 {
        return Err(Error::Io(format!("head depth is {n} (0..=1024)")));
    }
    let mut widths = (0..=n)
        .map(|i| get_size(h, &format!("head layer {i} width"), 1 << 24))
        .collect::<Result<Vec<_>>>()?;
    let classes = widths.pop().unwrap_or(0);
    Ok((widths, classes))
}

/// An error unless the header, fully read, describes exactly the values
/// the file holds (`need`: the model's count, `None` on overflow): checked
/// before anything is planned, so a corrupt width never allocates.
pub fn check_counts(h: &Bytes, need: Option<usize>, held: usize) -> Result<()> {
    if !h.is_done() {
        return Err(Error::Io("trailing bytes after the header".into()));
    }
    if need != Some(held) {
        return Err(Error::Io(format!(
            "shapes need {need:?} values, the file holds {held}"
        )));
    }
    Ok(())
}

/// A model that saves to and loads from the model-file format. The values
/// are stored in plain layouts (row-major weights, KCRS filters, unpadded
/// biases), so a file does not depend on the blocking of the build or CPU
/// that wrote it.
pub trait ModelFile: Sized {
    /// The kind tag, e.g. `*b"MLP\0"`.
    const KIND: [u8; 4];
    /// The architecture: whatever [`ModelFile::from_parts`] needs to plan
    /// the model again.
    fn header(&self) -> Vec<u8>;
    /// Every parameter (and saved statistic), plain, in a fixed order.
    fn values(&self) -> Vec<f32>;
    /// The model planned for minibatch `batch` from a checked header and
    /// values; shapes that do not account for exactly the values are an
    /// error.
    fn from_parts(header: &[u8], values: &[f32], batch: usize) -> Result<Self>;

    /// Saves the model (checksummed, written atomically).
    fn save(&self, path: &Path) -> Result<()> {
        write(path, Self::KIND, &self.header(), &self.values())
    }
    /// Loads a model saved by [`ModelFile::save`], planned for minibatch
    /// `batch`. Any corruption is an error naming the file.
    fn load(path: &Path, batch: usize) -> Result<Self> {
        let (header, values) = read(path, Self::KIND)?;
        Self::from_parts(&header, &values, batch)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))
    }
    /// [`ModelFile::load`] on a file's bytes in memory (what the fuzz
    /// target drives).
    fn from_bytes(bytes: &[u8], batch: usize) -> Result<Self> {
        let (header, values) = parse(bytes, Self::KIND).map_err(Error::Io)?;
        Self::from_parts(&header, &values, batch)
    }
}
