#![no_main]
//! Fuzz target `pickle`: see `reshard_fuzz::pickle` (fuzz/src/lib.rs) for what it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::pickle(data));
