//! Running a planned copy: the tasks on a pool, each piece read (pread or from the mapping) and
//! converted into its destination.

use super::planner::{plan, Piece, Plan};
use super::{Progress, Request};
use crate::convert::convert;
use crate::error::{Error, Result};
use crate::file::{ReadMode, SafetensorsFile};
use crate::pool::{check_threads, pool, READAHEAD_THREADS, REMOTE_THREADS};

/// Bytes of the per-thread bounce buffer of the pread conversion path: small enough to stay in
/// the core's cache between the read and the conversion (a whole 8 MiB task did not, ~2x slower).
const SCRATCH_BYTES: usize = 256 << 10;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn run_piece(file: &SafetensorsFile, p: &Piece) -> Result<()> {
    if p.dst_len == 0 {
        return Ok(());
    }
    // SAFETY: `plan` checked that [dst, dst + dst_len) lies inside the caller's buffer; tasks write
    // disjoint ranges; the caller keeps the buffer alive and unaliased during `execute`.
    let dst = unsafe { std::slice::from_raw_parts_mut(p.dst.0, p.dst_len) };
    prefault(dst);
    if p.from == p.to {
        return file.read_at(dst, p.src);
    }
    let len = p.src_len as usize;
    if let Some(src) = file.mapped(p.src, len) {
        convert(src, p.from, dst, p.to);
        return Ok(());
    }
    // pread path: bounce through a small per-thread buffer that stays in cache, block by block.
    let (si, di) = (p.from.itemsize().unwrap_or(1), p.to.itemsize().unwrap_or(1));
    let block = (SCRATCH_BYTES / si).max(1);
    SCRATCH.with(|s| {
        let mut buf = s.borrow_mut();
        if buf.len() < block * si {
            buf.resize(block * si, 0);
        }
        let n = len / si;
        let mut done = 0;
        while done < n {
            let k = block.min(n - done);
            let src = &mut buf[..k * si];
            file.read_at(src, p.src + (done * si) as u64)?;
            convert(src, p.from, &mut dst[done * di..(done + k) * di], p.to);
            done += k;
        }
        Ok(())
    })
}

