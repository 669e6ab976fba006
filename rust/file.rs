//! Opening a safetensors file and reading byte ranges of its data section.
//!
//! Two read paths, chosen by the caller and visible in its reports:
//! * [`ReadMode::Pread`] (default): positioned reads straight into the destination. No page faults
//!   on a mapping, so a file truncated under us or a flaky network filesystem gives an error, never
//!   SIGBUS; large reads are also faster than faulting a mapping page by page on NFS/Lustre.
//! * [`ReadMode::Mmap`]: copies out of a read-only memory map, which lets conversions read the source
//!   in place.
//! * [`ReadMode::RangedGet`] (feature `store`): an object in object storage, read with ranged GETs
//!   ([`crate::store`]); the header first, then exactly the byte ranges a copy asks for.

use std::ffi::CString;
use std::fs::{File, Metadata};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::{Advice, Mmap};

use crate::error::{Error, Result};
use crate::header::{parse_buffer, parse_header, read_header_len, Header, LEN_PREFIX};
use crate::sniff;

/// How tensor bytes are read from the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    Pread,
    Mmap,
    /// Ranged GETs from object storage (never asked for: an object URL opens this way).
    RangedGet,
}

impl ReadMode {
    /// Parses `"pread"` or `"mmap"`.
    pub fn parse(s: &str) -> Option<ReadMode> {
        match s {
            "pread" => Some(ReadMode::Pread),
            "mmap" => Some(ReadMode::Mmap),
            _ => None,
        }
    }

    /// The name accepted by [`ReadMode::parse`].
    pub fn name(self) -> &'static str {
        match self {
            ReadMode::Pread => "pread",
            ReadMode::Mmap => "mmap",
            ReadMode::RangedGet => "ranged-get",
        }
    }
}

/// Where the bytes of a [`SafetensorsFile`] come from.
#[derive(Debug)]
enum Backing {
    /// Positioned reads from the open file.
    Pread(File),
    /// A read-only map of the open file (the file is kept to notice truncation).
    Mapped(File, Mmap),
    /// Bytes owned in memory (tests, fuzzing, callers that already hold the file).
    Memory(Box<[u8]>),
    /// An object in object storage, read with ranged GETs.
    #[cfg(feature = "store")]
    Remote(crate::store::Object),
}

/// An open, validated safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    len: u64,
    /// Size and modification time (ns) at open: a change means the file was rewritten in place.
    stamp: Option<(u64, i64)>,
    header: Header,
    backing: Backing,
    /// `fstatfs` answer, asked once: an open descriptor's filesystem never changes, and a load
    /// asks per file twice (read-ahead and allocation).
    fs: OnceLock<crate::readahead::Filesystem>,
}

/// What a non-regular file is, for the message refusing it.
fn kind_of(m: &Metadata) -> Option<&'static str> {
    let t = m.file_type();
    if t.is_file() {
        None
    } else if t.is_dir() {
        Some("a directory")
    } else if t.is_fifo() {
        Some("a FIFO")
    } else if t.is_char_device() {
        Some("a character device")
    } else if t.is_block_device() {
        Some("a block device")
    } else if t.is_socket() {
        Some("a socket")
    } else {
        Some("not a regular file")
    }
}

fn stamp(m: &Metadata) -> (u64, i64) {
    (m.len(), m.mtime() * 1_000_000_000 + m.mtime_nsec())
}

