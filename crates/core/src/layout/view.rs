//! Views: a target tensor defined through transforms of source tensors, and their normal form.
//!
//! A [`View`] is data (serde, tagged by `op`): an expression whose leaves name source tensors
//! and whose nodes rename, slice, split one dimension into several, merge several into one,
//! permute, concatenate or pad. It is what a conversion between frameworks says about each
//! target tensor, e.g. Hugging Face's `q_proj` out of Megatron's fused QKV rows
//! `(ng·(hpg+2)·hd, H)`:
//! `Merge(Slice(Split(qkv, 0, [ng, hpg+2, hd]), 1, 0, hpg), 0, 3)`.
//!
//! # Normal form
//!
//! [`View::compile`] turns the expression into a [`ViewMap`]: the target's shape and a list of
//! [`ViewPart`]s that partition the target's elements. A part is a *strided bijection*: a box
//! `x ∈ [0, size_a)` over its [`Axis`]es, each axis stepping `stride` along one target
//! dimension and `src_stride` along one source dimension, so that
//!
//! ```text
//! target[d] = origin[d]     + Σ_{axes a on target dim d} stride_a     · x_a
//! source[e] = src_origin[e] + Σ_{axes a on source dim e} src_stride_a · x_a
//! ```
//!
//! (numpy's `as_strided` on both sides at once), or a fill part (target side only, every
//! element set to a stated value). The axes on any one dimension are *nested* — each stride
//! exceeds the span of the smaller ones — so each side is injective and the preimage of a
//! range is a few boxes of the axes ([`ViewPart::target_preimage`], `source_preimage`).
//!
//! Why this form rather than one fixed factorisation of each dimension into atoms shared by
//! all parts: slices and concatenations move a part's origin off any shared factorisation
//! (a sliced vocabulary, a fused tensor's later thirds), and a per-part stride per axis stays
//! closed under every transform, cutting a part only where the arithmetic demands it:
//!
//! - `Permute`, `Merge`, `Concat` and `Pad` never cut: they relabel dimensions, scale strides
//!   and move origins (Pad adds fill parts).
//! - `Slice` keeps the preimage of the range, a few boxes of each part's axes.
//! - `Split` divides each part's positions along the dimension by each factor in turn. An
//!   axis whose stride is a multiple of the factor goes to the quotient, one whose span stays
//!   below it to the remainder, and one that straddles it is refined into two axes (or its
//!   partial first and last blocks cut off as parts of their own). Where no such refinement
//!   exists (a split that does not fall on the boundaries of what it splits) parts are cut
//!   down further; past [`MAX_PARTS`] the view is refused as not a strided view of its sources.
//!
//! The planner (`plan::plan_views`) maps every target piece and every source piece into a
//! part's axis space with the preimages, intersects them there with the same sweep as
//! [`super::join`], and emits the strided runs of [`super::for_each_run`]; no tensor is
//! materialised. An identity view (`Source` alone) has one part with one axis per dimension
//! and plans exactly the copies of `plan::plan`.

use super::{DType, Region, MAX_DIMS};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Most parts a view may compile to: a split that does not fall on the boundaries of what it
/// splits is cut into more parts than this, and refused.
pub const MAX_PARTS: usize = 1 << 16;

/// The value padding elements are set to, converted to the target's dtype when planned.
/// Compared bit for bit (so a view equals itself whatever its fill).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fill(pub f64);

