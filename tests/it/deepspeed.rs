//! DeepSpeed ZeRO checkpoints (`tests/fixtures/deepspeed/<case>`, saved by DeepSpeed 0.19.8
//! itself under torchrun on gloo by `scripts/gen_deepspeed.py`: stages 1, 2, 3; fp32 and bf16;
//! one and two parameter groups; 2 and 3 data-parallel ranks; tied, frozen, BF16_Optimizer,
//! parameter alignment, round-robin gradients, stage-3 sub-groups), judged byte for byte against DeepSpeed's own results: its
//! consolidation (`oracle/fp32.safetensors`, from `zero_to_fp32`) and the engine's own full
//! state after saving (`oracle/engine.safetensors`: fp32 master weights, Adam moments,
//! buffers and frozen parameters, gathered with DeepSpeed's `safe_get_full_*`). That
//! DeepSpeed's engine loads reshard's outputs at another degree and trains on from them is
//! `python/tests/test_deepspeed.py`'s.

use crate::common::{self, convert, fails, fixture, read_all, read_st, reshard, s, Tensors};
use reshard::formats::{Checkpoint, Format};
use reshard::{OpenOptions, Weights};
use std::path::{Path, PathBuf};

/// The fixture cases: (name, case folder, case.json).
fn cases() -> Vec<(String, PathBuf, serde_json::Value)> {
    common::cases("deepspeed", 14)
}

fn stage(info: &serde_json::Value) -> u64 {
    info["stage"].as_u64().unwrap()
}

fn dp(info: &serde_json::Value) -> u64 {
    info["dp"].as_u64().unwrap()
}

/// Every tensor of `want` is in `got` with the same dtype, shape and bytes.
fn contains(case: &str, what: &str, got: &Tensors, want: &Tensors) {
    for (name, w) in want {
        let g = got
            .get(name)
            .unwrap_or_else(|| panic!("{case} {what}: `{name}` missing"));
        assert_eq!((&g.0, &g.1), (&w.0, &w.1), "{case} {what}: `{name}`");
        assert!(g.2 == w.2, "{case} {what}: bytes of `{name}` differ");
    }
}

#[test]
fn every_fixture_consolidates_to_deepspeeds_own_result() {
    let d = tempfile::tempdir().unwrap();
    for (name, dir, info) in cases() {
        let out = d.path().join(format!("{name}.safetensors"));
        convert(&dir.join("checkpoint"), &out, &["--to", "1", "-q"]);
        let (got, extras) = read_st(&out);
        // the engine's own fp32 master weights, Adam moments, buffers, frozen parameters
        let (engine, _) = read_st(&dir.join("oracle/engine.safetensors"));
        contains(&name, "engine state", &got, &engine);
        // DeepSpeed's consolidation, where zero_to_fp32 can read the checkpoint
        let fp32 = dir.join("oracle/fp32.safetensors");
        if fp32.is_file() {
            let (oracle, _) = read_st(&fp32);
            contains(&name, "zero_to_fp32", &got, &oracle);
        } else {
            // BF16_Optimizer: zero_to_fp32 refuses what reshard reads
            let err = info["zero_to_fp32_error"].as_str().unwrap();
            assert!(err.contains("is not a zero checkpoint"), "{name}: {err}");
        }
        // nothing else but the optimizer's step counters and tied names
        let tied: Vec<String> = if info["tied"].as_bool().unwrap() {
            vec!["head.weight".to_string()]
        } else {
            vec![]
        };
        for n in got.keys() {
            assert!(
                engine.contains_key(n) || tied.contains(n) || n.ends_with(".step"),
                "{name}: unexpected `{n}`"
            );
        }
        // the engine's and client's non-tensor state is kept
        let extras = extras.unwrap();
        assert_eq!(extras["global_steps"], 2, "{name}");
        assert_eq!(extras["epoch"], 3, "{name}");
        assert_eq!(extras["dp_world_size"], dp(&info), "{name}");
        assert_eq!(extras["optimizer.param_groups.0.lr"], 0.01, "{name}");
    }
}

