//! Megatron-LM's own layouts: save directories (`latest_checkpointed_iteration.txt` beside
//! `iter_NNNNNNN/` folders, the tracked iteration by default, `--step N` to choose) with
//! either format inside, and legacy per-rank checkpoints (`--ckpt-format torch`:
//! `mp_rank_TT[_PPP]/model_optim_rng.pt`, `tests/fixtures/megatron_legacy`, written by
//! `scripts/gen_megatron_legacy.py` from seeded global tensors cut by Megatron's rules), read
//! as global tensors and judged byte for byte against the generator's global tensors
//! (`<config>.safetensors`).

use crate::common::{self, convert, fails, fixture, ok, read_all, read_st, s, Tensors};
use reshard::formats::torch::pickle::Value;
use reshard::formats::{Checkpoint, Format};
use reshard::OpenOptions;
use std::path::{Path, PathBuf};

/// The legacy fixture cases: (case, the config its global tensors are of, ranks: TP × PP ×
/// EP).
const CASES: &[(&str, &str, u32)] = &[
    ("tp2", "llama", 2),
    ("pp2", "llama", 2),
    ("tp2_pp2", "llama", 4),
    ("te_qkv_bias_tp2_pp2", "qwen_te", 4),
    // 4 experts over 2 expert ranks (mp_rank_TT_EEE), each split over 2 tensor ranks
    ("moe_tp2_ep2", "moe", 4),
];

fn legacy(case: &str) -> PathBuf {
    fixture(&format!("megatron_legacy/{case}/checkpoint"))
}

fn expected(config: &str) -> Tensors {
    read_st(&fixture(&format!("megatron_legacy/{config}.safetensors"))).0
}

/// `got` holds exactly the tensors of `want`, with the same dtype, shape and bytes.
fn same(what: &str, got: &Tensors, want: &Tensors) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: names"
    );
    for (name, w) in want {
        let g = &got[name];
        assert_eq!((&g.0, &g.1), (&w.0, &w.1), "{what}: `{name}`");
        assert!(g.2 == w.2, "{what}: bytes of `{name}` differ");
    }
}

/// A copy of the legacy case `case`'s save directory in a temporary folder.
fn copy(case: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("save");
    common::copy_dir(&legacy(case), &dir);
    (d, dir)
}

#[test]
fn legacy_checkpoints_read_as_the_global_tensors() {
    for (case, config, ranks) in CASES {
        let want = expected(config);
        let ck = Checkpoint::open(legacy(case)).unwrap();
        assert_eq!(ck.format, Format::MEGATRON_LEGACY, "{case}");
        assert_eq!(ck.ranks, *ranks, "{case}");
        assert_eq!(ck.tag.as_deref(), Some("iter_0000007"), "{case}");
        same(case, &read_all(&ck), &want);
        // the arguments and counters are non-tensor entries for common.pt; the optimizer's
        // and the RNG states are each rank's and left out
        let names: Vec<&str> = ck.extras.iter().map(|x| x.name.as_str()).collect();
        for n in [
            "args",
            "checkpoint_version",
            "iteration",
            "num_floating_point_operations_so_far",
            "opt_param_scheduler.max_lr",
        ] {
            assert!(names.contains(&n), "{case}: {n} not in {names:?}");
        }
        assert!(
            names.iter().all(|n| !n.starts_with("optimizer")
                && !n.starts_with("rng_state")
                && !n.starts_with("model")),
            "{case}: {names:?}"
        );
        assert!(ck.extras.iter().all(|x| x.origin == "common.pt"));
        let iteration = ck.extras.iter().find(|x| x.name == "iteration").unwrap();
        assert_eq!(iteration.value, serde_json::json!(7));
        // through the CLI into one safetensors file: the same bytes
        let d = tempfile::tempdir().unwrap();
        let st = d.path().join("m.safetensors");
        convert(
            &legacy(case),
            &st,
            &[
                "--to",
                "1",
                "--format",
                "safetensors",
                "--recipe",
                "none",
                "-q",
            ],
        );
        same(&format!("{case} → safetensors"), &read_st(&st).0, &want);
    }
}

#[test]
fn inspect_shows_the_split_and_the_iteration() {
    let out = ok(&["inspect", s(&legacy("tp2_pp2"))]);
    assert!(
        out.contains("megatron-legacy checkpoint, 4 rank(s), 4 file(s)"),
        "{out}"
    );
    assert!(
        out.contains("Megatron-LM (--ckpt-format torch), TP 2, PP 2, 4 layers, iteration 7"),
        "{out}"
    );
    assert!(
        out.contains("decoder.layers.3.mlp.linear_fc1.weight"),
        "{out}"
    );
    // the iteration folder itself opens too
    let it = legacy("tp2_pp2").join("iter_0000007");
    let out = ok(&["inspect", s(&it)]);
    assert!(
        out.contains("megatron-legacy checkpoint, 4 rank(s)"),
        "{out}"
    );
}

