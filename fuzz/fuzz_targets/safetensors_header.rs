#![no_main]
//! Fuzz target `safetensors_header`: see `reshard_fuzz::safetensors_header` (fuzz/src/lib.rs) for what it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::safetensors_header(data));
