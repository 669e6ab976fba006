//! The copy planner: arbitrary bytes decoded into a file (structured or raw header, arbitrary
//! header and data lengths) and a batch of copy requests. The planner must accept exactly what
//! the format allows, and an accepted plan must write exactly the expected bytes and nothing
//! outside the destinations (guard bytes, and AddressSanitizer where it runs).
#![no_main]

use libfuzzer_sys::fuzz_target;

mod checks {
    include!("../checks.rs");
}

fuzz_target!(|data: &[u8]| checks::check_copy_plan(data));
