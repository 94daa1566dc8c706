//! Reading real PyTorch Distributed Checkpoints (written by torch 2.15 and 2.1, see
//! tests/fixtures/README.md and each case.json) and checking every tensor and non-tensor
//! value against the oracles gathered in the live jobs; then converting them with the CLI,
//! N → 1 and N → M → 1, and refusing damaged checkpoints with one line naming the file.

use crate::common::{
    assert_same, convert, copy_fixture, fails_all, fixture, json_object, ok, read_all, read_st, s,
    set_len, Tensors,
};
use reshard::formats::{Checkpoint, Format};
use reshard::layout::Region;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every DCP fixture.
const CASES: &[&str] = &[
    "fsdp2_w4_f32",
    "fsdp2_w3_bf16",
    "fsdp2_w2_f32",
    "dtensor2d_w4",
    "fsdp1_w4_f32",
    "fabric_fsdp1_w4_f32",
    "fabric_fsdp1_w4_f32_torch21",
    "fsdp2_w2_f32_nocoll",
    "fsdp2_w2_f32_zstd",
    "fmt_fs_safetensors_w2",
    "fsdp2_w4_f32_threads2",
    "torch21_shardedtensor_w3",
    "fsdp2_w4_f32_shard1",
    "fsdp2_w2_perrank",
    "fsdp2_w2_tied",
];

fn checkpoint(case: &str) -> PathBuf {
    fixture(case).join("checkpoint")
}

fn oracle(case: &str) -> Tensors {
    read_st(&fixture(case).join("oracle/full.safetensors")).0
}

fn nontensor(case: &str) -> serde_json::Map<String, serde_json::Value> {
    json_object(&fixture(case).join("oracle/nontensor.json"))
}

#[test]
fn every_fixture_reads_exactly_like_its_oracle() {
    for case in CASES {
        let ck = Checkpoint::open(checkpoint(case)).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(ck.format, Format::DCP, "{case}");
        assert_same(case, "read_region", &read_all(&ck), &oracle(case));

        // Non-tensor items: same keys as the oracle, same JSON values.
        let nt = nontensor(case);
        let dcp: BTreeMap<&str, &serde_json::Value> = ck
            .extras
            .iter()
            .filter(|x| x.origin == "dcp")
            .map(|x| (x.name.as_str(), &x.value))
            .collect();
        let names: BTreeSet<&str> = dcp.keys().copied().collect();
        let oracle_names: BTreeSet<&str> = nt.keys().map(String::as_str).collect();
        assert_eq!(names, oracle_names, "{case}: non-tensor keys");
        for (k, v) in &nt {
            assert_eq!(dcp[k.as_str()], v, "{case}: value of `{k}`");
        }
        for x in &ck.extras {
            assert!(x.pickle.is_some(), "{case}: `{}` keeps its pickle", x.name);
        }
        // Every key has its state-dict path.
        for t in &ck.tensors {
            assert!(
                ck.paths.contains_key(&t.name),
                "{case}: no path for {}",
                t.name
            );
        }
    }
}

#[test]
fn ranks_files_producer_and_meta_pt() {
    let expect = [
        ("fsdp2_w4_f32", 4, 4),
        ("fsdp2_w3_bf16", 3, 3),
        ("fsdp2_w2_f32_nocoll", 2, 2),
        ("fsdp2_w2_f32_zstd", 2, 3), // + the scratch file
        ("fsdp2_w4_f32_threads2", 4, 8),
        ("torch21_shardedtensor_w3", 3, 3),
        ("fabric_fsdp1_w4_f32_torch21", 4, 4),
    ];
    for (case, ranks, files) in expect {
        let ck = Checkpoint::open(checkpoint(case)).unwrap();
        assert_eq!((ck.ranks, ck.files.len()), (ranks, files), "{case}");
    }
    for (case, producer) in [
        ("fsdp2_w4_f32", "torch >= 2.4 (DCP 1.0.0)"),
        ("torch21_shardedtensor_w3", "torch 2.1–2.3 (no DCP version)"),
        (
            "fabric_fsdp1_w4_f32_torch21",
            "torch 2.1–2.3 (no DCP version)",
        ),
    ] {
        let ck = Checkpoint::open(checkpoint(case)).unwrap();
        assert_eq!(ck.producer.as_deref(), Some(producer), "{case}");
    }
    for case in ["fabric_fsdp1_w4_f32", "fabric_fsdp1_w4_f32_torch21"] {
        let ck = Checkpoint::open(checkpoint(case)).unwrap();
        let meta: Vec<_> = ck.extras.iter().filter(|x| x.origin == "meta.pt").collect();
        assert_eq!(meta.len(), 1, "{case}");
        assert_eq!(meta[0].name, "step");
        assert_eq!(meta[0].value, serde_json::json!(1));
    }
    // The threads2 ranks each wrote two files; pieces carry the rank of their file.
    let ck = Checkpoint::open(checkpoint("fsdp2_w4_f32_threads2")).unwrap();
    for t in &ck.tensors {
        for p in &t.pieces {
            let name = ck.files[p.loc.file as usize].file_name().unwrap();
            let want = format!("__{}_", p.rank);
            assert!(name.to_str().unwrap().starts_with(&want), "{}", t.name);
        }
    }
}

