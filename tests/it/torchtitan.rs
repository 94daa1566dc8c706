//! torchtitan checkpoint folders, as torchtitan 0.3.0's own `CheckpointManager` writes them
//! (`tests/fixtures/torchtitan/<case>/checkpoint/step-<n>/`, made by
//! `scripts/gen_torchtitan.py`: FSDP2 over 2 or 3 gloo ranks, torchtitan's optimizer,
//! LR-scheduler and dataloader containers, saved at steps 2 and 10), judged against
//! torchtitan's own loading at world size 1 (`oracle/step-<n>.safetensors` and `.json`):
//! the folder lists its steps, a conversion reads the newest or `--step N`, every tensor
//! consolidates and reshards N→M→1 byte for byte, torchtitan's key layout (model keys without
//! prefix, `optimizer.state.*`, `optimizer.param_groups.<fqn>.*`, `lr_scheduler.*`,
//! `dataloader.*`, `train_state.*`) works with `--include`/`--exclude`, and the dataloader's
//! per-rank state is told apart.

use crate::common::{
    assert_same, convert, fails, fixture, json_object, ok, read_all, read_st, s, Tensors,
};
use reshard::formats::torch::pickle::Value;
use reshard::formats::Checkpoint;
use reshard::OpenOptions;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// (case, ranks it was saved at)
const CASES: [(&str, u32); 3] = [
    ("fsdp2_w2_f32", 2),
    ("fsdp2_w3_f32", 3),
    ("fsdp2_w3_bf16", 3),
];
const STEPS: [u64; 2] = [2, 10];

fn folder(case: &str) -> PathBuf {
    fixture(&format!("torchtitan/{case}/checkpoint"))
}

fn oracle(case: &str, step: u64) -> Tensors {
    read_st(&fixture(&format!(
        "torchtitan/{case}/oracle/step-{step}.safetensors"
    )))
    .0
}

/// The non-tensor values torchtitan loaded (`optimizer.param_groups.*`, `lr_scheduler.*`,
/// `train_state.*`) and, under `dataloader`, what each rank saved.
fn values(case: &str, step: u64) -> serde_json::Map<String, serde_json::Value> {
    json_object(&fixture(&format!(
        "torchtitan/{case}/oracle/step-{step}.json"
    )))
}

