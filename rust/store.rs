//! Object storage as a source of bytes (feature `store`): checkpoints read with ranged GETs from
//! S3 (and S3-compatible stores), Google Cloud Storage, Azure Blob Storage, or any HTTP server
//! that honours `Range`, through the `object_store` crate: one trait for every store, retries
//! and timeouts as configuration, ranged reads as the primitive.
//!
//! * [`Store`]: one bucket (container, host) and its client, configured from the URL, the
//!   standard environment variables of its kind (`AWS_*`, `GOOGLE_*`, `AZURE_*`), defaults the
//!   caller read from configuration files (an AWS profile) and the caller's options.
//! * [`Object`]: one object of a store, its size and version (ETag, else Last-Modified) fixed
//!   when it was opened. Every later read asks for that version (`If-Match`, else
//!   `If-Unmodified-Since`) and is checked to come from it: an object replaced during a load is
//!   an error ([`StoreFailure::Changed`]), never a mix of two versions; an object with neither
//!   validator is refused at open ([`ranged`]).
//!
//! Reads block the calling thread (the copy engine's workers) while one shared runtime's threads
//! drive the connections; the bytes of a response go straight into the caller's buffer as they
//! arrive. Transient failures (connection refused or cut, timeouts, 5xx and 429 answers, a body
//! cut short, which resumes from the byte it reached) are retried by `object_store` with bounded
//! exponential backoff ([`Settings`]); everything else is an [`Error::Store`] at once. Nothing
//! here prints or logs: `object_store` reports retries through `tracing`, which stays silent
//! without a subscriber, and messages never carry credentials or a URL's query.

use std::sync::{Arc, Mutex, OnceLock};

use object_store::path::Path as StorePath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, ObjectStoreScheme};
use tokio::runtime::Runtime;
use url::Url;

use crate::error::{Error, Result, StoreFailure};
use ranged::read_range;

mod config;
mod credentials;
mod ranged;
mod values;

pub use config::{
    Settings, DEFAULT_INIT_BACKOFF, DEFAULT_MAX_BACKOFF, DEFAULT_MAX_RETRIES,
    DEFAULT_RETRY_TIMEOUT, DEFAULT_TIMEOUTS,
};

/// One bucket, container or host, and the client that reads it.
#[derive(Debug)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    /// `scheme://authority`: what messages name with an object's key.
    base: String,
}

/// One object of a [`Store`], as it was when opened: its size and validators (ETag,
/// Last-Modified), which every read must match ([`ranged`]).
#[derive(Debug)]
pub struct Object {
    store: Arc<dyn ObjectStore>,
    url: String,
    path: StorePath,
    meta: ObjectMeta,
}

/// The runtime every store's requests run on: built on first use, and again in a child process
/// after a fork (the parent's runtime threads do not exist there; using its runtime would hang).
fn runtime() -> Result<Arc<Runtime>> {
    static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return Ok(rt.clone());
        }
        // A forked child: the parent's runtime cannot run here, and dropping it would wait on
        // threads that do not exist.
        if let Some((_, stale)) = slot.take() {
            std::mem::forget(stale);
        }
    }
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 16);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("fastload-store")
        .enable_all()
        .build()
        .map_err(|e| Error::Io {
            detail: format!("cannot start the object storage runtime: {e}"),
            source: None,
        })?;
    let rt = Arc::new(rt);
    *slot = Some((pid, rt.clone()));
    Ok(rt)
}

/// Runs `future` to completion on the store runtime, blocking this thread. A panic in the client
/// (it unwraps what it takes to be valid, e.g. a header built from a configured value) is an
/// error here, never a Rust panic across the Python boundary.
///
/// With a cancellation flag on this thread ([`crate::cancel`]: a copy's, or a call the bindings
/// watch for Ctrl-C), the request is abandoned within [`CANCEL_POLL`] of the flag being raised,
/// as [`Error::Cancelled`], whatever its timeouts and retries would still allow.
fn block_on<F: std::future::Future>(future: F) -> Result<F::Output> {
    let rt = runtime()?;
    let flag = crate::cancel::current();
    let run = async move {
        let Some(flag) = flag else {
            return Ok(future.await);
        };
        let cancelled = async {
            while !crate::cancel::raised(&flag) {
                tokio::time::sleep(CANCEL_POLL).await;
            }
        };
        futures_util::pin_mut!(future, cancelled);
        match futures_util::future::select(future, cancelled).await {
            futures_util::future::Either::Left((out, _)) => Ok(out),
            futures_util::future::Either::Right(_) => Err(Error::Cancelled),
        }
    };
    let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(run)));
    done.map_err(|p| {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        config_error(format!(
            "the object storage client cannot make a request with this configuration ({})",
            redact(&what)
        ))
    })?
}

