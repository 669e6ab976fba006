//! Header parsing and validation: arbitrary bytes as a whole file. Accepted headers must satisfy
//! the layout invariants, round-trip through `build_header`, and copy back their own bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
mod checks {
    include!("../checks.rs");
}

fuzz_target!(|data: &[u8]| checks::check_header_bytes(data));