#[test]
fn legacy_to_torch_dist_carries_the_arguments_into_common_pt() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("dist");
    convert(
        &legacy("tp2"),
        &out,
        &["--to", "2", "--format", "megatron", "-q"],
    );
    // a save directory read from gives a save directory: the tracker, the same iteration
    assert_eq!(
        std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap(),
        "7"
    );
    assert!(out.join("iter_0000007").join("metadata.json").is_file());
    let ck = Checkpoint::open(&out).unwrap();
    assert_eq!(
        (ck.format, ck.tag.as_deref()),
        (Format::MEGATRON, Some("iter_0000007"))
    );
    // layers stacked as megatron-core saves them, the bytes the legacy files hold
    assert!(ck
        .tensor("decoder.layers.self_attention.linear_qkv.weight")
        .is_some());
    same("legacy → torch_dist", &unstacked(&ck), &expected("llama"));
    let args = ck.extras.iter().find(|x| x.name == "args").unwrap();
    assert_eq!(args.origin, "common.pt");
    let hidden = args.pickle.as_ref().and_then(|a| a.get("hidden_size"));
    assert_eq!(hidden.and_then(|v| v.as_int()), Some(8));
}

#[test]
fn legacy_to_torch_dist_is_megatron_cores_own_save() {
    // megatron-core saved each model both ways: reshard's torch_dist from the legacy files
    // holds the same keys, shapes and bytes as megatron-core's own, and the same
    // `_extra_state` objects
    let frameworks = |case: &str, f: &str| fixture(&format!("frameworks/{case}/{f}"));
    let objects = |ck: &Checkpoint| {
        let mut v: Vec<String> = ck
            .extras
            .iter()
            .filter(|e| e.name.contains("._extra_state/"))
            .map(|e| e.name.clone())
            .collect();
        v.sort();
        v
    };
    for case in [
        "llama_tp2_pp2",
        "llama_tied_tp2",
        "qwen2_tp2",
        "mixtral_ep2",
        "mixtral_gg_ep2",
        "qwen2moe_tp2_ep2",
    ] {
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("dist");
        convert(
            &frameworks(case, "legacy"),
            &out,
            &["--format", "megatron", "-q"],
        );
        let got = Checkpoint::open(&out).unwrap();
        let want = Checkpoint::open(frameworks(case, "torch_dist")).unwrap();
        same(
            &format!("{case}: legacy → torch_dist"),
            &read_all(&got),
            &read_all(&want),
        );
        assert_eq!(
            objects(&got),
            objects(&want),
            "{case}: _extra_state objects"
        );
        assert!(!objects(&got).is_empty(), "{case}");
    }
}

/// The files under `dir`, relative, sorted.
fn files_under(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = common::snapshot(dir)
        .into_keys()
        .map(|p| {
            p.strip_prefix(dir)
                .unwrap_or(&p)
                .to_string_lossy()
                .replace('\\', "/")
        })
        .collect();
    v.sort();
    v
}

/// A split: TP × PP × EP.
type Split = (u64, u64, u64);

/// Write `src` as a legacy checkpoint at TP × PP × EP into `out` and read it back.
fn write_legacy(src: &Path, out: &Path, (tp, pp, ep): (u64, u64, u64)) -> Checkpoint {
    let (t, p, e) = (tp.to_string(), pp.to_string(), ep.to_string());
    convert(
        src,
        out,
        &[
            "--format",
            "megatron-legacy",
            "--tp",
            &t,
            "--pp",
            &p,
            "--ep",
            &e,
            "-q",
        ],
    );
    let ck = Checkpoint::open(out).unwrap();
    assert_eq!(ck.format, Format::MEGATRON_LEGACY, "{}", out.display());
    assert_eq!(ck.ranks as u64, tp * pp * ep, "{}", out.display());
    assert_eq!(ck.tag.as_deref(), Some("iter_0000007"));
    ck
}

/// The rank folders Megatron-LM's `get_checkpoint_name` names for TP × PP × EP.
fn rank_files((tp, pp, ep): (u64, u64, u64)) -> Vec<String> {
    let mut v = vec!["latest_checkpointed_iteration.txt".to_string()];
    for p in 0..pp {
        for e in 0..ep {
            for t in 0..tp {
                let mut n = format!("mp_rank_{t:02}");
                if pp > 1 {
                    n += &format!("_{p:03}");
                }
                if ep > 1 {
                    n += &format!("_{e:03}");
                }
                v.push(format!("iter_0000007/{n}/model_optim_rng.pt"));
            }
        }
    }
    v.sort();
    v
}