/// Opens `name` (relative to `dir` when given, as `openat`) for reading, refusing anything but a
/// regular file before an open that could block (a FIFO blocks `open(2)` until a writer comes).
fn open_regular(dir: Option<RawFd>, name: &Path) -> Result<File> {
    let refuse = |m: &Metadata| match kind_of(m) {
        Some(kind) => Err(Error::NotRegularFile { kind: kind.into() }),
        None => Ok(()),
    };
    let cname = CString::new(name.as_os_str().as_bytes()).map_err(|_| Error::Io {
        detail: "path contains a NUL byte".into(),
        source: None,
    })?;
    let base = dir.unwrap_or(libc::AT_FDCWD);
    // stat first: refuses a FIFO or a device without opening it at all.
    // SAFETY: `st` is written by fstatat on success; `cname` is NUL-terminated.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatat(base, cname.as_ptr(), &mut st, 0) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        let kind = match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => "a directory",
            libc::S_IFIFO => "a FIFO",
            libc::S_IFCHR => "a character device",
            libc::S_IFBLK => "a block device",
            libc::S_IFSOCK => "a socket",
            _ => "not a regular file",
        };
        return Err(Error::NotRegularFile { kind: kind.into() });
    }
    // O_NONBLOCK: if the path was swapped for a FIFO since the stat, the open still returns at
    // once and the fstat below refuses it. It changes nothing for a regular file.
    let flags = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: plain syscall on a NUL-terminated path; the fd is owned by the File below.
    let fd = unsafe { libc::openat(base, cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    refuse(&file.metadata()?)?;
    Ok(file)
}

impl SafetensorsFile {
    /// Opens `path`, reads and validates its header, and maps it when `mode` is [`ReadMode::Mmap`].
    /// Anything but a regular file is refused ([`Error::NotRegularFile`]) without blocking.
    pub fn open(path: &Path, mode: ReadMode) -> Result<Self> {
        Self::open_at(None, path, path, mode)
    }

    /// As [`SafetensorsFile::open`], with `name` resolved relative to the open directory `dir`
    /// (`openat`): every file of a checkpoint then comes from the directory that was opened once,
    /// even if the path is swapped for another directory meanwhile. `path` is what messages and
    /// [`SafetensorsFile::path`] show.
    pub fn open_at(dir: Option<RawFd>, name: &Path, path: &Path, mode: ReadMode) -> Result<Self> {
        let file = open_regular(dir, name)?;
        let meta = file.metadata()?;
        let len = meta.len();
        let stamp = Some(stamp(&meta));
        let mut prefix = [0u8; LEN_PREFIX as usize];
        let head = len.min(LEN_PREFIX) as usize;
        read_exact_at(&file, &mut prefix[..head], 0, len)?;
        let n = read_header_len(&prefix, len).map_err(|e| sniff::explain(e, &prefix[..head]))?;
        let mut json = vec![0u8; n as usize];
        read_exact_at(&file, &mut json, LEN_PREFIX, len)?;
        let header = parse_header(&json, len)?;
        let backing = match mode {
            // a local file has no ranged GETs: read it with pread
            ReadMode::Pread | ReadMode::RangedGet => Backing::Pread(file),
            ReadMode::Mmap => {
                // SAFETY: the map is read-only; a concurrent truncation is checked for before each
                // copy (see `check_unchanged`), which narrows but cannot close the SIGBUS window:
                // that is why pread is the default.
                let m = unsafe { Mmap::map(&file)? };
                // A file that shrank between the header read and the map gives a shorter map;
                // reads past its end would be refused later, but say what happened now.
                if (m.len() as u64) < len {
                    return Err(Error::FileShrunk {
                        expected: len,
                        actual: m.len() as u64,
                    });
                }
                let _ = m.advise(Advice::Sequential);
                Backing::Mapped(file, m)
            }
        };
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            len,
            stamp,
            header,
            backing,
            fs: OnceLock::new(),
        })
    }

    /// Validates a whole file held in memory; `label` stands for the path in messages.
    ///
    /// Reads copy out of `bytes` ([`SafetensorsFile::mode`] reports [`ReadMode::Mmap`], the
    /// in-place read path); planning and copying are the same as for a file on disk, which is
    /// what lets tests and the fuzzers drive the copy engine without touching the disk.
    pub fn from_bytes(label: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        let head = &bytes[..bytes.len().min(LEN_PREFIX as usize)];
        let header = parse_buffer(&bytes).map_err(|e| sniff::explain(e, head))?;
        Ok(SafetensorsFile {
            path: label.into(),
            len: bytes.len() as u64,
            stamp: None,
            header,
            backing: Backing::Memory(bytes.into_boxed_slice()),
            fs: OnceLock::new(),
        })
    }

    /// Opens an object in object storage with two ranged GETs: the 8-byte header length, checked
    /// against the cap and the object's size before the header's buffer is allocated, then
    /// exactly the header, validated as a file's. Nothing else is read until a copy asks for its
    /// byte ranges, so the bytes fetched from the store are the checkpoint's once (a read of more
    /// than the header here would fetch tensor bytes the copies fetch again, and on every rank of
    /// a collective load bytes that rank never reads).
    #[cfg(feature = "store")]
    pub fn open_object(object: crate::store::Object) -> Result<Self> {
        let len = object.size();
        let head = len.min(LEN_PREFIX) as usize;
        let mut prefix = [0u8; LEN_PREFIX as usize];
        object.read_into(&mut prefix[..head], 0)?;
        let n = read_header_len(&prefix[..head], len)
            .map_err(|e| sniff::explain(e, &prefix[..head]))?;
        let mut json = vec![0u8; n as usize];
        if n > 0 {
            object.read_into(&mut json, LEN_PREFIX)?;
        }
        let header = parse_header(&json, len)?;
        Ok(SafetensorsFile {
            path: PathBuf::from(object.url()),
            len,
            stamp: None,
            header,
            backing: Backing::Remote(object),
            fs: OnceLock::new(),
        })
    }

    /// The object behind this file when it comes from object storage.
    #[cfg(feature = "store")]
    pub fn object(&self) -> Option<&crate::store::Object> {
        match &self.backing {
            Backing::Remote(o) => Some(o),
            _ => None,
        }
    }

    /// `(size, ETag, Last-Modified)` of the object version every read of this file asks for
    /// ([`crate::store::Object::version`]); `None` for a local file or one held in memory.
    #[cfg(feature = "store")]
    pub fn version(&self) -> Option<(u64, Option<String>, Option<String>)> {
        self.object().map(crate::store::Object::version)
    }

    /// Whether the bytes come from object storage (each read a request over the network).
    pub fn is_remote(&self) -> bool {
        self.mode() == ReadMode::RangedGet
    }

    /// The path the file was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File size in bytes at open time.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file has no bytes (never true for a valid file).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The read path in use.
    pub fn mode(&self) -> ReadMode {
        match self.backing {
            Backing::Pread(_) => ReadMode::Pread,
            Backing::Mapped(..) | Backing::Memory(_) => ReadMode::Mmap,
            #[cfg(feature = "store")]
            Backing::Remote(_) => ReadMode::RangedGet,
        }
    }

    /// Fails with [`Error::FileShrunk`] if the file is now shorter than when it was opened, and
    /// with [`Error::FileChanged`] if its size or modification time changed (rewritten in place).
    /// The change time is not compared: renaming or unlinking the file (an atomic replace of
    /// its path by a saver) changes it but leaves the open file's bytes intact.
    pub fn check_unchanged(&self) -> Result<()> {
        let file = match &self.backing {
            Backing::Pread(f) | Backing::Mapped(f, _) => f,
            // an object is read at the version opened (If-Match), or not at all
            _ => return Ok(()),
        };
        let meta = file.metadata()?;
        let now = meta.len();
        if now < self.len {
            return Err(Error::FileShrunk {
                expected: self.len,
                actual: now,
            });
        }
        if let Some((len, mtime)) = self.stamp {
            let (now_len, now_mtime) = stamp(&meta);
            if (now_len, now_mtime) != (len, mtime) {
                return Err(Error::FileChanged {
                    detail: format!(
                        "size {len} -> {now_len} bytes, modification time {mtime} -> {now_mtime} ns"
                    ),
                });
            }
        }
        Ok(())
    }

    /// The open file descriptor (`None` for a file held in memory): lets a caller map exactly the
    /// file that was validated (`/proc/self/fd/N`) rather than whatever its path names now.
    pub fn raw_fd(&self) -> Option<RawFd> {
        match &self.backing {
            Backing::Pread(f) | Backing::Mapped(f, _) => Some(f.as_raw_fd()),
            _ => None,
        }
    }

    /// The bytes at absolute `offset` in mmap mode (and for in-memory files); `None` in pread
    /// mode or when the range is not inside the file.
    pub fn mapped(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let bytes: &[u8] = match &self.backing {
            Backing::Mapped(_, m) => m,
            Backing::Memory(b) => b,
            _ => return None,
        };
        let start = usize::try_from(offset).ok()?;
        bytes.get(start..start.checked_add(len)?)
    }

    /// Fills `dst` with the bytes at absolute file `offset`.
    pub fn read_at(&self, dst: &mut [u8], offset: u64) -> Result<()> {
        match (&self.backing, self.mapped(offset, dst.len())) {
            (_, Some(src)) => {
                dst.copy_from_slice(src);
                Ok(())
            }
            (Backing::Pread(file), None) => read_exact_at(file, dst, offset, self.len),
            #[cfg(feature = "store")]
            (Backing::Remote(object), None) => object.read_into(dst, offset),
            (_, None) => Err(Error::FileShrunk {
                expected: offset.saturating_add(dst.len() as u64),
                actual: self.len,
            }),
        }
    }

    /// Reads `[offset, offset + len)` and hands the bytes to `sink` as they come: from object
    /// storage, the chunks of one ranged GET as they arrive; otherwise in one piece.
    pub fn read_chunks(
        &self,
        offset: u64,
        len: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        #[cfg(feature = "store")]
        if let Backing::Remote(object) = &self.backing {
            return object.read_chunks(offset, len, sink);
        }
        let len = usize::try_from(len).map_err(|_| Error::FileShrunk {
            expected: offset.saturating_add(len),
            actual: self.len,
        })?;
        let mut buf = vec![0u8; len];
        self.read_at(&mut buf, offset)?;
        sink(&buf)
    }

    /// `(device, inode)` of the open file, to tell whether a path still names it (`None` for
    /// a file held in memory).
    pub fn identity(&self) -> Result<Option<(u64, u64)>> {
        match &self.backing {
            Backing::Pread(f) | Backing::Mapped(f, _) => {
                let m = f.metadata()?;
                Ok(Some((m.dev(), m.ino())))
            }
            _ => Ok(None),
        }
    }
}

