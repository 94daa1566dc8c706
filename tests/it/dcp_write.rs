//! `convert … OUT/ --to M --format dcp`: a DCP checkpoint at M ranks. Read back by reshard for
//! every fixture and M, and — when a Python with torch is available — loaded by real torch:
//! `torch.distributed.checkpoint.load` in M gloo processes into DTensors sharded for M ranks,
//! and `dcp_to_torch_save`, both compared with torch's own oracle.

use crate::common::archive::{split_items, walk_checked};
use crate::common::*;
use std::path::Path;

/// Every DCP fixture (HF-storage ones have no .metadata).
fn dcp_cases() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(fixture(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        // the DCP fixtures: a checkpoint folder and the consolidated oracle beside it
        .filter(|n| {
            fixture(n).join("checkpoint").is_dir()
                && fixture(n).join("oracle/full.safetensors").is_file()
                && !n.starts_with("hf_storage")
        })
        .collect();
    v.sort();
    v
}

const WORLDS: [usize; 5] = [1, 2, 3, 4, 8];

/// Convert fixture `case` to a DCP checkpoint of `m` ranks at `out`.
fn to_dcp(case: &str, out: &Path, m: usize) {
    let m = m.to_string();
    let args = [
        "--to",
        &m,
        "--format",
        "dcp",
        "--per-rank-state",
        "keep",
        "-q",
    ];
    convert(&fixture(case).join("checkpoint"), out, &args);
}

#[test]
fn dcp_outputs_read_back_equal_for_every_fixture_and_world_size() {
    let d = tempfile::tempdir().unwrap();
    for case in dcp_cases() {
        let oracle = read_safetensors(&fixture(&case).join("oracle/full.safetensors"));
        let nontensor = json_object(&fixture(&case).join("oracle/nontensor.json"));
        for m in WORLDS {
            let out = d.path().join(format!("{case}-{m}"));
            to_dcp(&case, &out, m);
            for r in 0..m {
                let file = out.join(format!("__{r}_0.distcp"));
                assert!(file.is_file(), "{case} -> {m}: rank {r} file");
                // every item a torch.save archive the zip crate reads, CRCs included
                let bytes = std::fs::read(&file).unwrap();
                let items = split_items(&bytes);
                for item in &items {
                    walk_checked(item);
                }
                let len: usize = items.iter().map(|i| i.len()).sum();
                assert_eq!(len, bytes.len(), "{case} -> {m}: rank {r} holds only items");
            }
            let back = d.path().join(format!("{case}-{m}.safetensors"));
            convert(&out, &back, &["--to", "1", "-q"]);
            assert_eq!(read_safetensors(&back), oracle, "{case} -> dcp at {m} -> 1");
            let ck = reshard::formats::Checkpoint::open(&out).unwrap();
            assert_eq!(ck.ranks as usize, m);
            for e in ck.extras.iter().filter(|e| e.origin == "dcp") {
                assert_eq!(
                    Some(&e.value),
                    nontensor.get(&e.name),
                    "{case} -> {m}: {}",
                    e.name
                );
            }
        }
    }
}

#[test]
fn torch_loads_dcp_outputs_at_every_world_size() {
    let Some(py) = torch_or_skip() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    for m in WORLDS {
        // one spawn of M gloo ranks loads every fixture's M-rank output in turn
        let mut args = vec!["dcp-load".to_string(), "--world".into(), m.to_string()];
        for case in dcp_cases() {
            let out = d.path().join(format!("{case}-{m}"));
            to_dcp(&case, &out, m);
            args.push(s(&out).to_string());
            args.push(s(&fixture(&case).join("oracle/full.safetensors")).to_string());
        }
        judge(&py, &args);
    }
    // torch's own consolidation of a 3-rank output, non-tensor values included
    for case in dcp_cases() {
        let out = d.path().join(format!("{case}-3"));
        judge(
            &py,
            &[
                "dcp-to-torch-save",
                s(&out),
                s(&fixture(&case).join("oracle/full.safetensors")),
                "--nontensor",
                s(&fixture(&case).join("oracle/nontensor.json")),
            ],
        );
    }
}
