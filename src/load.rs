//! The trainer-side loader: what rank `r` of a job at world size `M` needs, read straight
//! from the checkpoint's files with no process group — each rank independently, touching
//! only the bytes of its own shards.

use crate::checkpoint::check_buffer;
use crate::error::{Error, Result};
use crate::exec::read_regions_into;
use crate::formats::Checkpoint;
use crate::layout::{DType, Region};
use crate::select::Selection;
use crate::target::LayoutSpec;

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
    let mut want = vec![];
    for (r, out) in regions.iter().zip(outs.iter()) {
        let t = ck.checked(&r.name, &r.region, Some(r.dtype))?;
        check_buffer(&r.name, &r.region, r.dtype, out.len())?;
        want.push((t, &r.region, r.dtype));
    }
    read_regions_into(&ck.files, &want, outs)
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
