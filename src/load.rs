//! The trainer-side loader: what rank `r` of a job at world size `M` needs, read straight
//! from the checkpoint's files with no process group — each rank independently, touching
//! only the bytes of its own shards.

use crate::error::{Error, Result};
use crate::exec::read_regions;
use crate::formats::Checkpoint;
use crate::layout::{DType, Region};
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
    let mut want = vec![];
    for (src, tt) in chosen.iter().zip(&target) {
        for region in tt.ranks[rank as usize].iter().filter(|g| !g.is_empty()) {
            want.push((*src, region, tt.dtype));
            shards.push(LocalShard {
                name: tt.name.clone(),
                dtype: tt.dtype,
                global_shape: tt.shape.clone(),
                region: region.clone(),
                data: vec![],
            });
        }
    }
    for (s, d) in shards.iter_mut().zip(read_regions(&ck.files, &want)?) {
        s.data = d;
    }
    Ok(shards)
}
