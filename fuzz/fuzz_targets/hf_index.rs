#![no_main]
//! Fuzz target `hf_index`: see `reshard_fuzz::hf_index` (fuzz/src/lib.rs) for what it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::hf_index(data));
