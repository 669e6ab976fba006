//! Tests of the copy engine: planning and running, on real files in both read modes.

use super::*;
use crate::file::{ReadMode, SafetensorsFile};
use crate::header::build_header;
use half::bf16;
use std::io::Write;

fn write(tensors: &[(&str, Dtype, Vec<u64>, Vec<u8>)]) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let spec: Vec<(String, Dtype, Vec<u64>)> = tensors
        .iter()
        .map(|t| (t.0.to_string(), t.1, t.2.clone()))
        .collect();
    let (mut buf, _) = build_header(&spec, None).unwrap();
    for t in tensors {
        buf.extend_from_slice(&t.3);
    }
    let path = std::env::temp_dir().join(format!(
        "fastload-copy-{}-{}.st",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::File::create(&path)
        .unwrap()
        .write_all(&buf)
        .unwrap();
    path
}

fn req(name: &str, dst: &mut [u8], dtype: Dtype, selection: Selection) -> Request {
    Request {
        name: name.into(),
        ptr: dst.as_mut_ptr(),
        len: dst.len(),
        dtype,
        selection,
    }
}

#[test]
fn copies_whole_tensors_in_both_modes_and_with_many_threads() {
    let big: Vec<u8> = (0..(3 * CHUNK as usize + 123))
        .map(|i| (i % 251) as u8)
        .collect();
    let path = write(&[
        ("small", Dtype::U8, vec![3], vec![1, 2, 3]),
        ("big", Dtype::U8, vec![big.len() as u64], big.clone()),
    ]);
    for mode in [ReadMode::Pread, ReadMode::Mmap] {
        let f = SafetensorsFile::open(&path, mode).unwrap();
        for threads in [1, 4] {
            let (mut a, mut b) = (vec![0u8; 3], vec![0u8; big.len()]);
            let reqs = [
                req("small", &mut a, Dtype::U8, Selection::All),
                req("big", &mut b, Dtype::U8, Selection::All),
            ];
            let p = plan(&f, &reqs).unwrap();
            assert!(p.tasks() >= 4);
            assert_eq!(
                unsafe { execute(&f, &p, Some(threads), None, None) }.unwrap(),
                big.len() as u64 + 3
            );
            assert_eq!(a, [1, 2, 3]);
            assert!(b == big);
        }
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn converts_bf16_to_f32_on_the_way() {
    let vals = [1.5f32, -2.25, 1024.0];
    let raw: Vec<u8> = vals
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    let path = write(&[("w", Dtype::BF16, vec![3], raw)]);
    for mode in [ReadMode::Pread, ReadMode::Mmap] {
        let f = SafetensorsFile::open(&path, mode).unwrap();
        let mut out = vec![0u8; 12];
        unsafe { copy(&f, &[req("w", &mut out, Dtype::F32, Selection::All)], None) }.unwrap();
        let got: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, vals);
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn slices_rows_and_columns_and_element_ranges() {
    // 3 x 4 matrix of u16 0..12
    let raw: Vec<u8> = (0u16..12).flat_map(|v| v.to_le_bytes()).collect();
    let path = write(&[("m", Dtype::U16, vec![3, 4], raw)]);
    let f = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
    let read = |sel: Selection, n: usize| {
        let mut out = vec![0u8; n * 2];
        unsafe { copy(&f, &[req("m", &mut out, Dtype::U16, sel)], Some(2)) }.unwrap();
        out.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        read(
            Selection::Slice {
                dim: 0,
                start: 1,
                stop: 3
            },
            8
        ),
        (4..12).collect::<Vec<_>>()
    );
    assert_eq!(
        read(
            Selection::Slice {
                dim: 1,
                start: 2,
                stop: 4
            },
            6
        ),
        vec![2, 3, 6, 7, 10, 11]
    );
    assert_eq!(
        read(Selection::Elements { start: 5, stop: 7 }, 2),
        vec![5, 6]
    );
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_block_of_rows_reads_the_same_part_of_each_row() {
    // 3 x 4 matrix of u16 0..12, seen as rows of 4 (and as rows of 2)
    let raw: Vec<u8> = (0u16..12).flat_map(|v| v.to_le_bytes()).collect();
    let path = write(&[("m", Dtype::U16, vec![3, 4], raw)]);
    let f = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
    let rows = |first, count, row, start, stop| Selection::Rows {
        first,
        count,
        row,
        start,
        stop,
    };
    let read = |sel: Selection, n: usize| {
        let mut out = vec![0u8; n * 2];
        unsafe { copy(&f, &[req("m", &mut out, Dtype::U16, sel)], Some(2)) }.map(|_| {
            out.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(read(rows(1, 2, 4, 1, 3), 4).unwrap(), vec![5, 6, 9, 10]);
    assert_eq!(read(rows(0, 3, 4, 3, 4), 3).unwrap(), vec![3, 7, 11]);
    assert_eq!(
        read(rows(1, 4, 2, 0, 2), 8).unwrap(),
        (2u16..10).collect::<Vec<_>>()
    );
    assert!(read(rows(2, 0, 4, 0, 4), 0).unwrap().is_empty());
    // the last row may end before the tensor's end, never after it
    assert_eq!(read(rows(1, 2, 5, 0, 2), 4).unwrap(), vec![5, 6, 10, 11]);
    for bad in [
        rows(1, 3, 4, 0, 1), // row 3 of 3
        rows(0, 1, 4, 2, 5), // past the row
        rows(0, 1, 4, 3, 2), // backwards
        rows(0, 1, 0, 0, 0), // rows of nothing
        rows(u64::MAX, 2, 4, 0, 1),
        rows(1, u64::MAX, u64::MAX, 0, 1),
    ] {
        let err = read(bad, 1).unwrap_err();
        assert!(
            matches!(err, crate::error::Error::InvalidSelection { ref tensor, .. } if tensor == "m"),
            "{bad:?}: {err:?}"
        );
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn slices_of_an_empty_tensor_with_huge_dimensions_read_nothing() {
    // Found by the copy_plan fuzzer: the products of the other dimensions overflowed (with
    // [0, 2^33, 2^33], which the header now refuses; these still multiply to 2^62).
    let path = write(&[("e", Dtype::U8, vec![0, 1 << 31, 1 << 31], vec![])]);
    let f = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
    for dim in 0..3 {
        let stop = if dim == 0 { 0 } else { 2 };
        let sel = Selection::Slice {
            dim,
            start: 0,
            stop,
        };
        let p = plan(&f, &[req("e", &mut [], Dtype::U8, sel)]).unwrap();
        assert_eq!((p.src_bytes(), p.dst_bytes()), (0, 0));
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn rejects_bad_requests_before_writing_anything() {
    let path = write(&[
        ("a", Dtype::I32, vec![2], vec![1, 0, 0, 0, 2, 0, 0, 0]),
        ("b", Dtype::F4, vec![4], vec![0x12, 0x34]),
    ]);
    let f = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
    let mut ok = vec![0u8; 8];
    let mut short = vec![7u8; 4];
    let rule = |reqs: &[Request]| unsafe { copy(&f, reqs, None) }.unwrap_err().rule();
    // The valid first request must not have been written when the second fails.
    assert_eq!(
        rule(&[
            req("a", &mut ok, Dtype::I32, Selection::All),
            req("a", &mut short, Dtype::I32, Selection::All)
        ]),
        "destination-size"
    );
    assert_eq!(ok, vec![0u8; 8]);
    assert_eq!(
        rule(&[req("zz", &mut ok, Dtype::I32, Selection::All)]),
        "unknown-tensor"
    );
    assert_eq!(
        rule(&[req("a", &mut ok, Dtype::F64, Selection::All)]),
        "unsupported-conversion"
    );
    assert_eq!(
        rule(&[req(
            "a",
            &mut short,
            Dtype::I32,
            Selection::Elements { start: 1, stop: 3 }
        )]),
        "invalid-selection"
    );
    assert_eq!(
        rule(&[req(
            "a",
            &mut short,
            Dtype::I32,
            Selection::Slice {
                dim: 1,
                start: 0,
                stop: 1
            }
        )]),
        "invalid-selection"
    );
    assert_eq!(
        rule(&[req(
            "b",
            &mut short,
            Dtype::F4,
            Selection::Elements { start: 0, stop: 2 }
        )]),
        "invalid-selection"
    );
    let null = Request {
        name: "a".into(),
        ptr: std::ptr::null_mut(),
        len: 8,
        dtype: Dtype::I32,
        selection: Selection::All,
    };
    assert_eq!(rule(&[null]), "null-destination");
    let mut packed = vec![0u8; 2];
    unsafe {
        copy(
            &f,
            &[req("b", &mut packed, Dtype::F4, Selection::All)],
            None,
        )
    }
    .unwrap();
    assert_eq!(packed, [0x12, 0x34]);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_read_in_chunks_of_any_size_lands_in_its_pieces_converted_as_it_arrives() {
    // two pieces that follow each other in the file: 3 bf16 to f32, then 5 u8 as they are;
    // the bytes come in chunks that split elements and pieces anywhere
    let vals = [1.5f32, -2.25, 1024.0];
    let mut src: Vec<u8> = vals
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    src.extend([7u8, 8, 9, 10, 11]);
    for cuts in [vec![1usize], vec![3], vec![1, 2, 4, 1, 3], vec![11]] {
        let (mut a, mut b) = (vec![0u8; 12], vec![0u8; 5]);
        let pieces = [
            Piece {
                src: 100,
                src_len: 6,
                dst: DstPtr(a.as_mut_ptr()),
                dst_len: 12,
                from: Dtype::BF16,
                to: Dtype::F32,
                request: 0,
            },
            Piece {
                src: 106,
                src_len: 5,
                dst: DstPtr(b.as_mut_ptr()),
                dst_len: 5,
                from: Dtype::U8,
                to: Dtype::U8,
                request: 1,
            },
        ];
        let mut scatter = Scatter::new(&pieces);
        let mut at = 0;
        for n in cuts.iter().cycle() {
            if at == src.len() {
                break;
            }
            let end = (at + n).min(src.len());
            scatter.feed(&src[at..end]);
            at = end;
        }
        let got: Vec<f32> = a
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, vals, "chunks of {cuts:?}");
        assert_eq!(b, [7, 8, 9, 10, 11], "chunks of {cuts:?}");
    }
}

#[test]
fn a_small_copy_on_many_threads_is_cut_so_that_every_thread_gets_work() {
    // A 64 MiB staging buffer on 16 threads: 16 tasks of 4 MiB, not 8 of CHUNK.
    assert_eq!(task_bytes(64 << 20, 16), 4 << 20);
    // Large copies keep CHUNK; tiny ones stop at MIN_TASK.
    assert_eq!(task_bytes(1 << 30, 16), CHUNK);
    assert_eq!(task_bytes(4 << 20, 64), MIN_TASK);
    assert_eq!(task_bytes(0, 0), MIN_TASK);
}

#[test]
fn planning_for_threads_cuts_the_same_bytes_into_more_tasks() {
    let data = vec![7u8; 4 * MIN_TASK as usize];
    let path = write(&[("w", Dtype::U8, vec![data.len() as u64], data.clone())]);
    let f = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
    let mut out = vec![0u8; data.len()];
    let reqs = [req("w", &mut out, Dtype::U8, Selection::All)];
    assert_eq!(plan(&f, &reqs).unwrap().tasks(), 1);
    let p = plan_for_threads(&f, &reqs, data.len() as u64, 4).unwrap();
    assert_eq!(p.tasks(), 4);
    // The same file's share of a copy four times its size: tasks sized for the whole copy.
    let p = plan_for_threads(&f, &reqs, 4 * data.len() as u64, 4).unwrap();
    assert_eq!(p.tasks(), 1);
    assert_eq!(
        unsafe { execute(&f, &p, Some(4), None, None) }.unwrap(),
        data.len() as u64
    );
    assert!(out == data);
    std::fs::remove_file(path).unwrap();
}

#[test]
fn tasks_follow_the_file_whatever_the_order_of_the_requests() {
    // the runner's threads take tasks in order: in file order, the reads in flight are one
    // window moving through the file
    let n = MIN_TASK as usize;
    let tensors: Vec<(String, Vec<u8>)> = (0..6)
        .map(|i| (format!("t{i}"), vec![i as u8; n]))
        .collect();
    let spec: Vec<(&str, Dtype, Vec<u64>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, d)| (name.as_str(), Dtype::U8, vec![n as u64], d.clone()))
        .collect();
    let path = write(&spec);
    let f = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
    let mut outs: Vec<Vec<u8>> = (0..6).map(|_| vec![0u8; n]).collect();
    let reqs: Vec<Request> = outs
        .iter_mut()
        .enumerate()
        .rev()
        .map(|(i, out)| req(&format!("t{i}"), out, Dtype::U8, Selection::All))
        .collect();
    let p = plan_for_threads(&f, &reqs, 6 * n as u64, 6).unwrap();
    assert_eq!(p.tasks(), 6);
    let starts: Vec<u64> = p.tasks.iter().map(|t| t[0].src).collect();
    assert!(starts.windows(2).all(|w| w[0] < w[1]), "{starts:?}");
    assert_eq!(
        unsafe { execute(&f, &p, Some(3), None, None) }.unwrap(),
        6 * n as u64
    );
    for (i, out) in outs.iter().enumerate() {
        assert!(out.iter().all(|&b| b == i as u8), "t{i}");
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn in_file_order_runs_every_task_once_and_stops_at_the_first_error() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let tasks: Vec<usize> = (0..1000).collect();
    let runs: Vec<AtomicUsize> = tasks.iter().map(|_| AtomicUsize::new(0)).collect();
    let ok: std::result::Result<(), usize> = in_file_order(&pool, &tasks, |&i| {
        runs[i].fetch_add(1, Ordering::Relaxed);
        Ok(())
    });
    assert_eq!(ok, Ok(()));
    assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1));
    // task 10 fails: the error comes back, and no task runs twice; on one thread, deterministically,
    // none after it starts
    for threads in [1, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let runs: Vec<AtomicUsize> = tasks.iter().map(|_| AtomicUsize::new(0)).collect();
        let failed = in_file_order(&pool, &tasks, |&i| {
            runs[i].fetch_add(1, Ordering::Relaxed);
            if i == 10 {
                Err(i)
            } else {
                Ok(())
            }
        });
        assert_eq!(failed, Err(10));
        assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) <= 1));
        if threads == 1 {
            let ran: usize = runs.iter().map(|r| r.load(Ordering::Relaxed)).sum();
            assert_eq!(ran, 11);
        }
    }
}
