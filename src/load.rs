//! The trainer-side loader: what rank `r` of a job at world size `M` needs, read straight
//! from the checkpoint's files with no process group — each rank independently, touching
//! only the bytes of its own shards.

use crate::checkpoint::check_buffer;
use crate::error::{Error, Result};
use crate::exec::{read_many_into_counted, read_regions_into};
use crate::formats::Checkpoint;
use crate::layout::{row_major_strides, DType, Loc, Piece, Region, Sharding, TensorLayout, View};
use crate::plan::{CopyOp, FillOp};
use crate::select::Selection;
use crate::target::LayoutSpec;
use rayon::prelude::*;
use std::sync::atomic::AtomicU64;

/// One region of one tensor held by the loading rank, without its bytes: what
/// [`local_regions`] finds and [`local_shards_into`] reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRegion {
    /// Tensor name (flat key).
    pub name: String,
    /// Element type the bytes are read as.
    pub dtype: DType,
    /// The tensor's global shape.
    pub global_shape: Vec<u64>,
    /// The region of the global tensor this rank holds.
    pub region: Region,
}

impl LocalRegion {
    /// Bytes of the region in its dtype: the size of the buffer it is read into.
    pub fn nbytes(&self) -> u64 {
        self.region.volume() * self.dtype.size() as u64
    }
}

/// One region of one tensor held by the loading rank, with its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalShard {
    /// Tensor name (flat key).
    pub name: String,
    /// Element type of `data`.
    pub dtype: DType,
    /// The tensor's global shape.
    pub global_shape: Vec<u64>,
    /// The region of the global tensor this shard holds.
    pub region: Region,
    /// Row-major little-endian bytes of the region.
    pub data: Vec<u8>,
}

/// The regions rank `rank` holds under `layout`, for the tensors `select` keeps, as `dtype`
/// where given (floating tensors only). A rank may hold several regions of a tensor
/// (`StridedShard`, flat layouts) or none; empty regions are left out. Reads no tensor data.
pub fn local_regions(
    ck: &Checkpoint,
    layout: &LayoutSpec,
    rank: u64,
    select: &Selection,
    dtype: Option<DType>,
) -> Result<Vec<LocalRegion>> {
    let world = layout.world();
    if rank >= world {
        return Err(Error::usage(format!(
            "rank {rank} is outside a world of {world}"
        )));
    }
    let chosen = select.apply(ck)?;
    let wanted: Vec<(String, DType, Vec<u64>)> = chosen
        .iter()
        .map(|t| {
            let d = match dtype {
                Some(d) if t.dtype.is_castable_float() => d,
                _ => t.dtype,
            };
            (t.name.clone(), d, t.shape.clone())
        })
        .collect();
    let target = layout.compile(&wanted)?;
    let mut out = vec![];
    for tt in &target {
        for region in tt.ranks[rank as usize].iter().filter(|g| !g.is_empty()) {
            out.push(LocalRegion {
                name: tt.name.clone(),
                dtype: tt.dtype,
                global_shape: tt.shape.clone(),
                region: region.clone(),
            });
        }
    }
    Ok(out)
}

/// Read `regions` (from [`local_regions`] on `ck`) into the caller's buffers, one each of
/// exactly [`LocalRegion::nbytes`] bytes (e.g. the memory of the tensors to fill).
pub fn local_shards_into(
    ck: &Checkpoint,
    regions: &[LocalRegion],
    outs: &mut [&mut [u8]],
) -> Result<()> {
    if regions.len() != outs.len() {
        return Err(Error::usage(format!(
            "{} regions but {} buffers",
            regions.len(),
            outs.len()
        )));
    }
    let mut tensors = Vec::with_capacity(regions.len());
    for (r, out) in regions.iter().zip(outs.iter()) {
        tensors.push(ck.checked(&r.name, &r.region, Some(r.dtype))?);
        check_buffer(&r.name, &r.region, r.dtype, out.len())?;
    }
    // Of a lazily opened checkpoint, the item headers of the pieces overlapping the regions
    // are read now, all in one pass.
    let each: Vec<[&Region; 1]> = regions.iter().map(|r| [&r.region]).collect();
    let want: Vec<_> = tensors
        .iter()
        .zip(&each)
        .map(|(t, r)| (*t, Some(&r[..])))
        .collect();
    let located = ck.located_many(&want)?;
    let want: Vec<_> = located
        .iter()
        .zip(regions)
        .map(|(t, r)| (&**t, &r.region, r.dtype))
        .collect();
    read_regions_into(ck.sources(), &want, outs)
}

