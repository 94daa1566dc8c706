//! The planner: source layout × target layout → a minimal copy plan.
//!
//! Pure and serializable: it reads no data file. Every destination byte is read exactly once
//! from one source piece (identical replicas are deduplicated and reads spread over them),
//! padding is never copied, runs are merged into maximal contiguous or strided copies, and
//! adjacent copies are coalesced across tensors. Overlaps are found with the sweep of
//! [`crate::layout::join`], not by comparing all pairs.
//!
//! [`plan_views`] plans target tensors defined as [`View`]s of source tensors (renamed,
//! sliced, split, merged, permuted, concatenated, padded): each target piece and each source
//! piece is mapped into the axis space of the view's strided parts, intersected there, and
//! copied as strided runs; padding becomes [`FillOp`]s.

use crate::error::{Error, Result};
use crate::layout::{
    distinct_regions, for_each_run, join, DType, Loc, PartFrom, Piece, Region, Strided,
    TensorLayout, View, ViewPart,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// A dtype conversion applied while copying.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cast {
    /// Source element type.
    pub from: DType,
    /// Destination element type.
    pub to: DType,
    /// The block scales each element is multiplied by (dequantizing a block-quantized
    /// tensor, `from` being `F8_E4M3`); `None` for a plain conversion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<BlockScale>,
}

/// Where the scales of a block-quantized tensor are, for a [`Cast`] that dequantizes it: an
/// `f32` tensor `[⌈rows/block[0]⌉, ⌈cols/block[1]⌉]`, row-major from `offset` of source file
/// `src`, one scale per block of `block[0] × block[1]` elements of the quantized tensor,
/// itself row-major from `base` of the op's source file (so any byte an op reads names its
/// element, and its block, whatever the op's shape or cut). An element becomes
/// `f32(x) · scale`, rounded once to the target dtype, as DeepSeek-V3's `weight_dequant`
/// computes it (block edges need not fall on the tensor's: edge blocks are partial).
///
/// The plan stays pure: it names the scales' bytes, and the executor reads the scale rows
/// an op needs alongside its source bytes (a block row of scales per `block[0]` rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockScale {
    /// Source file holding the scales.
    pub src: u32,
    /// First byte of the scale tensor.
    pub offset: u64,
    /// First byte of the quantized tensor in the op's source file.
    pub base: u64,
    /// Elements per row of the quantized tensor.
    pub cols: u64,
    /// Rows and columns of a block.
    pub block: [u64; 2],
}

impl BlockScale {
    /// Scales per row of the scale tensor (blocks across a row of the quantized tensor).
    pub fn block_cols(&self) -> u64 {
        self.cols.div_ceil(self.block[1].max(1))
    }

    /// Bytes of one row of the scale tensor.
    pub fn row_bytes(&self) -> u64 {
        self.block_cols() * 4
    }

    /// The block rows (first, past the last) holding the scales of the elements at source
    /// bytes `a..b` (`elem` bytes each) of the quantized tensor.
    pub fn block_rows(&self, elem: u64, a: u64, b: u64) -> (u64, u64) {
        let row = |p: u64| (p.saturating_sub(self.base) / elem.max(1)) / self.cols.max(1);
        let bm = self.block[0].max(1);
        (row(a) / bm, row(b.max(a + 1) - 1) / bm + 1)
    }

    /// The bytes of the scale tensor (first, past the last, in file [`BlockScale::src`])
    /// that op `o` needs: whole block rows.
    pub fn span(&self, o: &CopyOp) -> (u64, u64) {
        let elem = o.cast.map_or(1, |c| c.from.size() as u64);
        let (a, b) = o.src_span();
        let (r0, r1) = self.block_rows(elem, a, b);
        (
            self.offset + r0 * self.row_bytes(),
            self.offset + r1 * self.row_bytes(),
        )
    }

