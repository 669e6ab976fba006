//! Opening a safetensors file and reading byte ranges of its data section.
//!
//! Two read paths, chosen by the caller and visible in its reports:
//! * [`ReadMode::Pread`] (default): positioned reads straight into the destination. No page faults
//!   on a mapping, so a file truncated under us or a flaky network filesystem gives an error, never
//!   SIGBUS; large reads are also faster than faulting a mapping page by page on NFS/Lustre.
//! * [`ReadMode::Mmap`]: copies out of a read-only memory map, which lets conversions read the source
//!   in place.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use memmap2::{Advice, Mmap};

use crate::error::{Error, Result};
use crate::header::{parse_header, read_header_len, Header, LEN_PREFIX};

/// How tensor bytes are read from the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadMode {
    Pread,
    Mmap,
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
        }
    }
}

/// An open, validated safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    len: u64,
    header: Header,
    mmap: Option<Mmap>,
}

impl SafetensorsFile {
    /// Opens `path`, reads and validates its header, and maps it when `mode` is [`ReadMode::Mmap`].
    pub fn open(path: &Path, mode: ReadMode) -> Result<Self> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        let mut prefix = [0u8; LEN_PREFIX as usize];
        if len >= LEN_PREFIX {
            read_exact_at(&file, &mut prefix, 0, len)?;
        }
        let n = read_header_len(&prefix, len)?;
        let mut json = vec![0u8; n as usize];
        read_exact_at(&file, &mut json, LEN_PREFIX, len)?;
        let header = parse_header(&json, len)?;
        let mmap = match mode {
            ReadMode::Pread => None,
            ReadMode::Mmap => {
                // SAFETY: the map is read-only; a concurrent truncation is checked for before each
                // copy (see `check_unchanged`), which narrows but cannot close the SIGBUS window:
                // that is why pread is the default.
                let m = unsafe { Mmap::map(&file)? };
                let _ = m.advise(Advice::Sequential);
                Some(m)
            }
        };
        Ok(SafetensorsFile { path: path.to_path_buf(), file, len, header, mmap })
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
        if self.mmap.is_some() {
            ReadMode::Mmap
        } else {
            ReadMode::Pread
        }
    }

    /// Fails with [`Error::FileShrunk`] if the file is now shorter than when it was opened.
    pub fn check_unchanged(&self) -> Result<()> {
        let now = self.file.metadata()?.len();
        if now < self.len {
            return Err(Error::FileShrunk { expected: self.len, actual: now });
        }
        Ok(())
    }

    /// The mapped bytes at absolute `offset`, in mmap mode.
    pub fn mapped(&self, offset: u64, len: usize) -> Option<&[u8]> {
        let m = self.mmap.as_ref()?;
        let start = usize::try_from(offset).ok()?;
        m.get(start..start.checked_add(len)?)
    }

    /// Fills `dst` with the bytes at absolute file `offset`.
    pub fn read_at(&self, dst: &mut [u8], offset: u64) -> Result<()> {
        match self.mapped(offset, dst.len()) {
            Some(src) => {
                dst.copy_from_slice(src);
                Ok(())
            }
            None if self.mmap.is_some() => Err(Error::FileShrunk { expected: offset + dst.len() as u64, actual: self.len }),
            None => read_exact_at(&self.file, dst, offset, self.len),
        }
    }

    /// Advises the kernel that `[offset, offset+len)` will be read soon (mmap mode only).
    pub fn will_need(&self, offset: u64, len: usize) {
        if let (Some(m), Ok(start)) = (self.mmap.as_ref(), usize::try_from(offset)) {
            if start.checked_add(len).is_some_and(|e| e <= m.len()) && len > 0 {
                let _ = m.advise_range(Advice::WillNeed, start, len);
            }
        }
    }
}

/// `pread` until `dst` is full; a short file is [`Error::FileShrunk`], not a partial result.
fn read_exact_at(file: &File, mut dst: &mut [u8], mut offset: u64, expected_len: u64) -> Result<()> {
    while !dst.is_empty() {
        match file.read_at(dst, offset) {
            Ok(0) => {
                let actual = file.metadata().map(|m| m.len()).unwrap_or(offset);
                return Err(Error::FileShrunk { expected: expected_len, actual });
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
        let path = dir.join(format!("fastload-test-{}-{}.safetensors", std::process::id(), rand_suffix()));
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
            f.read_at(&mut out, f.header().data_start() + x.begin + 4).unwrap();
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
        let err = opened.read_at(&mut out, opened.header().data_start()).unwrap_err();
        assert_eq!(err.rule(), "file-shrunk");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_missing_file_is_an_io_error() {
        let err = SafetensorsFile::open(Path::new("/nonexistent/x.safetensors"), ReadMode::Pread).unwrap_err();
        assert_eq!(err.rule(), "io");
    }
}
