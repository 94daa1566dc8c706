#![no_main]
//! Fuzz target `open_producers`: see `reshard_fuzz::open_producers` (fuzz/src/lib.rs) for what
//! it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::open_producers(data));