    /// The scales of quantized tensor `weight` (2-D, stored whole and row-major in one piece)
    /// in tensor `scale` (f32 `[⌈rows/block[0]⌉, ⌈cols/block[1]⌉]`, whole in one piece);
    /// `Err` says what is wrong, in words that follow the scale's name.
    pub fn of(
        weight: &TensorLayout,
        scale: &TensorLayout,
        block: [u64; 2],
    ) -> std::result::Result<BlockScale, String> {
        let whole = |t: &TensorLayout| -> Option<Loc> {
            let mut ps = t.pieces.iter().filter(|p| !p.region.is_empty());
            let p = ps.next()?;
            let contiguous = p.loc.strides.is_none()
                || p.loc.strides.as_deref()
                    == Some(&crate::layout::row_major_strides(&t.shape)[..]);
            (ps.all(|q| q.region == p.region && q.loc == p.loc)
                && p.region.offsets.iter().all(|&o| o == 0)
                && p.region.sizes[..] == t.shape[..]
                && contiguous
                && p.loc.pending.is_none())
            .then(|| p.loc.clone())
        };
        if weight.shape.len() != 2 {
            return Err(format!(
                "scales {} of {:?}, which is not 2-D; only 2-D weights are block-quantized",
                weight.name, weight.shape
            ));
        }
        if block[0] == 0 || block[1] == 0 {
            return Err(format!("has a block size of {block:?}"));
        }
        if scale.dtype != DType::F32 {
            return Err(format!("is {}, not F32", scale.dtype));
        }
        let want = [
            weight.shape[0].div_ceil(block[0]),
            weight.shape[1].div_ceil(block[1]),
        ];
        if scale.shape != want {
            return Err(format!(
                "has shape {:?}; {} {:?} in blocks of {}×{} needs {:?}",
                scale.shape, weight.name, weight.shape, block[0], block[1], want
            ));
        }
        let (Some(w), Some(s)) = (whole(weight), whole(scale)) else {
            return Err(format!(
                "or {} is not stored whole in one piece; block-quantized tensors are dequantized from one",
                weight.name
            ));
        };
        Ok(BlockScale {
            src: s.file,
            offset: s.offset,
            base: w.offset,
            cols: weight.shape[1],
            block,
        })
    }
}

/// One copy: `count` rows of `len` source bytes; row `i` is read at
/// `src_offset + i·src_stride` of source file `src` and written at
/// `dst_offset + i·dst_stride` of destination file `dst` (converted when `cast` is set).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyOp {
    /// Source file index.
    pub src: u32,
    /// First source byte.
    pub src_offset: u64,
    /// Destination file index.
    pub dst: u32,
    /// First destination byte.
    pub dst_offset: u64,
    /// Source bytes per row.
    pub len: u64,
    /// Number of rows (1 for a contiguous copy).
    pub count: u64,
    /// Source bytes between rows.
    pub src_stride: u64,
    /// Destination bytes between rows.
    pub dst_stride: u64,
    /// Conversion, if the dtypes differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cast: Option<Cast>,
}

impl CopyOp {
    /// Destination bytes per row.
    pub fn dst_len(&self) -> u64 {
        match self.cast {
            Some(c) => self.len / c.from.size() as u64 * c.to.size() as u64,
            None => self.len,
        }
    }

    /// Source bytes read by the whole op.
    pub fn bytes_read(&self) -> u64 {
        self.len * self.count
    }

    /// Destination bytes written by the whole op.
    pub fn bytes_written(&self) -> u64 {
        self.dst_len() * self.count
    }

    /// First and past-the-last destination byte touched.
    pub fn dst_span(&self) -> (u64, u64) {
        let end = self.dst_offset + (self.count - 1) * self.dst_stride + self.dst_len();
        (self.dst_offset, end)
    }

    /// First and past-the-last source byte touched.
    pub fn src_span(&self) -> (u64, u64) {
        let end = self.src_offset + (self.count - 1) * self.src_stride + self.len;
        (self.src_offset, end)
    }
}

/// One fill: `count` rows of `len` bytes, row `i` at `dst_offset + i·dst_stride` of
/// destination file `dst`, every element set to `value` (one element's bytes in the
/// destination dtype; `len` is a multiple of its length).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillOp {
    /// Destination file index.
    pub dst: u32,
    /// First destination byte.
    pub dst_offset: u64,
    /// Bytes per row.
    pub len: u64,
    /// Number of rows.
    pub count: u64,
    /// Destination bytes between rows.
    pub dst_stride: u64,
    /// One element of the fill value, little-endian.
    pub value: Vec<u8>,
}

impl FillOp {
    /// Destination bytes written by the whole op.
    pub fn bytes_written(&self) -> u64 {
        self.len * self.count
    }

    /// First and past-the-last destination byte touched.
    pub fn dst_span(&self) -> (u64, u64) {
        let end = self.dst_offset + (self.count - 1) * self.dst_stride + self.len;
        (self.dst_offset, end)
    }

