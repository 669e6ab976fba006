//! The `fastload._core` Python extension: thin wrappers over the core that release the GIL for
//! all I/O and copying, and turn core errors into the `fastload.errors` hierarchy.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::copy::{self, Progress, Request, Selection};
use crate::dtype::{Dtype, ALL_DTYPES};
use crate::error::Error;
use crate::file::{ReadMode, SafetensorsFile};
use crate::write::{self, Source};

/// Raises `err` as the matching `fastload.errors` class, prefixed with the file name.
fn to_py(py: Python<'_>, path: &std::path::Path, err: Error) -> PyErr {
    if let Error::Os { errno, detail } = &err {
        // The OSError subclass of the errno (FileNotFoundError ...), built by fastload.errors.
        let made = py
            .import("fastload.errors")
            .and_then(|m| m.getattr("os_error"))
            .and_then(|f| f.call1((path.display().to_string(), *errno, detail.clone())))
            .map(PyErr::from_value);
        return made.unwrap_or_else(|e| e);
    }
    let class = match &err {
        Error::UnknownTensor { .. } => "TensorNotFoundError",
        Error::UnsupportedConversion { .. } => "UnsupportedError",
        Error::Io { .. } => "FastloadIOError",
        Error::Cancelled => "LoadCancelledError",
        e if e.is_file_error() => "CheckpointError",
        _ => "RequestError",
    };
    let msg = format!("{}: {err}", path.display());
    let made = py
        .import("fastload.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((msg.clone(),)))
        .map(PyErr::from_value);
    made.unwrap_or_else(|e| e)
}

fn parse_dtype(name: &str) -> PyResult<Dtype> {
    Dtype::parse(name)
        .ok_or_else(|| PyValueError::new_err(format!("unknown safetensors dtype '{name}'")))
}

fn parse_selection(name: &str, sel: Option<Vec<u64>>) -> PyResult<Selection> {
    match sel.as_deref() {
        None => Ok(Selection::All),
        Some([start, stop]) => Ok(Selection::Elements {
            start: *start,
            stop: *stop,
        }),
        Some([dim, start, stop]) => Ok(Selection::Slice {
            dim: *dim as usize,
            start: *start,
            stop: *stop,
        }),
        Some(other) => Err(PyValueError::new_err(format!(
            "tensor '{name}': selection must be [start, stop] or [dim, start, stop], got {other:?}"
        ))),
    }
}

/// One destination: (name, pointer, byte length, dtype name, selection or None).
type Job = (String, usize, usize, String, Option<Vec<u64>>);

/// An open, validated safetensors file.
#[pyclass(frozen, module = "fastload._core", name = "SafetensorsFile")]
struct PySafetensorsFile {
    inner: Arc<SafetensorsFile>,
}

#[pymethods]
impl PySafetensorsFile {
    /// Opens `path`; with `dir_fd`, opens `name` relative to that open directory instead
    /// (`openat`) and shows `path` in messages. `strict` also refuses what only strict reading
    /// refuses (see `Header::strict_violation`).
    #[new]
    #[pyo3(signature = (path, mode = "pread", dir_fd = None, name = None, *, strict = false))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        mode: &str,
        dir_fd: Option<i32>,
        name: Option<PathBuf>,
        strict: bool,
    ) -> PyResult<Self> {
        let read_mode = ReadMode::parse(mode).ok_or_else(|| {
            PyValueError::new_err(format!("mode must be 'pread' or 'mmap', got '{mode}'"))
        })?;
        let name = name.unwrap_or_else(|| path.clone());
        if dir_fd.is_none() && name != path {
            return Err(PyValueError::new_err("name is only meaningful with dir_fd"));
        }
        let opened = py.detach(|| SafetensorsFile::open_at(dir_fd, &name, &path, read_mode));
        let inner = opened
            .and_then(|f| check_strict(f, strict))
            .map_err(|e| to_py(py, &path, e))?;
        Ok(PySafetensorsFile {
            inner: Arc::new(inner),
        })
    }

    /// Validates a whole file held in `data` (`safetensors.torch.load`); `label` stands for the
    /// path in messages.
    #[staticmethod]
    #[pyo3(signature = (label, data, *, strict = false))]
    fn from_bytes(py: Python<'_>, label: PathBuf, data: &[u8], strict: bool) -> PyResult<Self> {
        let data = data.to_vec();
        let opened = py.detach(|| SafetensorsFile::from_bytes(label.clone(), data));
        let inner = opened
            .and_then(|f| check_strict(f, strict))
            .map_err(|e| to_py(py, &label, e))?;
        Ok(PySafetensorsFile {
            inner: Arc::new(inner),
        })
    }

    /// The path the file was opened with.
    #[getter]
    fn path(&self) -> String {
        self.inner.path().display().to_string()
    }

    /// The read path: "pread" or "mmap".
    #[getter]
    fn mode(&self) -> &'static str {
        self.inner.mode().name()
    }

    /// File size in bytes.
    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.len()
    }

    /// Absolute offset of the data section.
    #[getter]
    fn data_start(&self) -> u64 {
        self.inner.header().data_start()
    }

    /// `(st_dev, st_ino)` of the file as opened, or None for an in-memory file: lets Python
    /// check that a path still names the validated file before mapping it again.
    fn identity(&self, py: Python<'_>) -> PyResult<Option<(u64, u64)>> {
        self.inner
            .identity()
            .map_err(|e| to_py(py, self.inner.path(), e))
    }

    /// `(name, local)` of the filesystem the file lives on ("ext4", "nfs", "fuse", ... or the
    /// magic number in hex), or None for an in-memory file. `local` is False for network, cluster
    /// and FUSE filesystems, where fastload copies instead of mapping by default.
    fn filesystem(&self, py: Python<'_>) -> PyResult<Option<(String, bool)>> {
        let fs = self
            .inner
            .filesystem()
            .map_err(|e| to_py(py, self.inner.path(), e))?;
        Ok(fs.map(|f| (f.name, f.local)))
    }

    /// Reads the not-yet-cached pages (every page with `cached`) of `[address, address +
    /// length)`, a mapping of this file whose byte `offset` is at `address`, into the mapping with
    /// parallel `MADV_POPULATE_READ`, uncached parts (every part with `cold`) read through the
    /// page cache first; returns the bytes populated. A range that is not mapped raises
    /// `FastloadIOError`, it never crashes.
    #[pyo3(signature = (address, offset, length, threads = None, cached = false, cold = false))]
    #[allow(clippy::too_many_arguments)] // the Python signature, whose flags callers pass by name
    fn read_ahead(
        &self,
        py: Python<'_>,
        address: usize,
        offset: u64,
        length: usize,
        threads: Option<usize>,
        cached: bool,
        cold: bool,
    ) -> PyResult<u64> {
        let file = &*self.inner;
        py.detach(|| file.read_ahead(address, offset, length, threads, cached, cold))
            .map_err(|e| to_py(py, file.path(), e))
    }

    /// Whether most of the file's bytes `[offset, offset + length)` (default: the tensor data)
    /// are not in the page cache (`cachestat(2)`; `False` for a file held in memory or where the
    /// kernel cannot say).
    #[pyo3(signature = (offset = None, length = None))]
    fn mostly_uncached(&self, py: Python<'_>, offset: Option<u64>, length: Option<u64>) -> bool {
        let start = offset.unwrap_or_else(|| self.inner.header().data_start());
        let len = length.unwrap_or_else(|| self.inner.len().saturating_sub(start));
        let file = &*self.inner;
        // ~5 ms per GiB of 4 KiB folios: the warm-up's helper thread asks, beside the loader
        py.detach(|| file.mostly_uncached((start, len)))
    }

    /// The open file descriptor (None for an in-memory file), valid while this object lives.
    fn fileno(&self) -> Option<i32> {
        self.inner.raw_fd()
    }

    /// Tensor names, sorted.
    fn keys(&self) -> Vec<String> {
        self.inner
            .header()
            .sorted_names()
            .into_iter()
            .map(String::from)
            .collect()
    }

    /// The `__metadata__` dict, or None.
    fn metadata(&self) -> Option<HashMap<String, String>> {
        self.inner
            .header()
            .metadata()
            .map(|m| m.iter().cloned().collect())
    }

    /// `(name, dtype, shape, begin, end)` for every tensor in header order; offsets are relative
    /// to the data section.
    fn tensors(&self) -> Vec<(String, &'static str, Vec<u64>, u64, u64)> {
        self.inner
            .header()
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.name(),
                    t.shape.clone(),
                    t.begin,
                    t.end,
                )
            })
            .collect()
    }

    /// `(dtype, shape, begin, end)` of one tensor.
    fn info(&self, py: Python<'_>, name: &str) -> PyResult<(&'static str, Vec<u64>, u64, u64)> {
        let t = self.inner.header().get(name).ok_or_else(|| {
            to_py(
                py,
                self.inner.path(),
                Error::UnknownTensor {
                    tensor: name.to_string(),
                },
            )
        })?;
        Ok((t.dtype.name(), t.shape.clone(), t.begin, t.end))
    }

    fn __len__(&self) -> usize {
        self.inner.header().tensors().len()
    }

    fn __contains__(&self, name: &str) -> bool {
        self.inner.header().get(name).is_some()
    }

    /// Fills destinations given as `(name, ptr, nbytes, dtype, selection)`; returns bytes written.
    ///
    /// Every job is validated before any byte is written. The GIL is released while copying;
    /// a long copy (or one given `progress`) is watched from the calling thread, which re-takes
    /// the GIL every few tens of milliseconds to run signal handlers (Ctrl-C cancels the copy and
    /// raises `KeyboardInterrupt`) and `progress`'s callback. The caller must keep each
    /// destination alive and untouched until this returns.
    #[pyo3(signature = (jobs, threads = None, progress = None))]
    fn copy_into(
        &self,
        py: Python<'_>,
        jobs: Vec<Job>,
        threads: Option<usize>,
        progress: Option<Bound<'_, PyProgress>>,
    ) -> PyResult<u64> {
        let mut requests = Vec::with_capacity(jobs.len());
        for (name, ptr, len, dtype, sel) in jobs {
            let selection = parse_selection(&name, sel)?;
            let dtype = parse_dtype(&dtype)?;
            requests.push(Request {
                name,
                ptr: ptr as *mut u8,
                len,
                dtype,
                selection,
            });
        }
        let file = &*self.inner;
        let err = |e| to_py(py, file.path(), e);
        copy::check_threads(threads).map_err(err)?;
        let plan = copy::plan(file, &requests).map_err(err)?;
        // Raw pointers are not Send; the plan only holds them as addresses.
        let plan = SendPlan(plan);
        let progress = match progress {
            Some(p) => Some(p),
            None if plan.0.dst_bytes() >= WATCH_BYTES => {
                Some(Bound::new(py, PyProgress::create(None))?)
            }
            None => None,
        };
        let Some(progress) = progress else {
            // SAFETY: the Python caller owns the destinations (torch tensors it keeps referenced
            // for the duration of the call) and `plan` checked each one's length.
            let done = py.detach(move || {
                let p = plan;
                unsafe { copy::execute(file, &p.0, threads, None, None) }
            });
            return done.map_err(err);
        };
        let state = progress.get().inner.clone();
        let callback = progress.get().callback.as_ref().map(|c| c.clone_ref(py));
        // SAFETY: as above; `watched` returns only once the copy has stopped.
        watched(py, file, plan, threads, &state, callback)
    }

    fn __repr__(&self) -> String {
        format!(
            "SafetensorsFile('{}', mode='{}', tensors={})",
            self.inner.path().display(),
            self.inner.mode().name(),
            self.inner.header().tensors().len()
        )
    }
}

