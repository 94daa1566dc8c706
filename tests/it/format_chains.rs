//! Property test of every reader/writer pair (issue #4): random checkpoints — random names,
//! dtypes (floats, bf16, ints, bool, fp8), shapes (0-d, zero-size, prime dims), non-tensor
//! values — driven through random chains of conversions among the five formats
//! (safetensors, HF sharded, HF storage shards, DCP, `.pt`) at random world sizes 1..=16 and
//! random layouts (FSDP `Shard(0)`, 2-D meshes with `Shard`/`EvenShard`/`StridedShard`/
//! `Replicate`, flat ranges). After every chain each tensor must hold the same bytes and each
//! non-tensor entry the same value as at the start.
//!
//! Failures proptest finds are saved under `proptest-regressions/format_chains.txt` (committed)
//! and replayed first on every run; the cases found so far are also spelled out as tests at the
//! end of this file.

use crate::common;
use crate::layout_props::shape_strategy;
use proptest::prelude::*;
use reshard::convert::{convert, ConvertOptions};
use reshard::formats::{Checkpoint, Format};
use reshard::layout::{DType, Placement, Region};
use reshard::per_rank::Policy;
use reshard::target::{LayoutSpec, Rule};
use safetensors::tensor::TensorView;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A generated tensor: name, dtype, shape, bytes.
#[derive(Clone, Debug)]
struct T {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

/// One hop of a chain: output format and target layout.
#[derive(Clone, Debug)]
struct Hop {
    format: Format,
    layout: LayoutSpec,
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    use safetensors::Dtype as S;
    match d {
        DType::Bool => S::BOOL,
        DType::U8 => S::U8,
        DType::I8 => S::I8,
        DType::F8E4M3 => S::F8_E4M3,
        DType::F8E5M2 => S::F8_E5M2,
        DType::I16 => S::I16,
        DType::U16 => S::U16,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::I32 => S::I32,
        DType::U32 => S::U32,
        DType::F32 => S::F32,
        DType::F64 => S::F64,
        DType::I64 => S::I64,
        DType::U64 => S::U64,
        d => unreachable!("no safetensors dtype for {d:?} in this test"),
    }
}

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(vec![
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
        DType::F8E4M3,
        DType::F8E5M2,
    ])
}

/// Dotted names from a small vocabulary (no two equal, none a dotted prefix of another, so
/// every format, `.pt` nesting included, can hold them all).
fn names(n: usize) -> impl Strategy<Value = Vec<String>> {
    let seg = prop::sample::select(vec![
        "model", "layers", "0", "1", "12", "attn", "q_proj", "weight", "bias", "embed", "norm",
        "state", "exp_avg", "head", "w-x", "ß",
    ]);
    prop::collection::vec(prop::collection::vec(seg, 1..=4), n).prop_map(|raw| {
        let mut out: Vec<String> = vec![];
        for (i, parts) in raw.into_iter().enumerate() {
            let mut name = parts.join(".");
            // make it unique and never a prefix path of another name: a final leaf segment
            name.push_str(&format!(".t{i}"));
            out.push(name);
        }
        out
    })
}

fn tensors() -> impl Strategy<Value = Vec<T>> {
    (1usize..=5)
        .prop_flat_map(|n| {
            (
                names(n),
                prop::collection::vec((dtype(), shape_strategy(), any::<u64>()), n),
            )
        })
        .prop_map(|(names, specs)| {
            names
                .into_iter()
                .zip(specs)
                .map(|(name, (dtype, shape, seed))| {
                    let n = shape.iter().product::<u64>() as usize * dtype.size();
                    let mut x = seed | 1;
                    let data = (0..n)
                        .map(|_| {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            if dtype == DType::Bool {
                                (x & 1) as u8
                            } else {
                                x as u8
                            }
                        })
                        .collect();
                    T {
                        name,
                        dtype,
                        shape,
                        data,
                    }
                })
                .collect()
        })
}

