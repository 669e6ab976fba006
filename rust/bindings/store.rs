//! Object storage for Python: `fastload._core.ObjectStore`, one bucket (container, host) and its
//! client, whose objects open as `SafetensorsFile`s read with ranged GETs.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use rayon::prelude::*;

use super::errors::to_py;
use super::watch::interruptible;
use super::{check_strict, PySafetensorsFile};
use crate::cancel::scoped;
use crate::error::Result;
use crate::file::SafetensorsFile;
use crate::pool::{pool, REMOTE_THREADS};
use crate::store::{redact, Settings, Store};

fn pairs(map: Option<HashMap<String, String>>) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = map.unwrap_or_default().into_iter().collect();
    pairs.sort();
    pairs
}

/// A store and the client that reads it, built from a URL (`s3://bucket/prefix`,
/// `gs://...`, `az://...`, `https://host/path`), the standard environment variables of its kind,
/// `defaults` read from configuration files (used where the environment is silent) and
/// `options` (which win). `key` is the part of the URL inside the store.
#[pyclass(frozen, module = "fastload._core", name = "ObjectStore")]
pub(super) struct PyObjectStore {
    inner: Arc<Store>,
    key: String,
}

#[pymethods]
impl PyObjectStore {
    #[new]
    #[pyo3(signature = (url, options = None, defaults = None))]
    fn new(
        py: Python<'_>,
        url: &str,
        options: Option<HashMap<String, String>>,
        defaults: Option<HashMap<String, String>>,
    ) -> PyResult<Self> {
        let settings = Settings {
            options: pairs(options),
            defaults: pairs(defaults),
        };
        let built = py.detach(|| Store::from_url(url, &settings));
        let (store, key) = built.map_err(|e| to_py(py, Path::new(&redact(url)), e))?;
        Ok(PyObjectStore {
            inner: Arc::new(store),
            key,
        })
    }

    /// The URL of the store's root (`s3://bucket`).
    #[getter]
    fn url(&self) -> String {
        self.inner.base().to_string()
    }

    /// The key the URL it was made from addresses (an object or a prefix; `""` for the root).
    #[getter]
    fn key(&self) -> String {
        self.key.clone()
    }

    /// The URL of `key`.
    fn url_of(&self, key: &str) -> String {
        self.inner.url_of(key)
    }

    /// `(size, etag)` of object `key`, or None if there is none.
    fn head(&self, py: Python<'_>, key: &str) -> PyResult<Option<(u64, Option<String>)>> {
        let store = &*self.inner;
        interruptible(py, |_| store.head(key))?
            .map_err(|e| to_py(py, Path::new(&store.url_of(key)), e))
    }

    /// The whole of object `key`, refused unread when larger than `max_bytes`.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        max_bytes: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let store = &*self.inner;
        let data = interruptible(py, |_| store.get(key, max_bytes))?
            .map_err(|e| to_py(py, Path::new(&store.url_of(key)), e))?;
        Ok(PyBytes::new(py, &data))
    }

    /// Fills the `length` bytes at `address` with the bytes of `key` at `offset`: one ranged
    /// GET, GIL released; the raw transport, what loads are measured against. Private: it
    /// writes to a raw address; Python reaches it through
    /// `fastload.core.store.object_store.read_into`, which takes the address from a tensor it holds.
    #[pyo3(name = "_read_into")]
    fn read_into(
        &self,
        py: Python<'_>,
        key: &str,
        offset: u64,
        address: usize,
        length: usize,
    ) -> PyResult<u64> {
        if address == 0 && length > 0 {
            return Err(PyValueError::new_err("_read_into: a null address"));
        }
        let store = &*self.inner;
        interruptible(py, |_| {
            // SAFETY: the caller (fastload.core.store.object_store.read_into) holds the tensor whose
            // `length` bytes start at `address` for the duration of the call.
            let dst = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, length) };
            store.read_into(key, offset, dst)
        })?
        .map_err(|e| to_py(py, Path::new(&store.url_of(key)), e))?;
        Ok(length as u64)
    }

    /// `(key, size)` of the objects directly under `prefix`.
    fn list(&self, py: Python<'_>, prefix: &str) -> PyResult<Vec<(String, u64)>> {
        let store = &*self.inner;
        interruptible(py, |_| store.list(prefix))?
            .map_err(|e| to_py(py, Path::new(&store.url_of(prefix)), e))
    }

    /// Opens objects `keys` as safetensors files, in parallel: each one's header is read and
    /// validated as a file's (`strict` as for a file); the first failure is raised.
    #[pyo3(signature = (keys, *, strict = false))]
    fn open(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        strict: bool,
    ) -> PyResult<Vec<PySafetensorsFile>> {
        let store = &*self.inner;
        let open_one = |key: &String| -> (String, Result<SafetensorsFile>) {
            let opened = store
                .open(key)
                .and_then(SafetensorsFile::open_object)
                .and_then(|f| check_strict(f, strict));
            (key.clone(), opened)
        };
        let opened: Vec<(String, Result<SafetensorsFile>)> = interruptible(py, |flag| {
            if keys.len() <= 1 {
                return Ok(keys.iter().map(open_one).collect());
            }
            // the pool's threads run under the same flag
            let open_here = |key| scoped(Some(flag), || open_one(key));
            pool(REMOTE_THREADS).map(|p| p.install(|| keys.par_iter().map(open_here).collect()))
        })?
        .map_err(|e| to_py(py, Path::new(&store.base().to_string()), e))?;
        let mut files = Vec::with_capacity(opened.len());
        for (key, result) in opened {
            let file = result.map_err(|e| to_py(py, Path::new(&store.url_of(&key)), e))?;
            files.push(PySafetensorsFile {
                inner: Arc::new(file),
            });
        }
        Ok(files)
    }

    fn __repr__(&self) -> String {
        format!("ObjectStore('{}')", self.inner.base())
    }
}
