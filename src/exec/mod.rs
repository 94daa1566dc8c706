//! The executor: runs a [`Plan`] from memory-mapped sources into destination files.
//!
//! It knows nothing about formats. Destinations are described as [`OutputFile`]s (size plus
//! literal bytes such as headers) and written with positional writes, never mapped, so their
//! pages never count against the process. Work is cut into windows of each destination file
//! (a few MiB) and windows run in parallel on a rayon pool; a window whose copies are all
//! plain contiguous runs is written straight from the source mapping, any other window is
//! assembled in a per-thread buffer (casts, strided rows, headers) and written once. Source
//! pages a window used are released (`MADV_DONTNEED`) as soon as it is written, so resident
//! memory stays flat whatever the checkpoint size.

use crate::commit::WriteContext;
use crate::error::{Error, IoContext, Result};
use crate::layout::DType;
use crate::plan::{Cast, CopyOp, Plan};
use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use serde::Serialize;
use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A destination file: where it goes, its final size, and bytes written verbatim (headers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputFile {
    /// Path relative to the destination (a file name for a single-file output).
    pub path: PathBuf,
    /// Final size in bytes.
    pub size: u64,
    /// `(offset, bytes)` written verbatim.
    pub literals: Vec<(u64, Vec<u8>)>,
    /// CRC-32s to compute over the finished file and write in place (zip records).
    pub checksums: Vec<Checksum>,
}

/// The CRC-32 of bytes `range` of an output file, written at each offset of `at` (which must
/// lie outside `range`) — 4 bytes little-endian (zip records), or as 8 lowercase hex digits
/// when `hex` (a safetensors header) — once every copy and literal is in place. It is
/// computed while the bytes stream: each window hashes its share of the range (from its
/// buffer, or straight from the source mapping for kernel-copied runs) and the shares are
/// joined in order with `crc32fast`'s `combine`; the output is never read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checksum {
    /// First and past-the-last byte covered.
    pub range: (u64, u64),
    /// Where to write the CRC.
    pub at: Vec<u64>,
    /// Write it as 8 lowercase hex digits instead of 4 little-endian bytes.
    pub hex: bool,
}

/// One window's share of a [`Checksum`]: the CRC-32 of destination bytes from `start` on.
struct CrcPart {
    /// Output file index.
    file: u32,
    /// Index of the checksum in that file's list.
    ck: u32,
    /// First destination byte hashed.
    start: u64,
    /// Bytes hashed.
    len: u64,
    /// The hash of those bytes.
    hash: crc32fast::Hasher,
}

/// The CRC-32 of bytes `offset..offset + len` of source `src`, taken as given (a checksum the
/// source records). An output checksum over bytes copied whole from a run of such ranges is
/// combined from them instead of hashed, so a kernel copy (`copy_file_range`) never has to
/// bring those bytes into user space. If the source bytes do not match their recorded CRC,
/// the output's CRC does not match its bytes either, and `reshard verify` flags the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownCrc {
    /// Source file index (as in [`CopyOp::src`]).
    pub src: u32,
    /// First byte.
    pub offset: u64,
    /// Bytes covered.
    pub len: u64,
    /// Their CRC-32.
    pub crc: u32,
}

/// The parts of output checksums that `known` source CRCs give without hashing: direct ops
/// (no cast, one row) whose share of a checksum range is read from a run of consecutive
/// known source ranges. Returns those parts and, per output file, the destination ranges
/// they cover (sorted, disjoint), which the windows then leave unhashed.
fn known_parts(
    plan: &Plan,
    outputs: &[OutputFile],
    ranges: &[Vec<(u32, u64, u64)>],
    known: &[KnownCrc],
) -> (Vec<CrcPart>, Vec<Vec<(u64, u64)>>) {
    let mut parts = vec![];
    let mut skip: Vec<Vec<(u64, u64)>> = vec![vec![]; outputs.len()];
    if known.is_empty() {
        return (parts, skip);
    }
    let index: std::collections::HashMap<(u32, u64), (u64, u32)> = known
        .iter()
        .filter(|k| k.len > 0)
        .map(|k| ((k.src, k.offset), (k.len, k.crc)))
        .collect();
    for o in plan.ops.iter().filter(|o| o.count == 1 && o.cast.is_none()) {
        let Some(rs) = ranges.get(o.dst as usize) else {
            continue;
        };
        let (d0, d1) = (o.dst_offset, o.dst_offset + o.len);
        let first = rs.partition_point(|r| r.2 <= d0);
        for &(ck, a, b) in rs[first..].iter().take_while(|r| r.1 < d1) {
            let (x, y) = (a.max(d0), b.min(d1));
            let (start, end) = (o.src_offset + (x - d0), o.src_offset + (y - d0));
            let mut hash = crc32fast::Hasher::new();
            let mut at = start;
            while at < end {
                match index.get(&(o.src, at)) {
                    Some(&(len, crc)) if at + len <= end => {
                        hash.combine(&crc32fast::Hasher::new_with_initial_len(crc, len));
                        at += len;
                    }
                    _ => break,
                }
            }
            if at == end && x < y {
                parts.push(CrcPart {
                    file: o.dst,
                    ck,
                    start: x,
                    len: y - x,
                    hash,
                });
                skip[o.dst as usize].push((x, y));
            }
        }
    }
    for s in &mut skip {
        s.sort_unstable();
    }
    (parts, skip)
}

