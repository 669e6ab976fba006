//! Tests of the object storage source against `object_store`'s in-memory store (no server).

use super::*;
use crate::copy::{self, Request, Selection};
use crate::dtype::Dtype;
use crate::file::{ReadMode, SafetensorsFile};
use crate::header::build_header;
use object_store::memory::InMemory;
use object_store::PutPayload;

fn memory_store() -> Store {
    Store {
        inner: Arc::new(InMemory::new()),
        base: "memory://test".into(),
    }
}

fn put(store: &Store, key: &str, bytes: Vec<u8>) {
    let path = StorePath::parse(key).unwrap();
    block_on(store.inner.put(&path, PutPayload::from(bytes)))
        .unwrap()
        .unwrap();
}

/// A file of a u8 tensor of `n` bytes (0, 1, 2 ...) and a 3-element f32 one.
fn sample(n: usize) -> Vec<u8> {
    let spec = vec![
        ("bytes".to_string(), Dtype::U8, vec![n as u64]),
        ("floats".to_string(), Dtype::F32, vec![3]),
    ];
    let (mut buf, _) = build_header(&spec, None).unwrap();
    buf.extend((0..n).map(|i| (i % 251) as u8));
    for v in [1.5f32, -2.0, 3.25] {
        buf.extend(v.to_le_bytes());
    }
    buf
}

#[test]
fn a_query_in_a_url_never_reaches_a_message() {
    let got = redact(
        "error sending request for url (https://acct.blob.core.windows.net/c/k?sv=1&sig=SECRET): reset",
    );
    assert!(!got.contains("SECRET"), "{got}");
    assert!(
        got.contains("https://acct.blob.core.windows.net/c/k?<query hidden>"),
        "{got}"
    );
}

#[test]
fn the_root_and_every_url_made_from_it_hide_the_user_info() {
    let settings = Settings {
        options: vec![],
        defaults: vec![],
    };
    for url in [
        "http://user:PASSWORD@127.0.0.1:9/dir/m.safetensors",
        "http://user:PASSWORD@127.0.0.1:9/dir/m.safetensors?sig=PASSWORD",
        "http://user:PASSWORD@127.0.0.1:9",
    ] {
        let (store, _) = Store::from_url(url, &settings).unwrap();
        for shown in [store.base().to_string(), store.url_of("dir/m.safetensors")] {
            assert!(!shown.contains("PASSWORD"), "{url}: {shown}");
            assert!(
                shown.starts_with("http://<credentials hidden>@127.0.0.1:9"),
                "{url}: {shown}"
            );
        }
    }
}