impl SafetensorsFile {
    /// Reads ahead the uncached pages (all pages with `cached`) of `[addr, addr + len)`, a mapping
    /// of this file whose byte `offset` is at `addr`; see [`crate::readahead::populate`].
    pub fn read_ahead(
        &self,
        addr: usize,
        offset: u64,
        len: usize,
        threads: Option<usize>,
        cached: bool,
        cold: bool,
    ) -> Result<u64> {
        let file = match &self.backing {
            Backing::Pread(f) | Backing::Mapped(f, _) => Some(f),
            _ => None,
        };
        crate::readahead::populate(file, addr, offset, len, threads, cached, cold)
    }

    /// Reads the file's bytes `[offset, offset + len)` into the page cache in parallel, mapping
    /// nothing; the bytes read (0 for a file held in memory). See
    /// [`crate::readahead::read_into_cache`].
    pub fn read_through(&self, (offset, len): (u64, u64), threads: Option<usize>) -> Result<u64> {
        match &self.backing {
            Backing::Pread(f) | Backing::Mapped(f, _) => {
                crate::readahead::read_into_cache(f, offset, len, threads)
            }
            _ => Ok(0),
        }
    }

    /// Whether most of the file's bytes `[offset, offset + len)` are not in the page cache (a copy
    /// of them waits on the disk); `false` for a file held in memory or where the kernel cannot
    /// say.
    pub fn mostly_uncached(&self, (offset, len): (u64, u64)) -> bool {
        match &self.backing {
            Backing::Pread(f) | Backing::Mapped(f, _) => {
                len > 0 && crate::readahead::mostly_uncached(f, offset, len)
            }
            _ => false,
        }
    }

