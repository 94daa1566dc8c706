//! megatron-core `dist_checkpointing` checkpoints (`tests/fixtures/megatron/<case>`, saved by
//! megatron-core 0.16.1 and 0.15.3 themselves under torchrun on gloo by
//! `scripts/gen_megatron.py`: tensor-parallel splits along either axis, layer-stacked tensors
//! (`prepend_axis_num`), replicas stored once, two writer threads per rank, `ShardedObject`s,
//! `common.pt`, and 0.15's flattened distributed-optimizer tensors), judged against
//! megatron-core's own loading: `oracle/full.safetensors` (every sharded tensor loaded whole
//! by `dist_checkpointing.load` in a job of one process, in its real shape) and
//! `oracle/nontensor.json` (`common.pt` and the objects). That megatron-core loads reshard's
//! megatron outputs at other splits is `python/tests/test_megatron.py`'s.

use crate::common::{self, convert, fails, fixture, read_all, read_st, s, Tensors};
use reshard::formats::{Checkpoint, Format};
use std::path::{Path, PathBuf};

/// The fixture cases: (name, case folder, case.json).
fn cases() -> Vec<(String, PathBuf, serde_json::Value)> {
    common::cases("megatron", 5)
}

fn oracle(dir: &Path) -> Tensors {
    read_st(&dir.join("oracle/full.safetensors")).0
}

/// `got` holds exactly the tensors of `want`, with the same dtype, shape and bytes.
fn same(case: &str, what: &str, got: &Tensors, want: &Tensors) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{case} {what}: names"
    );
    for (name, w) in want {
        let g = &got[name];
        assert_eq!((&g.0, &g.1), (&w.0, &w.1), "{case} {what}: `{name}`");
        assert!(g.2 == w.2, "{case} {what}: bytes of `{name}` differ");
    }
}

/// The oracle's JSON of a value with bytes as reshard shows them (`"<bytes: N>"`).
fn shown(v: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::Object(m) if m.len() == 1 && m.contains_key("__bytes_hex__") => J::String(format!(
            "<bytes: {}>",
            m["__bytes_hex__"].as_str().unwrap().len() / 2
        )),
        J::Object(m) => J::Object(m.iter().map(|(k, v)| (k.clone(), shown(v))).collect()),
        J::Array(a) => J::Array(a.iter().map(shown).collect()),
        other => other.clone(),
    }
}

/// The non-tensor entries of `ck` equal megatron-core's `common.pt` and objects.
fn nontensors_equal(case: &str, ck: &Checkpoint, dir: &Path) {
    let want: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("oracle/nontensor.json")).unwrap()).unwrap();
    let got = |name: &str| {
        ck.extras
            .iter()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("{case}: no entry `{name}`"))
    };
    let common = want["common.pt"].as_object().unwrap();
    assert!(!common.is_empty());
    for (k, v) in common {
        let e = got(k);
        assert_eq!(e.origin, "common.pt", "{case}: `{k}`");
        assert_eq!(e.value, shown(v), "{case}: common.pt `{k}`");
    }
    let objects = want["sharded_objects"].as_object().unwrap();
    assert!(objects.len() >= 2);
    for (k, v) in objects {
        // megatron-core's item holds `torch.save([data])`; its loader unwraps the list
        let item = serde_json::Value::Array(vec![shown(v)]);
        assert_eq!(got(k).value, item, "{case}: object `{k}`");
    }
    let common_count = ck.extras.iter().filter(|e| e.origin == "common.pt").count();
    assert_eq!(common_count + objects.len(), ck.extras.len(), "{case}");
}