impl PartialEq for Fill {
    fn eq(&self, other: &Fill) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for Fill {}

impl fmt::Display for Fill {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Fill {
    /// One element of the value in `dtype`, little-endian: floats rounded to nearest even;
    /// integers and bool only for a value they hold exactly; fp8 only for zero.
    pub fn bytes(self, dtype: DType) -> std::result::Result<Vec<u8>, String> {
        let v = self.0;
        let int = |lo: f64, hi: f64| -> std::result::Result<i128, String> {
            if v.fract() == 0.0 && v >= lo && v <= hi {
                Ok(v as i128)
            } else {
                Err(format!("fill value {v} is not a value of {dtype}"))
            }
        };
        Ok(match dtype {
            DType::F64 => v.to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            DType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
            DType::F8E4M3 | DType::F8E5M2 => {
                if v != 0.0 {
                    return Err(format!(
                        "fill value {v} in {dtype}: only 0 can be stated for fp8"
                    ));
                }
                vec![if v.is_sign_negative() { 0x80 } else { 0 }]
            }
            // the fnuz fp8s have no negative zero (0x80 is their NaN), e8m0 and the packed fp4
            // no zero of one bit pattern worth stating: positive zero only, where it exists
            DType::F8E4M3FNUZ | DType::F8E5M2FNUZ | DType::F4E2M1X2 => {
                if v != 0.0 || v.is_sign_negative() {
                    return Err(format!(
                        "fill value {v} in {dtype}: only 0 can be stated for fp8 and fp4"
                    ));
                }
                vec![0]
            }
            DType::F8E8M0 => {
                return Err(format!(
                    "fill value {v} in {dtype}: no fill is stated for e8m0 scales"
                ))
            }
            // a complex fill is the value with a zero imaginary part
            DType::C32 | DType::BC32 | DType::C64 | DType::C128 => {
                let part = dtype.complex_part().expect("a complex dtype");
                let mut b = Fill(v).bytes(part)?;
                b.extend(Fill(0.0).bytes(part)?);
                b
            }
            DType::Bool => vec![int(0.0, 1.0)? as u8],
            DType::U8 => vec![int(0.0, u8::MAX as f64)? as u8],
            DType::I8 => (int(i8::MIN as f64, i8::MAX as f64)? as i8)
                .to_le_bytes()
                .to_vec(),
            DType::I16 => (int(i16::MIN as f64, i16::MAX as f64)? as i16)
                .to_le_bytes()
                .to_vec(),
            DType::U16 => (int(0.0, u16::MAX as f64)? as u16).to_le_bytes().to_vec(),
            DType::I32 => (int(i32::MIN as f64, i32::MAX as f64)? as i32)
                .to_le_bytes()
                .to_vec(),
            DType::U32 => (int(0.0, u32::MAX as f64)? as u32).to_le_bytes().to_vec(),
            // 2^63 and 2^64 are the first f64 values past the ranges
            DType::I64 => (int(i64::MIN as f64, 9.223_372_036_854_775e18)? as i64)
                .to_le_bytes()
                .to_vec(),
            DType::U64 => (int(0.0, 1.844_674_407_370_955e19)? as u64)
                .to_le_bytes()
                .to_vec(),
        })
    }
}

/// A target tensor as an expression over source tensors. Dimensions are numbered from 0;
/// each node's dimensions are those of the tensor its operand describes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum View {
    /// The source tensor `name`, whole (a rename when the target is named otherwise).
    Source {
        /// The source tensor's name.
        name: String,
    },
    /// Elements `start .. start + len` of dimension `dim`.
    Slice {
        /// The operand.
        of: Box<View>,
        /// The dimension sliced.
        dim: usize,
        /// First index kept.
        start: u64,
        /// Number of indices kept.
        len: u64,
    },
    /// Dimension `dim` split into dimensions of `sizes` (row-major, their product its size;
    /// no sizes removes a dimension of size 1).
    Split {
        /// The operand.
        of: Box<View>,
        /// The dimension split.
        dim: usize,
        /// The new dimensions' sizes, outermost first.
        sizes: Vec<u64>,
    },
    /// Dimensions `dim .. dim + count` merged into one (row-major; a count of 0 inserts a
    /// dimension of size 1).
    Merge {
        /// The operand.
        of: Box<View>,
        /// The first dimension merged.
        dim: usize,
        /// How many dimensions are merged.
        count: usize,
    },
    /// Dimensions reordered as `torch.permute`: dimension `i` of the result is dimension
    /// `order[i]` of the operand.
    Permute {
        /// The operand.
        of: Box<View>,
        /// A permutation of the operand's dimensions.
        order: Vec<usize>,
    },
    /// The operands one after another along `dim` (equal in every other dimension).
    Concat {
        /// The dimension concatenated along.
        dim: usize,
        /// The operands, in order.
        parts: Vec<View>,
    },
    /// `before` elements of `fill` ahead of the operand along `dim` and `after` behind it.
    Pad {
        /// The operand.
        of: Box<View>,
        /// The dimension padded.
        dim: usize,
        /// Indices of fill ahead of the operand.
        before: u64,
        /// Indices of fill behind it.
        after: u64,
        /// The padding's value.
        fill: Fill,
    },
}

/// A compact one-line form: `name`, `X[d: a..b]`, `split(X, d, [..])`, `merge(X, d, n)`,
/// `permute(X, [..])`, `concat(d, [A, B])`, `pad(X, d, before, after, fill)`.
impl fmt::Display for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            View::Source { name } => write!(f, "{name}"),
            View::Slice {
                of,
                dim,
                start,
                len,
            } => {
                write!(f, "{of}[{dim}: {start}..{}]", start.saturating_add(*len))
            }
            View::Split { of, dim, sizes } => write!(f, "split({of}, {dim}, {sizes:?})"),
            View::Merge { of, dim, count } => write!(f, "merge({of}, {dim}, {count})"),
            View::Permute { of, order } => write!(f, "permute({of}, {order:?})"),
            View::Concat { dim, parts } => {
                write!(f, "concat({dim}, [")?;
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{p}")?;
                }
                write!(f, "])")
            }
            View::Pad {
                of,
                dim,
                before,
                after,
                fill,
            } => write!(f, "pad({of}, {dim}, {before}, {after}, {fill})"),
        }
    }
}

/// One axis of a [`ViewPart`]: index `x ∈ [0, size)` steps `stride` along target dimension
/// `dim` and `src_stride` along source dimension `src_dim` (both unused in a fill part).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Axis {
    /// Number of indices.
    pub size: u64,
    /// Target dimension.
    pub dim: usize,
    /// Step along the target dimension.
    pub stride: u64,
    /// Source dimension.
    pub src_dim: usize,
    /// Step along the source dimension.
    pub src_stride: u64,
}

/// Where a part's elements come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "from", rename_all = "snake_case")]
pub enum PartFrom {
    /// Source tensor `name`, its element `origin` at the part's first element.
    Source {
        /// The source tensor's name.
        name: String,
        /// Source index of the part's first element.
        origin: Vec<u64>,
    },
    /// Every element set to `value`.
    Fill {
        /// The value.
        value: Fill,
    },
}

/// One piece of a [`ViewMap`]: a strided box of the target and where it comes from (see the
/// module's documentation).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewPart {
    /// Target index of the part's first element.
    pub origin: Vec<u64>,
    /// The axes, in the target's row-major order (by dimension, then decreasing stride).
    pub axes: Vec<Axis>,
    /// Its source or fill.
    pub from: PartFrom,
}

/// A compiled [`View`]: the target's shape and the parts that partition its elements.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewMap {
    /// The target tensor's shape.
    pub shape: Vec<u64>,
    /// Disjoint parts covering every element of the target.
    pub parts: Vec<ViewPart>,
}

/// What compiling needs: the target's name for errors, the sources' shapes, a part budget.
/// One axis per dimension of `shape`, each stepping 1 along its own target dimension and
/// `src(d)` = (source dimension, source stride) on the source side.
fn unit_axes(shape: &[u64], src: impl Fn(usize) -> (usize, u64)) -> Vec<Axis> {
    shape
        .iter()
        .enumerate()
        .map(|(d, &size)| {
            let (src_dim, src_stride) = src(d);
            Axis {
                size,
                dim: d,
                stride: 1,
                src_dim,
                src_stride,
            }
        })
        .collect()
}

