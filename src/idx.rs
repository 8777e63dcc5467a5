//! A reader for the IDX format of (Fashion-)MNIST: big-endian magic
//! `0x00 0x00 <type> <dims>`, one big-endian `u32` per dimension, then the
//! data. Only unsigned bytes (type `0x08`) occur in these data sets; other
//! types are refused by name. Files may be gzip-compressed (as Debian ships
//! them); the gzip magic is detected, not the file name.

use crate::error::DataError;
use std::io::Read;
use std::path::Path;

/// An IDX array of unsigned bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdxArray {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// `product(dims)` values.
    pub data: Vec<u8>,
}

/// Parses IDX bytes (already decompressed); `name` is for error messages.
pub fn parse_idx(bytes: &[u8], name: &str) -> Result<IdxArray, DataError> {
    let bad = |reason: String| DataError::Format {
        source_name: name.to_string(),
        reason,
    };
    if bytes.len() < 4 || bytes[0] != 0 || bytes[1] != 0 {
        return Err(bad(
            "not an IDX file (magic must start with two zero bytes)".into(),
        ));
    }
    if bytes[2] != 0x08 {
        return Err(bad(format!(
            "element type 0x{:02x}; only unsigned bytes (0x08) are supported",
            bytes[2]
        )));
    }
    let nd = bytes[3] as usize;
    let head = 4 + 4 * nd;
    if nd == 0 || bytes.len() < head {
        return Err(bad(format!("header of {nd} dimensions is truncated")));
    }
    let dims: Vec<usize> = (0..nd)
        .map(|i| u32::from_be_bytes(bytes[4 + 4 * i..8 + 4 * i].try_into().unwrap()) as usize)
        .collect();
    let len = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
    if bytes.len() - head != len {
        return Err(bad(format!(
            "dimensions {dims:?} need {len} bytes of data, the file has {}",
            bytes.len() - head
        )));
    }
    Ok(IdxArray {
        dims,
        data: bytes[head..].to_vec(),
    })
}

/// Reads an IDX file, gunzipping it if it is compressed.
pub fn read_idx(path: &Path) -> Result<IdxArray, DataError> {
    let raw = std::fs::read(path).map_err(|e| {
        DataError::Io(std::io::Error::new(
            e.kind(),
            format!("{}: {e}", path.display()),
        ))
    })?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| {
                DataError::Io(std::io::Error::new(
                    e.kind(),
                    format!("{}: {e}", path.display()),
                ))
            })?;
        out
    } else {
        raw
    };
    parse_idx(&bytes, &path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses_by_name() {
        let mut b = vec![0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 3];
        b.extend([1, 2, 3, 4, 5, 6]);
        let a = parse_idx(&b, "t").unwrap();
        assert_eq!(a.dims, vec![2, 3]);
        assert_eq!(a.data, vec![1, 2, 3, 4, 5, 6]);
        b.pop();
        let e = parse_idx(&b, "t").unwrap_err().to_string();
        assert!(e.contains("need 6 bytes") && e.contains("has 5"), "{e}");
        let e = parse_idx(&[0, 0, 0x0d, 1, 0, 0, 0, 1, 0, 0, 0, 0], "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("0x0d"), "{e}");
        let e = parse_idx(&[1, 2, 3], "g").unwrap_err().to_string();
        assert!(e.contains("not an IDX"), "{e}");
    }
}
