//! The header's JSON as read: the top-level entries in file order and each object's fields in
//! order, duplicates kept so that the rules can refuse them.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::Value;

use crate::error::{Error, Result};

/// The top-level object's entries in file order, duplicates kept (a map type would drop them).
struct Entries(Vec<(String, Entry)>);

/// A top-level value. An object keeps its fields in order with duplicates, so that
/// `{"dtype": "F32", "dtype": "F16"}` is refused rather than one of the two silently winning:
/// JSON readers disagree on which one wins, and a file must not mean different tensors to
/// different loaders.
pub(super) enum Entry {
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
    pub(super) fn kind(&self) -> &'static str {
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

pub(super) fn parse_entries(text: &str) -> Result<Vec<(String, Entry)>> {
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

pub(super) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
