//! `reshard diff` and `reshard::diff`: non-tensor state compared by value whatever its encoding
//! (one JSON extra in safetensors, per-key pickles in `.pt`, one `BYTE_IO` item in DCP), and a
//! difference reported as a finding (exit 1), not as an error.

use crate::common::{convert, fixture, reshard, s};
use reshard::diff::{diff_extras, Difference};
use reshard::formats::torch::pickle::Value;
use reshard::Extra;
use std::path::{Path, PathBuf};

/// Run `reshard diff a b`: (exit status, stdout, stderr).
fn diff(a: &Path, b: &Path) -> (Option<i32>, String, String) {
    let o = reshard(&["diff", s(a), s(b)]);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `from` with every occurrence of `what` replaced by `with` (of the same length), the first
/// `count` times; panics when fewer are found.
fn patched(from: &[u8], what: &[u8], with: &[u8], count: usize) -> Vec<u8> {
    assert_eq!(what.len(), with.len());
    let mut b = from.to_vec();
    let mut at = 0;
    for _ in 0..count {
        let i = at
            + b[at..]
                .windows(what.len())
                .position(|w| w == what)
                .unwrap_or_else(|| panic!("{} not found", String::from_utf8_lossy(what)));
        b[i..i + what.len()].copy_from_slice(with);
        at = i + what.len();
    }
    b
}

#[test]
fn non_tensor_state_compares_by_value_across_formats() {
    let d = tempfile::tempdir().unwrap();
    let src = fixture("fabric_fsdp1_w4_f32_torch21/checkpoint");
    let mut all: Vec<PathBuf> = vec![src.clone()];
    for (name, format) in [
        ("model.safetensors", None),
        ("model.pt", None),
        ("dcp", Some("dcp")),
        ("hf", Some("hf")),
        ("hfs", Some("hf-storage")),
    ] {
        let out = d.path().join(name);
        let mut args = vec!["--to", "1", "-q"];
        if let Some(f) = format {
            args.extend(["--format", f]);
        }
        convert(&src, &out, &args);
        all.push(out);
    }
    // param_groups is one pickled item in DCP, one JSON value in safetensors, one pickled
    // value per key in .pt: equal everywhere
    for a in &all {
        for b in &all {
            let (code, out, err) = diff(a, b);
            assert_eq!(
                (code, err.as_str(), out.as_str()),
                (
                    Some(0),
                    "",
                    "compared 65 tensor(s) and 29 non-tensor entries: identical\n"
                ),
                "diff {} {}",
                a.display(),
                b.display()
            );
        }
    }
    // one value changed (lr 0.01 -> 0.02) in the safetensors file's JSON and its pickle alike
    let st = d.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let lr = patched(&bytes, br#"\"lr\":0.01,"#, br#"\"lr\":0.02,"#, 1);
    // `X\x02\x00\x00\x00lr` then BINFLOAT 0.01 (big-endian), as hex
    let lr = patched(&lr, b"6c72473f847ae147ae147b", b"6c72473f947ae147ae147b", 1);
    let changed = d.path().join("lr.safetensors");
    std::fs::write(&changed, &lr).unwrap();
    for other in [&src, &all[2], &all[3]] {
        let (code, out, err) = diff(other, &changed);
        assert_eq!(
            (code, out.as_str(), err.as_str()),
            (
                Some(1),
                "optimizer.param_groups.0.lr: value 0.01 vs 0.02\n\
                 compared 65 tensor(s) and 29 non-tensor entries: 1 difference(s)\n",
                format!(
                    "reshard: {} and {} differ: 1 difference(s)\n",
                    other.display(),
                    changed.display()
                )
                .as_str()
            )
        );
    }
    // without the pickles (`reshard.extras.pickle` renamed away) the JSON is compared:
    // equal to the others as it stands, different once lr changes
    let key = (b"\"reshard.extras.pickle\"", b"\"reshard.extras.pickly\"");
    let json_only = d.path().join("json.safetensors");
    std::fs::write(&json_only, patched(&bytes, key.0, key.1, 1)).unwrap();
    let (code, out, _) = diff(&all[2], &json_only);
    assert_eq!(code, Some(0), "{out}");
    let json_lr = d.path().join("json_lr.safetensors");
    std::fs::write(&json_lr, patched(&lr, key.0, key.1, 1)).unwrap();
    let (code, out, _) = diff(&all[2], &json_lr);
    assert_eq!(code, Some(1));
    assert!(
        out.starts_with("optimizer.param_groups.0.lr: value 0.01 vs 0.02\n"),
        "{out}"
    );
}

fn extra(name: &str, v: Value) -> Extra {
    Extra {
        name: name.into(),
        value: reshard::formats::dcp::to_json(&v),
        pickle: Some(v),
        raw: None,
        origin: "test",
        opaque: None,
    }
}

fn json_extra(name: &str, v: serde_json::Value) -> Extra {
    Extra {
        name: name.into(),
        value: v,
        pickle: None,
        raw: None,
        origin: "test",
        opaque: None,
    }
}

fn dict(pairs: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        pairs
            .into_iter()
            .map(|(k, v)| (Value::Str(k.into()), v))
            .collect(),
    )
}

#[test]
fn entries_are_compared_by_value_not_by_encoding() {
    let group = || {
        dict(vec![
            ("lr", Value::Float(0.01)),
            (
                "betas",
                Value::Tuple(vec![Value::Float(0.9), Value::Float(0.95)]),
            ),
            ("amsgrad", Value::Bool(false)),
            ("nan", Value::Float(f64::NAN)),
            ("params", Value::List(vec![Value::Int(0), Value::Int(1)])),
            ("state", Value::Dict(vec![])),
        ])
    };
    // one nested value against its leaves, each its own entry, in another order
    let nested = vec![extra("pg", Value::List(vec![group()]))];
    let flat = vec![
        extra(
            "pg.0.params",
            Value::List(vec![Value::Int(0), Value::Int(1)]),
        ),
        extra(
            "pg.0.betas",
            Value::List(vec![Value::Float(0.9), Value::Float(0.95)]),
        ),
        extra("pg.0.lr", Value::Float(0.01)),
        extra("pg.0.amsgrad", Value::Bool(false)),
        extra("pg.0.nan", Value::Float(f64::NAN)),
        extra("pg.0.state", Value::Dict(vec![])),
    ];
    let d = diff_extras(&nested, &flat);
    assert_eq!(
        (d.entries, d.differences.len()),
        (8, 0),
        "{:?}",
        d.differences
    );
    // JSON only (no pickle) against the Python value
    let json = vec![json_extra(
        "pg",
        serde_json::json!([{"lr": 0.01, "betas": [0.9, 0.95], "amsgrad": false,
                            "nan": "nan", "params": [0, 1], "state": {}}]),
    )];
    assert!(diff_extras(&json, &nested).is_equal());
    assert!(diff_extras(&nested, &json).is_equal());
    // int dict keys are str keys (DCP turns them into strings)
    let int_keys = vec![extra(
        "state",
        Value::Dict(vec![(Value::Int(3), Value::Int(7))]),
    )];
    let str_keys = vec![extra("state", dict(vec![("3", Value::Int(7))]))];
    assert!(diff_extras(&int_keys, &str_keys).is_equal());
    // int, float and bool stay distinct; so do values JSON shows alike
    for (a, b) in [
        (Value::Int(1), Value::Float(1.0)),
        (Value::Int(1), Value::Bool(true)),
        (Value::Float(0.0), Value::Bool(false)),
        (Value::Float(f64::NAN), Value::Str("nan".into())),
        (Value::Bytes(b"ab".to_vec()), Value::Bytes(b"cd".to_vec())),
        (Value::Dict(vec![]), Value::List(vec![])),
        (Value::None, Value::Str("null".into())),
    ] {
        let d = diff_extras(&[extra("x", a.clone())], &[extra("x", b.clone())]);
        assert_eq!(
            d.differences.get("x"),
            Some(&Difference::Value {
                a: reshard::formats::dcp::to_json(&a),
                b: reshard::formats::dcp::to_json(&b),
            }),
            "{a:?} vs {b:?}"
        );
    }
    // a changed leaf is named by its dotted key; a leaf on one side only too
    let mut other = flat.clone();
    other[2] = extra("pg.0.lr", Value::Float(0.02));
    other.push(extra("pg.0.fused", Value::None));
    let d = diff_extras(&nested, &other);
    assert_eq!(
        d.differences.into_iter().collect::<Vec<_>>(),
        vec![
            ("pg.0.fused".to_string(), Difference::OnlyInB),
            (
                "pg.0.lr".to_string(),
                Difference::Value {
                    a: serde_json::json!(0.01),
                    b: serde_json::json!(0.02)
                }
            ),
        ]
    );
}
