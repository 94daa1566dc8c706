//! The integration tests, as one test binary (one build, one link) with a module per format or
//! concern. Tests that measure their own time and memory run in a binary of their own
//! (`tests/bounds.rs`), away from the CPU load of these.
//!
//! Run one module with `cargo test --test it MODULE::`, e.g. `cargo test --test it dcp_read::`.

#[path = "../common/mod.rs"]
mod common;

// CLI and library
mod cli;
mod diff;
mod errors;
mod folders;
mod library;
mod loader;
mod outputs;
mod parts;
mod per_rank;
mod ties;
mod verify;

// formats, each judged against torch's own files and oracles
mod dcp_read;
mod dcp_write;
mod deepspeed;
mod deepspeed_universal;
mod fp8;
mod hf_storage;
mod megatron;
mod megatron_fsdp;
mod megatron_legacy;
mod pt_read;
mod pt_write;
mod recipes;
mod torch_checkpointing;
mod torch_save;
mod torchtitan;
mod verl;

// properties over random inputs
mod format_chains;
mod layout_props;
mod pickle_fuzz;
mod views;

// damaged, hostile and interrupted runs
mod corruption;
mod crash;
mod fuzz_regressions;

/// Every committed proptest regression file `proptest-regressions/NAME.txt` is read where the
/// proptest blocks of module NAME look for it ([`common::regressions`]), so its seeds are
/// replayed before new cases.
#[test]
fn proptest_regression_files_are_found() {
    for entry in std::fs::read_dir(common::root().join("proptest-regressions")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap();
        let seeds = common::regressions(name)
            .unwrap()
            .load_persisted_failures2(None);
        assert!(!seeds.is_empty(), "{}: no seed read", path.display());
        let module = common::root().join(format!("tests/it/{name}.rs"));
        let text = std::fs::read_to_string(&module).unwrap();
        assert!(
            text.contains(&format!("regressions(\"{name}\")")),
            "{}: does not replay {}",
            module.display(),
            path.display()
        );
    }
}
