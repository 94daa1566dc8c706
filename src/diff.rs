//! Comparing two checkpoints tensor by tensor, in any formats and layouts: names present on
//! one side only, dtype or shape changes, exact byte equality for tensors of one dtype, and
//! the largest absolute and relative differences when floating dtypes differ (both read as
//! f64). Tensors are read in blocks of rows (≤ 8 MiB per side), so memory stays bounded
//! whatever their size.
//!
//! Non-tensor entries ([`Extra`]) are compared by value, whatever way a format holds them:
//! DCP keeps `optimizer.param_groups` as one pickled `BYTE_IO` item, a `.pt` file as one
//! pickled value per key below it (`optimizer.param_groups.0.lr`), safetensors as one JSON
//! value in its `__metadata__`. Each side's entries are first brought to one canonical form,
//! [`canonical`], a map from dotted leaf keys to scalar values:
//!
//! - a dict is flattened into its items, each under `KEY.SUBKEY`; str and int keys (and
//!   bool and None keys, as their JSON text) name the item (DCP turns int keys into strings,
//!   so `{0: x}` and `{"0": x}` are one key); a dict with other keys (tuples, objects) is
//!   taken as the list of its `[key, value]` pairs, as its JSON shows it;
//! - lists, tuples and sets are flattened into their elements, each under `KEY.INDEX` (in the
//!   order the pickle holds them), so a list and a tuple of equal elements are equal: JSON,
//!   which safetensors metadata holds, cannot tell them apart;
//! - an empty dict is the leaf `{}`, an empty list, tuple or set the leaf `[]`;
//! - everything else is a leaf, compared as Python compares it but stricter about types: an
//!   int, a float and a bool are never equal to each other (`1`, `1.0` and `True` differ),
//!   NaN equals NaN, str and bytes by content, torch globals and objects (`torch.float32`,
//!   `torch.device("cpu")`) by module, name and arguments.
//!
//! Leaves are compared exactly where both sides hold the Python value (torch formats, and the
//! safetensors files reshard writes, which keep a pickle of each entry next to its JSON).
//! Where one side holds only JSON (a safetensors header without `reshard.extras.pickle`, a
//! DeepSpeed output), the two are compared by their JSON: ints and floats still differ
//! (`1` vs `1.0`), but the float NaN and the string `"nan"`, or two bytes values of one
//! length, cannot be told apart.

use crate::error::Result;
use crate::formats::Checkpoint;
use crate::layout::{DType, Region};
use crate::Extra;
use reshard_core::value::Value;
use serde::Serialize;
use std::collections::BTreeMap;

/// Bytes per side read at once.
const BLOCK: u64 = 8 << 20;

/// How one tensor (or entry) differs.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Difference {
    /// Only in the first checkpoint.
    OnlyInA,
    /// Only in the second.
    OnlyInB,
    /// Different shapes.
    Shape {
        /// In A.
        a: Vec<u64>,
        /// In B.
        b: Vec<u64>,
    },
    /// Same dtype, different bytes.
    Bytes {
        /// Elements that differ.
        elements: u64,
        /// Index (row-major) of the first that does.
        first: u64,
    },
    /// Different dtypes that cannot both be read as f64 (integers against floats).
    DType {
        /// In A.
        a: DType,
        /// In B.
        b: DType,
    },
    /// Floating tensors of different dtypes: the largest differences over all elements.
    Values {
        /// dtype in A.
        a: DType,
        /// dtype in B.
        b: DType,
        /// Largest |a - b|.
        max_abs: f64,
        /// Largest |a - b| / max(|a|, |b|) (0 where both are 0).
        max_rel: f64,
    },
    /// A non-tensor entry whose value differs.
    Value {
        /// In A.
        a: serde_json::Value,
        /// In B.
        b: serde_json::Value,
    },
}

/// The comparison of two checkpoints.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Diff {
    /// Tensors compared.
    pub tensors: usize,
    /// Non-tensor entries compared.
    pub entries: usize,
    /// Every difference, by name.
    pub differences: BTreeMap<String, Difference>,
}

impl Diff {
    /// True when nothing differs (floating tensors of different dtypes count as differing
    /// unless their values are equal).
    pub fn is_equal(&self) -> bool {
        self.differences.is_empty()
    }
}

fn f64s(bytes: &[u8]) -> impl Iterator<Item = f64> + '_ {
    bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()))
}