struct Ctx<'a> {
    target: &'a str,
    shape_of: &'a dyn Fn(&str) -> Option<Vec<u64>>,
    parts: usize,
}

impl Ctx<'_> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::layout(self.target, msg)
    }

    /// The error of `op` (a transform's name) on a dimension its operand lacks.
    fn no_dim(&self, op: &str, dim: usize, shape: &[u64]) -> Error {
        self.err(format!(
            "{op} of dimension {dim}, but its operand has shape {shape:?}"
        ))
    }

    /// The operand `of` evaluated, and the size of its dimension `dim` that `op` transforms.
    fn operand(&mut self, of: &View, op: &str, dim: usize) -> Result<(ViewMap, u64)> {
        let m = of.eval(self)?;
        match m.shape.get(dim) {
            Some(&size) => Ok((m, size)),
            None => Err(self.no_dim(op, dim, &m.shape)),
        }
    }

    /// Count `n` more parts made by cutting, refusing past the budget.
    fn spend(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<()> {
        self.parts = self.parts.saturating_add(n);
        if self.parts > MAX_PARTS {
            return Err(self.err(format!(
                "{} is not a strided view of its source: it cuts it into more than {MAX_PARTS} parts",
                what()
            )));
        }
        Ok(())
    }
}

fn dims_text(sizes: &[u64]) -> String {
    sizes
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join("×")
}

impl View {
    /// The source tensor `name`.
    pub fn source(name: impl Into<String>) -> View {
        View::Source { name: name.into() }
    }

    /// `self` sliced to `start .. start + len` along `dim`.
    pub fn slice(self, dim: usize, start: u64, len: u64) -> View {
        View::Slice {
            of: Box::new(self),
            dim,
            start,
            len,
        }
    }

    /// `self` with `dim` split into `sizes`.
    pub fn split(self, dim: usize, sizes: &[u64]) -> View {
        View::Split {
            of: Box::new(self),
            dim,
            sizes: sizes.to_vec(),
        }
    }

    /// `self` with `count` dimensions from `dim` merged.
    pub fn merge(self, dim: usize, count: usize) -> View {
        View::Merge {
            of: Box::new(self),
            dim,
            count,
        }
    }

    /// `self` permuted by `order`.
    pub fn permute(self, order: &[usize]) -> View {
        View::Permute {
            of: Box::new(self),
            order: order.to_vec(),
        }
    }

    /// `parts` concatenated along `dim`.
    pub fn concat(dim: usize, parts: Vec<View>) -> View {
        View::Concat { dim, parts }
    }

    /// `self` padded along `dim` with `before` and `after` elements of `fill`.
    pub fn pad(self, dim: usize, before: u64, after: u64, fill: f64) -> View {
        View::Pad {
            of: Box::new(self),
            dim,
            before,
            after,
            fill: Fill(fill),
        }
    }

