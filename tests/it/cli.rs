//! End-to-end tests of the `reshard` binary on checkpoints written by the tests themselves.

use crate::common::*;
use std::path::Path;

#[test]
fn consolidates_four_ranks_into_one_file_byte_for_byte() {
    let (d, ck) = synthetic(4);
    let before = snapshot(&ck);
    let out = d.path().join("full.safetensors");
    let msg = convert(&ck, &out, &["--to", "1"]);
    assert!(msg.contains("safetensors, 1 rank(s)"), "{msg}");
    assert_eq!(read_safetensors(&out), model());
    assert_eq!(snapshot(&ck), before, "the source changed");
    assert_eq!(names(d.path()), vec!["ck", "full.safetensors"]);
}

#[test]
fn reshards_n_to_m_to_one_for_many_m() {
    let (d, ck) = synthetic(4);
    for m in [1usize, 2, 3, 5, 8, 16] {
        let mid = d.path().join(format!("w{m}"));
        convert(
            &ck,
            &mid,
            &["--to", &m.to_string(), "--format", "hf-storage", "-q"],
        );
        let insp = ok(&["inspect", s(&mid)]);
        assert!(
            insp.contains(&format!("hf-storage checkpoint, {m} rank(s)")),
            "{insp}"
        );
        let back = d.path().join(format!("back{m}.safetensors"));
        convert(&mid, &back, &["--to", "1"]);
        assert_eq!(read_safetensors(&back), model(), "4 -> {m} -> 1");
    }
}

#[test]
fn hf_sharded_output_respects_max_shard_size_and_reads_back() {
    let (d, ck) = synthetic(3);
    let hf = d.path().join("hf");
    convert(&ck, &hf, &["--to", "1", "--max-shard-size", "1KB"]);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(hf.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), model().len());
    let mut total = 0;
    for (name, file) in map {
        let t = read_safetensors(&hf.join(file.as_str().unwrap()));
        assert_eq!(&t[name], &model()[name]);
        total += t[name].data.len();
    }
    assert_eq!(index["metadata"]["total_size"], total);
    let files = names(&hf).len() - 1;
    assert!(files > 2, "expected several shards under 1 KB, got {files}");
    let back = d.path().join("back.safetensors");
    convert(&hf, &back, &["--to", "1"]);
    assert_eq!(read_safetensors(&back), model());
}

#[test]
fn include_exclude_and_dtype_cast() {
    let (d, ck) = synthetic(2);
    let out = d.path().join("m.safetensors");
    convert(
        &ck,
        &out,
        &[
            "--to",
            "1",
            "--exclude",
            "opt.*",
            "--include",
            "model.*",
            "--dtype",
            "f32",
        ],
    );
    let got = read_safetensors(&out);
    let want = model();
    assert_eq!(got.len(), want.len() - 2);
    for (n, t) in &got {
        let w = &want[n];
        assert_eq!(t.shape, w.shape);
        match w.dtype {
            safetensors::Dtype::BF16 => {
                assert_eq!(t.dtype, safetensors::Dtype::F32);
                for (i, c) in w.data.chunks(2).enumerate() {
                    let f = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                    assert_eq!(&t.data[4 * i..4 * i + 4], &f.to_le_bytes(), "{n}[{i}]");
                }
            }
            safetensors::Dtype::F16 | safetensors::Dtype::F64 => {
                assert_eq!(t.dtype, safetensors::Dtype::F32)
            }
            _ => assert_eq!(t, w, "{n}: non-floating tensors and f32 are untouched"),
        }
    }
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("x.safetensors")),
            "--to",
            "1",
            "--include",
            "nothing.*",
        ],
        "no tensor",
    );
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("x.safetensors")),
            "--to",
            "1",
            "--dtype",
            "i32",
        ],
        "only floating dtypes",
    );
}

