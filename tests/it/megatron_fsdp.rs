//! Megatron-LM's `--ckpt-format fsdp_dtensor` checkpoints (`tests/fixtures/megatron_fsdp`:
//! a tiny Llama-style megatron-core model wrapped in Megatron-FSDP at TP 1 × FSDP 2 and
//! TP 2 × FSDP 2, saved by Megatron-LM's own state-dict code and `dcp.save` with
//! `scripts/gen_megatron_fsdp.py`), judged against the same model's oracles: mbridge's Hugging
//! Face export (byte for byte through the llama recipe) and megatron-core's own `torch_dist`
//! save (every tensor and `_extra_state` object). The Python side
//! (`python/tests/test_megatron_fsdp.py`) runs transformers and megatron-core on the outputs.

use crate::common::{convert, fails, fixture, ok, read_all, s, Tensors};
use reshard::formats::{Checkpoint, Format};
use reshard::OpenOptions;
use std::collections::BTreeSet;
use std::path::Path;

/// The cases: name and tensor-parallel size.
const CASES: &[(&str, u64)] = &[("llama_fsdp2", 1), ("llama_tp2_fsdp2", 2)];

/// `got` holds exactly the tensors of `want`, each with the same dtype, shape and bytes.
fn same(what: &str, got: &Tensors, want: &Tensors) {
    crate::common::assert_same("megatron_fsdp", what, got, want);
}

/// The `_extra_state` objects of a megatron-core checkpoint (names of its `BYTE_IO` items).
fn objects(ck: &Checkpoint) -> BTreeSet<String> {
    ck.extras
        .iter()
        .filter(|e| e.name.contains("._extra_state/"))
        .map(|e| e.name.clone())
        .collect()
}

#[test]
fn reads_under_megatron_core_names_with_swiglu_joined() {
    for (case, tp) in CASES {
        let ck = Checkpoint::open(fixture(&format!("megatron_fsdp/{case}/fsdp_dtensor"))).unwrap();
        assert_eq!(ck.format, Format::MEGATRON_FSDP, "{case}");
        assert_eq!(ck.tag.as_deref(), Some("iter_0000007"), "{case}");
        assert_eq!(ck.ranks as u64, 2 * tp, "{case}");
        let names: BTreeSet<&str> = ck.tensors.iter().map(|t| t.name.as_str()).collect();
        for n in [
            "embedding.word_embeddings.weight",
            "output_layer.weight",
            "decoder.final_layernorm.weight",
            "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.3.mlp.linear_fc1.layer_norm_weight",
            "decoder.layers.3.mlp.linear_fc1.weight",
        ] {
            assert!(names.contains(n), "{case}: no {n} in {names:?}");
        }
        assert!(
            !names
                .iter()
                .any(|n| n.starts_with("model.") || n.ends_with("_w") || n.ends_with("_v")),
            "{case}: {names:?}"
        );
        let fc1 = ck.tensor("decoder.layers.0.mlp.linear_fc1.weight").unwrap();
        assert_eq!(fc1.shape, vec![80, 16], "{case}");
        let common: BTreeSet<&str> = ck
            .extras
            .iter()
            .filter(|e| e.origin == "common.pt")
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(
            common,
            BTreeSet::from([
                "args",
                "checkpoint_version",
                "iteration",
                "num_floating_point_operations_so_far"
            ]),
            "{case}"
        );
        let args = reshard::recipe::source_config(&ck, "megatron")
            .unwrap()
            .expect("args");
        assert_eq!(args["ckpt_format"], "fsdp_dtensor", "{case}");
        assert_eq!(args["tensor_model_parallel_size"], *tp, "{case}");
        // the iteration's folder read as the whole save directory's
        let said = ok(&[
            "inspect",
            s(&fixture(&format!("megatron_fsdp/{case}/fsdp_dtensor"))),
        ]);
        assert!(said.contains("megatron-fsdp checkpoint"), "{said}");
        assert!(
            said.contains("recipe llama (common.pt args: normalization=RMSNorm, swiglu=True) converts it to hf"),
            "{said}"
        );
    }
}

