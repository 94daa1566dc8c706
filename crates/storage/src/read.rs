//! Reading regions into the caller's buffers: mapping sources, and performing copy ops
//! (with their casts) into memory — what the loader, the tie finder and
//! `Checkpoint::read_region` use, and what the executor's windows assemble with.

use crate::error::{Error, IoContext, Result};
use crate::layout::cast;
use crate::layout::{DType, Region, TensorLayout};
use crate::plan::{region_ops, BlockScale, CopyOp};
use crate::sys::{map_readonly, release};
use crate::Sources;
use memmap2::Mmap;
use std::fs::File;
use std::os::unix::fs::FileExt;
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
pub fn apply(o: &CopyOp, srcs: &[Mmap], buf: &mut [u8], lo: u64) {
    // a dequantizing cast reads its scales from their own mapping (checked to hold them)
    let scales = o.cast.and_then(|c| c.scale).map(|bs| {
        let (_, b) = bs.span(o);
        let map = &srcs[bs.src as usize];
        (bs, &map[bs.offset as usize..b as usize], 0)
    });
    apply_from(o, &srcs[o.src as usize], 0, scales, buf, lo)
}

/// Perform `o` reading `src`, which holds its source's bytes from offset `base` on, into
/// `buf`, which holds destination bytes from offset `lo` on; a dequantizing cast multiplies by
/// `scales`: its [`BlockScale`], and the scale rows from the given block row on.
fn apply_from(
    o: &CopyOp,
    src: &[u8],
    base: u64,
    scales: Option<(BlockScale, &[u8], u64)>,
    buf: &mut [u8],
    lo: u64,
) {
    let dl = o.dst_len() as usize;
    for r in 0..o.count {
        let at = o.src_offset + r * o.src_stride;
        let s = (at - base) as usize;
        let src = &src[s..s + o.len as usize];
        let a = (o.dst_offset + r * o.dst_stride - lo) as usize;
        let out = &mut buf[a..a + dl];
        match (o.cast, scales) {
            (None, _) => out.copy_from_slice(src),
            (Some(c), Some((bs, rows, row0))) => {
                let s = cast::Scales {
                    scales: rows,
                    row0,
                    cols: bs.cols,
                    block: bs.block,
                };
                let first = (at - bs.base) / c.from.size() as u64;
                cast::dequantize(c.from, c.to, src, first, &s, out)
            }
            (Some(c), None) => cast::convert(c.from, c.to, src, out),
        }
    }
}

/// Run `ops` whose destination is a single buffer `out` (destination file index ignored,
/// offsets relative to `out`), reading `sources`. For reading a region into memory.
pub fn read_into(ops: &[CopyOp], sources: Sources, out: &mut [u8]) -> Result<()> {
    read_many_into(&[ops.to_vec()], sources, &mut [out])
}

/// Like [`read_into`] for several buffers at once, mapping the sources once: `jobs[i]` fills
/// `outs[i]`. Sources are advised for random access, so only the pages the ops touch (and
/// the kernel's fault-around) are read. The copies run in parallel on the current rayon
/// pool: large contiguous copies are cut into pieces of [`TASK_BYTES`], and a buffer is
/// carved into disjoint slices, one per task, when its ops' destinations do not interleave.
pub fn read_many_into(
    jobs: &[Vec<CopyOp>],
    sources: Sources,
    outs: &mut [&mut [u8]],
) -> Result<()> {
    read_many_into_counted(jobs, sources, outs, None)
}