#[test]
fn an_object_opens_header_first_and_copies_like_a_file() {
    let store = memory_store();
    // a header longer than the first request's prefix too
    let n = 3 * crate::copy::CHUNK as usize + 17;
    put(&store, "dir/model.safetensors", sample(n));
    let file = SafetensorsFile::open_object(store.open("dir/model.safetensors").unwrap()).unwrap();
    assert_eq!(file.mode(), ReadMode::RangedGet);
    assert!(file.is_remote());
    assert_eq!(
        file.path().to_str(),
        Some("memory://test/dir/model.safetensors")
    );
    let (mut bytes, mut floats) = (vec![0u8; n], vec![0u8; 6]);
    let requests = [
        Request {
            name: "floats".into(),
            ptr: floats.as_mut_ptr(),
            len: 6,
            dtype: Dtype::F16,
            selection: Selection::All,
        },
        Request {
            name: "bytes".into(),
            ptr: bytes.as_mut_ptr(),
            len: n,
            dtype: Dtype::U8,
            selection: Selection::All,
        },
    ];
    // SAFETY: the destinations live until the copy returns.
    let written = unsafe { copy::copy(&file, &requests, Some(4)) }.unwrap();
    assert_eq!(written, n as u64 + 6);
    assert!(bytes.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    let halves: Vec<f32> = floats
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_eq!(halves, [1.5, -2.0, 3.25]);
}

/// An object of one `rows` x `cols` u8 tensor "w" whose byte `i` is `i % 251`, in memory.
fn matrix_object(rows: u64, cols: u64) -> SafetensorsFile {
    let spec = vec![("w".to_string(), Dtype::U8, vec![rows, cols])];
    let (mut buf, _) = build_header(&spec, None).unwrap();
    buf.extend((0..rows * cols).map(|i| (i % 251) as u8));
    let store = memory_store();
    put(&store, "w.safetensors", buf);
    SafetensorsFile::open_object(store.open("w.safetensors").unwrap()).unwrap()
}

#[test]
fn a_slice_along_the_columns_is_one_get_per_row_spread_over_tasks() {
    // a tensor-parallel rank's share of a row-parallel weight: half of each of 100 rows
    let (rows, cols) = (100u64, 64u64);
    let file = matrix_object(rows, cols);
    let mut dst = vec![0u8; (rows * cols / 2) as usize];
    let requests = [Request {
        name: "w".into(),
        ptr: dst.as_mut_ptr(),
        len: dst.len(),
        dtype: Dtype::U8,
        selection: Selection::Slice {
            dim: 1,
            start: cols / 2,
            stop: cols,
        },
    }];
    let plan = copy::plan(&file, &requests).unwrap();
    // every row a read of its own, at most GETS_PER_TASK of them one after the other
    assert_eq!(plan.tasks(), (rows as usize).div_ceil(copy::GETS_PER_TASK));
    // SAFETY: the destination lives until the copy returns.
    unsafe { copy::execute(&file, &plan, Some(4), None, None) }.unwrap();
    let want: Vec<u8> = (0..rows)
        .flat_map(|r| (cols / 2..cols).map(move |c| ((r * cols + c) % 251) as u8))
        .collect();
    assert_eq!(dst, want);
}

#[test]
fn blocks_of_rows_that_meet_in_the_file_are_one_get_whatever_request_they_come_from() {
    // an exchanged chunk of a row-parallel weight: the owner's half of each row and the half it
    // fetches for the other rank, each one request of rows, interleaved in the file
    let (rows, cols) = (100u64, 64u64);
    let file = matrix_object(rows, cols);
    let (first, count) = (10u64, 80u64);
    let mut halves = [
        vec![0u8; (count * cols / 2) as usize],
        vec![0u8; (count * cols / 2) as usize],
    ];
    let requests: Vec<Request> = halves
        .iter_mut()
        .enumerate()
        .map(|(i, dst)| Request {
            name: "w".into(),
            ptr: dst.as_mut_ptr(),
            len: dst.len(),
            dtype: Dtype::U8,
            selection: Selection::Rows {
                first,
                count,
                row: cols,
                start: i as u64 * cols / 2,
                stop: (i as u64 + 1) * cols / 2,
            },
        })
        .collect();
    let plan = copy::plan(&file, &requests).unwrap();
    // 160 pieces, one after the other in the file: one task, one ranged GET
    assert_eq!(plan.tasks(), 1);
    // SAFETY: the destinations live until the copy returns.
    unsafe { copy::execute(&file, &plan, Some(4), None, None) }.unwrap();
    for (i, half) in halves.iter().enumerate() {
        let want: Vec<u8> = (first..first + count)
            .flat_map(|r| {
                let cols_of = (i as u64 * cols / 2)..((i as u64 + 1) * cols / 2);
                cols_of.map(move |c| ((r * cols + c) % 251) as u8)
            })
            .collect();
        assert_eq!(half, &want, "half {i}");
    }
}

#[test]
fn a_missing_object_is_not_found_and_a_truncated_one_fails_its_header_check() {
    let store = memory_store();
    let err = store.open("nothing.safetensors").unwrap_err();
    assert_eq!(err.rule(), "store-not-found");
    assert_eq!(store.head("nothing.safetensors").unwrap(), None);
    let mut data = sample(1000);
    data.truncate(data.len() - 10);
    put(&store, "short.safetensors", data);
    let err = SafetensorsFile::open_object(store.open("short.safetensors").unwrap()).unwrap_err();
    assert_eq!(err.rule(), "offsets-past-eof");
}

#[test]
fn an_object_of_a_header_alone_or_of_an_empty_header_is_judged_by_its_header() {
    // the open reads the length, then exactly the header: nothing past it is asked for, and an
    // empty header asks for no bytes at all (its error is the header's, not the store's)
    let store = memory_store();
    let (header_only, _) = build_header(&[], None).unwrap();
    put(&store, "empty-model.safetensors", header_only);
    let file = SafetensorsFile::open_object(store.open("empty-model.safetensors").unwrap());
    assert!(file.unwrap().header().tensors().is_empty());
    put(&store, "no-header.safetensors", vec![0u8; 8]);
    let err =
        SafetensorsFile::open_object(store.open("no-header.safetensors").unwrap()).unwrap_err();
    assert!(!err.rule().starts_with("store-"), "{}", err.rule());
}

#[test]
fn an_object_replaced_after_it_was_opened_is_not_read() {
    let store = memory_store();
    put(&store, "m.safetensors", sample(100));
    let file = SafetensorsFile::open_object(store.open("m.safetensors").unwrap()).unwrap();
    put(&store, "m.safetensors", sample(100));
    let mut out = vec![0u8; 100];
    let requests = [Request {
        name: "bytes".into(),
        ptr: out.as_mut_ptr(),
        len: 100,
        dtype: Dtype::U8,
        selection: Selection::All,
    }];
    // SAFETY: `out` lives until the copy returns.
    let err = unsafe { copy::copy(&file, &requests, Some(1)) }.unwrap_err();
    assert_eq!(err.rule(), "object-changed");
    assert!(err.to_string().contains("tensor 'bytes'"), "{err}");
}

#[test]
fn a_range_the_object_no_longer_has_is_an_object_that_changed() {
    // what a store answers a ranged GET of an object cut short since it was opened
    let e = object_store::Error::Generic {
        store: "S3",
        source: "Error performing GET http://host/b/k in 1ms - Server returned non-2xx status \
                 code: 416 Range Not Satisfiable: <Error><Code>InvalidRange</Code></Error>"
            .into(),
    };
    match failure(e) {
        Error::Store { failure, .. } => assert_eq!(failure, StoreFailure::Changed),
        other => panic!("{other:?}"),
    }
}

#[test]
fn options_are_checked_by_key_and_durations_parsed() {
    let settings = |options: &[(&str, &str)]| Settings {
        options: options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        defaults: vec![],
    };
    let err = Store::from_url("s3://b/k", &settings(&[("nonsense", "SECRET")])).unwrap_err();
    assert_eq!(err.rule(), "store-config");
    assert!(!err.to_string().contains("SECRET"), "{err}");
    let err = Store::from_url("s3://b/k", &settings(&[("retry_timeout", "soon")])).unwrap_err();
    assert!(err.to_string().contains("retry_timeout"), "{err}");
    let (store, key) = Store::from_url(
        "s3://bucket/a/b/model.safetensors",
        &settings(&[("max_retries", "2"), ("aws_region", "eu-west-1")]),
    )
    .unwrap();
    assert_eq!(
        (store.base(), key.as_str()),
        ("s3://bucket", "a/b/model.safetensors")
    );
    let err = Store::from_url("ftp://host/x", &settings(&[])).unwrap_err();
    assert_eq!(err.rule(), "store-config");
}

#[test]
fn a_panic_in_the_client_is_a_config_error_not_a_panic() {
    let got: Result<()> = block_on(async { panic!("called `Result::unwrap()` on an `Err` value") });
    let err = got.unwrap_err();
    assert!(matches!(
        err,
        Error::Store {
            failure: StoreFailure::Config,
            ..
        }
    ));
    // and the runtime still serves requests
    assert_eq!(block_on(async { 7 }).unwrap(), 7);
}

#[test]
fn a_raised_cancel_flag_abandons_a_request_still_waiting() {
    let flag = crate::cancel::Flag::default();
    crate::cancel::raise(&flag);
    // a request that would wait a minute (the bound, should the flag be ignored)
    let wait = async { tokio::time::sleep(std::time::Duration::from_secs(60)).await };
    let got = crate::cancel::scoped(Some(&flag), || block_on(wait));
    assert_eq!(got, Err(Error::Cancelled));
    // without a flag, the same thread's requests run as before
    assert_eq!(block_on(async { 3 }).unwrap(), 3);
}

#[test]
fn a_file_tells_the_version_its_reads_are_pinned_to() {
    let store = memory_store();
    put(&store, "m.safetensors", sample(100));
    let file = SafetensorsFile::open_object(store.open("m.safetensors").unwrap()).unwrap();
    let (size, etag, date) = file.version().unwrap();
    let (head_size, head_etag) = store.head("m.safetensors").unwrap().unwrap();
    assert_eq!((size, etag.clone()), (head_size, head_etag));
    assert!(etag.is_some() && date.is_some());
    // another version of the object: another ETag, while the file keeps the one it opened
    put(&store, "m.safetensors", sample(100));
    let again = SafetensorsFile::open_object(store.open("m.safetensors").unwrap()).unwrap();
    assert_ne!(again.version().unwrap().1, etag);
    assert_eq!(file.version().unwrap().1, etag);
    // a file held in memory (as a local file) has no version to pin
    let held = SafetensorsFile::from_bytes("held", sample(100)).unwrap();
    assert!(held.version().is_none());
}
