//! The copy engine: fills caller-owned destination buffers from a [`SafetensorsFile`].
//!
//! Two steps. [`plan`] checks every request against the header (name, selection, destination size,
//! dtype pair) before a byte is written, and cuts the work into tasks of about [`CHUNK`] source
//! bytes: large tensors are split across threads, small ones batched into one task. [`execute`]
//! runs the tasks on a rayon pool.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;
use rayon::ThreadPool;

use crate::convert::convert;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::file::SafetensorsFile;
use crate::header::TensorInfo;
use crate::readahead::READAHEAD_THREADS;

/// Source bytes per task: big enough to amortize scheduling, small enough to balance threads.
pub const CHUNK: u64 = 8 << 20;

/// Most copy (and write) threads one call may ask for: more only adds scheduling and memory, and an
/// unbounded count let a caller start thousands of OS threads.
pub const MAX_THREADS: usize = 256;

/// Thread pools kept alive for reuse, least recently used dropped first: a process that asks for
/// many different counts keeps a bounded number of threads.
const CACHED_POOLS: usize = 4;

/// The progress of one or more copies, shared with whoever watches them: the bytes written so far
/// (counted per piece of at most [`CHUNK`] source bytes) and a flag that stops them between
/// pieces. A cancelled copy returns [`Error::Cancelled`]; what it wrote so far stays written.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    cancelled: AtomicBool,
}

