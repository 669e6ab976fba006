//! The copy engine: fills caller-owned destination buffers from a
//! [`SafetensorsFile`](crate::file::SafetensorsFile).
//!
//! Two steps. [`plan`] checks every request against the header (name, selection, destination size,
//! dtype pair) before a byte is written, and cuts the work into tasks of about [`CHUNK`] source
//! bytes: large tensors are split across threads, small ones batched into one task. [`execute`]
//! runs the tasks on a rayon pool ([`crate::pool`]).
//!
//! * `planner`: the requests checked and cut into tasks ([`plan`], [`Plan`]).
//! * `runner`: the tasks run, converting on the way ([`execute`], [`copy`]).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::dtype::Dtype;

mod planner;
mod runner;

pub use planner::{plan, plan_for_threads, task_bytes, Plan, GETS_PER_TASK};
#[cfg(test)]
use planner::{DstPtr, Piece};
#[cfg(test)]
use runner::in_file_order;
#[cfg(test)]
use runner::Scatter;
pub use runner::{copy, execute, execute_many};

/// Source bytes per task: big enough to amortize scheduling, small enough to balance threads.
pub const CHUNK: u64 = 8 << 20;

/// The smallest task [`task_bytes`] cuts a copy into for many threads: below this the per-task
/// overhead (a pread call, a rayon steal) starts to show.
pub const MIN_TASK: u64 = 1 << 20;

/// The progress of one or more copies, shared with whoever watches them: the bytes written so far
/// (counted per piece of at most [`CHUNK`] source bytes) and a flag that stops them between
/// pieces. A cancelled copy returns [`Error::Cancelled`](crate::error::Error::Cancelled); what it wrote so far stays written.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    /// Shared with the requests a remote copy has in flight ([`crate::cancel`]).
    cancelled: crate::cancel::Flag,
}

impl Progress {
    /// A fresh counter at 0, not cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Destination bytes written so far by every copy that used this object.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Asks running copies to stop at their next piece (and later ones not to start).
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Whether [`Progress::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// The flag [`Progress::cancel`] raises, for work that blocks ([`crate::cancel::scoped`]).
    pub fn flag(&self) -> &crate::cancel::Flag {
        &self.cancelled
    }

    fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts bytes copied by something other than this engine (so one counter covers a load).
    pub fn add_external(&self, bytes: u64) {
        self.add(bytes);
    }
}

/// Which elements of a tensor a request wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// The whole tensor.
    All,
    /// Elements `[start, stop)` of the flattened tensor (staging a tensor in pieces).
    Elements { start: u64, stop: u64 },
    /// Indices `[start, stop)` along dimension `dim`, all of the others (tensor-parallel shards).
    Slice { dim: usize, start: u64, stop: u64 },
    /// Elements `o * row + [start, stop)` of the flattened tensor for each `o` in
    /// `[first, first + count)`: a block of rows of `row` elements, the same part of each (the
    /// rows of a row-wise shard that one exchanged chunk holds, as one request instead of one per
    /// row).
    Rows {
        first: u64,
        count: u64,
        row: u64,
        start: u64,
        stop: u64,
    },
}

/// A destination to fill: `len` writable bytes at `ptr`, owned by the caller.
#[derive(Clone, Debug)]
pub struct Request {
    pub name: String,
    pub ptr: *mut u8,
    pub len: usize,
    pub dtype: Dtype,
    pub selection: Selection,
}

#[cfg(test)]
mod tests;