#[test]
fn legacy_written_at_other_splits_reads_back_byte_for_byte() {
    let splits: &[(&str, &[Split])] = &[
        ("tp2", &[(1, 1, 1), (2, 4, 1), (1, 2, 1)]),
        ("pp2", &[(2, 1, 1), (1, 4, 1)]),
        ("tp2_pp2", &[(1, 1, 1), (2, 1, 1)]),
        ("te_qkv_bias_tp2_pp2", &[(1, 1, 1), (2, 4, 1)]),
        ("moe_tp2_ep2", &[(1, 1, 1), (2, 2, 4), (1, 1, 2)]),
    ];
    for (case, to) in splits {
        let config = CASES.iter().find(|c| c.0 == *case).unwrap().1;
        let want = expected(config);
        for split in *to {
            let d = tempfile::tempdir().unwrap();
            let out = d.path().join("out");
            let ck = write_legacy(&legacy(case), &out, *split);
            assert_eq!(files_under(&out), rank_files(*split), "{case} → {split:?}");
            assert_eq!(
                std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap(),
                "7"
            );
            same(&format!("{case} → {split:?}"), &read_all(&ck), &want);
            // the arguments say the new split; the counters are carried
            let args = ck.extras.iter().find(|x| x.name == "args").unwrap();
            let arg = |n: &str| args.pickle.as_ref().and_then(|a| a.get(n)?.as_int());
            assert_eq!(
                (
                    arg("tensor_model_parallel_size"),
                    arg("pipeline_model_parallel_size"),
                    arg("expert_model_parallel_size")
                ),
                (
                    Some(split.0 as i64),
                    Some(split.1 as i64),
                    Some(split.2 as i64)
                ),
                "{case} → {split:?}"
            );
            let names: Vec<&str> = ck.extras.iter().map(|x| x.name.as_str()).collect();
            for n in [
                "checkpoint_version",
                "iteration",
                "num_floating_point_operations_so_far",
            ] {
                assert!(names.contains(&n), "{case}: {n} not in {names:?}");
            }
        }
    }
    // legacy TP 2 → legacy TP 1 → legacy TP 2 × PP 2: the source's global tensors each time
    let d = tempfile::tempdir().unwrap();
    let one = d.path().join("tp1");
    write_legacy(&legacy("tp2"), &one, (1, 1, 1));
    let again = write_legacy(&one, &d.path().join("tp2_pp2"), (2, 2, 1));
    same(
        "tp2 → tp1 → tp2 × pp2",
        &read_all(&again),
        &expected("llama"),
    );
    // the split defaults to the source's
    let out = d.path().join("same");
    convert(
        &legacy("tp2_pp2"),
        &out,
        &["--format", "megatron-legacy", "-q"],
    );
    assert_eq!(files_under(&out), rank_files((2, 2, 1)));
}

/// A torch_dist checkpoint's tensors under the legacy reader's names: each layer (and expert)
/// of a stacked tensor as its own tensor, `experts.experts` as `local_experts`.
fn unstacked(ck: &Checkpoint) -> Tensors {
    let mut out = Tensors::new();
    for (name, (dtype, shape, bytes)) in read_all(ck) {
        let Some(rest) = name.strip_prefix("decoder.layers.") else {
            out.insert(name, (dtype, shape, bytes));
            continue;
        };
        let (expert, rest) = match rest.strip_prefix("mlp.experts.experts.") {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let axes = if expert { 2 } else { 1 };
        let count = shape[..axes].iter().product::<u64>() as usize;
        let experts = shape.get(1).copied().unwrap_or(1) as usize;
        let each = bytes.len() / count;
        for k in 0..count {
            let n = if expert {
                format!(
                    "decoder.layers.{}.mlp.experts.local_experts.{}.{rest}",
                    k / experts,
                    k % experts
                )
            } else {
                format!("decoder.layers.{k}.{rest}")
            };
            out.insert(
                n,
                (
                    dtype.clone(),
                    shape[axes..].to_vec(),
                    bytes[k * each..(k + 1) * each].to_vec(),
                ),
            );
        }
    }
    out
}

#[test]
fn torch_dist_and_grouped_gemm_experts_to_legacy_and_back() {
    let frameworks = |case: &str, f: &str| fixture(&format!("frameworks/{case}/{f}"));
    for (case, splits) in [
        ("llama_tp2_pp2", &[(1u64, 1u64, 1u64), (2, 4, 1)][..]),
        ("llama_tied_tp2", &[(2, 2, 1), (1, 4, 1)][..]),
        ("mixtral_gg_ep2", &[(1, 1, 1), (2, 2, 4)][..]),
        ("mixtral_ep2", &[(2, 1, 1)][..]),
        ("qwen2moe_tp2_ep2", &[(1, 1, 1), (2, 2, 4)][..]),
    ] {
        let want = unstacked(&Checkpoint::open(frameworks(case, "torch_dist")).unwrap());
        // the legacy files megatron-core wrote hold the torch_dist checkpoint's tensors; with
        // grouped GEMM, weight1 / weight2 are each local expert's projections transposed
        let ck = Checkpoint::open(frameworks(case, "legacy")).unwrap();
        same(
            &format!("{case}: legacy vs torch_dist"),
            &read_all(&ck),
            &want,
        );
        for split in splits {
            let d = tempfile::tempdir().unwrap();
            // from torch_dist (layers stacked), and from the legacy files
            for (src, what) in [("torch_dist", "from torch_dist"), ("legacy", "from legacy")] {
                let out = d.path().join(src);
                let ck = write_legacy(&frameworks(case, src), &out, *split);
                assert_eq!(files_under(&out), rank_files(*split), "{case} {what}");
                same(&format!("{case} {what} → {split:?}"), &read_all(&ck), &want);
            }
        }
    }
}

#[test]
fn legacy_output_errors_write_nothing() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out");
    let go = |src: &Path, extra: &[&str], needle: &str| {
        let mut args = vec!["convert", s(src), s(&out), "--format", "megatron-legacy"];
        args.extend_from_slice(extra);
        fails(&args, needle);
        assert!(!out.exists(), "{needle}: something was written");
    };
    let src = legacy("tp2");
    go(
        &src,
        &["--tp", "3"],
        "--tp 3 does not divide args.padded_vocab_size 16",
    );
    go(
        &src,
        &["--tp", "4"],
        "--tp 4 does not divide the 2 query groups (args.num_query_groups)",
    );
    go(
        &src,
        &["--pp", "3"],
        "args say 4 layers over 3 pipeline stages, which reshard cannot place",
    );
    go(
        &legacy("moe_tp2_ep2"),
        &["--ep", "3"],
        "--ep 3 does not divide args.num_experts 4",
    );
    go(
        &src,
        &["--to", "3"],
        "--to 3: a megatron-legacy output is split by --tp, --pp and --ep (here TP 2 × PP 1 × EP 1 = 2 rank file(s))",
    );
    // a source without Megatron-LM's arguments
    let st = d.path().join("m.safetensors");
    convert(&src, &st, &["--to", "1", "-q"]);
    go(
        &st,
        &["--tp", "1"],
        "a megatron-legacy output needs Megatron-LM's arguments",
    );
    // the split options belong to a legacy output
    fails(
        &["convert", s(&src), s(&out), "--to", "1", "--tp", "1"],
        "--tp splits a megatron-legacy output",
    );
    assert!(!out.exists());
}

