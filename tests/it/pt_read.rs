//! Reading `torch.save` (`.pt`, zip format) files written by torch itself
//! (`scripts/gen_pt_fixtures.py`, fixtures under tests/fixtures/pt): every tensor and
//! non-tensor value against the oracle torch's own `flatten_state_dict` produced; then
//! converting them with the CLI (`.pt` → safetensors, `.pt` → `.pt`, `.pt` → DCP at 3 ranks →
//! `.pt`), judged by reshard and, when a Python with torch is available, by `torch.load`;
//! and refusing damaged or unsupported files with one line naming the file.

use crate::common::{
    assert_same, convert, fails, fixture, json_object, ok, python, read_all, read_st, root, s,
    torch_or_skip, Tensors,
};
use reshard::formats::{Checkpoint, Format, KeyPart};
use reshard::layout::Region;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Every readable fixture.
const CASES: &[&str] = &["flat_dtypes", "training", "tied", "views", "ordered"];

fn case_dir(case: &str) -> PathBuf {
    fixture("pt").join(case)
}

fn model(case: &str) -> PathBuf {
    case_dir(case).join("model.pt")
}

fn bad(name: &str) -> PathBuf {
    case_dir("bad").join(name)
}

fn oracle(case: &str) -> Tensors {
    read_st(&case_dir(case).join("oracle.safetensors")).0
}

fn nontensor(case: &str) -> serde_json::Map<String, serde_json::Value> {
    json_object(&case_dir(case).join("nontensor.json"))
}

/// `ck` holds exactly the oracle's tensors and non-tensor values.
fn assert_oracle(case: &str, what: &str, ck: &Checkpoint) {
    assert_same(case, what, &read_all(ck), &oracle(case));
    let nt = nontensor(case);
    let got: BTreeMap<&str, &serde_json::Value> = ck
        .extras
        .iter()
        .map(|x| (x.name.as_str(), &x.value))
        .collect();
    let names: BTreeSet<&str> = got.keys().copied().collect();
    let want: BTreeSet<&str> = nt.keys().map(String::as_str).collect();
    assert_eq!(names, want, "{case} {what}: non-tensor keys");
    for (k, v) in &nt {
        assert_eq!(got[k.as_str()], v, "{case} {what}: value of `{k}`");
    }
}

