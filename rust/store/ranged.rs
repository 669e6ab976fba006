//! Ranged GETs of one version of an object: every read of an opened object asks for the version
//! that was opened and is checked to come from it, so an object replaced during a load is an
//! error, never a mix of two versions.
//!
//! The version is what the store gives to tell versions apart: the ETag where there is one
//! (`If-Match`; S3, GCS, Azure, most HTTP servers), else the Last-Modified date
//! (`If-Unmodified-Since`; plain HTTP servers without ETags). Stores that ignore the condition
//! still say which size, ETag and date they served, and each answer is compared. An object with
//! neither (a server that sends no `ETag` and no `Last-Modified`) cannot be pinned to a version:
//! it is refused when opened ([`check_versioned`]), rather than read in pieces that could come
//! from two versions.

use std::ops::Range;

use futures_util::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore};

use super::{block_on, config_error, failure};
use crate::error::{Error, Result, StoreFailure};

/// Whether the store gave a Last-Modified date (`object_store` puts the epoch where it gave none).
pub(super) fn has_date(meta: &ObjectMeta) -> bool {
    meta.last_modified.timestamp() != 0 || meta.last_modified.timestamp_subsec_nanos() != 0
}

/// Refuses an object without a validator: its reads could not be checked to come from one
/// version. [`StoreFailure::Config`]: the store (its server), not the checkpoint, is at fault.
pub(super) fn check_versioned(meta: &ObjectMeta, url: &str) -> Result<()> {
    if meta.e_tag.is_some() || has_date(meta) {
        return Ok(());
    }
    Err(config_error(format!(
        "{url}: the server sends neither an ETag nor a Last-Modified date for this object, so \
         a replacement during the load could not be detected and the load could mix two \
         versions; fastload reads only objects it can pin to one version (serve it with ETags \
         or Last-Modified dates, as S3, GCS, Azure, nginx and Apache do)"
    )))
}

/// What differs between the version opened and the one that answered, if anything.
fn differs(opened: &ObjectMeta, served: &ObjectMeta) -> Option<String> {
    let etags = (opened.e_tag.as_deref(), served.e_tag.as_deref());
    let changed = opened.size != served.size
        || matches!(etags, (Some(a), Some(b)) if a != b)
        || (opened.e_tag.is_none() && opened.last_modified != served.last_modified);
    changed.then(|| {
        format!(
            "opened as {} bytes (ETag {}, Last-Modified {}), now {} bytes (ETag {}, \
             Last-Modified {})",
            opened.size,
            etags.0.unwrap_or("none"),
            opened.last_modified.to_rfc2822(),
            served.size,
            etags.1.unwrap_or("none"),
            served.last_modified.to_rfc2822()
        )
    })
}

/// One ranged GET of `range` of `path`, its bytes handed to `sink` as they arrive; with
/// `version` (the object as opened), asked for that version (`If-Match`, else
/// `If-Unmodified-Since`) and checked to come from it.
pub(super) fn read_range(
    store: &dyn ObjectStore,
    path: &StorePath,
    url: &str,
    range: Range<u64>,
    version: Option<&ObjectMeta>,
    sink: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let len = range.end - range.start;
    if len == 0 {
        return Ok(());
    }
    let options = GetOptions {
        range: Some(GetRange::Bounded(range.clone())),
        if_match: version.and_then(|v| v.e_tag.clone()),
        if_unmodified_since: version
            .filter(|v| v.e_tag.is_none() && has_date(v))
            .map(|v| v.last_modified),
        ..Default::default()
    };
    let changed = |detail: String| Error::Store {
        failure: StoreFailure::Changed,
        tensor: None,
        detail,
    };
    block_on(async {
        let result = store.get_opts(path, options).await.map_err(failure)?;
        if let Some(why) = version.and_then(|v| differs(v, &result.meta)) {
            return Err(changed(format!("{url}: {why}: replaced while loading")));
        }
        if result.range != range {
            return Err(changed(format!(
                "{url}: asked for bytes {range:?}, the store answered {:?}",
                result.range
            )));
        }
        let mut stream = result.into_stream();
        let mut got = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(failure)?;
            got += chunk.len() as u64;
            if got > len {
                break;
            }
            sink(&chunk)?;
        }
        if got != len {
            return Err(changed(format!(
                "{url}: bytes {}..{} answered with {got} bytes",
                range.start, range.end
            )));
        }
        Ok(())
    })?
}