#[test]
fn save_directories_open_the_tracked_iteration_and_step_chooses() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("save");
    // a torch_dist checkpoint at iteration 7, a legacy one at iteration 12
    common::copy_dir(
        &fixture("megatron/mcore016_tp2_dp1/checkpoint"),
        &dir.join("iter_0000007"),
    );
    common::copy_dir(
        &legacy("tp2").join("iter_0000007"),
        &dir.join("iter_0000012"),
    );
    std::fs::write(dir.join("latest_checkpointed_iteration.txt"), "7\n").unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(
        (ck.format, ck.tag.as_deref()),
        (Format::MEGATRON, Some("iter_0000007"))
    );
    let want = read_all(&Checkpoint::open(dir.join("iter_0000007")).unwrap());
    assert_eq!(read_all(&ck), want);
    let step = |n| OpenOptions {
        step: Some(n),
        ..Default::default()
    };
    let ck12 = Checkpoint::open_with(&dir, None, &step(12)).unwrap();
    assert_eq!(
        (ck12.format, ck12.tag.as_deref()),
        (Format::MEGATRON_LEGACY, Some("iter_0000012"))
    );
    // the CLI: inspect lists the iterations, --step chooses, convert reads the tracked one
    let out = ok(&["inspect", s(&dir)]);
    assert!(out.contains("megatron checkpoint, 2 rank(s)"), "{out}");
    assert!(
        out.contains(
            "one of 2 checkpoints in the folder: iter_0000007, iter_0000012 (read: iter_0000007"
        ),
        "{out}"
    );
    let out = ok(&["inspect", s(&dir), "--step", "12"]);
    assert!(out.contains("megatron-legacy checkpoint"), "{out}");
    let st = d.path().join("m.safetensors");
    convert(&dir, &st, &["--to", "1", "-q"]);
    assert_eq!(read_all(&Checkpoint::open(&st).unwrap()), want);
    let st12 = d.path().join("m12.safetensors");
    convert(
        &dir,
        &st12,
        &["--to", "1", "--step", "12", "--recipe", "none", "-q"],
    );
    same("--step 12", &read_st(&st12).0, &expected("llama"));
    // the tracker moves on: the newest is read
    std::fs::write(dir.join("latest_checkpointed_iteration.txt"), "12").unwrap();
    assert_eq!(
        Checkpoint::open(&dir).unwrap().format,
        Format::MEGATRON_LEGACY
    );
    // a release checkpoint
    std::fs::rename(dir.join("iter_0000012"), dir.join("release")).unwrap();
    std::fs::write(dir.join("latest_checkpointed_iteration.txt"), "release").unwrap();
    let rel = Checkpoint::open(&dir).unwrap();
    assert_eq!(rel.tag.as_deref(), Some("release"));
}

#[test]
fn save_directory_errors_name_the_file() {
    let (_d, dir) = copy("tp2");
    let tracker = dir.join("latest_checkpointed_iteration.txt");
    std::fs::write(&tracker, "9").unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: names iteration 9, but {} is not a folder",
            tracker.display(),
            dir.join("iter_0000009").display()
        )
    );
    fails(&["inspect", s(&dir)], "names iteration 9, but");
    std::fs::write(&tracker, "seven").unwrap();
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}: holds `seven`, not an iteration number or `release`",
            tracker.display()
        )),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1);
    std::fs::write(&tracker, "7").unwrap();
    fails(
        &["inspect", s(&dir), "--step", "8"],
        &format!(
            "has no iteration 8 ({} is not a folder)",
            dir.join("iter_0000008").display()
        ),
    );
    // without a tracker the newest iteration is read
    std::fs::remove_file(&tracker).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.tag.as_deref(), Some("iter_0000007"));
}

