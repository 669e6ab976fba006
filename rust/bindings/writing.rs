//! Writing files and bytes from tensors the Python caller owns.

use std::collections::HashMap;
use std::path::PathBuf;

use pyo3::prelude::*;

use super::errors::to_py;
use super::parse_dtype;
use crate::write::{self, Source};

/// One source: (name, dtype, shape, pointer, byte length).
type SourceSpec = (String, String, Vec<u64>, usize, usize);

/// Writes tensors to a new file at `path` (never overwriting one), fsynced; returns bytes written.
#[pyfunction]
#[pyo3(signature = (path, tensors, metadata = None, threads = None))]
pub(super) fn write_file(
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
pub(super) fn serialize<'py>(
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
