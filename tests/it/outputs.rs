//! What `convert` writes where, and what `plan` and `inspect` say of it: a destination named
//! for another output is refused, not overruled; `plan SRC DST` decides the format as
//! `convert SRC DST` does; `inspect` counts the files and bytes `convert` reported and knows
//! reshard wrote them; `--max-shard-size` bounds whole files, headers included.

use crate::common::*;
use std::path::{Path, PathBuf};

/// The Lightning Fabric FSDP1 checkpoint of the issue: 4 ranks of DCP written by torch 2.1,
/// with a `meta.pt` (non-tensor entries) and nesting.
fn source() -> PathBuf {
    fixture("fabric_fsdp1_w4_f32_torch21/checkpoint")
}

/// Every regular file under `dir` (or `dir` itself when a file), with its size.
fn files_under(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out: Vec<(PathBuf, u64)> = snapshot(dir)
        .into_iter()
        .map(|(p, b)| (p, b.len() as u64))
        .collect();
    out.sort();
    out
}

/// The part of `convert`'s summary line that `inspect` repeats: `N file(s), T tensor(s),
/// SIZE` (between the ranks and the timing).
fn written(summary: &str) -> &str {
    let line = summary.lines().next().unwrap();
    let from = line.find(" rank(s), ").unwrap() + " rank(s), ".len();
    let to = line.rfind(" in ").unwrap();
    &line[from..to]
}

#[test]
fn a_destination_named_for_another_output_is_refused_and_nothing_is_written() {
    let src = source();
    let d = tempfile::tempdir().unwrap();
    let at = |name: &str| d.path().join(name);
    // 2 ranks are a DCP folder: a .safetensors name is refused, and the shards it could mean
    // are named
    let err = fails(
        &["convert", s(&src), s(&at("x.safetensors")), "--to", "2"],
        "x.safetensors: a .safetensors name is one file, but 2 rank(s) are written as a folder (dcp)",
    );
    assert!(
        err.contains(&format!("name a folder such as {}/", s(&at("x"))))
            && err.contains("--format hf-storage"),
        "{err}"
    );
    // a folder format asked for: the name's own file format is the way out
    let err = fails(
        &[
            "convert",
            s(&src),
            s(&at("x.pt")),
            "--to",
            "1",
            "--format",
            "dcp",
        ],
        "x.pt: a .pt name is one file, but the dcp output asked for is a folder",
    );
    assert!(err.contains("drop --format to write one .pt file"), "{err}");
    // 2 ranks into a .pt name (no folder format of the torch family but DCP itself)
    fails(
        &["convert", s(&src), s(&at("x.pt")), "--to", "2"],
        "x.pt: a .pt name is one file, but 2 rank(s) are written as a folder (dcp)",
    );
    // another file format asked for
    fails(
        &[
            "convert",
            s(&src),
            s(&at("m.safetensors")),
            "--to",
            "1",
            "--format",
            "pt",
        ],
        &format!("name it {}", s(&at("m.pt"))),
    );
    // a name ending in / for one file
    let slash = format!("{}/", s(&at("one")));
    fails(
        &[
            "convert",
            s(&src),
            &slash,
            "--to",
            "1",
            "--format",
            "safetensors",
        ],
        &format!("name a file such as {}.safetensors", s(&at("one"))),
    );
    assert_eq!(
        names(d.path()),
        Vec::<String>::new(),
        "something was written"
    );
}

#[test]
fn destinations_that_name_their_output_are_written_as_before() {
    let src = source();
    let d = tempfile::tempdir().unwrap();
    let at = |name: &str| d.path().join(name);
    let open = |p: &Path| reshard::formats::Checkpoint::open(p).unwrap();
    use reshard::formats::Format;
    let cases: &[(&str, &[&str], Format, u32)] = &[
        ("model.safetensors", &["--to", "1"], Format::SAFETENSORS, 1),
        ("model.pt", &["--to", "1"], Format::PT, 1),
        ("model.pth", &["--to", "1"], Format::PT, 1),
        ("out", &["--to", "2"], Format::DCP, 2),
        ("hf", &["--to", "1"], Format::HF, 1),
        ("hf2", &["--to", "1", "--format", "hf"], Format::HF, 1),
        (
            "hfs",
            &["--to", "2", "--format", "hf-storage"],
            Format::HF_STORAGE,
            2,
        ),
        ("d1", &["--to", "1", "--format", "dcp"], Format::DCP, 1),
        ("p", &["--to", "1", "--format", "pt"], Format::PT, 1),
    ];
    for (name, args, format, ranks) in cases {
        convert(&src, &at(name), args);
        let ck = open(&at(name));
        assert_eq!((ck.format, ck.ranks), (*format, *ranks), "{name} {args:?}");
        assert_eq!(at(name).is_dir(), format.is_dir(), "{name} {args:?}");
    }
}

