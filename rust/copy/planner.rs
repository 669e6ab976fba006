//! Planning a copy: every request checked against the header before a byte is written, and the
//! work cut into tasks of about [`CHUNK`] source bytes (smaller for a small copy on many threads,
//! [`task_bytes`]).

use super::{Request, Selection, CHUNK, MIN_TASK};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::file::SafetensorsFile;
use crate::header::TensorInfo;

/// A raw destination pointer handed to worker threads. The caller of `execute` guarantees the
/// buffers are valid and not aliased for the duration of the call.
#[derive(Clone, Copy, Debug)]
pub(super) struct DstPtr(pub(super) *mut u8);
// SAFETY: tasks write disjoint byte ranges of buffers the caller keeps alive during `execute`.
unsafe impl Send for DstPtr {}
unsafe impl Sync for DstPtr {}

/// One contiguous run of source bytes and where its (possibly converted) elements go.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    pub(super) src: u64,
    pub(super) src_len: u64,
    pub(super) dst: DstPtr,
    pub(super) dst_len: usize,
    pub(super) from: Dtype,
    pub(super) to: Dtype,
    /// Index of the request (in [`Plan::names`]) the piece belongs to.
    pub(super) request: usize,
}

/// The validated work of one `execute` call.
#[derive(Debug, Default)]
pub struct Plan {
    pub(super) tasks: Vec<Vec<Piece>>,
    /// The tensor name of each request, for messages.
    pub(super) names: Vec<String>,
    src_bytes: u64,
    pub(super) dst_bytes: u64,
}

impl Plan {
    /// Bytes that will be read from the file.
    pub fn src_bytes(&self) -> u64 {
        self.src_bytes
    }

    /// `(offset, len)` of the file bytes from the first piece read to the end of the last.
    pub(super) fn src_span(&self) -> (u64, u64) {
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

    /// Whether any piece is converted to another dtype on the way.
    pub fn converts(&self) -> bool {
        self.tasks.iter().flatten().any(|p| p.from != p.to)
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
        Selection::Rows {
            first,
            count,
            row,
            start,
            stop,
        } => {
            // the last element read: (first + count - 1) * row + stop, which must be in the tensor
            let last = first
                .checked_add(count)
                .and_then(|n| n.checked_sub(1))
                .and_then(|n| n.checked_mul(row))
                .and_then(|n| n.checked_add(stop));
            if row == 0
                || start > stop
                || stop > row
                || (count > 0 && last.is_none_or(|l| l > numel))
            {
                return Err(bad(format!(
                    "elements [{start}, {stop}) of {count} rows of {row} from row {first} of a \
                     tensor with {numel}"
                )));
            }
            if count == 0 || start == stop {
                return Ok(vec![]);
            }
            // checked above: every product and sum here is at most numel
            if stop - start == row {
                return Ok(vec![(first * row, count * row)]);
            }
            Ok((first..first + count)
                .map(|o| (o * row + start, stop - start))
                .collect())
        }
    }
}

/// The task size for a copy of `total` bytes on `threads` threads: [`CHUNK`], or less when that
/// would leave threads idle (a GPU load fills one 64 MiB staging buffer per call: 8 tasks of
/// [`CHUNK`] kept 8 of 16 cores busy), but never under [`MIN_TASK`].
pub fn task_bytes(total: u64, threads: usize) -> u64 {
    let threads = threads.max(1) as u64;
    (total / threads).clamp(MIN_TASK, CHUNK)
}

/// Validates `requests` against the file and cuts them into tasks of [`CHUNK`] source bytes.
pub fn plan(file: &SafetensorsFile, requests: &[Request]) -> Result<Plan> {
    plan_tasks(file, requests, CHUNK)
}

/// As [`plan`], with tasks sized for `threads` workers sharing a copy of `total` bytes
/// ([`task_bytes`]): the bytes requested here and those of any other file whose tasks run in the
/// same copy (`execute_many`). Sized per file instead, a file's small share of a copy of several
/// was cut into 1 MiB tasks; from object storage each is a ranged GET, and 1 MiB GETs took 1.2-1.3x
/// as long as 8 MiB ones at 16 in flight (measured against a local S3 server).
pub fn plan_for_threads(
    file: &SafetensorsFile,
    requests: &[Request],
    total: u64,
    threads: usize,
) -> Result<Plan> {
    plan_tasks(file, requests, task_bytes(total, threads))
}

/// The most separate ranged GETs one task of a copy from object storage makes, one after the
/// other: a slice along a tensor's columns (a tensor-parallel rank's share of a row-parallel
/// weight) is one GET per row, small ones, which the tasks spread over the threads instead of one
/// thread asking for thousands in a row.
pub const GETS_PER_TASK: usize = 16;

/// Validates `requests` against the file and cuts them into tasks of about `chunk` source bytes
/// (and, from object storage, of at most [`GETS_PER_TASK`] separate reads).
fn plan_tasks(file: &SafetensorsFile, requests: &[Request], chunk: u64) -> Result<Plan> {
    let chunk = chunk.max(1);
    let header = file.header();
    let base = header.data_start();
    let mut plan = Plan::default();
    let mut pieces: Vec<Piece> = Vec::new();
    // The requests are checked in file order, so that the first bad one in the file is the one
    // an error names.
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| {
        let start = match requests[i].selection {
            Selection::All | Selection::Slice { .. } => 0,
            Selection::Elements { start, .. } => start,
            Selection::Rows {
                first, row, start, ..
            } => first.saturating_mul(row).saturating_add(start),
        };
        (header.get(&requests[i].name).map(|t| t.begin), start)
    });
    for &index in &order {
        let r = &requests[index];
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
        let per_task = (chunk / src_unit.max(dst_unit)).max(1);
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
                    request: index,
                };
                dst_off += k * dst_unit;
                done += k;
                plan.src_bytes += piece.src_len;
                plan.dst_bytes += piece.dst_len as u64;
                pieces.push(piece);
            }
        }
    }
    // The tasks cut from the pieces in file order, whatever requests they come from: the
    // runner's threads take tasks in order, so the reads in flight move through the file as one
    // window (`runner::in_file_order`); from object storage, the pieces of a task that follow
    // each other in the file are read with one ranged GET (a block of rows of one rank's shard,
    // `Selection::Rows`, interleaves in the file with the other ranks' blocks).
    pieces.sort_by_key(|p| p.src);
    let mut current: Vec<Piece> = Vec::new();
    let mut current_bytes = 0u64;
    // separate reads of the current task (pieces that do not follow the one before in the file)
    let mut current_gets = 0usize;
    for piece in pieces {
        let follows = current
            .last()
            .is_some_and(|p| p.src + p.src_len == piece.src);
        if file.is_remote() && !follows && current_gets == GETS_PER_TASK {
            plan.tasks.push(std::mem::take(&mut current));
            (current_bytes, current_gets) = (0, 0);
        }
        current_gets += usize::from(!follows);
        current_bytes += piece.src_len.max(1);
        current.push(piece);
        if current_bytes >= chunk {
            plan.tasks.push(std::mem::take(&mut current));
            (current_bytes, current_gets) = (0, 0);
        }
    }
    if !current.is_empty() {
        plan.tasks.push(current);
    }
    plan.names = requests.iter().map(|r| r.name.clone()).collect();
    Ok(plan)
}