/// The sub-ranges of `a..b` that no range of `skip` (sorted, disjoint) covers.
fn unknown(a: u64, b: u64, skip: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = vec![];
    let mut at = a;
    for &(x, y) in &skip[skip.partition_point(|s| s.1 <= a)..] {
        if x >= b {
            break;
        }
        if x > at {
            out.push((at, x));
        }
        at = at.max(y);
    }
    if at < b {
        out.push((at, b));
    }
    out
}

/// A checksum range of an output file: `(index, first, past-the-last byte)`.
type CkRange = (u32, u64, u64);

/// The checksum ranges of an output file, as `(index, first, past-the-last byte)`.
fn ck_ranges(o: &OutputFile) -> Vec<(u32, u64, u64)> {
    let mut r: Vec<_> = o
        .checksums
        .iter()
        .enumerate()
        .filter(|(_, c)| c.range.1 > c.range.0)
        .map(|(i, c)| (i as u32, c.range.0, c.range.1))
        .collect();
    r.sort_by_key(|&(_, a, _)| a);
    r
}

/// Join the parts of one checksum over `(a, b)`, sorted by start: bytes no window wrote
/// (file holes) are zeros.
fn join_crc(parts: &[CrcPart], (a, b): (u64, u64)) -> u32 {
    fn zeros(h: &mut crc32fast::Hasher, mut n: u64) {
        static Z: [u8; 4096] = [0; 4096];
        while n > 0 {
            let k = n.min(Z.len() as u64) as usize;
            h.update(&Z[..k]);
            n -= k as u64;
        }
    }
    let mut h = crc32fast::Hasher::new();
    let mut at = a;
    for p in parts {
        zeros(&mut h, p.start.saturating_sub(at));
        h.combine(&p.hash);
        at = at.max(p.start) + p.len;
    }
    zeros(&mut h, b.saturating_sub(at));
    h.finalize()
}

/// Executor settings.
#[derive(Clone, Debug)]
pub struct ExecOptions {
    /// Worker threads (`None`: one per core).
    pub threads: Option<usize>,
    /// Bytes of destination per work unit.
    pub window: u64,
    /// Show a progress bar on stderr (only drawn on a terminal).
    pub progress: bool,
    /// fsync every output before returning (needed for a durable commit; tests of the copy
    /// logic alone may turn it off).
    pub sync: bool,
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            threads: None,
            window: 8 << 20,
            progress: false,
            sync: true,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExecStats {
    /// Tensor bytes read from sources.
    pub bytes_read: u64,
    /// Bytes written to destinations (tensor data and literals).
    pub bytes_written: u64,
    /// Work units executed.
    pub windows: usize,
    /// Threads used.
    pub threads: usize,
}

/// A piece of one window: either literal bytes or (part of) a copy op.
#[derive(Clone, Debug)]
enum Frag<'a> {
    Lit { dst: u64, bytes: &'a [u8] },
    Op(CopyOp),
}

impl Frag<'_> {
    fn is_direct(&self) -> bool {
        matches!(self, Frag::Op(o) if o.count == 1 && o.cast.is_none())
    }
}

/// A unit of work: a byte range of one destination file and what fills it.
#[derive(Debug)]
struct Window<'a> {
    dst: u32,
    start: u64,
    end: u64,
    frags: Vec<Frag<'a>>,
}

/// Clip `op` to destination bytes `w0..w1`, pushing the parts to `out`. Rows are cut at
/// element boundaries of the destination dtype (windows are multiples of 8 bytes and writers
/// align cast destinations, so a cut never splits an element).
fn clip(op: &CopyOp, w0: u64, w1: u64, out: &mut Vec<Frag>) {
    let dl = op.dst_len();
    let (es, ed) = match op.cast {
        Some(c) => (c.from.size() as u64, c.to.size() as u64),
        None => (1, 1),
    };
    let row = |i: u64| -> (u64, u64) {
        let d = op.dst_offset + i * op.dst_stride;
        (d, d + dl)
    };
    let part = |i: u64, a: u64, b: u64| -> CopyOp {
        // destination bytes a..b of row i
        let (d, _) = row(i);
        let (x, y) = ((a - d) / ed * es, (b - d) / ed * es);
        CopyOp {
            src_offset: op.src_offset + i * op.src_stride + x,
            dst_offset: a,
            len: y - x,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
            ..*op
        }
    };
    if op.count == 1 {
        let (d, e) = row(0);
        let (a, b) = (d.max(w0), e.min(w1));
        if a < b {
            out.push(Frag::Op(if a == d && b == e { *op } else { part(0, a, b) }));
        }
        return;
    }
    let ds = op.dst_stride;
    // rows i with d_i < w1 and d_i + dl > w0
    let i_lo = if op.dst_offset + dl > w0 {
        0
    } else {
        (w0 - op.dst_offset - dl) / ds + 1
    };
    let i_hi = if w1 <= op.dst_offset {
        0
    } else {
        ((w1 - op.dst_offset).div_ceil(ds)).min(op.count)
    };
    let mut i = i_lo;
    let mut full_start = None;
    let flush = |from: Option<u64>, to: u64, out: &mut Vec<Frag>| {
        if let Some(f) = from {
            if to > f {
                out.push(Frag::Op(CopyOp {
                    src_offset: op.src_offset + f * op.src_stride,
                    dst_offset: op.dst_offset + f * ds,
                    count: to - f,
                    ..*op
                }));
            }
        }
    };
    while i < i_hi {
        let (d, e) = row(i);
        if d >= w0 && e <= w1 {
            full_start.get_or_insert(i);
        } else {
            flush(full_start.take(), i, out);
            let (a, b) = (d.max(w0), e.min(w1));
            if a < b {
                out.push(Frag::Op(part(i, a, b)));
            }
        }
        i += 1;
    }
    flush(full_start, i_hi, out);
}