#[test]
fn layout_file_2d_mesh_and_flat() {
    let (d, ck) = synthetic(4);
    let lay = d.path().join("tp.json");
    std::fs::write(
        &lay,
        r#"{"mesh": [2, 2], "rules": [{"match": "*.weight", "placements": ["Shard(0)", "Shard(1)"]},
                                     {"match": "model.cube", "placements": ["StridedShard(2, 2)", "EvenShard(0)"]}]}"#,
    )
    .unwrap();
    let out = d.path().join("tp");
    convert(&ck, &out, &["--layout", s(&lay)]);
    let insp = ok(&["inspect", s(&out)]);
    assert!(insp.contains("4 rank(s)"), "{insp}");
    assert!(insp.contains("split along dims [0, 1]"), "{insp}");
    let back = d.path().join("back.safetensors");
    convert(&out, &back, &["--to", "1"]);
    assert_eq!(read_safetensors(&back), model());

    let flat = d.path().join("flat.json");
    std::fs::write(&flat, r#"{"mesh": [5], "flat": true}"#).unwrap();
    let out = d.path().join("flat");
    convert(&ck, &out, &["--layout", s(&flat), "--to", "5"]);
    let back = d.path().join("back2.safetensors");
    convert(&out, &back, &["--to", "1"]);
    assert_eq!(read_safetensors(&back), model());
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("z")),
            "--layout",
            s(&flat),
            "--to",
            "4",
        ],
        "disagrees",
    );
    std::fs::write(
        &flat,
        r#"{"mesh": [2], "rules": [{"match": "*", "placements": ["Shard(0)", "R"]}]}"#,
    )
    .unwrap();
    fails(
        &["plan", s(&ck), "--layout", s(&flat)],
        "placements for a 1-d mesh",
    );
}

#[test]
fn inspect_and_plan_report_and_write_nothing() {
    let (d, ck) = synthetic(4);
    let text = ok(&["inspect", s(&ck)]);
    assert!(
        text.contains("hf-storage checkpoint, 4 rank(s), 4 file(s), 15 tensor(s)"),
        "{text}"
    );
    assert!(
        text.contains("model.embed.weight") && text.contains("along dim 0: 0:3 3:6 6:9 9:10"),
        "{text}"
    );
    let j: serde_json::Value = serde_json::from_str(&ok(&["inspect", s(&ck), "--json"])).unwrap();
    assert_eq!(j["tensors"].as_array().unwrap().len(), 15);
    let total: usize = model().values().map(|t| t.data.len()).sum();
    let p: serde_json::Value =
        serde_json::from_str(&ok(&["plan", s(&ck), "--to", "2", "--json"])).unwrap();
    assert_eq!(p["bytes_read"], total);
    assert_eq!(p["bytes_written"], total);
    assert_eq!(p["target"]["ranks"], 2);
    let text = ok(&["plan", s(&ck), "--to", "1", "--ops"]);
    assert!(
        text.contains("per-thread balance") && text.contains("OPS"),
        "{text}"
    );
    assert_eq!(names(d.path()), vec!["ck"]);
    let help = ok(&["convert", "--help"]);
    assert!(help.contains("Examples:"), "{help}");
}

#[test]
fn existing_destination_needs_force() {
    let (d, ck) = synthetic(2);
    let out = d.path().join("o.safetensors");
    std::fs::write(&out, b"keep me").unwrap();
    fails(
        &["convert", s(&ck), s(&out), "--to", "1"],
        "already exists (use --force",
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
    convert(&ck, &out, &["--to", "1", "--force", "-q"]);
    assert_eq!(read_safetensors(&out), model());
    // directories too
    let dir = d.path().join("o2");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("old"), b"x").unwrap();
    fails(&["convert", s(&ck), s(&dir), "--to", "2"], "already exists");
    convert(&ck, &dir, &["--to", "2", "--force", "-q"]);
    assert!(!dir.join("old").exists());
    assert_eq!(names(d.path()), vec!["ck", "o.safetensors", "o2"]);
}

/// Run a failing conversion and check nothing was written next to the destination.
fn bad(ck: &Path, needle: &str) {
    eprintln!("case: {needle}");
    let parent = ck.parent().unwrap();
    let before = names(parent);
    let out = parent.join("out.safetensors");
    fails(&["convert", s(ck), s(&out), "--to", "1"], needle);
    fails(&["inspect", s(ck)], needle);
    assert_eq!(
        names(parent),
        before,
        "output or temporary files left behind"
    );
}

