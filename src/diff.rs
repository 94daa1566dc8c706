//! Comparing two checkpoints tensor by tensor, in any formats and layouts: names present on
//! one side only, dtype or shape changes, exact byte equality for tensors of one dtype, and
//! the largest absolute and relative differences when floating dtypes differ (both read as
//! f64). Non-tensor entries are compared by value. Tensors are read in blocks of rows
//! (≤ 8 MiB per side), so memory stays bounded whatever their size.

use crate::error::Result;
use crate::formats::Checkpoint;
use crate::layout::{DType, Region};
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
    let ea: BTreeMap<&str, &serde_json::Value> = a
        .extras
        .iter()
        .map(|e| (e.name.as_str(), &e.value))
        .collect();
    let eb: BTreeMap<&str, &serde_json::Value> = b
        .extras
        .iter()
        .map(|e| (e.name.as_str(), &e.value))
        .collect();
    for (k, va) in &ea {
        match eb.get(k) {
            None => {
                out.differences.insert(k.to_string(), Difference::OnlyInA);
            }
            Some(vb) => {
                out.entries += 1;
                if va != vb {
                    out.differences.insert(
                        k.to_string(),
                        Difference::Value {
                            a: (*va).clone(),
                            b: (*vb).clone(),
                        },
                    );
                }
            }
        }
    }
    for k in eb.keys() {
        if !ea.contains_key(k) {
            out.differences.insert(k.to_string(), Difference::OnlyInB);
        }
    }
    Ok(out)
}
