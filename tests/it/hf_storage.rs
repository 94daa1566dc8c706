//! Real checkpoints written by torch's `HuggingFaceStorageWriter(save_distributed=True)`
//! (tests/fixtures, made by scripts/gen_fixtures.py): reshard's results are compared byte for
//! byte with torch's consolidated oracle, and — when a Python with torch is available — torch's
//! own reader must accept what reshard writes.

use crate::common::*;

const CASES: [&str; 2] = ["hf_storage_w4_f32", "hf_storage_w3_bf16"];

#[test]
fn consolidation_and_round_trips_equal_torchs_oracle() {
    for case in CASES {
        let ck = fixture(case).join("checkpoint");
        let oracle = read_safetensors(&fixture(case).join("oracle/full.safetensors"));
        let d = tempfile::tempdir().unwrap();
        let one = d.path().join("one.safetensors");
        convert(&ck, &one, &["--to", "1", "-q"]);
        assert_eq!(read_safetensors(&one), oracle, "{case} -> 1");
        for m in [1usize, 2, 3, 5, 8] {
            let mid = d.path().join(format!("m{m}"));
            convert(
                &ck,
                &mid,
                &["--to", &m.to_string(), "--format", "hf-storage", "-q"],
            );
            let back = d.path().join(format!("back{m}.safetensors"));
            convert(&mid, &back, &["--to", "1", "-q"]);
            assert_eq!(read_safetensors(&back), oracle, "{case} -> {m} -> 1");
        }
        let hf = d.path().join("hf");
        convert(&ck, &hf, &["--to", "1", "--max-shard-size", "2KB", "-q"]);
        let back = d.path().join("hf.safetensors");
        convert(&hf, &back, &["--to", "1", "-q"]);
        assert_eq!(read_safetensors(&back), oracle, "{case} -> hf -> 1");
    }
}

#[test]
fn torch_reads_what_reshard_writes() {
    let Some(py) = torch_or_skip() else {
        return;
    };
    for case in CASES {
        let ck = fixture(case).join("checkpoint");
        let oracle = fixture(case).join("oracle/full.safetensors");
        let d = tempfile::tempdir().unwrap();
        // N -> M with torch's HuggingFaceStorageReader, for M below and above N
        for m in [1usize, 2, 8] {
            let out = d.path().join(format!("m{m}"));
            convert(
                &ck,
                &out,
                &["--to", &m.to_string(), "--format", "hf-storage", "-q"],
            );
            judge(&py, &["hf-storage-load", s(&out), s(&oracle)]);
        }
        let one = d.path().join("one.safetensors");
        convert(&ck, &one, &["--to", "1", "-q"]);
        judge(&py, &["safetensors-equal", s(&one), s(&oracle)]);
        let hf = d.path().join("hf");
        convert(&ck, &hf, &["--to", "1", "--max-shard-size", "2KB", "-q"]);
        judge(&py, &["hf-load", s(&hf), s(&oracle)]);
    }
}
