#![no_main]
//! Fuzz target `layout`: see `reshard_fuzz::layout` (fuzz/src/lib.rs) for what it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::layout(data));