#[test]
fn zero_through_dcp_to_pt_is_exact() {
    let d = tempfile::tempdir().unwrap();
    for (name, dir, _) in cases() {
        let dcp = d.path().join(format!("{name}-dcp"));
        let pt = d.path().join(format!("{name}.pt"));
        let out = convert(
            &dir.join("checkpoint"),
            &dcp,
            &["--to", "3", "--format", "dcp"],
        );
        assert!(out.contains("dcp, 3 rank(s)"), "{out}");
        convert(&dcp, &pt, &["--to", "1", "-q"]);
        let got = read_all(&Checkpoint::open(&pt).unwrap());
        let (engine, _) = read_st(&dir.join("oracle/engine.safetensors"));
        contains(&name, "zero -> dcp@3 -> pt", &got, &engine);
        // the optimizer state sits where torch's optimizer state dict has it
        let ck = Checkpoint::open(&dcp).unwrap();
        let p = &ck.paths["optimizer.state.lin.weight.exp_avg"];
        let keys: Vec<String> = p.iter().map(|k| k.text()).collect();
        assert_eq!(
            keys,
            ["optimizer", "state", "lin.weight", "exp_avg"],
            "{name}"
        );
    }
}

/// Every tensor, and every non-tensor entry but those that record the degree (stage 3's
/// `param_shapes` lists sub-groups, which depend on it).
fn contents(p: &Path) -> (Tensors, Vec<(String, serde_json::Value)>) {
    let ck = Checkpoint::open(p).unwrap();
    let extras = ck
        .extras
        .iter()
        .filter(|e| !["dp_world_size", "ds_config", "param_shapes"].contains(&e.name.as_str()))
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect();
    (read_all(&ck), extras)
}

/// The non-tensor entry `name` of the checkpoint at `p`.
fn entry(p: &Path, name: &str) -> serde_json::Value {
    Checkpoint::open(p)
        .unwrap()
        .extras
        .into_iter()
        .find(|e| e.name == name)
        .unwrap()
        .value
}

#[test]
fn degree_round_trips_are_byte_identical() {
    let d = tempfile::tempdir().unwrap();
    for (name, dir, info) in cases() {
        let src = dir.join("checkpoint");
        let want = contents(&src);
        let n = dp(&info);
        for m in [1, if n == 2 { 3 } else { 2 }, 4] {
            let mid = d.path().join(format!("{name}-{m}"));
            let back = d.path().join(format!("{name}-{m}-back"));
            convert(
                &src,
                &mid,
                &["--to", &m.to_string(), "--format", "deepspeed", "-q"],
            );
            convert(
                &mid,
                &back,
                &["--to", &n.to_string(), "--format", "deepspeed", "-q"],
            );
            let (mid_t, mid_x) = contents(&mid);
            common::assert_same(&name, &format!("dp {n} -> {m}"), &mid_t, &want.0);
            assert_eq!(mid_x, want.1, "{name}: non-tensor entries at dp {m}");
            let (back_t, back_x) = contents(&back);
            common::assert_same(&name, &format!("dp {n} -> {m} -> {n}"), &back_t, &want.0);
            assert_eq!(back_x, want.1, "{name}");
            // the files DeepSpeed's engine at M ranks looks for, under the source's tag
            let ck = Checkpoint::open(&mid).unwrap();
            assert_eq!(ck.ranks as u64, m);
            assert_eq!(ck.tag.as_deref(), Some("global_step2"));
            assert_eq!(
                std::fs::read_to_string(mid.join("latest")).unwrap(),
                "global_step2"
            );
            let ds_dp = ck
                .extras
                .iter()
                .find(|e| e.name == "dp_world_size")
                .unwrap();
            assert_eq!(ds_dp.value, m, "{name}");
            let bf16 = info["dtype"] == "bfloat16";
            for r in 0..m {
                let prefix = if bf16 { "bf16_" } else { "" };
                let f = format!("global_step2/{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt");
                assert!(mid.join(&f).is_file(), "{name}: {f}");
            }
            // the model-dtype weights DeepSpeed's engine loads at stages 1 and 2 are the
            // module's own (the master weights rounded as DeepSpeed rounds them)
            if stage(&info) < 3 {
                let opts = OpenOptions {
                    weights: Some(Weights::Model),
                    ..Default::default()
                };
                let model = read_all(&Checkpoint::open_with(&mid, None, &opts).unwrap());
                let (module, _) = read_st(&dir.join("oracle/module.safetensors"));
                contains(&name, &format!("module at dp {m}"), &model, &module);
            }
            // back at the source's degree, the config and the flat groups are the source's
            for key in ["ds_config", "param_shapes"] {
                assert_eq!(entry(&back, key), entry(&src, key), "{name}: {key}");
            }
            if m == 3 && n == 2 {
                let cfg = entry(&mid, "ds_config");
                assert_eq!(cfg["train_micro_batch_size_per_gpu"], 2, "{name}");
                assert_eq!(cfg["train_batch_size"], 6, "{name}");
            }
        }
    }
}