/// JSON non-tensor values (what a safetensors source can carry).
fn extras() -> impl Strategy<Value = BTreeMap<String, serde_json::Value>> {
    let leaf = prop_oneof![
        any::<i32>().prop_map(serde_json::Value::from),
        (-1e6f64..1e6).prop_map(serde_json::Value::from),
        "[a-z é]{0,8}".prop_map(serde_json::Value::from),
        any::<bool>().prop_map(serde_json::Value::from),
        Just(serde_json::Value::Null),
        prop::collection::vec(any::<i16>(), 0..4).prop_map(|v| serde_json::json!(v)),
    ];
    prop::collection::btree_map(
        "(step|epoch|cfg\\.lr|cfg\\.name|sched\\.[a-z]{1,4})",
        leaf,
        0..4,
    )
}

fn placement() -> impl Strategy<Value = Placement> {
    prop_oneof![
        Just(Placement::Replicate),
        (0usize..3).prop_map(Placement::Shard),
        (0usize..3).prop_map(Placement::EvenShard),
        (0usize..2, 2u64..4).prop_map(|(d, k)| Placement::StridedShard(d, k)),
    ]
}

fn layout() -> impl Strategy<Value = LayoutSpec> {
    prop_oneof![
        (1u64..=16).prop_map(LayoutSpec::fsdp),
        (1u64..=4, 1u64..=4, placement(), placement()).prop_map(|(a, b, p, q)| LayoutSpec {
            mesh: vec![a, b],
            rules: vec![Rule {
                pattern: "*".into(),
                placements: vec![p, q],
            }],
            flat: false,
        }),
        (1u64..=16).prop_map(|w| LayoutSpec {
            mesh: vec![w],
            rules: vec![],
            flat: true,
        }),
    ]
}

fn hop() -> impl Strategy<Value = Hop> {
    let single = |f: Format| Hop {
        format: f,
        layout: LayoutSpec::fsdp(1),
    };
    prop_oneof![
        Just(single(Format::SAFETENSORS)),
        Just(single(Format::HF)),
        Just(single(Format::PT)),
        layout().prop_map(|layout| Hop {
            format: Format::HF_STORAGE,
            layout
        }),
        layout().prop_map(|layout| Hop {
            format: Format::DCP,
            layout
        }),
    ]
}

/// Write the starting checkpoint: one safetensors file with the non-tensor entries as JSON.
fn write_source(path: &Path, ts: &[T], extras: &BTreeMap<String, serde_json::Value>) {
    let views: Vec<(String, TensorView)> = ts
        .iter()
        .map(|t| {
            let shape = t.shape.iter().map(|&s| s as usize).collect();
            (
                t.name.clone(),
                TensorView::new(st_dtype(t.dtype), shape, &t.data).unwrap(),
            )
        })
        .collect();
    let mut meta = std::collections::HashMap::new();
    if !extras.is_empty() {
        meta.insert(
            reshard::formats::EXTRAS_KEY.to_string(),
            serde_json::to_string(extras).unwrap(),
        );
    }
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

fn dest(dir: &Path, k: usize, f: Format) -> PathBuf {
    dir.join(if f == Format::SAFETENSORS {
        format!("hop{k}.safetensors")
    } else if f == Format::PT {
        format!("hop{k}.pt")
    } else {
        format!("hop{k}")
    })
}

/// Convert `src` through `hops` (outputs under `dir`); the last output.
fn run_chain(src: &Path, hops: &[Hop], dir: &Path) -> Result<PathBuf, TestCaseError> {
    let mut cur = src.to_path_buf();
    for (k, h) in hops.iter().enumerate() {
        let dst = dest(dir, k, h.format);
        let mut opts = ConvertOptions::to(1);
        opts.layout = h.layout.clone();
        opts.format = Some(h.format);
        opts.exec.sync = false;
        opts.per_rank = Some(Policy::Keep);
        convert(&cur, &dst, &opts).map_err(|e| {
            TestCaseError::fail(format!("{} hop {k} {:?}: {e}", src.display(), h.format))
        })?;
        cur = dst;
    }
    Ok(cur)
}

/// Run the chain and compare the last checkpoint with the first.
fn check_chain(
    ts: &[T],
    extras: &BTreeMap<String, serde_json::Value>,
    hops: &[Hop],
) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    let mut src = d.path().join("src.safetensors");
    write_source(&src, ts, extras);
    src = run_chain(&src, hops, d.path())?;
    let ck = Checkpoint::open(&src).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut got_names: Vec<&str> = ck.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut want_names: Vec<&str> = ts.iter().map(|t| t.name.as_str()).collect();
    got_names.sort_unstable();
    want_names.sort_unstable();
    prop_assert_eq!(got_names, want_names);
    for t in ts {
        let l = ck.tensor(&t.name).unwrap();
        prop_assert_eq!(l.dtype, t.dtype, "{}", t.name);
        prop_assert_eq!(&l.shape, &t.shape, "{}", t.name);
        let bytes = ck
            .read_region(&t.name, &Region::full(&t.shape), None)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(bytes == t.data, "{}: bytes differ", t.name);
    }
    let got: BTreeMap<String, serde_json::Value> = ck
        .extras
        .iter()
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect();
    prop_assert_eq!(&got, extras);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        max_shrink_iters: 200,
        failure_persistence: common::regressions("format_chains"),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_chains_preserve_every_byte_and_value(
        ts in tensors(),
        extras in extras(),
        hops in prop::collection::vec(hop(), 1..=4),
    ) {
        check_chain(&ts, &extras, &hops)?;
    }
}