/// `file`, unless `strict` and its header has something only strict reading refuses.
fn check_strict(file: SafetensorsFile, strict: bool) -> Result<SafetensorsFile, Error> {
    match file.header().strict_violation() {
        Some(e) if strict => Err(e.clone()),
        _ => Ok(file),
    }
}

struct SendPlan(copy::Plan);
// SAFETY: a Plan holds destination addresses that the caller guarantees valid during the call.
unsafe impl Send for SendPlan {}
// SAFETY: as Send: the addresses are only written through `execute`'s disjoint pieces.
unsafe impl Sync for SendPlan {}

/// Copies at least this many bytes are watched for Ctrl-C (smaller ones finish in milliseconds
/// and skip the watcher's thread).
const WATCH_BYTES: u64 = 16 << 20;

/// How often a watched copy re-takes the GIL for signals and the progress callback.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// What the copy thread tells the watching thread.
enum Event {
    /// A task finished; the progress counter then read this many bytes.
    Task(u64),
    /// The copy stopped with this result.
    Finished(crate::error::Result<u64>),
}

/// Runs `plan` on a scoped thread while the calling thread, GIL released, waits for it. After
/// each task (about `CHUNK` bytes) and every [`WATCH_EVERY`] at least, the calling thread re-takes
/// the GIL to run signal handlers and `callback(bytes done)`. An exception from either cancels
/// the copy; it is raised once the copy has stopped (destinations are never written after this
/// returns).
fn watched(
    py: Python<'_>,
    file: &SafetensorsFile,
    plan: SendPlan,
    threads: Option<usize>,
    progress: &Progress,
    callback: Option<Py<PyAny>>,
) -> PyResult<u64> {
    let (result, raised) = py.detach(|| {
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            let plan = &plan;
            let done_tx = tx.clone();
            s.spawn(move || {
                let tick = move |done: u64| {
                    let _ = tx.send(Event::Task(done));
                };
                // SAFETY: forwarded from `copy_into`; the scope outlives the copy.
                let r =
                    unsafe { copy::execute(file, &plan.0, threads, Some(progress), Some(&tick)) };
                let _ = done_tx.send(Event::Finished(r));
            });
            let mut raised: Option<PyErr> = None;
            let mut seen = 0u64;
            loop {
                let done = match rx.recv_timeout(WATCH_EVERY) {
                    Ok(Event::Finished(r)) => return (r, raised),
                    Ok(Event::Task(done)) => done,
                    Err(RecvTimeoutError::Timeout) => progress.done(),
                    Err(RecvTimeoutError::Disconnected) => {
                        let lost = Error::Io {
                            detail: "the copy thread stopped without a result".into(),
                        };
                        return (Err(lost), raised);
                    }
                };
                // Tasks finish out of order on several threads: report the largest count seen.
                seen = seen.max(done);
                if raised.is_some() {
                    continue;
                }
                raised = Python::attach(|py| {
                    py.check_signals()?;
                    if let Some(cb) = &callback {
                        cb.call1(py, (seen,))?;
                    }
                    Ok::<(), PyErr>(())
                })
                .err();
                if raised.is_some() {
                    progress.cancel();
                }
            }
        })
    });
    if let Some(e) = raised {
        return Err(e);
    }
    result.map_err(|e| to_py(py, file.path(), e))
}

