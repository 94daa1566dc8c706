#![no_main]
//! Fuzz target `open_deepspeed`: see `reshard_fuzz::open_deepspeed` (fuzz/src/lib.rs) for what
//! it checks.

libfuzzer_sys::fuzz_target!(|data: &[u8]| reshard_fuzz::open_deepspeed(data));