/// The local shards rank `rank` holds under `layout`, with their bytes: [`local_regions`]
/// read into new buffers.
pub fn local_shards(
    ck: &Checkpoint,
    layout: &LayoutSpec,
    rank: u64,
    select: &Selection,
    dtype: Option<DType>,
) -> Result<Vec<LocalShard>> {
    let regions = local_regions(ck, layout, rank, select, dtype)?;
    let mut data: Vec<Vec<u8>> = regions
        .iter()
        .map(|r| vec![0u8; r.nbytes() as usize])
        .collect();
    let mut outs: Vec<&mut [u8]> = data.iter_mut().map(Vec::as_mut_slice).collect();
    local_shards_into(ck, &regions, &mut outs)?;
    Ok(regions
        .into_iter()
        .zip(data)
        .map(|(r, data)| LocalShard {
            name: r.name,
            dtype: r.dtype,
            global_shape: r.global_shape,
            region: r.region,
            data,
        })
        .collect())
}

/// One global region of a checkpoint tensor and where it sits in a [`LocalTensor`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalPart {
    /// The region of the global tensor.
    pub region: Region,
    /// Its first element's index in the local tensor (per dimension).
    pub at: Vec<u64>,
}

/// A destination tensor in the caller's memory made of regions of one checkpoint tensor:
/// a DTensor's `to_local()`, a `ShardedTensor`'s local shard, or a whole tensor. Its bytes
/// are row-major in `dtype`; [`read_local_tensors_into`] fills them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalTensor {
    /// The checkpoint tensor's name.
    pub name: String,
    /// Element type of the destination (a cast when it differs from the checkpoint's).
    pub dtype: DType,
    /// The destination's shape.
    pub shape: Vec<u64>,
    /// What it is made of.
    pub parts: Vec<LocalPart>,
}

impl LocalTensor {
    /// The whole tensor `name` of `shape`.
    pub fn whole(name: impl Into<String>, dtype: DType, shape: &[u64]) -> Self {
        Self::region(name, dtype, Region::full(shape))
    }

    /// One region of tensor `name` as a tensor of its own (a `ShardedTensor` shard).
    pub fn region(name: impl Into<String>, dtype: DType, region: Region) -> Self {
        LocalTensor {
            name: name.into(),
            dtype,
            shape: region.sizes.to_vec(),
            parts: vec![LocalPart {
                at: vec![0; region.ndim()],
                region,
            }],
        }
    }

    /// What the rank at `coordinate` of `sharding`'s mesh holds of tensor `name` of
    /// `global_shape`: DTensor's local tensor under those placements (uneven and empty
    /// shards as `torch.chunk` gives them; several parts under `StridedShard`).
    pub fn of_sharding(
        name: impl Into<String>,
        dtype: DType,
        global_shape: &[u64],
        sharding: &Sharding,
        coordinate: &[u64],
    ) -> Result<Self> {
        let name = name.into();
        sharding
            .check(global_shape.len())
            .map_err(|e| Error::layout(&name, e.to_string()))?;
        let mesh = &sharding.mesh.0;
        if coordinate.len() != mesh.len() || coordinate.iter().zip(mesh).any(|(c, m)| c >= m) {
            return Err(Error::layout(
                &name,
                format!("mesh coordinate {coordinate:?} is outside the mesh {mesh:?}"),
            ));
        }
        let rank = coordinate.iter().zip(mesh).fold(0, |r, (c, m)| r * m + c);
        let segs = sharding.rank_segments(global_shape, rank);
        let shape: Vec<u64> = segs.iter().map(|d| d.iter().map(|s| s.1).sum()).collect();
        let mut parts = vec![LocalPart {
            region: Region::new(vec![], vec![]),
            at: vec![],
        }];
        for d in &segs {
            let mut next = Vec::with_capacity(parts.len() * d.len());
            for p in &parts {
                let mut at = 0;
                for &(start, len) in d {
                    let mut q = p.clone();
                    q.region.offsets.push(start);
                    q.region.sizes.push(len);
                    q.at.push(at);
                    at += len;
                    next.push(q);
                }
            }
            parts = next;
        }
        parts.retain(|p| !p.region.is_empty());
        Ok(LocalTensor {
            name,
            dtype,
            shape,
            parts,
        })
    }

    /// Bytes of the destination: the size of the buffer it is read into.
    pub fn nbytes(&self) -> u64 {
        self.shape
            .iter()
            .fold(self.dtype.size() as u64, |n, &d| n.saturating_mul(d))
    }
}

