//! Running a planned copy: the tasks on a pool, each piece read (pread or from the mapping) and
//! converted into its destination.

use rayon::prelude::*;

use super::planner::{plan, Piece, Plan};
use super::{Progress, Request};
use crate::convert::convert;
use crate::error::{Error, Result};
use crate::file::SafetensorsFile;
use crate::pool::{check_threads, pool, READAHEAD_THREADS};

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
/// older kernels answer EINVAL and the copy faults the pages as before.
fn prefault(dst: &mut [u8]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = (dst.as_mut_ptr() as usize).div_ceil(PAGE) * PAGE;
        let end = (dst.as_mut_ptr() as usize + dst.len()) / PAGE * PAGE;
        if end > start {
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

/// Runs a plan with `threads` workers (`None`: [`default_threads`](crate::pool::default_threads), at least [`READAHEAD_THREADS`]
/// for a file mostly not in the page cache; more than [`MAX_THREADS`](crate::pool::MAX_THREADS) is
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
    let threads = match threads {
        // A file mostly not in the page cache: the copy waits on the disk, which wants more
        // requests in flight than there are cores (1 GiB bf16 -> f32 on 2 cores: 1.65 s with 2
        // threads, 1.06 s with 8; cached copies are CPU-bound and 8 were ~10% slower there).
        // Asked of the bytes this plan reads (a GPU load runs one plan per staging buffer).
        None if file.mostly_uncached(plan.src_span()) => {
            check_threads(None)?.max(READAHEAD_THREADS)
        }
        _ => check_threads(threads)?,
    };
    file.check_unchanged()?;
    let task = |pieces: &Vec<Piece>| -> Result<()> {
        let Some(progress) = progress else {
            return pieces.iter().try_for_each(|p| run_piece(file, p));
        };
        for p in pieces {
            if progress.is_cancelled() {
                return Err(Error::Cancelled);
            }
            run_piece(file, p)?;
            progress.add(p.dst_len as u64);
        }
        if let Some(f) = on_task {
            f(progress.done());
        }
        Ok(())
    };
    if threads == 1 || plan.tasks.len() <= 1 {
        plan.tasks.iter().try_for_each(task)?;
    } else {
        pool(threads)?.install(|| plan.tasks.par_iter().try_for_each(task))?;
    }
    file.check_unchanged()?;
    Ok(plan.dst_bytes)
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
