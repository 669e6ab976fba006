//! The worker threads of the engine: thread counts a caller may ask for, and the rayon pools that
//! copies (`copy`), read-ahead (`readahead`) and writes (`write`) run on, built once per size and
//! shared; built again in a child process after a fork (see [`pool`]).
//!
//! A leaf: it knows threads, not files, so every module that runs work in parallel can use it
//! without the others.

use std::sync::{Arc, Mutex};

use rayon::ThreadPool;

use crate::error::{Error, Result};

/// Most copy (and write) threads one call may ask for: more only adds scheduling and memory, and an
/// unbounded count let a caller start thousands of OS threads.
pub const MAX_THREADS: usize = 256;

/// Threads that issue read-ahead: I/O-bound (they sleep in the disk queue), so more than the
/// cores; eight keeps a local NVMe or virtio disk's queue full. Copies of a file mostly not in the
/// page cache use at least this many too (see `copy::execute`).
pub const READAHEAD_THREADS: usize = 8;

/// Threads that copy from object storage by default: each waits on one ranged GET at a time, so
/// the count is the number of requests in flight (object stores serve many parallel requests;
/// each is at most [`crate::copy::CHUNK`] bytes).
pub const REMOTE_THREADS: usize = 16;

/// Thread pools kept alive for reuse, least recently used dropped first: a process that asks for
/// many different counts keeps a bounded number of threads.
const CACHED_POOLS: usize = 4;

/// The default thread count: the CPUs this process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Checks a caller's thread count: `None` is [`default_threads`], otherwise 1..=[`MAX_THREADS`].
pub fn check_threads(threads: Option<usize>) -> Result<usize> {
    match threads {
        None => Ok(default_threads().min(MAX_THREADS)),
        Some(n) if (1..=MAX_THREADS).contains(&n) => Ok(n),
        Some(n) => Err(Error::InvalidThreads {
            threads: n as u64,
            max: MAX_THREADS,
        }),
    }
}

/// A pool and its thread count.
type SizedPool = (usize, Arc<ThreadPool>);

/// The cached pools and the process that built them.
struct Pools {
    pid: u32,
    sized: Vec<SizedPool>,
}

/// A pool with `threads` workers (1..=[`MAX_THREADS`]), built once per size and reused; at most
/// [`CACHED_POOLS`] sizes are kept (a dropped pool's threads exit once its last user is done).
///
/// After `fork()` the child has none of the parent's threads: a pool the parent built would take
/// work and never run it (a load in a `multiprocessing` or DataLoader worker, a pre-fork server,
/// hung for ever). The cache remembers the process that built it, and a child starts a new one.
pub fn pool(threads: usize) -> Result<Arc<ThreadPool>> {
    static POOLS: Mutex<Pools> = Mutex::new(Pools {
        pid: 0,
        sized: Vec::new(),
    });
    let threads = check_threads(Some(threads))?;
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if pools.pid != pid {
        // The parent's pools (none before the first use): their threads do not exist here, and
        // dropping them would signal threads that are gone; they are leaked, once per fork.
        std::mem::forget(std::mem::take(&mut pools.sized));
        pools.pid = pid;
    }
    if let Some(i) = pools.sized.iter().position(|(n, _)| *n == threads) {
        // Most recently used last.
        let entry = pools.sized.remove(i);
        let p = entry.1.clone();
        pools.sized.push(entry);
        return Ok(p);
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("fastload-copy-{i}"))
        .build()
        .map_err(|e| Error::Io {
            detail: format!("cannot start {threads} copy threads: {e}"),
            source: None,
        })?;
    let p = Arc::new(p);
    if pools.sized.len() >= CACHED_POOLS {
        pools.sized.remove(0);
    }
    pools.sized.push((threads, p.clone()));
    Ok(p)
}