    /// The filesystem the file lives on (`None` for a file held in memory): decides whether
    /// views of a mapping are the default (local filesystems) or private copies (network/FUSE).
    pub fn filesystem(&self) -> Result<Option<crate::readahead::Filesystem>> {
        match &self.backing {
            Backing::Pread(f) | Backing::Mapped(f, _) => {
                if let Some(fs) = self.fs.get() {
                    return Ok(Some(fs.clone()));
                }
                let fs = crate::readahead::filesystem_of(f)?;
                Ok(Some(self.fs.get_or_init(|| fs).clone()))
            }
            _ => Ok(None),
        }
    }
}

/// `pread` until `dst` is full; a short file is [`Error::FileShrunk`], not a partial result.
fn read_exact_at(
    file: &File,
    mut dst: &mut [u8],
    mut offset: u64,
    expected_len: u64,
) -> Result<()> {
    while !dst.is_empty() {
        match file.read_at(dst, offset) {
            Ok(0) => {
                let actual = file.metadata().map(|m| m.len()).unwrap_or(offset);
                return Err(Error::FileShrunk {
                    expected: expected_len,
                    actual,
                });
            }
            Ok(n) => {
                dst = &mut dst[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::header::build_header;
    use std::io::Write;

    pub(crate) fn temp_file(bytes: &[u8]) -> (PathBuf, File) {
        let dir = std::env::temp_dir();
        let path = dir.join(format!(
            "fastload-test-{}-{}.safetensors",
            std::process::id(),
            rand_suffix()
        ));
        let mut f = File::create(&path).unwrap();
        f.write_all(bytes).unwrap();
        (path, f)
    }

    fn rand_suffix() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        N.fetch_add(1, Ordering::Relaxed)
    }

    fn sample() -> Vec<u8> {
        let (mut buf, _) = build_header(&[("x".into(), Dtype::U8, vec![16])], None).unwrap();
        buf.extend(0u8..16);
        buf
    }

    #[test]
    fn both_modes_read_the_same_bytes() {
        let (path, _f) = temp_file(&sample());
        for mode in [ReadMode::Pread, ReadMode::Mmap] {
            let f = SafetensorsFile::open(&path, mode).unwrap();
            assert_eq!(f.mode(), mode);
            let x = f.header().get("x").unwrap();
            let mut out = [0u8; 4];
            f.read_at(&mut out, f.header().data_start() + x.begin + 4)
                .unwrap();
            assert_eq!(out, [4, 5, 6, 7]);
        }
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_file_truncated_after_open_is_an_error_not_a_crash() {
        let (path, f) = temp_file(&sample());
        let opened = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
        f.set_len(20).unwrap();
        assert_eq!(opened.check_unchanged().unwrap_err().rule(), "file-shrunk");
        let mut out = [0u8; 16];
        let err = opened
            .read_at(&mut out, opened.header().data_start())
            .unwrap_err();
        assert_eq!(err.rule(), "file-shrunk");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_missing_file_is_an_io_error() {
        let err = SafetensorsFile::open(Path::new("/nonexistent/x.safetensors"), ReadMode::Pread)
            .unwrap_err();
        assert_eq!(err.rule(), "io");
    }
}