    /// The source tensors the view reads, each once, in the order first named.
    pub fn sources(&self) -> Vec<&str> {
        fn walk<'a>(v: &'a View, out: &mut Vec<&'a str>) {
            match v {
                View::Source { name } => {
                    if !out.contains(&name.as_str()) {
                        out.push(name)
                    }
                }
                View::Slice { of, .. }
                | View::Split { of, .. }
                | View::Merge { of, .. }
                | View::Permute { of, .. }
                | View::Pad { of, .. } => walk(of, out),
                View::Concat { parts, .. } => parts.iter().for_each(|p| walk(p, out)),
            }
        }
        let mut out = vec![];
        walk(self, &mut out);
        out
    }

    /// The view with each source leaf replaced by what `f` makes of its name (a rename, or
    /// another view: a slice of a stacked tensor).
    pub fn map_sources(self, f: &mut dyn FnMut(&str) -> View) -> View {
        match self {
            View::Source { name } => f(&name),
            View::Slice {
                of,
                dim,
                start,
                len,
            } => View::Slice {
                of: Box::new(of.map_sources(f)),
                dim,
                start,
                len,
            },
            View::Split { of, dim, sizes } => View::Split {
                of: Box::new(of.map_sources(f)),
                dim,
                sizes,
            },
            View::Merge { of, dim, count } => View::Merge {
                of: Box::new(of.map_sources(f)),
                dim,
                count,
            },
            View::Permute { of, order } => View::Permute {
                of: Box::new(of.map_sources(f)),
                order,
            },
            View::Concat { dim, parts } => View::Concat {
                dim,
                parts: parts.into_iter().map(|p| p.map_sources(f)).collect(),
            },
            View::Pad {
                of,
                dim,
                before,
                after,
                fill,
            } => View::Pad {
                of: Box::new(of.map_sources(f)),
                dim,
                before,
                after,
                fill,
            },
        }
    }

    /// The shape of target tensor `target` this view defines, the sources' shapes given by
    /// `shape_of`; an inconsistent view is a one-line error naming `target`.
    pub fn shape(
        &self,
        target: &str,
        shape_of: &dyn Fn(&str) -> Option<Vec<u64>>,
    ) -> Result<Vec<u64>> {
        Ok(self.compile(target, shape_of)?.shape)
    }

    /// The view's normal form for target tensor `target`, the sources' shapes given by
    /// `shape_of` (see the module's documentation). Errors are one line naming `target`.
    pub fn compile(
        &self,
        target: &str,
        shape_of: &dyn Fn(&str) -> Option<Vec<u64>>,
    ) -> Result<ViewMap> {
        let mut ctx = Ctx {
            target,
            shape_of,
            parts: 0,
        };
        let map = self.eval(&mut ctx)?;
        // Every transform partitions by construction: a count that disagrees is a bug.
        let want = Region::full(&map.shape).volume();
        let got = map
            .parts
            .iter()
            .map(|p| p.axes.iter().map(|a| a.size).product::<u64>())
            .fold(0u64, u64::saturating_add);
        if got != want {
            return Err(Error::internal(format!(
                "view of `{target}`: parts hold {got} of {want} elements"
            )));
        }
        Ok(map)
    }

    fn eval(&self, ctx: &mut Ctx) -> Result<ViewMap> {
        let map = match self {
            View::Source { name } => {
                let shape = (ctx.shape_of)(name).ok_or_else(|| {
                    ctx.err(format!(
                        "is a view of `{name}`, which the source does not hold"
                    ))
                })?;
                let part = ViewPart {
                    origin: vec![0; shape.len()],
                    axes: unit_axes(&shape, |d| (d, 1)),
                    from: PartFrom::Source {
                        name: name.clone(),
                        origin: vec![0; shape.len()],
                    },
                };
                let parts = if shape.contains(&0) {
                    vec![]
                } else {
                    vec![part]
                };
                ViewMap { shape, parts }
            }
            View::Slice {
                of,
                dim,
                start,
                len,
            } => {
                let (dim, start, len) = (*dim, *start, *len);
                let (mut m, size) = ctx.operand(of, "a slice", dim)?;
                if start.checked_add(len).is_none_or(|e| e > size) {
                    return Err(ctx.err(format!(
                        "slice {start}..{} of dimension {dim} reaches past its {size} indices",
                        start.saturating_add(len)
                    )));
                }
                let mut region = Region::full(&m.shape);
                region.offsets[dim] = start;
                region.sizes[dim] = len;
                let mut parts = vec![];
                for p in std::mem::take(&mut m.parts) {
                    let boxes = p.target_preimage(&region);
                    if boxes.len() > 1 {
                        ctx.spend(boxes.len() - 1, &|| {
                            format!("slice {start}..{} of dimension {dim}", start + len)
                        })?;
                    }
                    for b in boxes {
                        let mut q = p.restrict(&b);
                        q.origin[dim] -= start;
                        parts.push(q);
                    }
                }
                m.shape[dim] = len;
                if len == 0 {
                    parts.clear();
                }
                ViewMap {
                    shape: m.shape,
                    parts,
                }
            }
            View::Split { of, dim, sizes } => {
                let dim = *dim;
                let (m, size) = ctx.operand(of, "a split", dim)?;
                let product = sizes.iter().try_fold(1u64, |a, &s| a.checked_mul(s));
                if product != Some(size) {
                    return Err(ctx.err(format!(
                        "splits dimension {dim} of {size} into {} (product {})",
                        if sizes.is_empty() {
                            "no dimensions".to_string()
                        } else {
                            dims_text(sizes)
                        },
                        product.map_or("overflows".to_string(), |p| p.to_string())
                    )));
                }
                let mut shape = m.shape.clone();
                shape.splice(dim..=dim, sizes.iter().copied());
                check_ndim(ctx, &shape)?;
                let what = || format!("split of dimension {dim} into {}", dims_text(sizes));
                let mut parts = vec![];
                for p in m.parts {
                    parts.extend(split_part(ctx, p, dim, sizes, &what)?);
                }
                ViewMap { shape, parts }
            }
            View::Merge { of, dim, count } => {
                let (dim, count) = (*dim, *count);
                let m = of.eval(ctx)?;
                if dim.checked_add(count).is_none_or(|e| e > m.shape.len())
                    || (count == 0 && dim > m.shape.len())
                {
                    return Err(ctx.err(format!(
                        "merges dimensions {dim}..{} of an operand of shape {:?}",
                        dim.saturating_add(count),
                        m.shape
                    )));
                }
                let merged = m.shape[dim..dim + count]
                    .iter()
                    .try_fold(1u64, |a, &s| a.checked_mul(s))
                    .ok_or_else(|| ctx.err("merged dimension's size overflows"))?;
                let mut shape = m.shape.clone();
                shape.splice(dim..dim + count, [merged]);
                check_ndim(ctx, &shape)?;
                // place value of each merged dimension
                let mut place = vec![1u64; count];
                for j in (0..count.saturating_sub(1)).rev() {
                    place[j] = place[j + 1] * m.shape[dim + j + 1];
                }
                let parts = m
                    .parts
                    .into_iter()
                    .map(|mut p| {
                        let o: u64 = (0..count).map(|j| p.origin[dim + j] * place[j]).sum();
                        p.origin.splice(dim..dim + count, [o]);
                        for a in &mut p.axes {
                            if a.dim >= dim + count {
                                a.dim = a.dim + 1 - count;
                            } else if a.dim >= dim {
                                a.stride *= place[a.dim - dim];
                                a.dim = dim;
                            }
                        }
                        p.sort();
                        p
                    })
                    .collect();
                ViewMap { shape, parts }
            }
            View::Permute { of, order } => {
                let m = of.eval(ctx)?;
                let n = m.shape.len();
                let mut inv = vec![usize::MAX; n];
                for (i, &o) in order.iter().enumerate() {
                    if o < n && inv[o] == usize::MAX {
                        inv[o] = i;
                    }
                }
                if order.len() != n || inv.contains(&usize::MAX) {
                    return Err(ctx.err(format!(
                        "permutes by {order:?}, not a permutation of the {n} dimensions of shape {:?}",
                        m.shape
                    )));
                }
                let shape = order.iter().map(|&o| m.shape[o]).collect();
                let parts = m
                    .parts
                    .into_iter()
                    .map(|mut p| {
                        p.origin = order.iter().map(|&o| p.origin[o]).collect();
                        for a in &mut p.axes {
                            a.dim = inv[a.dim];
                        }
                        p.sort();
                        p
                    })
                    .collect();
                ViewMap { shape, parts }
            }
            View::Concat { dim, parts: views } => {
                let dim = *dim;
                let mut shape: Option<Vec<u64>> = None;
                let mut parts = vec![];
                for v in views {
                    let m = v.eval(ctx)?;
                    if dim >= m.shape.len() {
                        return Err(ctx.no_dim("a concatenation", dim, &m.shape));
                    }
                    let at = match &mut shape {
                        None => {
                            shape = Some(m.shape.clone());
                            0
                        }
                        Some(s) => {
                            let same = s.len() == m.shape.len()
                                && (0..s.len()).all(|d| d == dim || s[d] == m.shape[d]);
                            if !same {
                                return Err(ctx.err(format!(
                                    "concatenates along dimension {dim} an operand of shape {:?} \
                                     after operands of shape {s:?}",
                                    m.shape
                                )));
                            }
                            let at = s[dim];
                            s[dim] = at.checked_add(m.shape[dim]).ok_or_else(|| {
                                ctx.err("concatenated dimension's size overflows")
                            })?;
                            at
                        }
                    };
                    for mut p in m.parts {
                        p.origin[dim] += at;
                        parts.push(p);
                    }
                }
                let shape = shape.ok_or_else(|| {
                    ctx.err(format!("concatenates no operands along dimension {dim}"))
                })?;
                ViewMap { shape, parts }
            }
            View::Pad {
                of,
                dim,
                before,
                after,
                fill,
            } => {
                let (dim, before, after) = (*dim, *before, *after);
                let (mut m, size) = ctx.operand(of, "padding", dim)?;
                let padded = size
                    .checked_add(before)
                    .and_then(|s| s.checked_add(after))
                    .ok_or_else(|| ctx.err("padded dimension's size overflows"))?;
                for p in &mut m.parts {
                    p.origin[dim] += before;
                }
                let mut shape = m.shape.clone();
                shape[dim] = padded;
                for (at, n) in [(0, before), (before + size, after)] {
                    let mut sizes = shape.clone();
                    sizes[dim] = n;
                    if sizes.contains(&0) {
                        continue;
                    }
                    let mut origin = vec![0; shape.len()];
                    origin[dim] = at;
                    m.parts.push(ViewPart {
                        origin,
                        axes: unit_axes(&sizes, |_| (0, 0)),
                        from: PartFrom::Fill { value: *fill },
                    });
                }
                ViewMap {
                    shape,
                    parts: m.parts,
                }
            }
        };
        check_ndim(ctx, &map.shape)?;
        Ok(map)
    }
}