/// Progress of copies, shared with Python: `done` bytes so far, `cancel()` to stop them between
/// pieces (they raise `LoadCancelledError`), and an optional `callback(done)` that a copy calls
/// with the GIL held after each task of about `CHUNK` bytes and every few tens of milliseconds
/// (an exception from it cancels the copy).
#[pyclass(frozen, module = "fastload._core", name = "Progress")]
struct PyProgress {
    inner: Arc<Progress>,
    callback: Option<Py<PyAny>>,
}

impl PyProgress {
    fn create(callback: Option<Py<PyAny>>) -> Self {
        PyProgress {
            inner: Arc::new(Progress::new()),
            callback,
        }
    }
}

#[pymethods]
impl PyProgress {
    #[new]
    #[pyo3(signature = (callback = None))]
    fn new(callback: Option<Py<PyAny>>) -> Self {
        Self::create(callback)
    }

    /// Destination bytes written so far by the copies given this object.
    #[getter]
    fn done(&self) -> u64 {
        self.inner.done()
    }

    /// Whether `cancel()` was called.
    #[getter]
    fn cancelled(&self) -> bool {
        self.inner.is_cancelled()
    }

    /// Stops running copies at their next piece; later copies given this object do not start.
    fn cancel(&self) {
        self.inner.cancel();
    }

