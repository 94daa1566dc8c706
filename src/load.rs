//! The trainer-side loader: what rank `r` of a job at world size `M` needs, read straight
//! from the checkpoint's files with no process group — each rank independently, touching
//! only the bytes of its own shards.

use crate::error::{Error, Result};
use crate::exec::read_many;
use crate::formats::Checkpoint;
use crate::layout::{DType, Loc, Piece, Region};
use crate::plan::fill;
use crate::select::Selection;
use crate::target::LayoutSpec;

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

/// The local shards rank `rank` holds under `layout`, for the tensors `select` keeps, cast to
/// `dtype` where given (floating tensors only). A rank may hold several regions of a tensor
/// (`StridedShard`, flat layouts) or none; empty regions are left out.
pub fn local_shards(
    ck: &Checkpoint,
    layout: &LayoutSpec,
    rank: u64,
    select: &Selection,
    dtype: Option<DType>,
) -> Result<Vec<LocalShard>> {
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
    let mut shards = vec![];
    let mut jobs = vec![];
    for (src, tt) in chosen.iter().zip(&target) {
        for region in tt.ranks[rank as usize].iter().filter(|g| !g.is_empty()) {
            let piece = Piece {
                rank: rank as u32,
                region: region.clone(),
                loc: Loc {
                    file: 0,
                    offset: 0,
                    strides: None,
                },
            };
            let mut ops = vec![];
            fill(src, std::slice::from_ref(&piece), tt.dtype, &mut ops);
            jobs.push(ops);
            shards.push(LocalShard {
                name: tt.name.clone(),
                dtype: tt.dtype,
                global_shape: tt.shape.clone(),
                region: region.clone(),
                data: vec![],
            });
        }
    }
    let mut outs: Vec<Vec<u8>> = shards
        .iter()
        .map(|s| vec![0u8; s.region.volume() as usize * s.dtype.size()])
        .collect();
    read_many(&jobs, &ck.files, &mut outs)?;
    for (s, d) in shards.iter_mut().zip(outs) {
        s.data = d;
    }
    Ok(shards)
}
