//! Running one window: a window of plain contiguous runs is copied by the kernel
//! (`copy_file_range`, or `pwrite` straight from the source mapping where the kernel
//! cannot), any other is assembled in a per-thread buffer and written once. Either way the
//! window hashes its share of the output's checksums, and releases the source pages it
//! read through the mapping.

use super::crc::{unknown, CkRange, CrcPart};
use super::read::{apply, apply_small, is_small};
use super::schedule::{Frag, Window};
use crate::error::Result;
use crate::plan::CopyOp;
use crate::sys::{copy_range, kernel_copy_available, release, WriteContext};
use memmap2::Mmap;
use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

thread_local! {
    /// The window buffer of each worker thread, reused from window to window.
    static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// The files one window reads and writes.
pub(super) struct WindowIo<'a> {
    /// Source mappings, by source index.
    pub srcs: &'a [Mmap],
    /// The same sources opened for kernel copies and small reads.
    pub src_files: &'a [File],
    /// Their paths, for error messages.
    pub src_paths: &'a [std::path::PathBuf],
    /// The window's destination file.
    pub dst: &'a File,
    /// Its path, for error messages.
    pub dst_path: &'a Path,
}

impl WindowIo<'_> {
    /// Write `bytes` at destination offset `at`.
    fn write(&self, bytes: &[u8], at: u64) -> Result<()> {
        self.dst.write_all_at(bytes, at).at_write(self.dst_path)
    }

    /// Source bytes of row `row` of `o`, from the mapping.
    fn row(&self, o: &CopyOp, row: u64) -> &[u8] {
        let s = (o.src_offset + row * o.src_stride) as usize;
        &self.srcs[o.src as usize][s..s + o.len as usize]
    }
}

/// A window's share of its destination's checksums: the ranges it touches (clipped to the
/// window), those whose parts known source CRCs give instead, and the parts hashed so far.
struct Shares<'a> {
    file: u32,
    hits: Vec<CkRange>,
    skip: &'a [(u64, u64)],
    parts: Vec<CrcPart>,
}

impl<'a> Shares<'a> {
    fn new(w: &Window, ranges: &[CkRange], skip: &'a [(u64, u64)]) -> Self {
        let first = ranges.partition_point(|r| r.2 <= w.start);
        let hits = ranges[first..]
            .iter()
            .take_while(|r| r.1 < w.end)
            .map(|&(i, a, b)| (i, a.max(w.start), b.min(w.end)))
            .collect();
        Shares {
            file: w.dst,
            hits,
            skip,
            parts: vec![],
        }
    }

    /// Hash `bytes`, destination bytes from `start` on, as a part of checksum `ck`.
    fn hash(&mut self, ck: u32, start: u64, bytes: &[u8]) {
        let mut hash = crc32fast::Hasher::new();
        hash.update(bytes);
        self.parts.push(CrcPart {
            file: self.file,
            ck,
            start,
            len: bytes.len() as u64,
            hash,
        });
    }

    /// The destination ranges within `d0..d1` still to hash, with their checksum index. Only
    /// the checksum ranges overlapping `d0..d1` are looked at (the hits are sorted and
    /// disjoint): a window of many small copies asks once per copy.
    fn to_hash(&self, d0: u64, d1: u64) -> Vec<(u32, u64, u64)> {
        let first = self.hits.partition_point(|h| h.2 <= d0);
        self.hits[first..]
            .iter()
            .take_while(|h| h.1 < d1)
            .flat_map(|&(ck, a, b)| {
                unknown(a.max(d0), b.min(d1), self.skip)
                    .into_iter()
                    .map(move |(x, y)| (ck, x, y))
            })
            .collect()
    }
}

/// Run one window; `ranges` are its destination file's checksum ranges (sorted, disjoint),
/// and the window's share of each is hashed and returned, except for the destination ranges
/// in `skip`, whose parts known source CRCs give ([`super::crc::known_parts`]).
pub(super) fn run_window(
    w: &Window,
    io: &WindowIo,
    (ranges, skip): (&[CkRange], &[(u64, u64)]),
) -> Result<Vec<CrcPart>> {
    let mut shares = Shares::new(w, ranges, skip);
    let mapped = if w.frags.iter().all(Frag::is_direct) {
        copy_runs(w, io, &mut shares)?
    } else {
        assemble(w, io, &mut shares)?;
        // An assembled window reads small copies with pread, the others from the mapping.
        w.frags
            .iter()
            .filter_map(|f| match f {
                Frag::Op(o) if !is_small(o) => Some((o.src, o.src_span().0, o.src_span().1)),
                _ => None,
            })
            .collect()
    };
    release_spans(io, mapped);
    Ok(shares.parts)
}