/// Compare tensor `name` present in both.
fn tensor(a: &Checkpoint, b: &Checkpoint, name: &str) -> Result<Option<Difference>> {
    let (ta, tb) = (
        a.tensor(name).expect("present"),
        b.tensor(name).expect("present"),
    );
    if ta.shape != tb.shape {
        return Ok(Some(Difference::Shape {
            a: ta.shape.clone(),
            b: tb.shape.clone(),
        }));
    }
    if ta.dtype == tb.dtype {
        let elem = ta.dtype.size() as u64;
        let (mut differ, mut first, mut base) = (0u64, None, 0u64);
        for r in Region::row_blocks(&ta.shape, elem, BLOCK) {
            let x = a.read_region(name, &r, None)?;
            let y = b.read_region(name, &r, None)?;
            if x != y {
                for (i, (p, q)) in x
                    .chunks_exact(elem as usize)
                    .zip(y.chunks_exact(elem as usize))
                    .enumerate()
                {
                    if p != q {
                        differ += 1;
                        first.get_or_insert(base + i as u64);
                    }
                }
            }
            base += r.volume();
        }
        return Ok(first.map(|first| Difference::Bytes {
            elements: differ,
            first,
        }));
    }
    if !(ta.dtype.can_cast_to(DType::F64) && tb.dtype.can_cast_to(DType::F64)) {
        return Ok(Some(Difference::DType {
            a: ta.dtype,
            b: tb.dtype,
        }));
    }
    let (mut max_abs, mut max_rel) = (0f64, 0f64);
    for r in Region::row_blocks(&ta.shape, 8, BLOCK) {
        let x = a.read_region(name, &r, Some(DType::F64))?;
        let y = b.read_region(name, &r, Some(DType::F64))?;
        for (p, q) in f64s(&x).zip(f64s(&y)) {
            if p == q || (p.is_nan() && q.is_nan()) {
                continue;
            }
            let d = (p - q).abs();
            let d = if d.is_nan() { f64::INFINITY } else { d };
            max_abs = max_abs.max(d);
            let m = p.abs().max(q.abs());
            max_rel = max_rel.max(if m > 0.0 { d / m } else { 0.0 });
        }
    }
    Ok(Some(Difference::Values {
        a: ta.dtype,
        b: tb.dtype,
        max_abs,
        max_rel,
    }))
}

/// Compare checkpoints `a` and `b`.
pub fn diff(a: &Checkpoint, b: &Checkpoint) -> Result<Diff> {
    let mut out = Diff::default();
    let names_b: std::collections::HashSet<&str> =
        b.tensors.iter().map(|t| t.name.as_str()).collect();
    for t in &a.tensors {
        if !names_b.contains(t.name.as_str()) {
            out.differences.insert(t.name.clone(), Difference::OnlyInA);
            continue;
        }
        out.tensors += 1;
        if let Some(d) = tensor(a, b, &t.name)? {
            out.differences.insert(t.name.clone(), d);
        }
    }
    for t in &b.tensors {
        if a.tensor(&t.name).is_none() {
            out.differences.insert(t.name.clone(), Difference::OnlyInB);
        }
    }
    let extras = diff_extras(&a.extras, &b.extras);
    out.entries = extras.entries;
    out.differences.extend(extras.differences);
    Ok(out)
}

/// Compare the non-tensor entries `a` and `b` by value (see the module doc): a [`Diff`] of
/// no tensors whose `entries` counts the leaves present on both sides.
pub fn diff_extras(a: &[Extra], b: &[Extra]) -> Diff {
    let (ca, cb) = (canonical(a), canonical(b));
    let mut out = Diff::default();
    for (k, la) in &ca {
        match cb.get(k) {
            None => {
                out.differences.insert(k.clone(), Difference::OnlyInA);
            }
            Some(lb) => {
                out.entries += 1;
                if !la.same(lb) {
                    out.differences.insert(
                        k.clone(),
                        Difference::Value {
                            a: la.json.clone(),
                            b: lb.json.clone(),
                        },
                    );
                }
            }
        }
    }
    for k in cb.keys() {
        if !ca.contains_key(k) {
            out.differences.insert(k.clone(), Difference::OnlyInB);
        }
    }
    out
}

/// One scalar value of a non-tensor entry, at a dotted leaf key of [`canonical`].
#[derive(Clone, Debug)]
pub struct Leaf {
    /// The value as JSON (what a difference shows).
    pub json: serde_json::Value,
    /// The Python value, where the entry held one (not for JSON-only entries).
    pub exact: Option<Value>,
}

impl Leaf {
    /// True when the two are the same value: exactly where both hold the Python value, else
    /// by their JSON.
    pub fn same(&self, other: &Leaf) -> bool {
        match (&self.exact, &other.exact) {
            (Some(a), Some(b)) => same(a, b),
            _ => self.json == other.json,
        }
    }
}

/// The canonical form of non-tensor entries: dotted leaf keys and their scalar values, nested
/// dicts and sequences flattened (the rules are in the module doc). Where two entries give one
/// key (a hostile file), the first in `extras`' order is kept.
pub fn canonical(extras: &[Extra]) -> BTreeMap<String, Leaf> {
    let mut out = BTreeMap::new();
    for e in extras {
        match &e.pickle {
            Some(v) => flatten(&e.name, v, &mut out),
            None => flatten_json(&e.name, &e.value, &mut out),
        }
    }
    out
}

/// `key.sub`, or `sub` alone under an empty key.
fn join(key: &str, sub: &str) -> String {
    if key.is_empty() {
        sub.to_string()
    } else {
        format!("{key}.{sub}")
    }
}

