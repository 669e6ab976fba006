//! Reads that bypass the page cache: a second descriptor of the same open file with `O_DIRECT`.
//!
//! A model a GPU now holds has no business in a low-RAM host's page cache, and a cold read that
//! goes straight from the device into the slot skips one memory copy. Direct I/O wants the file
//! offset, the length and the memory address aligned ([`super::ALIGN`]); where the filesystem
//! refuses it (tmpfs, some network filesystems answer `EINVAL`), the ring reads through the page
//! cache instead.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::MetadataExt;

use crate::error::{Error, Result};

/// A descriptor of the file behind `fd` opened with `O_DIRECT`, checked to be the same file
/// (device and inode); `None` where the platform or the filesystem refuses direct I/O.
pub fn reopen(fd: RawFd) -> Option<File> {
    #[cfg(target_os = "linux")]
    {
        let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).ok()?;
        let flags = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_DIRECT;
        // SAFETY: plain syscall on a NUL-terminated path; the fd is owned by the File below.
        let own = unsafe { libc::open(path.as_ptr(), flags) };
        if own < 0 {
            return None;
        }
        // SAFETY: `own` was just opened and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(own) };
        // SAFETY: `fd` is an open descriptor of the caller's; `ManuallyDrop` leaves it open.
        let theirs = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
        let (a, b) = (file.metadata().ok()?, theirs.metadata().ok()?);
        (a.dev() == b.dev() && a.ino() == b.ino()).then_some(file)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = fd;
        None
    }
}

/// The outcome of one direct read.
pub enum Direct {
    /// At least the bytes needed were read.
    Done,
    /// The filesystem refused direct I/O for this read (`EINVAL`): read it through the cache.
    Refused,
}

/// Reads `[offset, offset + dst.len())` of `file` into `dst` (all three aligned), accepting a
/// short read only past `need` bytes (the aligned tail beyond the end of the file). Interrupted
/// and `EAGAIN` reads are retried; a read that ends before `need` is [`Error::FileShrunk`].
pub fn read(
    file: &File,
    dst: &mut [u8],
    offset: u64,
    need: usize,
    file_len: u64,
) -> Result<Direct> {
    let mut done = 0usize;
    while done < need {
        let rest = &mut dst[done..];
        // SAFETY: `rest` is writable for its length; pread writes at most that many bytes.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                (offset + done as u64) as libc::off_t,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                Some(libc::EINVAL) if done == 0 => return Ok(Direct::Refused),
                _ => return Err(err.into()),
            }
        }
        if n == 0 {
            let actual = file
                .metadata()
                .map(|m| m.len())
                .unwrap_or(offset + done as u64);
            return Err(Error::FileShrunk {
                expected: file_len,
                actual,
            });
        }
        done += n as usize;
        // A short direct read that is not at the end of the file leaves `done` unaligned, and
        // the next direct read would be refused: finish such a read through the cache.
        if done < need && done as u64 % super::ALIGN != 0 {
            return Ok(Direct::Refused);
        }
    }
    Ok(Direct::Done)
}
