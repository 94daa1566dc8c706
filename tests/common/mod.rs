//! Shared helpers of the integration tests: a synthetic model written as real per-rank
//! safetensors shards (with the `safetensors` crate, not with reshard), and CLI runners.
#![allow(dead_code)]

use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A full tensor: dtype, shape and row-major little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Full {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

pub fn elem(d: Dtype) -> usize {
    d.bitsize() / 8
}

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// bf16 values that are finite (exponent not all ones).
fn finite_bf16(n: usize, seed: u64) -> Vec<u8> {
    let mut b = bytes(n * 2, seed);
    for i in 0..n {
        b[2 * i + 1] &= 0x3f; // keep the exponent small and finite
    }
    b
}

/// The synthetic model: uneven dims, a scalar, a zero-size tensor, many dtypes.
pub fn model() -> BTreeMap<String, Full> {
    let spec: Vec<(&str, Dtype, Vec<usize>)> = vec![
        ("model.embed.weight", Dtype::F32, vec![10, 12]),
        ("model.cls", Dtype::F32, vec![3, 12]),
        ("model.logit_scale", Dtype::F32, vec![1]),
        ("model.blocks.0.qkv.weight", Dtype::BF16, vec![36, 12]),
        ("model.blocks.0.fc1.weight", Dtype::BF16, vec![13, 12]),
        ("model.blocks.0.fc1.bias", Dtype::F16, vec![13]),
        ("model.head.weight", Dtype::F32, vec![5, 12]),
        ("model.mask", Dtype::BOOL, vec![7]),
        ("model.ids", Dtype::I64, vec![11, 2]),
        ("model.codes", Dtype::U8, vec![17]),
        ("model.f8", Dtype::F8_E4M3, vec![5, 3]),
        ("model.cube", Dtype::F64, vec![3, 2, 5]),
        ("model.empty", Dtype::F32, vec![0, 4]),
        ("opt.step", Dtype::F32, vec![]),
        ("opt.embed.exp_avg", Dtype::F32, vec![10, 12]),
    ];
    spec.into_iter()
        .enumerate()
        .map(|(i, (n, d, s))| {
            let count: usize = s.iter().product();
            let data = if d == Dtype::BF16 {
                finite_bf16(count, i as u64 + 1)
            } else {
                bytes(count * elem(d), i as u64 + 1)
            };
            (
                n.to_string(),
                Full {
                    dtype: d,
                    shape: s,
                    data,
                },
            )
        })
        .collect()
}

/// torch.chunk of n into k: range of chunk i.
pub fn chunk(n: usize, k: usize, i: usize) -> (usize, usize) {
    let c = n.div_ceil(k);
    ((i * c).min(n), ((i + 1) * c).min(n))
}

/// Rows a..b of a row-major tensor.
pub fn rows(t: &Full, a: usize, b: usize) -> Vec<u8> {
    let row: usize = t.shape[1..].iter().product::<usize>() * elem(t.dtype);
    t.data[a * row..b * row].to_vec()
}

/// One rank's shard: tensor name → (dtype, local shape, saved offsets, bytes).
pub type Shard = BTreeMap<String, (Dtype, Vec<usize>, Vec<usize>, Vec<u8>)>;

/// FSDP2-style shards: dim 0 chunked over `world`, scalars and zero-size tensors on rank 0.
pub fn fsdp_shards(model: &BTreeMap<String, Full>, world: usize) -> Vec<Shard> {
    let mut out = vec![Shard::new(); world];
    for (name, t) in model {
        if t.shape.is_empty() || t.shape.iter().product::<usize>() == 0 {
            out[0].insert(
                name.clone(),
                (
                    t.dtype,
                    t.shape.clone(),
                    vec![0; t.shape.len()],
                    t.data.clone(),
                ),
            );
            continue;
        }
        for (r, shard) in out.iter_mut().enumerate() {
            let (a, b) = chunk(t.shape[0], world, r);
            if a == b {
                continue;
            }
            let mut shape = t.shape.clone();
            shape[0] = b - a;
            let mut offs = vec![0; t.shape.len()];
            offs[0] = a;
            shard.insert(name.clone(), (t.dtype, shape, offs, rows(t, a, b)));
        }
    }
    out
}

/// Write shards as torch's HuggingFaceStorageWriter(save_distributed=True) names them.
pub fn write_hf_storage(dir: &Path, shards: &[Shard]) {
    std::fs::create_dir_all(dir).unwrap();
    for (r, shard) in shards.iter().enumerate() {
        let info: serde_json::Map<String, serde_json::Value> = shard
            .iter()
            .map(|(n, (_, _, offs, _))| (n.clone(), serde_json::json!({"saved_offsets": offs})))
            .collect();
        let meta: HashMap<String, String> = [
            (
                "DCP_SHARDING_INFO".to_string(),
                serde_json::Value::Object(info).to_string(),
            ),
            ("DCP_VERSION".to_string(), "1.0".to_string()),
            ("format".to_string(), "pt".to_string()),
        ]
        .into();
        let views: Vec<(String, TensorView)> = shard
            .iter()
            .map(|(n, (d, s, _, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        let path = dir.join(format!(
            "shard-{:05}-model-00001-of-00001.safetensors",
            r + 1
        ));
        safetensors::serialize_to_file(views, Some(meta), &path).unwrap();
    }
}

/// Write one plain safetensors file.
pub fn write_safetensors(path: &Path, model: &BTreeMap<String, Full>) {
    let views: Vec<(String, TensorView)> = model
        .iter()
        .map(|(n, t)| {
            (
                n.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Read every tensor of a safetensors file (with the safetensors crate).
pub fn read_safetensors(path: &Path) -> BTreeMap<String, Full> {
    let buf = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                n,
                Full {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    data: v.data().to_vec(),
                },
            )
        })
        .collect()
}

/// Run the reshard binary.
pub fn reshard(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_reshard"))
        .args(args)
        .output()
        .unwrap()
}

/// Run reshard and require success; returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = reshard(args);
    assert!(
        o.status.success(),
        "reshard {args:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Run reshard and require a failure with a one-line error containing `needle`.
pub fn fails(args: &[&str], needle: &str) -> String {
    let o = reshard(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(
        o.status.code(),
        Some(1),
        "reshard {args:?}: expected exit 1, stderr: {err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(err.starts_with("reshard: error: "), "{err}");
    assert!(
        err.contains(needle),
        "reshard {args:?}: `{needle}` not in: {err}"
    );
    err
}

/// A path as &str.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every file under `dir` with its bytes (to prove sources are untouched).
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        if d.is_file() {
            out.insert(d.clone(), std::fs::read(&d).unwrap());
            continue;
        }
        for e in std::fs::read_dir(&d).unwrap() {
            stack.push(e.unwrap().path());
        }
    }
    out
}

/// Names in `dir` (no temporary leftovers expected).
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The crate root, where `cargo test` runs the tests.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The `failure_persistence` of a proptest block: `proptest-regressions/NAME.txt` at the crate
/// root (committed), whose seeds are replayed first on every run, whatever the working
/// directory.
pub fn regressions(name: &str) -> Option<Box<dyn proptest::test_runner::FailurePersistence>> {
    let path = format!(
        "{}/proptest-regressions/{name}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    // `Direct` takes a `&'static str`; one small leak per proptest block.
    let path: &'static str = Box::leak(path.into_boxed_str());
    Some(Box::new(
        proptest::test_runner::FileFailurePersistence::Direct(path),
    ))
}

/// A Python that can import torch and safetensors: $RESHARD_PYTHON, or the project's .venv.
/// Tests that need torch report themselves skipped when there is none.
pub fn torch_python() -> Option<PathBuf> {
    [
        std::env::var_os("RESHARD_PYTHON").map(PathBuf::from),
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python")),
    ]
    .into_iter()
    .flatten()
    .find(|p| {
        Command::new(p)
            .args(["-c", "import torch, safetensors"])
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Run `scripts/torch_interop.py ARGS` with `py` and require torch to accept.
pub fn judge<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(py: &Path, args: &[S]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/torch_interop.py");
    let o = Command::new(py).arg(&script).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "torch rejected: torch_interop.py {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Every real checkpoint of `tests/fixtures`: the torch-written DCP and HF-storage
/// directories and the `.pt` files, sorted.
pub fn fixture_checkpoints() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path().join("checkpoint"))
        .filter(|p| p.is_dir())
        .collect();
    for case in ["flat_dtypes", "training", "tied", "views", "ordered"] {
        v.push(root.join("pt").join(case).join("model.pt"));
    }
    v.sort();
    v
}