/// torch.load(a) and torch.load(b) hold the same nested state dict; dict keys equal with
/// their types (int keys stay ints), or as `str(key)` when `loose` (after DCP, which names
/// keys by `str`).
fn torch_same(py: &Path, a: &Path, b: &Path, loose: bool) {
    let script = root().join("scripts/gen_pt_fixtures.py");
    let mut args = vec!["compare", s(a), s(b)];
    if loose {
        args.push("--loose-keys");
    }
    let o = Command::new(py).arg(&script).args(&args).output().unwrap();
    assert!(
        o.status.success(),
        "torch.load({}) and torch.load({}) differ: {}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn every_fixture_reads_exactly_like_its_oracle() {
    for case in CASES {
        let ck = Checkpoint::open(model(case)).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(ck.format, Format::PT, "{case}");
        assert_eq!((ck.ranks, ck.files.len()), (1, 1), "{case}");
        assert!(ck.producer.as_deref().unwrap().starts_with("torch.save"));
        assert_oracle(case, "read_region", &ck);
        for x in &ck.extras {
            assert!(x.pickle.is_some(), "{case}: `{}` keeps its pickle", x.name);
            assert_eq!(x.origin, "pt");
        }
        // a nested key has its path; a top-level one needs none
        for (name, path) in &ck.paths {
            assert!(path.len() > 1 || path != &[KeyPart::Key(name.clone())]);
        }
    }
}

#[test]
fn typed_reads_of_views_and_tied_weights() {
    // views: the transposed tensor reads as the transpose of its base, the offset slice as
    // the right elements, the stride-0 expansion as repeated rows
    let ck = Checkpoint::open(model("views")).unwrap();
    let full = |n: &str| Region::full(&ck.tensor(n).unwrap().shape);
    let base = ck.read_array::<f32>("base", &full("base")).unwrap();
    let t = ck
        .read_array::<f32>("transposed", &full("transposed"))
        .unwrap();
    assert_eq!(t, base.t().into_dyn());
    let slice = ck.read_array::<i32>("slice", &full("slice")).unwrap();
    assert_eq!(
        slice.iter().copied().collect::<Vec<_>>(),
        (7..19).collect::<Vec<i32>>()
    );
    let e = ck.read_array::<f32>("expanded", &full("expanded")).unwrap();
    let e = e.into_dimensionality::<ndarray::Ix2>().unwrap();
    assert!(e.rows().into_iter().all(|r| r == e.row(0)));
    // a region of a non-contiguous view
    let part = ck
        .read_array::<f32>("cols", &Region::new(vec![1, 1], vec![2, 2]))
        .unwrap();
    let whole = ck.read_array::<f32>("cols", &full("cols")).unwrap();
    assert_eq!(part[[0, 0]], whole[[1, 1]]);
    assert_eq!(part[[1, 1]], whole[[2, 2]]);
    // tied: two keys, one storage record
    let ck = Checkpoint::open(model("tied")).unwrap();
    let a = &ck.tensor("embed.weight").unwrap().pieces[0].loc;
    let b = &ck.tensor("lm_head.weight").unwrap().pieces[0].loc;
    assert_eq!(a, b);
    // bf16 converts on read
    let ck = Checkpoint::open(model("flat_dtypes")).unwrap();
    let p = ck
        .read_array::<f32>("proj", &Region::full(&[3, 13]))
        .unwrap();
    let raw = ck
        .read_array::<half::bf16>("proj", &Region::full(&[3, 13]))
        .unwrap();
    assert!(p.iter().zip(raw.iter()).all(|(x, y)| *x == y.to_f32()));
}

#[test]
fn nesting_follows_dcp_flattening() {
    let ck = Checkpoint::open(model("training")).unwrap();
    let k = |s: &str| KeyPart::Key(s.into());
    assert_eq!(
        ck.paths["optimizer.state.1.exp_avg_sq"],
        vec![
            k("optimizer"),
            k("state"),
            KeyPart::IntKey { int: 1 },
            k("exp_avg_sq")
        ]
    );
    assert_eq!(
        ck.paths["optimizer.param_groups.0.params"],
        vec![
            k("optimizer"),
            k("param_groups"),
            KeyPart::Index(0),
            k("params")
        ]
    );
    assert_eq!(ck.paths["hparams.betas"], vec![k("hparams"), k("betas")]);
    assert!(!ck.paths.contains_key("step"));
    let ck = Checkpoint::open(model("ordered")).unwrap();
    assert_eq!(
        ck.paths["layers.1.w"],
        vec![k("layers"), KeyPart::Index(1), k("w")]
    );
    assert!(ck.tensor("dotted.key").is_some() && !ck.paths.contains_key("dotted.key"));
}

#[test]
fn convert_to_safetensors_equals_the_oracle() {
    let d = tempfile::tempdir().unwrap();
    for case in CASES {
        let out = d.path().join(format!("{case}.safetensors"));
        convert(&model(case), &out, &["--to", "1", "-q"]);
        let (tensors, extras) = read_st(&out);
        assert_same(case, "safetensors", &tensors, &oracle(case));
        let nt = nontensor(case);
        match extras {
            Some(serde_json::Value::Object(m)) => assert_eq!(m, nt, "{case}: reshard.extras"),
            None => assert!(nt.is_empty(), "{case}: no reshard.extras"),
            Some(other) => panic!("{case}: reshard.extras is {other}"),
        }
    }
    // inspect reads it too
    let text = ok(&["inspect", s(&model("training"))]);
    assert!(text.contains("model.fc1.weight"), "{text}");
}

#[test]
fn pt_to_pt_round_trips() {
    let py = torch_or_skip();
    let d = tempfile::tempdir().unwrap();
    for case in CASES {
        let out = d.path().join(format!("{case}.pt"));
        convert(&model(case), &out, &["--to", "1", "-q"]);
        let src = Checkpoint::open(model(case)).unwrap();
        let ck = Checkpoint::open(&out).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_oracle(case, ".pt -> .pt", &ck);
        assert_eq!(ck.paths, src.paths, "{case}: nesting");
        if *case == "tied" {
            // the writer stores a tied group once (crate::ties), so the output ties them too
            let loc = |n: &str| ck.tensor(n).unwrap().pieces[0].loc.clone();
            assert_eq!(
                loc("embed.weight"),
                loc("lm_head.weight"),
                "tied in the output"
            );
        }
        if let Some(py) = &py {
            torch_same(py, &model(case), &out, false);
        }
    }
}

#[test]
fn pt_to_dcp_at_three_ranks_and_back_round_trips() {
    let py = torch_or_skip();
    let d = tempfile::tempdir().unwrap();
    for case in CASES {
        let dcp = d.path().join(format!("{case}-dcp"));
        let back = d.path().join(format!("{case}-back.pt"));
        convert(&model(case), &dcp, &["--to", "3", "--format", "dcp", "-q"]);
        let mid = Checkpoint::open(&dcp).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!((mid.format, mid.ranks), (Format::DCP, 3), "{case}");
        assert_same(case, "dcp", &read_all(&mid), &oracle(case));
        convert(&dcp, &back, &["--to", "1", "-q"]);
        let ck = Checkpoint::open(&back).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_oracle(case, ".pt -> dcp -> .pt", &ck);
        if let Some(py) = &py {
            torch_same(py, &model(case), &back, true);
        }
    }
}

/// `reshard convert BAD out.safetensors` fails with one line naming the file (plus
/// `needle`) and writes nothing.
fn refused(file: &Path, needle: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let err = fails(&["convert", s(file), s(&out), "--to", "1", "-q"], needle);
    assert!(err.contains(s(file)), "does not name the file: {err}");
    assert!(!out.exists(), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{err}");
}

#[test]
fn damaged_files_are_refused_with_one_line() {
    let d = tempfile::tempdir().unwrap();
    let good = std::fs::read(model("training")).unwrap();
    let n = good.len();
    let write = |name: &str, bytes: &[u8]| {
        let p = d.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    // truncated: inside the first local header, inside data.pkl, in the tensor data, in the
    // central directory, in the end records
    for cut in [2, 10, 100, n / 2, n - 300, n - 40, n - 1] {
        refused(&write(&format!("cut{cut}.pt"), &good[..cut]), "");
    }
    // data.pkl damaged: the CRC-32 catches it
    let ar = reshard::formats::torch::zip::Archive::parse(&good).unwrap();
    let pkl_name = format!("{}/data.pkl", ar.prefix);
    let pkl = ar.record(&good, &pkl_name).unwrap();
    let mut flipped = good.clone();
    flipped[pkl.offset as usize + 40] ^= 0x5a;
    refused(&write("flipped.pt", &flipped), "CRC-32");
    // ... and with the CRC zeroed (unchecked), the pickle decoder refuses it
    let mut garbled = good.clone();
    garbled[pkl.offset as usize] = 0xff; // an unknown opcode where PROTO was
    let cd = n - 22 - 20 - 56; // EOCD, zip64 locator and zip64 EOCD precede nothing else
    let cd_start = (0..cd)
        .rev()
        .find(|&i| {
            good[i..].starts_with(b"PK\x01\x02") && good[i + 46..].starts_with(pkl_name.as_bytes())
        })
        .unwrap();
    garbled[cd_start + 16..cd_start + 20].fill(0);
    refused(
        &write("garbled.pt", &garbled),
        "unknown opcode 0xff at byte 0",
    );
    // a storage record whose name no longer matches its central directory entry
    let mut renamed = good.clone();
    let rec = ar.record(&good, &format!("{}/data/0", ar.prefix)).unwrap();
    let name_at = (0..rec.offset as usize)
        .rev()
        .find(|&i| renamed[i..].starts_with(b"PK\x03\x04"))
        .unwrap()
        + 30;
    renamed[name_at] = b'X';
    refused(&write("renamed.pt", &renamed), "its local header names");
    // the central directory's first signature broken
    let mut cdbad = good.clone();
    let first_cd = (0..n)
        .find(|&i| good[i..].starts_with(b"PK\x01\x02"))
        .unwrap();
    cdbad[first_cd + 1] = b'Q';
    refused(&write("cd.pt", &cdbad), "bad signature");
}

#[test]
fn unsupported_contents_are_refused_with_one_line() {
    refused(
        &bad("bare_tensor.pt"),
        "holds a single tensor, not a state dict",
    );
    refused(
        &bad("top_list.pt"),
        "holds a pickled list, not a state dict",
    );
    refused(
        &bad("tensor_in_tuple.pt"),
        "`a.pair`: a tensor inside a tuple; only dicts and lists may hold tensors",
    );
    refused(
        &bad("missing_record.pt"),
        "`w`: zip has no record `good/data/0`",
    );
    refused(
        &bad("short_record.pt"),
        "`w`: storage `0` has 48 bytes but its record holds 20",
    );
    // The legacy format is detected as a .pt and named, by the library and the CLI.
    let e = Checkpoint::open(bad("legacy.pt")).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}: ", bad("legacy.pt").display()))
            && e.contains("legacy torch.save format; re-save with torch>=1.6 default"),
        "{e}"
    );
    refused(&bad("legacy.pt"), "uses the legacy torch.save format");
}

/// An optimizer's state dict keyed by int parameter numbers, one saved before its first step
/// (`"state": {}`), and a model: `.pt` → `.pt` keeps int keys ints and the empty dict, so
/// `load_state_dict` restores every parameter's state.
#[test]
fn optimizer_state_dicts_survive_pt_to_pt() {
    let Some(py) = torch_or_skip() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("in.pt");
    let out = d.path().join("out.pt");
    let make = format!(
        r#"
import torch
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
opt = torch.optim.AdamW(m.parameters(), lr=0.1)
fresh = torch.optim.SGD(m.parameters(), lr=0.5).state_dict()
m(torch.randn(5, 3)).sum().backward()
opt.step()
torch.save({{"model": m.state_dict(), "optimizer": opt.state_dict(), "fresh": fresh}}, {src:?})
"#,
        src = s(&src)
    );
    python(&py, &make);
    convert(&src, &out, &["--to", "1", "-q"]);
    torch_same(&py, &src, &out, false);
    let check = format!(
        r#"
import torch
sd = torch.load({out:?}, weights_only=True)
assert sd["fresh"]["state"] == {{}}, sd["fresh"]
assert sorted(sd["optimizer"]["state"]) == [0, 1, 2, 3], sd["optimizer"]["state"].keys()
m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
m.load_state_dict(sd["model"])
opt = torch.optim.AdamW(m.parameters(), lr=0.1)
opt.load_state_dict(sd["optimizer"])
assert len(opt.state) == 4 and all("exp_avg" in s for s in opt.state.values())
torch.optim.SGD(m.parameters(), lr=0.5).load_state_dict(sd["fresh"])
print("ok")
"#,
        out = s(&out)
    );
    python(&py, &check);
}