    /// Check the op is well formed for a destination of `size` bytes: rows of whole elements
    /// of its value, rows that do not overlap, none past the end. `Err` says what is wrong.
    pub fn check(&self, size: u64) -> std::result::Result<(), String> {
        let elem = self.value.len() as u64;
        if elem == 0 || self.len % elem != 0 {
            return Err(format!(
                "a fill's rows of {} bytes are not whole elements of {elem} bytes",
                self.len
            ));
        }
        if self.count == 0 || self.len == 0 || (self.count > 1 && self.dst_stride < self.len) {
            return Err(format!(
                "malformed fill in plan ({} rows of {} bytes, {} apart)",
                self.count, self.len, self.dst_stride
            ));
        }
        let end = (self.count - 1)
            .checked_mul(self.dst_stride)
            .and_then(|x| x.checked_add(self.dst_offset))
            .and_then(|x| x.checked_add(self.len));
        if end.is_none_or(|e| e > size) {
            return Err(format!(
                "fill past the end of the output ({} rows of {} bytes from {}, {} apart; the output has {size})",
                self.count, self.len, self.dst_offset, self.dst_stride
            ));
        }
        Ok(())
    }

    /// Write the op's rows into `buf`, which holds destination bytes from `lo` on (its rows
    /// whole elements of its value, and within `buf`: [`FillOp::check`]).
    pub fn write_into(&self, buf: &mut [u8], lo: u64) {
        let v = &self.value;
        for r in 0..self.count {
            let a = (self.dst_offset + r * self.dst_stride - lo) as usize;
            let row = &mut buf[a..a + self.len as usize];
            if v.iter().all(|&b| b == v[0]) {
                row.fill(v[0]);
            } else {
                row.chunks_exact_mut(v.len())
                    .for_each(|e| e.copy_from_slice(v));
            }
        }
    }
}

/// What the plan does for one tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPlan {
    /// Tensor name.
    pub name: String,
    /// Source and destination dtype.
    pub dtype: (DType, DType),
    /// Global shape.
    pub shape: Vec<u64>,
    /// Source pieces (all, replicas included) and destination pieces.
    pub pieces: (usize, usize),
    /// Ops produced for this tensor before cross-tensor coalescing.
    pub ops: usize,
    /// Bytes read and written by its copies.
    pub bytes: (u64, u64),
    /// The view the tensor is defined by, when it is not the source tensor of its name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub view: Option<View>,
}

/// A copy plan: ops sorted by destination, and a summary per tensor.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The copies, sorted by (destination file, destination offset).
    pub ops: Vec<CopyOp>,
    /// One entry per planned tensor, in destination order.
    pub tensors: Vec<TensorPlan>,
    /// The fills (padding of views), sorted by (destination file, destination offset).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fills: Vec<FillOp>,
}

impl Plan {
    /// Total bytes read from sources.
    pub fn bytes_read(&self) -> u64 {
        self.ops.iter().map(CopyOp::bytes_read).sum()
    }

    /// Total tensor bytes written to destinations.
    pub fn bytes_written(&self) -> u64 {
        self.ops.iter().map(CopyOp::bytes_written).sum()
    }

    /// Total bytes set by fills.
    pub fn bytes_filled(&self) -> u64 {
        self.fills.iter().map(FillOp::bytes_written).sum()
    }

    /// Source file indices read, sorted.
    pub fn src_files(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.ops.iter().map(|o| o.src).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// Plan the copy of every tensor of `dst` from the tensor of the same name in `src`.
/// Both sides are validated first (exact cover, no conflicting overlap).
pub fn plan(src: &[TensorLayout], dst: &[TensorLayout]) -> Result<Plan> {
    plan_named(src.iter().map(|t| (t.name.as_str(), t)), dst)
}

/// [`plan()`] with each source tensor under a name of the caller's (its output name when
/// tensors are renamed), so the source layouts need not be copied to rename them.
pub fn plan_named<'a>(
    src: impl IntoIterator<Item = (&'a str, &'a TensorLayout)>,
    dst: &[TensorLayout],
) -> Result<Plan> {
    plan_named_scaled(src, dst, &HashMap::new())
}

/// [`plan_named`] where some sources are block-quantized: a target named in `scales` is
/// dequantized from its source (`F8_E4M3`) into its own floating dtype by a [`Cast`] with
/// those [`BlockScale`]s (a target of the source's dtype is copied as it is).
pub fn plan_named_scaled<'a>(
    src: impl IntoIterator<Item = (&'a str, &'a TensorLayout)>,
    dst: &[TensorLayout],
    scales: &HashMap<&str, BlockScale>,
) -> Result<Plan> {
    let by_name: HashMap<&str, &TensorLayout> = src.into_iter().collect();
    plan_each(dst, |d, ops, _| {
        let s = by_name
            .get(d.name.as_str())
            .ok_or_else(|| Error::layout(&d.name, "is in the target but not in the source"))?;
        let scale = scales.get(d.name.as_str()).filter(|_| s.dtype != d.dtype);
        plan_tensor_scaled(s, d, scale, ops)?;
        Ok(TensorPlan {
            name: d.name.clone(),
            dtype: (s.dtype, d.dtype),
            shape: d.shape.clone(),
            pieces: (s.pieces.len(), d.pieces.len()),
            ops: ops.len(),
            bytes: (0, 0),
            view: None,
        })
    })
}