/// Cut the plan into windows of `window` destination bytes.
fn windows<'a>(plan: &Plan, outputs: &'a [OutputFile], window: u64) -> Vec<Window<'a>> {
    let window = window.max(8) / 8 * 8;
    let mut per_file: Vec<Vec<Window>> = outputs
        .iter()
        .enumerate()
        .map(|(f, o)| {
            (0..o.size.div_ceil(window))
                .map(|k| Window {
                    dst: f as u32,
                    start: k * window,
                    end: ((k + 1) * window).min(o.size),
                    frags: vec![],
                })
                .collect()
        })
        .collect();
    for (f, o) in outputs.iter().enumerate() {
        for (off, bytes) in &o.literals {
            let mut a = *off;
            let end = off + bytes.len() as u64;
            while a < end {
                let k = (a / window) as usize;
                let b = end.min((k as u64 + 1) * window);
                let s = &bytes[(a - off) as usize..(b - off) as usize];
                per_file[f][k].frags.push(Frag::Lit { dst: a, bytes: s });
                a = b;
            }
        }
    }
    for op in &plan.ops {
        let (a, b) = op.dst_span();
        if b <= a {
            continue;
        }
        let wins = &mut per_file[op.dst as usize];
        for k in (a / window)..=((b - 1) / window) {
            let w = &mut wins[k as usize];
            clip(op, w.start, w.end, &mut w.frags);
        }
    }
    per_file
        .into_iter()
        .flatten()
        .filter(|w| !w.frags.is_empty())
        .collect()
}

/// Convert the elements of `src` bytes (dtype `c.from`) into `dst` bytes (dtype `c.to`).
///
/// One loop per dtype pair, chosen once per call: bf16 → f32 is a 16-bit shift and the
/// others go through `half`'s scalar conversions, each a single round-to-nearest-even from f32
/// (f64 sources round once from f64). The earlier per-element match over an f64 detour ran at
/// 5–9 ns per element (`cargo bench --bench casts`); see BENCHMARKS.md for these loops.
fn convert(c: Cast, src: &[u8], dst: &mut [u8]) {
    fn each<const S: usize, const D: usize>(
        src: &[u8],
        dst: &mut [u8],
        f: impl Fn([u8; S]) -> [u8; D],
    ) {
        for (s, d) in src.chunks_exact(S).zip(dst.chunks_exact_mut(D)) {
            let mut a = [0u8; S];
            a.copy_from_slice(s);
            d.copy_from_slice(&f(a));
        }
    }
    let f32_of = |b: [u8; 4]| f32::from_le_bytes(b);
    let f64_of = |b: [u8; 8]| f64::from_le_bytes(b);
    let bf16_to_f32 = |b: [u8; 2]| f32::from_bits((u16::from_le_bytes(b) as u32) << 16);
    // NaN payloads are kept bit for bit (`half` sets the quiet bit; torch's c10 does not).
    let f16_to_f32 = |b: [u8; 2]| {
        let h = u16::from_le_bytes(b);
        if h & 0x7c00 == 0x7c00 && h & 0x03ff != 0 {
            f32::from_bits(((h as u32 & 0x8000) << 16) | 0x7f80_0000 | ((h as u32 & 0x03ff) << 13))
        } else {
            f16::from_bits(h).to_f32()
        }
    };
    match (c.from, c.to) {
        (DType::BF16, DType::F32) => each(src, dst, |b| bf16_to_f32(b).to_le_bytes()),
        (DType::F16, DType::F32) => each(src, dst, |b| f16_to_f32(b).to_le_bytes()),
        (DType::BF16, DType::F64) => each(src, dst, |b| (bf16_to_f32(b) as f64).to_le_bytes()),
        (DType::F16, DType::F64) => each(src, dst, |b| (f16_to_f32(b) as f64).to_le_bytes()),
        (DType::F32, DType::F64) => each(src, dst, |b| (f32_of(b) as f64).to_le_bytes()),
        (DType::F32, DType::BF16) => each(src, dst, |b| {
            bf16::from_f32(f32_of(b)).to_bits().to_le_bytes()
        }),
        (DType::F32, DType::F16) => each(src, dst, |b| {
            f16::from_f32(f32_of(b)).to_bits().to_le_bytes()
        }),
        // bf16 and f16 are exact in f32, so one rounding
        (DType::F16, DType::BF16) => each(src, dst, |b| {
            bf16::from_f32(f16_to_f32(b)).to_bits().to_le_bytes()
        }),
        (DType::BF16, DType::F16) => each(src, dst, |b| {
            f16::from_f32(bf16_to_f32(b)).to_bits().to_le_bytes()
        }),
        (DType::F64, DType::F32) => each(src, dst, |b| (f64_of(b) as f32).to_le_bytes()),
        (DType::F64, DType::BF16) => each(src, dst, |b| {
            bf16::from_f64(f64_of(b)).to_bits().to_le_bytes()
        }),
        (DType::F64, DType::F16) => each(src, dst, |b| {
            f16::from_f64(f64_of(b)).to_bits().to_le_bytes()
        }),
        // same dtype, or pairs the planner never emits (checked when the plan is made)
        _ => {
            let n = src.len().min(dst.len());
            dst[..n].copy_from_slice(&src[..n]);
        }
    }
}