/// How often a request waiting on the store looks at its cancellation flag.
const CANCEL_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// `detail` without the query or the user-info of any URL in it (an Azure SAS token, a
/// presigned signature, `user:password@`), on one line, at most 600 characters
/// ([`crate::redact::one_line`]).
pub fn redact(detail: &str) -> String {
    crate::redact::one_line(detail)
}

/// The HTTP status an error the client gave up on reports, where its text has one: a request
/// `object_store` does not sort by status itself (a listing) still says "status code: 403".
fn status_in(text: &str) -> Option<u16> {
    let at = text.find("status code: ")? + "status code: ".len();
    text[at..].get(..3)?.parse().ok()
}

/// An `object_store` error as fastload's, sorted by who can do something about it.
fn failure(e: object_store::Error) -> Error {
    use object_store::Error as E;
    let text = match &e {
        // a credentials failure (see `credentials`) says itself what is wrong
        E::Unauthenticated { path, source } if path.is_empty() => source.to_string(),
        _ => e.to_string(),
    };
    let failure = match &e {
        E::NotFound { .. } => StoreFailure::NotFound,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => StoreFailure::Denied,
        E::Precondition { .. } | E::NotModified { .. } => StoreFailure::Changed,
        E::InvalidPath { .. } | E::UnknownConfigurationKey { .. } | E::NotSupported { .. } => {
            StoreFailure::Config
        }
        E::NotImplemented { .. } => StoreFailure::Config,
        _ if matches!(status_in(&text), Some(404)) => StoreFailure::NotFound,
        _ if matches!(status_in(&text), Some(401 | 403)) => StoreFailure::Denied,
        // a range inside the size the object had when opened: it is shorter now, another version
        _ if matches!(status_in(&text), Some(416)) => StoreFailure::Changed,
        // a configured value the client parses only when it first needs it
        E::Generic {
            store: "Config", ..
        } => {
            return config_error(
                "a store option has a value the client cannot use (check the options' values)",
            )
        }
        _ => StoreFailure::Unavailable,
    };
    Error::Store {
        failure,
        tensor: None,
        detail: redact(&text),
    }
}

fn config_error(detail: impl Into<String>) -> Error {
    Error::Store {
        failure: StoreFailure::Config,
        tensor: None,
        detail: detail.into(),
    }
}

impl Store {
    /// The store that `url` names (`s3://bucket/key`, `gs://...`, `az://container/...`,
    /// `https://host/path`), and the key of the object or prefix it addresses in it.
    ///
    /// An `http://` endpoint (`AWS_ENDPOINT_URL=http://127.0.0.1:9000`, an `http://` URL) allows
    /// plain HTTP, as the AWS SDKs do; otherwise only HTTPS is used.
    pub fn from_url(url: &str, settings: &Settings) -> Result<(Store, String)> {
        // before any client is built: reqwest has no TLS provider of its own here
        rustls_provider();
        let parsed = Url::parse(url)
            .map_err(|e| config_error(format!("'{}' is not a URL ({e})", redact(url))))?;
        let (scheme, path) = ObjectStoreScheme::parse(&parsed).map_err(|_| {
            config_error(format!(
                "'{}' is not an object storage URL (s3://, gs://, az://, http(s)://)",
                redact(url)
            ))
        })?;
        let inner = config::build(url, &parsed, scheme, settings)?;
        let base = parsed[..url::Position::BeforePath].to_string();
        // The root of the store as a URL: the given URL less the key (the bucket or container
        // stays in it, wherever the URL puts it); the scheme and host where that is not a
        // suffix (a query, percent-encoding).
        let key = path.as_ref().to_string();
        let whole = parsed.as_str().trim_end_matches('/');
        let root = match whole.strip_suffix(key.as_str()) {
            Some(rest) if !key.is_empty() => rest.trim_end_matches('/').to_string(),
            _ if key.is_empty() && parsed.query().is_none() => whole.to_string(),
            _ => base,
        };
        // The root is shown (messages, `ObjectStore.url`, the files' paths, reports) and never
        // parsed again (the client is built): kept without the URL's user-info, so nothing made
        // from it can show a password.
        let base = crate::redact::urls(&root);
        Ok((Store { inner, base }, key))
    }

    /// `scheme://bucket`: the URL of the store's root, its user-info hidden
    /// ([`crate::redact::urls`]).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The URL of `key` in this store, for messages.
    pub fn url_of(&self, key: &str) -> String {
        format!("{}/{}", self.base, key)
    }

    fn path(&self, key: &str) -> Result<StorePath> {
        StorePath::parse(key).map_err(|e| {
            config_error(format!(
                "'{}' is not an object key ({e})",
                redact(&self.url_of(key))
            ))
        })
    }

    /// Size and version of `key`, or `None` if there is no such object (a missing bucket is an
    /// error).
    pub fn head(&self, key: &str) -> Result<Option<(u64, Option<String>)>> {
        let path = self.path(key)?;
        match block_on(self.inner.head(&path))? {
            Ok(meta) => Ok(Some((meta.size, meta.e_tag))),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(failure(e)),
        }
    }

