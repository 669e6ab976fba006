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

/// Fuzzer bytes read as a stream of small numbers; an exhausted stream reads zeros, so every
/// input decodes to something.
struct Stream<'a> {
    bytes: &'a [u8],
}

impl<'a> Stream<'a> {
    fn u8(&mut self) -> u8 {
        match self.bytes.split_first() {
            Some((&b, rest)) => {
                self.bytes = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        b.iter_mut().for_each(|x| *x = self.u8());
        u64::from_le_bytes(b)
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.bytes.split_at(n.min(self.bytes.len()));
        self.bytes = rest;
        head
    }

    fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// Tensor names the structured headers pick from; few, so duplicates happen.
const NAMES: [&str; 8] = [
    "a",
    "b",
    "w",
    "x.weight",
    "",
    "__metadata__",
    "é\"\\\n",
    "a ",
];

/// A dimension: mostly small, sometimes 0, sometimes large enough to overflow products.
fn dim(s: &mut Stream) -> u64 {
    match s.u8() {
        x @ 0..=223 => (x % 8) as u64,
        x @ 224..=239 => (x as u64) << 4,
        240 => 1 << 32,
        241 => (1 << 32) + 1,
        242 => 1 << 63,
        243 => u64::MAX,
        244 => u32::MAX as u64,
        x => 1 << (x - 200),
    }
}

/// A header JSON that is mostly well-formed, with a layout that is mostly consistent: what gets
/// the fuzzer past the JSON parser and into the layout rules and the planner.
fn structured_header(s: &mut Stream) -> (String, u64) {
    let mut entries: Vec<String> = Vec::new();
    let mut pos = 0u64;
    let n = s.u8() % 6;
    if s.u8() % 8 == 0 {
        let value = match s.u8() % 4 {
            0 => r#"{"k":1}"#,
            1 => "[]",
            _ => r#"{"format":"pt"}"#,
        };
        entries.push(format!(r#""__metadata__":{value}"#));
    }
    for _ in 0..n {
        let name = serde_json::to_string(NAMES[(s.u8() % 8) as usize]).expect("a string");
        let d = s.u8() as usize;
        let dtype = match ALL_DTYPES.get(d % 22) {
            Some(dt) => dt.name(),
            None => ["F128", "bf16"][d % 2],
        };
        let ndim = s.u8() % 5;
        let shape: Vec<u64> = (0..ndim).map(|_| dim(s)).collect();
        let nbytes = Dtype::parse(dtype)
            .and_then(|dt| {
                shape
                    .iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d))
                    .and_then(|n| dt.bytes_for(n))
            })
            .unwrap_or(0);
        let (begin, end) = match s.u8() % 8 {
            0..=4 => (pos, pos.saturating_add(nbytes)),
            5 => (
                pos,
                pos.saturating_add(nbytes).saturating_add(s.u8() as u64 % 3),
            ),
            6 => (
                pos.saturating_sub(s.u8() as u64 % 3),
                pos.saturating_add(nbytes),
            ),
            _ => (s.u16() as u64, s.u16() as u64),
        };
        pos = pos.max(end);
        let extra = if s.u8() % 16 == 0 { r#","x":1"# } else { "" };
        entries.push(format!(
            r#"{name}:{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{begin},{end}]{extra}}}"#
        ));
    }
    (format!("{{{}}}", entries.join(",")), pos)
}

/// Decodes a whole file from fuzzer bytes: a structured or raw JSON header, a header length that
/// is usually right, and a data section whose length is usually what the header needs.
fn file_from_stream(s: &mut Stream) -> Vec<u8> {
    let mode = s.u8();
    let (json, needed) = if mode % 4 == 3 {
        let n = (s.u16() % 1024) as usize;
        (s.take(n).to_vec(), s.u16() as u64)
    } else {
        let (json, pos) = structured_header(s);
        (json.into_bytes(), pos)
    };
    let data_len = match s.u8() % 8 {
        0..=5 => needed,
        6 => needed.saturating_add(s.u8() as u64 % 5).saturating_sub(2),
        _ => s.u16() as u64,
    }
    .min(MAX_DATA);
    let prefix = if mode & 0x80 != 0 && mode & 0x40 != 0 {
        s.u64()
    } else {
        json.len() as u64
    };
    let mut file = prefix.to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    file.extend((0..data_len).map(|i| (i.wrapping_mul(31).wrapping_add(7) % 251) as u8));
    file
}

/// An index for a selection: mostly inside `0..=bound`, sometimes just past it or huge.
fn index(s: &mut Stream, bound: u64) -> u64 {
    match s.u8() {
        x @ 0..=219 => (x as u64) % bound.saturating_add(1),
        x @ 220..=239 => bound.saturating_add((x - 220) as u64),
        240 => bound / 2,
        x => u64::MAX - (x - 240) as u64,
    }
}

/// What a request should do according to the format's rules, computed independently of the
/// planner (u128 arithmetic, no chunking): the flat element runs it reads, or `None` when the
/// planner must refuse it.
fn expected_runs(h: &Header, name: &str, to: Dtype, sel: Selection) -> Option<Vec<(u128, u128)>> {
    let t = h.get(name)?;
    if t.dtype != to && !(t.dtype.is_convertible_float() && to.is_convertible_float()) {
        return None;
    }
    if t.dtype.itemsize().is_none() && sel != Selection::All {
        return None;
    }
    let numel = t.numel() as u128;
    match sel {
        Selection::All => Some(vec![(0, numel)]),
        Selection::Elements { start, stop } => {
            let (start, stop) = (start as u128, stop as u128);
            (start <= stop && stop <= numel).then(|| vec![(start, stop - start)])
        }
        Selection::Slice { dim, start, stop } => {
            let size = *t.shape.get(dim)? as u128;
            let (start, stop) = (start as u128, stop as u128);
            if start > stop || stop > size {
                return None;
            }
            if numel == 0 || start == stop {
                return Some(vec![]);
            }
            // numel > 0: every dimension is >= 1, so these products are at most numel.
            let outer: u128 = t.shape[..dim].iter().map(|&d| d as u128).product();
            let inner: u128 = t.shape[dim + 1..].iter().map(|&d| d as u128).product();
            Some(
                (0..outer)
                    .map(|o| ((o * size + start) * inner, (stop - start) * inner))
                    .collect(),
            )
        }
    }
}

/// The bytes a request must produce, gathered and converted without the planner.
fn expected_bytes(
    file_bytes: &[u8],
    h: &Header,
    t: &TensorInfo,
    runs: &[(u128, u128)],
    to: Dtype,
) -> Vec<u8> {
    let base = h.data_start() as usize + t.begin as usize;
    let src: Vec<u8> = match t.dtype.itemsize() {
        None => file_bytes[base..base + t.nbytes() as usize].to_vec(),
        Some(size) => runs
            .iter()
            .flat_map(|&(first, count)| {
                let from = base + first as usize * size;
                file_bytes[from..from + count as usize * size]
                    .iter()
                    .copied()
            })
            .collect(),
    };
    if t.dtype == to {
        return src;
    }
    let n = src.len()
        / t.dtype
            .itemsize()
            .expect("converting types have an itemsize");
    let mut out = vec![0u8; n * to.itemsize().expect("converting types have an itemsize")];
    convert(&src, t.dtype, &mut out, to);
    out
}

/// One request as decoded from the fuzzer, with the oracle's verdict.
struct Case {
    request: Request,
    buf: Guarded,
    /// The runs it reads, if the planner must accept it.
    runs: Option<Vec<(u128, u128)>>,
}

/// Decodes arbitrary bytes into a file and a batch of copy requests, then checks that the planner
/// accepts exactly the requests the format allows, and that running an accepted plan writes
/// exactly the expected bytes and nothing outside the destinations.
pub fn check_copy_plan(bytes: &[u8]) {
    let mut s = Stream { bytes };
    let file_bytes = file_from_stream(&mut s);
    check_header_bytes(&file_bytes);
    let file = match SafetensorsFile::from_bytes("fuzz.safetensors", file_bytes.clone()) {
        Ok(f) => f,
        Err(e) => return check_file_error(&e),
    };
    let h = file.header();
    let names: Vec<String> = h.tensors().iter().map(|t| t.name.clone()).collect();
    let threads = 1 + (s.u8() % 3) as usize;
    let n = 1 + s.u8() % 6;
    let mut cases: Vec<Case> = Vec::new();
    for _ in 0..n {
        if s.is_empty() && !cases.is_empty() {
            break;
        }
        let pick = s.u8();
        let name = match names.get(pick as usize % names.len().max(1)) {
            Some(n) if pick < 224 => n.clone(),
            _ => "missing".to_string(),
        };
        let stored = h.get(&name).map(|t| t.dtype);
        let d = s.u8();
        let to = match stored {
            Some(dt) if d < 128 => dt,
            _ => ALL_DTYPES[d as usize % ALL_DTYPES.len()],
        };
        let shape = h.get(&name).map(|t| t.shape.clone()).unwrap_or_default();
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .unwrap_or(u64::MAX);
        let selection = match s.u8() % 4 {
            0 | 1 => Selection::All,
            2 => Selection::Elements {
                start: index(&mut s, numel),
                stop: index(&mut s, numel),
            },
            _ => {
                let dim = (s.u8() % (shape.len() as u8 + 1)) as usize;
                let size = shape.get(dim).copied().unwrap_or(8);
                Selection::Slice {
                    dim,
                    start: index(&mut s, size),
                    stop: index(&mut s, size),
                }
            }
        };
        let runs = expected_runs(h, &name, to, selection);
        // Valid requests are bounded by the data section (every element has >= 4 bits), so the
        // exact destination is always small enough to allocate.
        let exact = runs.as_ref().map(|r| {
            let total: u128 = r.iter().map(|&(_, c)| c).sum();
            (total * to.bits() as u128 / 8) as usize
        });
        let size_pick = s.u8();
        let len = match (exact, size_pick) {
            (Some(e), 0..=199) => e,
            (Some(e), 200..=219) => e + 1,
            (Some(e), 220..=239) => e.saturating_sub(1),
            (_, x) => (x % 64) as usize,
        };
        let null = s.u8() == 255;
        let mut buf = Guarded::new(len);
        let ptr = if null {
            std::ptr::null_mut()
        } else {
            buf.ptr()
        };
        let valid = exact == Some(len) && !(null && len > 0);
        let request = Request {
            name,
            ptr,
            len,
            dtype: to,
            selection,
        };
        cases.push(Case {
            request,
            buf,
            runs: if valid { runs } else { None },
        });
    }
    let requests: Vec<Request> = cases.iter().map(|c| c.request.clone()).collect();
    let all_valid = cases.iter().all(|c| c.runs.is_some());
    let plan = match copy::plan(&file, &requests) {
        Ok(p) => p,
        Err(e) => {
            assert!(
                !all_valid,
                "planner refused valid requests: {e} ({requests:?})"
            );
            assert!(
                !e.is_file_error(),
                "a request error reported as a file error: {e:?}"
            );
            return;
        }
    };
    assert!(
        all_valid,
        "planner accepted requests the format forbids: {requests:?}"
    );
    let want_dst: u64 = cases.iter().map(|c| c.request.len as u64).sum();
    assert_eq!(plan.dst_bytes(), want_dst);
    // SAFETY: every request points into its own live `Guarded` buffer of the stated length (or is
    // a null pointer with length 0, which the engine must not touch).
    let written = unsafe { copy::execute(&file, &plan, Some(threads), None, None) }
        .expect("an accepted plan runs against an unchanged in-memory file");
    assert_eq!(written, want_dst);
    for c in &cases {
        let r = &c.request;
        c.buf.assert_guards_intact(&r.name);
        if r.ptr.is_null() {
            continue;
        }
        let t = h
            .get(&r.name)
            .expect("accepted requests name tensors of the file");
        let runs = c.runs.as_ref().expect("accepted");
        let want = expected_bytes(&file_bytes, h, t, runs, r.dtype);
        assert!(
            c.buf.data() == want.as_slice(),
            "'{}' {:?}: wrong bytes",
            r.name,
            r.selection
        );
    }
}