/// Every ordered pair of formats at least once, on one fixed checkpoint.
#[test]
fn every_reader_writer_pair() {
    let ts = vec![
        T {
            name: "model.embed.weight".into(),
            dtype: DType::BF16,
            shape: vec![13, 3],
            data: (0..78).map(|i| (i * 7) as u8).collect(),
        },
        T {
            name: "model.head.bias".into(),
            dtype: DType::I64,
            shape: vec![5],
            data: (0..40).collect(),
        },
        T {
            name: "scale".into(),
            dtype: DType::F32,
            shape: vec![],
            data: vec![0, 0, 0x80, 0x3f],
        },
        T {
            name: "empty".into(),
            dtype: DType::Bool,
            shape: vec![0, 4],
            data: vec![],
        },
    ];
    let extras: BTreeMap<String, serde_json::Value> = [
        ("step".to_string(), serde_json::json!(7)),
        ("cfg.lr".to_string(), serde_json::json!(0.001)),
        ("cfg.betas".to_string(), serde_json::json!([0.9, 0.95])),
    ]
    .into_iter()
    .collect();
    let hops = |f: Format, w: u64| Hop {
        format: f,
        layout: LayoutSpec::fsdp(w),
    };
    let all = [
        hops(Format::SAFETENSORS, 1),
        hops(Format::HF, 1),
        hops(Format::HF_STORAGE, 3),
        hops(Format::DCP, 5),
        hops(Format::PT, 1),
    ];
    for a in &all {
        for b in &all {
            check_chain(&ts, &extras, &[a.clone(), b.clone()])
                .unwrap_or_else(|e| panic!("{:?} -> {:?}: {e}", a.format, b.format));
        }
    }
}

/// Found by the property test: a zero-size tensor (`[2, 0]`) resharded to more ranks than it
/// has rows came back from HF-storage shards as `[1, 0]` (its shape was inferred from rank 0's
/// empty chunk alone).
#[test]
fn regression_zero_size_tensor_keeps_its_shape_in_hf_storage() {
    let ts = vec![T {
        name: "model.t0".into(),
        dtype: DType::F32,
        shape: vec![2, 0],
        data: vec![],
    }];
    let flat5 = LayoutSpec {
        mesh: vec![5],
        rules: vec![],
        flat: true,
    };
    let hops = [
        Hop {
            format: Format::DCP,
            layout: flat5,
        },
        Hop {
            format: Format::HF,
            layout: LayoutSpec::fsdp(1),
        },
        Hop {
            format: Format::HF_STORAGE,
            layout: LayoutSpec::fsdp(6),
        },
    ];
    check_chain(&ts, &BTreeMap::new(), &hops).unwrap();
}

