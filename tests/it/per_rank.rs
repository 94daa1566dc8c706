//! Per-rank state (issue #4, point 3) on a real torch-written checkpoint: each of 2 ranks saved
//! its data-loader position under `dataloader.dp_rank_<r>`, and an RNG state under one key
//! (`rng_state`, plus the fixture's `extra.rng`). `inspect` marks them; `--to 1` keeps rank 0's;
//! other world sizes refuse unless `--per-rank-state` says what to do.

use crate::common::{convert, fails, fixture, ok, python, s, torch_or_skip};
use reshard::formats::Checkpoint;
use std::path::{Path, PathBuf};

fn ckpt() -> PathBuf {
    fixture("fsdp2_w2_perrank/checkpoint")
}

/// Non-tensor names of a checkpoint.
fn extras(p: &Path) -> Vec<String> {
    let ck = Checkpoint::open(p).unwrap();
    ck.extras.iter().map(|e| e.name.clone()).collect()
}

fn tensors(p: &Path) -> Vec<String> {
    let ck = Checkpoint::open(p).unwrap();
    ck.tensors.iter().map(|t| t.name.clone()).collect()
}

fn dataloader(names: &[String]) -> Vec<&str> {
    names
        .iter()
        .filter(|n| n.starts_with("dataloader."))
        .map(String::as_str)
        .collect()
}

#[test]
fn inspect_marks_per_rank_entries() {
    let text = ok(&["inspect", s(&ckpt())]);
    assert!(
        text.contains("dataloader.dp_rank_1.samples_seen [dcp] = 41  (per-rank: rank 1)"),
        "{text}"
    );
    assert!(text.contains("(per-rank: one rank's copy)"), "{text}");
    assert!(text.contains("8 per-rank entries"), "{text}");
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} not listed"))
            .to_string()
    };
    assert!(
        line("model.embed.weight").contains("chunks")
            && !line("model.embed.weight").contains("per-rank")
    );
    assert!(line("rng_state ").contains("per-rank"));
    let json: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", s(&ckpt()), "--json"])).unwrap();
    let marks = json["per_rank"].as_object().unwrap();
    assert_eq!(marks.len(), 8);
    assert_eq!(
        marks["dataloader.dp_rank_0.epoch"],
        serde_json::json!({"rank": 0})
    );
    assert_eq!(marks["rng_state"], serde_json::json!("single"));
}

#[test]
fn consolidating_keeps_rank_zeros_state() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("one.safetensors");
    let msg = convert(&ckpt(), &out, &["--to", "1"]);
    assert!(
        msg.contains("left out 3 per-rank entries (kept rank 0's): dataloader.dp_rank_1.epoch"),
        "{msg}"
    );
    let names = extras(&out);
    assert_eq!(
        dataloader(&names),
        [
            "dataloader.dp_rank_0.epoch",
            "dataloader.dp_rank_0.samples_seen",
            "dataloader.dp_rank_0.order"
        ]
    );
    let t = tensors(&out);
    assert!(t.contains(&"rng_state".to_string()) && t.contains(&"extra.rng".to_string()));
}

#[test]
fn other_world_sizes_need_a_policy() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("three");
    let err = fails(
        &["convert", s(&ckpt()), s(&out), "--to", "3"],
        "per-rank state",
    );
    assert!(
        err.contains("`extra.rng` (and 7 more) is per-rank state saved by 2 rank(s), which cannot be resharded to 3: add --per-rank-state drop"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        0,
        "nothing left behind"
    );

    // drop: no per-rank entry at all, everything else unchanged
    let all = extras(&ckpt());
    convert(
        &ckpt(),
        &out,
        &["--to", "3", "--format", "dcp", "--per-rank-state", "drop"],
    );
    let kept = extras(&out);
    let want: Vec<String> = all
        .iter()
        .filter(|n| !n.starts_with("dataloader."))
        .cloned()
        .collect();
    assert_eq!(kept, want);
    let t = tensors(&out);
    assert!(!t.iter().any(|n| n == "rng_state" || n == "extra.rng"));
    assert_eq!(t.len(), tensors(&ckpt()).len() - 2);

    // rank0: rank 0's data-loader state and the single RNG copies
    let out0 = d.path().join("three-rank0");
    convert(
        &ckpt(),
        &out0,
        &["--to", "3", "--format", "dcp", "--per-rank-state", "rank0"],
    );
    assert_eq!(dataloader(&extras(&out0)).len(), 3);
    assert!(dataloader(&extras(&out0))
        .iter()
        .all(|n| n.contains("dp_rank_0")));
    assert!(tensors(&out0).contains(&"rng_state".to_string()));

    // same world size: every rank's state carries over unchanged
    let two = d.path().join("two");
    convert(&ckpt(), &two, &["--to", "2", "--format", "dcp"]);
    assert_eq!(extras(&two), all);
}

#[test]
fn torch_loads_rank_zeros_state_from_the_pt() {
    let Some(py) = torch_or_skip() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("model.pt");
    convert(&ckpt(), &out, &["--to", "1", "-q"]);
    let code = format!(
        r#"
import torch
sd = torch.load({out:?}, weights_only=True)
assert sd["dataloader"] == {{"dp_rank_0": {{"epoch": 2, "samples_seen": 40, "order": [0, 7]}}}}, sd["dataloader"]
want = torch.Generator().manual_seed(1234).get_state()
assert torch.equal(sd["rng_state"], want)
print("ok")
"#,
        out = s(&out)
    );
    python(&py, &code);
}