/// Drop the pages of bytes `a..b` of a source mapping (rounded out to whole pages), so
/// resident memory stays bounded; later reads fault them in again from the page cache.
pub(crate) fn release(map: &Mmap, a: u64, b: u64) {
    const PAGE: u64 = 4096;
    let a = a / PAGE * PAGE;
    let b = b.div_ceil(PAGE) * PAGE;
    let b = b.min(map.len() as u64);
    if b > a {
        // SAFETY: the mapping is a read-only shared file mapping; dropping its pages only makes
        // later reads fault them in again from the page cache. No reference into it is held
        // across this call by this thread, and other threads' reads refault transparently.
        unsafe {
            let _ = map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                a as usize,
                (b - a) as usize,
            );
        }
    }
}

/// Perform `o` into `buf`, which holds destination bytes from offset `lo` on.
fn apply(o: &CopyOp, srcs: &[Mmap], buf: &mut [u8], lo: u64) {
    let dl = o.dst_len() as usize;
    for r in 0..o.count {
        let s = (o.src_offset + r * o.src_stride) as usize;
        let src = &srcs[o.src as usize][s..s + o.len as usize];
        let a = (o.dst_offset + r * o.dst_stride - lo) as usize;
        let out = &mut buf[a..a + dl];
        match o.cast {
            None => out.copy_from_slice(src),
            Some(c) => convert(c, src, out),
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
pub fn read_many(jobs: &[Vec<CopyOp>], sources: &[PathBuf], outs: &mut [Vec<u8>]) -> Result<()> {
    let maps = map_sources_with(sources, memmap2::Advice::Random)?;
    for (ops, out) in jobs.iter().zip(outs.iter_mut()) {
        read_with(ops, sources, &maps, out)?;
    }
    Ok(())
}

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

/// Whether `copy_file_range` is worth trying (cleared the first time the kernel refuses it).
static COPY_FILE_RANGE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Copy `len` bytes between files in the kernel (`copy_file_range`), without mapping or
/// buffering them in user space. Returns `Ok(false)`, having copied nothing, when the kernel
/// or filesystem does not support it, so the caller falls back to `pwrite`.
fn copy_range(
    src: &File,
    src_off: u64,
    dst: &File,
    dst_off: u64,
    len: u64,
) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let (mut off_in, mut off_out) = (src_off as libc::loff_t, dst_off as libc::loff_t);
    let mut left = len;
    while left > 0 {
        // SAFETY: valid descriptors and offset pointers for the duration of the call.
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                left as usize,
                0,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            let unsupported = matches!(
                e.raw_os_error(),
                Some(libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
            );
            if unsupported && left == len {
                COPY_FILE_RANGE.store(false, Ordering::Relaxed);
                return Ok(false);
            }
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "source ended early",
            ));
        }
        left -= n as u64;
    }
    Ok(true)
}

thread_local! {
    static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Run one window; `ranges` are its destination file's checksum ranges (sorted, disjoint),
/// and the window's share of each is hashed into `parts`, except for the destination ranges
/// in `skip`, whose parts known source CRCs give ([`known_parts`]).
fn run_window(
    w: &Window,
    srcs: &[Mmap],
    src_files: &[File],
    dst: &File,
    dst_path: &Path,
    (ranges, skip): (&[CkRange], &[(u64, u64)]),
    parts: &mut Vec<CrcPart>,
) -> Result<()> {
    let write = |bytes: &[u8], at: u64| dst.write_all_at(bytes, at).at_write(dst_path);
    let slice = |o: &CopyOp, row: u64| -> &[u8] {
        let s = (o.src_offset + row * o.src_stride) as usize;
        &srcs[o.src as usize][s..s + o.len as usize]
    };
    // The checksum ranges this window touches.
    let first = ranges.partition_point(|r| r.2 <= w.start);
    let hits: Vec<(u32, u64, u64)> = ranges[first..]
        .iter()
        .take_while(|r| r.1 < w.end)
        .map(|&(i, a, b)| (i, a.max(w.start), b.min(w.end)))
        .collect();
    let mut hash = |ck: u32, start: u64, bytes: &[u8]| {
        let mut hash = crc32fast::Hasher::new();
        hash.update(bytes);
        parts.push(CrcPart {
            file: w.dst,
            ck,
            start,
            len: bytes.len() as u64,
            hash,
        });
    };
    if w.frags.iter().all(Frag::is_direct) {
        let mut mapped = false;
        for f in &w.frags {
            if let Frag::Op(o) = f {
                // Hash the run from the source mapping (the kernel copies it below), unless
                // known source CRCs give its checksum.
                let (d0, d1) = (o.dst_offset, o.dst_offset + o.len);
                for &(ck, a, b) in &hits {
                    for (x, y) in unknown(a.max(d0), b.min(d1), skip) {
                        let s = (o.src_offset + (x - d0)) as usize;
                        hash(ck, x, &srcs[o.src as usize][s..s + (y - x) as usize]);
                        mapped = true;
                    }
                }
                let kernel = COPY_FILE_RANGE.load(Ordering::Relaxed)
                    && copy_range(
                        &src_files[o.src as usize],
                        o.src_offset,
                        dst,
                        o.dst_offset,
                        o.len,
                    )
                    .at_write(dst_path)?;
                if !kernel {
                    write(slice(o, 0), o.dst_offset)?;
                }
            }
        }
        if !mapped {
            // copy_file_range read through the page cache, not the mapping: nothing to release.
            return Ok(());
        }
    } else {
        let lo = w
            .frags
            .iter()
            .map(|f| match f {
                Frag::Lit { dst, .. } => *dst,
                Frag::Op(o) => o.dst_offset,
            })
            .min()
            .unwrap_or(w.start);
        let hi = w
            .frags
            .iter()
            .map(|f| match f {
                Frag::Lit { dst, bytes } => dst + bytes.len() as u64,
                Frag::Op(o) => o.dst_span().1,
            })
            .max()
            .unwrap_or(w.start);
        // The buffer also spans the checksummed bytes (unwritten bytes in it are zeros).
        let lo = hits.iter().map(|h| h.1).fold(lo, u64::min);
        let hi = hits.iter().map(|h| h.2).fold(hi, u64::max);
        let covered: u64 = w
            .frags
            .iter()
            .map(|f| match f {
                Frag::Lit { bytes, .. } => bytes.len() as u64,
                Frag::Op(o) => o.bytes_written(),
            })
            .sum();
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
                    Frag::Op(o) => apply(o, srcs, &mut buf, lo),
                }
            }
            for &(ck, a, b) in &hits {
                for (x, y) in unknown(a, b, skip) {
                    hash(ck, x, &buf[(x - lo) as usize..(y - lo) as usize]);
                }
            }
            write(&buf, lo)
        })?;
    }
    for f in &w.frags {
        if let Frag::Op(o) = f {
            let (a, b) = o.src_span();
            release(&srcs[o.src as usize], a, b);
        }
    }
    Ok(())
}