impl Progress {
    /// A fresh counter at 0, not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Destination bytes written so far by every copy that used this object.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Asks running copies to stop at their next piece (and later ones not to start).
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Whether [`Progress::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts bytes copied by something other than this engine (so one counter covers a load).
    pub fn add_external(&self, bytes: u64) {
        self.add(bytes);
    }
}

/// Checks a caller's thread count: `None` is [`default_threads`], otherwise 1..=[`MAX_THREADS`].
pub fn check_threads(threads: Option<usize>) -> Result<usize> {
    match threads {
        None => Ok(default_threads().min(MAX_THREADS)),
        Some(n) if (1..=MAX_THREADS).contains(&n) => Ok(n),
        Some(n) => Err(Error::InvalidThreads {
            threads: n as u64,
            max: MAX_THREADS,
        }),
    }
}

/// Which elements of a tensor a request wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The whole tensor.
    All,
    /// Elements `[start, stop)` of the flattened tensor (staging a tensor in pieces).
    Elements { start: u64, stop: u64 },
    /// Indices `[start, stop)` along dimension `dim`, all of the others (tensor-parallel shards).
    Slice { dim: usize, start: u64, stop: u64 },
}

/// A destination to fill: `len` writable bytes at `ptr`, owned by the caller.
#[derive(Clone, Debug)]
pub struct Request {
    pub name: String,
    pub ptr: *mut u8,
    pub len: usize,
    pub dtype: Dtype,
    pub selection: Selection,
}

/// A raw destination pointer handed to worker threads. The caller of [`execute`] guarantees the
/// buffers are valid and not aliased for the duration of the call.
#[derive(Clone, Copy, Debug)]
struct DstPtr(*mut u8);
// SAFETY: tasks write disjoint byte ranges of buffers the caller keeps alive during `execute`.
unsafe impl Send for DstPtr {}
unsafe impl Sync for DstPtr {}

/// One contiguous run of source bytes and where its (possibly converted) elements go.
#[derive(Clone, Copy, Debug)]
struct Piece {
    src: u64,
    src_len: u64,
    dst: DstPtr,
    dst_len: usize,
    from: Dtype,
    to: Dtype,
}

/// The validated work of one [`execute`] call.
#[derive(Debug, Default)]
pub struct Plan {
    tasks: Vec<Vec<Piece>>,
    src_bytes: u64,
    dst_bytes: u64,
}

impl Plan {
    /// Bytes that will be read from the file.
    pub fn src_bytes(&self) -> u64 {
        self.src_bytes
    }

    /// `(offset, len)` of the file bytes from the first piece read to the end of the last.
    fn src_span(&self) -> (u64, u64) {
        let pieces = self.tasks.iter().flatten();
        let start = pieces.clone().map(|p| p.src).min().unwrap_or(0);
        let end = pieces.map(|p| p.src + p.src_len).max().unwrap_or(0);
        (start, end.saturating_sub(start))
    }

    /// Bytes that will be written to destinations.
    pub fn dst_bytes(&self) -> u64 {
        self.dst_bytes
    }

    /// Number of parallel tasks.
    pub fn tasks(&self) -> usize {
        self.tasks.len()
    }
}

/// Runs of `(first element, element count)` that a selection takes from a tensor, merged where
/// they touch.
fn runs(t: &TensorInfo, sel: Selection) -> Result<Vec<(u64, u64)>> {
    let bad = |detail: String| Error::InvalidSelection {
        tensor: t.name.clone(),
        detail,
    };
    let numel = t.numel();
    match sel {
        Selection::All => Ok(vec![(0, numel)]),
        Selection::Elements { start, stop } => {
            if start > stop || stop > numel {
                return Err(bad(format!(
                    "elements [{start}, {stop}) of a tensor with {numel}"
                )));
            }
            Ok(vec![(start, stop - start)])
        }
        Selection::Slice { dim, start, stop } => {
            let Some(&size) = t.shape.get(dim) else {
                return Err(bad(format!(
                    "dimension {dim} of a {}-d tensor",
                    t.shape.len()
                )));
            };
            if start > stop || stop > size {
                return Err(bad(format!(
                    "[{start}, {stop}) along dimension {dim} of size {size}"
                )));
            }
            // An empty tensor or an empty range reads nothing. Checked first: with a 0 elsewhere
            // in the shape, the products below could overflow (found by the copy_plan fuzzer).
            if numel == 0 || start == stop {
                return Ok(vec![]);
            }
            // numel > 0, so every dimension is >= 1 and these products are at most numel.
            let outer: u64 = t.shape[..dim].iter().product();
            let inner: u64 = t.shape[dim + 1..].iter().product();
            let count = (stop - start) * inner;
            if count == size * inner {
                return Ok(vec![(0, numel)]);
            }
            Ok((0..outer)
                .map(|o| ((o * size + start) * inner, count))
                .collect())
        }
    }
}

/// Validates `requests` against the file and cuts them into tasks.
pub fn plan(file: &SafetensorsFile, requests: &[Request]) -> Result<Plan> {
    let header = file.header();
    let base = header.data_start();
    let mut plan = Plan::default();
    let mut current: Vec<Piece> = Vec::new();
    let mut current_bytes = 0u64;
    for r in requests {
        let t = header.get(&r.name).ok_or_else(|| Error::UnknownTensor {
            tensor: r.name.clone(),
        })?;
        let (from, to) = (t.dtype, r.dtype);
        let converting = from != to;
        if converting && !(from.is_convertible_float() && to.is_convertible_float()) {
            return Err(Error::UnsupportedConversion {
                tensor: t.name.clone(),
                from: from.name().into(),
                to: to.name().into(),
            });
        }
        if from.itemsize().is_none() && r.selection != Selection::All {
            return Err(Error::InvalidSelection {
                tensor: t.name.clone(),
                detail: format!("{from} is a packed sub-byte type; only whole tensors can be read"),
            });
        }
        let runs = runs(t, r.selection)?;
        let total: u64 = runs.iter().map(|r| r.1).sum();
        let expected = to.bytes_for(total).unwrap_or(u64::MAX);
        if expected != r.len as u64 {
            return Err(Error::DestinationSize {
                tensor: t.name.clone(),
                expected,
                actual: r.len as u64,
            });
        }
        if r.len > 0 && r.ptr.is_null() {
            return Err(Error::NullDestination {
                tensor: t.name.clone(),
            });
        }
        // For packed types (whole tensor, same dtype) count bytes; otherwise elements.
        let (src_unit, dst_unit) = match (from.itemsize(), to.itemsize()) {
            (Some(s), Some(d)) => (s as u64, d as u64),
            _ => (1, 1),
        };
        let runs = if src_unit == 1 && from.itemsize().is_none() {
            vec![(0, t.nbytes())]
        } else {
            runs
        };
        let per_task = (CHUNK / src_unit.max(dst_unit)).max(1);
        let mut dst_off = 0u64;
        for (first, count) in runs {
            let mut done = 0;
            while done < count {
                let k = per_task.min(count - done);
                let piece = Piece {
                    src: base + t.begin + (first + done) * src_unit,
                    src_len: k * src_unit,
                    // SAFETY of the arithmetic: dst_off + k * dst_unit <= r.len, checked above.
                    dst: DstPtr(r.ptr.wrapping_add(dst_off as usize)),
                    dst_len: (k * dst_unit) as usize,
                    from,
                    to,
                };
                dst_off += k * dst_unit;
                done += k;
                plan.src_bytes += piece.src_len;
                plan.dst_bytes += piece.dst_len as u64;
                current_bytes += piece.src_len.max(1);
                current.push(piece);
                if current_bytes >= CHUNK {
                    plan.tasks.push(std::mem::take(&mut current));
                    current_bytes = 0;
                }
            }
        }
    }
    if !current.is_empty() {
        plan.tasks.push(current);
    }
    Ok(plan)
}

/// Bytes of the per-thread bounce buffer of the pread conversion path: small enough to stay in
/// the core's cache between the read and the conversion (a whole 8 MiB task did not, ~2x slower).
const SCRATCH_BYTES: usize = 256 << 10;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn run_piece(file: &SafetensorsFile, p: &Piece) -> Result<()> {
    if p.dst_len == 0 {
        return Ok(());
    }
    // SAFETY: `plan` checked that [dst, dst + dst_len) lies inside the caller's buffer; tasks write
    // disjoint ranges; the caller keeps the buffer alive and unaliased during `execute`.
    let dst = unsafe { std::slice::from_raw_parts_mut(p.dst.0, p.dst_len) };
    prefault(dst);
    if p.from == p.to {
        return file.read_at(dst, p.src);
    }
    let len = p.src_len as usize;
    if let Some(src) = file.mapped(p.src, len) {
        convert(src, p.from, dst, p.to);
        return Ok(());
    }
    // pread path: bounce through a small per-thread buffer that stays in cache, block by block.
    let (si, di) = (p.from.itemsize().unwrap_or(1), p.to.itemsize().unwrap_or(1));
    let block = (SCRATCH_BYTES / si).max(1);
    SCRATCH.with(|s| {
        let mut buf = s.borrow_mut();
        if buf.len() < block * si {
            buf.resize(block * si, 0);
        }
        let n = len / si;
        let mut done = 0;
        while done < n {
            let k = block.min(n - done);
            let src = &mut buf[..k * si];
            file.read_at(src, p.src + (done * si) as u64)?;
            convert(src, p.from, &mut dst[done * di..(done + k) * di], p.to);
            done += k;
        }
        Ok(())
    })
}

/// Faults in the whole pages of a fresh destination with one `madvise(MADV_POPULATE_WRITE)`
/// (Linux 5.14+) instead of one page fault per 4 KiB during the copy: on a warm page cache, faulting
/// fresh memory is most of a load's time, and batching it cut a 1 GiB load by ~20% here. A hint:
/// older kernels answer EINVAL and the copy faults the pages as before.
fn prefault(dst: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (dst.as_mut_ptr() as usize).div_ceil(PAGE) * PAGE;
        let end = (dst.as_mut_ptr() as usize + dst.len()) / PAGE * PAGE;
        if end > start {
            // SAFETY: the range lies inside a destination this call may write; populating pages
            // never changes their contents.
            unsafe {
                libc::madvise(
                    start as *mut libc::c_void,
                    end - start,
                    libc::MADV_POPULATE_WRITE,
                )
            };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = dst;
}

/// A pool and its thread count.
type SizedPool = (usize, Arc<ThreadPool>);

/// A pool with `threads` workers (1..=[`MAX_THREADS`]), built once per size and reused; at most
/// [`CACHED_POOLS`] sizes are kept (a dropped pool's threads exit once its last user is done).
pub fn pool(threads: usize) -> Result<Arc<ThreadPool>> {
    static POOLS: OnceLock<Mutex<Vec<SizedPool>>> = OnceLock::new();
    let threads = check_threads(Some(threads))?;
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(i) = pools.iter().position(|(n, _)| *n == threads) {
        // Most recently used last.
        let entry = pools.remove(i);
        let p = entry.1.clone();
        pools.push(entry);
        return Ok(p);
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("fastload-copy-{i}"))
        .build()
        .map_err(|e| Error::Io {
            detail: format!("cannot start {threads} copy threads: {e}"),
        })?;
    let p = Arc::new(p);
    if pools.len() >= CACHED_POOLS {
        pools.remove(0);
    }
    pools.push((threads, p.clone()));
    Ok(p)
}

/// The default thread count: the CPUs this process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Runs a plan with `threads` workers (`None`: [`default_threads`], at least [`READAHEAD_THREADS`]
/// for a file mostly not in the page cache; more than [`MAX_THREADS`] is
/// [`Error::InvalidThreads`]). With `progress`, bytes are counted there as pieces finish, a cancel
/// stops the copy at the next piece with [`Error::Cancelled`], and `on_task` (if any) is called
/// with the counter's value after each task (about [`CHUNK`] bytes) from the thread that ran it.
/// The file is checked unchanged before and after ([`SafetensorsFile::check_unchanged`]), so
/// bytes rewritten in place during the copy are reported, not returned torn.
///
/// # Safety
/// Every destination of the requests the plan was made from must be valid for writes of its
/// length, not read or written by anything else, and alive until this returns.
pub unsafe fn execute(
    file: &SafetensorsFile,
    plan: &Plan,
    threads: Option<usize>,
    progress: Option<&Progress>,
    on_task: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<u64> {
    let threads = match threads {
        // A file mostly not in the page cache: the copy waits on the disk, which wants more
        // requests in flight than there are cores (1 GiB bf16 -> f32 on 2 cores: 1.65 s with 2
        // threads, 1.06 s with 8; cached copies are CPU-bound and 8 were ~10% slower there).
        // Asked of the bytes this plan reads (a GPU load runs one plan per staging buffer).
        None if file.mostly_uncached(plan.src_span()) => {
            check_threads(None)?.max(READAHEAD_THREADS)
        }
        _ => check_threads(threads)?,
    };
    file.check_unchanged()?;
    let task = |pieces: &Vec<Piece>| -> Result<()> {
        let Some(progress) = progress else {
            return pieces.iter().try_for_each(|p| run_piece(file, p));
        };
        for p in pieces {
            if progress.is_cancelled() {
                return Err(Error::Cancelled);
            }
            run_piece(file, p)?;
            progress.add(p.dst_len as u64);
        }
        if let Some(f) = on_task {
            f(progress.done());
        }
        Ok(())
    };
    if threads == 1 || plan.tasks.len() <= 1 {
        plan.tasks.iter().try_for_each(task)?;
    } else {
        pool(threads)?.install(|| plan.tasks.par_iter().try_for_each(task))?;
    }
    file.check_unchanged()?;
    Ok(plan.dst_bytes)
}

/// Validates and copies in one call. See [`execute`] for the safety contract.
///
/// # Safety
/// As [`execute`].
pub unsafe fn copy(
    file: &SafetensorsFile,
    requests: &[Request],
    threads: Option<usize>,
) -> Result<u64> {
    let plan = plan(file, requests)?;
    // SAFETY: forwarded contract.
    unsafe { execute(file, &plan, threads, None, None) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file::ReadMode;
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
}
