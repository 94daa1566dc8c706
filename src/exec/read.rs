//! Reading regions into the caller's buffers: mapping sources, and performing copy ops
//! (with their casts) into memory — what the loader, the tie finder and
//! `Checkpoint::read_region` use, and what the executor's windows assemble with.

use crate::error::{Error, Result};
use crate::layout::cast;
use crate::layout::{DType, Region, TensorLayout};
use crate::plan::{region_ops, CopyOp};
use crate::sys::map_readonly;
use memmap2::Mmap;
use std::path::PathBuf;

/// Map `sources` read-only.
pub fn map_sources(sources: &[PathBuf]) -> Result<Vec<Mmap>> {
    map_sources_with(sources, memmap2::Advice::Sequential)
}

/// Map `sources` read-only with an access-pattern hint.
fn map_sources_with(sources: &[PathBuf], advice: memmap2::Advice) -> Result<Vec<Mmap>> {
    sources.iter().map(|p| map_readonly(p, advice)).collect()
}

/// Perform `o` into `buf`, which holds destination bytes from offset `lo` on.
pub(super) fn apply(o: &CopyOp, srcs: &[Mmap], buf: &mut [u8], lo: u64) {
    let dl = o.dst_len() as usize;
    for r in 0..o.count {
        let s = (o.src_offset + r * o.src_stride) as usize;
        let src = &srcs[o.src as usize][s..s + o.len as usize];
        let a = (o.dst_offset + r * o.dst_stride - lo) as usize;
        let out = &mut buf[a..a + dl];
        match o.cast {
            None => out.copy_from_slice(src),
            Some(c) => cast::convert(c.from, c.to, src, out),
        }
    }
}

/// Run `ops` whose destination is a single buffer `out` (destination file index ignored,
/// offsets relative to `out`), reading `sources`. For reading a region into memory.
pub fn read_into(ops: &[CopyOp], sources: &[PathBuf], out: &mut [u8]) -> Result<()> {
    let maps = map_sources_with(sources, memmap2::Advice::Random)?;
    read_with(ops, sources, &maps, out)
}

/// Like [`read_into`] for several buffers at once, mapping the sources once: `jobs[i]` fills
/// `outs[i]`. Sources are advised for random access, so only the pages the ops touch (and
/// the kernel's fault-around) are read.
pub fn read_many_into(
    jobs: &[Vec<CopyOp>],
    sources: &[PathBuf],
    outs: &mut [&mut [u8]],
) -> Result<()> {
    let maps = map_sources_with(sources, memmap2::Advice::Random)?;
    for (ops, out) in jobs.iter().zip(outs.iter_mut()) {
        read_with(ops, sources, &maps, out)?;
    }
    Ok(())
}

/// Read each `(tensor, region, dtype)` of `want` from `sources` (the files the tensors'
/// pieces name) into a buffer of its own, row-major, cast to `dtype` where it differs
/// ([`region_ops`]), mapping the sources once.
pub fn read_regions(
    sources: &[PathBuf],
    want: &[(&TensorLayout, &Region, DType)],
) -> Result<Vec<Vec<u8>>> {
    let mut outs: Vec<Vec<u8>> = want
        .iter()
        .map(|(_, region, dtype)| vec![0u8; (region.volume() * dtype.size() as u64) as usize])
        .collect();
    let mut slices: Vec<&mut [u8]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    read_regions_into(sources, want, &mut slices)?;
    Ok(outs)
}

/// [`read_regions`] into the caller's buffers, one per entry of `want`, each exactly the
/// size of its region in its dtype.
pub fn read_regions_into(
    sources: &[PathBuf],
    want: &[(&TensorLayout, &Region, DType)],
    outs: &mut [&mut [u8]],
) -> Result<()> {
    let jobs: Vec<Vec<CopyOp>> = want
        .iter()
        .map(|&(t, region, dtype)| region_ops(t, region, dtype))
        .collect();
    read_many_into(&jobs, sources, outs)
}

/// Perform `ops` into `out` from the mapped `sources`, checking each op against the
/// source's length and the buffer's first.
fn read_with(ops: &[CopyOp], sources: &[PathBuf], maps: &[Mmap], out: &mut [u8]) -> Result<()> {
    for o in ops {
        let m = maps
            .get(o.src as usize)
            .ok_or_else(|| Error::usage("copy op names an unknown source"))?;
        let (_, b) = o.src_span();
        if b > m.len() as u64 {
            return Err(Error::format(
                &sources[o.src as usize],
                format!(
                    "is truncated: bytes up to {b} are needed, the file has {}",
                    m.len()
                ),
            ));
        }
        if o.dst_span().1 > out.len() as u64 {
            return Err(Error::usage("copy op past the end of the buffer"));
        }
        apply(o, maps, out, 0);
    }
    Ok(())
}