/// Found by the property test: a float non-tensor value (`cfg.lr`) came back one ulp off
/// after a trip through JSON (serde_json's default float parser is not exact; reshard now
/// enables its `float_roundtrip` feature).
#[test]
fn regression_float_values_survive_json_exactly() {
    let ts = vec![T {
        name: "model.t0".into(),
        dtype: DType::F32,
        shape: vec![],
        data: vec![95, 143, 132, 83],
    }];
    let extras: BTreeMap<String, serde_json::Value> = [(
        "cfg.lr".to_string(),
        serde_json::json!(250518.60876796854f64),
    )]
    .into_iter()
    .collect();
    let hops = [
        Hop {
            format: Format::DCP,
            layout: LayoutSpec::fsdp(6),
        },
        Hop {
            format: Format::SAFETENSORS,
            layout: LayoutSpec::fsdp(1),
        },
        Hop {
            format: Format::HF_STORAGE,
            layout: LayoutSpec::fsdp(7),
        },
    ];
    check_chain(&ts, &extras, &hops).unwrap();
}

/// Tensors by name (dtype, shape, bytes) and non-tensor leaves by flat name.
type Contents = (
    BTreeMap<String, (DType, Vec<u64>, Vec<u8>)>,
    BTreeMap<String, serde_json::Value>,
);

/// Every tensor's bytes and every non-tensor value of a checkpoint.
fn contents(p: &Path) -> Contents {
    let ck = Checkpoint::open(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let t = ck
        .tensors
        .iter()
        .map(|t| {
            let b = ck
                .read_region(&t.name, &Region::full(&t.shape), None)
                .unwrap();
            (t.name.clone(), (t.dtype, t.shape.clone(), b))
        })
        .collect();
    let mut e = BTreeMap::new();
    for x in &ck.extras {
        flatten_json(&x.name, &x.value, &mut e);
    }
    (t, e)
}

/// A non-tensor value as the leaves DCP's flattening would make of it: dicts always, and lists
/// holding a dict or such a list, are split into `name.key` / `name.i` (a torch 2.1 checkpoint
/// keeps `optimizer.param_groups` as one value, a later flattening splits it; both are the
/// same state).
fn flatten_json(name: &str, v: &serde_json::Value, out: &mut BTreeMap<String, serde_json::Value>) {
    fn deep(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Object(_) => true,
            serde_json::Value::Array(items) => items.iter().any(|x| match x {
                serde_json::Value::Object(_) => true,
                serde_json::Value::Array(_) => deep(x),
                _ => false,
            }),
            _ => false,
        }
    }
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => {
            for (k, x) in m {
                flatten_json(&format!("{name}.{k}"), x, out);
            }
        }
        serde_json::Value::Array(items) if deep(v) => {
            for (i, x) in items.iter().enumerate() {
                flatten_json(&format!("{name}.{i}"), x, out);
            }
        }
        _ => {
            out.insert(name.to_string(), v.clone());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        max_shrink_iters: 50,
        failure_persistence: common::regressions("format_chains"),
        ..ProptestConfig::default()
    })]

    /// Real torch-written checkpoints through random chains keep every byte and value.
    #[test]
    fn real_checkpoints_through_random_chains(
        pick in any::<prop::sample::Index>(),
        hops in prop::collection::vec(hop(), 1..=3),
    ) {
        let sources = common::fixture_checkpoints();
        let src = pick.get(&sources).clone();
        let want = contents(&src);
        let d = tempfile::tempdir().unwrap();
        let cur = run_chain(&src, &hops, d.path())?;
        let got = contents(&cur);
        prop_assert!(got.0 == want.0, "{}: tensors differ after {:?}", src.display(),
            hops.iter().map(|h| h.format).collect::<Vec<_>>());
        prop_assert_eq!(got.1, want.1, "{}", src.display());
    }
}
