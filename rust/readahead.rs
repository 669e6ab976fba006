//! What the zero-copy path needs from the operating system: which filesystem a file lives on
//! (views of a mapping are only the default on local ones) and a parallel read-ahead that fills a
//! mapping's pages at the disk's bandwidth when they are not in the page cache yet.

use std::fs::File;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::pool::{pool, READAHEAD_THREADS};

/// The filesystem a file lives on, from `fstatfs(2)`'s `f_type`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filesystem {
    /// A short name ("ext4", "nfs", "fuse", ...) or the magic number in hex when unknown.
    pub name: String,
    /// False for network, cluster and FUSE filesystems, where page faults on a mapping are slow
    /// (one round trip per fault) and an unreachable server or a file changed on another host
    /// turns a memory access into SIGBUS.
    pub local: bool,
}

/// `(f_type, name, local)` of the filesystems fastload names. Anything else counts as local: the
/// remote kinds are listed exhaustively (from linux/magic.h and the vendors' headers), and an
/// unknown local filesystem wrongly copied would only cost speed, not correctness.
const KNOWN: &[(u64, &str, bool)] = &[
    (0xEF53, "ext4", true),
    (0x5846_5342, "xfs", true),
    (0x9123_683E, "btrfs", true),
    (0x2FC1_2FC1, "zfs", true),
    (0x0102_1994, "tmpfs", true),
    (0x8584_58F6, "ramfs", true),
    (0x794C_7630, "overlayfs", true),
    (0x7371_7368, "squashfs", true),
    (0xF2F5_2010, "f2fs", true),
    (0x4D44, "vfat", true),
    (0x2011_BAB0, "exfat", true),
    (0x6969, "nfs", false),
    (0x517B, "smb", false),
    (0xFF53_4D42, "cifs", false),
    (0xFE53_4D42, "smb2", false),
    (0x6573_5546, "fuse", false),
    (0x0BD0_0BD0, "lustre", false),
    (0x0102_1997, "9p", false),
    (0x00C3_6400, "ceph", false),
    (0x4750_4653, "gpfs", false),
    (0x5346_414F, "afs", false),
    (0x6B41_4653, "afs", false),
    (0x7375_7245, "coda", false),
    (0x0116_1970, "gfs2", false),
    (0x1983_0326, "beegfs", false),
    (0x2003_0528, "orangefs", false),
    (0xAAD7_AAEA, "panfs", false),
    (0x0BAD_1DEA, "wekafs", false),
];

/// Names the filesystem of an open file.
pub fn filesystem_of(file: &File) -> Result<Filesystem> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: fstatfs writes a whole statfs into `st` when it returns 0.
        if unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: initialized by the successful call above.
        let magic = unsafe { st.assume_init() }.f_type as u64 & 0xFFFF_FFFF;
        Ok(match KNOWN.iter().find(|k| k.0 == magic) {
            Some(&(_, name, local)) => Filesystem {
                name: name.into(),
                local,
            },
            None => Filesystem {
                name: format!("{magic:#x}"),
                local: true,
            },
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        Ok(Filesystem {
            name: "unknown".into(),
            local: true,
        })
    }
}

/// Bytes per read-ahead task: large enough for deep sequential I/O, small enough to spread a
/// file over the threads and to skip the parts that are already cached.
pub const READAHEAD_CHUNK: usize = 32 << 20;

/// Bytes one `MADV_POPULATE_READ` call maps (see [`populate`]).
const POPULATE_STEP: usize = 4 << 20;

/// The sum of `work` over `pieces`, on `threads` read-ahead threads (default
/// [`READAHEAD_THREADS`]); in the calling thread when one thread or one piece is enough.
#[cfg(target_os = "linux")]
fn on_threads<T: Sync>(
    pieces: &[T],
    threads: Option<usize>,
    work: impl Fn(&T) -> Result<u64> + Sync + Send,
) -> Result<u64> {
    let threads = threads.unwrap_or(READAHEAD_THREADS).max(1);
    if threads == 1 || pieces.len() <= 1 {
        return pieces.iter().map(work).sum();
    }
    pool(threads)?.install(|| pieces.par_iter().map(work).sum())
}

