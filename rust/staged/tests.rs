use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::dtype::Dtype;
use crate::file::{ReadMode, SafetensorsFile};
use crate::header::build_header;

fn span(name: &str, begin: u64, end: u64, unit: u64) -> Span {
    Span {
        name: name.into(),
        begin,
        end,
        unit,
    }
}

#[test]
fn small_neighbours_share_a_fill_and_a_large_span_is_cut_at_element_boundaries() {
    let spans = [
        span("a", 100, 110, 2),
        span("b", 110, 130, 4),
        span("c", 130, 400, 4),
    ];
    let fills = layout(&spans, 128, 64, 0).unwrap();
    // Every byte of every span lands in exactly one piece, in order, inside its slot.
    for (i, s) in spans.iter().enumerate() {
        let mut at = 0;
        for f in &fills {
            assert_eq!(f.offset % 64, 0);
            assert!(f.len() <= 128);
            for p in f.pieces.iter().filter(|p| p.span == i) {
                assert_eq!(p.start, at);
                assert_eq!(p.start % s.unit, 0);
                assert_eq!(f.offset + p.slot_offset, s.begin + p.start);
                assert!(p.slot_offset + (p.stop - p.start) <= 128);
                at = p.stop;
            }
        }
        assert_eq!(at, s.end - s.begin, "span {}", s.name);
    }
    assert_eq!(
        fills[0].pieces.len(),
        3,
        "a, b and the start of c share the first fill"
    );
}

#[test]
fn a_wide_gap_starts_a_new_fill_and_a_narrow_one_is_read_through() {
    let spans = [
        span("a", 0, 8, 4),
        span("b", 16, 24, 4),
        span("c", 4096, 4104, 4),
    ];
    let fills = layout(&spans, 8192, 1, 64).unwrap();
    assert_eq!(fills.len(), 2);
    assert_eq!(fills[0].pieces.len(), 2);
    assert_eq!((fills[1].offset, fills[1].end), (4096, 4104));
}

#[test]
fn a_unit_larger_than_a_slot_is_refused_with_the_slot_size_it_needs() {
    let err = layout(&[span("packed", 4096, 4096 + 300, 300)], 256, 64, 0).unwrap_err();
    assert_eq!(err.rule(), "invalid-staging");
    let msg = err.to_string();
    assert!(
        msg.contains("packed") && msg.contains("at least 320 bytes"),
        "{msg}"
    );
}

#[test]
fn empty_spans_get_no_piece_and_a_slot_not_a_multiple_of_the_alignment_is_refused() {
    assert!(layout(&[span("e", 10, 10, 4)], 64, 1, 0)
        .unwrap()
        .is_empty());
    assert_eq!(
        layout(&[], 100, 64, 0).unwrap_err().rule(),
        "invalid-staging"
    );
}

fn temp(bytes: &[u8]) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "fastload-staged-{}-{}.safetensors",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::File::create(&path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
    path
}

/// A file of one U8 tensor of `n` bytes (byte i = i * 7 mod 251), and its path.
fn sample(n: usize) -> (PathBuf, Vec<u8>) {
    let (mut buf, _) = build_header(&[("x".into(), Dtype::U8, vec![n as u64])], None).unwrap();
    let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    buf.extend(&data);
    (temp(&buf), data)
}