#[test]
fn converts_to_hf_byte_equal_to_mbridges_export() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, _) in CASES {
        let dir = fixture(&format!("megatron_fsdp/{case}"));
        let out = tmp.path().join(case);
        let said = convert(&dir.join("fsdp_dtensor"), &out, &["--format", "hf"]);
        assert!(said.contains("recipe llama"), "{said}");
        let want = read_all(&Checkpoint::open(dir.join("hf_mbridge")).unwrap());
        let got = read_all(&Checkpoint::open(&out).unwrap());
        same(&format!("{case} -> hf"), &got, &want);
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        for (k, v) in [
            ("model_type", serde_json::json!("llama")),
            ("vocab_size", 96.into()),
            ("intermediate_size", 40.into()),
            ("num_key_value_heads", 2.into()),
            ("head_dim", 4.into()),
            ("tie_word_embeddings", false.into()),
        ] {
            assert_eq!(config[k], v, "{case}: config.json {k}");
        }
    }
}

#[test]
fn converts_to_torch_dist_equal_to_megatron_cores_own_save() {
    let tmp = tempfile::tempdir().unwrap();
    for (case, tp) in CASES {
        let dir = fixture(&format!("megatron_fsdp/{case}"));
        let out = tmp.path().join(case);
        let said = convert(&dir.join("fsdp_dtensor"), &out, &["--format", "megatron"]);
        assert!(
            said.contains("a megatron-fsdp source: layers and experts stacked"),
            "{said}"
        );
        // a Megatron-LM save directory, at the source's iteration
        assert_eq!(
            std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap(),
            "7"
        );
        let got = Checkpoint::open(&out).unwrap();
        assert_eq!(got.format, Format::MEGATRON, "{case}");
        let want = Checkpoint::open(dir.join("torch_dist")).unwrap();
        same(
            &format!("{case} -> torch_dist"),
            &read_all(&got),
            &read_all(&want),
        );
        assert_eq!(
            objects(&got),
            objects(&want),
            "{case}: _extra_state objects"
        );
        let args = reshard::recipe::source_config(&got, "megatron")
            .unwrap()
            .expect("args in common.pt");
        assert_eq!(args["tensor_model_parallel_size"], *tp, "{case}");
        let it = got.extras.iter().find(|e| e.name == "iteration").unwrap();
        assert_eq!(it.value, 7, "{case}");
    }
}

#[test]
fn a_plain_dcp_checkpoint_stays_dcp_and_bad_input_is_one_line() {
    // a DCP checkpoint of no Megatron-LM save is not taken for one
    let plain = fixture("fsdp2_w2_f32/checkpoint");
    assert_eq!(Checkpoint::open(&plain).unwrap().format, Format::DCP);
    // asked for as megatron-fsdp: refused naming its .metadata
    let err = Checkpoint::open_with(&plain, Some(Format::MEGATRON_FSDP), &OpenOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!(
            "{}",
            Path::new(&plain).join(".metadata").display()
        )) && err.contains("not a Megatron-LM fsdp_dtensor save")
            && !err.contains('\n'),
        "{err}"
    );
    // read only
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("megatron_fsdp/llama_fsdp2/fsdp_dtensor");
    fails(
        &[
            "convert",
            s(&src),
            s(&tmp.path().join("o")),
            "--format",
            "megatron-fsdp",
            "--to",
            "2",
        ],
        "fsdp_dtensor checkpoints are read, not written",
    );
    // a data file cut short: the error names it
    let copy = tmp.path().join("cut");
    crate::common::copy_dir(&src, &copy);
    let data = copy.join("iter_0000007/__1_0.distcp");
    crate::common::set_len(&data, 100);
    let err = Checkpoint::open(&copy).unwrap_err().to_string();
    assert!(err.contains("__1_0.distcp") && !err.contains('\n'), "{err}");
}