#[test]
fn stages_can_be_changed_both_ways() {
    let d = tempfile::tempdir().unwrap();
    for (name, dir, info) in cases() {
        let src = dir.join("checkpoint");
        let want = contents(&src);
        let from = stage(&info);
        for to in [1u64, 2, 3].into_iter().filter(|&t| t != from) {
            let mid = d.path().join(format!("{name}-z{to}"));
            let back = d.path().join(format!("{name}-z{to}-back"));
            convert(
                &src,
                &mid,
                &[
                    "--to",
                    "3",
                    "--format",
                    "deepspeed",
                    "--zero-stage",
                    &to.to_string(),
                    "-q",
                ],
            );
            let per_rank_model = mid.join("global_step2/zero_pp_rank_2_mp_rank_00_model_states.pt");
            assert_eq!(per_rank_model.is_file(), to == 3, "{name} -> stage {to}");
            let ck = Checkpoint::open(&mid).unwrap();
            let z = ck
                .extras
                .iter()
                .find(|e| e.name == "optimizer_state_dict.zero_stage")
                .map(|e| e.value.clone());
            if info["grad_accum_fp32"] != true || to != 1 {
                assert_eq!(z, Some(serde_json::json!(to)), "{name} -> stage {to}");
            }
            convert(
                &mid,
                &back,
                &[
                    "--to",
                    &dp(&info).to_string(),
                    "--format",
                    "deepspeed",
                    "--zero-stage",
                    &from.to_string(),
                    "-q",
                ],
            );
            let (t, x) = contents(&back);
            common::assert_same(
                &name,
                &format!("stage {from} -> {to} -> {from}"),
                &t,
                &want.0,
            );
            assert_eq!(x, want.1, "{name}");
        }
    }
}

#[test]
fn model_weights_are_the_modules_own() {
    for (name, dir, info) in cases() {
        let src = dir.join("checkpoint");
        let opts = OpenOptions {
            weights: Some(Weights::Model),
            ..Default::default()
        };
        if stage(&info) == 3 {
            let e = Checkpoint::open_with(&src, None, &opts)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("ZeRO stage 3 checkpoint, which keeps no model-dtype copy"),
                "{e}"
            );
            continue;
        }
        let ck = Checkpoint::open_with(&src, None, &opts).unwrap();
        let (module, _) = read_st(&dir.join("oracle/module.safetensors"));
        let got = read_all(&ck);
        contains(&name, "--weights model", &got, &module);
        let bf16 = info["dtype"] == "bfloat16";
        assert_eq!(
            got["lin.weight"].0,
            if bf16 { "BF16" } else { "F32" },
            "{name}"
        );
    }
}