fn check_ndim(ctx: &Ctx, shape: &[u64]) -> Result<()> {
    if shape.len() > MAX_DIMS {
        return Err(ctx.err(format!(
            "view has {} dimensions; reshard handles at most {MAX_DIMS}",
            shape.len()
        )));
    }
    Ok(())
}

/// Split target dimension `dim` of part `p` into `sizes`: divide by each factor from the
/// innermost, the remainder becoming the new dimension.
fn split_part(
    ctx: &mut Ctx,
    mut p: ViewPart,
    dim: usize,
    sizes: &[u64],
    what: &dyn Fn() -> String,
) -> Result<Vec<ViewPart>> {
    if sizes.is_empty() {
        // a dimension of size 1 removed: its axes hold one index each
        p.axes.retain(|a| a.dim != dim);
        p.origin.remove(dim);
        for a in &mut p.axes {
            if a.dim > dim {
                a.dim -= 1;
            }
        }
        return Ok(vec![p]);
    }
    let extra = sizes.len() - 1;
    for a in &mut p.axes {
        if a.dim > dim {
            a.dim += extra;
        }
    }
    p.origin
        .splice(dim + 1..dim + 1, std::iter::repeat_n(0, extra));
    let mut parts = vec![p];
    for j in (1..sizes.len()).rev() {
        let mut next = vec![];
        for q in parts {
            divide(ctx, q, dim, sizes[j], dim + j, what, &mut next)?;
        }
        parts = next;
    }
    for q in &mut parts {
        q.sort();
    }
    Ok(parts)
}

/// Rewrite target dimension `dim` of `p` as `m · q + r` with `r < m`: `q` stays in `dim`,
/// `r` goes to (the so far empty) dimension `rdim`. Pushes the parts to `out`, cut where an
/// axis carries across a multiple of `m`.
fn divide(
    ctx: &mut Ctx,
    mut p: ViewPart,
    dim: usize,
    m: u64,
    rdim: usize,
    what: &dyn Fn() -> String,
    out: &mut Vec<ViewPart>,
) -> Result<()> {
    p.axes.retain(|a| a.size != 1 || a.dim != dim);
    let (t0, r0) = (p.origin[dim], p.origin[dim] % m);
    let on_dim: Vec<usize> = (0..p.axes.len())
        .filter(|&i| p.axes[i].dim == dim)
        .collect();
    // an axis stepping a multiple of m or more that is no multiple of m: cut it into indices
    if let Some(&i) = on_dim
        .iter()
        .find(|&&i| p.axes[i].stride >= m && p.axes[i].stride % m != 0)
    {
        return expand(ctx, p, i, dim, m, rdim, what, out);
    }
    let low: Vec<usize> = on_dim
        .iter()
        .copied()
        .filter(|&i| p.axes[i].stride < m)
        .collect();
    let span = |ix: &[usize]| -> u64 {
        ix.iter()
            .map(|&i| p.axes[i].stride * (p.axes[i].size - 1))
            .sum()
    };
    if r0 + span(&low) < m {
        // no carry: high axes step the quotient, low ones the remainder
        p.origin[dim] = t0 / m;
        p.origin[rdim] = r0;
        for &i in &on_dim {
            let a = &mut p.axes[i];
            if a.stride >= m {
                a.stride /= m;
            } else {
                a.dim = rdim;
            }
        }
        out.push(p);
        return Ok(());
    }
    // the outermost low axis straddles multiples of m
    let b = *low
        .iter()
        .max_by_key(|&&i| p.axes[i].stride)
        .expect("low axes span");
    let inner: Vec<usize> = low.iter().copied().filter(|&i| i != b).collect();
    let (sb, nb) = (p.axes[b].stride, p.axes[b].size);
    if m % sb == 0 && r0 % sb + span(&inner) < sb {
        let g = m / sb;
        let u0 = (r0 / sb) % g;
        let head = if u0 > 0 { nb.min(g - u0) } else { 0 };
        let k = (nb - head) / g;
        let tail = nb - head - k * g;
        let mut cuts = vec![];
        if head > 0 {
            cuts.push(p.restrict_axis(b, 0, head));
        }
        if k > 0 {
            let mut mid = p.restrict_axis(b, head, k * g);
            let a = mid.axes[b];
            mid.axes[b].size = g;
            mid.axes.insert(
                b,
                Axis {
                    size: k,
                    stride: a.stride * g,
                    src_stride: a.src_stride * g,
                    ..a
                },
            );
            cuts.push(mid);
        }
        if tail > 0 {
            cuts.push(p.restrict_axis(b, head + k * g, tail));
        }
        ctx.spend(cuts.len() - 1, what)?;
        for c in cuts {
            divide(ctx, c, dim, m, rdim, what, out)?;
        }
        return Ok(());
    }
    expand(ctx, p, b, dim, m, rdim, what, out)
}

