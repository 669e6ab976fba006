//! Writing safetensors files straight from tensor memory.
//!
//! The Python `safetensors` writer builds the whole file as one `bytes` object before writing it,
//! which doubles peak memory. Here the header is built, the file sized, and each tensor's bytes
//! written at their offset with positioned writes from several threads, then fsynced. Atomic
//! replacement (temporary name + rename) is the caller's job, which knows the final name.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rayon::prelude::*;

use crate::copy::CHUNK;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::header::build_header;
use crate::pool::{check_threads, pool};

/// A tensor to write: its bytes are `len` bytes at `ptr`, owned by the caller.
#[derive(Clone, Debug)]
pub struct Source {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub ptr: *const u8,
    pub len: usize,
}

#[derive(Clone, Copy)]
struct SrcPtr(*const u8);
// SAFETY: sources are only read, and the caller keeps them alive during `write_file`.
unsafe impl Send for SrcPtr {}
unsafe impl Sync for SrcPtr {}

/// Writes `sources` (in the given order) to a new file at `path`, fsynced. Returns bytes written.
///
/// # Safety
/// Every source must be valid for reads of `len` bytes until this returns.
pub unsafe fn write_file(
    path: &Path,
    sources: &[Source],
    metadata: Option<&[(String, String)]>,
    threads: Option<usize>,
) -> Result<u64> {
    // Checked before the file is created, so a bad count leaves nothing behind.
    let threads = check_threads(threads)?;
    let spec: Vec<(String, Dtype, Vec<u64>)> = sources
        .iter()
        .map(|s| (s.name.clone(), s.dtype, s.shape.clone()))
        .collect();
    let (prefix, offsets) = build_header(&spec, metadata)?;
    let mut pieces = Vec::new();
    for (s, &(begin, end)) in sources.iter().zip(&offsets) {
        check_source(s, end - begin)?;
        let mut done = 0u64;
        while done < s.len as u64 {
            let k = CHUNK.min(s.len as u64 - done);
            pieces.push((
                SrcPtr(s.ptr.wrapping_add(done as usize)),
                k as usize,
                prefix.len() as u64 + begin + done,
            ));
            done += k;
        }
    }
    let total = prefix.len() as u64 + offsets.last().map_or(0, |o| o.1);
    let file = OpenOptions::new().write(true).create_new(true).open(path)?;
    file.set_len(total)?;
    file.write_all_at(&prefix, 0)?;
    let write_piece = |&(src, len, at): &(SrcPtr, usize, u64)| -> Result<()> {
        // SAFETY: the caller guarantees each source is readable for its length.
        let bytes = unsafe { std::slice::from_raw_parts(src.0, len) };
        file.write_all_at(bytes, at).map_err(Error::from)
    };
    if threads == 1 || pieces.len() <= 1 {
        pieces.iter().try_for_each(write_piece)?;
    } else {
        pool(threads)?.install(|| pieces.par_iter().try_for_each(write_piece))?;
    }
    file.sync_all()?;
    Ok(total)
}

/// The whole file as bytes (`safetensors.torch.save`): header, then each source's bytes.
///
/// # Safety
/// Every source must be valid for reads of `len` bytes until this returns.
pub unsafe fn serialize(
    sources: &[Source],
    metadata: Option<&[(String, String)]>,
) -> Result<Vec<u8>> {
    let spec: Vec<(String, Dtype, Vec<u64>)> = sources
        .iter()
        .map(|s| (s.name.clone(), s.dtype, s.shape.clone()))
        .collect();
    let (prefix, offsets) = build_header(&spec, metadata)?;
    let data_len = offsets.last().map_or(0, |o| o.1) as usize;
    let mut out = Vec::with_capacity(prefix.len() + data_len);
    out.extend_from_slice(&prefix);
    for (s, &(begin, end)) in sources.iter().zip(&offsets) {
        check_source(s, end - begin)?;
        if s.len > 0 {
            // SAFETY: the caller guarantees the source is readable for its length.
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(s.ptr, s.len) });
        }
    }
    Ok(out)
}

/// A source must hold exactly the bytes its shape and dtype need, from a non-null pointer.
fn check_source(s: &Source, expected: u64) -> Result<()> {
    if expected != s.len as u64 {
        return Err(Error::InvalidSource {
            tensor: s.name.clone(),
            detail: format!(
                "its shape and dtype need {expected} bytes but {} were given",
                s.len
            ),
        });
    }
    if s.len > 0 && s.ptr.is_null() {
        return Err(Error::InvalidSource {
            tensor: s.name.clone(),
            detail: "its data pointer is null".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::copy::{copy, Request, Selection};
    use crate::file::{ReadMode, SafetensorsFile};

    #[test]
    fn written_files_read_back_identically() {
        let path =
            std::env::temp_dir().join(format!("fastload-write-{}.safetensors", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let a: Vec<u8> = (0..(2 * CHUNK as usize + 5))
            .map(|i| (i % 13) as u8)
            .collect();
        let b = [7u8, 0, 0, 0];
        let sources = [
            Source {
                name: "a".into(),
                dtype: Dtype::U8,
                shape: vec![a.len() as u64],
                ptr: a.as_ptr(),
                len: a.len(),
            },
            Source {
                name: "b".into(),
                dtype: Dtype::I32,
                shape: vec![],
                ptr: b.as_ptr(),
                len: 4,
            },
            Source {
                name: "e".into(),
                dtype: Dtype::F32,
                shape: vec![0],
                ptr: std::ptr::null(),
                len: 0,
            },
        ];
        let meta = [("format".to_string(), "pt".to_string())];
        unsafe { write_file(&path, &sources, Some(&meta), Some(2)) }.unwrap();
        let f = SafetensorsFile::open(&path, ReadMode::Pread).unwrap();
        let mut out = vec![0u8; a.len()];
        let r = Request {
            name: "a".into(),
            ptr: out.as_mut_ptr(),
            len: out.len(),
            dtype: Dtype::U8,
            selection: Selection::All,
        };
        unsafe { copy(&f, &[r], None) }.unwrap();
        assert!(out == a);
        assert_eq!(f.header().metadata().unwrap()[0].1, "pt");
        // create_new: never overwrites in place.
        assert_eq!(
            unsafe { write_file(&path, &sources, None, None) }
                .unwrap_err()
                .rule(),
            "io"
        );
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn serialized_bytes_parse_back_with_the_data_in_place() {
        let a = [1u8, 2, 3, 4];
        let s = [Source {
            name: "a".into(),
            dtype: Dtype::U8,
            shape: vec![2, 2],
            ptr: a.as_ptr(),
            len: 4,
        }];
        let bytes = unsafe { serialize(&s, None) }.unwrap();
        let f = SafetensorsFile::from_bytes("mem", bytes.clone()).unwrap();
        let start = f.header().data_start() as usize;
        assert_eq!(&bytes[start..], &a);
        assert_eq!(f.header().get("a").unwrap().shape, vec![2, 2]);
    }

    #[test]
    fn a_source_of_the_wrong_size_is_refused() {
        let path = std::env::temp_dir().join(format!(
            "fastload-write-bad-{}.safetensors",
            std::process::id()
        ));
        let b = [0u8; 3];
        let s = [Source {
            name: "b".into(),
            dtype: Dtype::I32,
            shape: vec![1],
            ptr: b.as_ptr(),
            len: 3,
        }];
        assert_eq!(
            unsafe { write_file(&path, &s, None, None) }
                .unwrap_err()
                .rule(),
            "invalid-source"
        );
        assert!(!path.exists());
    }
}