#[test]
fn gaps_in_torchs_shard_numbering_are_ranks_that_stored_nothing() {
    // torch's HuggingFaceStorageWriter writes no file for a rank that only holds replicas
    // (a 2 x 2 mesh with [Shard(0), Replicate()] writes shard-00001 and shard-00003): the
    // files present are the checkpoint, as torch's reader takes them
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    write_hf_storage(&ck, &fsdp_shards(&model(), 2));
    std::fs::rename(
        ck.join("shard-00002-model-00001-of-00001.safetensors"),
        ck.join("shard-00003-model-00001-of-00001.safetensors"),
    )
    .unwrap();
    let insp = ok(&["inspect", s(&ck)]);
    assert!(
        insp.contains("hf-storage checkpoint, 3 rank(s), 2 file(s)"),
        "{insp}"
    );
    let out = d.path().join("one.safetensors");
    convert(&ck, &out, &["--to", "1", "-q"]);
    assert_eq!(read_safetensors(&out), model());
}

#[test]
fn bad_inputs_fail_with_one_line_naming_the_file() {
    let m = model();
    // truncated shard
    let (_d, ck) = synthetic(4);
    let f = ck.join("shard-00002-model-00001-of-00001.safetensors");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() - 10]).unwrap();
    bad(
        &ck,
        "shard-00002-model-00001-of-00001.safetensors: is truncated",
    );
    // truncated inside the header
    std::fs::write(&f, &b[..20]).unwrap();
    bad(
        &ck,
        "shard-00002-model-00001-of-00001.safetensors: is truncated: its header length says ",
    );
    // corrupt header
    let mut c = b.clone();
    c[8] = b'!';
    std::fs::write(&f, &c).unwrap();
    bad(
        &ck,
        "shard-00002-model-00001-of-00001.safetensors: is not a valid safetensors file",
    );
    // a lost rank file of torch's writer (which records no world size): its chunks are
    // regions no piece covers
    std::fs::remove_file(&f).unwrap();
    bad(
        &ck,
        "ck: tensor `model.ids`: pieces cover 16 of 22 elements: region [3:6, 0:2] is not covered",
    );
    // a lost rank file of reshard's output (which records its world size) is named
    let (d, ck) = synthetic(4);
    let mid = d.path().join("mid");
    convert(&ck, &mid, &["--to", "3", "--format", "hf-storage", "-q"]);
    std::fs::remove_file(mid.join("shard-00002-model-00001-of-00001.safetensors")).unwrap();
    bad(&mid, "shard-00002-…: is missing");

    // a gap: one chunk dropped
    let (_d, ck) = synthetic(4);
    let mut shards = fsdp_shards(&m, 4);
    shards[1].remove("model.embed.weight");
    write_hf_storage(&ck, &shards);
    bad(&ck, "tensor `model.embed.weight`: pieces cover 84 of 120 elements: region [3:6, 0:12] is not covered");

    // an overlap: a chunk claims rows another rank holds
    let (_d, ck) = synthetic(4);
    let mut shards = fsdp_shards(&m, 4);
    shards[1].get_mut("model.embed.weight").unwrap().2 = vec![2, 0];
    write_hf_storage(&ck, &shards);
    bad(
        &ck,
        "tensor `model.embed.weight`: pieces [0:3, 0:12] and [2:5, 0:12] overlap",
    );
    // the same chunk stored by two ranks (torch's writer never does that)
    let mut shards = fsdp_shards(&m, 4);
    shards[2].get_mut("model.cls").unwrap().2 = vec![1, 0];
    write_hf_storage(&ck, &shards);
    bad(&ck, "tensor `model.cls`: chunk [1:2, 0:12] is stored twice");

    // a chunk outside the tensor is caught as a gap of the real shape or an overlap; a chunk
    // of the wrong dtype is named with its file
    let (_d, ck) = synthetic(2);
    let mut shards = fsdp_shards(&m, 2);
    let e = shards[1].get_mut("model.embed.weight").unwrap();
    e.0 = safetensors::Dtype::I32;
    write_hf_storage(&ck, &shards);
    bad(
        &ck,
        "shard-00002-model-00001-of-00001.safetensors: tensor `model.embed.weight` is I32",
    );

    // HF index naming a missing file, and one escaping the directory
    let d = tempfile::tempdir().unwrap();
    let hf = d.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    write_safetensors(&hf.join("a.safetensors"), &m);
    let mut map = serde_json::Map::new();
    for n in m.keys() {
        map.insert(n.clone(), "a.safetensors".into());
    }
    map.insert("model.cls".into(), "b.safetensors".into());
    std::fs::write(
        hf.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    bad(
        &hf,
        "b.safetensors: is missing (named by model.safetensors.index.json for `model.cls`)",
    );
    map.insert("model.cls".into(), "../a.safetensors".into());
    std::fs::write(
        hf.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    bad(&hf, "outside the checkpoint directory");
    std::fs::write(hf.join("model.safetensors.index.json"), "{not json").unwrap();
    bad(&hf, "model.safetensors.index.json: is not valid JSON");

    // not a checkpoint at all
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    bad(&empty, "is not a checkpoint");
    fails(
        &["inspect", s(&d.path().join("nope"))],
        "nope: No such file or directory",
    );
}

#[test]
fn refuses_to_write_into_or_over_the_source() {
    let (d, ck) = synthetic(2);
    let before = snapshot(&ck);
    fails(
        &[
            "convert",
            s(&ck),
            s(&ck.join("x.safetensors")),
            "--to",
            "1",
            "--force",
        ],
        "overlaps the source",
    );
    fails(
        &["convert", s(&ck), s(&ck), "--to", "2", "--force"],
        "overlaps the source",
    );
    fails(
        &["convert", s(&ck), s(d.path()), "--to", "2", "--force"],
        "overlaps the source",
    );
    let st = d.path().join("a.safetensors");
    convert(&ck, &st, &["--to", "1"]);
    fails(
        &["convert", s(&st), s(&st), "--to", "1", "--force"],
        "overlaps the source",
    );
    assert_eq!(snapshot(&ck), before);
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("x.safetensors")),
            "--to",
            "0",
        ],
        "--to must be at least 1",
    );
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("x")),
            "--to",
            "2",
            "--format",
            "safetensors",
        ],
        "holds one rank",
    );
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("x")),
            "--to",
            "2",
            "--format",
            "hf",
        ],
        "consolidated model",
    );
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("no/such/x.safetensors")),
            "--to",
            "1",
        ],
        &format!(
            "{}: cannot write: the folder {} does not exist",
            d.path().join("no/such/x.safetensors").display(),
            d.path().join("no/such").display()
        ),
    );
}

