// Checks shared by the fuzz targets (`rust/fuzz/fuzz_targets/*.rs`) and the corpus replay test of
// the main crate (`rust/corpus_replay.rs`). Both `include!` this file into a module where
// `fastload` names the crate, so the replay in CI runs exactly what the fuzzers ran.
//
// Every check panics on a broken invariant: libFuzzer reports the panic as a crash, the replay
// test as a failure.

use std::collections::HashSet;

use fastload::convert::convert;
use fastload::copy::{self, Request, Selection};
use fastload::dtype::{Dtype, ALL_DTYPES};
use fastload::error::Error;
use fastload::file::SafetensorsFile;
use fastload::header::{self, Header, TensorInfo, LEN_PREFIX, MAX_HEADER_LEN};

/// Bytes on each side of a destination; a write outside the destination changes them.
const GUARD: usize = 64;
const GUARD_BYTE: u8 = 0xA5;
/// Largest data section the structured inputs of the copy target build.
const MAX_DATA: u64 = 1 << 16;

/// A destination buffer with guard bytes on both sides, pre-filled with the guard pattern so a
/// byte the engine forgets to write shows up as a mismatch too.
struct Guarded {
    buf: Vec<u8>,
    len: usize,
}

impl Guarded {
    fn new(len: usize) -> Self {
        Guarded {
            buf: vec![GUARD_BYTE; len + 2 * GUARD],
            len,
        }
    }

    fn ptr(&mut self) -> *mut u8 {
        self.buf[GUARD..].as_mut_ptr()
    }

    fn data(&self) -> &[u8] {
        &self.buf[GUARD..GUARD + self.len]
    }

    fn assert_guards_intact(&self, what: &str) {
        let before = &self.buf[..GUARD];
        let after = &self.buf[GUARD + self.len..];
        assert!(
            before.iter().chain(after).all(|&b| b == GUARD_BYTE),
            "{what}: a write landed outside the {}-byte destination",
            self.len
        );
    }
}

/// A rejected file must be rejected for a rule about the file, with a message that names it.
fn check_file_error(e: &Error) {
    assert!(
        e.is_file_error(),
        "header validation returned a non-file error: {e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("[{}] ", e.rule())),
        "message without its rule: {msg}"
    );
}

/// Runs a whole file through header validation and, when it is accepted, checks the layout
/// invariants, the round trip through `build_header`, and a copy of every tensor.
///
/// The first 8 bytes are also read as a claimed file length for the rest as a JSON header, which
/// exercises validation against file sizes no in-memory buffer could have.
pub fn check_header_bytes(bytes: &[u8]) {
    match header::parse_buffer(bytes) {
        Ok(h) => {
            check_layout(&h, bytes.len() as u64);
            check_round_trip(&h, bytes);
            check_whole_copies(&h, bytes);
        }
        Err(e) => check_file_error(&e),
    }
    if let Some(prefix) = bytes.get(..8) {
        let claimed = u64::from_le_bytes(prefix.try_into().expect("8 bytes"));
        match header::parse_header(&bytes[8..], claimed) {
            Ok(h) => check_layout(&h, claimed),
            Err(e) => check_file_error(&e),
        }
    }
}

