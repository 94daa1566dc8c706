//! Shared helpers of the integration tests: a synthetic model written as real per-rank
//! safetensors shards (with the `safetensors` crate, not with reshard), CLI runners, the
//! fixture paths, the Python with torch that judges interop, where proptest keeps its
//! failures, and ([`archive`]) an independent judge of the zip archives reshard writes.
#![allow(dead_code)]

pub mod archive;

use reshard::formats::Checkpoint;
use reshard::layout::Region;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, BTreeSet, HashMap};
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

/// A temporary directory holding `ck`: [`model`] as HF-storage shards of `world` ranks
/// ([`fsdp_shards`]).
pub fn synthetic(world: usize) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let ck = d.path().join("ck");
    write_hf_storage(&ck, &fsdp_shards(&model(), world));
    (d, ck)
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

/// Tensors by name: (dtype name, shape, bytes), as [`read_st`] and [`read_all`] give them.
pub type Tensors = BTreeMap<String, (String, Vec<u64>, Vec<u8>)>;

/// Every tensor of a safetensors file (with the safetensors crate), and its
/// `reshard.extras` metadata parsed as JSON, if any.
pub fn read_st(path: &Path) -> (Tensors, Option<serde_json::Value>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                (
                    t.dtype().to_string(),
                    t.shape().iter().map(|&s| s as u64).collect(),
                    t.data().to_vec(),
                ),
            )
        })
        .collect();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let extras = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("reshard.extras"))
        .map(|text| serde_json::from_str(text).unwrap());
    (tensors, extras)
}

/// Every tensor of `ck`, read whole through the library.
pub fn read_all(ck: &Checkpoint) -> Tensors {
    ck.tensors
        .iter()
        .map(|t| {
            let bytes = ck
                .read_region(&t.name, &Region::full(&t.shape), None)
                .unwrap_or_else(|e| panic!("{}: {e}", t.name));
            (
                t.name.clone(),
                (t.dtype.name().to_string(), t.shape.clone(), bytes),
            )
        })
        .collect()
}

/// Same names, and per name the same dtype, shape and bytes.
pub fn assert_same(case: &str, what: &str, got: &Tensors, want: &Tensors) {
    let g: BTreeSet<_> = got.keys().collect();
    let w: BTreeSet<_> = want.keys().collect();
    assert_eq!(g, w, "{case} {what}: tensor names differ");
    for (name, (dt, shape, data)) in want {
        let (gdt, gshape, gdata) = &got[name];
        assert_eq!((gdt, gshape), (dt, shape), "{case} {what}: `{name}`");
        assert!(gdata == data, "{case} {what}: bytes of `{name}` differ");
    }
}

