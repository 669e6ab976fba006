//! One error type for the core; each broken rule is its own variant.
//!
//! Messages name the tensor where there is one. The file name is added by the caller that knows it
//! (see [`crate::file::SafetensorsFile`] and the Python bindings), so the same validation code
//! serves in-memory buffers and files.
//!
//! An operating-system error stays whole: [`Error::Io`] and [`Error::Os`] keep the
//! [`std::io::Error`] as their [`source`](std::error::Error::source). [`Error::kind`] sorts the
//! variants by who is at fault, exhaustively, and the Python bindings raise one class per kind.

use std::fmt;
use std::sync::Arc;

/// Everything that can go wrong while reading a safetensors file or copying out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Fewer than 8 bytes: there is no header length.
    FileTooSmall { len: u64 },
    /// The declared header length is above the cap (100 MB, as in the safetensors crate).
    HeaderTooLarge { len: u64, cap: u64 },
    /// The declared header length runs past the end of the file.
    HeaderPastEof { len: u64, file_len: u64 },
    /// The header bytes are not UTF-8.
    HeaderNotUtf8 { position: usize },
    /// The header is not valid JSON.
    InvalidJson { detail: String },
    /// The header JSON is not an object.
    HeaderNotObject,
    /// A tensor entry lacks a field, has an unknown field, or a field of the wrong type.
    InvalidTensorEntry { tensor: String, detail: String },
    /// A dtype name that the format does not define.
    UnknownDtype { tensor: String, dtype: String },
    /// A shape whose element count overflows, or a packed type that does not end on a byte.
    InvalidShape { tensor: String, detail: String },
    /// `data_offsets` with begin > end.
    InvalidOffsets {
        tensor: String,
        begin: u64,
        end: u64,
    },
    /// shape × itemsize differs from the `data_offsets` span.
    SpanMismatch {
        tensor: String,
        expected: u64,
        actual: u64,
    },
    /// `data_offsets` end beyond the data section.
    OffsetsPastEof {
        tensor: String,
        end: u64,
        data_len: u64,
    },
    /// The same tensor name appears twice.
    DuplicateName { tensor: String },
    /// Two tensors share bytes.
    Overlap { tensor: String, other: String },
    /// Bytes that no tensor covers before a tensor (a hole, or data not starting at 0).
    Gap {
        tensor: String,
        expected: u64,
        begin: u64,
    },
    /// Bytes that no tensor covers at the end of the data section.
    TrailingBytes { covered: u64, data_len: u64 },
    /// `__metadata__` is not an object of string to string.
    InvalidMetadata { detail: String },
    /// A name the file does not contain.
    UnknownTensor { tensor: String },
    /// A destination of the wrong byte size.
    DestinationSize {
        tensor: String,
        expected: u64,
        actual: u64,
    },
    /// A tensor to write whose bytes do not match its shape and dtype, or whose pointer is null.
    InvalidSource { tensor: String, detail: String },
    /// A destination pointer that is null while bytes are to be written.
    NullDestination { tensor: String },
    /// A dtype conversion the engine does not do.
    UnsupportedConversion {
        tensor: String,
        from: String,
        to: String,
    },
    /// A selection (element range or slice) outside the tensor.
    InvalidSelection { tensor: String, detail: String },
    /// A staged read the ring cannot serve (a slot too small for a tensor's smallest piece).
    InvalidStaging {
        tensor: Option<String>,
        detail: String,
    },
    /// The file got shorter after its header was read.
    FileShrunk { expected: u64, actual: u64 },
    /// The file's size or modification time changed after it was opened: it was rewritten in
    /// place, and bytes read from it may mix two versions.
    FileChanged { detail: String },
    /// The path names something other than a regular file (a FIFO, a device, a directory).
    NotRegularFile { kind: String },
    /// A thread count of 0 or above the cap.
    InvalidThreads { threads: u64, max: usize },
    /// The copy was cancelled through its progress object (or by Ctrl-C).
    Cancelled,
    /// An I/O failure without an `errno`: an [`std::io::Error`] that carries none (its message is
    /// `detail`), or one of the engine's own (a mapping found truncated, a pool that could not
    /// start), with the operating-system error behind it, if any, as `source`.
    Io {
        detail: String,
        source: Option<IoError>,
    },
    /// An operating-system error with its `errno` (the bindings raise the matching `OSError`
    /// subclass, e.g. `FileNotFoundError` for `ENOENT`); the message is `source`'s.
    Os { errno: i32, source: IoError },
    /// The file is not in the safetensors format; `looks_like` says what its first bytes suggest.
    NotSafetensors { looks_like: String },
    /// A request to object storage failed: refused for good (a missing object, denied access, a
    /// configuration the store cannot use, an object replaced meanwhile), or still failing after
    /// the retries configured for transient failures. `tensor` names the tensor being read, if
    /// any; `detail` is the store's answer, with any URL query (a signature) left out.
    Store {
        failure: StoreFailure,
        tensor: Option<String>,
        detail: String,
    },
}

