//! The format's rules: each tensor entry (fields, dtype, shape, offsets), the metadata, and the
//! data section covered exactly. The first broken rule is returned as its own [`Error`] variant.

use serde_json::Value;

use super::json::{json_kind, Entry};
use super::TensorInfo;
use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// Refuses a shape no tensor library can index, even with no elements: torch sizes and strides
/// are `i64`, and the first stride is the product of the later dimensions with zeros counted as
/// 1, so `[0, 2**63]` and `[0, 2**40, 2**40]` cannot be built while `[2**62, 0, 4]` can.
fn check_extent(name: &str, shape: &[u64]) -> Result<()> {
    const MAX: u64 = i64::MAX as u64;
    let refuse = |why: &str| Error::InvalidShape {
        tensor: name.to_string(),
        detail: format!("{shape:?}: {why}, which no tensor can be indexed with"),
    };
    if shape.iter().any(|&d| d > MAX) {
        return Err(refuse("a dimension above 2^63 - 1"));
    }
    let stride = shape
        .iter()
        .skip(1)
        .try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))
        .filter(|&n| n <= MAX);
    if stride.is_none() {
        return Err(refuse(
            "a stride above 2^63 - 1 (later dimensions, zeros counted as 1)",
        ));
    }
    Ok(())
}

pub(super) fn parse_metadata(value: Entry) -> Result<Vec<(String, String)>> {
    let Entry::Object(fields) = value else {
        return Err(Error::InvalidMetadata {
            detail: format!(
                "must be an object of string to string, found {}",
                value.kind()
            ),
        });
    };
    let mut out = Vec::with_capacity(fields.len());
    let mut seen = std::collections::HashSet::with_capacity(fields.len());
    for (k, v) in fields {
        let Value::String(s) = v else {
            return Err(Error::InvalidMetadata {
                detail: format!("value of '{k}' must be a string, found {}", json_kind(&v)),
            });
        };
        if !seen.insert(k.clone()) {
            return Err(Error::InvalidMetadata {
                detail: format!("key '{k}' appears twice"),
            });
        }
        out.push((k, s));
    }
    // Sorted, so that the order of keys in the file does not show (the header is a map).
    out.sort_unstable();
    Ok(out)
}

pub(super) fn parse_tensor(
    name: String,
    value: Entry,
    data_len: u64,
    strict_violation: &mut Option<Error>,
) -> Result<TensorInfo> {
    let entry_err = |detail: String| Error::InvalidTensorEntry {
        tensor: name.clone(),
        detail,
    };
    let Entry::Object(fields) = value else {
        return Err(entry_err(format!(
            "expected an object, found {}",
            value.kind()
        )));
    };
    let mut obj = serde_json::Map::new();
    for (field, v) in fields {
        if !matches!(field.as_str(), "dtype" | "shape" | "data_offsets") {
            // Ignored, as the safetensors crate does; only strict reading refuses it.
            strict_violation.get_or_insert_with(|| entry_err(format!("unknown field '{field}'")));
            continue;
        }
        if obj.insert(field.clone(), v).is_some() {
            return Err(entry_err(format!("field '{field}' appears twice")));
        }
    }
    let dtype = match obj.remove("dtype") {
        Some(Value::String(s)) => Dtype::parse(&s).ok_or_else(|| Error::UnknownDtype {
            tensor: name.clone(),
            dtype: s,
        })?,
        Some(other) => {
            return Err(entry_err(format!(
                "'dtype' must be a string, found {}",
                json_kind(&other)
            )))
        }
        None => return Err(entry_err("missing field 'dtype'".into())),
    };
    let shape = match obj.remove("shape") {
        Some(Value::Array(dims)) => dims
            .iter()
            .map(|d| {
                d.as_u64().ok_or_else(|| Error::InvalidShape {
                    tensor: name.clone(),
                    detail: format!("dimension {d} is not a non-negative integer"),
                })
            })
            .collect::<Result<Vec<u64>>>()?,
        Some(other) => {
            return Err(entry_err(format!(
                "'shape' must be an array, found {}",
                json_kind(&other)
            )))
        }
        None => return Err(entry_err("missing field 'shape'".into())),
    };
    let (begin, end) = match obj.remove("data_offsets") {
        Some(Value::Array(o)) if o.len() == 2 => match (o[0].as_u64(), o[1].as_u64()) {
            (Some(b), Some(e)) => (b, e),
            _ => {
                return Err(entry_err(
                    "'data_offsets' must be two non-negative integers".into(),
                ))
            }
        },
        Some(_) => return Err(entry_err("'data_offsets' must be [begin, end]".into())),
        None => return Err(entry_err("missing field 'data_offsets'".into())),
    };
    if begin > end {
        return Err(Error::InvalidOffsets {
            tensor: name,
            begin,
            end,
        });
    }
    check_extent(&name, &shape)?;
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::InvalidShape {
            tensor: name.clone(),
            detail: format!("{shape:?} overflows"),
        })?;
    let expected = dtype.bytes_for(numel).ok_or_else(|| Error::InvalidShape {
        tensor: name.clone(),
        detail: format!("{numel} elements of {dtype} do not fill whole bytes or overflow"),
    })?;
    if expected != end - begin {
        return Err(Error::SpanMismatch {
            tensor: name,
            expected,
            actual: end - begin,
        });
    }
    if end > data_len {
        return Err(Error::OffsetsPastEof {
            tensor: name,
            end,
            data_len,
        });
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        begin,
        end,
    })
}

/// The data section must be covered exactly: from byte 0, no overlaps, no holes, nothing after.
pub(super) fn check_layout(tensors: &[TensorInfo], data_len: u64) -> Result<()> {
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| (t.begin, t.end));
    let mut expected = 0u64;
    let mut prev: Option<&TensorInfo> = None;
    for t in order {
        if t.begin < expected {
            let other = prev.map(|p| p.name.clone()).unwrap_or_default();
            return Err(Error::Overlap {
                tensor: t.name.clone(),
                other,
            });
        }
        if t.begin > expected {
            return Err(Error::Gap {
                tensor: t.name.clone(),
                expected,
                begin: t.begin,
            });
        }
        expected = t.end;
        if t.end > t.begin {
            prev = Some(t);
        }
    }
    if expected != data_len {
        return Err(Error::TrailingBytes {
            covered: expected,
            data_len,
        });
    }
    Ok(())
}