/// Check every op stays within its source mapping and destination size.
fn check_bounds(
    plan: &Plan,
    sources: &[PathBuf],
    maps: &[Mmap],
    outputs: &[OutputFile],
) -> Result<()> {
    for o in &plan.ops {
        let s = maps.get(o.src as usize).ok_or_else(|| {
            Error::usage(format!(
                "plan names source file #{} of {}",
                o.src,
                maps.len()
            ))
        })?;
        let (_, b) = o.src_span();
        if b > s.len() as u64 {
            return Err(Error::format(
                &sources[o.src as usize],
                format!("is shorter than its metadata says: bytes up to {b} are needed, the file has {}", s.len()),
            ));
        }
        let d = outputs
            .get(o.dst as usize)
            .ok_or_else(|| Error::usage(format!("plan names destination file #{}", o.dst)))?;
        if o.dst_span().1 > d.size {
            return Err(Error::usage(format!(
                "{}: copy past the end of the output ({} > {})",
                d.path.display(),
                o.dst_span().1,
                d.size
            )));
        }
        if o.count == 0
            || (o.cast.is_some() && o.len % o.cast.map_or(1, |c| c.from.size() as u64) != 0)
        {
            return Err(Error::usage("malformed copy op in plan"));
        }
    }
    Ok(())
}

/// Worker threads when none are asked for: one per core when at least a tenth of the bytes
/// pass through user space (gathered rows, casts, literals, or checksums to hash), otherwise
/// one. Kernel copies into one file serialise on the file's lock, and a second thread only
/// adds contention: consolidating 1 GiB (4 ranks, Shard(0)) took 0.63 s on one thread and
/// 0.72 s on two (BENCHMARKS.md, executor experiments), while resharding 4 → 8 (CRCs hashed
/// over new item boundaries) took 0.75 s on one and 0.48 s on two.
fn default_threads(wins: &[Window], ranges: &[Vec<CkRange>], skip: &[Vec<(u64, u64)>]) -> usize {
    let total: u64 = wins.iter().map(|w| w.end - w.start).sum();
    let gathered: u64 = wins
        .iter()
        .filter(|w| !w.frags.iter().all(Frag::is_direct))
        .map(|w| w.end - w.start)
        .sum();
    let to_hash: u64 = ranges
        .iter()
        .flatten()
        .map(|r| r.2 - r.1)
        .sum::<u64>()
        .saturating_sub(skip.iter().flatten().map(|s| s.1 - s.0).sum());
    if (gathered + to_hash).saturating_mul(10) < total {
        1
    } else {
        rayon::current_num_threads()
    }
}

/// Allocate `size` bytes of blocks for a fresh destination (`fallocate`) before any data is
/// written. Writing one large file then costs about 8 % less on ext4 than letting delayed
/// allocation place blocks as pages are dirtied (BENCHMARKS.md, executor experiments), and a
/// full disk is found before any copying. Filesystems without `fallocate` are left to
/// allocate as they write.
fn preallocate(f: &File, size: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if size == 0 {
        return Ok(());
    }
    let Ok(len) = libc::off_t::try_from(size) else {
        return Ok(());
    };
    loop {
        // SAFETY: a valid descriptor open for writing; mode 0 allocates and extends.
        let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL) => return Ok(()),
            _ => return Err(e),
        }
    }
}

/// Map `sources` read-only.
pub fn map_sources(sources: &[PathBuf]) -> Result<Vec<Mmap>> {
    map_sources_with(sources, memmap2::Advice::Sequential)
}

/// Map `sources` read-only with an access-pattern hint.
fn map_sources_with(sources: &[PathBuf], advice: memmap2::Advice) -> Result<Vec<Mmap>> {
    sources
        .iter()
        .map(|p| {
            let f = File::open(p).at(p)?;
            // SAFETY: the file is opened read-only; reshard never writes to sources. Another
            // process truncating the file while it is mapped would be undefined behaviour in
            // any mmap-based reader; sizes are checked against the metadata before copying.
            let m = unsafe { Mmap::map(&f) }.at(p)?;
            let _ = m.advise(advice);
            Ok(m)
        })
        .collect()
}

/// Run `plan`, reading `sources` and writing each of `outputs` to `dest_paths` (same order),
/// which must already exist. Files are fsynced before this returns (unless `opts.sync` is off).
pub fn execute(
    plan: &Plan,
    sources: &[PathBuf],
    outputs: &[OutputFile],
    dest_paths: &[PathBuf],
    opts: &ExecOptions,
) -> Result<ExecStats> {
    execute_with_known(plan, sources, outputs, dest_paths, opts, &[])
}

