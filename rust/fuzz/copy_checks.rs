// The copy_plan target's checks, included by `checks.rs` into the same module (its `use` lines
// and `Guarded` serve here): fuzzer bytes decoded into a file and copy requests, an independent
// oracle of what the planner must accept, and the bytes an accepted plan must write.

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
        Selection::Rows {
            first,
            count,
            row,
            start,
            stop,
        } => {
            let (first, count, row) = (first as u128, count as u128, row as u128);
            let (start, stop) = (start as u128, stop as u128);
            if row == 0 || start > stop || stop > row {
                return None;
            }
            if count > 0 && (first + count - 1) * row + stop > numel {
                return None;
            }
            Some(
                (first..first + count)
                    .filter(|_| start < stop)
                    .map(|o| (o * row + start, stop - start))
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
            0 => Selection::All,
            1 => {
                let row = index(&mut s, numel);
                let rows = numel.checked_div(row).unwrap_or(1);
                Selection::Rows {
                    first: index(&mut s, rows),
                    count: index(&mut s, rows),
                    row,
                    start: index(&mut s, row),
                    stop: index(&mut s, row),
                }
            }
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
