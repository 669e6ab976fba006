//! The ring: threads of its own read the fills in order into the caller's slots, as far ahead as
//! free slots allow, while the consumer takes each fill the moment its reads complete and gives
//! its slot back when the copy out of it is done.
//!
//! Fill `k` goes to slot `k % slots`, so it may be read once fill `k - slots` was released. The
//! consumer waits for fills in order ([`Ring::wait`]) and releases them in order
//! ([`Ring::release`]). Threads are started per ring (no shared pool: nothing to go stale across a
//! `fork()`) and joined before [`Ring::close`] returns, so no read writes a slot afterwards.

use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::direct::{self, Direct};
use super::layout::{Fill, Span};
use super::ALIGN;
use crate::copy::Progress;
use crate::error::{Error, Result};
use crate::file::SafetensorsFile;

/// How the ring reads.
#[derive(Clone, Debug)]
pub struct RingOptions {
    /// The address of each slot (`slot_bytes` writable bytes each, kept alive by the caller until
    /// [`Ring::close`] returns).
    pub slots: Vec<usize>,
    pub slot_bytes: u64,
    /// Reading threads: the reads in flight at once.
    pub threads: usize,
    /// Read ranges not in the page cache with direct I/O (where the filesystem allows it).
    pub direct: bool,
    /// Bytes of one read ([`super::CHUNK`] by default; smaller in tests).
    pub chunk: u64,
}

/// What the ring read, and how.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingStats {
    /// Bytes read with direct I/O (past the page cache).
    pub direct_bytes: u64,
    /// Bytes read through the page cache (cached already, or where direct I/O is refused).
    pub cached_bytes: u64,
}

/// One read: `need` bytes of the file at `offset` into the fill's slot at `slot_offset` (`len`,
/// `need` rounded up to the alignment, is what a direct read asks for).
struct Chunk {
    fill: usize,
    offset: u64,
    need: u64,
    len: u64,
    slot_offset: u64,
}

struct State {
    /// Fills released so far (all of `0..released`).
    released: usize,
    /// Reads still to complete per fill.
    remaining: Vec<usize>,
    /// The first failure, and the tensor it was reading.
    error: Option<(Option<String>, Error)>,
    closed: bool,
}

struct Shared {
    file: Arc<SafetensorsFile>,
    direct: Option<File>,
    direct_ok: AtomicBool,
    spans: Vec<Span>,
    fills: Vec<Fill>,
    chunks: Vec<Chunk>,
    slots: Vec<usize>,
    next: AtomicUsize,
    state: Mutex<State>,
    cv: Condvar,
    progress: Option<Arc<Progress>>,
    direct_bytes: AtomicU64,
    cached_bytes: AtomicU64,
    /// Raised by [`Ring::close`]: a read blocked on object storage is abandoned at once.
    cancel: crate::cancel::Flag,
}