/// [`execute`], with the CRC-32s of source ranges the sources record ([`KnownCrc`]): output
/// checksums over bytes copied whole from them are combined, not hashed.
pub fn execute_with_known(
    plan: &Plan,
    sources: &[PathBuf],
    outputs: &[OutputFile],
    dest_paths: &[PathBuf],
    opts: &ExecOptions,
    known: &[KnownCrc],
) -> Result<ExecStats> {
    let maps = map_sources(sources)?;
    let src_files: Vec<File> = sources
        .iter()
        .map(|p| File::open(p).at(p))
        .collect::<Result<_>>()?;
    check_bounds(plan, sources, &maps, outputs)?;
    for o in outputs {
        let r = ck_ranges(o);
        if r.windows(2).any(|p| p[0].2 > p[1].1) || r.last().is_some_and(|l| l.2 > o.size) {
            return Err(Error::usage(format!(
                "{}: checksum ranges overlap or pass the end of the file",
                o.path.display()
            )));
        }
    }
    let files: Vec<File> = dest_paths
        .iter()
        .zip(outputs)
        .map(|(p, o)| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .at_write(p)?;
            preallocate(&f, o.size).at_write(p)?;
            f.set_len(o.size).at_write(p)?;
            Ok(f)
        })
        .collect::<Result<_>>()?;
    let wins = windows(plan, outputs, opts.window);
    let total: u64 = wins.iter().map(|w| w.end - w.start).sum();
    let ranges: Vec<Vec<CkRange>> = outputs.iter().map(ck_ranges).collect();
    let (given, skip) = known_parts(plan, outputs, &ranges, known);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(
            opts.threads
                .unwrap_or_else(|| default_threads(&wins, &ranges, &skip)),
        )
        .build()
        .map_err(|e| Error::usage(format!("cannot start worker threads: {e}")))?;
    let bar = if opts.progress {
        let b = indicatif::ProgressBar::with_draw_target(
            Some(total),
            indicatif::ProgressDrawTarget::stderr(),
        );
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let done = AtomicU64::new(0);
    let mut parts: Vec<CrcPart> = pool.install(|| {
        wins.par_iter()
            .map(|w| {
                let mut parts = vec![];
                run_window(
                    w,
                    &maps,
                    &src_files,
                    &files[w.dst as usize],
                    &dest_paths[w.dst as usize],
                    (&ranges[w.dst as usize], &skip[w.dst as usize]),
                    &mut parts,
                )?;
                bar.inc(w.end - w.start);
                done.fetch_add(1, Ordering::Relaxed);
                Ok::<_, Error>(parts)
            })
            .try_reduce(Vec::new, |mut a, b| {
                a.extend(b);
                Ok(a)
            })
    })?;
    // Join each checksum's streamed and given parts and write it in place.
    parts.extend(given);
    parts.sort_by_key(|p| (p.file, p.ck, p.start));
    let mut rest = parts.as_slice();
    for (f, o) in outputs.iter().enumerate() {
        for (i, c) in o.checksums.iter().enumerate() {
            let n = rest
                .iter()
                .take_while(|p| p.file == f as u32 && p.ck == i as u32)
                .count();
            let crc = join_crc(&rest[..n], c.range);
            rest = &rest[n..];
            let bytes = if c.hex {
                format!("{crc:08x}").into_bytes()
            } else {
                crc.to_le_bytes().to_vec()
            };
            for &at in &c.at {
                files[f].write_all_at(&bytes, at).at_write(&dest_paths[f])?;
            }
        }
    }
    bar.finish_and_clear();
    if opts.sync {
        for (f, p) in files.iter().zip(dest_paths) {
            f.sync_all().at_write(p)?;
        }
    }
    Ok(ExecStats {
        bytes_read: plan.bytes_read(),
        bytes_written: plan.bytes_written()
            + outputs
                .iter()
                .flat_map(|o| &o.literals)
                .map(|(_, b)| b.len() as u64)
                .sum::<u64>(),
        windows: wins.len(),
        threads: pool.current_num_threads(),
    })
}

