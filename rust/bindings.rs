//! The `fastload._core` Python extension: thin wrappers over the core that release the GIL for
//! all I/O and copying, and turn core errors into the `fastload.core.basics.errors` hierarchy.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::copy::{self, Request, Selection};
use crate::dtype::{Dtype, ALL_DTYPES};
use crate::error::Error;
use crate::file::{ReadMode, SafetensorsFile};
use crate::pool;

mod errors;
mod staged;
mod store;
mod watch;
mod writing;

use errors::to_py;
use watch::{watched, PyProgress, WATCH_BYTES};

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
        Some([first, count, row, start, stop]) => Ok(Selection::Rows {
            first: *first,
            count: *count,
            row: *row,
            start: *start,
            stop: *stop,
        }),
        Some(other) => Err(PyValueError::new_err(format!(
            "tensor '{name}': selection must be [start, stop], [dim, start, stop] or [first row, \
             rows, row length, start, stop], got {other:?}"
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

    /// Whether the bytes come from object storage (read with ranged GETs).
    #[getter]
    fn remote(&self) -> bool {
        self.inner.is_remote()
    }

    /// `(size, etag, last_modified)` of the object version every read asks for (an object in
    /// object storage; the date in RFC 3339, `None` where the store gave none), or None for a
    /// local file: what the ranks of a collective load compare before they read.
    #[getter]
    fn version(&self) -> Option<(u64, Option<String>, Option<String>)> {
        self.inner.version()
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

    /// Reads the file's bytes `[offset, offset + length)` (default: the tensor data) into the
    /// page cache with `threads` parallel readers (`sendfile` to /dev/null, a descriptor each),
    /// mapping nothing; returns the bytes read (0 for a file held in memory). The range is
    /// clipped to the file.
    #[pyo3(signature = (offset = None, length = None, threads = None))]
    fn read_through(
        &self,
        py: Python<'_>,
        offset: Option<u64>,
        length: Option<u64>,
        threads: Option<usize>,
    ) -> PyResult<u64> {
        let size = self.inner.len();
        let start = offset
            .unwrap_or_else(|| self.inner.header().data_start())
            .min(size);
        let len = length.unwrap_or(u64::MAX).min(size - start);
        let file = &*self.inner;
        py.detach(|| file.read_through((start, len), threads))
            .map_err(|e| to_py(py, file.path(), e))
    }

    /// Whether most of the file's bytes `[offset, offset + length)` (default: the tensor data)
    /// are not in the page cache (`cachestat(2)`, of 32 evenly spread windows of a range over 8 MiB;
    /// `False` for a file held in memory or where the kernel cannot say).
    #[pyo3(signature = (offset = None, length = None))]
    fn mostly_uncached(&self, py: Python<'_>, offset: Option<u64>, length: Option<u64>) -> bool {
        let start = offset.unwrap_or_else(|| self.inner.header().data_start());
        let len = length.unwrap_or_else(|| self.inner.len().saturating_sub(start));
        let file = &*self.inner;
        // a sample of a large range (a bounded cost): the warm-up's helper thread asks, beside the loader
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
    /// Private (`_copy_into`): it writes to raw addresses, so Python reaches it only through
    /// `fastload.core.basics.engine.copy_into`, which derives each address and length from a tensor.
    ///
    /// Every job is validated before any byte is written. The GIL is released while copying;
    /// a long copy (or one given `progress`) is watched from the calling thread, which re-takes
    /// the GIL every few tens of milliseconds to run signal handlers (Ctrl-C cancels the copy and
    /// raises `KeyboardInterrupt`) and `progress`'s callback. The caller must keep each
    /// destination alive and untouched until this returns.
    #[pyo3(name = "_copy_into", signature = (jobs, threads = None, progress = None))]
    fn copy_into(
        &self,
        py: Python<'_>,
        jobs: Vec<Job>,
        threads: Option<usize>,
        progress: Option<Bound<'_, PyProgress>>,
    ) -> PyResult<u64> {
        let file = &*self.inner;
        let err = |e| to_py(py, file.path(), e);
        let workers = planning_workers(file, threads).map_err(err)?;
        let total = job_bytes(&jobs);
        let plan = plan_jobs(file, jobs, total, workers).map_err(|e| match e {
            Planned::Py(e) => e,
            Planned::Core(e) => err(e),
        })?;
        run_copy(py, vec![(file, plan)], threads, progress)
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

/// Why jobs could not be planned: a Python-side argument, or the engine's refusal.
enum Planned {
    Py(PyErr),
    Core(Error),
}

/// The engine's plan for `jobs` on `file` (every job validated before any byte is written).
/// The threads a copy from `file` plans its tasks for: `threads`, or by default the CPUs, and at
/// least [`pool::REMOTE_THREADS`] for an object in object storage (as `copy::execute_many` runs
/// it).
fn planning_workers(file: &SafetensorsFile, threads: Option<usize>) -> Result<usize, Error> {
    let workers = pool::check_threads(threads)?;
    Ok(match threads {
        None if file.is_remote() => workers.max(pool::REMOTE_THREADS),
        _ => workers,
    })
}

/// The destination bytes of `jobs`.
fn job_bytes(jobs: &[Job]) -> u64 {
    jobs.iter().map(|j| j.2 as u64).fold(0, u64::saturating_add)
}

/// The engine's plan for `jobs` on `file`, its tasks sized for `workers` threads sharing a copy
/// of `total` bytes (`copy::plan_for_threads`); every job validated before any byte is written.
fn plan_jobs(
    file: &SafetensorsFile,
    jobs: Vec<Job>,
    total: u64,
    workers: usize,
) -> Result<SendPlan, Planned> {
    let mut requests = Vec::with_capacity(jobs.len());
    for (name, ptr, len, dtype, sel) in jobs {
        let selection = parse_selection(&name, sel).map_err(Planned::Py)?;
        let dtype = parse_dtype(&dtype).map_err(Planned::Py)?;
        requests.push(Request {
            name,
            ptr: ptr as *mut u8,
            len,
            dtype,
            selection,
        });
    }
    // Raw pointers are not Send; the plan only holds them as addresses.
    copy::plan_for_threads(file, &requests, total, workers)
        .map(SendPlan)
        .map_err(Planned::Core)
}

/// Runs planned copies of one or more files as one copy, GIL released; watched (Ctrl-C,
/// `progress`'s callback) when given `progress`, when large, or when it reads object storage
/// (a stalled store makes any copy long).
fn run_copy(
    py: Python<'_>,
    work: Vec<(&SafetensorsFile, SendPlan)>,
    threads: Option<usize>,
    progress: Option<Bound<'_, PyProgress>>,
) -> PyResult<u64> {
    let bytes: u64 = work.iter().map(|(_, p)| p.0.dst_bytes()).sum();
    let progress = match progress {
        Some(p) => Some(p),
        None if bytes >= WATCH_BYTES || work.iter().any(|(f, _)| f.is_remote()) => {
            Some(Bound::new(py, PyProgress::create(None))?)
        }
        None => None,
    };
    let Some(progress) = progress else {
        // SAFETY: the Python caller owns the destinations (torch tensors it keeps referenced
        // for the duration of the call) and `plan` checked each one's length.
        let done = py.detach(|| {
            let plans: Vec<_> = work.iter().map(|(f, p)| (*f, &p.0)).collect();
            unsafe { copy::execute_many(&plans, threads, None, None) }
        });
        return done.map_err(|(index, e)| to_py(py, work[index].0.path(), e));
    };
    let state = progress.get().inner.clone();
    let callback = progress.get().callback.as_ref().map(|c| c.clone_ref(py));
    // SAFETY: as above; `watched` returns only once the copy has stopped.
    watched(py, &work, threads, &state, callback)
}

/// Fills the destinations of several files in one copy (`[(file, jobs)]`, jobs as
/// `SafetensorsFile._copy_into` takes them): the tasks of every file run on one pool, so the
/// shards of a checkpoint are read in parallel with each other. Private, as `_copy_into`:
/// Python reaches it through `fastload.core.basics.engine.copy_files`.
#[pyfunction]
#[pyo3(name = "_copy_files", signature = (items, threads = None, progress = None))]
fn copy_files(
    py: Python<'_>,
    items: Vec<(Bound<'_, PySafetensorsFile>, Vec<Job>)>,
    threads: Option<usize>,
    progress: Option<Bound<'_, PyProgress>>,
) -> PyResult<u64> {
    let files: Vec<Arc<SafetensorsFile>> =
        items.iter().map(|(f, _)| f.get().inner.clone()).collect();
    // Every file's tasks run on one pool: they are sized for its threads and the whole copy.
    let total = items
        .iter()
        .map(|(_, jobs)| job_bytes(jobs))
        .fold(0, u64::saturating_add);
    let mut workers = 1;
    for file in &files {
        let planned = planning_workers(file, threads).map_err(|e| to_py(py, file.path(), e))?;
        workers = workers.max(planned);
    }
    let mut work = Vec::with_capacity(items.len());
    for (file, (_, jobs)) in files.iter().zip(items) {
        let err = |e| to_py(py, file.path(), e);
        let plan = plan_jobs(file, jobs, total, workers).map_err(|e| match e {
            Planned::Py(e) => e,
            Planned::Core(e) => err(e),
        })?;
        work.push((&**file, plan));
    }
    run_copy(py, work, threads, progress)
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
    pool::default_threads()
}

/// `text` with the query and the user-info of every URL in it hidden: the one redaction of the
/// package (`fastload.core.basics.redaction`).
#[pyfunction]
fn redact_urls(text: &str) -> String {
    crate::redact::urls(text)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySafetensorsFile>()?;
    m.add_class::<PyProgress>()?;
    m.add_class::<store::PyObjectStore>()?;
    m.add_class::<staged::PyStagedRead>()?;
    m.add("STAGE_ALIGN", crate::staged::ALIGN)?;
    m.add_function(wrap_pyfunction!(copy_files, m)?)?;
    m.add_function(wrap_pyfunction!(writing::write_file, m)?)?;
    m.add_function(wrap_pyfunction!(writing::serialize, m)?)?;
    m.add_function(wrap_pyfunction!(validate, m)?)?;
    m.add_function(wrap_pyfunction!(dtype_bits, m)?)?;
    m.add_function(wrap_pyfunction!(default_threads, m)?)?;
    m.add_function(wrap_pyfunction!(redact_urls, m)?)?;
    m.add("MAX_HEADER_LEN", crate::header::MAX_HEADER_LEN)?;
    m.add("CHUNK", copy::CHUNK)?;
    m.add("MAX_THREADS", pool::MAX_THREADS)?;
    Ok(())
}
