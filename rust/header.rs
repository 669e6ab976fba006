//! Parsing and strict validation of the safetensors header.
//!
//! Layout: 8-byte little-endian header length `n`, `n` bytes of UTF-8 JSON, then the data section.
//! The JSON maps tensor names to `{"dtype", "shape", "data_offsets"}` (offsets relative to the data
//! section) plus an optional `"__metadata__"` object of strings. Validation follows the format's
//! rules and reports the first broken one as its own [`Error`] variant.
//!
//! * this module: the header types and the reading of a file's prefix ([`read_header_len`],
//!   [`parse_header`], [`parse_buffer`]).
//! * `json`: the JSON read with its duplicates and order kept.
//! * `rules`: the format's rules for tensor entries, metadata and the data section's layout.
//! * `build`: writing a header ([`build_header`]).

use std::collections::HashMap;

use serde_json::Value;

use crate::dtype::Dtype;
use crate::error::{Error, Result};

mod build;
mod json;
mod rules;

pub use build::{build_header, BuiltHeader};
use json::{parse_entries, Entry};
use rules::{check_layout, parse_metadata, parse_tensor};

/// Largest header accepted, as in the safetensors crate: a bigger one is a malformed or hostile file.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// Bytes before the JSON header.
pub const LEN_PREFIX: u64 = 8;

/// One tensor of the header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Offset of the first byte, relative to the data section.
    pub begin: u64,
    /// Offset one past the last byte, relative to the data section.
    pub end: u64,
}

impl TensorInfo {
    /// Number of elements (1 for a 0-d tensor). Validated not to overflow.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of data.
    pub fn nbytes(&self) -> u64 {
        self.end - self.begin
    }
}

/// A validated header.
#[derive(Clone, Debug)]
pub struct Header {
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    metadata: Option<Vec<(String, String)>>,
    /// The first thing that only strict reading refuses (see [`Header::strict_violation`]).
    strict_violation: Option<Error>,
    /// Length of the JSON part.
    pub json_len: u64,
}

impl Header {
    /// Tensors in header order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Looks a tensor up by name.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Tensor names, sorted (as `safetensors.safe_open.keys()`).
    pub fn sorted_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        names
    }

    /// The `__metadata__` entries, if the header has them.
    pub fn metadata(&self) -> Option<&[(String, String)]> {
        self.metadata.as_deref()
    }

    /// Absolute file offset of the data section.
    pub fn data_start(&self) -> u64 {
        LEN_PREFIX + self.json_len
    }

    /// What a strict reader refuses in this header, which the default reading accepts as the
    /// safetensors crate does: an unknown field in a tensor entry (ignored) or
    /// `"__metadata__": null` (no metadata). Neither can make two readers disagree on a tensor.
    pub fn strict_violation(&self) -> Option<&Error> {
        self.strict_violation.as_ref()
    }
}

/// Reads the header length from the first 8 bytes and checks it against the cap and the file size.
pub fn read_header_len(prefix: &[u8], file_len: u64) -> Result<u64> {
    if file_len < LEN_PREFIX || prefix.len() < LEN_PREFIX as usize {
        return Err(Error::FileTooSmall { len: file_len });
    }
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&prefix[..8]);
    let len = u64::from_le_bytes(bytes);
    if len > MAX_HEADER_LEN {
        return Err(Error::HeaderTooLarge {
            len,
            cap: MAX_HEADER_LEN,
        });
    }
    if len > file_len - LEN_PREFIX {
        return Err(Error::HeaderPastEof { len, file_len });
    }
    Ok(len)
}

/// Parses and validates the JSON header of a file of `file_len` bytes.
pub fn parse_header(json: &[u8], file_len: u64) -> Result<Header> {
    let json_len = json.len() as u64;
    let data_len = file_len
        .checked_sub(LEN_PREFIX + json_len)
        .ok_or(Error::HeaderPastEof {
            len: json_len,
            file_len,
        })?;
    let text = std::str::from_utf8(json).map_err(|e| Error::HeaderNotUtf8 {
        position: e.valid_up_to(),
    })?;
    let entries = parse_entries(text)?;

    let mut tensors = Vec::with_capacity(entries.len());
    let mut by_name = HashMap::with_capacity(entries.len());
    let mut metadata = None;
    let mut seen_metadata = false;
    let mut strict_violation = None;
    for (name, value) in entries {
        if name == "__metadata__" {
            if seen_metadata {
                return Err(Error::DuplicateName { tensor: name });
            }
            seen_metadata = true;
            if matches!(value, Entry::Other(Value::Null)) {
                strict_violation.get_or_insert(Error::InvalidMetadata {
                    detail: "is null (strict reading wants an object or no __metadata__)".into(),
                });
                continue;
            }
            metadata = Some(parse_metadata(value)?);
            continue;
        }
        if by_name.contains_key(&name) {
            return Err(Error::DuplicateName { tensor: name });
        }
        let info = parse_tensor(name, value, data_len, &mut strict_violation)?;
        by_name.insert(info.name.clone(), tensors.len());
        tensors.push(info);
    }
    check_layout(&tensors, data_len)?;
    Ok(Header {
        tensors,
        by_name,
        metadata,
        strict_violation,
        json_len,
    })
}

/// Validates a whole file held in memory (tests, fuzzing, and callers with a buffer).
pub fn parse_buffer(buf: &[u8]) -> Result<Header> {
    let file_len = buf.len() as u64;
    let n = read_header_len(buf, file_len)? as usize;
    parse_header(&buf[LEN_PREFIX as usize..LEN_PREFIX as usize + n], file_len)
}

#[cfg(test)]
mod tests;
