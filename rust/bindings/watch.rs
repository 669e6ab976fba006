//! Watching a long copy from the calling thread: Ctrl-C and the progress callback run while the
//! copy's threads work with the GIL released; [`PyProgress`] is the counter Python sees.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;

use super::errors::to_py;
use super::SendPlan;
use crate::copy::{self, Progress};
use crate::error::Error;
use crate::file::SafetensorsFile;

/// Copies at least this many bytes are watched for Ctrl-C (smaller ones finish in milliseconds
/// and skip the watcher's thread).
pub(super) const WATCH_BYTES: u64 = 16 << 20;

/// How often a watched copy re-takes the GIL for signals and the progress callback.
const WATCH_EVERY: Duration = Duration::from_millis(50);

/// What the copy thread tells the watching thread.
enum Event {
    /// A task finished; the progress counter then read this many bytes.
    Task(u64),
    /// The copy stopped with this result (an error with the index of its file).
    Finished(std::result::Result<u64, (usize, Error)>),
}

/// Runs the plans of `work` (one copy, [`copy::execute_many`]) on a scoped thread while the
/// calling thread, GIL released, waits for it. After
/// each task (about `CHUNK` bytes) and every [`WATCH_EVERY`] at least, the calling thread re-takes
/// the GIL to run signal handlers and `callback(bytes done)`. An exception from either cancels
/// the copy; it is raised once the copy has stopped (destinations are never written after this
/// returns).
pub(super) fn watched(
    py: Python<'_>,
    work: &[(&SafetensorsFile, SendPlan)],
    threads: Option<usize>,
    progress: &Progress,
    callback: Option<Py<PyAny>>,
) -> PyResult<u64> {
    let (result, raised) = py.detach(|| {
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            let done_tx = tx.clone();
            s.spawn(move || {
                let tick = move |done: u64| {
                    let _ = tx.send(Event::Task(done));
                };
                let plans: Vec<_> = work.iter().map(|(f, p)| (*f, &p.0)).collect();
                // SAFETY: forwarded from `copy_into`; the scope outlives the copy.
                let r = unsafe { copy::execute_many(&plans, threads, Some(progress), Some(&tick)) };
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
                            source: None,
                        };
                        return (Err((0, lost)), raised);
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
    result.map_err(|(index, e)| to_py(py, work[index].0.path(), e))
}

/// Runs `work` (requests to object storage: a HEAD, a listing, headers) on a thread of its own
/// while this thread, GIL released, waits: every [`WATCH_EVERY`] it re-takes the GIL to run
/// Python's signal handlers. An exception from them (Ctrl-C's `KeyboardInterrupt`) raises the
/// cancellation flag `work` runs under ([`crate::cancel`], also given to it for the threads it
/// starts), which abandons its requests at once; the exception is raised once `work` returned.
pub(super) fn interruptible<T: Send>(
    py: Python<'_>,
    work: impl FnOnce(&crate::cancel::Flag) -> crate::error::Result<T> + Send,
) -> PyResult<crate::error::Result<T>> {
    let flag = crate::cancel::Flag::default();
    let (result, raised) = py.detach(|| {
        let (tx, rx) = mpsc::channel();
        std::thread::scope(|s| {
            let flag = &flag;
            s.spawn(move || {
                let _ = tx.send(crate::cancel::scoped(Some(flag), || work(flag)));
            });
            let mut raised: Option<PyErr> = None;
            loop {
                match rx.recv_timeout(WATCH_EVERY) {
                    Ok(result) => return (result, raised),
                    Err(RecvTimeoutError::Timeout) if raised.is_none() => {
                        raised = Python::attach(|py| py.check_signals()).err();
                        if raised.is_some() {
                            crate::cancel::raise(flag);
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        let lost = Error::Io {
                            detail: "the request thread stopped without a result".into(),
                            source: None,
                        };
                        return (Err(lost), raised);
                    }
                }
            }
        })
    });
    match raised {
        Some(e) => Err(e),
        None => Ok(result),
    }
}

/// Progress of copies, shared with Python: `done` bytes so far, `cancel()` to stop them between
/// pieces (they raise `LoadCancelledError`), and an optional `callback(done)` that a copy calls
/// with the GIL held after each task of about `CHUNK` bytes and every few tens of milliseconds
/// (an exception from it cancels the copy).
#[pyclass(frozen, module = "fastload._core", name = "Progress")]
pub(super) struct PyProgress {
    pub(super) inner: Arc<Progress>,
    pub(super) callback: Option<Py<PyAny>>,
}

impl PyProgress {
    pub(super) fn create(callback: Option<Py<PyAny>>) -> Self {
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

    /// Counts `nbytes` written by a copy outside the engine (pickle files, the staged copies to
    /// a device) and calls the callback with the new total; an exception from it cancels the
    /// copies given this object and is raised.
    fn add(&self, py: Python<'_>, nbytes: u64) -> PyResult<()> {
        self.inner.add_external(nbytes);
        if let Some(cb) = &self.callback {
            if let Err(e) = cb.call1(py, (self.inner.done(),)) {
                self.inner.cancel();
                return Err(e);
            }
        }
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "Progress(done={}, cancelled={})",
            self.inner.done(),
            self.inner.is_cancelled()
        )
    }
}