/// Release the source pages of `spans` (source, first byte, past the last) read through the
/// mapping, neighbours of one source within [`RELEASE_GAP`] merged: one `madvise` (and TLB
/// shootdown) per merged span, not one per copy.
fn release_spans(io: &WindowIo, mut spans: Vec<(u32, u64, u64)>) {
    spans.sort_unstable();
    let mut cur: Option<(u32, u64, u64)> = None;
    for (src, a, b) in spans {
        match &mut cur {
            Some(c) if c.0 == src && a <= c.2.saturating_add(RELEASE_GAP) => c.2 = c.2.max(b),
            _ => {
                if let Some((s, x, y)) = cur.replace((src, a, b)) {
                    release(&io.srcs[s as usize], x, y);
                }
            }
        }
    }
    if let Some((s, x, y)) = cur {
        release(&io.srcs[s as usize], x, y);
    }
}

/// Source spans of one window closer than this are released by one call.
const RELEASE_GAP: u64 = 1 << 20;

/// Copy a window of plain contiguous runs, in the kernel where it can. Checksummed bytes
/// are hashed from the source mapping, unless known source CRCs give them. Returns the
/// source spans read through the mapping (copy_file_range reads through the page cache).
fn copy_runs(w: &Window, io: &WindowIo, shares: &mut Shares) -> Result<Vec<(u32, u64, u64)>> {
    let mut mapped = vec![];
    for f in &w.frags {
        let Frag::Op(o) = f else { continue };
        let d0 = o.dst_offset;
        for (ck, x, y) in shares.to_hash(d0, d0 + o.len) {
            let s = o.src_offset + (x - d0);
            shares.hash(ck, x, &io.srcs[o.src as usize][s as usize..(s + (y - x)) as usize]);
            mapped.push((o.src, s, s + (y - x)));
        }
        let src = &io.src_files[o.src as usize];
        let kernel = kernel_copy_available()
            && copy_range(src, o.src_offset, io.dst, o.dst_offset, o.len).at_write(io.dst_path)?;
        if !kernel {
            io.write(io.row(o, 0), o.dst_offset)?;
            mapped.push((o.src, o.src_offset, o.src_offset + o.len));
        }
    }
    Ok(mapped)
}

/// Assemble a window in the thread's buffer (literals, gathered rows, casts), hash its
/// share of the checksums from there, and write it at once.
fn assemble(w: &Window, io: &WindowIo, shares: &mut Shares) -> Result<()> {
    let (lo, hi, covered) = buffer_span(w, &shares.hits);
    BUF.with(|buf| -> Result<()> {
        let mut buf = buf.borrow_mut();
        buf.resize((hi - lo) as usize, 0);
        if covered < hi - lo {
            buf.fill(0);
        }
        for f in &w.frags {
            match f {
                Frag::Lit { dst, bytes } => {
                    let a = (dst - lo) as usize;
                    buf[a..a + bytes.len()].copy_from_slice(bytes);
                }
                Frag::Op(o) => {
                    if !apply_small(o, io.src_files, io.src_paths, &mut buf, lo)? {
                        apply(o, io.srcs, &mut buf, lo);
                    }
                }
            }
        }
        for (ck, x, y) in shares.to_hash(lo, hi) {
            shares.hash(ck, x, &buf[(x - lo) as usize..(y - lo) as usize]);
        }
        io.write(&buf, lo)
    })
}

/// The destination bytes `lo..hi` a window's buffer spans (its fragments and the checksummed
/// bytes `hits`; bytes in it that no fragment writes are zeros), and how many bytes its
/// fragments write.
fn buffer_span(w: &Window, hits: &[CkRange]) -> (u64, u64, u64) {
    let span = |f: &Frag| match f {
        Frag::Lit { dst, bytes } => (*dst, dst + bytes.len() as u64),
        Frag::Op(o) => o.dst_span(),
    };
    let lo = w.frags.iter().map(|f| span(f).0).min().unwrap_or(w.start);
    let hi = w.frags.iter().map(|f| span(f).1).max().unwrap_or(w.start);
    let lo = hits.iter().map(|h| h.1).fold(lo, u64::min);
    let hi = hits.iter().map(|h| h.2).fold(hi, u64::max);
    let covered = w
        .frags
        .iter()
        .map(|f| match f {
            Frag::Lit { bytes, .. } => bytes.len() as u64,
            Frag::Op(o) => o.bytes_written(),
        })
        .sum();
    (lo, hi, covered)
}