/// The byte offsets found by parsing the items equal those torch's own zip reader found
/// (`data_abs_offset` in the shared fixtures' manifest.json).
#[test]
fn piece_offsets_match_the_manifests() {
    for case in [
        "fsdp2_w4_f32_threads2",
        "fsdp2_w4_f32_shard1",
        "torch21_shardedtensor_w3",
        "fmt_fs_safetensors_w2",
        "fsdp2_w2_f32_nocoll",
    ] {
        let text = std::fs::read_to_string(fixture(case).join("oracle/manifest.json")).unwrap();
        let m: serde_json::Value = serde_json::from_str(&text).unwrap();
        let ck = Checkpoint::open(checkpoint(case)).unwrap();
        let mut checked = 0;
        for t in &ck.tensors {
            let chunks = m["keys"][&t.name]["chunks"].as_array().unwrap();
            for p in t.pieces.iter().filter(|p| !p.region.is_empty()) {
                let file = ck.files[p.loc.file as usize].file_name().unwrap();
                let found = chunks.iter().find(|c| {
                    let r = Region::new(
                        serde_json::from_value::<Vec<u64>>(c["offsets"].clone()).unwrap(),
                        serde_json::from_value::<Vec<u64>>(c["sizes"].clone()).unwrap(),
                    );
                    r == p.region && c["file"].as_str() == file.to_str()
                });
                let Some(c) = found else {
                    // use_collectives=False: replicated chunks are listed by every rank and
                    // the manifest records one of them.
                    assert_eq!(case, "fsdp2_w2_f32_nocoll", "{}: {}", t.name, p.region);
                    continue;
                };
                let item = if c["item"].is_object() {
                    &c["item"]
                } else {
                    &c["safetensors_item"]
                };
                assert_eq!(
                    Some(p.loc.offset),
                    item["data_abs_offset"].as_u64(),
                    "{case}: {} {}",
                    t.name,
                    p.region
                );
                checked += 1;
            }
        }
        assert!(checked > 10, "{case}: only {checked} pieces checked");
    }
}

#[test]
fn cli_consolidates_every_fixture_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    for case in CASES {
        let out = tmp.path().join(format!("{case}.safetensors"));
        convert(&checkpoint(case), &out, &["--to", "1"]);
        assert_same(case, "convert --to 1", &read_st(&out).0, &oracle(case));
    }
}

