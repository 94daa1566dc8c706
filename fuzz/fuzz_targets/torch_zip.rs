#![no_main]
//! Fuzz target `torch_zip`: see `reshard_fuzz::torch_zip` (fuzz/src/lib.rs) for what it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::torch_zip(data));