/// The invariants of an accepted header: tensors cover the data section exactly, in order, with
/// no overlap, and every span agrees with its shape and dtype.
fn check_layout(h: &Header, file_len: u64) {
    assert!(h.json_len <= MAX_HEADER_LEN);
    assert_eq!(h.data_start(), LEN_PREFIX + h.json_len);
    assert!(
        h.data_start() <= file_len,
        "data section starts past the end of the file"
    );
    let data_len = file_len - h.data_start();
    let mut names = HashSet::new();
    for t in h.tensors() {
        assert!(
            names.insert(t.name.as_str()),
            "tensor '{}' accepted twice",
            t.name
        );
        assert_ne!(t.name, "__metadata__");
        assert!(
            t.begin <= t.end && t.end <= data_len,
            "'{}' outside the data",
            t.name
        );
        // u128 cannot overflow here: the header accepts only shapes whose running product fits
        // in u64, and a running product that reaches 0 stays 0.
        let numel = t.shape.iter().fold(1u128, |a, &d| a * d as u128);
        assert!(
            numel <= u64::MAX as u128,
            "'{}': element count overflows",
            t.name
        );
        assert_eq!(t.numel() as u128, numel);
        let bits = numel * t.dtype.bits() as u128;
        assert_eq!(
            bits % 8,
            0,
            "'{}': packed elements do not fill whole bytes",
            t.name
        );
        assert_eq!(
            bits / 8,
            (t.end - t.begin) as u128,
            "'{}': span disagrees",
            t.name
        );
        assert_eq!(t.nbytes(), t.end - t.begin);
        assert_eq!(h.get(&t.name), Some(t));
    }
    let mut pos = 0;
    for t in in_data_order(h) {
        assert_eq!(t.begin, pos, "'{}': hole or overlap", t.name);
        pos = t.end;
    }
    assert_eq!(pos, data_len, "tensors do not cover the data section");
    let sorted = h.sorted_names();
    assert_eq!(sorted.len(), h.tensors().len());
    assert!(sorted.windows(2).all(|w| w[0] < w[1]));
    if let Some(meta) = h.metadata() {
        let keys: HashSet<&str> = meta.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys.len(), meta.len(), "metadata key accepted twice");
    }
}

fn in_data_order(h: &Header) -> Vec<&TensorInfo> {
    let mut order: Vec<&TensorInfo> = h.tensors().iter().collect();
    order.sort_by_key(|t| (t.begin, t.end));
    order
}

/// An accepted header, written again by `build_header` in data order, parses to the same tensors.
fn check_round_trip(h: &Header, bytes: &[u8]) {
    let order = in_data_order(h);
    let spec: Vec<(String, Dtype, Vec<u64>)> = order
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect();
    let (mut rebuilt, offsets) =
        header::build_header(&spec, h.metadata()).expect("an accepted header re-serializes");
    for (t, &span) in order.iter().zip(&offsets) {
        assert_eq!(
            (t.begin, t.end),
            span,
            "'{}' moved in the rebuilt header",
            t.name
        );
    }
    rebuilt.extend_from_slice(&bytes[h.data_start() as usize..]);
    let back = header::parse_buffer(&rebuilt).expect("a rebuilt header parses");
    assert_eq!(back.tensors().len(), h.tensors().len());
    for t in h.tensors() {
        assert_eq!(back.get(&t.name), Some(t));
    }
    assert_eq!(back.metadata(), h.metadata());
}

/// Every tensor of an accepted file, copied whole in its own dtype, equals its bytes in the file.
fn check_whole_copies(h: &Header, bytes: &[u8]) {
    let file = SafetensorsFile::from_bytes("fuzz.safetensors", bytes.to_vec())
        .expect("from_bytes accepts what parse_buffer accepts");
    let mut bufs: Vec<Guarded> = h
        .tensors()
        .iter()
        .map(|t| Guarded::new(t.nbytes() as usize))
        .collect();
    let requests: Vec<Request> = h
        .tensors()
        .iter()
        .zip(bufs.iter_mut())
        .map(|(t, g)| Request {
            name: t.name.clone(),
            ptr: g.ptr(),
            len: g.len,
            dtype: t.dtype,
            selection: Selection::All,
        })
        .collect();
    let plan = copy::plan(&file, &requests).expect("whole tensors in their own dtype plan");
    // SAFETY: each request points into its own live `Guarded` buffer of the stated length.
    let written = unsafe { copy::execute(&file, &plan, Some(1), None, None) }.expect("copy of a valid file");
    assert_eq!(written, bufs.iter().map(|g| g.len as u64).sum::<u64>());
    let start = h.data_start() as usize;
    for (t, g) in h.tensors().iter().zip(&bufs) {
        g.assert_guards_intact(&t.name);
        assert!(
            g.data() == &bytes[start + t.begin as usize..start + t.end as usize],
            "'{}' copied wrong bytes",
            t.name
        );
    }
}

// The copy target's decoding and oracle: a file and its requests built from fuzzer bytes, and the
// bytes an accepted plan must write.
include!("copy_checks.rs");
