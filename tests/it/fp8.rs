//! Block-quantized FP8 weights (DeepSeek-V3 style): dequantized by `--dtype` bit for bit as
//! DeepSeek-V3's `weight_dequant` computes them in torch (`tests/fixtures/fp8`, written by
//! `scripts/gen_fp8.py` with the CRC-32 of each expected tensor), copied as they are without
//! it, and malformed scales refused in one line naming the file.

use crate::common::*;
use reshard::formats::Checkpoint;
use reshard::layout::{DType, Placement};
use reshard::target::Rule;
use reshard::{ConvertOptions, LayoutSpec};
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    fixture("fp8/checkpoint")
}

/// `expected.json`: per tensor, the CRC-32 of its dequantized bytes as `bf16` or `f32`.
fn expected(dtype: &str) -> BTreeMap<String, u32> {
    let v = json_object(&fixture("fp8/expected.json"));
    v["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, t)| {
            (
                k.clone(),
                t[format!("{dtype}_crc32")].as_u64().unwrap() as u32,
            )
        })
        .collect()
}

/// Every tensor of an output folder or file, through the library.
fn tensors_of(dst: &Path) -> Tensors {
    read_all(&Checkpoint::open(dst).unwrap())
}

/// `got` holds exactly the expected tensors, each of `dtype` with the expected bytes.
fn assert_dequantized(got: &Tensors, dtype: &str, st_name: &str) {
    let want = expected(dtype);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "the output's tensors (no scales)"
    );
    for (name, crc) in &want {
        let (dt, _, bytes) = &got[name];
        assert_eq!(dt, st_name, "{name}");
        assert_eq!(
            crc32fast::hash(bytes),
            *crc,
            "{name}: bytes differ from torch's"
        );
    }
}

#[test]
fn dtype_dequantizes_as_deepseeks_weight_dequant() {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("bf16");
    convert(&src(), &dst, &["--to", "1", "--dtype", "bf16"]);
    let got = tensors_of(&dst);
    assert_dequantized(&got, "bf16", "BF16");
    let k = "model.layers.0.self_attn.k_proj.weight";
    let (want, _) = read_st(&fixture("fp8/expected_k_proj_bf16.safetensors"));
    assert!(got[k].2 == want[k].2, "{k}: bytes differ");
    let config = json_object(&dst.join("config.json"));
    assert!(!config.contains_key("quantization_config"));
    assert_eq!(config["hidden_size"], 136);
    // sharded f32, with windows and reads cut small: each element still finds its block
    let dst = tmp.path().join("f32");
    let mut opts = ConvertOptions::to(3);
    opts.dtype = Some(DType::F32);
    opts.exec.window = 4096;
    opts.exec.threads = Some(3);
    reshard::convert::convert(src(), &dst, &opts).unwrap();
    assert_dequantized(&tensors_of(&dst), "f32", "F32");
    // a column split: strided pieces, each row a run within the row of blocks
    let dst = tmp.path().join("cols");
    let mut opts = ConvertOptions::to(2);
    opts.layout = LayoutSpec {
        mesh: vec![2],
        rules: vec![Rule {
            pattern: "*_proj.weight".into(),
            placements: vec![Placement::Shard(1)],
        }],
        flat: false,
    };
    opts.dtype = Some(DType::BF16);
    reshard::convert::convert(src(), &dst, &opts).unwrap();
    assert_dequantized(&tensors_of(&dst), "bf16", "BF16");
}

#[test]
fn without_dtype_fp8_is_copied_with_its_scales() {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("out");
    convert(&src(), &dst, &["--to", "1"]);
    let want = tensors_of(&src());
    assert_same("fp8", "copy", &tensors_of(&dst), &want);
    let sharded = tmp.path().join("sharded");
    convert(&src(), &sharded, &["--to", "2"]);
    assert_same("fp8", "sharded copy", &tensors_of(&sharded), &want);
    assert_eq!(
        want["model.layers.0.mlp.up_proj.weight"].0, "F8_E4M3",
        "the fixture's weights are FP8"
    );
    let config = json_object(&dst.join("config.json"));
    assert_eq!(config["quantization_config"]["weight_block_size"][0], 128);
}

#[test]
fn inspect_shows_the_quantization() {
    let out = ok(&["inspect", s(&src())]);
    assert!(
        out.contains("quantized: FP8 block 128×128, 7 tensors"),
        "{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&ok(&["inspect", "--json", s(&src())])).unwrap();
    assert_eq!(v["quantization"]["weights"].as_array().unwrap().len(), 7);
    assert_eq!(v["quantization"]["weight_block_size"][1], 128);
}

/// The fixture copied to a folder of its own, its safetensors file's tensors changed by `edit`.
fn broken(edit: impl FnOnce(&mut BTreeMap<String, Full>)) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ck");
    copy_dir(&src(), &dir);
    let file = dir.join("model.safetensors");
    let mut m = read_safetensors(&file);
    edit(&mut m);
    write_safetensors(&file, &m);
    (tmp, dir)
}

#[test]
fn malformed_scales_are_one_line_errors_naming_the_file() {
    let w = "model.layers.0.mlp.gate_proj.weight";
    let sc = "model.layers.0.mlp.gate_proj.weight_scale_inv";
    let run = |dir: &Path, needles: &[&str]| {
        let dst = dir.parent().unwrap().join("out");
        fails_all(
            &["convert", s(dir), s(&dst), "--to", "1", "--dtype", "bf16"],
            needles,
        );
        assert!(!dst.exists(), "nothing is written");
    };
    let (_t, dir) = broken(|m| {
        m.remove(sc);
    });
    run(
        &dir,
        &["model.safetensors", w, "no scale tensor", "_scale_inv"],
    );
    let (_t, dir) = broken(|m| {
        let t = m.get_mut(sc).unwrap();
        t.shape = vec![4];
    });
    run(&dir, &["model.safetensors", sc, "has shape [4]", "[2, 2]"]);
    let (_t, dir) = broken(|m| {
        let t = m.get_mut(sc).unwrap();
        t.dtype = Dtype::F16;
        t.data.truncate(8);
    });
    run(&dir, &["model.safetensors", sc, "is F16, not F32"]);
    // the same folder copies as it is without --dtype
    let dst = dir.parent().unwrap().join("copy");
    convert(&dir, &dst, &["--to", "1"]);
}