/// How a request to object storage failed (see [`Error::Store`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFailure {
    /// No such object, or no such bucket (HTTP 404).
    NotFound,
    /// Credentials refused or missing (HTTP 401/403).
    Denied,
    /// The store could not be reached or kept failing (connection refused or cut, timeouts,
    /// 5xx/429 answers) after the configured retries.
    Unavailable,
    /// The URL or the options cannot make a client (an unknown option, no region, a bad URL).
    Config,
    /// The object is no longer the version that was opened (HTTP 412 to `If-Match`), or it
    /// answered other bytes than asked for.
    Changed,
}

impl Error {
    /// A short, stable name of the broken rule (used in messages and by tests).
    pub fn rule(&self) -> &'static str {
        match self {
            Error::FileTooSmall { .. } => "file-too-small",
            Error::HeaderTooLarge { .. } => "header-too-large",
            Error::HeaderPastEof { .. } => "header-past-eof",
            Error::HeaderNotUtf8 { .. } => "header-not-utf8",
            Error::InvalidJson { .. } => "invalid-json",
            Error::HeaderNotObject => "header-not-object",
            Error::InvalidTensorEntry { .. } => "invalid-tensor-entry",
            Error::UnknownDtype { .. } => "unknown-dtype",
            Error::InvalidShape { .. } => "invalid-shape",
            Error::InvalidOffsets { .. } => "invalid-offsets",
            Error::SpanMismatch { .. } => "span-mismatch",
            Error::OffsetsPastEof { .. } => "offsets-past-eof",
            Error::DuplicateName { .. } => "duplicate-name",
            Error::Overlap { .. } => "overlap",
            Error::Gap { .. } => "gap",
            Error::TrailingBytes { .. } => "trailing-bytes",
            Error::InvalidMetadata { .. } => "invalid-metadata",
            Error::UnknownTensor { .. } => "unknown-tensor",
            Error::DestinationSize { .. } => "destination-size",
            Error::NullDestination { .. } => "null-destination",
            Error::InvalidSource { .. } => "invalid-source",
            Error::UnsupportedConversion { .. } => "unsupported-conversion",
            Error::InvalidSelection { .. } => "invalid-selection",
            Error::InvalidStaging { .. } => "invalid-staging",
            Error::FileShrunk { .. } => "file-shrunk",
            Error::FileChanged { .. } => "file-changed",
            Error::NotRegularFile { .. } => "not-regular-file",
            Error::InvalidThreads { .. } => "invalid-threads",
            Error::Cancelled => "cancelled",
            Error::Io { .. } | Error::Os { .. } => "io",
            Error::NotSafetensors { .. } => "not-safetensors",
            Error::Store { failure, .. } => match failure {
                StoreFailure::NotFound => "store-not-found",
                StoreFailure::Denied => "store-denied",
                StoreFailure::Unavailable => "store-unavailable",
                StoreFailure::Config => "store-config",
                StoreFailure::Changed => "object-changed",
            },
        }
    }

    /// Who is at fault. Exhaustive on purpose: a new variant does not compile until it is given
    /// its kind here (and so, in the bindings, its Python class).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::FileTooSmall { .. }
            | Error::HeaderTooLarge { .. }
            | Error::HeaderPastEof { .. }
            | Error::HeaderNotUtf8 { .. }
            | Error::InvalidJson { .. }
            | Error::HeaderNotObject
            | Error::InvalidTensorEntry { .. }
            | Error::UnknownDtype { .. }
            | Error::InvalidShape { .. }
            | Error::InvalidOffsets { .. }
            | Error::SpanMismatch { .. }
            | Error::OffsetsPastEof { .. }
            | Error::DuplicateName { .. }
            | Error::Overlap { .. }
            | Error::Gap { .. }
            | Error::TrailingBytes { .. }
            | Error::InvalidMetadata { .. }
            | Error::FileShrunk { .. }
            | Error::FileChanged { .. }
            | Error::NotRegularFile { .. }
            | Error::NotSafetensors { .. }
            | Error::Store {
                failure: StoreFailure::Changed,
                ..
            } => ErrorKind::File,
            Error::UnknownTensor { .. } => ErrorKind::MissingTensor,
            Error::UnsupportedConversion { .. } => ErrorKind::Unsupported,
            Error::DestinationSize { .. }
            | Error::NullDestination { .. }
            | Error::InvalidSource { .. }
            | Error::InvalidSelection { .. }
            | Error::InvalidStaging { .. }
            | Error::InvalidThreads { .. }
            | Error::Store {
                failure: StoreFailure::Config,
                ..
            } => ErrorKind::Request,
            Error::Cancelled => ErrorKind::Cancelled,
            Error::Io { .. } => ErrorKind::Io,
            Error::Os { errno, .. } => ErrorKind::Os { errno: *errno },
            Error::Store { failure, .. } => match failure {
                StoreFailure::NotFound => ErrorKind::Store {
                    errno: Some(libc::ENOENT),
                },
                StoreFailure::Denied => ErrorKind::Store {
                    errno: Some(libc::EACCES),
                },
                StoreFailure::Unavailable => ErrorKind::Store { errno: None },
                StoreFailure::Config => ErrorKind::Request,
                StoreFailure::Changed => ErrorKind::File,
            },
        }
    }

    /// This error, naming `tensor` if it is an [`Error::Store`] that names none yet: a failed
    /// ranged read is reported with the tensor it was for.
    pub fn for_tensor(self, tensor: &str) -> Self {
        match self {
            Error::Store {
                failure,
                tensor: None,
                detail,
            } => Error::Store {
                failure,
                tensor: Some(tensor.to_string()),
                detail,
            },
            other => other,
        }
    }

    /// Whether the error is about the file's content (as opposed to the caller's request or the
    /// operating system). The bindings raise content errors as `CheckpointError`.
    pub fn is_file_error(&self) -> bool {
        self.kind() == ErrorKind::File
    }
}