#[test]
fn plan_with_a_destination_decides_the_format_as_convert_does() {
    let src = source();
    let d = tempfile::tempdir().unwrap();
    let st = d.path().join("model.safetensors");
    // without DST a consolidated model is a folder (hf), as before; with one named
    // .safetensors, one safetensors file, as `convert` writes it
    let text = ok(&["plan", s(&src), "--to", "1"]);
    assert!(
        text.contains("-> hf (1 rank(s)); output format hf"),
        "{text}"
    );
    assert!(text.contains("into a folder (no DST given)"), "{text}");
    let text = ok(&["plan", s(&src), s(&st), "--to", "1"]);
    assert!(
        text.contains(
            "-> safetensors (1 rank(s)); output format safetensors: the destination ends in .safetensors"
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!("into {} (one file)", s(&st))),
        "{text}"
    );
    let plan: serde_json::Value =
        serde_json::from_str(&ok(&["plan", s(&src), s(&st), "--to", "1", "--json"])).unwrap();
    let target = &plan["target"];
    assert_eq!(target["path"], s(&st));
    assert_eq!(target["format"], "safetensors");
    assert_eq!(target["container"], "file");
    assert_eq!(
        names(d.path()),
        Vec::<String>::new(),
        "plan wrote something"
    );
    // what it plans is what convert writes
    let summary = convert(&src, &st, &["--to", "1"]);
    assert!(
        summary.contains("output format safetensors: the destination ends in .safetensors"),
        "{summary}"
    );
    let files = target["files"].as_array().unwrap();
    assert_eq!(files.len(), 1, "{target}");
    assert_eq!(files[0]["size"], std::fs::metadata(&st).unwrap().len());
    // a folder: the files planned are those written
    let out = d.path().join("out");
    let plan: serde_json::Value =
        serde_json::from_str(&ok(&["plan", s(&src), s(&out), "--to", "2", "--json"])).unwrap();
    assert_eq!(plan["target"]["format"], "dcp");
    assert_eq!(plan["target"]["container"], "directory");
    convert(&src, &out, &["--to", "2"]);
    let mut planned: Vec<(PathBuf, u64)> = plan["target"]["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                out.join(f["path"].as_str().unwrap()),
                f["size"].as_u64().unwrap(),
            )
        })
        .collect();
    planned.sort();
    assert_eq!(planned, files_under(&out));
    // a destination convert refuses, plan refuses alike
    let bad = d.path().join("x.safetensors");
    for args in [&["--to", "2"][..], &["--to", "1", "--format", "dcp"]] {
        let plan_err = fails(
            &[&["plan", s(&src), s(&bad)][..], args].concat(),
            "x.safetensors: a .safetensors name is one file",
        );
        let convert_err = fails(
            &[&["convert", s(&src), s(&bad)][..], args].concat(),
            "x.safetensors",
        );
        assert_eq!(plan_err, convert_err, "{args:?}");
    }
    assert!(!bad.exists());
}

#[test]
fn inspect_counts_the_files_and_bytes_convert_wrote_and_knows_reshard_wrote_them() {
    let src = source();
    let d = tempfile::tempdir().unwrap();
    let reshard_v = format!("reshard {}", env!("CARGO_PKG_VERSION"));
    let dcp = format!("{reshard_v} (DCP in the torch 2.1 layout)");
    let cases: &[(&str, &[&str], &str)] = &[
        ("out", &["--to", "2"], &dcp),
        ("hf", &["--to", "1", "--format", "hf"], &reshard_v),
        ("model.safetensors", &["--to", "1"], &reshard_v),
        ("hfs", &["--to", "3", "--format", "hf-storage"], &reshard_v),
        (
            "model.pt",
            &["--to", "1"],
            "reshard (a torch.save zip archive)",
        ),
    ];
    for (name, args, producer) in cases {
        let dst = d.path().join(name);
        let summary = convert(&src, &dst, args);
        let insp = ok(&["inspect", s(&dst)]);
        let first = insp.lines().next().unwrap();
        assert!(
            first.contains(written(&summary)),
            "{name}: convert said `{}`, inspect `{first}`",
            written(&summary)
        );
        assert!(
            insp.contains(&format!("  written by {producer}\n")),
            "{name}: {insp}"
        );
        let on_disk = files_under(&dst);
        let j: serde_json::Value =
            serde_json::from_str(&ok(&["inspect", s(&dst), "--json"])).unwrap();
        assert_eq!(j["on_disk"]["files"], on_disk.len(), "{name}");
        assert_eq!(
            j["on_disk"]["bytes"],
            on_disk.iter().map(|(_, n)| n).sum::<u64>(),
            "{name}"
        );
        assert_eq!(j["producer"], *producer, "{name}");
    }
    // a checkpoint torch wrote is still torch's
    let insp = ok(&["inspect", s(&src)]);
    assert!(
        insp.contains("  written by torch 2.1–2.3 (no DCP version)\n"),
        "{insp}"
    );
    assert!(insp.contains(" 6 file(s), 65 tensor(s), "), "{insp}");
}