#[test]
fn cli_reshards_n_to_m_to_one() {
    let tmp = tempfile::tempdir().unwrap();
    for &case in CASES {
        let want = oracle(case);
        for m in [1, 2, 3, 5, 8] {
            let mid = tmp.path().join(format!("{case}-{m}"));
            let back = tmp.path().join(format!("{case}-{m}.safetensors"));
            let ms = m.to_string();
            convert(
                &checkpoint(case),
                &mid,
                &[
                    "--to",
                    &ms,
                    "--format",
                    "hf-storage",
                    "--per-rank-state",
                    "keep",
                ],
            );
            let shards = std::fs::read_dir(&mid).unwrap().count();
            assert!(shards >= m, "{case} → {m}: {shards} files");
            convert(&mid, &back, &["--to", "1"]);
            assert_same(case, &format!("→ {m} → 1"), &read_st(&back).0, &want);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Damaged checkpoints

/// A writable copy of a fixture's checkpoint.
/// Replace the first occurrence of `from` after `anchor` in `file` by `to`.
fn patch_after(file: &Path, anchor: &[u8], from: &[u8], to: &[u8]) {
    let mut b = std::fs::read(file).unwrap();
    let find = |hay: &[u8], needle: &[u8], start: usize| {
        hay[start..]
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + start)
    };
    let a = find(&b, anchor, 0).expect("anchor not found");
    let at = find(&b, from, a + anchor.len()).expect("pattern not found");
    b[at..at + to.len()].copy_from_slice(to);
    std::fs::write(file, b).unwrap();
}

/// Replace every occurrence of `from` by `to` (same length).
fn patch_all(file: &Path, from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let mut b = std::fs::read(file).unwrap();
    let mut n = 0;
    let mut i = 0;
    while i + from.len() <= b.len() {
        if &b[i..i + from.len()] == from {
            b[i..i + from.len()].copy_from_slice(to);
            n += 1;
            i += from.len();
        } else {
            i += 1;
        }
    }
    assert!(n > 0, "pattern not found");
    std::fs::write(file, b).unwrap();
}

/// Set the CRC-32 of every `archive/data.pkl` central-directory record to 0 ("not computed").
fn zero_pickle_crcs(file: &Path) {
    let mut b = std::fs::read(file).unwrap();
    let name = b"archive/data.pkl";
    let mut i = 0;
    while i + 46 + name.len() <= b.len() {
        if &b[i..i + 4] == b"PK\x01\x02" && &b[i + 46..i + 46 + name.len()] == name {
            b[i + 16..i + 20].fill(0);
        }
        i += 1;
    }
    std::fs::write(file, b).unwrap();
}

fn convert_fails(ck: &Path, needles: &[&str]) -> String {
    let out = ck.parent().unwrap().join("out.safetensors");
    let err = fails_all(&["convert", s(ck), s(&out), "--to", "1"], needles);
    assert!(!out.exists(), "no output on failure");
    // the library refuses it too
    assert!(Checkpoint::open(ck).is_err());
    err
}

#[test]
fn truncated_metadata_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("fsdp2_w4_f32", tmp.path());
    let meta = ck.join(".metadata");
    let b = std::fs::read(&meta).unwrap();
    std::fs::write(&meta, &b[..b.len() / 2]).unwrap();
    convert_fails(&ck, &[".metadata", "cannot decode the metadata pickle"]);
    std::fs::write(&meta, &b[..3]).unwrap();
    convert_fails(&ck, &[".metadata"]);
}

#[test]
fn missing_and_truncated_data_files_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("fsdp2_w4_f32", tmp.path());
    std::fs::remove_file(ck.join("__2_0.distcp")).unwrap();
    convert_fails(&ck, &["__2_0.distcp", "is missing"]);

    let ck = copy_fixture("fabric_fsdp1_w4_f32_torch21", tmp.path());
    let f = ck.join("__3_0.distcp");
    let len = std::fs::metadata(&f).unwrap().len();
    set_len(&f, len / 2);
    convert_fails(&ck, &["__3_0.distcp", "is truncated"]);

    // The safetensors-format fixture: a truncated blob.
    let ck = copy_fixture("fmt_fs_safetensors_w2", tmp.path());
    let f = ck.join("__0_0.distcp");
    let len = std::fs::metadata(&f).unwrap().len();
    set_len(&f, len - 10);
    convert_fails(&ck, &["__0_0.distcp", "truncated"]);
}

#[test]
fn a_chunk_outside_its_tensor_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("fsdp2_w4_f32", tmp.path());
    // model.cls is the first tensor: its global size (3, 12) is `K 3 K 12 TUPLE2` right
    // after its name; make it (2, 12) so the chunk at row 2 lies outside.
    patch_after(
        &ck.join(".metadata"),
        b"model.cls",
        b"K\x03K\x0c\x86",
        b"K\x02K\x0c\x86",
    );
    convert_fails(
        &ck,
        &[
            ".metadata",
            "model.cls",
            "outside the tensor's shape [2, 12]",
        ],
    );

    // A chunk moved (offsets patched, not its storage key): no storage entry for it.
    let ck = copy_fixture("torch21_shardedtensor_w3", tmp.path());
    // sharded.w_dim0_13x4's second chunk has offsets (5, 0): `K 5 K 0 TUPLE2`.
    patch_after(
        &ck.join(".metadata"),
        b"sharded.w_dim0_13x4",
        b"K\x05K\x00\x86",
        b"K\x06K\x00\x86",
    );
    convert_fails(&ck, &[".metadata", "no storage_data entry", "w_dim0_13x4"]);
}