    /// Counts `nbytes` written by a copy outside the engine (pickle files).
    fn add(&self, nbytes: u64) {
        self.inner.add_external(nbytes);
    }

    fn __repr__(&self) -> String {
        format!(
            "Progress(done={}, cancelled={})",
            self.inner.done(),
            self.inner.is_cancelled()
        )
    }
}

/// One source: (name, dtype, shape, pointer, byte length).
type SourceSpec = (String, String, Vec<u64>, usize, usize);

/// Writes tensors to a new file at `path` (never overwriting one), fsynced; returns bytes written.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata = None, threads = None))]
fn write_file(
    py: Python<'_>,
    path: PathBuf,
    tensors: Vec<SourceSpec>,
    metadata: Option<HashMap<String, String>>,
    threads: Option<usize>,
) -> PyResult<u64> {
    let sources = sources_of(tensors)?;
    let meta = sorted_metadata(metadata);
    let sources = SendSources(sources);
    let p = path.clone();
    // SAFETY: the Python caller keeps the source tensors alive during the call.
    let done = py.detach(move || {
        let s = sources;
        unsafe { write::write_file(&p, &s.0, meta.as_deref(), threads) }
    });
    done.map_err(|e| to_py(py, &path, e))
}

/// The safetensors bytes of `tensors` (a file's whole content, built in memory).
#[pyfunction]
#[pyo3(signature = (tensors, metadata = None))]
fn serialize<'py>(
    py: Python<'py>,
    tensors: Vec<SourceSpec>,
    metadata: Option<HashMap<String, String>>,
) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let sources = sources_of(tensors)?;
    let meta = sorted_metadata(metadata);
    // SAFETY: the Python caller keeps the source tensors alive during the call.
    let bytes = unsafe { write::serialize(&sources, meta.as_deref()) }
        .map_err(|e| to_py(py, std::path::Path::new("<bytes>"), e))?;
    Ok(pyo3::types::PyBytes::new(py, &bytes))
}

