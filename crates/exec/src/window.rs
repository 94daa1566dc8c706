//! Running one window: long plain runs are copied by the kernel (`copy_file_range`, or
//! `pwrite` straight from the source mapping where the kernel cannot), and the stretches
//! between them (literals, short, strided or cast copies, fills) are assembled in a
//! per-thread buffer and written once each. Either way the
//! window hashes its share of the output's checksums, and releases the source pages it
//! read through the mapping.

use super::crc::{unknown, CkRange, CrcPart, WHOLE};
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
    /// Also hash every byte written, as parts of checksum [`WHOLE`].
    whole: bool,
}

impl<'a> Shares<'a> {
    fn new(w: &Window, ranges: &[CkRange], skip: &'a [(u64, u64)], whole: bool) -> Self {
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
            whole,
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
/// in `skip`, whose parts known source CRCs give ([`super::crc::known_parts`]). With `whole`,
/// every byte the window writes is hashed too, as parts of checksum [`WHOLE`] (bytes it
/// leaves alone are zeros).
pub(super) fn run_window(
    w: &Window,
    io: &WindowIo,
    (ranges, skip): (&[CkRange], &[(u64, u64)]),
    whole: bool,
) -> Result<Vec<CrcPart>> {
    let mut shares = Shares::new(w, ranges, skip, whole);
    let mut mapped = vec![];
    for seg in segments(w, &shares.hits) {
        match seg {
            Segment::Kernel(o) => copy_run(o, io, &mut shares, &mut mapped)?,
            Segment::Buffer { lo, hi, frags } => {
                assemble(lo, hi, &frags, io, &mut shares)?;
                // Small copies were read with pread, the others from the mapping.
                mapped.extend(frags.iter().filter_map(|f| match f {
                    Frag::Op(o) if !is_small(o) => Some((o.src, o.src_span().0, o.src_span().1)),
                    _ => None,
                }));
            }
        }
    }
    release_spans(io, mapped);
    Ok(shares.parts)
}

/// How one window is written, in destination order: long contiguous runs copied by the
/// kernel, and the bytes between them (literals, short or strided copies, casts, fills, and
/// any checksummed bytes) assembled in the thread's buffer, one write per stretch. Stretches
/// with nothing to write are left alone: destinations are fresh files, so they read as
/// zeros, as an assembled buffer's unwritten bytes would, and checksums count them so.
enum Segment<'w, 'a> {
    /// A run for the kernel ([`Frag::in_kernel`]).
    Kernel(&'w CopyOp),
    /// Destination bytes `lo..hi`, filled by `frags` (each lies within).
    Buffer {
        lo: u64,
        hi: u64,
        frags: Vec<&'w Frag<'a>>,
    },
}

/// Cut window `w` into [`Segment`]s; `hits` are its checksum ranges (a window without
/// kernel runs is one buffer spanning them too, as it always was). A fragment that reaches
/// across a kernel run (rows interleaved with it) makes the whole window one buffer.
fn segments<'w, 'a>(w: &'w Window<'a>, hits: &[CkRange]) -> Vec<Segment<'w, 'a>> {
    let (lo, hi) = buffer_span(w, hits);
    let whole = || {
        vec![Segment::Buffer {
            lo,
            hi,
            frags: w.frags.iter().collect(),
        }]
    };
    let mut runs: Vec<&CopyOp> = w
        .frags
        .iter()
        .filter(|f| f.in_kernel())
        .filter_map(|f| match f {
            Frag::Op(o) => Some(o),
            Frag::Lit { .. } | Frag::Fill(_) => None,
        })
        .collect();
    if runs.is_empty() {
        return whole();
    }
    runs.sort_unstable_by_key(|o| o.dst_offset);
    // the stretches between the runs, each with the fragments inside it
    let mut gaps: Vec<(u64, u64, Vec<&Frag>)> = vec![];
    let mut at = lo;
    for o in &runs {
        if o.dst_offset < at {
            return whole(); // runs overlap: not from a valid plan, but stay correct
        }
        gaps.push((at, o.dst_offset, vec![]));
        at = o.dst_offset + o.len;
    }
    gaps.push((at, hi.max(at), vec![]));
    for f in w.frags.iter().filter(|f| !f.in_kernel()) {
        let (a, b) = f.dst_span();
        let k = gaps.partition_point(|g| g.1 <= a);
        match gaps.get_mut(k) {
            Some(g) if g.0 <= a && b <= g.1 => g.2.push(f),
            _ => return whole(),
        }
    }
    let mut out = vec![];
    let mut gaps = gaps.into_iter();
    for o in runs {
        if let Some((a, b, frags)) = gaps.next() {
            push_stretch(&mut out, a, b, frags);
        }
        out.push(Segment::Kernel(o));
    }
    if let Some((a, b, frags)) = gaps.next() {
        push_stretch(&mut out, a, b, frags);
    }
    out
}

/// Add the stretch `a..b` filled by `frags` to `out`, unless nothing in it is written (a
/// checksum over it counts its bytes as the zeros they are).
fn push_stretch<'w, 'a>(out: &mut Vec<Segment<'w, 'a>>, a: u64, b: u64, frags: Vec<&'w Frag<'a>>) {
    if a < b && !frags.is_empty() {
        out.push(Segment::Buffer {
            lo: a,
            hi: b,
            frags,
        });
    }
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

/// Copy the plain contiguous run `o` in the kernel where it can (else write it from the
/// source mapping). Its checksummed bytes are hashed from the mapping, unless known source
/// CRCs give them; spans read through the mapping are added to `mapped`
/// (`copy_file_range` reads through the page cache).
fn copy_run(
    o: &CopyOp,
    io: &WindowIo,
    shares: &mut Shares,
    mapped: &mut Vec<(u32, u64, u64)>,
) -> Result<()> {
    let d0 = o.dst_offset;
    for (ck, x, y) in shares.to_hash(d0, d0 + o.len) {
        let s = o.src_offset + (x - d0);
        shares.hash(
            ck,
            x,
            &io.srcs[o.src as usize][s as usize..(s + (y - x)) as usize],
        );
        mapped.push((o.src, s, s + (y - x)));
    }
    if shares.whole {
        shares.hash(WHOLE, d0, io.row(o, 0));
        mapped.push((o.src, o.src_offset, o.src_offset + o.len));
    }
    let src = &io.src_files[o.src as usize];
    let kernel = kernel_copy_available()
        && copy_range(src, o.src_offset, io.dst, o.dst_offset, o.len).at_write(io.dst_path)?;
    if !kernel {
        io.write(io.row(o, 0), o.dst_offset)?;
        mapped.push((o.src, o.src_offset, o.src_offset + o.len));
    }
    Ok(())
}

/// Assemble destination bytes `lo..hi` in the thread's buffer from `frags` (literals,
/// gathered rows, casts, fills; bytes no fragment writes are zeros), hash their share of the
/// checksums from there, and write them at once.
fn assemble(lo: u64, hi: u64, frags: &[&Frag], io: &WindowIo, shares: &mut Shares) -> Result<()> {
    let covered: u64 = frags.iter().map(|f| f.bytes_written()).sum();
    BUF.with(|buf| -> Result<()> {
        let mut buf = buf.borrow_mut();
        buf.resize((hi - lo) as usize, 0);
        if covered < hi - lo {
            buf.fill(0);
        }
        for f in frags {
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
                Frag::Fill(o) => o.write_into(&mut buf, lo),
            }
        }
        for (ck, x, y) in shares.to_hash(lo, hi) {
            shares.hash(ck, x, &buf[(x - lo) as usize..(y - lo) as usize]);
        }
        if shares.whole {
            shares.hash(WHOLE, lo, &buf);
        }
        io.write(&buf, lo)
    })
}

/// The destination bytes `lo..hi` that window `w`'s fragments and checksummed bytes `hits`
/// span.
fn buffer_span(w: &Window, hits: &[CkRange]) -> (u64, u64) {
    let lo = w
        .frags
        .iter()
        .map(|f| f.dst_span().0)
        .min()
        .unwrap_or(w.start);
    let hi = w
        .frags
        .iter()
        .map(|f| f.dst_span().1)
        .max()
        .unwrap_or(w.start);
    let lo = hits.iter().map(|h| h.1).fold(lo, u64::min);
    let hi = hits.iter().map(|h| h.2).fold(hi, u64::max);
    (lo, hi)
}

#[cfg(test)]
mod tests {
    use super::super::{execute_with_known, Checksum, ExecOptions, KnownCrc, OutputFile, Plan};
    use crate::plan::{CopyOp, FillOp};

    /// A small deterministic generator (xorshift), so every case is reproducible.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n.max(1)
        }
        fn within(&mut self, a: u64, b: u64) -> u64 {
            a + self.below(b - a + 1)
        }
    }

    /// Destination bytes laid out as a run of random pieces — literals, long runs for the
    /// kernel, short runs, strided gathers, fills (contiguous, strided, or padding rows
    /// between the rows of a strided copy; of zeros or of a value of 1 to 16 bytes), holes —
    /// and checksums over random spans of them, written into the first bytes (a hole
    /// otherwise).
    fn case(seed: u64, src: &[u8]) -> (Plan, OutputFile, Vec<KnownCrc>) {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let (mut ops, mut literals, mut known) = (vec![], vec![], vec![]);
        let mut fills = vec![];
        let mut at = 64u64;
        let n = src.len() as u64;
        for _ in 0..rng.within(4, 40) {
            let (len, count, stride) = match rng.below(6) {
                5 => {
                    let elem = 1 << rng.below(5);
                    let value: Vec<u8> = match rng.below(3) {
                        0 => vec![0; elem as usize],
                        _ => (0..elem).map(|_| rng.within(1, 255) as u8).collect(),
                    };
                    let pad = elem * rng.within(1, 4);
                    let (len, count, stride) = match rng.below(3) {
                        0 => (elem * rng.within(1, 3000), 1, 0),
                        1 => (pad, rng.within(2, 50), pad + rng.within(0, 30)),
                        _ => {
                            // rows of a strided copy, each followed by its padding
                            let (l, c) = (rng.within(1, 64), rng.within(2, 60));
                            ops.push(CopyOp {
                                src: 0,
                                src_offset: rng.below(n - c * l),
                                dst: 0,
                                dst_offset: at,
                                len: l,
                                count: c,
                                src_stride: l,
                                dst_stride: l + pad,
                                cast: None,
                            });
                            at += l;
                            (pad, c, l + pad)
                        }
                    };
                    fills.push(FillOp {
                        dst: 0,
                        dst_offset: at,
                        len,
                        count,
                        dst_stride: stride,
                        value,
                    });
                    at += (count - 1) * stride + len;
                    continue;
                }
                0 => {
                    let len = rng.within(1, 100);
                    let bytes: Vec<u8> = (0..len).map(|i| (i as u8) ^ 0x5A).collect();
                    literals.push((at, bytes.into()));
                    at += len;
                    continue;
                }
                1 => (rng.within(64 << 10, 300 << 10), 1, 0),
                2 => (rng.within(1, 5000), 1, 0),
                3 => {
                    let len = rng.within(1, 64);
                    (len, rng.within(2, 8), len + rng.within(1, 100))
                }
                _ => {
                    at += rng.within(1, 1000);
                    continue;
                }
            };
            let span = (count - 1) * stride + len;
            let src_offset = rng.below(n - span);
            if count == 1 && rng.below(2) == 0 {
                known.push(KnownCrc {
                    src: 0,
                    offset: src_offset,
                    len,
                    crc: crc32fast::hash(&src[src_offset as usize..(src_offset + len) as usize]),
                });
            }
            ops.push(CopyOp {
                src: 0,
                src_offset,
                dst: 0,
                dst_offset: at,
                len,
                count,
                src_stride: stride,
                dst_stride: len,
                cast: None,
            });
            at += len * count;
        }
        let size = at + rng.below(100);
        let checksums = (0..rng.below(4))
            .map(|i| {
                let a = rng.within(64, size - 1);
                Checksum {
                    range: (a, rng.within(a + 1, size)),
                    at: vec![i * 4],
                    hex: false,
                }
            })
            .collect::<Vec<_>>();
        // checksum ranges must not overlap each other
        let mut checksums = checksums;
        checksums.sort_by_key(|c| c.range);
        let mut end = 0;
        checksums.retain(|c| {
            let keep = c.range.0 >= end;
            if keep {
                end = c.range.1;
            }
            keep
        });
        let out = OutputFile {
            path: "dst".into(),
            size,
            literals,
            checksums,
        };
        let plan = Plan {
            ops,
            tensors: vec![],
            fills,
        };
        (plan, out, known)
    }

    /// What the destination must hold: every literal, op and fill applied to zeros, then
    /// each checksum of the finished bytes written in place.
    fn expected(plan: &Plan, out: &OutputFile, src: &[u8]) -> Vec<u8> {
        let mut want = vec![0u8; out.size as usize];
        apply_reference(plan, out, src, &mut want);
        for c in &out.checksums {
            let crc = crc32fast::hash(&want[c.range.0 as usize..c.range.1 as usize]);
            for &a in &c.at {
                want[a as usize..a as usize + 4].copy_from_slice(&crc.to_le_bytes());
            }
        }
        want
    }

    /// Apply every literal, op and fill to `want`, byte by byte.
    fn apply_reference(plan: &Plan, out: &OutputFile, src: &[u8], want: &mut [u8]) {
        for (at, bytes) in &out.literals {
            want[*at as usize..*at as usize + bytes.len()].copy_from_slice(bytes);
        }
        for o in &plan.ops {
            for r in 0..o.count {
                let s = (o.src_offset + r * o.src_stride) as usize;
                let d = (o.dst_offset + r * o.dst_stride) as usize;
                want[d..d + o.len as usize].copy_from_slice(&src[s..s + o.len as usize]);
            }
        }
        for f in &plan.fills {
            for r in 0..f.count {
                let d = (f.dst_offset + r * f.dst_stride) as usize;
                for i in 0..f.len as usize {
                    want[d + i] = f.value[i % f.value.len()];
                }
            }
        }
    }

    #[test]
    fn parts_write_exactly_the_plan_together() {
        // every random case split into 1..=5 parts, each part run on its own (its plan
        // restricted to its spans) into one shared file, the checksum shares joined at the end
        let d = tempfile::tempdir().unwrap();
        let src_path = d.path().join("src");
        let src: Vec<u8> = (0..(1u32 << 20))
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&src_path, &src).unwrap();
        for seed in 0..40 {
            let (plan, out, _) = case(seed, &src);
            let want = expected(&plan, &out, &src);
            for n in 1..=5u32 {
                let parts = crate::parts::split(&[out.size], &plan, n).unwrap();
                let dst = d.path().join(format!("dst-{seed}-{n}"));
                std::fs::File::create(&dst).unwrap();
                let opts = ExecOptions {
                    window: 4096 + 8 * seed,
                    sync: false,
                    ..Default::default()
                };
                let mut shares = vec![];
                let mut crcs = vec![];
                for spans in &parts {
                    let sub = super::super::restrict(&plan, spans);
                    let w = super::super::execute_part(
                        &sub,
                        crate::Sources::local(std::slice::from_ref(&src_path)),
                        std::slice::from_ref(&out),
                        std::slice::from_ref(&dst),
                        &opts,
                        spans,
                    )
                    .unwrap();
                    shares.extend(w.shares);
                    crcs.extend(spans.iter().copied().zip(w.span_crcs));
                }
                // each span's CRC is that of its bytes before the checksums go in
                let before = std::fs::read(&dst).unwrap();
                for (sp, crc) in crcs {
                    assert_eq!(
                        crc32fast::hash(&before[sp.start as usize..sp.end as usize]),
                        crc,
                        "seed {seed}, {n} parts, span {sp:?}"
                    );
                }
                super::super::write_checksum_shares(
                    std::slice::from_ref(&out),
                    &shares,
                    std::slice::from_ref(&dst),
                )
                .unwrap();
                let got = std::fs::read(&dst).unwrap();
                assert!(got == want, "seed {seed}, {n} parts: output differs");
                std::fs::remove_file(&dst).unwrap();
            }
        }
    }