#[test]
fn unknown_globals_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("fsdp2_w4_f32", tmp.path());
    patch_all(
        &ck.join(".metadata"),
        b"torch.distributed.checkpoint.filesystem",
        b"torch.distributed.checkpoint.filesystex",
    );
    convert_fails(
        &ck,
        &[
            ".metadata",
            "unknown global `torch.distributed.checkpoint.filesystex._StorageInfo`",
        ],
    );
    // in an item's data.pkl (CRCs zeroed, as writers without CRCs leave them)
    let ck = copy_fixture("fabric_fsdp1_w4_f32_torch21", tmp.path());
    patch_all(&ck.join("__1_0.distcp"), b"torch._utils", b"torch._utilz");
    zero_pickle_crcs(&ck.join("__1_0.distcp"));
    convert_fails(&ck, &["__1_0.distcp", "unknown global `torch._utilz"]);
}

#[test]
fn corrupt_zip_records_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("fsdp2_w4_f32", tmp.path());
    let f = ck.join("__0_0.distcp");
    let mut b = std::fs::read(&f).unwrap();
    assert_eq!(&b[..4], b"PK\x03\x04");
    b[0] = b'X';
    std::fs::write(&f, &b).unwrap();
    convert_fails(&ck, &["__0_0.distcp", "local header signature"]);

    // Every item's data.pkl local header signature flipped: all refused the same way.
    let ck = copy_fixture("torch21_shardedtensor_w3", tmp.path());
    patch_all(
        &ck.join("__1_0.distcp"),
        b"PK\x03\x04\x00\x00\x08\x08",
        b"PK\x03\x05\x00\x00\x08\x08",
    );
    convert_fails(&ck, &["__1_0.distcp", "local header signature"]);
}

#[test]
fn paths_leaving_the_directory_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("torch21_shardedtensor_w3", tmp.path());
    // `__1_0.distcp` and `../x_0.distcp` have the same length.
    patch_all(
        &ck.join(".metadata"),
        b"__1_0.distcp",
        b"../x_0.distcp"[..12].as_ref(),
    );
    convert_fails(&ck, &[".metadata", "leaves the checkpoint directory"]);

    #[cfg(unix)]
    {
        let ck = copy_fixture("torch21_shardedtensor_w3", tmp.path().join("b").as_path());
        let outside = tmp.path().join("elsewhere.distcp");
        std::fs::rename(ck.join("__2_0.distcp"), &outside).unwrap();
        std::os::unix::fs::symlink(&outside, ck.join("__2_0.distcp")).unwrap();
        convert_fails(&ck, &["__2_0.distcp", "outside the checkpoint directory"]);
    }
}

#[test]
fn unknown_stream_transforms_are_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = copy_fixture("fsdp2_w2_f32_zstd", tmp.path());
    patch_all(&ck.join(".metadata"), b"stream.zstd/1", b"stream.lz4x/1");
    convert_fails(&ck, &[".metadata", "stream transform `stream.lz4x/1`"]);

    // A corrupt zstd stream.
    let ck = copy_fixture("fsdp2_w2_f32_zstd", tmp.path().join("b").as_path());
    let f = ck.join("__1_0.distcp");
    let mut b = std::fs::read(&f).unwrap();
    assert_eq!(&b[..4], b"\x28\xb5\x2f\xfd");
    b[0] = 0;
    std::fs::write(&f, &b).unwrap();
    convert_fails(&ck, &["__1_0.distcp", "zstd"]);
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn mutate(file: &Path, flips: &[(prop::sample::Index, u8)], cut: Option<prop::sample::Index>) {
        let mut b = std::fs::read(file).unwrap();
        let n = b.len();
        for (i, v) in flips {
            b[i.index(n)] = *v;
        }
        if let Some(c) = cut {
            b.truncate(c.index(n));
        }
        std::fs::write(file, b).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 96,
            failure_persistence: crate::common::regressions("dcp_read"),
            ..ProptestConfig::default()
        })]

        /// Damaged metadata or data files are read or refused, never a panic; what is read
        /// can be read back without a panic either.
        #[test]
        fn damaged_checkpoints_never_panic(
            case in prop::sample::select(vec!["torch21_shardedtensor_w3", "fsdp2_w2_f32_zstd"]),
            target in 0usize..3,
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in proptest::option::of(any::<prop::sample::Index>()),
        ) {
            let tmp = tempfile::tempdir().unwrap();
            let ck = copy_fixture(case, tmp.path());
            let file = match target {
                0 => ck.join(".metadata"),
                1 => ck.join("__0_0.distcp"),
                _ => ck.join("__1_0.distcp"),
            };
            mutate(&file, &flips, cut);
            if let Ok(c) = Checkpoint::open(&ck) {
                for t in &c.tensors {
                    let _ = c.read_region(&t.name, &Region::full(&t.shape), None);
                }
            }
        }
    }
}

