//! Scheduling: how a plan is cut into windows (byte ranges of one destination file, with
//! the literals, clipped copy ops and clipped fills that write them), how many threads run them, and how
//! their bytes would spread over a given number of threads.

use super::crc::CkRange;
use super::OutputFile;
use crate::parts::Span;
use crate::plan::{CopyOp, FillOp, Plan};

/// A piece of one window: literal bytes, (part of) a copy op or (part of) a fill.
#[derive(Clone, Debug)]
pub(super) enum Frag<'a> {
    /// Literal bytes written at destination offset `dst`.
    Lit { dst: u64, bytes: &'a [u8] },
    /// A copy op, clipped to the window.
    Op(CopyOp),
    /// A fill, clipped to the window ([`clip_fill`]).
    Fill(FillOp),
}

impl Frag<'_> {
    /// True for a plain contiguous run (one row, no cast) of at least [`KERNEL_BYTES`]: the
    /// kernel copies it (`copy_file_range`); the window's other bytes are assembled in a
    /// buffer.
    pub(super) fn in_kernel(&self) -> bool {
        matches!(self, Frag::Op(o) if o.count == 1 && o.cast.is_none() && o.len >= KERNEL_BYTES)
    }

    /// The destination bytes `first..past-the-last` the fragment spans.
    pub(super) fn dst_span(&self) -> (u64, u64) {
        match self {
            Frag::Lit { dst, bytes } => (*dst, dst + bytes.len() as u64),
            Frag::Op(o) => o.dst_span(),
            Frag::Fill(o) => o.dst_span(),
        }
    }

    /// Destination bytes the fragment writes.
    pub(super) fn bytes_written(&self) -> u64 {
        match self {
            Frag::Lit { bytes, .. } => bytes.len() as u64,
            Frag::Op(o) => o.bytes_written(),
            Frag::Fill(o) => o.bytes_written(),
        }
    }
}

/// Plain runs at least this long are copied by the kernel; shorter ones cost less assembled
/// with their neighbours into one write than a system call each.
pub(super) const KERNEL_BYTES: u64 = 64 << 10;

/// A unit of work: a byte range of one destination file and what fills it.
#[derive(Debug)]
pub(super) struct Window<'a> {
    /// Destination file index.
    pub dst: u32,
    /// First destination byte.
    pub start: u64,
    /// Past-the-last destination byte.
    pub end: u64,
    /// What fills it, in plan order.
    pub frags: Vec<Frag<'a>>,
}

impl Window<'_> {
    /// Destination bytes the window spans.
    pub fn size(&self) -> u64 {
        self.end - self.start
    }
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

/// Clip fill `op` to destination bytes `w0..w1`, pushing the parts to `out`. Each part is a
/// fill of whole elements of its own value: where a cut falls inside an element (a window or
/// span edge need not fall on one), the element's bytes on either side of it become fills of
/// those bytes alone.
pub(super) fn clip_fill(op: &FillOp, w0: u64, w1: u64, out: &mut Vec<FillOp>) {
    let (len, count) = (op.len, op.count);
    if count == 0 || len == 0 || w1 <= w0 {
        return;
    }
    let row = |i: u64| op.dst_offset + i * op.dst_stride;
    // rows i with row(i) < w1 and row(i) + len > w0
    let i_lo = if op.dst_offset + len > w0 || op.dst_stride == 0 {
        0
    } else {
        (w0 - op.dst_offset - len) / op.dst_stride + 1
    };
    let i_hi = match (w1 <= op.dst_offset, op.dst_stride) {
        (true, _) => 0,
        (false, 0) => 1,
        (false, ds) => (w1 - op.dst_offset).div_ceil(ds).min(count),
    };
    // the rows wholly inside, as one fill
    let (mut full_lo, mut full_hi) = (i_hi, i_hi);
    for i in i_lo..i_hi {
        if row(i) >= w0 && row(i) + len <= w1 {
            full_lo = full_lo.min(i);
            full_hi = i + 1;
        }
    }
    for i in i_lo..i_hi {
        if (full_lo..full_hi).contains(&i) {
            if i == full_lo {
                out.push(FillOp {
                    dst_offset: row(i),
                    count: full_hi - full_lo,
                    ..op.clone()
                });
            }
            continue;
        }
        let (a, b) = (row(i).max(w0), (row(i) + len).min(w1));
        if a < b {
            fill_part(op, row(i), (a, b), out);
        }
    }
}