/// [`divide`] each index of axis `i` of `p` as a part of its own.
#[allow(clippy::too_many_arguments)]
fn expand(
    ctx: &mut Ctx,
    p: ViewPart,
    i: usize,
    dim: usize,
    m: u64,
    rdim: usize,
    what: &dyn Fn() -> String,
    out: &mut Vec<ViewPart>,
) -> Result<()> {
    let n = p.axes[i].size;
    ctx.spend(usize::try_from(n - 1).unwrap_or(usize::MAX), what)?;
    for x in 0..n {
        let mut q = p.restrict_axis(i, x, 1);
        q.axes.remove(i);
        divide(ctx, q, dim, m, rdim, what, out)?;
    }
    Ok(())
}

impl ViewPart {
    /// Number of elements.
    pub fn volume(&self) -> u64 {
        self.axes.iter().map(|a| a.size).product()
    }

    /// The source tensor's name, for a part that copies.
    pub fn source(&self) -> Option<&str> {
        match &self.from {
            PartFrom::Source { name, .. } => Some(name),
            PartFrom::Fill { .. } => None,
        }
    }

    /// Axes in the target's row-major order (stable, so equal strides keep their order).
    fn sort(&mut self) {
        self.axes
            .sort_by_key(|a| (a.dim, std::cmp::Reverse(a.stride)));
    }

    /// The part restricted to indices `start .. start + len` of axis `i`.
    fn restrict_axis(&self, i: usize, start: u64, len: u64) -> ViewPart {
        let mut q = self.clone();
        let a = q.axes[i];
        q.axes[i].size = len;
        q.origin[a.dim] += a.stride * start;
        if let PartFrom::Source { origin, .. } = &mut q.from {
            origin[a.src_dim] += a.src_stride * start;
        }
        q
    }

    /// The part restricted to `b`, a box of its axes (axes left with one index dropped, but
    /// for the whole part, which is kept as it is).
    fn restrict(&self, b: &Region) -> ViewPart {
        if b.offsets.iter().all(|&o| o == 0)
            && b.sizes.iter().zip(&self.axes).all(|(s, a)| *s == a.size)
        {
            return self.clone();
        }
        let mut q = self.clone();
        for (i, (&o, &s)) in b.offsets.iter().zip(&b.sizes).enumerate() {
            q = q.restrict_axis(i, o, s);
        }
        q.axes.retain(|a| a.size != 1);
        q
    }

    /// The boxes of the part's axis space whose elements fall in `region` of the target
    /// (disjoint, in increasing order of their first index).
    pub fn target_preimage(&self, region: &Region) -> Vec<Region> {
        let axes: Vec<(usize, u64, u64)> = self
            .axes
            .iter()
            .map(|a| (a.dim, a.size, a.stride))
            .collect();
        preimage(&self.origin, &axes, region)
    }

    /// The boxes of the part's axis space whose source elements fall in `region` of its
    /// source tensor (none for a fill part).
    pub fn source_preimage(&self, region: &Region) -> Vec<Region> {
        match &self.from {
            PartFrom::Source { origin, .. } => {
                let axes: Vec<(usize, u64, u64)> = self
                    .axes
                    .iter()
                    .map(|a| (a.src_dim, a.size, a.src_stride))
                    .collect();
                preimage(origin, &axes, region)
            }
            PartFrom::Fill { .. } => vec![],
        }
    }

    /// The target index of the first element of `b`, a box of the part's axes.
    pub fn target_index(&self, b: &Region) -> Vec<u64> {
        let mut t = self.origin.clone();
        for (a, &o) in self.axes.iter().zip(&b.offsets) {
            t[a.dim] += a.stride * o;
        }
        t
    }

    /// The source index of the first element of `b` (the target's, for a fill part).
    pub fn source_index(&self, b: &Region) -> Vec<u64> {
        match &self.from {
            PartFrom::Source { origin, .. } => {
                let mut s = origin.clone();
                for (a, &o) in self.axes.iter().zip(&b.offsets) {
                    s[a.src_dim] += a.src_stride * o;
                }
                s
            }
            PartFrom::Fill { .. } => self.target_index(b),
        }
    }
}