#[test]
fn every_fixture_consolidates_to_megatrons_own_loading() {
    let d = tempfile::tempdir().unwrap();
    for (name, dir, info) in cases() {
        let ckpt = dir.join("checkpoint");
        let ck = Checkpoint::open(&ckpt).unwrap();
        assert_eq!(ck.format, Format::MEGATRON, "{name}");
        let procs = info["processes"].as_u64().unwrap();
        assert_eq!(ck.ranks as u64, procs, "{name}");
        // two writer threads per rank: __R_0 and __R_1
        assert!(ckpt.join("__0_1.distcp").is_file(), "{name}");
        let want = oracle(&dir);
        same(&name, "open", &read_all(&ck), &want);
        nontensors_equal(&name, &ck, &dir);
        for ext in ["safetensors", "pt"] {
            let out = d.path().join(format!("{name}.{ext}"));
            convert(&ckpt, &out, &["--to", "1", "-q"]);
            same(
                &name,
                ext,
                &read_all(&Checkpoint::open(&out).unwrap()),
                &want,
            );
        }
        // lazily opened (the loader's way) it reads the same
        let lazy = Checkpoint::open_lazy(&ckpt, None).unwrap();
        same(&name, "lazy", &read_all(&lazy), &want);
    }
}

#[test]
fn resharded_n_to_m_to_1_is_byte_exact_and_keeps_the_rest() {
    let d = tempfile::tempdir().unwrap();
    for (name, dir, info) in cases() {
        let ckpt = dir.join("checkpoint");
        let want = oracle(&dir);
        let src = Checkpoint::open(&ckpt).unwrap();
        let procs = info["processes"].as_u64().unwrap();
        for m in [1u64, 3, 4] {
            let mid = d.path().join(format!("{name}_m{m}"));
            let to = m.to_string();
            let mut args = vec!["--format", "megatron", "--to", to.as_str(), "-q"];
            if m != procs {
                args.extend(["--per-rank-state", "keep"]);
            }
            convert(&ckpt, &mid, &args);
            for f in ["metadata.json", "common.pt", ".metadata"] {
                assert!(mid.join(f).is_file(), "{name} at {m}: {f}");
            }
            assert_eq!(
                std::fs::read(mid.join("metadata.json")).unwrap(),
                std::fs::read(ckpt.join("metadata.json")).unwrap(),
                "{name}"
            );
            let ck = Checkpoint::open(&mid).unwrap();
            assert_eq!(
                (ck.format, ck.ranks as u64),
                (Format::MEGATRON, m),
                "{name}"
            );
            same(&name, &format!("at {m}"), &read_all(&ck), &want);
            nontensors_equal(&name, &ck, &dir);
            let back = d.path().join(format!("{name}_m{m}.safetensors"));
            convert(&mid, &back, &["--to", "1", "-q"]);
            same(
                &name,
                &format!("{m} to 1"),
                &read_all(&Checkpoint::open(&back).unwrap()),
                &want,
            );
        }
        // and through a plain DCP checkpoint
        let dcp = d.path().join(format!("{name}_dcp"));
        convert(
            &ckpt,
            &dcp,
            &[
                "--format",
                "dcp",
                "--to",
                "2",
                "-q",
                "--per-rank-state",
                "keep",
            ],
        );
        let ck = Checkpoint::open(&dcp).unwrap();
        assert_eq!(ck.format, Format::DCP);
        same(&name, "dcp", &read_all(&ck), &want);
        assert_eq!(ck.extras.len(), src.extras.len(), "{name}");
    }
}