/// [`read_many_into`], adding each copy's destination bytes to `done` as it completes (a
/// progress count another thread may read).
pub fn read_many_into_counted(
    jobs: &[Vec<CopyOp>],
    sources: Sources,
    outs: &mut [&mut [u8]],
    done: Option<&std::sync::atomic::AtomicU64>,
) -> Result<()> {
    use rayon::prelude::*;
    if jobs.len() != outs.len() {
        return Err(Error::usage("copy jobs and buffers differ in number"));
    }
    let maps = map_sources_with(sources.paths, memmap2::Advice::Random)?;
    for (ops, out) in jobs.iter().zip(outs.iter()) {
        check_ops(ops, sources.paths, &maps, out.len() as u64)?;
    }
    // (remote sources: their mirror files have their full sizes before any byte is fetched)
    sources.ensure_ops(jobs.iter().flatten())?;
    let files: Vec<File> = sources
        .paths
        .iter()
        .map(|p| File::open(p).at(p))
        .collect::<Result<_>>()?;
    let mut tasks: Vec<Task> = vec![];
    for (ops, out) in jobs.iter().zip(outs.iter_mut()) {
        carve(ops, out, &mut tasks);
    }
    tasks.into_par_iter().try_for_each(|t| {
        for o in &t.ops {
            let bytes = o.dst_len() * o.count;
            if apply_small(o, &files, sources.paths, t.buf, t.lo)? {
                if let Some(d) = done {
                    d.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
                }
                continue;
            }
            let (a, b) = o.src_span();
            apply(o, &maps, t.buf, t.lo);
            if let Some(d) = done {
                d.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
            }
            // The caller's buffers hold the data now: drop the source pages from this
            // process's resident set (they stay in the page cache), so reading N bytes
            // costs N bytes of memory, not 2N. Small copies are left to the unmapping.
            if b - a >= RELEASE_BYTES {
                release(&maps[o.src as usize], a, b);
            }
        }
        Ok(())
    })
}

/// Copies whose source bytes span at most this many are read with `pread`, not through
/// the mapping.
const PREAD_BYTES: u64 = 4096;

/// Whether `o` is read with `pread` ([`apply_small`]) rather than through the mapping.
pub fn is_small(o: &CopyOp) -> bool {
    let (a, b) = o.src_span();
    b - a <= PREAD_BYTES
}

/// Perform `o` into `buf` (destination bytes from `lo` on) by reading its source bytes with
/// `pread`, when they span at most `PREAD_BYTES`; false (nothing done) otherwise. A fault
/// on the mapping would map the pages around a small copy too (the kernel's fault-around),
/// resident until unmapping: a million small items would hold their whole files.
pub fn apply_small(
    o: &CopyOp,
    files: &[File],
    paths: &[PathBuf],
    buf: &mut [u8],
    lo: u64,
) -> Result<bool> {
    if !is_small(o) {
        return Ok(false);
    }
    let (a, b) = o.src_span();
    let mut small = [0u8; PREAD_BYTES as usize];
    let bytes = &mut small[..(b - a) as usize];
    let i = o.src as usize;
    files[i].read_exact_at(bytes, a).at(&paths[i])?;
    let mut rows = vec![];
    let scales = match o.cast.and_then(|c| c.scale) {
        Some(bs) => {
            let (sa, sb) = bs.span(o);
            rows.resize((sb - sa) as usize, 0);
            let j = bs.src as usize;
            files[j].read_exact_at(&mut rows, sa).at(&paths[j])?;
            Some((bs, &rows[..], (sa - bs.offset) / bs.row_bytes().max(1)))
        }
        None => None,
    };
    apply_from(o, bytes, a, scales, buf, lo);
    Ok(true)
}

/// Copies at least this long release their source pages as soon as they are done.
const RELEASE_BYTES: u64 = 64 << 10;

/// Bytes of copying one parallel task does at most, when its copies can be cut.
pub const TASK_BYTES: u64 = 4 << 20;

/// Copies into one slice of a buffer, whose first byte is the buffer's byte `lo`.
struct Task<'a> {
    ops: Vec<CopyOp>,
    buf: &'a mut [u8],
    lo: u64,
}

/// `o` cut into copies of at most about [`TASK_BYTES`] destination bytes: a contiguous copy
/// into byte ranges, a strided one into groups of rows.
fn cut(o: &CopyOp) -> Vec<CopyOp> {
    let dl = o.dst_len();
    if o.count == 1 {
        // Keep cuts on element boundaries of both dtypes.
        let (es, ed) = match o.cast {
            Some(c) => (c.from.size() as u64, c.to.size() as u64),
            None => (1, 1),
        };
        let elems = o.len / es;
        let step = (TASK_BYTES / ed).max(1);
        if elems <= step {
            return vec![*o];
        }
        return (0..elems)
            .step_by(step as usize)
            .map(|a| {
                let n = step.min(elems - a);
                CopyOp {
                    src_offset: o.src_offset + a * es,
                    dst_offset: o.dst_offset + a * ed,
                    len: n * es,
                    ..*o
                }
            })
            .collect();
    }
    let rows = (TASK_BYTES / dl.max(1)).max(1);
    if o.count <= rows {
        return vec![*o];
    }
    (0..o.count)
        .step_by(rows as usize)
        .map(|r| CopyOp {
            src_offset: o.src_offset + r * o.src_stride,
            dst_offset: o.dst_offset + r * o.dst_stride,
            count: rows.min(o.count - r),
            ..*o
        })
        .collect()
}