/// Faults in the whole pages of a fresh destination with one `madvise(MADV_POPULATE_WRITE)`
/// (Linux 5.14+) instead of one page fault per 4 KiB during the copy: on a warm page cache, faulting
/// fresh memory is most of a load's time, and batching it cut a 1 GiB load by ~20% here. A hint:
/// older kernels answer EINVAL and the copy faults the pages as before. A destination already in
/// memory (a reload writes into the model's tensors) is left alone: walking its pages again cost
/// 45-80 ms per GiB here, a third of a warm 1 GiB reload.
fn prefault(dst: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (dst.as_mut_ptr() as usize).div_ceil(PAGE) * PAGE;
        let end = (dst.as_mut_ptr() as usize + dst.len()) / PAGE * PAGE;
        if end > start && !resident(end - PAGE) {
            // SAFETY: the range lies inside a destination this call may write; populating pages
            // never changes their contents.
            unsafe {
                libc::madvise(
                    start as *mut libc::c_void,
                    end - start,
                    libc::MADV_POPULATE_WRITE,
                )
            };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = dst;
}

/// Whether the page at `page` (aligned) is in memory. The last page of a destination is asked: a
/// fresh allocation's first page may hold the allocator's header, its last is untouched.
#[cfg(target_os = "linux")]
fn resident(page: usize) -> bool {
    let mut vec = [0u8; 1];
    // SAFETY: `page` is page-aligned and inside a mapping the caller may write; mincore only
    // reports on it, into the one byte given for one page.
    let rc = unsafe { libc::mincore(page as *mut libc::c_void, 4096, vec.as_mut_ptr()) };
    rc == 0 && vec[0] & 1 == 1
}

/// Runs a plan with `threads` workers (`None`: [`default_threads`](crate::pool::default_threads), at least [`READAHEAD_THREADS`]
/// for a file mostly not in the page cache or positioned reads without a conversion, at least
/// [`REMOTE_THREADS`] for an object in object storage; more than [`MAX_THREADS`](crate::pool::MAX_THREADS) is
/// [`Error::InvalidThreads`]). With `progress`, bytes are counted there as pieces finish, a cancel
/// stops the copy at the next piece with [`Error::Cancelled`], and `on_task` (if any) is called
/// with the counter's value after each task (about [`CHUNK`](super::CHUNK) bytes) from the thread that ran it.
/// The file is checked unchanged before and after ([`SafetensorsFile::check_unchanged`]), so
/// bytes rewritten in place during the copy are reported, not returned torn.
///
/// # Safety
/// Every destination of the requests the plan was made from must be valid for writes of its
/// length, not read or written by anything else, and alive until this returns.
pub unsafe fn execute(
    file: &SafetensorsFile,
    plan: &Plan,
    threads: Option<usize>,
    progress: Option<&Progress>,
    on_task: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<u64> {
    // SAFETY: forwarded contract.
    unsafe { execute_many(&[(file, plan)], threads, progress, on_task) }.map_err(|(_, e)| e)
}

/// Runs the plans of several files as one copy: the tasks of every file on one pool, so the
/// shards of a checkpoint are read in parallel with each other, not one after the other (the
/// thread count as in [`execute`], from every file's needs). The first error stops the copy; it
/// comes with the index in `work` of the file it is about.
///
/// # Safety
/// As [`execute`], for every plan.
pub unsafe fn execute_many(
    work: &[(&SafetensorsFile, &Plan)],
    threads: Option<usize>,
    progress: Option<&Progress>,
    on_task: Option<&(dyn Fn(u64) + Sync)>,
) -> std::result::Result<u64, (usize, Error)> {
    let first = |e: Error| (0, e);
    let threads = (|| -> Result<usize> {
        Ok(match threads {
            // Each request from object storage waits on the network, not on a core.
            None if work.iter().any(|(f, _)| f.is_remote()) => {
                check_threads(None)?.max(REMOTE_THREADS)
            }
            // Positioned reads without a conversion, from the page cache too: each thread waits
            // in the kernel's copy, and more reads in flight than cores kept it busier (a warm
            // 1 GiB reload into the model's memory, 2 cores: 0.118 s with 2 threads, 0.104 with
            // 4, 0.102 with 8; a load into fresh memory took the same with 2 and 8). Asked first:
            // it needs no look at the page cache.
            None if work
                .iter()
                .all(|(f, p)| f.mode() == ReadMode::Pread && !p.converts()) =>
            {
                check_threads(None)?.max(READAHEAD_THREADS)
            }
            // A file mostly not in the page cache: the copy waits on the disk, which wants more
            // requests in flight than there are cores (1 GiB bf16 -> f32 on 2 cores: 1.65 s with 2
            // threads, 1.06 s with 8; cached copies are CPU-bound and 8 were ~10% slower there).
            // Asked of the bytes this plan reads (a GPU load runs one plan per staging buffer).
            None if work.iter().any(|(f, p)| f.mostly_uncached(p.src_span())) => {
                check_threads(None)?.max(READAHEAD_THREADS)
            }
            _ => check_threads(threads)?,
        })
    })()
    .map_err(first)?;
    for (index, (file, _)) in work.iter().enumerate() {
        file.check_unchanged().map_err(|e| (index, e))?;
    }
    let task = |&(index, t): &(usize, usize)| -> std::result::Result<(), (usize, Error)> {
        let (file, plan) = work[index];
        let pieces = &plan.tasks[t];
        let ran = if file.is_remote() {
            // a cancel abandons the requests in flight, not only the next ones
            crate::cancel::scoped(progress.map(Progress::flag), || {
                run_remote(file, plan, pieces, progress)
            })
        } else if let Some(progress) = progress {
            pieces.iter().try_for_each(|p| {
                if progress.is_cancelled() {
                    return Err(Error::Cancelled);
                }
                run_piece(file, p)?;
                progress.add(p.dst_len as u64);
                Ok(())
            })
        } else {
            pieces.iter().try_for_each(|p| run_piece(file, p))
        };
        ran.map_err(|e| (index, e))?;
        if let (Some(f), Some(progress)) = (on_task, progress) {
            f(progress.done());
        }
        Ok(())
    };
    let tasks: Vec<(usize, usize)> = work
        .iter()
        .enumerate()
        .flat_map(|(i, (_, plan))| (0..plan.tasks.len()).map(move |t| (i, t)))
        .collect();
    if threads == 1 || tasks.len() <= 1 {
        tasks.iter().try_for_each(task)?;
    } else {
        in_file_order(&*pool(threads).map_err(first)?, &tasks, task)?;
    }
    for (index, (file, _)) in work.iter().enumerate() {
        file.check_unchanged().map_err(|e| (index, e))?;
    }
    Ok(work.iter().map(|(_, plan)| plan.dst_bytes).sum())
}

/// Runs `task` on every item of `tasks` on every thread of `pool`, each thread taking the next
/// item not yet taken, in order: the reads in flight stay next to each other in the file, one
/// window moving through it, as a sequential reader's would (rayon's splitting instead starts
/// each thread on a region of its own, as many scattered streams as threads: the storage's
/// read-ahead, the kernel's and a virtual disk's host's, serves one stream better). The first
/// error stops the threads at their next item and is returned.
pub(super) fn in_file_order<T: Sync, E: Send>(
    pool: &rayon::ThreadPool,
    tasks: &[T],
    task: impl Fn(&T) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<(), E> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<E>> = Mutex::new(None);
    pool.broadcast(|_| loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(t) = tasks.get(i) else { break };
        if let Err(e) = task(t) {
            // no later item starts; the first error wins
            next.store(tasks.len(), Ordering::Relaxed);
            failed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
            break;
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Runs one task's pieces from object storage: each run of pieces that follow each other in the
/// file is one ranged GET, whose bytes go into the pieces' destinations as they arrive
/// (converted on the way where asked: [`Scatter`]). A failed read names its tensor.
fn run_remote(
    file: &SafetensorsFile,
    plan: &Plan,
    pieces: &[Piece],
    progress: Option<&Progress>,
) -> Result<()> {
    let mut i = 0;
    while i < pieces.len() {
        if progress.is_some_and(|p| p.is_cancelled()) {
            return Err(Error::Cancelled);
        }
        let mut j = i + 1;
        while j < pieces.len() && pieces[j - 1].src + pieces[j - 1].src_len == pieces[j].src {
            j += 1;
        }
        let run = &pieces[i..j];
        for p in run {
            // SAFETY: as in `run_piece`: inside the caller's buffer, disjoint from other tasks.
            prefault(unsafe { std::slice::from_raw_parts_mut(p.dst.0, p.dst_len) });
        }
        let start = run[0].src;
        let len: u64 = run.iter().map(|p| p.src_len).sum();
        let mut scatter = Scatter::new(run);
        let read = file.read_chunks(start, len, &mut |chunk| {
            scatter.feed(chunk);
            Ok(())
        });
        if let Err(e) = read {
            let at = run[scatter.index.min(run.len() - 1)].request;
            return Err(e.for_tensor(&plan.names[at]));
        }
        if let Some(progress) = progress {
            progress.add(run.iter().map(|p| p.dst_len as u64).sum());
        }
        i = j;
    }
    Ok(())
}

/// Writes a run of pieces from the bytes of one read, in the pieces' order, each converted to
/// its destination's dtype where it differs: an element split between two chunks of the
/// response waits in `carry` for its other part.
pub(super) struct Scatter<'a> {
    pieces: &'a [Piece],
    /// the piece being written
    index: usize,
    /// source bytes of it consumed, destination bytes of it written
    src_done: u64,
    dst_done: usize,
    carry: [u8; 8],
    carry_len: usize,
}

impl<'a> Scatter<'a> {
    pub(super) fn new(pieces: &'a [Piece]) -> Self {
        Scatter {
            pieces,
            index: 0,
            src_done: 0,
            dst_done: 0,
            carry: [0; 8],
            carry_len: 0,
        }
    }

    /// Takes the next bytes of the read (the reader checks that the read's length is the
    /// pieces' total, so every byte has a place).
    pub(super) fn feed(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() && self.index < self.pieces.len() {
            let p = self.pieces[self.index];
            let take = ((p.src_len - self.src_done) as usize).min(chunk.len());
            let (part, rest) = chunk.split_at(take);
            self.write(&p, part);
            self.src_done += take as u64;
            chunk = rest;
            if self.src_done == p.src_len {
                self.index += 1;
                self.src_done = 0;
                self.dst_done = 0;
                self.carry_len = 0;
            }
        }
    }

    fn write(&mut self, p: &Piece, mut part: &[u8]) {
        // SAFETY: as in `run_piece`.
        let dst = unsafe { std::slice::from_raw_parts_mut(p.dst.0, p.dst_len) };
        if p.from == p.to {
            dst[self.dst_done..self.dst_done + part.len()].copy_from_slice(part);
            self.dst_done += part.len();
            return;
        }
        // converting types all have an item size (the planner allows only F32/F16/BF16/F64)
        let (si, di) = (p.from.itemsize().unwrap_or(1), p.to.itemsize().unwrap_or(1));
        if self.carry_len > 0 {
            let k = (si - self.carry_len).min(part.len());
            self.carry[self.carry_len..self.carry_len + k].copy_from_slice(&part[..k]);
            self.carry_len += k;
            part = &part[k..];
            if self.carry_len < si {
                return;
            }
            let at = self.dst_done;
            convert(&self.carry[..si], p.from, &mut dst[at..at + di], p.to);
            self.dst_done += di;
            self.carry_len = 0;
        }
        let n = part.len() / si;
        if n > 0 {
            let at = self.dst_done;
            convert(&part[..n * si], p.from, &mut dst[at..at + n * di], p.to);
            self.dst_done += n * di;
        }
        let rest = &part[n * si..];
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carry_len = rest.len();
    }
}

/// Validates and copies in one call. See [`execute`] for the safety contract.
///
/// # Safety
/// As [`execute`].
pub unsafe fn copy(
    file: &SafetensorsFile,
    requests: &[Request],
    threads: Option<usize>,
) -> Result<u64> {
    let plan = plan(file, requests)?;
    // SAFETY: forwarded contract.
    unsafe { execute(file, &plan, threads, None, None) }
}