/// Fill each of `tensors` from `ck` into the caller's buffer of the same index, exactly
/// [`LocalTensor::nbytes`] long (e.g. a torch tensor's memory). Everything is checked before
/// a byte is written; the copies run in parallel on the current rayon pool.
pub fn read_local_tensors_into(
    ck: &Checkpoint,
    tensors: &[LocalTensor],
    outs: &mut [&mut [u8]],
) -> Result<()> {
    read_local_tensors_into_counted(ck, tensors, outs, None)
}

/// [`read_local_tensors_into`], adding the bytes written to `done` as the copies complete
/// (progress for a caller polling it from another thread).
pub fn read_local_tensors_into_counted(
    ck: &Checkpoint,
    tensors: &[LocalTensor],
    outs: &mut [&mut [u8]],
    done: Option<&AtomicU64>,
) -> Result<()> {
    if tensors.len() != outs.len() {
        return Err(Error::usage(format!(
            "{} tensors but {} buffers",
            tensors.len(),
            outs.len()
        )));
    }
    check_buffers(tensors, outs)?;
    let prepared: Vec<(Option<&TensorLayout>, Vec<Piece>)> = tensors
        .iter()
        .map(|lt| local_pieces(ck, lt))
        .collect::<Result<_>>()?;
    // Of a lazily opened checkpoint, the item headers of the pieces overlapping the parts
    // are read now, all in one pass.
    let parts: Vec<Vec<&Region>> = tensors
        .iter()
        .map(|lt| lt.parts.iter().map(|p| &p.region).collect())
        .collect();
    let want: Vec<_> = prepared
        .iter()
        .zip(&parts)
        .filter_map(|((t, _), regions)| Some(((*t)?, Some(&regions[..]))))
        .collect();
    let mut located = ck.located_many(&want)?.into_iter();
    let located: Vec<_> = prepared
        .iter()
        .map(|(t, _)| t.map(|_| located.next().expect("one layout per tensor with parts")))
        .collect();
    // One job per destination, made in parallel.
    let jobs: Vec<Vec<CopyOp>> = prepared
        .par_iter()
        .zip(&located)
        .zip(tensors)
        .map(|(((_, pieces), t), lt)| {
            let mut ops = vec![];
            if let Some(t) = t {
                crate::plan::fill(t, pieces, lt.dtype, &mut ops);
            }
            ops
        })
        .collect();
    read_many_into_counted(&jobs, ck.sources(), outs, done)
}

/// Fill each of `tensors` into the caller's buffer of the same index, as
/// [`read_local_tensors_into`] does, where tensor `i` is not one of `ck`'s but the target
/// `views[i]` defines of them (a recipe's: `q_proj` out of a fused QKV, a vocabulary without
/// its padding): its parts are regions of that target, read through the view from the
/// source pieces, with no tensor materialised. Everything is checked before a byte is
/// written.
pub fn read_view_tensors_into(
    ck: &Checkpoint,
    tensors: &[LocalTensor],
    views: &[&View],
    outs: &mut [&mut [u8]],
) -> Result<()> {
    read_view_tensors_into_counted(ck, tensors, views, outs, None)
}

/// [`read_view_tensors_into`], adding the bytes copied to `done` as the copies complete
/// (fills, which write no source bytes, are not counted).
pub fn read_view_tensors_into_counted(
    ck: &Checkpoint,
    tensors: &[LocalTensor],
    views: &[&View],
    outs: &mut [&mut [u8]],
    done: Option<&AtomicU64>,
) -> Result<()> {
    if tensors.len() != outs.len() || tensors.len() != views.len() {
        return Err(Error::usage(format!(
            "{} tensors, {} views and {} buffers",
            tensors.len(),
            views.len(),
            outs.len()
        )));
    }
    check_buffers(tensors, outs)?;
    // the sources the views read, located whole and validated once
    let mut names: Vec<&str> = views.iter().flat_map(|v| v.sources()).collect();
    names.sort_unstable();
    names.dedup();
    let wanted = names
        .iter()
        .map(|n| {
            ck.tensor(n)
                .map(|t| (t, None))
                .ok_or_else(|| Error::layout(*n, format!("is not in {}", ck.path.display())))
        })
        .collect::<Result<Vec<_>>>()?;
    let located = ck.located_many(&wanted)?;
    for t in &located {
        t.validate()?;
    }
    let by_name: std::collections::HashMap<&str, &TensorLayout> = names
        .iter()
        .copied()
        .zip(located.iter().map(|t| t.as_ref()))
        .collect();
    let shape_of = |n: &str| by_name.get(n).map(|t| t.shape.clone());
    let planned: Vec<(Vec<CopyOp>, Vec<FillOp>)> = tensors
        .par_iter()
        .zip(views)
        .map(|(lt, view)| {
            let shape = view.shape(&lt.name, &shape_of)?;
            let dst = TensorLayout {
                name: lt.name.clone(),
                dtype: lt.dtype,
                shape: shape.clone(),
                pieces: buffer_pieces(lt, &shape)?,
            };
            let (mut ops, mut fills) = (vec![], vec![]);
            crate::plan::plan_view_pieces(&by_name, &dst, view, &mut ops, &mut fills)?;
            Ok((ops, fills))
        })
        .collect::<Result<_>>()?;
    let (jobs, fills): (Vec<Vec<CopyOp>>, Vec<Vec<FillOp>>) = planned.into_iter().unzip();
    for (i, fs) in fills.iter().enumerate() {
        for f in fs {
            f.check(outs[i].len() as u64)
                .map_err(|m| Error::internal(format!("tensor `{}`: {m}", tensors[i].name)))?;
        }
    }
    read_many_into_counted(&jobs, ck.sources(), outs, done)?;
    // the padding (disjoint from the copies)
    for (out, fs) in outs.iter_mut().zip(&fills) {
        fs.iter().for_each(|f| f.write_into(out, 0));
    }
    Ok(())
}