/// Faults in the pages of `[addr, addr + len)`, a mapping of `file` whose byte `offset` is at
/// `addr`, that are not in the page cache yet, with parallel `madvise(MADV_POPULATE_READ)` over
/// [`READAHEAD_CHUNK`] pieces, each first read into the page cache by [`read_through`]; returns
/// the bytes of the pieces it populated. Cached pieces are left alone unless `cached` (faulting
/// them later costs no I/O, and a single first access maps them about as fast as populating
/// would; a load maps them too when a helper thread can do it while the skeleton is built), and
/// then read through only with `cold` (the caller found the range mostly not cached; asking per
/// piece would cost a page-cache walk each). Which pieces are cached comes from `cachestat(2)` on
/// `file` (Linux 6.5+, a fraction of a millisecond per GiB), else from `mincore(2)` on the
/// mapping (~50 ms per GiB).
///
/// Never dereferences the range: a range that is not mapped is an error from the kernel, not a
/// crash. Kernels without `MADV_POPULATE_READ` (before 5.14) skip the read-ahead and return 0.
/// A file truncated under the mapping is [`Error::FileShrunk`]-like: the kernel answers EFAULT.
pub fn populate(
    file: Option<&File>,
    addr: usize,
    offset: u64,
    len: usize,
    threads: Option<usize>,
    cached: bool,
    cold: bool,
) -> Result<u64> {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = addr / PAGE * PAGE;
        let end = addr.checked_add(len).ok_or_else(|| Error::Io {
            detail: "read-ahead range overflows the address space".into(),
            source: None,
        })?;
        let end = end.div_ceil(PAGE) * PAGE;
        // The file offset of address s: the mapping is linear from (addr, offset).
        let at = |s: usize| (s as u64).wrapping_sub(addr as u64).wrapping_add(offset);
        // (address, length, known not cached)
        let pieces: Vec<(usize, usize, bool)> = (start..end)
            .step_by(READAHEAD_CHUNK)
            .map(|s| (s, READAHEAD_CHUNK.min(end - s)))
            .filter_map(|(s, l)| {
                if cached {
                    return Some((s, l, false));
                }
                let cached = match file.and_then(|f| cached_pages(f, at(s), l as u64)) {
                    Some(pages) => pages >= (l as u64).div_ceil(PAGE as u64),
                    None => resident(s, l).unwrap_or(false),
                };
                (!cached).then_some((s, l, true))
            })
            .collect();
        if pieces.is_empty() {
            return Ok(0);
        }
        let work = |&(s, l, uncached): &(usize, usize, bool)| -> Result<u64> {
            if let (Some(f), true) = (file, uncached || cold) {
                // What this does not read (no splice support) the populating faults read.
                let _ = read_through(f, at(s), l as u64);
            }
            // In steps: the kernel holds the address space's lock for reading through one call,
            // and every mmap of the loading thread (new Python or torch memory) waits for it.
            let mut rc = 0;
            for step in (s..s + l).step_by(POPULATE_STEP) {
                let n = POPULATE_STEP.min(s + l - step);
                // SAFETY: populating only reads the mapping's pages into memory; it does not
                // access them from Rust and fails (does not fault) on an unmapped range.
                rc = unsafe {
                    libc::madvise(step as *mut libc::c_void, n, libc::MADV_POPULATE_READ)
                };
                if rc != 0 {
                    break;
                }
            }
            if rc == 0 {
                touch(s, l);
                return Ok(l as u64);
            }
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINVAL) => Ok(0), // kernel without MADV_POPULATE_READ
                Some(libc::EFAULT) => Err(Error::Io {
                    detail: "the mapped file is shorter than when it was opened (truncated \
                             while loading)"
                        .into(),
                    source: Some(err.into()),
                }),
                _ => Err(err.into()),
            }
        };
        on_threads(&pieces, threads, work)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, addr, offset, len, threads, cached, cold);
        Ok(0)
    }
}

