//! Arbitrary bytes as `.attn` source: check (parse, lower, verify), then optimize, schedule and
//! render every function that checks, for both targets. Nothing may panic or hang.

#![no_main]

use attn_fuzz::pipeline::{MAX_SOURCE_BYTES, check_plan_render};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() > MAX_SOURCE_BYTES {
        return;
    }
    // Non-UTF-8 input cannot reach the compiler (its API takes `&str`); the lossy conversion keeps
    // the rest of such an input useful.
    let source = String::from_utf8_lossy(data);
    check_plan_render(&source);
});