/// Who is at fault in an [`Error`], which decides how it is reported: the Python bindings raise
/// one `fastload.core.basics.errors` class per kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The file's content breaks a rule of the format, is not safetensors at all, or changed on
    /// disk while it was read (`CheckpointError`).
    File,
    /// A tensor name the file does not contain (`TensorNotFoundError`).
    MissingTensor,
    /// A dtype conversion the engine does not do (`UnsupportedError`).
    Unsupported,
    /// The caller's request is inconsistent: a destination of the wrong size or null, a selection
    /// outside the tensor, a tensor to write that does not match its shape, a thread count out of
    /// range (`RequestError`).
    Request,
    /// The copy was cancelled (`LoadCancelledError`).
    Cancelled,
    /// An I/O failure without an `errno` (`FastloadIOError`).
    Io,
    /// An operating-system error with its `errno` (the `FastloadIOError` subclass of the errno).
    Os { errno: i32 },
    /// Object storage failed: `errno` says which `FastloadIOError` subclass fits (`ENOENT`: a
    /// missing object or bucket, `EACCES`: denied), none for an unreachable or failing store.
    Store { errno: Option<i32> },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] ", self.rule())?;
        match self {
            Error::FileTooSmall { len } => {
                write!(f, "file is {len} bytes; a safetensors file starts with an 8-byte header length")
            }
            Error::HeaderTooLarge { len, cap } => {
                write!(f, "header length {len} exceeds the {cap}-byte limit")
            }
            Error::HeaderPastEof { len, file_len } => write!(
                f,
                "header length {len} runs past the end of the {file_len}-byte file (truncated or not safetensors)"
            ),
            Error::HeaderNotUtf8 { position } => {
                write!(f, "header is not valid UTF-8 (at byte {position} of the header)")
            }
            Error::InvalidJson { detail } => write!(f, "header is not valid JSON: {detail}"),
            Error::HeaderNotObject => write!(f, "header JSON must be an object of tensor entries"),
            Error::InvalidTensorEntry { tensor, detail } => {
                write!(f, "tensor '{tensor}': invalid entry: {detail}")
            }
            Error::UnknownDtype { tensor, dtype } => {
                write!(f, "tensor '{tensor}': unknown dtype '{dtype}'")
            }
            Error::InvalidShape { tensor, detail } => {
                write!(f, "tensor '{tensor}': invalid shape: {detail}")
            }
            Error::InvalidOffsets { tensor, begin, end } => write!(
                f,
                "tensor '{tensor}': data_offsets [{begin}, {end}] have begin > end"
            ),
            Error::SpanMismatch { tensor, expected, actual } => write!(
                f,
                "tensor '{tensor}': shape and dtype need {expected} bytes but data_offsets span {actual}"
            ),
            Error::OffsetsPastEof { tensor, end, data_len } => write!(
                f,
                "tensor '{tensor}': data ends at byte {end} but the data section has {data_len} bytes (truncated file?)"
            ),
            Error::DuplicateName { tensor } => write!(f, "tensor '{tensor}' is listed twice"),
            Error::Overlap { tensor, other } => {
                write!(f, "tensor '{tensor}' overlaps tensor '{other}'")
            }
            Error::Gap { tensor, expected, begin } => write!(
                f,
                "tensor '{tensor}': data begins at byte {begin}, expected {expected} (a hole in the data section)"
            ),
            Error::TrailingBytes { covered, data_len } => write!(
                f,
                "tensors cover {covered} bytes but the data section has {data_len} (trailing bytes)"
            ),
            Error::InvalidMetadata { detail } => write!(f, "__metadata__: {detail}"),
            Error::UnknownTensor { tensor } => write!(f, "no tensor named '{tensor}' in the file"),
            Error::DestinationSize { tensor, expected, actual } => write!(
                f,
                "tensor '{tensor}': destination has {actual} bytes, expected {expected}"
            ),
            Error::InvalidSource { tensor, detail } => {
                write!(f, "tensor '{tensor}': cannot write it: {detail}")
            }
            Error::NullDestination { tensor } => {
                write!(f, "tensor '{tensor}': destination pointer is null")
            }
            Error::UnsupportedConversion { tensor, from, to } => write!(
                f,
                "tensor '{tensor}': cannot convert {from} to {to} (conversion supports F32, F16, BF16, F64)"
            ),
            Error::InvalidSelection { tensor, detail } => {
                write!(f, "tensor '{tensor}': invalid selection: {detail}")
            }
            Error::InvalidStaging { tensor, detail } => {
                if let Some(tensor) = tensor {
                    write!(f, "tensor '{tensor}': ")?;
                }
                write!(f, "{detail}")
            }
            Error::FileShrunk { expected, actual } => write!(
                f,
                "file changed on disk while loading: expected {expected} bytes, found {actual}"
            ),
            Error::FileChanged { detail } => write!(
                f,
                "file was rewritten in place while loading ({detail}); the bytes read may mix two versions"
            ),
            Error::NotRegularFile { kind } => write!(
                f,
                "not a regular file ({kind}); a checkpoint must be a regular file"
            ),
            Error::InvalidThreads { threads, max } => {
                write!(f, "threads must be between 1 and {max}, got {threads}")
            }
            Error::Cancelled => write!(f, "the copy was cancelled before it finished"),
            Error::Io { detail, .. } => write!(f, "I/O error: {detail}"),
            Error::Os { source, .. } => write!(f, "I/O error: {source}"),
            Error::NotSafetensors { looks_like } => {
                write!(f, "not a safetensors file: it looks like {looks_like}")
            }
            Error::Store {
                failure,
                tensor,
                detail,
            } => {
                if let Some(tensor) = tensor {
                    write!(f, "tensor '{tensor}': ")?;
                }
                let what = match failure {
                    StoreFailure::NotFound => "no such object or bucket",
                    StoreFailure::Denied => "access denied",
                    StoreFailure::Unavailable => "request failed",
                    StoreFailure::Config => "cannot use this store configuration",
                    StoreFailure::Changed => "the object changed while loading",
                };
                write!(f, "{what}: {detail}")
            }
        }
    }
}