/// Reads `[offset, offset + len)` of `file` into the page cache, in [`READAHEAD_CHUNK`] pieces on
/// `threads` threads (default [`READAHEAD_THREADS`]), without mapping or copying it (see
/// [`read_through`]); returns the bytes read. A caller that will copy from the page cache (a load
/// that converts) warms the file this way and holds no mapping of it beside its new tensors.
pub fn read_into_cache(file: &File, offset: u64, len: u64, threads: Option<usize>) -> Result<u64> {
    #[cfg(target_os = "linux")]
    {
        let step = READAHEAD_CHUNK as u64;
        let pieces: Vec<(u64, u64)> = (0..len.div_ceil(step))
            .map(|i| (offset + i * step, step.min(len - i * step)))
            .collect();
        on_threads(&pieces, threads, |&(at, n)| {
            Ok(if read_through(file, at, n) { n } else { 0 })
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, offset, len, threads);
        Ok(0)
    }
}

/// Reads `[offset, offset + len)` of `file` into the page cache through the read path without
/// copying it anywhere (`sendfile(2)` to `/dev/null`); returns whether every byte was read.
///
/// Why: `posix_fadvise(WILLNEED)` leaves 4 KiB page-cache folios, which every later mapping of
/// the file (this process's or another's) maps page by page; the read path caches large folios.
/// Faulting uncached pages in directly caches larger ones still, but read slower inside a load.
/// Measured here (1 GiB bf16, evicted, 4 rounds): load 0.97 s (this) vs 1.02 s (WILLNEED), 1.14 s
/// (faults); mapping the file in a new process afterwards 0.030 vs 0.058 s.
#[cfg(target_os = "linux")]
fn read_through(file: &File, offset: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") else {
        return false;
    };
    // A descriptor of its own: read-ahead state is kept per open file, and threads reading other
    // parts through one descriptor reset each other's (1 GiB cold: 0.9-1.2 s shared, 0.8 own).
    let own = std::fs::File::open(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let file = own.as_ref().unwrap_or(file);
    let mut at = offset as libc::off_t;
    let mut left = len;
    while left > 0 {
        let want = left.min(1 << 30) as usize;
        // SAFETY: sendfile reads the file descriptor's pages and writes them to /dev/null; `at`
        // lives for the call.
        let n = unsafe { libc::sendfile(null.as_raw_fd(), file.as_raw_fd(), &mut at, want) };
        if n <= 0 {
            return false;
        }
        left -= n as u64;
    }
    true
}

/// Reads one byte of every page of `[s, s + l)`, just populated: under a hypervisor the guest's
/// first access to a page the disk was just read into still costs a trap to the host (no guest
/// page fault; ~1-2 us per page, 0.2-0.6 s per GiB measured here), and paying it here, while the
/// other threads' reads are in flight, hides it behind the disk instead of the first forward pass.
#[cfg(target_os = "linux")]
fn touch(s: usize, l: usize) {
    for page in (s..s + l).step_by(4096) {
        // SAFETY: MADV_POPULATE_READ just succeeded on this range, so it is mapped readable and
        // its pages are present; volatile so the read is not optimized away.
        unsafe { std::ptr::read_volatile(page as *const u8) };
    }
}

/// Windows of a large range that [`mostly_uncached`] asks about, and their size: `cachestat(2)`
/// walks every page it is asked about (12-15 ms for 1 GiB here, 20-36 ms beside other work: a
/// tenth of a warm 1 GiB reload), where a majority needs a sample: 32 evenly spread windows of
/// 256 KiB cost the same at any size.
const UNCACHED_SAMPLES: u64 = 32;
const UNCACHED_WINDOW: u64 = 256 << 10;

/// Whether most pages of `file`'s `[offset, offset + len)` are not in the page cache
/// (`cachestat(2)`, over [`UNCACHED_SAMPLES`] evenly spread windows of a range larger than them
/// all); `false` where the kernel cannot say. Copies of such a range wait on the disk, which serves
/// parallel requests better than one per core.
pub fn mostly_uncached(file: &File, offset: u64, len: u64) -> bool {
    #[cfg(target_os = "linux")]
    {
        if len <= UNCACHED_SAMPLES * UNCACHED_WINDOW {
            let pages = len.div_ceil(4096);
            return cached_pages(file, offset, len).is_some_and(|cached| cached * 2 < pages);
        }
        let stride = len / UNCACHED_SAMPLES;
        let mut cached = 0;
        for i in 0..UNCACHED_SAMPLES {
            // the middle of each stride, on a page boundary: exactly the window's pages
            let at = (offset + i * stride + (stride - UNCACHED_WINDOW) / 2) / 4096 * 4096;
            match cached_pages(file, at, UNCACHED_WINDOW) {
                Some(pages) => cached += pages,
                None => return false,
            }
        }
        cached * 2 < UNCACHED_SAMPLES * UNCACHED_WINDOW / 4096
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, offset, len);
        false
    }
}