/// Plan every target tensor of `dst`, each defined by its [`View`] of the source tensors
/// `src` (by name): the copies that fill every target piece from the source pieces the view
/// maps it to, and fills for its padding. Every source named is validated (once), and so is
/// every target (exact cover); the view's shape must be the target's. Every source a view reads
/// must have one dtype, which the target's may differ from as a cast allows.
pub fn plan_views<'a>(
    src: impl IntoIterator<Item = (&'a str, &'a TensorLayout)>,
    dst: &[(TensorLayout, View)],
) -> Result<Plan> {
    let by_name: HashMap<&str, &TensorLayout> = src.into_iter().collect();
    // each source read is validated once, however many views read it (a fused QKV: three)
    let mut read: Vec<&str> = dst.iter().flat_map(|(_, v)| v.sources()).collect();
    read.sort_unstable();
    read.dedup();
    for name in read {
        if let Some(s) = by_name.get(name) {
            s.validate()?;
        }
    }
    plan_each(dst, |(d, view), ops, fills| {
        plan_view(&by_name, d, view, true, ops, fills)
    })
}

/// The copies and fills of the pieces of `dst` (a tensor defined by `view` of the tensors of
/// `src`, by name), which need not cover it — a loading rank's share of a target, its pieces
/// placed in the rank's buffers — appended to `ops` and `fills`. The sources are validated by
/// the caller (once per source).
pub fn plan_view_pieces(
    src: &HashMap<&str, &TensorLayout>,
    dst: &TensorLayout,
    view: &View,
    ops: &mut Vec<CopyOp>,
    fills: &mut Vec<FillOp>,
) -> Result<()> {
    plan_view(src, dst, view, false, ops, fills).map(|_| ())
}

/// One tensor's copies, fills and summary.
type Planned = (Vec<CopyOp>, Vec<FillOp>, TensorPlan);

/// Run `one` over the targets of `dst`, in parallel, a group at a time so that only one
/// group's ops are held twice; the first error in target order is reported. `one` appends
/// a tensor's copies and fills and returns its summary (its byte counts are filled in here).
fn plan_each<T: Sync>(
    dst: &[T],
    one: impl Fn(&T, &mut Vec<CopyOp>, &mut Vec<FillOp>) -> Result<TensorPlan> + Sync,
) -> Result<Plan> {
    use rayon::prelude::*;
    const GROUP: usize = 64;
    let mut out = Plan::default();
    for group in dst.chunks(GROUP) {
        let planned: Vec<Result<Planned>> = group
            .par_iter()
            .map(|d| {
                let (mut ops, mut fills) = (vec![], vec![]);
                let mut t = one(d, &mut ops, &mut fills)?;
                t.ops = ops.len();
                t.bytes = (
                    ops.iter().map(CopyOp::bytes_read).sum(),
                    ops.iter().map(CopyOp::bytes_written).sum(),
                );
                Ok((ops, fills, t))
            })
            .collect();
        for p in planned {
            let (ops, fills, t) = p?;
            out.ops.extend(ops);
            out.fills.extend(fills);
            out.tensors.push(t);
        }
    }
    out.ops = coalesce(std::mem::take(&mut out.ops));
    out.fills = coalesce_fills(std::mem::take(&mut out.fills));
    Ok(out)
}

/// Check a source may be planned from into a target of `dtype` named `target`: located, and
/// castable.
fn check_source(src: &TensorLayout, target: &str, dtype: DType) -> Result<()> {
    if !src.dtype.can_cast_to(dtype) {
        return Err(Error::layout(
            target,
            format!(
                "cannot convert {} to {} (only between f16, bf16, f32, f64)",
                src.dtype, dtype
            ),
        ));
    }
    if src.pieces.iter().any(|p| p.loc.pending.is_some()) {
        return Err(Error::layout(
            &src.name,
            "has pieces not yet located (a lazily opened checkpoint): open it with Checkpoint::open to plan a conversion",
        ));
    }
    Ok(())
}

