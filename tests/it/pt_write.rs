//! `convert … model.pt --to 1`: a torch.save file with the nested state dict. Checked in Rust
//! (zip directory, CRC-32 of every record, the pickle's structure, every tensor's bytes
//! against torch's oracle) and, when a Python with torch is available, by
//! `torch.load(weights_only=True)` itself.

use crate::common::archive::{prefix, record_data, walk_checked};
use crate::common::{convert, fixture, json_object, judge, s, torch_or_skip};
use reshard::formats::torch::pickle::{parse, torch_save_globals, Value};
use safetensors::SafeTensors;
use std::path::Path;

const CASES: [&str; 6] = [
    "fabric_fsdp1_w4_f32_torch21",
    "fabric_fsdp1_w4_f32",
    "fsdp2_w4_f32",
    "fsdp2_w3_bf16",
    "dtensor2d_w4",
    "fsdp1_w4_f32",
];

/// Convert fixture `case` to the `.pt` file `out`, with `args` after `--to 1`.
fn to_pt(case: &str, out: &Path, args: &[&str]) {
    let mut all = vec!["--to", "1", "-q"];
    all.extend_from_slice(args);
    convert(&fixture(case).join("checkpoint"), out, &all);
}

/// Flatten the unpickled state dict: '.'-joined keys to (storage key, shape) of tensors.
fn tensors(v: &Value, path: &str, out: &mut Vec<(String, String, Vec<i64>)>) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    if v.is_object("torch._utils", "_rebuild_tensor_v2")
        || v.is_object("torch._utils", "_rebuild_tensor_v3")
    {
        let args = v.args().unwrap();
        let pid = args[0].as_persistent_id().unwrap().as_list().unwrap();
        let key = pid[2].as_str().unwrap().to_string();
        out.push((path.to_string(), key, args[2].as_int_tuple().unwrap()));
        return;
    }
    if let Some(items) = v.as_dict() {
        for (k, x) in items {
            let k = k
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("{}", k.as_int().unwrap()));
            tensors(x, &join(&k), out);
        }
    } else if let Some(items) = v.as_list() {
        for (i, x) in items.iter().enumerate() {
            tensors(x, &join(&i.to_string()), out);
        }
    }
}

#[test]
fn pt_holds_every_tensor_of_the_oracle_with_valid_crcs() {
    let d = tempfile::tempdir().unwrap();
    for case in CASES {
        let out = d.path().join(format!("{case}.pt"));
        to_pt(case, &out, &[]);
        // the zip crate reads every record and checks its CRC-32; data is 64-byte aligned
        let bytes = std::fs::read(&out).unwrap();
        let w = walk_checked(&bytes);
        for e in w.iter().filter(|e| e.name.contains("/data/")) {
            assert_eq!(
                e.data_offset % 64,
                0,
                "{case}: {} not 64-byte aligned",
                e.name
            );
        }
        let prefix = prefix(&w);
        let pkl = record_data(&bytes, &w, &format!("{prefix}/data.pkl"));
        let value = parse(pkl, &torch_save_globals()).unwrap();
        let mut found = vec![];
        tensors(&value, "", &mut found);
        let oracle_bytes = std::fs::read(fixture(case).join("oracle/full.safetensors")).unwrap();
        let oracle = SafeTensors::deserialize(&oracle_bytes).unwrap();
        assert_eq!(found.len(), oracle.len(), "{case}: tensor count");
        for (name, key, shape) in &found {
            let want = oracle
                .tensor(name)
                .unwrap_or_else(|_| panic!("{case}: unexpected tensor {name}"));
            let shape: Vec<usize> = shape.iter().map(|&s| s as usize).collect();
            assert_eq!(shape, want.shape(), "{case}: {name}");
            let data = record_data(&bytes, &w, &format!("{prefix}/data/{key}"));
            assert_eq!(data, want.data(), "{case}: {name}");
        }
        // Lightning's layout: meta.pt's keys merged at the top level
        if case.starts_with("fabric") {
            assert_eq!(value.get("step").and_then(Value::as_int), Some(1), "{case}");
            assert!(
                value
                    .get("optimizer")
                    .and_then(|o| o.get("param_groups"))
                    .is_some(),
                "{case}"
            );
        }
    }
}

#[test]
fn flat_pt_with_strip_prefix() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("model.pt");
    to_pt(
        "fsdp2_w4_f32",
        &out,
        &["--include", "model.*", "--strip-prefix", "model."],
    );
    let bytes = std::fs::read(&out).unwrap();
    let w = walk_checked(&bytes);
    let pkl = record_data(&bytes, &w, &format!("{}/data.pkl", prefix(&w)));
    let value = parse(pkl, &torch_save_globals()).unwrap();
    let keys: Vec<&str> = value
        .as_dict()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap())
        .collect();
    assert!(
        keys.contains(&"embed.weight") && keys.contains(&"blocks.0.fc1.weight"),
        "{keys:?}"
    );
    assert!(
        keys.iter()
            .all(|k| !k.starts_with("model.") && !k.starts_with("optimizer")),
        "{keys:?}"
    );
}

#[test]
fn torch_load_weights_only_accepts_the_pt() {
    let Some(py) = torch_or_skip() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    for case in CASES {
        let out = d.path().join(format!("{case}.pt"));
        to_pt(case, &out, &[]);
        // the non-tensor oracle, plus meta.pt's `{"step": 1}` merged at the top for Fabric
        let mut nontensor = json_object(&fixture(case).join("oracle/nontensor.json"));
        if case.starts_with("fabric") {
            nontensor.insert("step".into(), 1.into());
        }
        let nt = d.path().join(format!("{case}.json"));
        std::fs::write(&nt, serde_json::Value::Object(nontensor).to_string()).unwrap();
        let oracle = fixture(case).join("oracle/full.safetensors");
        let args = ["pt-load", s(&out), s(&oracle), "--nontensor", s(&nt)];
        judge(&py, &args);
    }
}
