#![no_main]
//! Fuzz target `open_dcp`: see `reshard_fuzz::open_dcp` (fuzz/src/lib.rs) for what it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::open_dcp(data));