/// Plan one target tensor `dst` defined by `view` of the tensors of `by_name`; `whole`: its
/// pieces must cover it exactly (an output), else they are any regions of it (a loader's).
fn plan_view(
    by_name: &HashMap<&str, &TensorLayout>,
    dst: &TensorLayout,
    view: &View,
    whole: bool,
    ops: &mut Vec<CopyOp>,
    fills: &mut Vec<FillOp>,
) -> Result<TensorPlan> {
    let mut srcs: Vec<(&str, &TensorLayout)> = vec![];
    for name in view.sources() {
        let s = by_name.get(name).ok_or_else(|| {
            Error::layout(
                &dst.name,
                format!("is a view of `{name}`, which the source does not hold"),
            )
        })?;
        if let Some((first, f)) = srcs.first() {
            if f.dtype != s.dtype {
                return Err(Error::layout(
                    &dst.name,
                    format!(
                        "is a view of `{first}` ({}) and `{name}` ({}): its sources must share one dtype",
                        f.dtype, s.dtype
                    ),
                ));
            }
        }
        check_source(s, &dst.name, dst.dtype)?;
        srcs.push((name, s));
    }
    let shape_of = |n: &str| by_name.get(n).map(|t| t.shape.clone());
    let map = view.compile(&dst.name, &shape_of)?;
    if map.shape != dst.shape {
        return Err(Error::layout(
            &dst.name,
            format!(
                "its view has shape {:?}, the target {:?}",
                map.shape, dst.shape
            ),
        ));
    }
    if whole {
        dst.validate()?;
    }
    for part in &map.parts {
        match &part.from {
            PartFrom::Source { name, .. } => {
                let src = by_name[name.as_str()];
                fill_part(src, dst, part, ops);
            }
            PartFrom::Fill { value } => {
                let value = value
                    .bytes(dst.dtype)
                    .map_err(|e| Error::layout(&dst.name, e))?;
                pad_part(dst, part, &value, fills);
            }
        }
    }
    Ok(TensorPlan {
        name: dst.name.clone(),
        dtype: (srcs.first().map_or(dst.dtype, |s| s.1.dtype), dst.dtype),
        shape: dst.shape.clone(),
        pieces: (
            srcs.iter().map(|s| s.1.pieces.len()).sum(),
            dst.pieces.len(),
        ),
        ops: 0,
        bytes: (0, 0),
        view: (!matches!(view, View::Source { name } if *name == dst.name)).then(|| view.clone()),
    })
}

/// `pieces` (of a tensor of `dtype`) as pieces of `part`'s axis space: each piece's boxes
/// there, where its bytes are, with the strides of the axes. Indices are kept where the part
/// has axes (so that an identity view spreads reads over replicas as [`plan()`] does): a
/// piece with no element in the part is one empty box. `source` picks the side: the part's source, or
/// the target.
fn part_pieces(part: &ViewPart, pieces: &[Piece], dtype: DType, source: bool) -> Vec<Piece> {
    let elem = dtype.size() as u64;
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        let boxes = match (p.region.is_empty(), source) {
            (true, _) => vec![],
            (false, true) => part.source_preimage(&p.region),
            (false, false) => part.target_preimage(&p.region),
        };
        let n = part.axes.len();
        if boxes.is_empty() && n > 0 {
            out.push(Piece {
                rank: p.rank,
                region: Region::new(vec![0; n], vec![0; n]),
                loc: p.loc.clone(),
            });
            continue;
        }
        let strides = p.strides();
        let x_strides: Vec<u64> = part
            .axes
            .iter()
            .map(|a| match source {
                true => a.src_stride * strides[a.src_dim],
                false => a.stride * strides[a.dim],
            })
            .collect();
        for b in boxes {
            let first = match source {
                true => part.source_index(&b),
                false => part.target_index(&b),
            };
            let elems: u64 = first
                .iter()
                .zip(&p.region.offsets)
                .zip(&strides)
                .map(|((i, o), s)| (i - o) * s)
                .sum();
            out.push(Piece {
                rank: p.rank,
                region: b,
                loc: Loc {
                    file: p.loc.file,
                    offset: p.loc.offset + elems * elem,
                    strides: Some(x_strides.clone()),
                    pending: None,
                },
            });
        }
    }
    out
}

/// Append to `ops` the copies of `part` of `dst`'s view from `src`: both sides' pieces
/// mapped into the part's axis space and copied by [`fill`] there.
fn fill_part(src: &TensorLayout, dst: &TensorLayout, part: &ViewPart, ops: &mut Vec<CopyOp>) {
    let shape: Vec<u64> = part.axes.iter().map(|a| a.size).collect();
    let x_src = TensorLayout {
        name: src.name.clone(),
        dtype: src.dtype,
        pieces: part_pieces(part, &src.pieces, src.dtype, true),
        shape,
    };
    let x_dst = part_pieces(part, &dst.pieces, dst.dtype, false);
    fill(&x_src, &x_dst, dst.dtype, ops);
}

