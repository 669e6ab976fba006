//! Recognizing files that are not safetensors at all, so that a `config.json` or a pickle passed
//! as weights is reported as such instead of as an absurd header length.
//!
//! A safetensors file starts with its header length as a little-endian u64 below 100 MB, so its
//! bytes 4..8 are zero; text and the other formats' magic numbers never look like that. The check
//! only runs after the header length was refused, so it cannot reject a valid file.

use crate::error::Error;

/// What the first bytes of a file suggest it is, for the formats people confuse with safetensors.
pub fn looks_like(head: &[u8]) -> Option<&'static str> {
    let trimmed = head
        .strip_prefix(b"\xef\xbb\xbf") // a UTF-8 byte order mark
        .unwrap_or(head);
    let first = trimmed.iter().copied().find(|b| !b.is_ascii_whitespace());
    let known: &[(&[u8], &str)] = &[
        (
            b"PK\x03\x04",
            "a zip archive (torch.save's format: a .bin/.pt checkpoint?)",
        ),
        (
            b"version ",
            "a Git LFS pointer (the weights were never downloaded: git lfs pull)",
        ),
        (b"GGUF", "a GGUF file (llama.cpp's format)"),
        (b"\x89HDF", "an HDF5 file (a Keras .h5 checkpoint?)"),
        (b"\x93NUMPY", "a NumPy .npy array"),
        (b"\x1f\x8b", "gzip-compressed data"),
    ];
    if let Some((_, what)) = known.iter().find(|(magic, _)| trimmed.starts_with(magic)) {
        return Some(what);
    }
    if trimmed.first() == Some(&0x80) && matches!(trimmed.get(1), Some(2..=5)) {
        return Some("a Python pickle (a legacy torch.save checkpoint?)");
    }
    match first {
        Some(b'{') | Some(b'[') => return Some("JSON (a config.json or an .index.json?)"),
        Some(b'<') => return Some("HTML or XML (an error page saved in place of the file?)"),
        _ => {}
    }
    let text = !trimmed.is_empty()
        && trimmed
            .iter()
            .all(|&b| b.is_ascii_graphic() || b.is_ascii_whitespace());
    text.then_some("text")
}

/// Replaces a refused header length by [`Error::NotSafetensors`] when `head` (the first bytes
/// of the file) shows another format; other errors pass through.
pub fn explain(err: Error, head: &[u8]) -> Error {
    match err {
        Error::FileTooSmall { .. } | Error::HeaderTooLarge { .. } | Error::HeaderPastEof { .. } => {
            match looks_like(head) {
                Some(what) => Error::NotSafetensors {
                    looks_like: what.to_string(),
                },
                None => err,
            }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule_for(head: &[u8]) -> &'static str {
        explain(Error::HeaderTooLarge { len: 0, cap: 0 }, head).rule()
    }

    #[test]
    fn recognizes_json_zip_pickle_and_lfs_pointers() {
        assert_eq!(rule_for(b"{\n  \"arc"), "not-safetensors");
        assert_eq!(rule_for(b"PK\x03\x04\0\0\0\0"), "not-safetensors");
        assert_eq!(rule_for(b"\x80\x02}q\0(X"), "not-safetensors");
        assert!(looks_like(b"version https://git-lfs")
            .unwrap()
            .contains("LFS"));
        assert!(looks_like(b"  [1, 2]").unwrap().contains("JSON"));
    }

    #[test]
    fn a_plausible_binary_length_is_left_to_the_header_rules() {
        assert_eq!(
            rule_for(b"\xf8\xff\xff\xff\xff\xff\xff\xff"),
            "header-too-large"
        );
        assert_eq!(looks_like(b"@\0\0\0\0\0\0\0"), None);
    }

    #[test]
    fn errors_other_than_the_header_length_are_unchanged() {
        let gap = Error::Gap {
            tensor: "a".into(),
            expected: 0,
            begin: 4,
        };
        assert_eq!(explain(gap.clone(), b"{"), gap);
    }
}