/// A running staged read of one file (see the module docs).
pub struct Ring {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tensor whose bytes chunk `c` was reading (for the error message).
    fn tensor_of(&self, c: &Chunk) -> Option<String> {
        let end = c.offset + c.need;
        self.fills[c.fill].pieces.iter().find_map(|p| {
            let s = &self.spans[p.span];
            let (a, b) = (s.begin + p.start, s.begin + p.stop);
            (a < end && b > c.offset).then(|| s.name.clone())
        })
    }

    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(c) = self.chunks.get(i) else { return };
            {
                let mut st = self.lock();
                while !st.closed && st.error.is_none() && c.fill >= st.released + self.slots.len() {
                    st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                if st.closed || st.error.is_some() {
                    return;
                }
            }
            let result = if self.progress.as_ref().is_some_and(|p| p.is_cancelled()) {
                Err(Error::Cancelled)
            } else {
                self.read(c)
            };
            let mut st = self.lock();
            match result {
                Ok(()) => {
                    st.remaining[c.fill] -= 1;
                    if st.remaining[c.fill] == 0 {
                        self.cv.notify_all();
                    }
                }
                Err(e) => {
                    if st.error.is_none() {
                        st.error = Some((self.tensor_of(c), e));
                    }
                    self.cv.notify_all();
                    return;
                }
            }
        }
    }

    fn read(&self, c: &Chunk) -> Result<()> {
        let base = self.slots[c.fill % self.slots.len()] + c.slot_offset as usize;
        // SAFETY: the layout keeps every fill inside its slot (`len` included: fills start aligned
        // and slots are a multiple of the alignment); chunks write disjoint ranges; the fill's
        // slot is not handed to the consumer before its reads complete, nor read into again
        // before the consumer releases it; the caller keeps the slots alive until `close`.
        let dst = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, c.len as usize) };
        let need = c.need as usize;
        if let Some(fd) = &self.direct {
            let aligned = base % ALIGN as usize == 0 && c.offset % ALIGN == 0;
            if aligned
                && self.direct_ok.load(Ordering::Relaxed)
                && self.file.mostly_uncached((c.offset, c.need))
            {
                match direct::read(fd, dst, c.offset, need, self.file.len())? {
                    Direct::Done => {
                        self.direct_bytes.fetch_add(c.need, Ordering::Relaxed);
                        return Ok(());
                    }
                    // Refused once, refused for good: the rest goes through the cache.
                    Direct::Refused => self.direct_ok.store(false, Ordering::Relaxed),
                }
            }
        }
        self.file.read_at(&mut dst[..need], c.offset)?;
        self.cached_bytes.fetch_add(c.need, Ordering::Relaxed);
        Ok(())
    }
}