/// The boxes of an axis space of `(dimension, size, stride)` axes whose images
/// `origin[d] + Σ stride·x` (over the axes on each dimension `d`) fall in `region`.
fn preimage(origin: &[u64], axes: &[(usize, u64, u64)], region: &Region) -> Vec<Region> {
    // per dimension: its axes, and the boxes `(start, len)` of them
    let mut per_dim: Vec<(Vec<usize>, AxisBoxes)> = vec![];
    for (d, &base) in origin.iter().enumerate() {
        let (lo, hi) = (region.offsets[d], region.end(d));
        let mut on: Vec<usize> = (0..axes.len()).filter(|&i| axes[i].0 == d).collect();
        on.sort_by_key(|&i| std::cmp::Reverse(axes[i].2));
        let sizes: Vec<(u64, u64)> = on.iter().map(|&i| (axes[i].1, axes[i].2)).collect();
        let boxes = ranges(base, &sizes, lo, hi);
        if boxes.is_empty() {
            return vec![];
        }
        per_dim.push((on, boxes));
    }
    // the product of each dimension's boxes
    let mut out = vec![Region::new(vec![0; axes.len()], vec![0; axes.len()])];
    for (on, boxes) in &per_dim {
        let mut next = Vec::with_capacity(out.len() * boxes.len());
        for r in &out {
            for b in boxes {
                let mut r = r.clone();
                for (&i, &(o, s)) in on.iter().zip(b) {
                    r.offsets[i] = o;
                    r.sizes[i] = s;
                }
                next.push(r);
            }
        }
        out = next;
    }
    out
}

/// Boxes of some axes: each a `(start, len)` per axis.
type AxisBoxes = Vec<Vec<(u64, u64)>>;

/// The boxes `(start, len)` per axis of the indices `x` of nested axes `(size, stride)`
/// (outermost first) with `base + Σ stride·x` in `lo .. hi`, in increasing order.
fn ranges(base: u64, axes: &[(u64, u64)], lo: u64, hi: u64) -> AxisBoxes {
    // spans[k]: the span of the axes inside axis k
    let mut spans = vec![0u128; axes.len() + 1];
    for k in (0..axes.len()).rev() {
        let (n, s) = axes[k];
        spans[k] = spans[k + 1] + s as u128 * (n as u128).saturating_sub(1);
    }
    let mut out = vec![];
    if axes.iter().all(|&(n, _)| n > 0) && lo < hi {
        let mut prefix = vec![];
        ranges_from(
            base as u128,
            axes,
            &spans,
            (lo as u128, hi as u128),
            &mut prefix,
            &mut out,
        );
    }
    out
}