/// Reads every fill of `path`'s tensor through a ring and returns the bytes in order.
fn read_through_ring(
    path: &Path,
    slots: usize,
    slot_bytes: u64,
    chunk: u64,
) -> (Vec<u8>, RingStats) {
    let file = Arc::new(SafetensorsFile::open(path, ReadMode::Pread).unwrap());
    let info = file.header().get("x").unwrap().clone();
    let start = file.header().data_start();
    let spans = vec![span("x", start + info.begin, start + info.end, 1)];
    let fills = layout(&spans, slot_bytes, ALIGN, GAP).unwrap();
    // Slots aligned for direct reads: one allocation, cut at aligned offsets.
    let mut memory = vec![0u8; slots * slot_bytes as usize + ALIGN as usize];
    let base = (memory.as_mut_ptr() as usize).div_ceil(ALIGN as usize) * ALIGN as usize;
    let opts = RingOptions {
        slots: (0..slots).map(|i| base + i * slot_bytes as usize).collect(),
        slot_bytes,
        threads: 4,
        direct: true,
        chunk,
    };
    let mut ring = Ring::start(file, spans, fills.clone(), opts, None).unwrap();
    let mut out = Vec::new();
    for (k, f) in fills.iter().enumerate() {
        let slot = loop {
            if let Some(s) = ring.wait(k, Duration::from_millis(100)).unwrap() {
                break s;
            }
        };
        for p in &f.pieces {
            let at = base + slot * slot_bytes as usize + p.slot_offset as usize;
            // SAFETY: the piece lies in the slot, read and not yet released.
            let bytes =
                unsafe { std::slice::from_raw_parts(at as *const u8, (p.stop - p.start) as usize) };
            out.extend_from_slice(bytes);
        }
        ring.release(k).unwrap();
    }
    ring.finish().unwrap();
    let stats = ring.stats();
    drop(memory);
    (out, stats)
}

#[test]
fn a_ring_of_few_slots_reads_a_file_many_times_its_size_in_order() {
    let (path, data) = sample(300_000);
    let (out, stats) = read_through_ring(&path, 3, 16384, 4096);
    assert_eq!(out, data);
    // Every byte was read once (plus the fills' aligned heads), by one path or the other.
    assert!(stats.direct_bytes + stats.cached_bytes >= data.len() as u64);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_file_truncated_under_the_ring_is_an_error_naming_the_tensor_not_a_hang() {
    let (path, _) = sample(200_000);
    let file = Arc::new(SafetensorsFile::open(&path, ReadMode::Pread).unwrap());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(1000)
        .unwrap();
    let start = file.header().data_start();
    let spans = vec![span("x", start, start + 200_000, 1)];
    let fills = layout(&spans, 16384, ALIGN, GAP).unwrap();
    let mut memory = vec![0u8; 2 * 16384];
    let base = memory.as_mut_ptr() as usize;
    let opts = RingOptions {
        slots: vec![base, base + 16384],
        slot_bytes: 16384,
        threads: 2,
        direct: false,
        chunk: 4096,
    };
    let mut ring = Ring::start(file, spans, fills.clone(), opts, None).unwrap();
    let mut failed = None;
    for k in 0..fills.len() {
        match ring.wait(k, Duration::from_secs(10)) {
            Ok(Some(_)) => ring.release(k).unwrap(),
            Ok(None) => panic!("fill {k} neither read nor failed in 10 s"),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    let (tensor, err) = failed.expect("the truncation was noticed");
    assert_eq!(tensor.as_deref(), Some("x"));
    assert_eq!(err.rule(), "file-shrunk");
    ring.close();
    drop(memory);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn fills_are_released_in_order_only() {
    let (path, _) = sample(50_000);
    let file = Arc::new(SafetensorsFile::open(&path, ReadMode::Pread).unwrap());
    let start = file.header().data_start();
    let spans = vec![span("x", start, start + 50_000, 1)];
    let fills = layout(&spans, 8192, ALIGN, GAP).unwrap();
    let mut memory = vec![0u8; 2 * 8192];
    let base = memory.as_mut_ptr() as usize;
    let opts = RingOptions {
        slots: vec![base, base + 8192],
        slot_bytes: 8192,
        threads: 2,
        direct: false,
        chunk: 4096,
    };
    let mut ring = Ring::start(file, spans, fills, opts, None).unwrap();
    assert!(ring.wait(0, Duration::from_secs(10)).unwrap().is_some());
    assert!(ring.wait(1, Duration::from_secs(10)).unwrap().is_some());
    assert_eq!(ring.release(1).unwrap_err().rule(), "invalid-staging");
    ring.release(0).unwrap();
    ring.close();
    assert_eq!(
        ring.wait(2, Duration::from_secs(1)).unwrap_err().1.rule(),
        "cancelled"
    );
    drop(memory);
    std::fs::remove_file(path).unwrap();
}