#[test]
fn items_disagreeing_with_the_metadata_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    // dtype: the first `float32` global (memoised for every f32 tensor) becomes float64.
    let ck = copy_fixture("torch21_shardedtensor_w3", tmp.path());
    patch_after(
        &ck.join(".metadata"),
        b"w_dim0_13x4",
        b"float32",
        b"float64",
    );
    convert_fails(
        &ck,
        &[
            "__0_0.distcp",
            "w_dim0_13x4",
            "holds F32 but the metadata says F64",
        ],
    );
    // shape: chunk 0 of sharded.w_dim0_13x4 claims sizes (4, 4), its item holds (5, 4).
    let ck = copy_fixture("torch21_shardedtensor_w3", tmp.path().join("b").as_path());
    patch_after(
        &ck.join(".metadata"),
        b"sharded.w_dim0_13x4",
        b"K\x05K\x04\x86",
        b"K\x04K\x04\x86",
    );
    convert_fails(
        &ck,
        &["__0_0.distcp", "has shape [5, 4] but its chunk [0:4, 0:4]"],
    );
}

#[test]
fn non_tensor_entries_survive_n_to_m_to_one() {
    let tmp = tempfile::tempdir().unwrap();
    let case = "fabric_fsdp1_w4_f32_torch21";
    let mid = tmp.path().join("m2");
    let out = convert(
        &checkpoint(case),
        &mid,
        &["--to", "2", "--format", "hf-storage"],
    );
    assert!(out.contains("kept 2 non-tensor entries as JSON"), "{out}");
    let back = tmp.path().join("one.safetensors");
    convert(&mid, &back, &["--to", "1"]);
    let ck = reshard::formats::Checkpoint::open(&back).unwrap();
    let names: Vec<&str> = ck.extras.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, vec!["optimizer.param_groups", "step"]);
    assert_eq!(ck.extras[1].value, serde_json::json!(1));
    let groups = &ck.extras[0].value;
    assert_eq!(groups[0]["betas"], serde_json::json!([0.9, 0.95]));
    let insp = ok(&["inspect", s(&back)]);
    assert!(insp.contains("step [reshard.extras] = 1"), "{insp}");
}

#[test]
fn a_dcp_source_resharded_to_m_ranks_stays_dcp_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let case = "fsdp2_w4_f32";
    let run = |args: &[&str]| -> String {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_reshard"))
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let drop = ["--per-rank-state", "drop"];
    let plan = run(&[&["plan", s(&checkpoint(case)), "--to", "2"][..], &drop].concat());
    assert!(
        plan.contains("-> dcp (2 rank(s)); output format dcp: the source's format"),
        "{plan}"
    );
    let out = tmp.path().join("two");
    let text = run(&[
        &["convert", s(&checkpoint(case)), s(&out), "--to", "2"][..],
        &drop,
    ]
    .concat());
    assert!(
        text.contains("output format dcp: the source's format"),
        "{text}"
    );
    let ck = reshard::formats::Checkpoint::open(&out).unwrap();
    assert_eq!((ck.format, ck.ranks), (reshard::formats::Format::DCP, 2));
    // one rank into a directory is still a consolidated Hugging Face checkpoint
    let one = tmp.path().join("one");
    let text = run(&["convert", s(&checkpoint(case)), s(&one), "--to", "1"]);
    assert!(
        text.contains("output format hf: a consolidated model in a directory"),
        "{text}"
    );
}