/// Append to `fills` the fills of `part` (a fill part of `dst`'s view) in `dst`'s pieces.
fn pad_part(dst: &TensorLayout, part: &ViewPart, value: &[u8], fills: &mut Vec<FillOp>) {
    let elem = dst.dtype.size() as u64;
    for p in part_pieces(part, &dst.pieces, dst.dtype, false) {
        if p.region.is_empty() {
            continue;
        }
        let strides = p.strides();
        let d = Strided {
            region: &p.region,
            base: p.loc.offset,
            strides: &strides,
            elem,
        };
        for_each_run(&p.region, &d, &d, |r| {
            fills.push(FillOp {
                dst: p.loc.file,
                dst_offset: r.dst,
                len: r.elems * elem,
                count: r.count,
                dst_stride: r.dst_stride,
                value: value.to_vec(),
            })
        });
    }
}

/// Append to `ops` the copies that fill every piece of `dst` from `src`.
pub fn plan_tensor(src: &TensorLayout, dst: &TensorLayout, ops: &mut Vec<CopyOp>) -> Result<()> {
    plan_tensor_scaled(src, dst, None, ops)
}

/// [`plan_tensor`], dequantizing an `F8_E4M3` source with `scale` (its [`BlockScale`]) into
/// the target's floating dtype when one is given.
fn plan_tensor_scaled(
    src: &TensorLayout,
    dst: &TensorLayout,
    scale: Option<&BlockScale>,
    ops: &mut Vec<CopyOp>,
) -> Result<()> {
    if src.shape != dst.shape {
        return Err(Error::layout(
            &dst.name,
            format!(
                "source shape {:?} differs from target shape {:?}",
                src.shape, dst.shape
            ),
        ));
    }
    if scale.is_some() && (src.dtype != DType::F8E4M3 || !dst.dtype.is_castable_float()) {
        return Err(Error::layout(
            &dst.name,
            format!(
                "cannot dequantize {} to {} (only F8_E4M3 to f16, bf16, f32, f64)",
                src.dtype, dst.dtype
            ),
        ));
    }
    check_source(
        src,
        &dst.name,
        if scale.is_some() {
            src.dtype
        } else {
            dst.dtype
        },
    )?;
    src.validate()?;
    dst.validate()?;
    let first = ops.len();
    fill(src, &dst.pieces, dst.dtype, ops);
    if let Some(bs) = scale {
        for o in &mut ops[first..] {
            if let Some(c) = &mut o.cast {
                c.scale = Some(*bs);
            }
        }
    }
    Ok(())
}

/// Append to `ops` the copies that fill `pieces` (regions of `src`'s tensor, stored as
/// `dtype`) from `src`, which must be valid. Each piece is filled wholly, even when several
/// pieces hold the same region; the pieces need not cover the tensor.
pub fn fill(src: &TensorLayout, pieces: &[Piece], dtype: DType, ops: &mut Vec<CopyOp>) {
    let cast = (src.dtype != dtype).then_some(Cast {
        from: src.dtype,
        to: dtype,
        scale: None,
    });
    let (es, ed) = (src.dtype.size() as u64, dtype.size() as u64);
    debug_assert!(
        src.pieces.iter().all(|p| p.loc.pending.is_none()),
        "fill from pieces not yet located"
    );

    // Group source replicas by region.
    let groups_regions = distinct_regions(src.pieces.iter().map(|p| &p.region));
    let replicas: Vec<Vec<usize>> = if groups_regions.len() == src.pieces.len() {
        // Every piece non-empty and distinct: piece i is group i.
        vec![]
    } else {
        let index: HashMap<&Region, usize> = groups_regions
            .iter()
            .enumerate()
            .map(|(i, r)| (*r, i))
            .collect();
        let mut replicas: Vec<Vec<usize>> = vec![vec![]; groups_regions.len()];
        for (i, p) in src.pieces.iter().enumerate() {
            if let Some(&g) = index.get(&p.region) {
                replicas[g].push(i);
            }
        }
        replicas
    };
    let dst_regions: Vec<&Region> = pieces.iter().map(|p| &p.region).collect();

    let mut pairs = vec![];
    join(&groups_regions, &dst_regions, |g, j| pairs.push((j, g)));
    pairs.sort_unstable();
    for (j, g) in pairs {
        let b = groups_regions[g]
            .intersect(dst_regions[j])
            .expect("join yields intersecting pairs");
        let si = match replicas.get(g) {
            Some(reps) => reps[(j + g) % reps.len()],
            None => g,
        };
        let sp = &src.pieces[si];
        let dp = &pieces[j];
        let (src_strides, dst_strides) = (sp.strides(), dp.strides());
        let s = Strided {
            region: &sp.region,
            base: sp.loc.offset,
            strides: &src_strides,
            elem: es,
        };
        let d = Strided {
            region: &dp.region,
            base: dp.loc.offset,
            strides: &dst_strides,
            elem: ed,
        };
        for_each_run(&b, &s, &d, |r| {
            ops.push(CopyOp {
                src: sp.loc.file,
                src_offset: r.src,
                dst: dp.loc.file,
                dst_offset: r.dst,
                len: r.elems * es,
                count: r.count,
                src_stride: r.src_stride,
                dst_stride: r.dst_stride,
                cast,
            })
        });
    }
}