impl Ring {
    /// Starts reading `fills` (from [`super::layout`] of `spans`) of `file` into the slots of
    /// `opts`. Refuses a fill larger than a slot, a ring of no slot and a thread count of 0.
    pub fn start(
        file: Arc<SafetensorsFile>,
        spans: Vec<Span>,
        fills: Vec<Fill>,
        opts: RingOptions,
        progress: Option<Arc<Progress>>,
    ) -> Result<Ring> {
        let refuse = |detail: String| Error::InvalidStaging {
            tensor: None,
            detail,
        };
        if opts.slots.is_empty() || opts.threads == 0 || opts.chunk == 0 {
            return Err(refuse(format!(
                "a ring needs slots, threads and a read size (got {} slots, {} threads, \
                 reads of {} bytes)",
                opts.slots.len(),
                opts.threads,
                opts.chunk
            )));
        }
        // Direct reads need aligned reads: a read size and slots that keep every read aligned.
        let direct = opts.direct
            && opts.chunk % ALIGN == 0
            && opts.slot_bytes % ALIGN == 0
            && opts.slots.iter().all(|s| s % ALIGN as usize == 0);
        let mut chunks = Vec::new();
        for (k, f) in fills.iter().enumerate() {
            if f.len() > opts.slot_bytes || f.pieces.iter().any(|p| p.span >= spans.len()) {
                return Err(refuse(format!(
                    "fill {k} of {} bytes does not fit a slot of {} bytes",
                    f.len(),
                    opts.slot_bytes
                )));
            }
            let mut at = f.offset;
            while at < f.end {
                let need = opts.chunk.min(f.end - at);
                let len = if direct {
                    need.div_ceil(ALIGN) * ALIGN
                } else {
                    need
                };
                chunks.push(Chunk {
                    fill: k,
                    offset: at,
                    need,
                    len,
                    slot_offset: at - f.offset,
                });
                at += need;
            }
        }
        let mut remaining = vec![0usize; fills.len()];
        for c in &chunks {
            remaining[c.fill] += 1;
        }
        let direct = if direct {
            file.raw_fd().and_then(direct::reopen)
        } else {
            None
        };
        let threads = opts.threads.min(chunks.len().max(1));
        let shared = Arc::new(Shared {
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            file,
            spans,
            fills,
            chunks,
            slots: opts.slots,
            next: AtomicUsize::new(0),
            state: Mutex::new(State {
                released: 0,
                remaining,
                error: None,
                closed: false,
            }),
            cv: Condvar::new(),
            progress,
            direct_bytes: AtomicU64::new(0),
            cached_bytes: AtomicU64::new(0),
            cancel: crate::cancel::Flag::default(),
        });
        let mut ring = Ring {
            shared,
            workers: Vec::with_capacity(threads),
        };
        for i in 0..threads {
            let shared = ring.shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("fastload-stage-{i}"))
                .spawn(move || {
                    crate::cancel::scoped(Some(&shared.cancel.clone()), || shared.work())
                });
            match spawned {
                Ok(h) => ring.workers.push(h),
                Err(e) => {
                    ring.close();
                    return Err(Error::Io {
                        detail: format!("cannot start {threads} reading threads: {e}"),
                        source: None,
                    });
                }
            }
        }
        Ok(ring)
    }

    /// The fills, in the order they are read.
    pub fn fills(&self) -> &[Fill] {
        &self.shared.fills
    }

    /// The names of the spans read, in the order given.
    pub fn span_names(&self) -> Vec<&str> {
        self.shared.spans.iter().map(|s| s.name.as_str()).collect()
    }

    /// The number of slots.
    pub fn slots(&self) -> usize {
        self.shared.slots.len()
    }

    /// Waits up to `timeout` for fill `k` to be read: `Ok(Some(slot))` once it is, `Ok(None)` if
    /// the time ran out first. A read that failed (any fill's) is the error, with the tensor it
    /// was reading; a closed ring is [`Error::Cancelled`].
    pub fn wait(
        &self,
        k: usize,
        timeout: Duration,
    ) -> std::result::Result<Option<usize>, (Option<String>, Error)> {
        let sh = &self.shared;
        if k >= sh.fills.len() {
            return Err((
                None,
                Error::InvalidStaging {
                    tensor: None,
                    detail: format!("no fill {k}: the ring has {}", sh.fills.len()),
                },
            ));
        }
        let mut st = sh.lock();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some((tensor, e)) = &st.error {
                return Err((tensor.clone(), e.clone()));
            }
            if st.closed {
                return Err((None, Error::Cancelled));
            }
            if st.remaining[k] == 0 {
                return Ok(Some(k % sh.slots.len()));
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            st = sh
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Gives fill `k`'s slot back for the fill `slots` ahead; fills are released in order.
    pub fn release(&self, k: usize) -> Result<()> {
        let sh = &self.shared;
        let mut st = sh.lock();
        if k != st.released || k >= sh.fills.len() || st.remaining[k] != 0 {
            return Err(Error::InvalidStaging {
                tensor: None,
                detail: format!(
                    "fill {k} released out of order (next to release: {}, of {})",
                    st.released,
                    sh.fills.len()
                ),
            });
        }
        st.released += 1;
        sh.cv.notify_all();
        Ok(())
    }

    /// Bytes read so far, by path.
    pub fn stats(&self) -> RingStats {
        RingStats {
            direct_bytes: self.shared.direct_bytes.load(Ordering::Relaxed),
            cached_bytes: self.shared.cached_bytes.load(Ordering::Relaxed),
        }
    }

    /// Stops the reads (those under way finish) and joins the threads: once this returns, no
    /// slot is written again. Idempotent.
    pub fn close(&mut self) {
        crate::cancel::raise(&self.shared.cancel);
        self.shared.lock().closed = true;
        self.shared.cv.notify_all();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }

    /// Joins the threads after every fill was released, then checks that the file was not
    /// rewritten meanwhile (bytes of two versions in one load).
    pub fn finish(&mut self) -> Result<()> {
        self.close();
        self.shared.file.check_unchanged()
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.close();
    }
}