/// Rewrite one pickled int argument of a rank file in place (`name` from `from` to `to`, both
/// below 256, so the pickle keeps its length), and the CRC-32 its zip records of `data.pkl`.
fn set_arg_byte(file: &Path, name: &str, from: u8, to: u8) {
    let mut b = std::fs::read(file).unwrap();
    let u32_at = |b: &[u8], i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    let u16_at = |b: &[u8], i: usize| u16::from_le_bytes(b[i..i + 2].try_into().unwrap()) as usize;
    // data.pkl: its local header first (sizes in a data descriptor after the data, as
    // torch.save writes it), its size in the central directory's entry
    let rec = b"model_optim_rng/data.pkl";
    let find =
        |b: &[u8], from: usize| from + b[from..].windows(rec.len()).position(|w| w == rec).unwrap();
    let local = find(&b, 0) - 30;
    let start = local + 30 + u16_at(&b, local + 26) + u16_at(&b, local + 28);
    let central = find(&b, start) - 46;
    assert_eq!(&b[central..central + 4], b"PK\x01\x02");
    let end = start + u32_at(&b, central + 20) as usize;
    // torch.save's protocol 2: the name as BINUNICODE (`X`, u32 length, bytes), BINPUT (`q`,
    // a memo index), then the value as BININT1 (`K`, one byte)
    let mut pat = vec![b'X'];
    pat.extend_from_slice(&(name.len() as u32).to_le_bytes());
    pat.extend_from_slice(name.as_bytes());
    let at = start
        + b[start..end]
            .windows(pat.len())
            .position(|w| w == pat.as_slice())
            .unwrap_or_else(|| panic!("{name} not in {}", file.display()));
    let v = at + pat.len();
    assert_eq!(
        (b[v], b[v + 2], b[v + 3]),
        (b'q', b'K', from),
        "{name} as pickled"
    );
    b[v + 3] = to;
    let crc = crc32fast::hash(&b[start..end]).to_le_bytes();
    // the CRC in the data descriptor and in the central directory's entry
    let desc = if &b[end..end + 4] == b"PK\x07\x08" {
        end + 4
    } else {
        end
    };
    b[desc..desc + 4].copy_from_slice(&crc);
    b[central + 16..central + 20].copy_from_slice(&crc);
    std::fs::write(file, b).unwrap();
}

#[test]
fn legacy_errors_name_the_file() {
    // a rank file missing
    let (_d, dir) = copy("tp2_pp2");
    let it = dir.join("iter_0000007");
    let gone = it.join("mp_rank_01_001/model_optim_rng.pt");
    std::fs::remove_file(&gone).unwrap();
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: is missing: the arguments of {} say TP 2, PP 2",
            gone.display(),
            it.join("mp_rank_00_000/model_optim_rng.pt").display()
        )
    );
    fails(&["inspect", s(&dir)], "is missing: the arguments of");

    // arguments that differ between ranks
    let (_d, dir) = copy("tp2");
    let it = dir.join("iter_0000007");
    let other = it.join("mp_rank_01/model_optim_rng.pt");
    set_arg_byte(&other, "num_attention_heads", 4, 8);
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}: has args.num_attention_heads = 8, but {} has 4",
            other.display(),
            it.join("mp_rank_00/model_optim_rng.pt").display()
        )),
        "{e}"
    );

    // a tensor whose local shape contradicts the arguments (both ranks say 8 heads)
    let first = it.join("mp_rank_00/model_optim_rng.pt");
    set_arg_byte(&first, "num_attention_heads", 4, 8);
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}: `decoder.layers.0.self_attention.linear_qkv.weight` has the shape [8, 8], but the arguments make it [12, 8]",
            first.display()
        )),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1);

    // a pipeline split the arguments cannot place
    let (_d, dir) = copy("pp2");
    let it = dir.join("iter_0000007");
    for f in ["mp_rank_00_000", "mp_rank_00_001"] {
        set_arg_byte(&it.join(f).join("model_optim_rng.pt"), "num_layers", 4, 5);
    }
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert!(
        e.contains("args say 5 layers over 2 pipeline stages, which reshard cannot place"),
        "{e}"
    );
}

#[test]
fn save_dir_writes_a_megatron_output_as_a_save_directory() {
    let d = tempfile::tempdir().unwrap();
    let hf = fixture("frameworks/llama_tp2/hf_mbridge");
    // from Hugging Face: the iteration the recipe's common.pt holds (0)
    let out = d.path().join("mc");
    convert(&hf, &out, &["--format", "megatron", "--save-dir", "-q"]);
    assert_eq!(
        files_under(&out)
            .into_iter()
            .filter(|f| !f.ends_with(".distcp"))
            .collect::<Vec<_>>(),
        [
            "iter_0000000/.metadata",
            "iter_0000000/common.pt",
            "iter_0000000/metadata.json",
            "latest_checkpointed_iteration.txt"
        ]
    );
    assert_eq!(
        std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap(),
        "0"
    );
    let ck = Checkpoint::open(&out).unwrap();
    let plain = d.path().join("plain");
    convert(&hf, &plain, &["--format", "megatron", "-q"]);
    assert!(plain.join("metadata.json").is_file());
    assert_eq!(
        read_all(&ck),
        read_all(&Checkpoint::open(&plain).unwrap()),
        "the same tensors either way"
    );
    // a save directory for a format that has none is refused, nothing written
    let bad = d.path().join("bad");
    fails(
        &["convert", s(&hf), s(&bad), "--format", "hf", "--save-dir"],
        "--save-dir writes a megatron output as a Megatron-LM save directory; this output is hf",
    );
    assert!(!bad.exists());
}

// ------------------------------------------------------------------ the distributed optimizer

/// `tests/fixtures/megatron_distopt` (`scripts/gen_megatron_distopt.py`): a GPT trained two
/// Adam steps by megatron-core's DistributedOptimizer at TP 2 × DP 2, saved as legacy files
/// with `distrib_optim.pt` and by megatron-core as `torch_dist` (`fully_reshardable`).
fn distopt(form: &str) -> PathBuf {
    fixture(&format!("megatron_distopt/{form}"))
}