/// Each buffer is exactly its tensor's [`LocalTensor::nbytes`].
fn check_buffers(tensors: &[LocalTensor], outs: &[&mut [u8]]) -> Result<()> {
    for (lt, out) in tensors.iter().zip(outs.iter()) {
        if out.len() as u64 != lt.nbytes() {
            return Err(Error::layout(
                &lt.name,
                format!(
                    "a local tensor {:?} of {} is {} bytes, the buffer {}",
                    lt.shape,
                    lt.dtype,
                    lt.nbytes(),
                    out.len()
                ),
            ));
        }
    }
    Ok(())
}

/// The parts of `lt` (regions of a tensor of `global` shape) as pieces of its buffer (file 0),
/// each checked to lie in the tensor and to fit the destination's shape.
fn buffer_pieces(lt: &LocalTensor, global: &[u64]) -> Result<Vec<Piece>> {
    let strides = row_major_strides(&lt.shape);
    lt.parts
        .iter()
        .map(|p| {
            let inside = p.region.ndim() == global.len()
                && (0..global.len())
                    .all(|d| p.region.offsets[d].saturating_add(p.region.sizes[d]) <= global[d]);
            let fits = p.at.len() == lt.shape.len()
                && (0..lt.shape.len())
                    .all(|d| p.at[d].saturating_add(p.region.sizes[d]) <= lt.shape[d]);
            if !inside || !fits {
                return Err(Error::layout(
                    &lt.name,
                    format!(
                        "part {} at {:?} does not fit a tensor {:?} in a local tensor {:?}",
                        p.region, p.at, global, lt.shape
                    ),
                ));
            }
            Ok(buffer_piece(lt, p, &strides))
        })
        .collect()
}

/// The tensor of `ck` the destination `lt` is filled from (`None` when it has no parts) and
/// its parts as pieces of its buffer (at offset 0), every part checked against the tensor and
/// the destination's shape.
fn local_pieces<'a>(
    ck: &'a Checkpoint,
    lt: &LocalTensor,
) -> Result<(Option<&'a TensorLayout>, Vec<Piece>)> {
    let mut pieces = Vec::with_capacity(lt.parts.len());
    let mut src = None;
    for p in &lt.parts {
        src = Some(ck.checked(&lt.name, &p.region, Some(lt.dtype))?);
        let fits = p.at.len() == lt.shape.len()
            && (0..lt.shape.len())
                .all(|d| p.at[d].saturating_add(p.region.sizes[d]) <= lt.shape[d]);
        if !fits {
            return Err(Error::layout(
                &lt.name,
                format!(
                    "part {} at {:?} does not fit a local tensor {:?}",
                    p.region, p.at, lt.shape
                ),
            ));
        }
        pieces.push(buffer_piece(lt, p, &row_major_strides(&lt.shape)));
    }
    Ok((src, pieces))
}

/// Part `p` of `lt` as a piece of its buffer (file 0), whose row-major `strides` are `lt`'s.
fn buffer_piece(lt: &LocalTensor, p: &LocalPart, strides: &[u64]) -> Piece {
    let first: u64 = p.at.iter().zip(strides).map(|(a, s)| a * s).sum();
    Piece {
        rank: 0,
        region: p.region.clone(),
        loc: Loc {
            file: 0,
            offset: first * lt.dtype.size() as u64,
            strides: Some(strides.to_vec()),
            pending: None,
        },
    }
}