/// The pickled loader state rank `r` saved under `dataloader.dp_rank_<r>`.
fn dataloader_bytes(case: &str, step: u64, r: u32) -> Vec<u8> {
    let v = values(case, step);
    let hex = v["dataloader"][format!("dataloader.dp_rank_{r}")]["bytes_hex"]
        .as_str()
        .unwrap()
        .to_string();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// Convert arguments that read step `step` of a folder (the newest needs none).
fn step_args(step: u64) -> Vec<String> {
    if step == 10 {
        vec![]
    } else {
        vec!["--step".into(), step.to_string()]
    }
}

fn convert_step(src: &Path, dst: &Path, step: u64, args: &[&str]) -> String {
    let sa = step_args(step);
    let mut all: Vec<&str> = sa.iter().map(String::as_str).collect();
    all.extend_from_slice(args);
    convert(src, dst, &all)
}

/// Tensors of `t` whose names satisfy `f`.
fn only(t: &Tensors, f: impl Fn(&str) -> bool) -> Tensors {
    t.iter()
        .filter(|(k, _)| f(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn extra_names(ck: &Checkpoint) -> BTreeSet<String> {
    ck.extras.iter().map(|x| x.name.clone()).collect()
}

/// Every non-tensor value torchtitan loaded is in `ck` with that value; the dataloader's
/// entries are those of `ranks` (rank r's pickled bytes, byte for byte where `ck` keeps the
/// pickle), and `world_size` when `world_size` is set.
fn assert_values(
    what: &str,
    ck: &Checkpoint,
    case: &str,
    step: u64,
    ranks: &[u32],
    world_size: bool,
) {
    let want = values(case, step);
    let is_dcp = ck.format == reshard::Format::DCP;
    let mut names = BTreeSet::new();
    for (k, v) in &want {
        if k == "dataloader" {
            continue;
        }
        let x = ck
            .extras
            .iter()
            .find(|x| &x.name == k)
            .unwrap_or_else(|| panic!("{what}: no `{k}`"));
        assert_eq!(&x.value, v, "{what}: value of `{k}`");
        names.insert(k.clone());
    }
    for &r in ranks {
        let name = format!("dataloader.dp_rank_{r}");
        let x = ck
            .extras
            .iter()
            .find(|x| x.name == name)
            .unwrap_or_else(|| panic!("{what}: no `{name}`"));
        let want = dataloader_bytes(case, step, r);
        assert_eq!(
            x.value,
            serde_json::json!(format!("<bytes: {}>", want.len())),
            "{what}: `{name}`"
        );
        match &x.pickle {
            Some(p) => assert_eq!(p, &Value::Bytes(want), "{what}: bytes of `{name}`"),
            // a safetensors output keeps values as JSON only where it cannot keep the pickle
            None => assert!(!is_dcp, "{what}: `{name}` lost its pickle"),
        }
        names.insert(name);
    }
    if world_size {
        let x = ck
            .extras
            .iter()
            .find(|x| x.name == "dataloader.world_size")
            .unwrap_or_else(|| panic!("{what}: no dataloader.world_size"));
        assert_eq!(
            x.value, want["dataloader"]["dataloader.world_size"],
            "{what}"
        );
        names.insert("dataloader.world_size".into());
    }
    assert_eq!(extra_names(ck), names, "{what}: non-tensor entries");
}

#[test]
fn inspect_lists_the_steps_and_the_newest_is_read() {
    for (case, ranks) in CASES {
        let dir = folder(case);
        assert_eq!(
            reshard::formats::checkpoints_in(&dir),
            vec!["step-2".to_string(), "step-10".to_string()],
            "{case}"
        );
        let ck = Checkpoint::open(&dir).unwrap();
        assert_eq!(
            (ck.ranks, ck.tag.as_deref()),
            (ranks, Some("step-10")),
            "{case}"
        );
        let out = ok(&["inspect", s(&dir)]);
        assert!(
            out.contains(&format!("dcp checkpoint, {ranks} rank(s)")),
            "{case}: {out}"
        );
        assert!(
            out.contains("one of 2 checkpoints in the folder: step-2, step-10 (read: step-10"),
            "{case}: {out}"
        );
        assert!(out.contains("train_state.step [dcp] = 10"), "{case}: {out}");
        let out = ok(&["inspect", s(&dir), "--step", "2"]);
        assert!(out.contains("train_state.step [dcp] = 2"), "{case}: {out}");
        fails(
            &["inspect", s(&dir), "--step", "3"],
            "has no checkpoint tagged `step-3`",
        );
        // each step read through the library is torchtitan's step: its own values
        for step in STEPS {
            let ck = Checkpoint::open_with(
                &dir,
                None,
                &OpenOptions {
                    tag: Some(format!("step-{step}")),
                    ..Default::default()
                },
            )
            .unwrap();
            let all: Vec<u32> = (0..ranks).collect();
            assert_values(&format!("{case} step-{step}"), &ck, case, step, &all, true);
            assert_same(
                case,
                &format!("step-{step} read"),
                &read_all(&ck),
                &oracle(case, step),
            );
        }
    }
}

#[test]
fn consolidation_equals_torchtitans_own_loading() {
    let d = tempfile::tempdir().unwrap();
    for (case, _) in CASES {
        for step in STEPS {
            for ext in ["safetensors", "pt"] {
                let out = d.path().join(format!("{case}-{step}.{ext}"));
                let msg = convert_step(&folder(case), &out, step, &["--to", "1"]);
                assert!(msg.contains("(kept rank 0's)"), "{case}: {msg}");
                let ck = Checkpoint::open(&out).unwrap();
                let what = format!("{case} step-{step} .{ext}");
                assert_same(case, &what, &read_all(&ck), &oracle(case, step));
                // rank 0's dataloader state and world_size, every other value as loaded
                assert_values(&what, &ck, case, step, &[0], true);
            }
        }
    }
}

#[test]
fn n_to_m_to_1_is_byte_exact() {
    let d = tempfile::tempdir().unwrap();
    for (case, ranks) in CASES {
        for step in STEPS {
            let want = oracle(case, step);
            for m in [1u32, 2, 4, 5] {
                let mid = d.path().join(format!("{case}-{step}-{m}"));
                let mut args = vec![
                    "--to".to_string(),
                    m.to_string(),
                    "--format".into(),
                    "dcp".into(),
                ];
                if m != ranks {
                    args.extend(["--per-rank-state".into(), "drop".into()]);
                }
                let a: Vec<&str> = args.iter().map(String::as_str).collect();
                convert_step(&folder(case), &mid, step, &a);
                let ck = Checkpoint::open(&mid).unwrap();
                assert_eq!(ck.ranks, m, "{case}");
                let what = format!("{case} step-{step} -> {m}");
                if m == ranks {
                    // the job's own world size: every rank's dataloader state carries over
                    let all: Vec<u32> = (0..ranks).collect();
                    assert_values(&what, &ck, case, step, &all, true);
                } else {
                    assert_values(&what, &ck, case, step, &[], false);
                }
                let one = d.path().join(format!("{case}-{step}-{m}.safetensors"));
                convert(&mid, &one, &["--to", "1", "-q"]);
                assert_same(
                    case,
                    &format!("{what} -> 1"),
                    &read_all(&Checkpoint::open(&one).unwrap()),
                    &want,
                );
            }
        }
    }
}

#[test]
fn include_and_exclude_select_torchtitan_keys() {
    let d = tempfile::tempdir().unwrap();
    for (case, _) in CASES {
        let want = oracle(case, 10);
        let src = folder(case);
        // the model alone: its keys have no prefix, so everything else is excluded by name
        let model = d.path().join(format!("{case}-model.safetensors"));
        convert(
            &src,
            &model,
            &[
                "--to",
                "1",
                "-q",
                "--exclude",
                "optimizer.*",
                "--exclude",
                "lr_scheduler.*",
                "--exclude",
                "dataloader.*",
                "--exclude",
                "train_state.*",
            ],
        );
        let ck = Checkpoint::open(&model).unwrap();
        let m = only(&want, |k| !k.starts_with("optimizer."));
        assert_eq!(
            m.keys().map(String::as_str).collect::<Vec<_>>(),
            [
                "fc1.bias",
                "fc1.weight",
                "norm.weight",
                "output.weight",
                "pos",
                "scale",
                "tok_embeddings.weight"
            ],
            "{case}"
        );
        assert_same(case, "model only", &read_all(&ck), &m);
        assert!(ck.extras.is_empty(), "{case}: {:?}", extra_names(&ck));

        // optimizer state alone
        let opt = d.path().join(format!("{case}-opt.safetensors"));
        convert(
            &src,
            &opt,
            &["--to", "1", "-q", "--include", "optimizer.state.*"],
        );
        let ck = Checkpoint::open(&opt).unwrap();
        let o = only(&want, |k| k.starts_with("optimizer.state."));
        assert_eq!(
            o.len(),
            18,
            "{case}: 6 parameters x (exp_avg, exp_avg_sq, step)"
        );
        assert_same(case, "optimizer.state.*", &read_all(&ck), &o);
        assert!(ck.extras.is_empty(), "{case}");

        // one moment of every parameter; the param groups of one; the scheduler and train state
        let some = d.path().join(format!("{case}-some"));
        convert(
            &src,
            &some,
            &[
                "--to",
                "2",
                "--format",
                "dcp",
                "-q",
                "--include",
                "optimizer.state.*.exp_avg",
                "--include",
                "optimizer.param_groups.fc1.weight.*",
                "--include",
                "lr_scheduler.*",
                "--include",
                "train_state.*",
            ],
        );
        let ck = Checkpoint::open(&some).unwrap();
        let e = only(&want, |k| {
            k.starts_with("optimizer.state.") && k.ends_with(".exp_avg")
        });
        assert_eq!(e.len(), 6, "{case}");
        assert_same(case, "exp_avg", &read_all(&ck), &e);
        let v = values(case, 10);
        let wanted: BTreeSet<String> = v
            .keys()
            .filter(|k| {
                k.starts_with("optimizer.param_groups.fc1.weight.")
                    || k.starts_with("lr_scheduler.")
                    || k.starts_with("train_state.")
            })
            .cloned()
            .collect();
        assert_eq!(
            wanted.len(),
            12 + 1 + 2,
            "{case}: 12 param-group keys, last_epoch, step, ntokens_seen"
        );
        assert_eq!(extra_names(&ck), wanted, "{case}");
        for x in &ck.extras {
            assert_eq!(&x.value, &v[&x.name], "{case}: `{}`", x.name);
        }
    }
}

#[test]
fn the_dataloader_is_per_rank_state() {
    let d = tempfile::tempdir().unwrap();
    for (case, ranks) in CASES {
        let src = folder(case);
        let json: serde_json::Value =
            serde_json::from_str(&ok(&["inspect", s(&src), "--json"])).unwrap();
        let marks = json["per_rank"].as_object().unwrap();
        let mut want = serde_json::Map::new();
        for r in 0..ranks {
            want.insert(
                format!("dataloader.dp_rank_{r}"),
                serde_json::json!({ "rank": r }),
            );
        }
        want.insert("dataloader.world_size".into(), serde_json::json!("single"));
        // nothing else: model, optimizer, scheduler and train state are not per-rank
        assert_eq!(marks, &want, "{case}");

        // another world size needs a policy, named in a one-line error; nothing is written
        let out = d.path().join(format!("{case}-four"));
        let err = fails(
            &["convert", s(&src), s(&out), "--to", "4"],
            "per-rank state",
        );
        assert!(
            err.contains(&format!(
                "`dataloader.dp_rank_0` (and {ranks} more) is per-rank state saved by {ranks} rank(s), which cannot be resharded to 4"
            )),
            "{case}: {err}"
        );
        assert!(!out.exists());

        // rank0: rank 0's loader state, byte for byte, and the single world_size
        convert(
            &src,
            &out,
            &["--to", "4", "--per-rank-state", "rank0", "-q"],
        );
        let ck = Checkpoint::open(&out).unwrap();
        assert_values(&format!("{case} rank0"), &ck, case, 10, &[0], true);
        // keep at the same world size: every rank's state, as saved
        let same = d.path().join(format!("{case}-same"));
        convert(&src, &same, &["--to", &ranks.to_string(), "-q"]);
        let all: Vec<u32> = (0..ranks).collect();
        assert_values(
            &format!("{case} same"),
            &Checkpoint::open(&same).unwrap(),
            case,
            10,
            &all,
            true,
        );
    }
}