impl std::error::Error for Error {
    /// The [`std::io::Error`] behind an [`Error::Os`], or behind an [`Error::Io`] that has one.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Os { source, .. }
            | Error::Io {
                source: Some(source),
                ..
            } => Some(source.get()),
            _ => None,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        match e.raw_os_error() {
            Some(errno) => Error::Os {
                errno,
                source: e.into(),
            },
            None => Error::Io {
                detail: e.to_string(),
                source: Some(e.into()),
            },
        }
    }
}

/// An [`std::io::Error`] kept whole inside an [`Error`]. Shared, so that errors stay `Clone` (a
/// header keeps its strict-reading error, the bindings hand errors between threads); compared by
/// what it says (kind, `errno`, message), since `std::io::Error` has no equality.
#[derive(Clone, Debug)]
pub struct IoError(Arc<std::io::Error>);

impl IoError {
    /// The error itself.
    pub fn get(&self) -> &std::io::Error {
        &self.0
    }
}

impl From<std::io::Error> for IoError {
    fn from(e: std::io::Error) -> Self {
        IoError(Arc::new(e))
    }
}

impl PartialEq for IoError {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.get(), other.get());
        Arc::ptr_eq(&self.0, &other.0)
            || (a.kind() == b.kind()
                && a.raw_os_error() == b.raw_os_error()
                && a.to_string() == b.to_string())
    }
}

impl Eq for IoError {}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Result alias of the core.
pub type Result<T> = std::result::Result<T, Error>;