/// The safetensors files of an hf folder, with their sizes.
fn shards(hf: &Path) -> Vec<(PathBuf, u64)> {
    files_under(hf)
        .into_iter()
        .filter(|(p, _)| p.extension().is_some_and(|e| e == "safetensors"))
        .collect()
}

#[test]
fn max_shard_size_bounds_each_file_with_its_header() {
    let src = source();
    let d = tempfile::tempdir().unwrap();
    // the largest tensor is 1.7 KiB: every shard, header included, fits 5 KB
    let hf = d.path().join("hf");
    convert(
        &src,
        &hf,
        &["--to", "1", "--format", "hf", "--max-shard-size", "5KB"],
    );
    let files = shards(&hf);
    assert!(files.len() > 4, "{files:?}");
    for (p, n) in &files {
        assert!(*n <= 5000, "{}: {n} bytes, over 5 KB", p.display());
    }
    // the shards keep what each file needs (format, CRC-32s, reshard's version); the
    // checkpoint's non-tensor entries and nesting are in the index, once
    let index = json_object(&hf.join("model.safetensors.index.json"));
    let meta = index["metadata"].as_object().unwrap();
    for k in ["reshard.extras", "reshard.extras.pickle", "reshard.paths"] {
        assert!(meta[k].is_string(), "index metadata {k}: {meta:?}");
    }
    for (p, _) in &files {
        let bytes = std::fs::read(p).unwrap();
        let (_, m) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let m = m.metadata().clone().unwrap();
        let mut keys: Vec<&str> = m.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            vec!["format", "reshard.crc32", "reshard.version"],
            "{}",
            p.display()
        );
        assert_eq!(m["format"], "pt");
    }
    // read back whole, non-tensor entries and nesting included: equal to the source
    let same = |a: &Path, b: &Path| {
        let o = reshard(&["diff", s(a), s(b)]);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let paths = |p: &Path| -> serde_json::Value {
            serde_json::from_str::<serde_json::Value>(&ok(&["inspect", s(p), "--json"])).unwrap()
                ["paths"]
                .clone()
        };
        assert_eq!(
            paths(a),
            paths(b),
            "nesting of {} and {}",
            a.display(),
            b.display()
        );
    };
    same(&src, &hf);
    // a limit below the largest tensor: that tensor gets a file of its own
    let small = d.path().join("small");
    convert(
        &src,
        &small,
        &["--to", "1", "--format", "hf", "--max-shard-size", "1000B"],
    );
    for (p, n) in shards(&small) {
        let held = read_safetensors(&p).len();
        assert!(
            n <= 1000 || held == 1,
            "{}: {n} bytes for {held} tensors",
            p.display()
        );
    }
    same(&src, &small);
    // torch's safetensors and transformers load the shards through the index
    let Some(py) = torch_or_skip() else {
        return;
    };
    let full = d.path().join("full.safetensors");
    convert(&src, &full, &["--to", "1"]);
    judge(&py, &["hf-load", s(&hf), s(&full)]);
    python(
        &py,
        &format!(
            r#"
from transformers.utils.hub import get_checkpoint_shard_files
from transformers.modeling_utils import load_state_dict
d = {hf:?}
files, meta = get_checkpoint_shard_files(d, d + "/model.safetensors.index.json", local_files_only=True)
sd = {{}}
for f in files:
    sd.update(load_state_dict(f))
assert set(sd) == set(meta["weight_map"]) and len(sd) == 65, sorted(sd)
"#,
            hf = s(&hf)
        ),
    );
}