/// Bytes of destination each of `threads` workers would get if windows were dealt greedily
/// (largest first) — the per-thread balance `reshard plan` shows.
pub fn balance(plan: &Plan, outputs: &[OutputFile], threads: usize, window: u64) -> Vec<u64> {
    let mut sizes: Vec<u64> = windows(plan, outputs, window)
        .iter()
        .map(|w| w.end - w.start)
        .collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    let mut load = vec![0u64; threads.max(1)];
    for s in sizes {
        if let Some(m) = load.iter_mut().min() {
            *m += s;
        }
    }
    load
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checksum over `a..b` written as 4 bytes at each of `at`.
    fn ck(a: u64, b: u64, at: &[u64]) -> Checksum {
        Checksum {
            range: (a, b),
            at: at.to_vec(),
            hex: false,
        }
    }

    /// Run `plan` from `src` into a fresh file `dst` laid out as `out`, in windows of
    /// `window` bytes, with `known` source CRCs; returns the file's bytes.
    fn run_to(
        plan: &Plan,
        src: &Path,
        dst: &Path,
        out: OutputFile,
        window: u64,
        known: &[KnownCrc],
    ) -> Vec<u8> {
        std::fs::File::create(dst).unwrap();
        let opts = ExecOptions {
            window,
            sync: false,
            ..Default::default()
        };
        let (src, dst) = (src.to_path_buf(), dst.to_path_buf());
        execute_with_known(
            plan,
            &[src],
            &[out],
            std::slice::from_ref(&dst),
            &opts,
            known,
        )
        .unwrap();
        std::fs::read(&dst).unwrap()
    }

    /// A copy op of source 0 into destination 0: `count` rows of `len` bytes, rows `stride`
    /// apart in the source and packed in the destination.
    fn op(dst_offset: u64, src_offset: u64, len: u64, count: u64, stride: u64) -> CopyOp {
        CopyOp {
            src: 0,
            src_offset,
            dst: 0,
            dst_offset,
            len,
            count,
            src_stride: stride,
            dst_stride: len,
            cast: None,
        }
    }

    #[test]
    fn clip_strided_op_into_windows_keeps_every_byte_once() {
        let op = CopyOp {
            src: 0,
            src_offset: 0,
            dst: 0,
            dst_offset: 4,
            len: 6,
            count: 10,
            src_stride: 6,
            dst_stride: 16,
            cast: None,
        };
        let mut seen = [0u8; 200];
        for w0 in (0..200).step_by(24) {
            let mut out = vec![];
            clip(&op, w0, w0 + 24, &mut out);
            for f in out {
                let Frag::Op(o) = f else { unreachable!() };
                assert!(o.dst_offset >= w0 && o.dst_span().1 <= w0 + 24);
                for r in 0..o.count {
                    for b in 0..o.len {
                        let d = o.dst_offset + r * o.dst_stride + b;
                        // source byte matches destination byte's position in the original op
                        let row = (d - 4) / 16;
                        assert_eq!(
                            o.src_offset + r * o.src_stride + b,
                            row * 6 + (d - 4 - row * 16)
                        );
                        seen[d as usize] += 1;
                    }
                }
            }
        }
        for r in 0..10u64 {
            for b in 0..6u64 {
                assert_eq!(seen[(4 + r * 16 + b) as usize], 1);
            }
        }
        assert_eq!(seen.iter().map(|&x| x as u64).sum::<u64>(), 60);
    }

    #[test]
    fn checksums_cover_the_finished_bytes() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&src, &data).unwrap();
        let dst = d.path().join("dst");
        std::fs::File::create(&dst).unwrap();
        // header literal, 10 kB copied in, CRC of (literal tail + data) written at offset 0
        let out = OutputFile {
            path: "dst".into(),
            size: 16 + 10_000,
            literals: vec![(0, vec![0xAA; 16])],
            checksums: vec![Checksum {
                range: (8, 16 + 10_000),
                at: vec![0, 4],
                hex: false,
            }],
        };
        let op = CopyOp {
            src: 0,
            src_offset: 0,
            dst: 0,
            dst_offset: 16,
            len: 10_000,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
            cast: None,
        };
        let plan = Plan {
            ops: vec![op],
            tensors: vec![],
        };
        let opts = ExecOptions {
            window: 4096,
            sync: false,
            ..Default::default()
        };
        execute(&plan, &[src], &[out], std::slice::from_ref(&dst), &opts).unwrap();
        let got = std::fs::read(&dst).unwrap();
        let want = crc32fast::hash(&got[8..]);
        assert_eq!(&got[0..4], &want.to_le_bytes());
        assert_eq!(&got[4..8], &want.to_le_bytes());
        assert_eq!(&got[16..], &data[..]);
    }

    #[test]
    fn streamed_checksums_equal_a_hash_of_the_file() {
        // Two records: one filled by direct runs, one by a strided gather, with a hole (zeros)
        // in the middle of the second; every window size cuts them differently.
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 13 % 251) as u8).collect();
        std::fs::write(&src, &data).unwrap();
        let plan = Plan {
            ops: vec![
                op(100, 0, 20_000, 1, 0),
                op(20_200, 20_000, 100, 50, 300),
                op(28_000, 40_000, 5_000, 1, 0),
            ],
            tensors: vec![],
        };
        for window in [8, 64, 4096, 10_000, 1 << 20] {
            let dst = d.path().join(format!("dst{window}"));
            let out = OutputFile {
                path: "dst".into(),
                size: 33_100,
                literals: vec![(0, vec![0xAA; 100]), (33_000, vec![0x55; 100])],
                checksums: vec![
                    ck(100, 20_100, &[0]),
                    ck(20_200, 33_000, &[4, 33_010]),
                    ck(50, 50, &[8]),
                ],
            };
            let got = run_to(&plan, &src, &dst, out, window, &[]);
            let one = crc32fast::hash(&got[100..20_100]).to_le_bytes();
            let two = crc32fast::hash(&got[20_200..33_000]).to_le_bytes();
            assert_eq!(&got[0..4], &one, "window {window}");
            assert_eq!(&got[4..8], &two, "window {window}");
            assert_eq!(&got[33_010..33_014], &two, "window {window}");
            assert_eq!(&got[8..12], &0u32.to_le_bytes(), "window {window}");
            assert_eq!(&got[100..20_100], &data[..20_000]);
            assert!(got[25_200..28_000].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn known_source_crcs_are_combined_instead_of_hashed() {
        // Record 1 of the output is copied from source records [0, 8000) + [8000, 20000);
        // record 2 from [40000, 45000) and a strided gather (which must be hashed).
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let data: Vec<u8> = (0..50_000u32).map(|i| (i * 7 % 253) as u8).collect();
        std::fs::write(&src, &data).unwrap();
        let plan = Plan {
            ops: vec![
                op(0, 0, 20_000, 1, 0),
                op(20_000, 20_000, 100, 50, 300),
                op(25_000, 40_000, 5_000, 1, 0),
            ],
            tensors: vec![],
        };
        let known = |a: u64, b: u64, crc: u32| KnownCrc {
            src: 0,
            offset: a,
            len: b - a,
            crc,
        };
        let crc = |a: usize, b: usize| crc32fast::hash(&data[a..b]);
        let good = vec![
            known(0, 8_000, crc(0, 8_000)),
            known(8_000, 20_000, crc(8_000, 20_000)),
            known(40_000, 45_000, crc(40_000, 45_000)),
            known(45_000, 45_000, 0),
        ];
        // A wrong recorded CRC is carried, not recomputed: the output then fails its check.
        let mut bad = good.clone();
        bad[1].crc ^= 1;
        // Records that do not line up with the op (a range starting mid-op) are ignored.
        let misaligned = vec![known(100, 8_000, crc(100, 8_000))];
        for (name, known, expect_ok) in [
            ("none", vec![], true),
            ("good", good, true),
            ("bad", bad, false),
            ("misaligned", misaligned, true),
        ] {
            for window in [64, 4096, 1 << 20] {
                let dst = d.path().join(format!("dst-{name}-{window}"));
                let out = OutputFile {
                    path: "dst".into(),
                    size: 30_008,
                    literals: vec![],
                    checksums: vec![ck(0, 20_000, &[30_000]), ck(20_000, 30_000, &[30_004])],
                };
                let got = run_to(&plan, &src, &dst, out, window, &known);
                let one = crc32fast::hash(&got[0..20_000]).to_le_bytes();
                let two = crc32fast::hash(&got[20_000..30_000]).to_le_bytes();
                assert_eq!(&got[30_004..30_008], &two, "{name} window {window}");
                assert_eq!(
                    got[30_000..30_004] == one,
                    expect_ok,
                    "{name} window {window}"
                );
                assert_eq!(&got[..20_000], &data[..20_000]);
            }
        }
        assert_eq!(
            unknown(0, 10, &[(2, 4), (6, 7)]),
            vec![(0, 2), (4, 6), (7, 10)]
        );
        assert_eq!(unknown(3, 5, &[(0, 4), (4, 9)]), vec![]);
    }

    #[test]
    fn casts_agree_with_half_for_every_16_bit_pattern() {
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        let cast = |from, to| Cast { from, to };
        let mut out = vec![0u8; 65536 * 4];
        // 16-bit -> f32 is exact; NaN payloads are kept as torch's c10 conversions keep them
        // (`half` would set the quiet bit).
        let nan16 = |b: u16| b & 0x7c00 == 0x7c00 && b & 0x03ff != 0;
        convert(cast(DType::BF16, DType::F32), &all, &mut out);
        for (b, o) in (0..=u16::MAX).zip(out.chunks_exact(4)) {
            let got = u32::from_le_bytes(o.try_into().unwrap());
            assert_eq!(got, (b as u32) << 16, "bf16 {b:#06x}");
            let x = bf16::from_bits(b);
            if !x.is_nan() {
                assert_eq!(got, x.to_f32().to_bits(), "bf16 {b:#06x}");
            }
        }
        convert(cast(DType::F16, DType::F32), &all, &mut out);
        for (b, o) in (0..=u16::MAX).zip(out.chunks_exact(4)) {
            let got = u32::from_le_bytes(o.try_into().unwrap());
            let want = if nan16(b) {
                ((b as u32 & 0x8000) << 16) | 0x7f80_0000 | ((b as u32 & 0x03ff) << 13)
            } else {
                f16::from_bits(b).to_f32().to_bits()
            };
            assert_eq!(got, want, "f16 {b:#06x}");
        }
        // f32 -> 16-bit: round to nearest even, as half (and torch) do, specials included
        let mut vals: Vec<u32> = (0..200_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        vals.extend([
            0,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0x3f80_8000,
            0x3f81_8000,
        ]);
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut half_out = vec![0u8; vals.len() * 2];
        convert(cast(DType::F32, DType::BF16), &src, &mut half_out);
        for (v, o) in vals.iter().zip(half_out.chunks_exact(2)) {
            let want = bf16::from_f32(f32::from_bits(*v)).to_bits();
            assert_eq!(
                u16::from_le_bytes([o[0], o[1]]),
                want,
                "f32 {v:#010x} -> bf16"
            );
        }
        convert(cast(DType::F32, DType::F16), &src, &mut half_out);
        for (v, o) in vals.iter().zip(half_out.chunks_exact(2)) {
            let want = f16::from_f32(f32::from_bits(*v)).to_bits();
            assert_eq!(
                u16::from_le_bytes([o[0], o[1]]),
                want,
                "f32 {v:#010x} -> f16"
            );
        }
    }

    #[test]
    fn casts_round_trip_exactly_representable_values() {
        let vals = [0.0f32, 1.5, -2.25, 65504.0, 1e-3];
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut mid = vec![0u8; vals.len() * 2];
        convert(
            Cast {
                from: DType::F32,
                to: DType::BF16,
            },
            &src,
            &mut mid,
        );
        let mut back = vec![0u8; vals.len() * 4];
        convert(
            Cast {
                from: DType::BF16,
                to: DType::F32,
            },
            &mid,
            &mut back,
        );
        let got: Vec<f32> = back
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for (g, v) in got.iter().zip(vals) {
            assert_eq!(*g, bf16::from_f32(v).to_f32());
        }
        assert_eq!(got[1], 1.5);
        let mut h = vec![0u8; vals.len() * 2];
        convert(
            Cast {
                from: DType::F32,
                to: DType::F16,
            },
            &src,
            &mut h,
        );
        assert_eq!(
            f16::from_bits(u16::from_le_bytes([h[6], h[7]])).to_f32(),
            65504.0
        );
    }
}
