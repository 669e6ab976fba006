//! Writing a header: the bytes the safetensors writer produces for tensors laid out back to back.

use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// What [`build_header`] returns: the file prefix (length + JSON) and each tensor's data offsets.
pub type BuiltHeader = (Vec<u8>, Vec<(u64, u64)>);

/// Serializes a header for the given tensors (name, dtype, shape) laid out back to back, padded
/// with spaces to a multiple of 8 bytes so the data section is aligned. Returns the full prefix
/// (length + JSON) and the data offsets of each tensor.
pub fn build_header(
    tensors: &[(String, Dtype, Vec<u64>)],
    metadata: Option<&[(String, String)]>,
) -> Result<BuiltHeader> {
    // Written by hand rather than through a JSON map so that the bytes are those of the
    // safetensors writer: `__metadata__` first, tensors in the given order, fields in the order
    // dtype, shape, data_offsets.
    let quote = |s: &str| serde_json::to_string(s).expect("a string always serializes");
    let mut parts = Vec::with_capacity(tensors.len() + 1);
    if let Some(meta) = metadata {
        let m: Vec<String> = meta
            .iter()
            .map(|(k, v)| format!("{}:{}", quote(k), quote(v)))
            .collect();
        parts.push(format!("\"__metadata__\":{{{}}}", m.join(",")));
    }
    let mut seen = std::collections::HashSet::with_capacity(tensors.len());
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut pos = 0u64;
    for (name, dtype, shape) in tensors {
        if name == "__metadata__" || !seen.insert(name.as_str()) {
            return Err(Error::DuplicateName {
                tensor: name.clone(),
            });
        }
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let nbytes = numel
            .and_then(|n| dtype.bytes_for(n))
            .ok_or_else(|| Error::InvalidShape {
                tensor: name.clone(),
                detail: format!("{shape:?} of {dtype} overflows or is not whole bytes"),
            })?;
        let end = pos.checked_add(nbytes).ok_or_else(|| Error::InvalidShape {
            tensor: name.clone(),
            detail: "the tensors' total size overflows".into(),
        })?;
        let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
        parts.push(format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{pos},{end}]}}",
            quote(name),
            dtype.name(),
            dims.join(",")
        ));
        offsets.push((pos, end));
        pos = end;
    }
    let mut json = format!("{{{}}}", parts.join(",")).into_bytes();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok((out, offsets))
}
