//! fastload's Rust core: strict safetensors header validation and a parallel, dtype-converting
//! copy engine that fills destination buffers owned by the caller (torch tensors, in the Python
//! package).
//!
//! One module per concern:
//! * [`dtype`]: the element types of the format.
//! * [`header`]: parsing and validating the header.
//! * [`sniff`]: naming the format of a file that is not safetensors.
//! * [`file`]: opening a file and reading its bytes (pread or mmap).
//! * [`convert`]: F32 / F16 / BF16 / F64 conversion.
//! * [`copy`]: planning and running the parallel copy.
//! * [`cancel`]: the flag that abandons blocking requests when a copy or call is cancelled.
//! * [`pool`]: thread counts and the shared worker pools.
//! * [`redact`]: secrets (a URL's query and user-info) hidden from every message.
//! * [`readahead`]: filesystem detection and parallel read-ahead of mappings (zero-copy loads).
//! * [`staged`]: the staged read pipeline of accelerator loads (a ring of slots, direct I/O).
//! * [`write`]: writing safetensors files.
//! * [`store`] (feature `store`): object storage (S3, GCS, Azure, HTTP) as a source of bytes.
//! * `bindings` (feature `python`): the `fastload._core` extension module.

pub mod cancel;
pub mod convert;
pub mod copy;
pub mod dtype;
pub mod error;
pub mod file;
pub mod header;
pub mod pool;
pub mod readahead;
pub mod redact;
pub mod sniff;
pub mod staged;
#[cfg(feature = "store")]
pub mod store;
pub mod write;

#[cfg(feature = "python")]
mod bindings;
#[cfg(test)]
mod corpus_replay;

pub use dtype::Dtype;
pub use error::{Error, ErrorKind, Result};
pub use file::{ReadMode, SafetensorsFile};
pub use header::{Header, TensorInfo};