fn ranges_from(
    base: u128,
    axes: &[(u64, u64)],
    spans: &[u128],
    (lo, hi): (u128, u128),
    prefix: &mut Vec<(u64, u64)>,
    out: &mut AxisBoxes,
) {
    let k = prefix.len();
    if base + spans[k] < lo || base >= hi {
        return;
    }
    if base >= lo && base + spans[k] < hi {
        let mut b = prefix.clone();
        b.extend(axes[k..].iter().map(|&(n, _)| (0, n)));
        out.push(b);
        return;
    }
    // k < axes.len() here: a single index is either in the range or out of it
    let (n, s) = (axes[k].0 as u128, axes[k].1 as u128);
    let inner = spans[k + 1];
    // index x's block is base + s·x ..= base + s·x + inner
    let div_ceil = |a: u128, b: u128| a.div_ceil(b);
    let first = if lo > base + inner {
        div_ceil(lo - base - inner, s)
    } else {
        0
    };
    let end = div_ceil(hi - base.min(hi), s).min(n);
    let full_lo = if lo > base { div_ceil(lo - base, s) } else { 0 }.max(first);
    let full_hi = if hi > base + inner {
        div_ceil(hi - base - inner, s)
    } else {
        0
    }
    .min(end);
    let partial = |x: u128, prefix: &mut Vec<(u64, u64)>, out: &mut AxisBoxes| {
        prefix.push((x as u64, 1));
        ranges_from(base + s * x, axes, spans, (lo, hi), prefix, out);
        prefix.pop();
    };
    if full_lo >= full_hi {
        for x in first..end {
            partial(x, prefix, out);
        }
        return;
    }
    for x in first..full_lo {
        partial(x, prefix, out);
    }
    let mut b = prefix.clone();
    b.push((full_lo as u64, (full_hi - full_lo) as u64));
    b.extend(axes[k + 1..].iter().map(|&(n, _)| (0, n)));
    out.push(b);
    for x in full_hi..end {
        partial(x, prefix, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every index of a box of nested axes, by brute force.
    fn brute(base: u64, axes: &[(u64, u64)], lo: u64, hi: u64) -> Vec<Vec<u64>> {
        let mut out = vec![];
        let mut x = vec![0u64; axes.len()];
        if axes.iter().any(|a| a.0 == 0) {
            return out;
        }
        loop {
            let t = base + axes.iter().zip(&x).map(|(a, i)| a.1 * i).sum::<u64>();
            if lo <= t && t < hi {
                out.push(x.clone());
            }
            let mut k = axes.len();
            loop {
                if k == 0 {
                    return out;
                }
                k -= 1;
                x[k] += 1;
                if x[k] < axes[k].0 {
                    break;
                }
                x[k] = 0;
            }
        }
    }

    #[test]
    fn ranges_are_exactly_the_preimage() {
        // nested axes with gaps (a sliced middle factor) and without
        let systems: [&[(u64, u64)]; 5] = [
            &[(4, 12), (3, 3), (3, 1)],
            &[(3, 20), (2, 4), (3, 1)],
            &[(5, 1)],
            &[(2, 7), (1, 5), (2, 2)],
            &[],
        ];
        for axes in systems {
            for base in [0, 3] {
                for lo in 0..40 {
                    for hi in lo..45 {
                        let boxes = ranges(base, axes, lo, hi);
                        let mut got: Vec<Vec<u64>> = vec![];
                        for b in &boxes {
                            let sub: Vec<(u64, u64)> = b.iter().map(|r| (r.1, 0)).collect();
                            for x in brute(0, &sub, 0, 1) {
                                got.push(x.iter().zip(b).map(|(i, r)| i + r.0).collect());
                            }
                        }
                        assert_eq!(got, brute(base, axes, lo, hi), "{axes:?} {base} {lo}..{hi}");
                        // a few boxes, never one per index
                        assert!(boxes.len() <= 2 * axes.len() + 1, "{boxes:?}");
                    }
                }
            }
        }
    }

    fn shapes(n: &str) -> Option<Vec<u64>> {
        match n {
            "qkv" => Some(vec![40, 6]),
            "x" => Some(vec![196_608]),
            "e" => Some(vec![10, 3]),
            _ => None,
        }
    }

    #[test]
    fn fused_qkv_rows_compile_to_one_strided_part() {
        let q = View::source("qkv")
            .split(0, &[2, 5, 4])
            .slice(1, 0, 3)
            .merge(0, 3);
        let m = q.compile("q", &shapes).unwrap();
        assert_eq!(m.shape, vec![24, 6]);
        let ax = |size, dim, stride, src_dim, src_stride| Axis {
            size,
            dim,
            stride,
            src_dim,
            src_stride,
        };
        assert_eq!(
            m.parts,
            vec![ViewPart {
                origin: vec![0, 0],
                axes: vec![
                    ax(2, 0, 12, 0, 20),
                    ax(3, 0, 4, 0, 4),
                    ax(4, 0, 1, 0, 1),
                    ax(6, 1, 1, 1, 1)
                ],
                from: PartFrom::Source {
                    name: "qkv".into(),
                    origin: vec![0, 0]
                },
            }]
        );
        // v: the last head of each group, from row 16 of the group's 20
        let v = View::source("qkv")
            .split(0, &[2, 5, 4])
            .slice(1, 4, 1)
            .merge(0, 3);
        let m = v.compile("v", &shapes).unwrap();
        assert_eq!(m.parts.len(), 1);
        assert_eq!(
            m.parts[0].from,
            PartFrom::Source {
                name: "qkv".into(),
                origin: vec![16, 0]
            }
        );
    }

    #[test]
    fn a_split_off_the_boundaries_is_cut_and_past_the_budget_refused() {
        // rows 2..10 of 10 split as 2 × 4: the slice's offset carries into the outer factor
        let m = View::source("e")
            .slice(0, 2, 8)
            .split(0, &[2, 4])
            .compile("t", &shapes)
            .unwrap();
        assert_eq!(m.shape, vec![2, 4, 3]);
        assert_eq!(m.parts.len(), 1);
        assert_eq!(m.parts[0].axes[0].src_stride, 4);
        // padding: fill parts, and the split still one part per side
        let m = View::source("e")
            .pad(0, 1, 1, 0.0)
            .split(0, &[3, 4])
            .compile("t", &shapes)
            .unwrap();
        assert_eq!(m.shape, vec![3, 4, 3]);
        let vol: u64 = m.parts.iter().map(ViewPart::volume).sum();
        assert_eq!(vol, 36);
        // interleaved pairs split by 3: every pair straddles, cut into single rows
        let e = View::source("x")
            .split(0, &[2, 98_304])
            .permute(&[1, 0])
            .merge(0, 2)
            .split(0, &[65_536, 3])
            .compile("t", &shapes)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "tensor `t`: split of dimension 0 into 65536×3 is not a strided view of its source: \
                 it cuts it into more than {MAX_PARTS} parts"
            )
        );
    }

    #[test]
    fn fill_values_in_each_dtype() {
        assert_eq!(Fill(1.0).bytes(DType::BF16).unwrap(), [0x80, 0x3f]);
        assert_eq!(Fill(1.0).bytes(DType::F16).unwrap(), [0x00, 0x3c]);
        assert_eq!(
            Fill(-2.0).bytes(DType::F32).unwrap(),
            (-2.0f32).to_le_bytes()
        );
        assert_eq!(
            Fill(-0.0).bytes(DType::F64).unwrap(),
            (-0.0f64).to_le_bytes()
        );
        assert_eq!(Fill(-3.0).bytes(DType::I8).unwrap(), [0xfd]);
        assert_eq!(Fill(1.0).bytes(DType::Bool).unwrap(), [1]);
        assert_eq!(Fill(0.0).bytes(DType::F8E4M3).unwrap(), [0]);
        assert_eq!(Fill(65535.0).bytes(DType::U16).unwrap(), [0xff, 0xff]);
        assert_eq!(Fill(0.0).bytes(DType::F8E4M3FNUZ).unwrap(), [0]);
        assert_eq!(Fill(0.0).bytes(DType::F4E2M1X2).unwrap(), [0]);
        // complex: the value, then a zero imaginary part
        assert_eq!(Fill(1.0).bytes(DType::BC32).unwrap(), [0x80, 0x3f, 0, 0]);
        let mut c64 = 1.5f32.to_le_bytes().to_vec();
        c64.extend(0f32.to_le_bytes());
        assert_eq!(Fill(1.5).bytes(DType::C64).unwrap(), c64);
        for (v, d) in [
            (2.0, DType::Bool),
            (256.0, DType::U8),
            (-1.0, DType::U32),
            (0.5, DType::I64),
            (1.0, DType::F8E5M2),
            (f64::NAN, DType::I32),
            (1.0, DType::F8E4M3FNUZ),
            (-0.0, DType::F8E5M2FNUZ),
            (0.0, DType::F8E8M0),
            (0.5, DType::F4E2M1X2),
        ] {
            assert!(Fill(v).bytes(d).is_err(), "{v} {d}");
        }
        assert_eq!(
            Fill(0.5).bytes(DType::I16).unwrap_err(),
            "fill value 0.5 is not a value of I16"
        );
    }
}