/// The copy ops that read `region` of tensor `t` (which must be valid, and `region` within
/// its shape) into a row-major buffer of `dtype` elements starting at byte 0 (destination
/// file 0), cast from `t.dtype` where it differs. The buffer holds
/// `region.volume() * dtype.size()` bytes.
pub fn region_ops(t: &TensorLayout, region: &Region, dtype: DType) -> Vec<CopyOp> {
    let piece = Piece {
        rank: 0,
        region: region.clone(),
        loc: Loc {
            file: 0,
            offset: 0,
            strides: None,
            pending: None,
        },
    };
    let mut ops = vec![];
    fill(t, std::slice::from_ref(&piece), dtype, &mut ops);
    ops
}

/// Sort ops by destination and merge neighbours that continue each other on both sides.
pub fn coalesce(mut ops: Vec<CopyOp>) -> Vec<CopyOp> {
    ops.sort_unstable_by_key(|o| (o.dst, o.dst_offset));
    // In place: `last` is the op kept before `o`.
    ops.dedup_by(|o, last| {
        let continues = last.count == 1
            && o.count == 1
            && last.src == o.src
            && last.dst == o.dst
            && last.cast == o.cast
            && last.src_offset + last.len == o.src_offset
            && last.dst_offset + last.dst_len() == o.dst_offset;
        if continues {
            last.len += o.len;
        }
        continues
    });
    ops
}