fn sources_of(tensors: Vec<SourceSpec>) -> PyResult<Vec<Source>> {
    let mut sources = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, ptr, len) in tensors {
        let dtype = parse_dtype(&dtype)?;
        sources.push(Source {
            name,
            dtype,
            shape,
            ptr: ptr as *const u8,
            len,
        });
    }
    Ok(sources)
}

fn sorted_metadata(metadata: Option<HashMap<String, String>>) -> Option<Vec<(String, String)>> {
    let mut meta: Option<Vec<(String, String)>> = metadata.map(|m| m.into_iter().collect());
    if let Some(m) = meta.as_mut() {
        m.sort();
    }
    meta
}

struct SendSources(Vec<Source>);
// SAFETY: sources are read-only addresses the caller keeps valid during the call.
unsafe impl Send for SendSources {}

/// Validates a whole file without reading tensor data; returns the number of tensors.
#[pyfunction]
#[pyo3(signature = (path, *, strict = false))]
fn validate(py: Python<'_>, path: PathBuf, strict: bool) -> PyResult<usize> {
    let opened = py.detach(|| SafetensorsFile::open(&path, ReadMode::Pread));
    opened
        .and_then(|f| check_strict(f, strict))
        .map(|f| f.header().tensors().len())
        .map_err(|e| to_py(py, &path, e))
}

/// `{dtype name: bits}` for every safetensors dtype.
#[pyfunction]
fn dtype_bits() -> HashMap<&'static str, usize> {
    ALL_DTYPES.iter().map(|d| (d.name(), d.bits())).collect()
}

/// Copy threads used when none are given.
#[pyfunction]
fn default_threads() -> usize {
    copy::default_threads()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySafetensorsFile>()?;
    m.add_class::<PyProgress>()?;
    m.add_function(wrap_pyfunction!(write_file, m)?)?;
    m.add_function(wrap_pyfunction!(serialize, m)?)?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_bits, m)?)?;
    m.add_function(wrap_pyfunction!(default_threads, m)?)?;
    m.add("MAX_HEADER_LEN", crate::header::MAX_HEADER_LEN)?;
    m.add("CHUNK", copy::CHUNK)?;
    m.add("MAX_THREADS", copy::MAX_THREADS)?;
    Ok(())
}
