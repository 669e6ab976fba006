//! Parsing and strict validation of the safetensors header.
//!
//! Layout: 8-byte little-endian header length `n`, `n` bytes of UTF-8 JSON, then the data section.
//! The JSON maps tensor names to `{"dtype", "shape", "data_offsets"}` (offsets relative to the data
//! section) plus an optional `"__metadata__"` object of strings. Validation follows the format's
//! rules and reports the first broken one as its own [`Error`] variant.

use std::collections::HashMap;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

use crate::dtype::Dtype;
use crate::error::{Error, Result};

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

/// The top-level object's entries in file order, duplicates kept (a map type would drop them).
struct Entries(Vec<(String, Entry)>);

/// A top-level value. An object keeps its fields in order with duplicates, so that
/// `{"dtype": "F32", "dtype": "F16"}` is refused rather than one of the two silently winning:
/// JSON readers disagree on which one wins, and a file must not mean different tensors to
/// different loaders.
enum Entry {
    Object(Vec<(String, Value)>),
    Other(Value),
}

impl<'de> serde::Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct EntryVisitor;
        impl<'de> Visitor<'de> for EntryVisitor {
            type Value = Entry;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entry, A::Error> {
                let mut fields = Vec::with_capacity(map.size_hint().unwrap_or(0).min(8));
                while let Some(field) = map.next_entry::<String, Value>()? {
                    fields.push(field);
                }
                Ok(Entry::Object(fields))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> std::result::Result<Entry, A::Error> {
                let value = Value::deserialize(de::value::SeqAccessDeserializer::new(seq))?;
                Ok(Entry::Other(value))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<Entry, E> {
                Ok(Entry::Other(Value::Bool(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Entry, E> {
                Ok(Entry::Other(Value::from(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Entry, E> {
                Ok(Entry::Other(Value::from(v)))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Entry, E> {
                Ok(Entry::Other(Value::from(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Entry, E> {
                Ok(Entry::Other(Value::String(v.to_owned())))
            }
            fn visit_unit<E: de::Error>(self) -> std::result::Result<Entry, E> {
                Ok(Entry::Other(Value::Null))
            }
        }
        d.deserialize_any(EntryVisitor)
    }
}

impl Entry {
    /// What the value is, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Entry::Object(_) => "an object",
            Entry::Other(v) => json_kind(v),
        }
    }
}

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((k, v)) = map.next_entry::<String, Entry>()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(EntriesVisitor)
    }
}

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

fn parse_entries(text: &str) -> Result<Vec<(String, Entry)>> {
    if !text.trim_start().starts_with('{') {
        // Tell "valid JSON, wrong shape" from "not JSON at all".
        return Err(match serde_json::from_str::<de::IgnoredAny>(text) {
            Ok(_) => Error::HeaderNotObject,
            Err(e) => Error::InvalidJson {
                detail: e.to_string(),
            },
        });
    }
    serde_json::from_str::<Entries>(text)
        .map(|e| e.0)
        .map_err(|e| Error::InvalidJson {
            detail: e.to_string(),
        })
}

fn parse_metadata(value: Entry) -> Result<Vec<(String, String)>> {
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

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn parse_tensor(
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
fn check_layout(tensors: &[TensorInfo], data_len: u64) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file from a raw JSON header and `data_len` zero bytes of data.
    fn file(json: &str, data_len: usize) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data_len));
        v
    }

    fn rule(buf: &[u8]) -> &'static str {
        parse_buffer(buf).unwrap_err().rule()
    }

    #[test]
    fn accepts_a_valid_file_with_metadata_and_empty_and_scalar_tensors() {
        let json = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"s":{"dtype":"BF16","shape":[],"data_offsets":[16,18]},"e":{"dtype":"I64","shape":[0,3],"data_offsets":[18,18]}}"#;
        let h = parse_buffer(&file(json, 18)).unwrap();
        assert_eq!(h.tensors().len(), 3);
        assert_eq!(h.get("s").unwrap().numel(), 1);
        assert_eq!(h.get("e").unwrap().nbytes(), 0);
        assert_eq!(
            h.metadata().unwrap(),
            &[("format".to_string(), "pt".to_string())]
        );
        assert_eq!(h.sorted_names(), vec!["a", "e", "s"]);
    }

    #[test]
    fn refuses_empty_shapes_that_no_tensor_can_index_and_accepts_the_largest_that_can() {
        let one = |shape: &str| {
            let json = format!(r#"{{"e":{{"dtype":"F32","shape":{shape},"data_offsets":[0,0]}}}}"#);
            parse_buffer(&file(&json, 0)).map(|h| h.tensors().len())
        };
        for shape in [
            "[0,9223372036854775808]",
            "[9223372036854775808,0]",
            "[0,1099511627776,1099511627776]",
            "[0,4611686018427387904,4]",
        ] {
            assert_eq!(one(shape).unwrap_err().rule(), "invalid-shape", "{shape}");
        }
        for shape in [
            "[0,9223372036854775807]",
            "[0,2147483648,2147483648]",
            "[4611686018427387904,0,4]",
            "[0]",
        ] {
            assert_eq!(one(shape).unwrap(), 1, "{shape}");
        }
    }

    #[test]
    fn accepts_an_empty_header() {
        assert!(parse_buffer(&file("{}", 0)).unwrap().tensors().is_empty());
    }

    #[test]
    fn rejects_a_file_shorter_than_the_length_prefix() {
        assert_eq!(rule(&[1, 2, 3]), "file-too-small");
    }

    #[test]
    fn rejects_a_header_length_over_the_cap() {
        let mut v = (MAX_HEADER_LEN + 1).to_le_bytes().to_vec();
        v.extend_from_slice(b"{}");
        assert_eq!(rule(&v), "header-too-large");
        let v = u64::MAX.to_le_bytes().to_vec();
        assert_eq!(rule(&v), "header-too-large");
    }

    #[test]
    fn rejects_a_header_length_past_the_end_of_file() {
        let mut v = 100u64.to_le_bytes().to_vec();
        v.extend_from_slice(b"{}");
        assert_eq!(rule(&v), "header-past-eof");
    }

    #[test]
    fn rejects_a_header_that_is_not_utf8() {
        let mut v = 4u64.to_le_bytes().to_vec();
        v.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
        assert_eq!(rule(&v), "header-not-utf8");
    }

    #[test]
    fn rejects_invalid_json() {
        assert_eq!(rule(&file("{\"a\":", 0)), "invalid-json");
        assert_eq!(rule(&file("nope", 0)), "invalid-json");
    }

    #[test]
    fn rejects_json_that_is_not_an_object() {
        assert_eq!(rule(&file("[1,2]", 0)), "header-not-object");
        assert_eq!(rule(&file("  \"x\"", 0)), "header-not-object");
    }

    #[test]
    fn rejects_entries_with_missing_or_mistyped_fields() {
        assert_eq!(
            rule(&file(r#"{"a":{"dtype":"F32","shape":[1]}}"#, 4)),
            "invalid-tensor-entry"
        );
        assert_eq!(rule(&file(r#"{"a":3}"#, 0)), "invalid-tensor-entry");
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
                4
            )),
            "invalid-tensor-entry"
        );
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,-4]}}"#,
                4
            )),
            "invalid-tensor-entry"
        );
    }

    #[test]
    fn accepts_unknown_entry_fields_and_null_metadata_but_notes_them_for_strict_reading() {
        let h = parse_buffer(&file(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}"#,
            4,
        ))
        .unwrap();
        assert_eq!(h.get("a").unwrap().shape, vec![1]);
        let v = h.strict_violation().unwrap();
        assert_eq!(v.rule(), "invalid-tensor-entry");
        assert!(v.to_string().contains("unknown field 'x'"));

        let h = parse_buffer(&file(r#"{"__metadata__":null}"#, 0)).unwrap();
        assert!(h.metadata().is_none());
        assert_eq!(h.strict_violation().unwrap().rule(), "invalid-metadata");

        let ok = r#"{"__metadata__":{},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        assert!(parse_buffer(&file(ok, 4))
            .unwrap()
            .strict_violation()
            .is_none());
    }

    #[test]
    fn rejects_an_unknown_dtype() {
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#,
                16
            )),
            "unknown-dtype"
        );
    }

    #[test]
    fn rejects_negative_non_integer_and_overflowing_shapes() {
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                4
            )),
            "invalid-shape"
        );
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}}"#,
                4
            )),
            "invalid-shape"
        );
        let big = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,4]}}"#;
        assert_eq!(rule(&file(big, 4)), "invalid-shape");
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#,
                2
            )),
            "invalid-shape"
        );
    }

    #[test]
    fn rejects_begin_after_end() {
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}"#,
                4
            )),
            "invalid-offsets"
        );
    }

    #[test]
    fn rejects_a_span_that_disagrees_with_the_shape() {
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                4
            )),
            "span-mismatch"
        );
    }

    #[test]
    fn rejects_offsets_past_the_end_of_the_data() {
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                4
            )),
            "offsets-past-eof"
        );
    }

    #[test]
    fn rejects_duplicate_names() {
        let json = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
        assert_eq!(rule(&file(json, 2)), "duplicate-name");
    }

    #[test]
    fn rejects_overlapping_tensors() {
        let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
        assert_eq!(rule(&file(json, 6)), "overlap");
    }

    #[test]
    fn rejects_a_hole_between_tensors_or_before_the_first() {
        let json = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
        assert_eq!(rule(&file(json, 6)), "gap");
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
                4
            )),
            "gap"
        );
    }

    #[test]
    fn rejects_trailing_bytes_after_the_last_tensor() {
        assert_eq!(
            rule(&file(
                r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
                5
            )),
            "trailing-bytes"
        );
    }

    #[test]
    fn rejects_metadata_that_is_not_string_to_string() {
        assert_eq!(
            rule(&file(r#"{"__metadata__":{"a":1}}"#, 0)),
            "invalid-metadata"
        );
        assert_eq!(rule(&file(r#"{"__metadata__":[]}"#, 0)), "invalid-metadata");
    }

    #[test]
    fn rejects_a_field_or_metadata_key_given_twice() {
        // Readers disagree on which duplicate wins, so neither may.
        let twice = r#"{"a":{"dtype":"F32","dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        let err = parse_buffer(&file(twice, 4)).unwrap_err();
        assert_eq!(err.rule(), "invalid-tensor-entry");
        assert!(err.to_string().contains("'dtype' appears twice"), "{err}");
        let meta = r#"{"__metadata__":{"format":"pt","format":"np"}}"#;
        assert_eq!(rule(&file(meta, 0)), "invalid-metadata");
    }

    #[test]
    fn metadata_is_sorted_by_key_whatever_the_file_order() {
        let h = parse_buffer(&file(r#"{"__metadata__":{"b":"2","a":"1"}}"#, 0)).unwrap();
        let keys: Vec<&str> = h
            .metadata()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str())
            .collect();
        assert_eq!(keys, ["a", "b"]);
    }

    #[test]
    fn built_headers_parse_back() {
        let tensors = vec![
            ("w".to_string(), Dtype::F32, vec![3, 2]),
            ("b".to_string(), Dtype::BF16, vec![]),
            ("e".to_string(), Dtype::I8, vec![0]),
        ];
        let meta = [("format".to_string(), "pt".to_string())];
        let (prefix, offsets) = build_header(&tensors, Some(&meta)).unwrap();
        assert_eq!(prefix.len() % 8, 0);
        let data_len = offsets.last().unwrap().1 as usize;
        let mut buf = prefix.clone();
        buf.extend(std::iter::repeat_n(0u8, data_len));
        let h = parse_buffer(&buf).unwrap();
        assert_eq!(h.get("w").unwrap().begin, 0);
        assert_eq!(h.get("b").unwrap().end, 26);
        assert!(build_header(&[tensors[0].clone(), tensors[0].clone()], None).is_err());
    }

    #[test]
    fn built_headers_are_byte_identical_to_the_safetensors_writer() {
        let tensors = vec![("test1".to_string(), Dtype::I32, vec![2, 2])];
        let meta = [("framework".to_string(), "pt".to_string())];
        let (prefix, _) = build_header(&tensors, Some(&meta)).unwrap();
        let json = r#"{"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}"#;
        assert_eq!(&prefix[..8], &96u64.to_le_bytes());
        assert_eq!(
            std::str::from_utf8(&prefix[8..]).unwrap(),
            format!("{json} ")
        );
    }
}