/// Pages of `file`'s `[offset, offset + len)` in the page cache, from `cachestat(2)`; `None` where
/// the kernel lacks it (before 6.5) or refuses.
#[cfg(target_os = "linux")]
fn cached_pages(file: &File, offset: u64, len: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        cache: u64,
        dirty: u64,
        writeback: u64,
        evicted: u64,
        recently_evicted: u64,
    }
    // The syscall number is 451 on every architecture (it postdates the unified table).
    const SYS_CACHESTAT: libc::c_long = 451;
    let range = Range { off: offset, len };
    let mut stat = Stat::default();
    // SAFETY: cachestat reads `range` and writes one `Stat`, both live for the call.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut Stat,
            0,
        )
    };
    (rc == 0).then_some(stat.cache)
}

/// Whether every page of `[addr, addr + len)` (page-aligned) is in memory, from `mincore(2)`.
#[cfg(target_os = "linux")]
fn resident(addr: usize, len: usize) -> Result<bool> {
    let mut vec = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `vec` has one byte per page of the range, as mincore requires.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(vec.iter().all(|b| b & 1 == 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reading_through_puts_an_evicted_range_in_the_page_cache() {
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!("fastload-rt-{}", std::process::id()));
        let len = 3 * READAHEAD_CHUNK as u64 / 2;
        let mut out = File::create(&path).unwrap();
        out.write_all(&vec![5u8; len as usize]).unwrap();
        out.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        // SAFETY: plain advice on an open descriptor
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert!(read_through(&f, 0, len));
        if let Some(cached) = cached_pages(&f, 0, len) {
            assert_eq!(cached, len.div_ceil(4096));
        }
        assert!(!read_through(&f, len, 4096), "nothing to read past the end");
        // In parallel pieces (the last one short), from an offset that is not a piece boundary
        // SAFETY: plain advice on an open descriptor
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(
            read_into_cache(&f, 4096, len - 4096, Some(3)).unwrap(),
            len - 4096
        );
        if let Some(cached) = cached_pages(&f, 4096, len - 4096) {
            assert_eq!(cached, (len - 4096).div_ceil(4096));
        }
        assert_eq!(read_into_cache(&f, len, 8192, Some(2)).unwrap(), 0);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_temporary_file_is_on_a_named_local_filesystem() {
        let path = std::env::temp_dir().join(format!("fastload-fs-{}", std::process::id()));
        let f = File::create(&path).unwrap();
        let fs = filesystem_of(&f).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(fs.local, "{fs:?}");
        assert!(!fs.name.is_empty());
    }

    #[test]
    fn populating_a_mapping_reads_its_pages_and_keeps_their_bytes() {
        let path = std::env::temp_dir().join(format!("fastload-ra-{}", std::process::id()));
        let bytes: Vec<u8> = (0..3 * READAHEAD_CHUNK / 2)
            .map(|i| (i % 253) as u8)
            .collect();
        File::create(&path).unwrap().write_all(&bytes).unwrap();
        let f = File::open(&path).unwrap();
        // SAFETY: the file is private to this test and not modified while mapped.
        let map = unsafe { memmap2::Mmap::map(&f).unwrap() };
        let (addr, len) = (map.as_ptr() as usize, map.len());
        let read = populate(Some(&f), addr, 0, len, Some(4), false, false).unwrap();
        assert!(read <= len.div_ceil(4096) as u64 * 4096);
        assert!(resident(addr, len).unwrap());
        assert_eq!(&map[..], &bytes[..]);
        // Now cached and mapped: nothing left to read, unless every piece is asked for.
        assert_eq!(
            populate(Some(&f), addr, 0, len, Some(4), false, false).unwrap(),
            0
        );
        let all = populate(Some(&f), addr, 0, len, Some(4), true, true).unwrap();
        assert_eq!(all, len.div_ceil(4096) as u64 * 4096);
        assert_eq!(&map[..], &bytes[..]);
        drop(map);
        std::fs::remove_file(&path).unwrap();
    }

    /// A 1 MiB file written and read back (so in the page cache), open; the caller removes it.
    fn just_read(tag: &str) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!("fastload-{tag}-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let _ = std::fs::read(&path).unwrap();
        let f = File::open(&path).unwrap();
        (path, f)
    }

    #[test]
    fn a_file_just_read_is_not_mostly_uncached() {
        let (path, f) = just_read("mu");
        assert!(!mostly_uncached(&f, 0, 1 << 20));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_large_range_is_mostly_uncached_as_its_pages_are() {
        use std::os::fd::AsRawFd;
        // Larger than the sampled windows: 96 MiB, then a share of it evicted from the front.
        let len: u64 = 96 << 20;
        assert!(len > UNCACHED_SAMPLES * UNCACHED_WINDOW);
        let path = std::env::temp_dir().join(format!("fastload-mu-large-{}", std::process::id()));
        let mut out = File::create(&path).unwrap();
        out.write_all(&vec![3u8; len as usize]).unwrap();
        out.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        let evict = |upto: u64| {
            let _ = std::fs::read(&path).unwrap();
            if upto == 0 {
                return; // a length of 0 advises to the end of the file
            }
            // SAFETY: plain advice on an open descriptor
            unsafe {
                libc::posix_fadvise(f.as_raw_fd(), 0, upto as i64, libc::POSIX_FADV_DONTNEED)
            };
        };
        if cached_pages(&f, 0, len).is_some() {
            for (evicted, uncached) in [
                (0, false),
                (len / 4, false),
                (3 * len / 4, true),
                (len, true),
            ] {
                evict(evicted);
                let whole = cached_pages(&f, 0, len).unwrap() * 2 < len / 4096;
                assert_eq!(
                    whole, uncached,
                    "the page cache itself, {evicted} bytes evicted"
                );
                assert_eq!(
                    mostly_uncached(&f, 0, len),
                    uncached,
                    "{evicted} bytes evicted"
                );
                // a range that does not start on a page or a window
                let (o, l) = (12345, len - 12345);
                assert_eq!(
                    mostly_uncached(&f, o, l),
                    uncached,
                    "{evicted} evicted, from {o}"
                );
            }
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_page_cache_count_of_a_file_just_read_covers_it() {
        let (path, f) = just_read("cs");
        if let Some(pages) = cached_pages(&f, 0, 1 << 20) {
            assert_eq!(pages, 256);
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn populating_an_unmapped_range_is_an_error_not_a_crash() {
        // Page 0 is never mapped in a Linux process.
        assert!(populate(None, 0, 0, 4096, Some(1), false, false).is_err());
        assert!(populate(None, 0, 0, 4096, Some(1), true, true).is_err());
    }
}
