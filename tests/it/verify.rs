//! Checksums and verification (issue #6): every output reshard writes records CRC-32s of what
//! it wrote, `reshard verify` checks structure and checksums of any checkpoint, `convert`
//! refuses sources whose recorded checksums do not match the bytes it reads, and `reshard diff`
//! compares checkpoints tensor by tensor.

use crate::common;
use crate::common::{convert, copy_dir, fails, fails_with, fixture, ok, s};
use reshard::formats::Checkpoint;
use std::path::{Path, PathBuf};

/// Flip one bit in the data of tensor `name` (its first non-empty piece) of the checkpoint at
/// `path`; returns the file changed.
fn corrupt(path: &Path, name: &str) -> PathBuf {
    let ck = Checkpoint::open(path).unwrap();
    let t = ck.tensor(name).unwrap();
    let p = t.pieces.iter().find(|p| !p.region.is_empty()).unwrap();
    let file = ck.files[p.loc.file as usize].clone();
    let mut b = std::fs::read(&file).unwrap();
    b[p.loc.offset as usize] ^= 0x10;
    std::fs::write(&file, b).unwrap();
    file
}

/// Three HF-storage ranks, per-rank state kept.
const HF_STORAGE_3: [&str; 6] = [
    "--to",
    "3",
    "--format",
    "hf-storage",
    "--per-rank-state",
    "keep",
];

#[test]
fn every_output_records_checksums_that_verify() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture("fsdp2_w4_f32/checkpoint");
    let text = ok(&["verify", s(&src)]);
    assert!(
        text.contains("structure ok") && text.contains("all match"),
        "{text}"
    );
    for (name, args) in [
        ("one.safetensors", vec!["--to", "1"]),
        ("hf", vec!["--to", "1", "--format", "hf"]),
        ("three", HF_STORAGE_3.to_vec()),
        (
            "dcp5",
            vec!["--to", "5", "--format", "dcp", "--per-rank-state", "keep"],
        ),
        ("model.pt", vec!["--to", "1"]),
    ] {
        let out = d.path().join(name);
        let mut a = vec!["convert", s(&src), s(&out), "-q"];
        a.extend(args);
        ok(&a);
        let ck = Checkpoint::open(&out).unwrap();
        let covered: u64 = ck.checksums.iter().map(|c| c.len).sum();
        assert!(
            covered >= ck.nbytes(),
            "{name}: {covered} of {} bytes checksummed",
            ck.nbytes()
        );
        let text = ok(&["verify", s(&out)]);
        assert!(text.contains("all match"), "{name}: {text}");
        let json: serde_json::Value =
            serde_json::from_str(&ok(&["verify", s(&out), "--json"])).unwrap();
        assert_eq!(json["checksums"]["mismatches"], serde_json::json!([]));
    }
    // torch's own checkpoints: DCP items and .pt records carry CRCs
    for p in [
        "pt/training/model.pt",
        "fabric_fsdp1_w4_f32_torch21/checkpoint",
    ] {
        let text = ok(&["verify", s(&fixture(p))]);
        assert!(text.contains("all match"), "{p}: {text}");
    }
    // files without recorded checksums say so
    let text = ok(&["verify", s(&fixture("hf_storage_w4_f32/checkpoint"))]);
    assert!(text.contains("no checksums recorded"), "{text}");
}

#[test]
fn a_flipped_bit_is_caught_by_verify_and_by_convert() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture("fsdp2_w4_f32/checkpoint");
    // sources of every kind, each with one bit flipped in model.embed.weight
    let mut cases = vec![];
    let dcp = d.path().join("dcp");
    copy_dir(&src, &dcp);
    cases.push(dcp);
    let pt = d.path().join("model.pt");
    convert(&src, &pt, &["--to", "1", "-q"]);
    cases.push(pt);
    let st = d.path().join("one.safetensors");
    convert(&src, &st, &["--to", "1", "-q"]);
    cases.push(st);
    let hs = d.path().join("hs");
    convert(&src, &hs, &[&HF_STORAGE_3[..], &["-q"]].concat());
    cases.push(hs);
    for case in &cases {
        let file = corrupt(case, "model.embed.weight");
        let err = fails_with(1, &["verify", s(case)], "is corrupt: its CRC-32 is");
        assert!(err.contains(s(&file)), "{err}");
        let out = d.path().join("out.safetensors");
        let err = fails(
            &[
                "convert",
                s(case),
                s(&out),
                "--to",
                "1",
                "--per-rank-state",
                "keep",
            ],
            "is corrupt",
        );
        assert!(
            err.contains(s(&file)) && err.contains("model.embed.weight"),
            "{err}"
        );
        assert!(!out.exists());
        // tensors whose records are intact still convert
        convert(case, &out, &["--to", "1", "--include", "optimizer.*", "-q"]);
        std::fs::remove_file(&out).unwrap();
        // --no-verify copies what is there; the damaged record is copied whole, so the
        // output carries the CRC the source recorded for it and the damage stays detectable
        convert(case, &out, &["--to", "1", "--no-verify", "-q"]);
        let err = fails_with(1, &["verify", s(&out)], "is corrupt: its CRC-32 is");
        assert!(err.contains("model.embed.weight"), "{err}");
        let diff = common::reshard(&["diff", s(&src), s(&out)]);
        assert_eq!(diff.status.code(), Some(1));
        let text = String::from_utf8_lossy(&diff.stdout);
        assert!(
            text.contains("model.embed.weight: 1 element(s) differ"),
            "{}: {text}",
            case.display()
        );
        std::fs::remove_file(&out).unwrap();
    }
}

#[test]
fn diff_reports_what_differs() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture("fsdp2_w2_f32/checkpoint");
    let same = d.path().join("same");
    convert(
        &src,
        &same,
        &[
            "--to",
            "3",
            "--format",
            "dcp",
            "--per-rank-state",
            "keep",
            "-q",
        ],
    );
    let text = ok(&["diff", s(&src), s(&same)]);
    assert!(text.ends_with("identical\n"), "{text}");
    // a cast: values within bf16 rounding, reported as differences
    let bf = d.path().join("bf16.safetensors");
    convert(&src, &bf, &["--to", "1", "--dtype", "bf16", "-q"]);
    let o = common::reshard(&["diff", s(&src), s(&bf), "--json"]);
    assert_eq!(o.status.code(), Some(1));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let w = &json["differences"]["model.embed.weight"];
    assert_eq!(w["kind"], "values");
    let rel = w["max_rel"].as_f64().unwrap();
    assert!(rel > 0.0 && rel <= 1.0 / 256.0, "{w}");
    assert_eq!(
        json["differences"]["optimizer.state.cls.step"]["kind"],
        "values"
    );
    // names on one side only, and a non-tensor value
    let part = d.path().join("part.safetensors");
    convert(&src, &part, &["--to", "1", "--exclude", "model.cls", "-q"]);
    let o = common::reshard(&["diff", s(&src), s(&part)]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("model.cls: only in"), "{text}");
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.starts_with("reshard: ") && err.contains("differ") && !err.contains("error"),
        "{err}"
    );
}
