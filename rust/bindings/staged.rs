//! The staged read pipeline (`crate::staged`) as `fastload._core.StagedRead`: Python's
//! `fastload.core.reads.streaming` lays out a file's tensors in slots of its staging memory, starts
//! the ring and consumes the fills in order (the copy to the device), releasing each slot when
//! the copy out of it is done.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::errors::{to_py, to_py_reading};
use super::watch::PyProgress;
use super::PySafetensorsFile;
use crate::error::Error;
use crate::file::SafetensorsFile;
use crate::pool;
use crate::staged::{layout, Ring, RingOptions, Span, ALIGN, CHUNK, GAP};

/// How often a wait re-takes the GIL to run signal handlers (Ctrl-C).
const WAIT_EVERY: Duration = Duration::from_millis(50);

/// Reading threads by default: each holds one read in flight, and the storage needs several
/// (a cached range is copied by as many threads as there are cores).
fn default_threads() -> usize {
    pool::default_threads().clamp(pool::READAHEAD_THREADS * 2, pool::MAX_THREADS)
}

/// A staged read of one file: the ring's threads fill slots in order while the caller consumes.
#[pyclass(frozen, module = "fastload._core", name = "StagedRead")]
pub(super) struct PyStagedRead {
    file: Arc<SafetensorsFile>,
    ring: Mutex<Ring>,
}

impl PyStagedRead {
    fn ring(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tensors this read fills, for a message: `tensor 'a'`, or `tensors 'a' to 'z' (n)`.
    fn what(&self) -> String {
        let ring = self.ring();
        let names = ring.span_names();
        match names.as_slice() {
            [] => "no tensor".to_string(),
            [one] => format!("tensor '{one}'"),
            [first, .., last] => format!("tensors '{first}' to '{last}' ({})", names.len()),
        }
    }
}

/// The span of `name`'s bytes `[start, stop)` (the whole tensor when `None`), checked against
/// the header.
fn span_of(file: &SafetensorsFile, name: &str, range: Option<(u64, u64)>) -> Result<Span, Error> {
    let info = file
        .header()
        .get(name)
        .ok_or_else(|| Error::UnknownTensor {
            tensor: name.to_string(),
        })?;
    let base = file.header().data_start() + info.begin;
    let nbytes = info.nbytes();
    // A packed sub-byte type is read whole: its elements do not end on byte boundaries.
    let unit = match info.dtype.itemsize() {
        Some(n) => n as u64,
        None => nbytes.max(1),
    };
    let (start, stop) = range.unwrap_or((0, nbytes));
    if start > stop || stop > nbytes || start % unit != 0 || stop % unit != 0 && stop != nbytes {
        return Err(Error::InvalidSelection {
            tensor: name.to_string(),
            detail: format!(
                "bytes [{start}, {stop}) of a {nbytes}-byte tensor cut at multiples of {unit}"
            ),
        });
    }
    Ok(Span {
        name: name.to_string(),
        begin: base + start,
        end: base + stop,
        unit,
    })
}

#[pymethods]
impl PyStagedRead {
    /// Lays out `spans` (`(tensor name, byte range or None)`) in slots of `slot_bytes` at the
    /// addresses `slots`, and starts reading. Private to `fastload.core.reads.streaming`, which takes
    /// the addresses from tensors it keeps alive until `close()` or `finish()` returns.
    #[new]
    #[pyo3(signature = (file, spans, slots, slot_bytes, *, threads = None, direct = true, chunk = None, progress = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        file: PyRef<'_, PySafetensorsFile>,
        spans: Vec<(String, Option<(u64, u64)>)>,
        slots: Vec<usize>,
        slot_bytes: u64,
        threads: Option<usize>,
        direct: bool,
        chunk: Option<u64>,
        progress: Option<Bound<'_, PyProgress>>,
    ) -> PyResult<Self> {
        let file = file.inner.clone();
        let err = |e| to_py(py, file.path(), e);
        if slots.contains(&0) {
            return Err(PyValueError::new_err("a staging slot's address is null"));
        }
        let threads = match threads {
            Some(n) => pool::check_threads(Some(n)).map_err(err)?,
            None => default_threads(),
        };
        let spans = spans
            .iter()
            .map(|(name, range)| span_of(&file, name, *range))
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        let align = if slot_bytes % ALIGN == 0 { ALIGN } else { 1 };
        let fills = layout(&spans, slot_bytes, align, GAP).map_err(err)?;
        let opts = RingOptions {
            slots,
            slot_bytes,
            threads,
            direct,
            chunk: chunk.unwrap_or(CHUNK),
        };
        let progress = progress.map(|p| p.get().inner.clone());
        let ring = Ring::start(file.clone(), spans, fills, opts, progress).map_err(err)?;
        Ok(PyStagedRead {
            file,
            ring: Mutex::new(ring),
        })
    }

    /// The fills in reading order, each a list of `(span index, start, stop, slot offset)`:
    /// bytes `[start, stop)` of span `span index` sit at `slot offset` in the fill's slot.
    fn fills(&self) -> Vec<Vec<(usize, u64, u64, u64)>> {
        self.ring()
            .fills()
            .iter()
            .map(|f| {
                f.pieces
                    .iter()
                    .map(|p| (p.span, p.start, p.stop, p.slot_offset))
                    .collect()
            })
            .collect()
    }

    /// Waits (GIL released, Ctrl-C honoured) until fill `k` is read; returns its slot. A failed
    /// read raises the error naming the file and the tensor, and stops the ring.
    fn wait(&self, py: Python<'_>, k: usize) -> PyResult<usize> {
        loop {
            let waited = {
                let ring = self.ring();
                py.detach(|| ring.wait(k, WAIT_EVERY))
            };
            match waited {
                Ok(Some(slot)) => return Ok(slot),
                Ok(None) => {
                    if let Err(e) = py.check_signals() {
                        self.ring().close();
                        return Err(e);
                    }
                }
                Err((tensor, e)) => {
                    py.detach(|| self.ring().close());
                    let what = tensor.as_ref().map(|t| format!("tensor '{t}'"));
                    let path = self.file.path();
                    return Err(to_py_reading(
                        py,
                        path,
                        what.as_deref(),
                        tensor.as_deref(),
                        e,
                    ));
                }
            }
        }
    }

    /// Gives fill `k`'s slot back to the readers (in order: `k` is the oldest fill not released).
    fn release(&self, py: Python<'_>, k: usize) -> PyResult<()> {
        self.ring()
            .release(k)
            .map_err(|e| to_py(py, self.file.path(), e))
    }

    /// Joins the readers once every fill was consumed, and checks the file was not rewritten
    /// meanwhile; returns `(direct bytes, cached bytes)` read.
    fn finish(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let result = py.detach(|| {
            let mut ring = self.ring();
            ring.finish().map(|()| ring.stats())
        });
        let stats = result.map_err(|e| {
            let what = self.what();
            to_py_reading(py, self.file.path(), Some(&what), None, e)
        })?;
        Ok((stats.direct_bytes, stats.cached_bytes))
    }

    /// Stops the readers and joins them (no slot is written after this returns). Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.ring().close());
    }

    /// `(direct bytes, cached bytes)` read so far.
    #[getter]
    fn stats(&self) -> (u64, u64) {
        let s = self.ring().stats();
        (s.direct_bytes, s.cached_bytes)
    }

    /// The number of slots.
    #[getter]
    fn slots(&self) -> usize {
        self.ring().slots()
    }
}