#[test]
fn tags_and_latest() {
    let d = tempfile::tempdir().unwrap();
    let case = fixture("deepspeed/zero2_dp2_f32_g1/checkpoint");
    let ck = common::copy_fixture("deepspeed/zero2_dp2_f32_g1", d.path());
    let tagged = Checkpoint::open_with(
        &ck,
        None,
        &OpenOptions {
            tag: Some("global_step2".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        read_all(&tagged),
        read_all(&Checkpoint::open(&case).unwrap())
    );
    assert_eq!(tagged.format, Format::DEEPSPEED);
    // the tag folder itself is a checkpoint too
    Checkpoint::open(ck.join("global_step2")).unwrap();
    fails(
        &["inspect", s(&ck), "--tag", "global_step9"],
        "has no checkpoint tagged `global_step9`",
    );
    fails(
        &["inspect", s(&ck), "--tag", "../x"],
        "tag `../x` is not a folder name",
    );
    // without `latest`, the sub-folders are named and --tag asked for
    std::fs::remove_file(ck.join("latest")).unwrap();
    fails(
        &["inspect", s(&ck)],
        "holds 1 checkpoint(s) in sub-folders (global_step2): choose one with --tag NAME",
    );
    let out = common::ok(&["inspect", s(&ck), "--tag", "global_step2"]);
    assert!(out.contains("deepspeed checkpoint, 2 rank(s)"), "{out}");
    assert!(out.contains("DeepSpeed 0.19.8 ZeRO stage 2"), "{out}");
    // `latest` naming a missing tag
    std::fs::write(ck.join("latest"), "global_step7").unwrap();
    fails(
        &["inspect", s(&ck)],
        "latest: names tag `global_step7`, but",
    );
    std::fs::write(ck.join("latest"), "../../etc").unwrap();
    fails(
        &["inspect", s(&ck)],
        "latest: holds `../../etc`, not a checkpoint tag",
    );
}

/// A copy of fixture `case`'s tag folder, changed by `f`.
fn damaged(case: &str, into: &Path, f: impl FnOnce(&Path)) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = into.join(format!("{case}-{n}"));
    let tag = dir.join("global_step2");
    std::fs::create_dir_all(&tag).unwrap();
    let src = fixture(&format!("deepspeed/{case}/checkpoint/global_step2"));
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tag.join(e.file_name())).unwrap();
    }
    f(&tag);
    tag
}

#[test]
fn damaged_checkpoints_get_one_line_naming_the_file() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out.safetensors");
    let run = |ck: &Path, needle: &str| {
        let msg = fails(&["convert", s(ck), s(&out), "--to", "1"], needle);
        assert!(!out.exists(), "{msg}");
        msg
    };
    let optim1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt";
    let ck = damaged("zero2_dp2_f32_g1", d.path(), |t| {
        std::fs::remove_file(t.join(optim1)).unwrap()
    });
    run(
        &ck,
        &format!("{optim1}: is missing: the checkpoint was saved by 2 data-parallel ranks"),
    );
    let ck = damaged("zero3_dp3_f32_g2", d.path(), |t| {
        std::fs::remove_file(t.join("zero_pp_rank_2_mp_rank_00_model_states.pt")).unwrap()
    });
    run(&ck, "zero_pp_rank_2_mp_rank_00_model_states.pt: is missing");
    let ck = damaged("zero1_dp2_f32_g1", d.path(), |t| {
        std::fs::copy(
            t.join(optim1),
            t.join("zero_pp_rank_2_mp_rank_00_optim_states.pt"),
        )
        .unwrap();
    });
    run(&ck, "zero_pp_rank_2_mp_rank_00_optim_states.pt: is a rank file beyond the 2 data-parallel ranks");
    let ck = damaged("zero1_dp2_f32_g1", d.path(), |t| {
        std::fs::rename(
            t.join("mp_rank_00_model_states.pt"),
            t.join("mp_rank_01_model_states.pt"),
        )
        .unwrap();
    });
    run(
        &ck,
        "mp_rank_01_model_states.pt: belongs to model-parallel rank > 0",
    );
    let ck = damaged("zero1_dp2_f32_g1", d.path(), |t| {
        let f = t.join(optim1);
        let b = std::fs::read(&f).unwrap();
        std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    });
    run(&ck, optim1);
    // rank files swapped: each records its own rank's parameter slices
    let ck = damaged("zero1_dp3_f32_g2", d.path(), |t| {
        let (a, b) = (
            t.join("zero_pp_rank_0_mp_rank_00_optim_states.pt"),
            t.join(optim1),
        );
        let tmp = t.join("swap");
        std::fs::rename(&a, &tmp).unwrap();
        std::fs::rename(&b, &a).unwrap();
        std::fs::rename(&tmp, &b).unwrap();
    });
    run(&ck, "records the parameter slices of another rank than 0");
    // the model states of another checkpoint (other parameter groups)
    let ck = damaged("zero1_dp2_f32_g1", d.path(), |t| {
        std::fs::copy(
            fixture(
                "deepspeed/zero1_dp2_bf16_g2/checkpoint/global_step2/mp_rank_00_model_states.pt",
            ),
            t.join("mp_rank_00_model_states.pt"),
        )
        .unwrap();
    });
    run(&ck, "zero_pp_rank_0_mp_rank_00_optim_states.pt: has 1 flat fp32 tensors, the model states' param_shapes 2 groups");
    // a damaged data byte: the record's CRC-32
    let ck = damaged("zero3_dp2_f32_g1", d.path(), |t| {
        let f = t.join(optim1);
        let mut b = std::fs::read(&f).unwrap();
        let n = b.len();
        b[n / 2] ^= 0x40;
        std::fs::write(&f, b).unwrap();
    });
    run(&ck, optim1);
    // sources are never written to
    let before = common::snapshot(&fixture("deepspeed"));
    let _ = reshard(&[
        "convert",
        s(&fixture("deepspeed/zero1_dp2_f32_g1/checkpoint")),
        s(&out),
        "--to",
        "1",
        "-q",
    ]);
    assert_eq!(before, common::snapshot(&fixture("deepspeed")));
}