/// A `torch_dist` checkpoint's tensors with the layers unstacked: `…decoder.layers.X` of
/// shape `[L, …]` becomes `…decoder.layers.{i}.X` (also after `optimizer.state.<key>.`).
fn layers_unstacked(ck: &Checkpoint) -> Tensors {
    let mut out = Tensors::new();
    for (name, (dtype, shape, bytes)) in read_all(ck) {
        let Some(at) = name.find("decoder.layers.") else {
            out.insert(name, (dtype, shape, bytes));
            continue;
        };
        let (head, rest) = name.split_at(at + "decoder.layers.".len());
        let each = bytes.len() / shape[0] as usize;
        for i in 0..shape[0] as usize {
            out.insert(
                format!("{head}{i}.{rest}"),
                (
                    dtype.clone(),
                    shape[1..].to_vec(),
                    bytes[i * each..(i + 1) * each].to_vec(),
                ),
            );
        }
    }
    out
}

#[test]
fn distributed_optimizer_state_reads_as_megatron_core_saved_it() {
    let ck = Checkpoint::open(distopt("legacy")).unwrap();
    let oracle = Checkpoint::open(distopt("torch_dist")).unwrap();
    let got = read_all(&ck);
    let want = layers_unstacked(&oracle);
    // 15 weights and, for each, megatron-core's param / exp_avg / exp_avg_sq
    assert_eq!(got.len(), 60);
    assert_eq!(
        got.keys()
            .filter(|k| k.starts_with("optimizer.state.exp_avg_sq."))
            .count(),
        15
    );
    same(
        "legacy with distrib_optim.pt vs megatron-core's torch_dist",
        &got,
        &want,
    );
    // each state piece is a stretch of a distrib_optim.pt record: files 2 and 3
    assert_eq!(ck.files.len(), 4);
    for (i, f) in ck.files.iter().enumerate() {
        let name = if i < 2 {
            "model_optim_rng.pt"
        } else {
            "distrib_optim.pt"
        };
        assert!(f.ends_with(name), "{}", f.display());
    }
    for t in ck
        .tensors
        .iter()
        .filter(|t| t.name.starts_with("optimizer."))
    {
        assert!(t.pieces.iter().all(|p| p.loc.file >= 2), "{}", t.name);
    }
    // the optimizer's non-tensor state, for common.pt: param_groups (each with its step) and
    // megatron-core's sharding type
    let extra = |n: &str| {
        ck.extras
            .iter()
            .find(|x| x.name == n)
            .unwrap_or_else(|| panic!("no extra {n}"))
    };
    assert_eq!(
        extra("optimizer.optimizer.param_groups.0.step").value,
        serde_json::json!(2.0)
    );
    assert_eq!(
        extra("optimizer.param_state_sharding_type").value,
        serde_json::json!("fully_reshardable")
    );
    assert_eq!(
        extra("optimizer.param_state_sharding_type").origin,
        "common.pt"
    );
}

#[test]
fn distributed_optimizer_state_converts_to_torch_dist_and_keeps_through_it() {
    let d = tempfile::tempdir().unwrap();
    // legacy -> torch_dist at 3 ranks: every tensor (optimizer state included) kept
    let out = d.path().join("dist3");
    convert(
        &distopt("legacy"),
        &out,
        &["--to", "3", "--format", "megatron", "-q"],
    );
    // layers stacked under megatron-core's keys, optimizer state included: the same keys,
    // shapes and bytes as megatron-core's own torch_dist save of that state
    let ck = Checkpoint::open(&out).unwrap();
    let oracle = read_all(&Checkpoint::open(distopt("torch_dist")).unwrap());
    same("legacy -> torch_dist", &read_all(&ck), &oracle);
    let sharding = ck
        .extras
        .iter()
        .find(|x| x.name == "optimizer")
        .and_then(|x| x.pickle.as_ref())
        .and_then(|v| v.get("param_state_sharding_type"))
        .and_then(|v| v.as_str());
    assert_eq!(sharding, Some("fully_reshardable"));
    // torch_dist -> torch_dist at 3 ranks: megatron-core's own save, optimizer state kept
    let out = d.path().join("td3");
    convert(
        &distopt("torch_dist"),
        &out,
        &["--to", "3", "--format", "megatron", "-q"],
    );
    let want = oracle;
    assert_eq!(
        want.keys()
            .filter(|k| k.starts_with("optimizer.state."))
            .count(),
        27
    );
    same(
        "torch_dist -> torch_dist",
        &read_all(&Checkpoint::open(&out).unwrap()),
        &want,
    );
}

