//! Arbitrary bytes as a `.safetensors` file: the reader returns named tensors or a typed error,
//! never panics. Every tensor it returns must be self-consistent, and converting it to each
//! declared dtype must also return a tensor or a typed error.

#![no_main]

use attn_fuzz::compare::check_file_tensor;
use attn_runtime::io::decode_safetensors;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(tensors) = decode_safetensors(data) {
        for (name, tensor) in tensors {
            check_file_tensor(&name, tensor);
        }
    }
});
