//! `convert … model.pt --to 1`: a torch.save file with the nested state dict. Checked in Rust
//! (zip directory, CRC-32 of every record, the pickle's structure, every tensor's bytes
//! against torch's oracle) and, when a Python with torch is available, by
//! `torch.load(weights_only=True)` itself.

use crate::common::torch_python;
use reshard::formats::pickle::{parse, torch_save_globals, Value};
use reshard::formats::torch_zip::Archive;
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

const CASES: [&str; 6] = [
    "fabric_fsdp1_w4_f32_torch21",
    "fabric_fsdp1_w4_f32",
    "fsdp2_w4_f32",
    "fsdp2_w3_bf16",
    "dtensor2d_w4",
    "fsdp1_w4_f32",
];

fn convert(args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "reshard {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
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
        convert(&[
            "convert",
            fixture(case).join("checkpoint").to_str().unwrap(),
            out.to_str().unwrap(),
            "--to",
            "1",
            "-q",
        ]);
        let bytes = std::fs::read(&out).unwrap();
        let ar = Archive::parse(&bytes).unwrap();
        for e in &ar.entries {
            ar.read_checked(&bytes, &e.name)
                .unwrap_or_else(|err| panic!("{case}: {}: {err}", e.name));
            let r = ar.record(&bytes, &e.name).unwrap();
            if e.name.contains("/data/") {
                assert_eq!(r.offset % 64, 0, "{case}: {} not 64-byte aligned", e.name);
            }
        }
        let pkl = ar.read(&bytes, &format!("{}/data.pkl", ar.prefix)).unwrap();
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
            let data = ar
                .read(&bytes, &format!("{}/data/{key}", ar.prefix))
                .unwrap();
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
    let ck = fixture("fsdp2_w4_f32").join("checkpoint");
    convert(&[
        "convert",
        ck.to_str().unwrap(),
        out.to_str().unwrap(),
        "--to",
        "1",
        "--include",
        "model.*",
        "--strip-prefix",
        "model.",
        "-q",
    ]);
    let bytes = std::fs::read(&out).unwrap();
    let ar = Archive::parse(&bytes).unwrap();
    let value = parse(
        ar.read(&bytes, &format!("{}/data.pkl", ar.prefix)).unwrap(),
        &torch_save_globals(),
    )
    .unwrap();
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
    let Some(py) = torch_python() else {
        eprintln!(
            "skipped: no Python with torch (set RESHARD_PYTHON or run scripts/setup_venv.sh)"
        );
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/torch_interop.py");
    let d = tempfile::tempdir().unwrap();
    for case in CASES {
        let out = d.path().join(format!("{case}.pt"));
        convert(&[
            "convert",
            fixture(case).join("checkpoint").to_str().unwrap(),
            out.to_str().unwrap(),
            "--to",
            "1",
            "-q",
        ]);
        // the non-tensor oracle, plus meta.pt's `{"step": 1}` merged at the top for Fabric
        let mut nontensor: serde_json::Map<String, serde_json::Value> = serde_json::from_str(
            &std::fs::read_to_string(fixture(case).join("oracle/nontensor.json")).unwrap(),
        )
        .unwrap();
        if case.starts_with("fabric") {
            nontensor.insert("step".into(), 1.into());
        }
        let nt = d.path().join(format!("{case}.json"));
        std::fs::write(&nt, serde_json::Value::Object(nontensor).to_string()).unwrap();
        let o = Command::new(&py)
            .arg(&script)
            .args([
                "pt-load",
                out.to_str().unwrap(),
                fixture(case)
                    .join("oracle/full.safetensors")
                    .to_str()
                    .unwrap(),
            ])
            .arg("--nontensor")
            .arg(&nt)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{case}: torch rejected the .pt: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