#[test]
fn distributed_optimizer_errors_name_the_file() {
    let copy = || {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("save");
        common::copy_dir(&distopt("legacy"), &dir);
        (d, dir.join("iter_0000007"))
    };
    let hostile = |n: &str| distopt(&format!("hostile/{n}"));
    // rank 1's file missing while rank 0 has one
    let (_d, it) = copy();
    let gone = it.join("mp_rank_01/distrib_optim.pt");
    std::fs::remove_file(&gone).unwrap();
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: is missing: {} has the distributed optimizer's state, so every rank folder must",
            gone.display(),
            it.join("mp_rank_00/distrib_optim.pt").display()
        )
    );
    // only data-parallel rank 0's half of the flat state: the sizes do not match the params
    for (file, needle) in [
        (
            "short.pt",
            "holds 1888 elements per state, but the 15 parameters of",
        ),
        (
            "not_coalesced.pt",
            "is not in the buckets_coalesced layout",
        ),
        (
            "two_buffers.pt",
            "holds the state of 2 gradient buffers (parameters of several dtypes); reshard reads one",
        ),
    ] {
        let (_d, it) = copy();
        let bad = it.join("mp_rank_01/distrib_optim.pt");
        std::fs::copy(hostile(file), &bad).unwrap();
        let e = Checkpoint::open(&it).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{}: {needle}", bad.display())),
            "{file}: {e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
        fails(&["inspect", s(&it)], needle);
    }
    // the parameter state's file missing while model_optim_rng.pt holds the optimizer's
    // state_dict (saved with the optimizer, not --no-save-optim): refused naming it, not read
    // as weights only
    let (_d, it) = copy();
    for r in ["mp_rank_00", "mp_rank_01"] {
        std::fs::remove_file(it.join(r).join("distrib_optim.pt")).unwrap();
    }
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    let missing = it.join("mp_rank_00/distrib_optim.pt");
    assert!(
        e.starts_with(&format!("{}: is missing", missing.display())),
        "{e}"
    );
}

#[test]
fn distributed_optimizer_state_of_tied_pipeline_stages_and_several_buckets() {
    // TP 1 × PP 2 × DP 2, tied embeddings (each pipeline end's copy in a bucket of its own),
    // 500-element buckets: the state equals the seeds the generator set it from
    let ck = Checkpoint::open(distopt("tied_pp2/legacy")).unwrap();
    let mut want = Tensors::new();
    for s in 0..2 {
        want.extend(read_st(&distopt(&format!("tied_pp2/expected_stage{s}.safetensors"))).0);
    }
    let got: Tensors = read_all(&ck)
        .into_iter()
        .filter(|(k, _)| k.starts_with("optimizer."))
        .collect();
    assert_eq!(got.len(), 42);
    same("tied PP 2, several buckets", &got, &want);
    // the last stage's copy of the tied embedding is megatron-core's replica: not presented
    assert!(!ck
        .tensors
        .iter()
        .any(|t| t.name.ends_with("output_layer.weight")));
}

#[test]
fn distributed_optimizer_state_of_experts_converts_to_megatron_core_torch_dist() {
    // 4 experts at EP 2 × DP 4 (expert-data-parallel 2): two chained optimizers, the dense
    // parameters' state in mp_rank_00_000's distrib_optim.pt, each expert rank's experts in
    // its own folder's
    let legacy = distopt("moe_ep2/legacy");
    let ck = Checkpoint::open(&legacy).unwrap();
    let oracle_ck = Checkpoint::open(distopt("moe_ep2/torch_dist")).unwrap();
    // 29 weights (8 experts' two linears each among them) and, for each, megatron-core's
    // param / exp_avg / exp_avg_sq
    assert_eq!(ck.tensors.len(), 116);
    assert!(ck.tensors.iter().any(|t| {
        t.name
        == "optimizer.state.exp_avg.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    }));
    // legacy -> torch_dist: megatron-core's keys (layers and experts stacked, [L, E, …]),
    // shapes and bytes, optimizer state included
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("dist3");
    convert(&legacy, &out, &["--to", "3", "--format", "megatron", "-q"]);
    let got = read_all(&Checkpoint::open(&out).unwrap());
    let want = read_all(&oracle_ck);
    assert_eq!(
        want.keys()
            .filter(|k| k.starts_with("optimizer.state."))
            .count(),
        30
    );
    assert_eq!(
        want["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"].1,
        vec![2, 4, 48, 16]
    );
    same("MoE legacy -> torch_dist", &got, &want);
    // common.pt: the chained optimizers' param_groups under int keys 0 (dense) and 1
    // (experts), each with megatron-core's sharding type, as megatron-core writes them
    let common = Checkpoint::open(&out).unwrap();
    let optimizer = common
        .extras
        .iter()
        .find(|x| x.name == "optimizer")
        .and_then(|x| x.pickle.as_ref())
        .expect("common.pt's optimizer");
    let oracle_optimizer = oracle_ck
        .extras
        .iter()
        .find(|x| x.name == "optimizer")
        .and_then(|x| x.pickle.as_ref())
        .expect("the oracle's optimizer");
    assert_eq!(optimizer, oracle_optimizer);
    for (i, expert) in [(0, false), (1, true)] {
        let Some(Value::Dict(chained)) = Some(optimizer) else {
            panic!("common.pt's optimizer is not a dict")
        };
        let o = chained
            .iter()
            .find(|(k, _)| *k == Value::Int(i))
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no optimizer {i} (an int key)"));
        assert_eq!(
            o.get("param_state_sharding_type").and_then(|v| v.as_str()),
            Some("fully_reshardable")
        );
        let groups = o.get("optimizer").and_then(|v| v.get("param_groups"));
        let Some(Value::List(groups)) = groups else {
            panic!("optimizer {i}: no param_groups")
        };
        assert!(groups
            .iter()
            .all(|g| g.get("is_expert_parallel").and_then(|v| v.as_bool()) == Some(expert)));
    }
}

#[test]
fn distributed_optimizer_of_experts_errors_name_the_file() {
    let copy = || {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("save");
        common::copy_dir(&distopt("moe_ep2/legacy"), &dir);
        (d, dir.join("iter_0000007"))
    };
    // expert rank 1's file in expert rank 0's folder: no dense state there
    let (_d, it) = copy();
    let bad = it.join("mp_rank_00_000/distrib_optim.pt");
    std::fs::copy(it.join("mp_rank_00_001/distrib_optim.pt"), &bad).unwrap();
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: holds no state (None) for the dense parameters' optimizer",
            bad.display()
        )
    );
    // a dense model's single optimizer state in a folder of the MoE model
    let (_d, it) = copy();
    let bad = it.join("mp_rank_00_001/distrib_optim.pt");
    std::fs::copy(
        distopt("legacy/iter_0000007/mp_rank_00/distrib_optim.pt"),
        &bad,
    )
    .unwrap();
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: holds the state of 1 chained optimizer(s), not the 2 of a model with expert parallelism (the dense parameters', the experts')",
            bad.display()
        )
    );
    // the two chained optimizers' states swapped: the sizes do not match the parameters
    let (_d, it) = copy();
    let bad = it.join("mp_rank_00_000/distrib_optim.pt");
    std::fs::copy(distopt("hostile/moe_swapped.pt"), &bad).unwrap();
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}: holds 4608 elements per state, but the 13 dense parameters of",
            bad.display()
        )),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    fails(&["inspect", s(&it)], "holds 4608 elements per state");
}