/// Push to `out` the fills of bytes `a..b` of the row of fill `op` at `d`, cut at element
/// edges: the tail of an element, whole elements, the head of one.
fn fill_part(op: &FillOp, d: u64, (a, b): (u64, u64), out: &mut Vec<FillOp>) {
    let elem = op.value.len().max(1) as u64;
    let mut push = |from: u64, to: u64, value: &[u8]| {
        if from < to {
            out.push(FillOp {
                dst_offset: from,
                len: to - from,
                count: 1,
                dst_stride: 0,
                value: value.to_vec(),
                ..*op
            });
        }
    };
    let k = ((a - d) % elem) as usize;
    let (ea, eb) = (
        d + (a - d).next_multiple_of(elem),
        d + (b - d) / elem * elem,
    );
    if ea > eb {
        // within one element
        return push(a, b, &op.value[k..k + (b - a) as usize]);
    }
    push(a, ea, &op.value[k..]);
    push(ea, eb, &op.value);
    push(eb, b, &op.value[..(b - eb) as usize]);
}

/// Cut the plan into windows of `window` destination bytes, over every byte of every output.
pub(super) fn windows<'a>(plan: &Plan, outputs: &'a [OutputFile], window: u64) -> Vec<Window<'a>> {
    windows_in(plan, outputs, window, &whole_files(outputs))
}

/// Every byte of every output, as spans.
fn whole_files(outputs: &[OutputFile]) -> Vec<Span> {
    outputs
        .iter()
        .enumerate()
        .map(|(f, o)| Span {
            file: f as u32,
            start: 0,
            end: o.size,
        })
        .collect()
}

/// Cut the plan into windows of `window` destination bytes over `spans` only (sorted by file
/// and start, disjoint, within their files): each span is cut from its start, and the
/// literals and copies are clipped to the windows, so bytes outside the spans are not
/// touched. Windows with nothing to write are left out. Copies and fills never write one byte
/// twice (the planner's promise; checked in debug builds).
pub(super) fn windows_in<'a>(
    plan: &Plan,
    outputs: &'a [OutputFile],
    window: u64,
    spans: &[Span],
) -> Vec<Window<'a>> {
    cut(plan, outputs, window, spans, Frags::All)
}

/// What [`cut`] keeps of each window's fragments.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Frags {
    /// Every fragment: the windows the executor runs.
    All,
    /// The first only: enough to know the window writes something, in memory bounded by
    /// the number of windows (a plan's fragments would take as much memory as the plan).
    First,
}

