//! Core errors raised as the `fastload.core.basics.errors` hierarchy.
//!
//! The class comes from an exhaustive `match` on [`ErrorKind`] (itself exhaustive over the
//! [`Error`] variants, see [`Error::kind`]): a new variant or kind does not compile until it is
//! given its Python class.

use std::path::Path;

use pyo3::prelude::*;

use crate::error::{Error, ErrorKind};

/// Raises `err` as the matching `fastload.core.basics.errors` class, prefixed with the file name.
///
/// | kind | raised as |
/// |---|---|
/// | `File` | `CheckpointError` |
/// | `MissingTensor` | `TensorNotFoundError` |
/// | `Unsupported` | `UnsupportedError` |
/// | `Request` | `RequestError` |
/// | `Cancelled` | `LoadCancelledError` |
/// | `Io` | `FastloadIOError` |
/// | `Store { errno }` | `fastload.core.basics.errors.store_error(url, errno, message)`: `FileNotFoundError` (`ENOENT`: no such object or bucket), `PermissionError` (`EACCES`: denied) or `FastloadIOError` (no errno: the store failed), the message kept |
/// | `Os { errno }` | `fastload.core.basics.errors.os_error(path, errno, message)`: the `FastloadIOError` subclass of the errno (`FileNotFoundError` for `ENOENT` ...) with `errno`, `strerror` and `filename` set |
pub(super) fn to_py(py: Python<'_>, path: &Path, err: Error) -> PyErr {
    let class = match err.kind() {
        ErrorKind::File => "CheckpointError",
        ErrorKind::MissingTensor => "TensorNotFoundError",
        ErrorKind::Unsupported => "UnsupportedError",
        ErrorKind::Request => "RequestError",
        ErrorKind::Cancelled => "LoadCancelledError",
        ErrorKind::Io => "FastloadIOError",
        ErrorKind::Os { errno } => return os_error(py, path, errno, &err),
        ErrorKind::Store { errno } => return store_error(py, path, errno, &err),
    };
    let msg = format!("{}: {err}", path.display());
    let made = py
        .import("fastload.core.basics.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| cls.call1((msg,)))
        .map(PyErr::from_value);
    made.unwrap_or_else(|e| e)
}

/// The `OSError` subclass of `errno` (`FileNotFoundError` ...), built by `fastload.core.basics.errors` from
/// the message of the operating-system error behind `err`.
fn os_error(py: Python<'_>, path: &Path, errno: i32, err: &Error) -> PyErr {
    let detail = std::error::Error::source(err)
        .map(ToString::to_string)
        .unwrap_or_default();
    let made = py
        .import("fastload.core.basics.errors")
        .and_then(|m| m.getattr("os_error"))
        .and_then(|f| f.call1((path.display().to_string(), errno, detail)))
        .map(PyErr::from_value);
    made.unwrap_or_else(|e| e)
}

/// An object storage failure as the `FastloadIOError` subclass its `errno` names, with the
/// message (the URL, the rule, the tensor, the store's answer) kept whole.
fn store_error(py: Python<'_>, path: &Path, errno: Option<i32>, err: &Error) -> PyErr {
    let url = path.display().to_string();
    let made = py
        .import("fastload.core.basics.errors")
        .and_then(|m| m.getattr("store_error"))
        .and_then(|f| f.call1((url.clone(), errno, format!("{url}: {err}"))))
        .map(PyErr::from_value);
    made.unwrap_or_else(|e| e)
}

/// [`to_py`] for a failure while reading `what` (`tensor 'x'`, or the tensors of a staged read),
/// with `tensor` the one tensor, when known: the message names the file, the rule and what was
/// being read (an operating-system error keeps its class, its `filename` the file's path).
pub(super) fn to_py_reading(
    py: Python<'_>,
    path: &Path,
    what: Option<&str>,
    tensor: Option<&str>,
    err: Error,
) -> PyErr {
    let Some(what) = what else {
        return to_py(py, path, err);
    };
    if let Error::Os { errno, .. } = err {
        let detail = std::error::Error::source(&err)
            .map(ToString::to_string)
            .unwrap_or_default();
        let made = py
            .import("fastload.core.basics.errors")
            .and_then(|m| m.getattr("os_error"))
            .and_then(|f| {
                f.call1((
                    path.display().to_string(),
                    errno,
                    format!("{what}: {detail}"),
                ))
            })
            .map(PyErr::from_value);
        return made.unwrap_or_else(|e| e);
    }
    if let (Error::Store { .. }, Some(t)) = (&err, tensor) {
        return to_py(py, path, err.for_tensor(t));
    }
    let text = err.to_string();
    let rule = format!("[{}] ", err.rule());
    let rest = text.strip_prefix(&rule).unwrap_or(&text).to_string();
    if rest.starts_with("tensor '") || matches!(err, Error::Store { .. }) {
        return to_py(py, path, err);
    }
    // The class of the error as `to_py` raises it, the message naming what was being read.
    let class_of = to_py(py, path, err);
    let msg = format!("{}: {rule}{what}: {rest}", path.display());
    let made = class_of.get_type(py).call1((msg,)).map(PyErr::from_value);
    made.unwrap_or(class_of)
}