#[test]
fn strip_and_add_prefixes_rename_tensors() {
    let (d, ck) = synthetic(2);
    let out = d.path().join("m.safetensors");
    convert(
        &ck,
        &out,
        &[
            "--to",
            "1",
            "--include",
            "model.*",
            "--strip-prefix",
            "model.",
            "--add-prefix",
            "student.",
        ],
    );
    let got = read_safetensors(&out);
    let want = model();
    assert_eq!(
        got.len(),
        want.keys().filter(|k| k.starts_with("model.")).count()
    );
    for (n, t) in &want {
        if let Some(rest) = n.strip_prefix("model.") {
            assert_eq!(&got[&format!("student.{rest}")], t);
        }
    }
    fails(
        &[
            "convert",
            s(&ck),
            s(&d.path().join("y.safetensors")),
            "--to",
            "1",
            "--strip-prefix",
            "model.cls",
        ],
        "`model.cls` would be renamed to an empty name",
    );
    assert!(!d.path().join("y.safetensors").exists());
}

/// Run reshard with `args` and return its exit status and standard error.
fn status(args: &[&str]) -> (Option<i32>, String) {
    let o = reshard(args);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn exit_status_is_0_for_equal_1_for_a_finding_and_2_for_errors() {
    let (d, ck) = synthetic(2);
    let one = d.path().join("one.safetensors");
    ok(&["convert", s(&ck), s(&one), "--to", "1", "-q"]);
    // diff: equal, different, and unreadable (either side)
    assert_eq!(status(&["diff", s(&ck), s(&one)]), (Some(0), String::new()));
    let part = d.path().join("part.safetensors");
    ok(&[
        "convert",
        s(&ck),
        s(&part),
        "--to",
        "1",
        "--exclude",
        "model.cls",
        "-q",
    ]);
    // a difference is a finding, not an error: its summary line has no `error:`
    assert_eq!(
        status(&["diff", s(&ck), s(&part)]),
        (
            Some(1),
            format!(
                "reshard: {} and {} differ: 1 difference(s)\n",
                ck.display(),
                part.display()
            )
        )
    );
    let nope = d.path().join("nope");
    fails(
        &["diff", s(&ck), s(&nope)],
        "nope: No such file or directory",
    );
    fails(
        &["diff", s(&nope), s(&ck)],
        "nope: No such file or directory",
    );
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    fails(&["diff", s(&ck), s(&empty)], "is not a checkpoint");
    // verify: intact, then one byte of tensor data flipped, then unreadable
    assert!(ok(&["verify", s(&one)]).contains("all match"));
    let mut bytes = std::fs::read(&one).unwrap();
    *bytes.last_mut().unwrap() ^= 0x40;
    std::fs::write(&one, &bytes).unwrap();
    fails_with(1, &["verify", s(&one)], "is corrupt: its CRC-32 is");
    fails(&["verify", s(&nope)], "nope: No such file or directory");
    // usage errors, from clap and from the library
    for bad in [
        &["frobnicate"][..],
        &["convert", s(&ck)],
        &["inspect", s(&ck), "--no-such-flag"],
        &["plan", s(&ck), "--to", "two"],
        &["plan", s(&ck), "--to", "1", "--max-shard-size", "5XB"],
    ] {
        let (code, err) = status(bad);
        assert_eq!(code, Some(2), "reshard {bad:?}: {err}");
        assert!(!err.is_empty(), "reshard {bad:?}: no message");
    }
    fails(&["plan", s(&ck)], "give the target world size with --to M");
    fails(&["plan", s(&ck), "--to", "0"], "--to must be at least 1");
    // sizes in decimal and binary units are accepted
    ok(&[
        "plan",
        s(&ck),
        "--to",
        "1",
        "--format",
        "hf",
        "--max-shard-size",
        "500MiB",
    ]);
    ok(&[
        "plan",
        s(&ck),
        "--to",
        "1",
        "--format",
        "hf",
        "--max-shard-size",
        "2GB",
    ]);
}

/// A checkpoint of `n` small tensors (distinct values, so none is tied): `inspect` of it
/// prints far more than a pipe holds.
fn many_tensors(dir: &Path, n: usize) -> std::path::PathBuf {
    let model: std::collections::BTreeMap<String, Full> = (0..n)
        .map(|i| {
            let t = Full {
                dtype: safetensors::Dtype::F32,
                shape: vec![1],
                data: (i as f32).to_le_bytes().to_vec(),
            };
            (format!("layers.{i:05}.weight"), t)
        })
        .collect();
    let path = dir.join("many.safetensors");
    write_safetensors(&path, &model);
    path
}

/// Run reshard with `args`, read `lines` lines of its standard output and close the pipe
/// (as `| head -n LINES` does); returns the exit status and standard error.
fn with_early_close(args: &[&str], lines: usize) -> (Option<i32>, String) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    for _ in 0..lines {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
    }
    drop(reader);
    let o = child.wait_with_output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn a_reader_closing_stdout_early_ends_quietly_with_the_same_status() {
    let d = tempfile::tempdir().unwrap();
    let many = many_tensors(d.path(), 5000);
    let one = d.path().join("one.safetensors");
    write_safetensors(&one, &model());
    // Each output is several pipe-fulls, so reshard is still writing when the pipe closes.
    for args in [
        &["inspect", s(&many)][..],
        &["inspect", s(&many), "--json"],
        &["plan", s(&many), "--to", "1", "--ops"],
        &["diff", s(&many), s(&many)],
        &["verify", s(&many)],
    ] {
        for lines in [0, 1] {
            assert_eq!(
                with_early_close(args, lines),
                (Some(0), String::new()),
                "reshard {args:?} | head -{lines}"
            );
        }
    }
    // a finding keeps its status: the differences are cut short, the verdict is not
    let (code, err) = with_early_close(&["diff", s(&many), s(&one)], 1);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("reshard: ") && err.contains("differ") && !err.contains("error"),
        "{err}"
    );
}
