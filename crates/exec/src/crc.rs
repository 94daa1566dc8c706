//! Output checksums: the CRC-32s an output file carries over its own bytes (zip records,
//! safetensors headers), computed while the bytes stream. Each window hashes its share of
//! a checksum range, shares that source CRCs already give are combined instead of hashed,
//! and the finished CRCs are joined in order and written in place.

use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::sys::WriteContext;
use crate::OutputFile;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// The CRC-32 of bytes `offset..offset + len` of source `src`, taken as given (a checksum the
/// source records). An output checksum over bytes copied whole from a run of such ranges is
/// combined from them instead of hashed, so a kernel copy (`copy_file_range`) never has to
/// bring those bytes into user space. If the source bytes do not match their recorded CRC,
/// the output's CRC does not match its bytes either, and `reshard verify` flags the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownCrc {
    /// Source file index (as in [`crate::plan::CopyOp::src`]).
    pub src: u32,
    /// First byte.
    pub offset: u64,
    /// Bytes covered.
    pub len: u64,
    /// Their CRC-32.
    pub crc: u32,
}

/// The checksum index of a window's hash of every byte it writes (the CRC-32 a part of a
/// conversion records for each of its spans, [`crate::parts`]).
pub(super) const WHOLE: u32 = u32::MAX;

/// One window's share of a [`Checksum`]: the CRC-32 of destination bytes from `start` on.
pub(super) struct CrcPart {
    /// Output file index.
    pub file: u32,
    /// Index of the checksum in that file's list.
    pub ck: u32,
    /// First destination byte hashed.
    pub start: u64,
    /// Bytes hashed.
    pub len: u64,
    /// The hash of those bytes.
    pub hash: crc32fast::Hasher,
}

/// The parts of output checksums that `known` source CRCs give without hashing: direct ops
/// (no cast, one row) whose share of a checksum range is read from a run of consecutive
/// known source ranges. Returns those parts and, per output file, the destination ranges
/// they cover (sorted, disjoint), which the windows then leave unhashed.
pub(super) fn known_parts(
    plan: &Plan,
    outputs: &[OutputFile],
    ranges: &[Vec<CkRange>],
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
pub(super) fn unknown(a: u64, b: u64, skip: &[(u64, u64)]) -> Vec<(u64, u64)> {
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
pub(super) type CkRange = (u32, u64, u64);

/// The checksum ranges of an output file, as `(index, first, past-the-last byte)`.
fn ck_ranges(o: &OutputFile) -> Vec<CkRange> {
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

/// The checksum ranges of every output ([`CkRange`]s, sorted by start), checked to be
/// disjoint and within their file.
pub(super) fn checked_ranges(outputs: &[OutputFile]) -> Result<Vec<Vec<CkRange>>> {
    outputs
        .iter()
        .map(|o| {
            let r = ck_ranges(o);
            if r.windows(2).any(|p| p[0].2 > p[1].1) || r.last().is_some_and(|l| l.2 > o.size) {
                return Err(Error::usage(format!(
                    "{}: checksum ranges overlap or pass the end of the file",
                    o.path.display()
                )));
            }
            Ok(r)
        })
        .collect()
}

/// Join the parts of one checksum over `(a, b)`, sorted by start: bytes no window wrote
/// (file holes) are zeros.
pub(super) fn join_crc(parts: &[CrcPart], (a, b): (u64, u64)) -> u32 {
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

/// Join each checksum's `parts` (streamed by the windows and given by known CRCs, in any
/// order) and write it in place in `files` (the outputs, opened at `dest_paths`).
pub(super) fn write_checksums(
    outputs: &[OutputFile],
    parts: Vec<CrcPart>,
    files: &[Option<File>],
    dest_paths: &[PathBuf],
) -> Result<()> {
    write_checksums_where(outputs, parts, files, dest_paths, &|_, _| true)
}

/// [`write_checksums`] of the checksums `(file, index)` that `keep` accepts only.
pub(super) fn write_checksums_where(
    outputs: &[OutputFile],
    mut parts: Vec<CrcPart>,
    files: &[Option<File>],
    dest_paths: &[PathBuf],
    keep: &dyn Fn(usize, usize) -> bool,
) -> Result<()> {
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
            if !keep(f, i) {
                continue;
            }
            let bytes = if c.hex {
                format!("{crc:08x}").into_bytes()
            } else {
                crc.to_le_bytes().to_vec()
            };
            if let (Some(file), false) = (&files[f], c.at.is_empty()) {
                for &at in &c.at {
                    file.write_all_at(&bytes, at).at_write(&dest_paths[f])?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{execute, execute_with_known, Checksum, ExecOptions};
    use super::*;
    use crate::plan::CopyOp;
    use std::path::Path;

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
            crate::Sources::local(&[src]),
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
            literals: vec![(0, vec![0xAA; 16].into())],
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
            ..Plan::default()
        };
        let opts = ExecOptions {
            window: 4096,
            sync: false,
            ..Default::default()
        };
        execute(
            &plan,
            crate::Sources::local(&[src]),
            &[out],
            std::slice::from_ref(&dst),
            &opts,
        )
        .unwrap();
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
            ..Plan::default()
        };
        for window in [8, 64, 4096, 10_000, 1 << 20] {
            let dst = d.path().join(format!("dst{window}"));
            let out = OutputFile {
                path: "dst".into(),
                size: 33_100,
                literals: vec![
                    (0, vec![0xAA; 100].into()),
                    (33_000, vec![0x55; 100].into()),
                ],
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
            ..Plan::default()
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
}