/// [`windows_in`], keeping `keep` of each window's fragments.
fn cut<'a>(
    plan: &Plan,
    outputs: &'a [OutputFile],
    window: u64,
    spans: &[Span],
    keep: Frags,
) -> Vec<Window<'a>> {
    let window = window.max(8) / 8 * 8;
    let first_only = keep == Frags::First;
    let mut wins: Vec<Window> = vec![];
    for s in spans {
        let mut a = s.start;
        while a < s.end {
            // edges on the whole run's grid (multiples of `window`), so a cut never falls
            // inside an element even where a span starts off it
            let b = s.end.min((a / window + 1).saturating_mul(window));
            wins.push(Window {
                dst: s.file,
                start: a,
                end: b,
                frags: vec![],
            });
            a = b;
        }
    }
    // the windows of file f are wins[first[f]..first[f + 1]], sorted by start
    let mut first = vec![0usize; outputs.len() + 1];
    for w in &wins {
        if let Some(n) = first.get_mut(w.dst as usize + 1) {
            *n += 1;
        }
    }
    for f in 0..outputs.len() {
        first[f + 1] += first[f];
    }
    // the windows of file f overlapping bytes a..b
    fn overlapping(
        wins: &[Window],
        first: &[usize],
        f: u32,
        a: u64,
        b: u64,
    ) -> std::ops::Range<usize> {
        let (lo, hi) = (first[f as usize], first[f as usize + 1]);
        let ws = &wins[lo..hi];
        let i = ws.partition_point(|w| w.end <= a);
        let j = ws.partition_point(|w| w.start < b);
        lo + i..lo + j.max(i)
    }
    // with `Frags::First`, a window that has a fragment is not clipped into again
    let done = |w: &Window| first_only && !w.frags.is_empty();
    for (f, o) in outputs.iter().enumerate() {
        for (off, bytes) in &o.literals {
            let end = off + bytes.len() as u64;
            for k in overlapping(&wins, &first, f as u32, *off, end) {
                let w = &mut wins[k];
                if done(w) {
                    continue;
                }
                let (a, b) = ((*off).max(w.start), end.min(w.end));
                let s = &bytes[(a - off) as usize..(b - off) as usize];
                w.frags.push(Frag::Lit { dst: a, bytes: s });
            }
        }
    }
    let mut scratch = vec![];
    for op in &plan.ops {
        let (a, b) = op.dst_span();
        if b <= a || op.dst as usize >= outputs.len() {
            continue;
        }
        for k in overlapping(&wins, &first, op.dst, a, b) {
            let w = &mut wins[k];
            if first_only {
                if !done(w) {
                    clip(op, w.start, w.end, &mut scratch);
                    w.frags.extend(scratch.drain(..).take(1));
                }
            } else {
                clip(op, w.start, w.end, &mut w.frags);
            }
        }
    }
    let mut cut = vec![];
    for op in &plan.fills {
        if op.count == 0 || op.dst as usize >= outputs.len() {
            continue;
        }
        let (a, b) = op.dst_span();
        for k in overlapping(&wins, &first, op.dst, a, b) {
            let w = &mut wins[k];
            if done(w) {
                continue;
            }
            clip_fill(op, w.start, w.end, &mut cut);
            let n = if first_only { 1 } else { cut.len() };
            w.frags.extend(cut.drain(..).take(n).map(Frag::Fill));
        }
    }
    debug_assert!(
        first_only || wins.iter().all(writes_once),
        "a fill overlaps a copy, a literal or another fill"
    );
    wins.into_iter().filter(|w| !w.frags.is_empty()).collect()
}

/// True when no byte of window `w` is written by a fill and by another fragment too (checked
/// only for windows with fills: copies alone are checked by the planner's tests).
fn writes_once(w: &Window) -> bool {
    if !w.frags.iter().any(|f| matches!(f, Frag::Fill(_))) {
        return true;
    }
    let mut seen = vec![false; w.size() as usize];
    let mut rows = |d: u64, len: u64, count: u64, stride: u64| -> bool {
        (0..count).all(|r| {
            let a = (d + r * stride - w.start) as usize;
            seen[a..a + len as usize]
                .iter_mut()
                .all(|b| !std::mem::replace(b, true))
        })
    };
    w.frags.iter().all(|f| match f {
        Frag::Lit { dst, bytes } => rows(*dst, bytes.len() as u64, 1, 0),
        Frag::Op(o) => rows(o.dst_offset, o.dst_len(), o.count, o.dst_stride),
        Frag::Fill(o) => rows(o.dst_offset, o.len, o.count, o.dst_stride),
    })
}

/// The copies and fills of `plan` that write into `spans` (sorted by file and start,
/// disjoint, from [`crate::parts::split`]), clipped to them: the plan of one part of a
/// conversion ([`crate::parts`]). Its tensor summaries are left out.
pub fn restrict(plan: &Plan, spans: &[Span]) -> Plan {
    let mut ops = vec![];
    each_reaching(
        &plan.ops,
        spans,
        |o| (o.dst, o.dst_offset),
        CopyOp::dst_span,
        |o, s| {
            let mut frags = vec![];
            clip(o, s.start, s.end, &mut frags);
            ops.extend(frags.into_iter().filter_map(|f| match f {
                Frag::Op(o) => Some(o),
                _ => None,
            }));
        },
    );
    let mut fills = vec![];
    each_reaching(
        &plan.fills,
        spans,
        |o| (o.dst, o.dst_offset),
        FillOp::dst_span,
        |o, s| clip_fill(o, s.start, s.end, &mut fills),
    );
    Plan {
        ops,
        tensors: vec![],
        fills,
    }
}

/// Call `f` with each of `items` (copies or fills, sorted by destination file and offset, at
/// `key`) that reaches into each of `spans`, and the span. They do not overlap, and a strided
/// one never crosses a span's edge ([`crate::parts::split`]), so only the last one starting
/// before a span can reach into it.
fn each_reaching<T>(
    items: &[T],
    spans: &[Span],
    key: impl Fn(&T) -> (u32, u64),
    span: impl Fn(&T) -> (u64, u64),
    mut f: impl FnMut(&T, &Span),
) {
    for s in spans {
        let mut i = items.partition_point(|o| key(o) < (s.file, s.start));
        if i > 0 && key(&items[i - 1]).0 == s.file && span(&items[i - 1]).1 > s.start {
            i -= 1;
        }
        for o in items[i..]
            .iter()
            .take_while(|o| key(o).0 == s.file && key(o).1 < s.end)
        {
            f(o, s);
        }
    }
}