#[test]
fn flattened_optimizer_tensors_are_read_in_their_real_shapes() {
    let mut seen = 0;
    for (name, dir, info) in cases() {
        if !info["flat"].as_bool().unwrap() {
            continue;
        }
        seen += 1;
        let ck = Checkpoint::open(dir.join("checkpoint")).unwrap();
        let keys = info["keys"].as_object().unwrap();
        for (k, v) in keys
            .iter()
            .filter(|(_, v)| v.get("dp_flat_ranges").is_some())
        {
            let t = ck.tensor(k).expect("tensor");
            let shape: Vec<u64> = v["global_shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(t.shape, shape, "{name}: `{k}`");
            // the stored chunks ([X/x, Y/y, x*y] flat ranges) are cut into boxes of the real
            // tensor, which together cover it once
            let covered: u64 = t.pieces.iter().map(|p| p.region.volume()).sum();
            assert_eq!(covered, shape.iter().product::<u64>(), "{name}: `{k}`");
        }
        let out = common::ok(&["inspect", s(&dir.join("checkpoint"))]);
        assert!(
            out.contains("optimizer.state.exp_avg.embedding.word_embeddings.weight")
                && out.contains("[16, 8]"),
            "{out}"
        );
    }
    assert!(seen >= 2);
}

#[test]
fn a_megatron_folder_without_its_files_is_a_dcp_checkpoint_or_refused() {
    let d = tempfile::tempdir().unwrap();
    let (name, dir, _) = cases()
        .into_iter()
        .find(|c| c.2["flat"].as_bool() == Some(true))
        .unwrap();
    let want = oracle(&dir);
    let copy = d.path().join("c");
    common::copy_dir(&dir.join("checkpoint"), &copy);
    // without metadata.json it is megatron's DCP part, read as DCP (flattened tensors too)
    let json = std::fs::read(copy.join("metadata.json")).unwrap();
    std::fs::remove_file(copy.join("metadata.json")).unwrap();
    let ck = Checkpoint::open(&copy).unwrap();
    assert_eq!(ck.format, Format::DCP);
    same(&name, "as dcp", &read_all(&ck), &want);
    // another backend, bad JSON, no common.pt: one line naming the file
    let meta = copy.join("metadata.json");
    std::fs::write(
        &meta,
        br#"{"sharded_backend": "zarr", "common_backend": "torch"}"#,
    )
    .unwrap();
    fails(
        &["inspect", s(&copy)],
        "metadata.json: names the sharded backend `zarr`; reshard reads megatron-core's `torch_dist`",
    );
    std::fs::write(&meta, b"{not json").unwrap();
    fails(&["inspect", s(&copy)], "metadata.json: is not valid JSON");
    std::fs::write(&meta, &json).unwrap();
    assert_eq!(Checkpoint::open(&copy).unwrap().format, Format::MEGATRON);
    // without common.pt, megatron-core's marker is gone: the DCP part is read as DCP
    std::fs::rename(copy.join("common.pt"), d.path().join("common.pt")).unwrap();
    let ck = Checkpoint::open(&copy).unwrap();
    assert_eq!(ck.format, Format::DCP);
    assert!(ck.extras.iter().all(|e| e.origin != "common.pt"));
    std::fs::write(copy.join("common.pt"), b"not a zip").unwrap();
    fails(&["inspect", s(&copy)], "common.pt");
    std::fs::rename(d.path().join("common.pt"), copy.join("common.pt")).unwrap();
    // a truncated data file of the second writer thread
    common::set_len(&copy.join("__1_1.distcp"), 100);
    fails(&["inspect", s(&copy)], "__1_1.distcp: is truncated");
}

#[test]
fn a_zarr_checkpoint_is_refused_by_name_and_a_stray_metadata_json_is_not_megatrons() {
    let d = tempfile::tempdir().unwrap();
    // megatron-core's older backend: metadata.json, common.pt and a folder per array
    let zarr = d.path().join("zarr");
    std::fs::create_dir_all(zarr.join("embedding.word_embeddings.weight")).unwrap();
    std::fs::write(
        zarr.join("metadata.json"),
        br#"{"sharded_backend": "zarr", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#,
    )
    .unwrap();
    std::fs::copy(
        fixture("megatron/mcore016_tp2_dp1/checkpoint/common.pt"),
        zarr.join("common.pt"),
    )
    .unwrap();
    fails(
        &["inspect", s(&zarr)],
        "metadata.json: names the sharded backend `zarr`; reshard reads megatron-core's `torch_dist`",
    );
    // a DCP checkpoint with some other metadata.json beside it stays DCP
    let dcp = d.path().join("dcp");
    common::copy_dir(&fixture("fsdp2_w2_f32/checkpoint"), &dcp);
    std::fs::write(dcp.join("metadata.json"), b"{\"run\": 3}").unwrap();
    assert_eq!(Checkpoint::open(&dcp).unwrap().format, Format::DCP);
}

#[test]
fn sharded_objects_are_per_rank_state_and_keys_select() {
    let d = tempfile::tempdir().unwrap();
    let (_, dir, _) = cases()
        .into_iter()
        .find(|c| c.0 == "mcore016_tp2_dp2")
        .unwrap();
    let ckpt = dir.join("checkpoint");
    // rng_state/shard_0.1_1.2 and dataloader_state/shard_3_4 belong to ranks: not resharded
    // without a policy
    fails(
        &[
            "convert",
            s(&ckpt),
            s(&d.path().join("x")),
            "--format",
            "megatron",
            "--to",
            "3",
        ],
        "is per-rank state saved by 4 rank(s), which cannot be resharded to 3",
    );
    let out = d.path().join("drop");
    megatron_at_3(&ckpt, &out, "drop");
    let ck = Checkpoint::open(&out).unwrap();
    assert!(
        ck.extras.iter().all(|e| e.origin == "common.pt"),
        "{:?}",
        ck.extras
    );
    // --include with megatron's names
    let only = d.path().join("only.safetensors");
    convert(
        &ckpt,
        &only,
        &["--include", "decoder.layers.*", "--to", "1", "-q"],
    );
    let got = read_all(&Checkpoint::open(&only).unwrap());
    let want: Tensors = oracle(&dir)
        .into_iter()
        .filter(|(k, _)| k.starts_with("decoder.layers."))
        .collect();
    assert_eq!(want.len(), 3);
    assert_eq!(got, want);
}

#[test]
fn megatron_lm_arguments_in_common_pt_come_back_as_a_namespace() {
    // Megatron-LM saves its arguments as an argparse.Namespace in common.pt
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    common::copy_dir(&fixture("megatron/mcore016_tp2_dp1/checkpoint"), &src);
    std::fs::copy(
        fixture("megatron/common_with_args.pt"),
        src.join("common.pt"),
    )
    .unwrap();
    let ck = Checkpoint::open(&src).unwrap();
    let args = ck.extras.iter().find(|e| e.name == "args").unwrap();
    assert_eq!(args.origin, "common.pt");
    assert!(args.pickle.is_some());
    let out = d.path().join("out");
    megatron_at_3(&src, &out, "keep");
    let back = Checkpoint::open(&out).unwrap();
    for e in ck.extras.iter().filter(|e| e.origin == "common.pt") {
        let b = back.extras.iter().find(|x| x.name == e.name).unwrap();
        assert_eq!((b.origin, &b.value), (e.origin, &e.value), "`{}`", e.name);
        assert!(
            b.pickle == e.pickle,
            "`{}`: the decoded values differ",
            e.name
        );
    }
}

#[test]
fn hostile_flattened_tensors_are_refused_or_read_whole() {
    // tests/fixtures/megatron/hostile (mk.py, ov.py): chunks of the view that overlap (which
    // cut into boxes of the real tensor would pass as replicas), a chunk over three blocks,
    // an empty real tensor
    let h = |c: &str| fixture(&format!("megatron/hostile/{c}"));
    fails(
        &["inspect", s(&h("overlap"))],
        ".metadata: tensor `w`: pieces [0:1, 0:1, 3:6] and [0:1, 0:1, 1:6] overlap",
    );
    fails(
        &["inspect", s(&h("zero3"))],
        ".metadata: tensor `w`: chunk [0:3, 0:1, 0:0] of a block-flattened tensor spans more than one block",
    );
    let ck = Checkpoint::open(h("zero")).unwrap();
    assert_eq!(ck.tensor("w").expect("w").shape, vec![0, 4]);
    let d = tempfile::tempdir().unwrap();
    convert(
        &h("zero"),
        &d.path().join("z.safetensors"),
        &["--to", "1", "-q"],
    );
}

/// `convert SRC OUT --format megatron --to 3 --per-rank-state POLICY -q`.
fn megatron_at_3(src: &std::path::Path, out: &std::path::Path, policy: &str) {
    convert(
        src,
        out,
        &[
            "--format",
            "megatron",
            "--to",
            "3",
            "--per-rank-state",
            policy,
            "-q",
        ],
    );
}