#[test]
fn distributed_optimizer_state_of_grouped_gemm_experts_converts_to_megatron_core_torch_dist() {
    // GroupedMLP's experts (moe_grouped_gemm): each layer's local experts in two parameters,
    // `mlp.experts.weight1` [H, E_local·2F/TP] and `weight2` [E_local·F/TP, H], in the expert
    // optimizer's buffer; their state seeded, saved by megatron-core both ways. At TP 1 × EP 2
    // (expert-data-parallel 2) and at TP 2 × EP 2 (the experts split over the tensor ranks,
    // the SwiGLU gate and up halves of each expert's linear_fc1 apart)
    for (case, folders) in [("gg_ep2", 2), ("gg_tp2_ep2", 4)] {
        let legacy = distopt(&format!("{case}/legacy"));
        let ck = Checkpoint::open(&legacy).unwrap();
        // the rank files and, after them, each folder's distrib_optim.pt
        assert_eq!(ck.files.len(), 2 * folders, "{case}");
        // 29 weights (8 experts' two linears each among them) and, for each, megatron-core's
        // param / exp_avg / exp_avg_sq; the experts' state read per expert, as the weights
        assert_eq!(ck.tensors.len(), 116, "{case}");
        let fc1 = ck
            .tensors
            .iter()
            .find(|t| {
                t.name
                == "optimizer.state.exp_avg.decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
            })
            .unwrap_or_else(|| panic!("{case}: no expert 3's linear_fc1 state"));
        assert_eq!(fc1.shape, vec![24, 16], "{case}");
        // a transposed view of its stretch of distrib_optim.pt, not a copy
        assert!(
            fc1.pieces
                .iter()
                .all(|p| p.loc.file as usize >= folders && p.loc.strides.is_some()),
            "{case}"
        );
        // legacy -> torch_dist: megatron-core's own fully_reshardable save, every tensor (the
        // experts' state stacked [L, E, …] under megatron-core's keys) byte for byte
        let d = tempfile::tempdir().unwrap();
        let out = d.path().join("dist3");
        convert(&legacy, &out, &["--to", "3", "--format", "megatron", "-q"]);
        let got = read_all(&Checkpoint::open(&out).unwrap());
        let want = read_all(&Checkpoint::open(distopt(&format!("{case}/torch_dist"))).unwrap());
        assert_eq!(want.len(), 40, "{case}");
        for (linear, shape) in [
            ("linear_fc1", [2, 4, 24, 16]),
            ("linear_fc2", [2, 4, 16, 12]),
        ] {
            for key in ["param", "exp_avg", "exp_avg_sq"] {
                let name = format!(
                    "optimizer.state.{key}.decoder.layers.mlp.experts.experts.{linear}.weight"
                );
                assert_eq!(want[&name].1, shape.to_vec(), "{case}: {name}");
            }
        }
        same(&format!("{case}: legacy -> torch_dist"), &got, &want);
    }
}

#[test]
fn distributed_optimizer_of_grouped_gemm_experts_errors_name_the_file() {
    // SequentialMLP's expert state (moe_ep2's) in a folder of GroupedMLP's: the same model
    // but for the experts' sizes, which make another buffer
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("save");
    common::copy_dir(&distopt("gg_ep2/legacy"), &dir);
    let it = dir.join("iter_0000007");
    let bad = it.join("mp_rank_00_001/distrib_optim.pt");
    std::fs::copy(
        distopt("moe_ep2/legacy/iter_0000007/mp_rank_00_001/distrib_optim.pt"),
        &bad,
    )
    .unwrap();
    let e = Checkpoint::open(&it).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: holds 4608 elements per state, but the 4 expert parameters of {} make a buffer of 2304 (another model, or data-parallel ranks missing)",
            bad.display(),
            it.join("mp_rank_00_001/model_optim_rng.pt").display()
        )
    );
}
