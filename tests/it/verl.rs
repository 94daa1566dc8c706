//! verl's FSDP checkpoint folders, as verl 0.9.1's own `FSDPCheckpointManager` writes them
//! (`tests/fixtures/verl/<case>/checkpoint/`, made by `scripts/gen_verl.py`: a tiny
//! transformers Llama under FSDP2 over 2 or 3 gloo ranks, one AdamW step), judged against
//! the model's and optimizer's full state dicts torch gathered before the save
//! (`oracle/model.safetensors`, `oracle/optim.safetensors`): every tensor is read from the
//! per-rank DTensor shards byte for byte, a Hugging Face output carries verl's config, and a
//! missing rank file is refused naming it, with nothing written.

use crate::common::{
    assert_same, convert, copy_fixture, fails, fixture, read_all, read_st, s, Tensors,
};
use reshard::formats::Checkpoint;

const CASES: [(&str, u32); 2] = [("fsdp2_w2", 2), ("fsdp2_w3", 3)];

fn model_only(t: &Tensors) -> Tensors {
    t.iter()
        .filter(|(k, _)| !k.starts_with("optim.") && !k.starts_with("extra_state."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[test]
fn model_tensors_byte_equal_to_the_gathered_state_dict() {
    for (case, world) in CASES {
        let ck = Checkpoint::open(fixture(&format!("verl/{case}/checkpoint"))).unwrap();
        assert_eq!(ck.format.name(), "verl");
        assert_eq!(ck.ranks, world);
        let (want, _) = read_st(&fixture(&format!("verl/{case}/oracle/model.safetensors")));
        assert_same(case, "model", &model_only(&read_all(&ck)), &want);
        // every parameter is sharded over every rank (FSDP2 Shard(0))
        let embed = ck
            .tensors
            .iter()
            .find(|t| t.name == "model.embed_tokens.weight")
            .unwrap();
        assert_eq!(embed.pieces.len(), world as usize);
    }
}

#[test]
fn optimizer_states_byte_equal_to_the_gathered_optimizer() {
    for (case, _) in CASES {
        let ck = Checkpoint::open(fixture(&format!("verl/{case}/checkpoint"))).unwrap();
        let got = read_all(&ck);
        let (want, _) = read_st(&fixture(&format!("verl/{case}/oracle/optim.safetensors")));
        // optimizer.state_dict() numbers the parameters in the model's order
        let (model, _) = read_st(&fixture(&format!("verl/{case}/oracle/model.safetensors")));
        let order: Vec<&String> = ck
            .tensors
            .iter()
            .map(|t| &t.name)
            .filter(|n| model.contains_key(*n))
            .collect();
        let mut seen = 0;
        for (i, fqn) in order.iter().enumerate() {
            for state in ["exp_avg", "exp_avg_sq", "step"] {
                let w = &want[&format!("state.{fqn}.{state}")];
                let g = &got[&format!("optim.state.{i}.{state}")];
                assert_eq!(g, w, "{case}: optim state {i} ({fqn}) {state}");
                seen += 1;
            }
        }
        assert_eq!(seen, want.len(), "{case}: every optimizer state compared");
        let lr = ck
            .extras
            .iter()
            .find(|e| e.name == "optim.param_groups.0.lr")
            .unwrap();
        assert!(lr.value.is_number());
    }
}

#[test]
fn hf_output_carries_the_config_and_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, _) in CASES {
        let out = tmp.path().join(case);
        convert(
            &fixture(&format!("verl/{case}/checkpoint")),
            &out,
            &[
                "--format",
                "hf",
                "--exclude",
                "optim.*",
                "--exclude",
                "extra_state.*",
            ],
        );
        let (want, _) = read_st(&fixture(&format!("verl/{case}/oracle/model.safetensors")));
        let (got, _) = read_st(&out.join("model-00001-of-00001.safetensors"));
        assert_same(case, "hf", &got, &want);
        let config = std::fs::read(out.join("config.json")).unwrap();
        let src = std::fs::read(fixture(&format!(
            "verl/{case}/checkpoint/huggingface/config.json"
        )))
        .unwrap();
        assert_eq!(
            config, src,
            "{case}: config.json from verl's huggingface/ folder"
        );
    }
}

#[test]
fn a_missing_rank_file_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_fixture("verl/fsdp2_w2", tmp.path());
    std::fs::remove_file(ckpt.join("model_world_size_2_rank_1.pt")).unwrap();
    let out = tmp.path().join("out");
    let err = fails(
        &["convert", s(&ckpt), s(&out), "--format", "hf"],
        "model_world_size_2_rank_1.pt",
    );
    assert!(err.contains("is missing"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!out.exists());

    let ckpt = copy_fixture("verl/fsdp2_w3", &tmp.path().join("b"));
    std::fs::remove_file(ckpt.join("optim_world_size_3_rank_2.pt")).unwrap();
    fails(
        &["inspect", s(&ckpt)],
        "optim_world_size_3_rank_2.pt: is missing",
    );
}

#[test]
fn fsdp1_sharded_tensors_read_and_convert_to_hf() {
    // FSDP1 SHARDED_STATE_DICT: a ShardedTensor per parameter, its process group's state
    // pickled as `getattr(ShardedTensor, "ProcessGroupState")(...)` (read as a value)
    let src = fixture("verl/fsdp1_w2/checkpoint");
    let ck = Checkpoint::open(&src).unwrap();
    assert_eq!(ck.ranks, 2);
    assert!(
        ck.producer.as_deref().unwrap_or("").contains("FSDP1"),
        "{:?}",
        ck.producer
    );
    let (want, _) = read_st(&fixture("verl/fsdp1_w2/oracle/model.safetensors"));
    assert_same("fsdp1_w2", "model", &model_only(&read_all(&ck)), &want);
    // the optimizer's flat padded slices are not read: no optim.* tensor
    assert!(ck.tensors.iter().all(|t| !t.name.starts_with("optim.")));
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf");
    convert(
        &src,
        &out,
        &["--format", "hf", "--exclude", "extra_state.*"],
    );
    let (got, _) = read_st(&out.join("model-00001-of-00001.safetensors"));
    assert_same("fsdp1_w2", "hf", &got, &want);
}