/// Split the copies `ops` into `out` (already checked against it) into tasks over disjoint
/// slices of `out`, or one task over all of it when their destinations interleave.
fn carve<'a>(ops: &[CopyOp], out: &'a mut [u8], tasks: &mut Vec<Task<'a>>) {
    let mut pieces: Vec<CopyOp> = ops.iter().flat_map(cut).collect();
    pieces.sort_unstable_by_key(|o| o.dst_offset);
    let disjoint = pieces
        .windows(2)
        .all(|w| w[0].dst_span().1 <= w[1].dst_offset);
    if !disjoint {
        tasks.push(Task {
            ops: pieces,
            buf: out,
            lo: 0,
        });
        return;
    }
    // Group neighbouring small copies so a task does about TASK_BYTES of work.
    let mut rest = out;
    let mut at = 0u64;
    let mut i = 0;
    while i < pieces.len() {
        let lo = pieces[i].dst_offset;
        let mut j = i;
        let mut bytes = 0;
        while j < pieces.len()
            && (j == i || bytes + pieces[j].dst_len() * pieces[j].count <= TASK_BYTES)
        {
            bytes += pieces[j].dst_len() * pieces[j].count;
            j += 1;
        }
        let hi = pieces[j - 1].dst_span().1;
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((lo - at) as usize);
        let (buf, tail) = tail.split_at_mut((hi - lo) as usize);
        rest = tail;
        at = hi;
        tasks.push(Task {
            ops: pieces[i..j].to_vec(),
            buf,
            lo,
        });
        i = j;
    }
}

/// Check each op against its source's length and the buffer's.
fn check_ops(ops: &[CopyOp], sources: &[PathBuf], maps: &[Mmap], out_len: u64) -> Result<()> {
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
        if o.count == 0 || o.dst_span().1 > out_len {
            return Err(Error::usage("copy op past the end of the buffer"));
        }
        check_scales(o, sources, maps)?;
    }
    Ok(())
}

/// Check the scales a dequantizing copy `o` reads are well described and within their
/// source's mapping (`maps`, of the files `sources`).
pub fn check_scales(o: &CopyOp, sources: &[PathBuf], maps: &[Mmap]) -> Result<()> {
    let Some((c, bs)) = o.cast.and_then(|c| c.scale.map(|s| (c, s))) else {
        return Ok(());
    };
    if c.from != DType::F8E4M3
        || bs.cols == 0
        || bs.block.contains(&0)
        || o.src_offset < bs.base
        || !c.to.is_castable_float()
    {
        return Err(Error::usage("malformed dequantizing copy op in plan"));
    }
    let m = maps
        .get(bs.src as usize)
        .ok_or_else(|| Error::usage("copy op names an unknown source of scales"))?;
    let (_, b) = bs.span(o);
    if b > m.len() as u64 {
        return Err(Error::format(
            &sources[bs.src as usize],
            format!(
                "is truncated: scale bytes up to {b} are needed, the file has {}",
                m.len()
            ),
        ));
    }
    Ok(())
}

/// Read each `(tensor, region, dtype)` of `want` from `sources` (the files the tensors'
/// pieces name) into a buffer of its own, row-major, cast to `dtype` where it differs
/// ([`region_ops`]), mapping the sources once.
pub fn read_regions(
    sources: Sources,
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
    sources: Sources,
    want: &[(&TensorLayout, &Region, DType)],
    outs: &mut [&mut [u8]],
) -> Result<()> {
    let jobs: Vec<Vec<CopyOp>> = want
        .iter()
        .map(|&(t, region, dtype)| region_ops(t, region, dtype))
        .collect();
    read_many_into(&jobs, sources, outs)
}