    /// The whole object `key` (a small file: an index, a config), refused unread beyond
    /// `max_bytes`.
    pub fn get(&self, key: &str, max_bytes: u64) -> Result<Vec<u8>> {
        // one request: its answer is one version, validators or not
        let object = self.open_as(key, false)?;
        if object.size() > max_bytes {
            return Err(Error::Store {
                failure: StoreFailure::Config,
                tensor: None,
                detail: format!(
                    "{} is {} bytes, more than the {max_bytes} bytes this file may have",
                    self.url_of(key),
                    object.size()
                ),
            });
        }
        let mut out = vec![0u8; object.size() as usize];
        object.read_into(&mut out, 0)?;
        Ok(out)
    }

    /// `(key, size)` of the objects directly under `prefix` (not in its sub-prefixes).
    pub fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        let trimmed = prefix.trim_end_matches('/');
        let path = if trimmed.is_empty() {
            None
        } else {
            Some(self.path(trimmed)?)
        };
        let listed = block_on(self.inner.list_with_delimiter(path.as_ref()))?.map_err(failure)?;
        Ok(listed
            .objects
            .into_iter()
            .map(|m| (m.location.as_ref().to_string(), m.size))
            .collect())
    }

    /// Fills `dst` with the bytes of `key` at `offset`: one ranged GET, no other request (the
    /// transport alone, as a floor to measure loads against).
    pub fn read_into(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        let path = self.path(key)?;
        let url = self.url_of(key);
        let mut at = 0usize;
        let end = offset.saturating_add(dst.len() as u64);
        read_range(&*self.inner, &path, &url, offset..end, None, &mut |chunk| {
            dst[at..at + chunk.len()].copy_from_slice(chunk);
            at += chunk.len();
            Ok(())
        })
    }

    /// Opens `key`: its size and version, asked once (a missing object is
    /// [`StoreFailure::NotFound`]; one without an ETag or a Last-Modified date, whose reads
    /// could not be pinned to one version, [`StoreFailure::Config`]). The object shares this
    /// store's client.
    pub fn open(&self, key: &str) -> Result<Object> {
        self.open_as(key, true)
    }

    /// [`Store::open`]; `pinned`: refused unless it has a validator (it will be read in pieces).
    fn open_as(&self, key: &str, pinned: bool) -> Result<Object> {
        let path = self.path(key)?;
        let meta = block_on(self.inner.head(&path))?.map_err(failure)?;
        let url = self.url_of(key);
        if pinned {
            ranged::check_versioned(&meta, &url)?;
        }
        Ok(Object {
            store: self.inner.clone(),
            url,
            path,
            meta,
        })
    }
}

/// Installs ring as the process's TLS provider (reqwest is built without a default one): once,
/// before the first HTTPS connection. Another library may have installed one already: then that
/// one is used.
fn rustls_provider() -> bool {
    static DONE: OnceLock<bool> = OnceLock::new();
    *DONE.get_or_init(|| {
        rustls::crypto::CryptoProvider::get_default().is_some()
            || rustls::crypto::ring::default_provider()
                .install_default()
                .is_ok()
            || rustls::crypto::CryptoProvider::get_default().is_some()
    })
}

impl Object {
    /// The object's size in bytes when opened.
    pub fn size(&self) -> u64 {
        self.meta.size
    }

    /// Its URL, for messages.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The version every read asks for: `(size, ETag, Last-Modified)` as the store answered
    /// when the object was opened (the date in RFC 3339, `None` where the store gave none).
    /// Processes that read one object together compare it, so that they pin one version.
    pub fn version(&self) -> (u64, Option<String>, Option<String>) {
        let date = ranged::has_date(&self.meta).then(|| self.meta.last_modified.to_rfc3339());
        (self.meta.size, self.meta.e_tag.clone(), date)
    }

    /// Reads `[offset, offset + len)` with one ranged GET, handing the bytes to `sink` in the
    /// order and pieces they arrive. A body cut short is resumed from the byte it reached (by
    /// `object_store`, within the retry policy); fewer or more bytes than asked for, or another
    /// version of the object, is an error. `sink` may stop the read with an error.
    pub fn read_chunks(
        &self,
        offset: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        if offset.saturating_add(len) > self.meta.size {
            return Err(Error::FileShrunk {
                expected: offset.saturating_add(len),
                actual: self.meta.size,
            });
        }
        read_range(
            &*self.store,
            &self.path,
            &self.url,
            offset..offset + len,
            Some(&self.meta),
            sink,
        )
    }

    /// Fills `dst` with the bytes at `offset`.
    pub fn read_into(&self, dst: &mut [u8], offset: u64) -> Result<()> {
        let mut at = 0usize;
        self.read_chunks(offset, dst.len() as u64, &mut |chunk| {
            dst[at..at + chunk.len()].copy_from_slice(chunk);
            at += chunk.len();
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests;