/// A JSON file holding an object (an oracle's non-tensor values).
pub fn json_object(p: &Path) -> serde_json::Map<String, serde_json::Value> {
    let text = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    match serde_json::from_str(&text).unwrap() {
        serde_json::Value::Object(m) => m,
        other => panic!("{}: not an object: {other}", p.display()),
    }
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

/// `reshard convert SRC DST ARGS…`, required to succeed; returns stdout.
pub fn convert(src: &Path, dst: &Path, args: &[&str]) -> String {
    let mut all = vec!["convert", s(src), s(dst)];
    all.extend_from_slice(args);
    ok(&all)
}

/// Run reshard and require an error (exit status 2) with a one-line message containing
/// `needle`.
pub fn fails(args: &[&str], needle: &str) -> String {
    fails_with(2, args, needle)
}

/// Run reshard and require exit status `code` with a one-line error containing `needle`.
pub fn fails_with(code: i32, args: &[&str], needle: &str) -> String {
    let o = reshard(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(
        o.status.code(),
        Some(code),
        "reshard {args:?}: expected exit {code}, stderr: {err}"
    );
    one_line_error(args, &err, &[needle]);
    err
}

/// Run reshard and require a failure (any exit but success) with a one-line error
/// containing every needle.
pub fn fails_all(args: &[&str], needles: &[&str]) -> String {
    let o = reshard(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success(),
        "reshard {args:?} succeeded on a bad input"
    );
    one_line_error(args, &err, needles);
    err
}

/// `err` is one `reshard: error: …` line containing every needle.
fn one_line_error(args: &[&str], err: &str, needles: &[&str]) {
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(err.starts_with("reshard: error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "reshard {args:?}: `{n}` not in: {err}");
    }
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

/// Copy directory `from` into `to` (created), sub-folders too (a DeepSpeed tag folder).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// A copy of fixture `case`'s checkpoint in `into/case`, to break.
pub fn copy_fixture(case: &str, into: &Path) -> PathBuf {
    let dst = into.join(case);
    copy_dir(&fixture(case).join("checkpoint"), &dst);
    dst
}

/// Cut `file` to `len` bytes.
pub fn set_len(file: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(len)
        .unwrap();
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

/// `tests/fixtures/REL`: the torch-written checkpoints and their oracles.
pub fn fixture(rel: &str) -> PathBuf {
    root().join("tests/fixtures").join(rel)
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
        Some(root().join(".venv/bin/python")),
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

/// [`torch_python`], or `None` after saying that the torch checks are skipped ([`no_torch`]).
pub fn torch_or_skip() -> Option<PathBuf> {
    let py = torch_python();
    if py.is_none() {
        no_torch();
    }
    py
}

/// Say that a test's torch checks are skipped for want of a Python with torch; under
/// `CI=true` (where `.ci/run` installs the venv first) a missing torch fails the test
/// instead, so that CI never passes a test that checked nothing.
pub fn no_torch() {
    let msg = "no Python with torch (set RESHARD_PYTHON or run scripts/setup_venv.sh)";
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{msg}: under CI=true the torch checks must run");
    }
    eprintln!("skipped: {msg}");
}

/// Run `code` with `py -c` and require it to succeed.
pub fn python(py: &Path, code: &str) {
    let o = Command::new(py).arg("-c").arg(code).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Run `scripts/torch_interop.py ARGS` with `py` and require torch to accept.
pub fn judge<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(py: &Path, args: &[S]) {
    let script = root().join("scripts/torch_interop.py");
    let o = Command::new(py).arg(&script).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "torch rejected: torch_interop.py {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The cases of a producer's fixture folder (`tests/fixtures/<folder>/<case>/case.json`):
/// (name, case folder, case.json), sorted by name; at least `min` of them.
pub fn cases(folder: &str, min: usize) -> Vec<(String, PathBuf, serde_json::Value)> {
    let mut v: Vec<_> = std::fs::read_dir(fixture(folder))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("case.json").is_file())
        .map(|p| {
            let info: serde_json::Value =
                serde_json::from_slice(&std::fs::read(p.join("case.json")).unwrap()).unwrap();
            (
                p.file_name().unwrap().to_string_lossy().to_string(),
                p,
                info,
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(v.len() >= min, "{folder}: {v:?}");
    v
}

/// Every real checkpoint of `tests/fixtures`: the torch-written DCP and HF-storage
/// directories, the `.pt` files, the tag folders of four DeepSpeed checkpoints (one per
/// optimizer layout: stage 1 tied, stage 2 bf16 with a frozen parameter, BF16_Optimizer,
/// stage 3 with frozen fragments) and two megatron-core folders, sorted.
pub fn fixture_checkpoints() -> Vec<PathBuf> {
    let root = fixture("");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path().join("checkpoint"))
        .filter(|p| p.is_dir())
        .collect();
    for case in ["flat_dtypes", "training", "tied", "views", "ordered"] {
        v.push(root.join("pt").join(case).join("model.pt"));
    }
    // megatron-core folders: 0.16 (save plans, two writer threads, ShardedObjects) and 0.15
    // (MCoreMetadata, flattened tensors)
    for case in ["mcore016_tp2_dp2", "mcore015_tp2_dp1_flat"] {
        v.push(root.join("megatron").join(case).join("checkpoint"));
    }
    for case in [
        "zero1_dp2_f32_g1",
        "zero2_dp3_bf16_g1",
        "zero1_dp2_bf16_g2_fp32acc",
        "zero3_dp3_f32_g2",
    ] {
        v.push(
            root.join("deepspeed")
                .join(case)
                .join("checkpoint/global_step2"),
        );
    }
    v.sort();
    v
}
