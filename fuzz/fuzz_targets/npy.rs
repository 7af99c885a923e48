//! Arbitrary bytes as a `.npy` file: the reader returns a tensor or a typed error, never panics.
//! A tensor it returns must be self-consistent, and converting it to each declared dtype must
//! also return a tensor or a typed error.

#![no_main]

use attn_fuzz::compare::check_file_tensor;
use attn_runtime::io::decode_npy;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(tensor) = decode_npy(data) {
        check_file_tensor("x", tensor);
    }
});