/// Worker threads when none are asked for: one per core when at least a tenth of the bytes
/// pass through user space (short or gathered copies, casts, literals, or checksums to hash), otherwise
/// one. Kernel copies into one file serialise on the file's lock, so a second thread only
/// adds contention there, while hashing and gathering gain from more threads
/// (BENCHMARKS.md, executor experiments).
pub(super) fn default_threads(
    wins: &[Window],
    ranges: &[Vec<CkRange>],
    skip: &[Vec<(u64, u64)>],
) -> usize {
    let total: u64 = wins.iter().map(Window::size).sum();
    let gathered: u64 = wins
        .iter()
        .flat_map(|w| &w.frags)
        .filter(|f| !f.in_kernel())
        .map(Frag::bytes_written)
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

/// Bytes of destination each of `threads` workers would get if windows were dealt greedily
/// (largest first) — the per-thread balance `reshard plan` shows. The windows are those
/// `windows` cuts, found keeping one fragment of each (`Frags::First`).
pub fn balance(plan: &Plan, outputs: &[OutputFile], threads: usize, window: u64) -> Vec<u64> {
    let whole = whole_files(outputs);
    let mut sizes: Vec<u64> = cut(plan, outputs, window, &whole, Frags::First)
        .iter()
        .map(Window::size)
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

    /// `balance`'s windows (one fragment kept of each) are exactly those `windows` makes:
    /// literals (an empty one included), strided copies whose rows skip whole windows, fills,
    /// a zero-size file and ops and literals past a file's end.
    #[test]
    fn written_windows_are_the_windows_with_fragments() {
        let file = |size: u64, literals: Vec<(u64, &[u8])>| OutputFile {
            path: "f".into(),
            size,
            literals: literals.into_iter().map(|(o, b)| (o, b.into())).collect(),
            checksums: vec![],
        };
        let outputs = vec![
            file(
                1000,
                vec![(0, b"abcd"), (96, b""), (101, b""), (990, b"0123456789")],
            ),
            file(0, vec![]),
            file(517, vec![(500, b"xy")]),
        ];
        let op = |dst: u32, dst_offset: u64, len: u64, count: u64, dst_stride: u64| CopyOp {
            src: 0,
            src_offset: 0,
            dst,
            dst_offset,
            len,
            count,
            src_stride: len,
            dst_stride,
            cast: None,
        };
        let plan = Plan {
            ops: vec![
                op(0, 200, 8, 4, 200),
                op(0, 300, 16, 1, 0),
                op(2, 0, 8, 3, 160),
                op(2, 511, 6, 1, 0),
                op(5, 0, 8, 1, 0),
            ],
            tensors: vec![],
            fills: vec![
                FillOp {
                    dst: 0,
                    dst_offset: 700,
                    len: 4,
                    count: 2,
                    dst_stride: 150,
                    value: vec![1, 2, 3, 4],
                },
                FillOp {
                    dst: 2,
                    dst_offset: 400,
                    len: 2,
                    count: 0,
                    dst_stride: 0,
                    value: vec![0, 0],
                },
            ],
        };
        for window in [8, 64, 96, 100, 4096] {
            let want: Vec<(u64, u64)> = windows(&plan, &outputs, window)
                .iter()
                .map(|w| (w.start, w.end))
                .collect();
            let first = cut(
                &plan,
                &outputs,
                window,
                &whole_files(&outputs),
                Frags::First,
            );
            assert!(first.iter().all(|w| w.frags.len() == 1), "window {window}");
            let got: Vec<(u64, u64)> = first.iter().map(|w| (w.start, w.end)).collect();
            assert_eq!(got, want, "window {window}");
        }
        // 1000 + 517 bytes in 64-byte windows, some never written: not every byte counts
        let load = balance(&plan, &outputs, 2, 64);
        assert_eq!(load.len(), 2);
        assert!(load.iter().sum::<u64>() < 1517);
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
}
