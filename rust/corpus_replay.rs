//! Replays the fuzz corpora (`rust/fuzz/corpus/<target>/`) through the same checks the fuzz
//! targets run (`rust/fuzz/checks.rs`), so `cargo test` guards every input the fuzzers kept,
//! including the ones that once found a bug, without fuzzing in CI.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

#[allow(dead_code)]
mod checks {
    use crate as fastload;
    include!("fuzz/checks.rs");
}

/// The files of one target's corpus, sorted by name.
fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("rust/fuzz/corpus")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read the corpus {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

/// Runs `check` on every file of `target`'s corpus and fails with the list of files that panic.
fn replay(target: &str, check: fn(&[u8])) {
    let files = corpus(target);
    assert!(!files.is_empty(), "the {target} corpus is empty");
    let failed: Vec<String> = files
        .iter()
        .filter(|path| {
            let bytes = std::fs::read(path).expect("a readable corpus file");
            catch_unwind(AssertUnwindSafe(|| check(&bytes))).is_err()
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} {target} inputs fail: {failed:#?}",
        failed.len(),
        files.len()
    );
}

#[test]
fn every_header_corpus_input_passes_the_header_checks() {
    replay("header", checks::check_header_bytes);
}

#[test]
fn every_copy_plan_corpus_input_passes_the_planner_checks() {
    replay("copy_plan", checks::check_copy_plan);
}