/// Sort fills by destination and merge neighbours of one value that continue each other.
pub fn coalesce_fills(mut fills: Vec<FillOp>) -> Vec<FillOp> {
    fills.sort_unstable_by_key(|o| (o.dst, o.dst_offset));
    fills.dedup_by(|o, last| {
        let continues = last.count == 1
            && o.count == 1
            && last.dst == o.dst
            && last.value == o.value
            && last.dst_offset + last.len == o.dst_offset;
        if continues {
            last.len += o.len;
        }
        continues
    });
    fills
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Sharding;

    /// A layout where rank r's pieces are stored row-major, back to back, in file r.
    fn sharded(name: &str, dtype: DType, shape: &[u64], s: &Sharding) -> TensorLayout {
        let mut pieces = vec![];
        for r in 0..s.mesh.world() {
            let mut off = 0;
            for region in s.rank_regions(shape, r) {
                let n = region.volume() * dtype.size() as u64;
                pieces.push(Piece {
                    rank: r as u32,
                    region,
                    loc: Loc {
                        file: r as u32,
                        offset: off,
                        strides: None,
                        pending: None,
                    },
                });
                off += n;
            }
        }
        TensorLayout {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            pieces,
        }
    }

    #[test]
    fn dim0_consolidation_is_one_op_per_piece_and_coalesces_within_a_file() {
        let src = sharded("w", DType::F32, &[10, 12], &Sharding::fsdp(4));
        let dst = sharded("w", DType::F32, &[10, 12], &Sharding::fsdp(1));
        let p = plan(&[src], &[dst]).unwrap();
        assert_eq!(p.ops.len(), 4);
        assert_eq!(p.bytes_read(), 480);
        assert_eq!(p.bytes_written(), 480);
        assert_eq!(p.tensors[0].ops, 4);
        assert!(p.ops.iter().all(|o| o.count == 1));
    }

    #[test]
    fn replicas_are_read_once() {
        let s = Sharding {
            mesh: crate::layout::Mesh(vec![2, 2]),
            placements: vec!["S(0)".parse().unwrap(), "R".parse().unwrap()],
        };
        let src = sharded("w", DType::BF16, &[7, 3], &s);
        let dst = sharded("w", DType::BF16, &[7, 3], &Sharding::fsdp(3));
        let p = plan(&[src], &[dst]).unwrap();
        assert_eq!(p.bytes_read(), 7 * 3 * 2);
    }

    #[test]
    fn column_shards_become_strided_ops_and_casts_convert_sizes() {
        let s1 = Sharding {
            mesh: crate::layout::Mesh(vec![4]),
            placements: vec![crate::layout::Placement::Shard(1)],
        };
        let src = sharded("w", DType::BF16, &[6, 8], &s1);
        let mut dst = sharded("w", DType::F32, &[6, 8], &Sharding::fsdp(1));
        let p = plan(std::slice::from_ref(&src), std::slice::from_ref(&dst)).unwrap();
        assert_eq!(p.ops.len(), 4);
        assert!(p
            .ops
            .iter()
            .all(|o| o.count == 6 && o.len == 4 && o.dst_len() == 8 && o.dst_stride == 32));
        assert_eq!(p.bytes_written(), 6 * 8 * 4);
        dst.dtype = DType::I32;
        let e = plan(&[src], &[dst]).unwrap_err().to_string();
        assert!(e.contains("cannot convert BF16 to I32"), "{e}");
    }

    #[test]
    fn region_ops_read_a_region_row_major_into_a_buffer() {
        // Column shards over 2 ranks of a 4 x 6 f32 tensor; rows 1..3, columns 2..5 span
        // both shards.
        let s = Sharding {
            mesh: crate::layout::Mesh(vec![2]),
            placements: vec![crate::layout::Placement::Shard(1)],
        };
        let t = sharded("w", DType::F32, &[4, 6], &s);
        let region = Region {
            offsets: [1, 2].into(),
            sizes: [2, 3].into(),
        };
        let ops = region_ops(&t, &region, DType::F32);
        assert!(ops.iter().all(|o| o.dst == 0 && o.cast.is_none()));
        // Every buffer byte is written once, in row-major order of the region.
        let mut seen = [0u8; 2 * 3 * 4];
        for o in &ops {
            for r in 0..o.count {
                let d = (o.dst_offset + r * o.dst_stride) as usize;
                for b in &mut seen[d..d + o.dst_len() as usize] {
                    *b += 1;
                }
            }
        }
        assert!(seen.iter().all(|&b| b == 1));
        // Element (1, 2), the buffer's first, is rank 0's local (1, 2) of a 4 x 3 piece:
        // file 0, element 1 * 3 + 2; its column runs down both rows of the region.
        let first = ops.iter().find(|o| o.dst_offset == 0).unwrap();
        assert_eq!(
            (first.src, first.src_offset, first.len, first.count),
            (0, (3 + 2) * 4, 4, 2)
        );
        // Cast to bf16: the same elements, half the destination bytes.
        let cast = region_ops(&t, &region, DType::BF16);
        assert_eq!(cast.len(), ops.len());
        assert_eq!(
            cast.iter().map(CopyOp::bytes_written).sum::<u64>(),
            2 * 3 * 2
        );
        assert!(cast.iter().all(|o| o.cast.is_some()));
    }

    #[test]
    fn block_scales_are_found_and_name_the_rows_an_op_needs() {
        let whole = |name: &str, dtype: DType, shape: &[u64], offset: u64| TensorLayout {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            pieces: vec![Piece {
                rank: 0,
                region: Region::full(shape),
                loc: Loc {
                    file: 0,
                    offset,
                    strides: None,
                    pending: None,
                },
            }],
        };
        let w = whole("w", DType::F8E4M3, &[300, 200], 1000);
        let s = whole("w_scale_inv", DType::F32, &[3, 2], 64);
        let bs = BlockScale::of(&w, &s, [128, 128]).unwrap();
        assert_eq!(
            (bs.base, bs.offset, bs.cols, bs.block_cols()),
            (1000, 64, 200, 2)
        );
        // rows 127..=128 of the weight: block rows 0 and 1, two scales each
        let o = CopyOp {
            src: 0,
            src_offset: 1000 + 127 * 200,
            dst: 0,
            dst_offset: 0,
            len: 400,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
            cast: Some(Cast {
                from: DType::F8E4M3,
                to: DType::BF16,
                scale: Some(bs),
            }),
        };
        assert_eq!(bs.span(&o), (64, 64 + 16));
        assert_eq!(bs.block_rows(1, 1000 + 299 * 200, 1000 + 300 * 200), (2, 3));
        let bad = whole("w_scale_inv", DType::F32, &[2, 2], 64);
        let e = BlockScale::of(&w, &bad, [128, 128]).unwrap_err();
        assert!(e.contains("[3, 2]"), "{e}");
        let f16 = whole("w_scale_inv", DType::F16, &[3, 2], 64);
        assert!(BlockScale::of(&w, &f16, [128, 128])
            .unwrap_err()
            .contains("not F32"));
    }

    #[test]
    fn missing_source_tensor_is_an_error() {
        let dst = sharded("x", DType::F32, &[2], &Sharding::fsdp(1));
        assert!(plan(&[], &[dst]).is_err());
    }
}