/// Most levels of nesting followed; deeper values are leaves (a pickle's nesting is bounded
/// by its parser, a JSON header's by serde_json's; this bounds the recursion here as well).
const DEPTH: usize = 64;

fn flatten(key: &str, v: &Value, out: &mut BTreeMap<String, Leaf>) {
    flatten_at(key, v, out, 0)
}

fn flatten_at(key: &str, v: &Value, out: &mut BTreeMap<String, Leaf>, depth: usize) {
    let items: Vec<(String, &Value)>;
    let pairs: Vec<Value>;
    match v {
        Value::Dict(kv) if !kv.is_empty() && depth < DEPTH => match dict_keys(kv) {
            Some(keys) => items = keys.into_iter().zip(kv.iter().map(|(_, v)| v)).collect(),
            None => {
                pairs = kv
                    .iter()
                    .map(|(k, v)| Value::List(vec![k.clone(), v.clone()]))
                    .collect();
                items = pairs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (i.to_string(), p))
                    .collect();
            }
        },
        Value::List(xs) | Value::Tuple(xs) | Value::Set(xs) if !xs.is_empty() && depth < DEPTH => {
            items = xs
                .iter()
                .enumerate()
                .map(|(i, x)| (i.to_string(), x))
                .collect();
        }
        _ => {
            let exact = match v {
                Value::Tuple(xs) | Value::Set(xs) if xs.is_empty() => Value::List(vec![]),
                other => other.clone(),
            };
            out.entry(key.to_string()).or_insert_with(|| Leaf {
                json: reshard_formats::dcp::to_json(v),
                exact: Some(exact),
            });
            return;
        }
    }
    for (k, x) in items {
        flatten_at(&join(key, &k), x, out, depth + 1);
    }
}

/// The texts of a dict's keys when every one is a str, int, bool or None (as JSON writes
/// them); `None` when one is not.
fn dict_keys(kv: &[(Value, Value)]) -> Option<Vec<String>> {
    kv.iter()
        .map(|(k, _)| match k {
            Value::Str(s) => Some(s.clone()),
            Value::Int(i) => Some(i.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            Value::None => Some("null".into()),
            _ => None,
        })
        .collect()
}

fn flatten_json(key: &str, v: &serde_json::Value, out: &mut BTreeMap<String, Leaf>) {
    flatten_json_at(key, v, out, 0)
}

fn flatten_json_at(
    key: &str,
    v: &serde_json::Value,
    out: &mut BTreeMap<String, Leaf>,
    depth: usize,
) {
    use serde_json::Value as J;
    match v {
        J::Object(m) if !m.is_empty() && depth < DEPTH => {
            for (k, x) in m {
                flatten_json_at(&join(key, k), x, out, depth + 1);
            }
        }
        J::Array(xs) if !xs.is_empty() && depth < DEPTH => {
            for (i, x) in xs.iter().enumerate() {
                flatten_json_at(&join(key, &i.to_string()), x, out, depth + 1);
            }
        }
        _ => {
            out.entry(key.to_string()).or_insert_with(|| Leaf {
                json: v.clone(),
                exact: None,
            });
        }
    }
}

/// An int's value, where it fits an i128.
fn int_of(v: &Value) -> Option<i128> {
    match v {
        Value::Int(i) => Some(*i as i128),
        Value::BigInt(b) if b.len() <= 16 => {
            let neg = b.last().is_some_and(|x| x & 0x80 != 0);
            let mut a = [if neg { 0xFF } else { 0 }; 16];
            a[..b.len()].copy_from_slice(b);
            Some(i128::from_le_bytes(a))
        }
        _ => None,
    }
}

/// Python's `==` made stricter about types (an int, a float and a bool are never equal) and
/// looser about NaN (equal to itself); sequences of one kind or another are equal when their
/// elements are.
fn same(a: &Value, b: &Value) -> bool {
    use Value as V;
    let all =
        |x: &[Value], y: &[Value]| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q));
    match (a, b) {
        (V::Int(_) | V::BigInt(_), V::Int(_) | V::BigInt(_)) => match (int_of(a), int_of(b)) {
            (Some(x), Some(y)) => x == y,
            _ => a == b,
        },
        (V::Float(x), V::Float(y)) => x == y || (x.is_nan() && y.is_nan()),
        (V::List(x) | V::Tuple(x) | V::Set(x), V::List(y) | V::Tuple(y) | V::Set(y)) => all(x, y),
        (V::Dict(x), V::Dict(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((k, v), (l, w))| same(k, l) && same(v, w))
        }
        (
            V::Object {
                module: m,
                name: n,
                args: x,
                state: s,
            },
            V::Object {
                module: m2,
                name: n2,
                args: y,
                state: t,
            },
        ) => {
            m == m2
                && n == n2
                && all(x, y)
                && match (s, t) {
                    (Some(s), Some(t)) => same(s, t),
                    (None, None) => true,
                    _ => false,
                }
        }
        (V::PersistentId(x), V::PersistentId(y)) => same(x, y),
        _ => a == b,
    }
}