#[test]
fn deepspeed_outputs_refuse_what_they_cannot_hold() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture("deepspeed/zero2_dp2_f32_g1/checkpoint");
    let out = d.path().join("out");
    let dcp = fixture("fsdp2_w2_f32/checkpoint");
    // `convert FROM out --to 2 --format deepspeed EXTRA…` fails saying `msg`
    let refused = |from: &std::path::Path, extra: &[&str], msg: &str| {
        let args = [
            &[
                "convert",
                s(from),
                s(&out),
                "--to",
                "2",
                "--format",
                "deepspeed",
            ][..],
            extra,
        ]
        .concat();
        fails(&args, msg);
    };
    refused(&dcp, &[], "a deepspeed output needs a DeepSpeed source");
    refused(
        &src,
        &["--exclude", "lin.weight"],
        "needs every parameter of the source; `lin.weight` is not selected",
    );
    refused(
        &src,
        &["--dtype", "bf16"],
        "a deepspeed output holds fp32 master weights",
    );
    let bf16 = fixture("deepspeed/zero2_dp2_bf16_g2/checkpoint");
    refused(
        &bf16,
        &["--weights", "model"],
        "a deepspeed output holds fp32 master weights",
    );
    fails(
        &["inspect", s(&dcp), "--weights", "model"],
        "which keeps one copy of its parameters",
    );
    assert!(!out.exists());
    // without the optimizer state: fresh moments, the master weights kept
    convert(
        &src,
        &out,
        &[
            "--to",
            "3",
            "--format",
            "deepspeed",
            "--exclude",
            "optimizer.state.*",
            "-q",
        ],
    );
    let ck = Checkpoint::open(&out).unwrap();
    assert!(ck
        .tensors
        .iter()
        .all(|t| !t.name.starts_with("optimizer.state.")));
    let (engine, _) = read_st(&fixture(
        "deepspeed/zero2_dp2_f32_g1/oracle/engine.safetensors",
    ));
    let params: Tensors = engine
        .into_iter()
        .filter(|(n, _)| !n.starts_with("optimizer."))
        .collect();
    contains(
        "zero2_dp2_f32_g1",
        "no optimizer state",
        &read_all(&ck),
        &params,
    );
}