    #[test]
    fn windows_of_kernel_runs_buffers_and_holes_write_exactly_the_plan() {
        let d = tempfile::tempdir().unwrap();
        let src_path = d.path().join("src");
        let src: Vec<u8> = (0..(1u32 << 20))
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&src_path, &src).unwrap();
        for seed in 0..60 {
            let (plan, out, known) = case(seed, &src);
            let want = expected(&plan, &out, &src);
            for window in [4096, (64 << 10) + 8, 8 << 20] {
                let dst = d.path().join(format!("dst-{seed}-{window}"));
                std::fs::File::create(&dst).unwrap();
                let opts = ExecOptions {
                    window,
                    sync: false,
                    ..Default::default()
                };
                execute_with_known(
                    &plan,
                    crate::Sources::local(std::slice::from_ref(&src_path)),
                    std::slice::from_ref(&out),
                    std::slice::from_ref(&dst),
                    &opts,
                    &known,
                )
                .unwrap();
                let got = std::fs::read(&dst).unwrap();
                assert!(got == want, "seed {seed}, window {window}: output differs");
                std::fs::remove_file(&dst).unwrap();
            }
        }
    }

    #[test]
    fn fills_overwrite_what_the_destination_held_zeros_included() {
        // copies and fills (zero and non-zero) that write every byte of a destination which
        // already holds other bytes, in windows of 8 to 4096 bytes that cut rows and elements
        let d = tempfile::tempdir().unwrap();
        let src_path = d.path().join("src");
        let src: Vec<u8> = (0..4096u32).map(|i| (i % 200) as u8 + 1).collect();
        std::fs::write(&src_path, &src).unwrap();
        let fill = |dst_offset, len, count, dst_stride, value: &[u8]| FillOp {
            dst: 0,
            dst_offset,
            len,
            count,
            dst_stride,
            value: value.to_vec(),
        };
        let copy = |dst_offset, len, count, dst_stride| CopyOp {
            src: 0,
            src_offset: 7,
            dst: 0,
            dst_offset,
            len,
            count,
            src_stride: len,
            dst_stride,
            cast: None,
        };
        // 0..100 zeros; 100..740 rows of 6 copied bytes padded by 10 bytes of a 2-byte
        // value; 740..1000 a 4-byte value; 1000..1592 16-byte elements of zeros
        let plan = Plan {
            ops: vec![copy(100, 6, 40, 16)],
            tensors: vec![],
            fills: vec![
                fill(0, 100, 1, 0, &[0]),
                fill(106, 10, 40, 16, &[0x34, 0x12]),
                fill(740, 260, 1, 0, &[1, 2, 3, 4]),
                fill(1000, 592, 1, 0, &[0; 16]),
            ],
        };
        let out = OutputFile {
            path: "dst".into(),
            size: 1592,
            literals: vec![],
            checksums: vec![],
        };
        let mut want = vec![0xEEu8; out.size as usize];
        apply_reference(&plan, &out, &src, &mut want);
        assert!(!want.contains(&0xEE));
        for window in [8, 24, 64, 4096] {
            let dst = d.path().join(format!("dst-{window}"));
            std::fs::write(&dst, vec![0xEEu8; out.size as usize]).unwrap();
            let opts = ExecOptions {
                window,
                sync: false,
                ..Default::default()
            };
            let stats = execute_with_known(
                &plan,
                crate::Sources::local(std::slice::from_ref(&src_path)),
                std::slice::from_ref(&out),
                std::slice::from_ref(&dst),
                &opts,
                &[],
            )
            .unwrap();
            assert!(std::fs::read(&dst).unwrap() == want, "window {window}");
            assert_eq!(stats.bytes_written, out.size);
        }
    }
}
