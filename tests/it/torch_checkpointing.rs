//! Meta's torch_checkpointing folders, as torch-checkpointing 0.1.1's own
//! `CheckpointManager.save` writes them (`tests/fixtures/torch_checkpointing/<case>/checkpoint/`,
//! made by `scripts/gen_torch_checkpointing.py`: a tiny MLP, one AdamW step, in one process or
//! under FSDP2 over 2 gloo ranks), judged against the library's own load of the checkpoint at
//! world 1 (`oracle/model.safetensors`, `oracle/optim.safetensors`): every tensor is read from
//! the per-rank files byte for byte, consolidation and a reshard to DCP at other world sizes
//! give the same bytes, and a malformed `metadata.pkl` or a missing rank file is refused
//! naming it, with nothing written.

use crate::common::{
    assert_same, convert, copy_fixture, fails, fixture, read_all, read_st, s, Tensors,
};
use reshard::formats::Checkpoint;

const CASES: [(&str, u32); 2] = [("w1", 1), ("fsdp2_w2", 2)];

fn ckpt(case: &str) -> std::path::PathBuf {
    fixture(&format!("torch_checkpointing/{case}/checkpoint"))
}

/// The oracle under reshard's names: the model as it is, the optimizer under `optimizer.`.
fn oracle(case: &str) -> Tensors {
    let (mut want, _) = read_st(&fixture(&format!(
        "torch_checkpointing/{case}/oracle/model.safetensors"
    )));
    let (optim, _) = read_st(&fixture(&format!(
        "torch_checkpointing/{case}/oracle/optim.safetensors"
    )));
    for (k, v) in optim {
        want.insert(format!("optimizer.{k}"), v);
    }
    want
}

#[test]
fn every_tensor_byte_equal_to_the_librarys_own_load() {
    for (case, world) in CASES {
        let ck = Checkpoint::open(ckpt(case)).unwrap();
        assert_eq!(ck.format.name(), "torch-checkpointing");
        assert_eq!(ck.ranks, world);
        assert_same(case, "read", &read_all(&ck), &oracle(case));
        // FSDP2 Shard(0): 7 rows over 2 ranks, 4 and 3
        let w = ck.tensors.iter().find(|t| t.name == "0.weight").unwrap();
        assert_eq!(w.shape, vec![7, 6]);
        assert_eq!(w.pieces.len(), world as usize, "{case}");
        let step = ck.extras.iter().find(|e| e.name == "step").unwrap();
        assert_eq!(step.value, serde_json::json!(1), "{case}");
        let lr = ck
            .extras
            .iter()
            .find(|e| e.name == "optimizer.param_groups.0.lr")
            .unwrap();
        assert_eq!(lr.value, serde_json::json!(0.01), "{case}");
    }
}

#[test]
fn consolidation_and_dcp_at_other_worlds_equal_the_oracle() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, _) in CASES {
        let one = tmp.path().join(format!("{case}.safetensors"));
        convert(&ckpt(case), &one, &["--to", "1", "-q"]);
        let (got, _) = read_st(&one);
        assert_same(case, "safetensors", &got, &oracle(case));
        for m in [3u32, 4] {
            let mid = tmp.path().join(format!("{case}-dcp{m}"));
            convert(
                &ckpt(case),
                &mid,
                &["--to", &m.to_string(), "--format", "dcp", "-q"],
            );
            let ck = Checkpoint::open(&mid).unwrap();
            assert_eq!(ck.ranks, m, "{case}");
            assert_same(case, &format!("dcp at {m}"), &read_all(&ck), &oracle(case));
        }
    }
}

#[test]
fn a_missing_rank_file_or_bad_metadata_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("torch_checkpointing/fsdp2_w2", tmp.path());
    std::fs::remove_file(ck.join("optimizer_1.pt")).unwrap();
    let out = tmp.path().join("out");
    let err = fails(
        &["convert", s(&ck), s(&out), "--to", "1"],
        "optimizer_1.pt: is missing",
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!out.exists());

    let ck = copy_fixture("torch_checkpointing/fsdp2_w2", &tmp.path().join("b"));
    std::fs::write(ck.join("metadata.pkl"), b"\x80\x04not a pickle").unwrap();
    let err = fails(&["convert", s(&ck), s(&out), "--to", "1"], "metadata.pkl");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!out.exists());

    // a well-formed pickle that is not torch_checkpointing's metadata
    let ck = copy_fixture("torch_checkpointing/w1", &tmp.path().join("c"));
    std::fs::write(ck.join("metadata.pkl"), b"\x80\x04}\x94.").unwrap();
    fails(
        &["inspect", s(&ck)],
        "metadata.pkl: is not torch_checkpointing metadata: no positive world_size",
    );
}

#[test]
fn verify_and_inspect_read_it() {
    for (case, _) in CASES {
        let out = crate::common::ok(&["inspect", s(&ckpt(case))]);
        assert!(out.contains("0.weight"), "{case}: {out}");
        crate::common::ok(&["verify", s(&ckpt(case))]);
    }
}

#[test]
fn written_as_one_process_and_read_back_with_its_items_and_values() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, _) in CASES {
        let out = tmp.path().join(case);
        convert(
            &ckpt(case),
            &out,
            &["--to", "1", "--format", "torch-checkpointing", "-q"],
        );
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["metadata.pkl", "model_0.pt", "optimizer_0.pt", "step_0.pt"],
            "{case}"
        );
        // (the Python tests compare metadata.pkl with the library's own single-process save
        // and load the folder with the library at world 1, 2 and 3)
        let ck = Checkpoint::open(&out).unwrap();
        assert_eq!(ck.format.name(), "torch-checkpointing");
        assert_eq!(ck.ranks, 1);
        assert_same(case, "written", &read_all(&ck), &oracle(case));
        let src = Checkpoint::open(ckpt(case)).unwrap();
        let values = |c: &Checkpoint| -> Vec<(String, serde_json::Value)> {
            c.extras
                .iter()
                .map(|e| (e.name.clone(), e.value.clone()))
                .collect()
        };
        assert_eq!(values(&ck), values(&src), "{case}");
        assert_eq!(ck.paths, src.paths, "{case}");
        assert_eq!(
            ck.paths.get("optimizer.state.0.exp_avg"),
            Some(&vec![
                reshard::KeyPart::Key("optimizer".into()),
                reshard::KeyPart::Key("state".into()),
                reshard::KeyPart::IntKey { int: 0 },
                reshard::KeyPart::Key("exp_avg".into()),
            ])
        );
    }
}

#[test]
fn written_at_one_rank_only() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("o");
    fails(
        &[
            "convert",
            s(&ckpt("fsdp2_w2")),
            s(&out),
            "--to",
            "2",
            "--format",
            "torch-checkpointing",
        ],
        "holds one rank, not 2: use --to 1",
    );
    assert!(!out.exists());
}
