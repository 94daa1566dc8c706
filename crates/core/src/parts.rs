//! Parts of a conversion for many workers: which worker this is ([`Part`], from `--part K/N` or
//! a launcher's environment, [`Part::from_env`]) and which destination bytes each part writes
//! ([`split`]), computed from the plan alone so that every worker, given the same plan, finds
//! the same parts without talking to the others.
//!
//! A part is a set of byte ranges of destination files. Where there are enough files, parts are
//! whole files; a file larger than a part's fair share is cut into ranges at points no strided
//! copy or fill crosses. Every byte counts, copied, filled (padding) or literal. Ranges are then dealt to parts largest first, each to the part with the fewest
//! bytes so far (ties to the lower index), which keeps every part within one range of the
//! mean.

use crate::error::{Error, Result};
use crate::plan::Plan;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Most parts a conversion may be split into.
pub const MAX_PARTS: u32 = 1 << 16;

/// Part `index` of `count` (`0 <= index < count`), counted as a launcher counts ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Part {
    /// This part, from 0.
    pub index: u32,
    /// How many parts.
    pub count: u32,
}

impl Part {
    /// Part `index` of `count`, checked.
    pub fn new(index: u64, count: u64) -> std::result::Result<Part, String> {
        if count == 0 || count > MAX_PARTS as u64 {
            return Err(format!(
                "a conversion has 1 to {MAX_PARTS} parts, not {count}"
            ));
        }
        if index >= count {
            return Err(format!(
                "part {index} of {count} does not exist (parts are numbered 0 to {})",
                count - 1
            ));
        }
        Ok(Part {
            index: index as u32,
            count: count as u32,
        })
    }

    /// The whole conversion: part 0 of 1.
    pub fn whole() -> Part {
        Part { index: 0, count: 1 }
    }

    /// The part a launcher's environment gives this process, and the launcher's name:
    /// torchrun (`RANK`, `WORLD_SIZE`), a Slurm array job (`SLURM_ARRAY_TASK_ID` with
    /// `SLURM_ARRAY_TASK_MIN` and `SLURM_ARRAY_TASK_COUNT` or `_MAX`, and `_STEP`), Slurm tasks
    /// (`SLURM_PROCID`, `SLURM_NTASKS`), a Kubernetes indexed job (`JOB_COMPLETION_INDEX`, with
    /// the count in `RESHARD_PARTS`), in that order; `None` when none is set. `var` reads a
    /// variable (`std::env::var` in use, a table in tests).
    pub fn from_env(
        var: impl Fn(&str) -> Option<String>,
    ) -> std::result::Result<Option<(Part, &'static str)>, String> {
        let num = |name: &str| -> std::result::Result<Option<u64>, String> {
            match var(name) {
                None => Ok(None),
                Some(v) => v.trim().parse().map(Some).map_err(|_| {
                    format!("the environment variable {name}={v:?} is not a non-negative integer")
                }),
            }
        };
        let pair = |i: &str, n: &str| -> std::result::Result<Option<(u64, u64)>, String> {
            match (num(i)?, num(n)?) {
                (Some(i), Some(n)) => Ok(Some((i, n))),
                (None, None) => Ok(None),
                (Some(_), None) => Err(format!("{i} is set but {n} is not")),
                (None, Some(_)) => Err(format!("{n} is set but {i} is not")),
            }
        };
        let found = |(i, n): (u64, u64), who: &'static str, vars: &str| {
            Part::new(i, n)
                .map(|p| Some((p, who)))
                .map_err(|e| format!("{vars} ({who}): {e}"))
        };
        if let Some(p) = pair("RANK", "WORLD_SIZE")? {
            return found(p, "torchrun", "RANK/WORLD_SIZE");
        }
        if let Some(id) = num("SLURM_ARRAY_TASK_ID")? {
            let min = num("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
            let step = num("SLURM_ARRAY_TASK_STEP")?.unwrap_or(1).max(1);
            let count = match (num("SLURM_ARRAY_TASK_COUNT")?, num("SLURM_ARRAY_TASK_MAX")?) {
                (Some(c), _) => c,
                (None, Some(max)) if max >= min => (max - min) / step + 1,
                _ => {
                    return Err(
                        "SLURM_ARRAY_TASK_ID is set but neither SLURM_ARRAY_TASK_COUNT nor a \
                                SLURM_ARRAY_TASK_MAX >= SLURM_ARRAY_TASK_MIN"
                            .into(),
                    )
                }
            };
            if id < min || (id - min) % step != 0 {
                return Err(format!(
                    "SLURM_ARRAY_TASK_ID={id} is not in the array {min}..(step {step})"
                ));
            }
            return found(
                ((id - min) / step, count),
                "Slurm array job",
                "SLURM_ARRAY_TASK_*",
            );
        }
        if let Some(p) = pair("SLURM_PROCID", "SLURM_NTASKS")? {
            return found(p, "Slurm tasks", "SLURM_PROCID/SLURM_NTASKS");
        }
        if let Some(i) = num("JOB_COMPLETION_INDEX")? {
            let n = num("RESHARD_PARTS")?.ok_or(
                "JOB_COMPLETION_INDEX is set (a Kubernetes indexed job): give the number of \
                 parts, the job's completions, in RESHARD_PARTS or with --part K/N",
            )?;
            return found(
                (i, n),
                "Kubernetes indexed job",
                "JOB_COMPLETION_INDEX/RESHARD_PARTS",
            );
        }
        Ok(None)
    }
}

/// The part this process runs, from `given` (`--part`, `part=`) or else from a launcher's
/// environment ([`Part::from_env`] over the process's variables), with where it came from;
/// `None` for a whole conversion (neither, or a count of 1).
pub fn choose(given: Option<Part>) -> Result<Option<(Part, &'static str)>> {
    let found = match given {
        Some(p) => Some((p, "given")),
        None => Part::from_env(|k| std::env::var(k).ok()).map_err(Error::usage)?,
    };
    Ok(found.filter(|(p, _)| p.count > 1))
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl FromStr for Part {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Part, String> {
        let bad = || format!("`{s}` is not a part: expected K/N, such as 0/4");
        let (k, n) = s.split_once('/').ok_or_else(bad)?;
        let k: u64 = k.trim().parse().map_err(|_| bad())?;
        let n: u64 = n.trim().parse().map_err(|_| bad())?;
        Part::new(k, n)
    }
}

/// Bytes `start..end` of destination file `file`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Destination file index.
    pub file: u32,
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

impl Span {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// True when it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Split the destination files (their sizes, `sizes[f]` for file `f`) written by `plan` (its
/// copies and fills sorted by destination file and offset, as planned) into `count` parts of
/// about equal bytes: per part, its spans sorted by file and offset. Every byte of every file
/// is in exactly one part; cuts inside a file fall on multiples of [`CUT_ALIGN`]; a strided
/// copy or fill (`count > 1`) never crosses a span's edge, a contiguous one may (the executor
/// clips it). Deterministic: the same inputs give the same parts on every worker. Parts may be
/// empty when there are fewer spans than parts.
pub fn split(sizes: &[u64], plan: &Plan, count: u32) -> Result<Vec<Vec<Span>>> {
    if count == 0 {
        return Err(Error::usage("a conversion has at least one part"));
    }
    let total: u64 = sizes.iter().sum();
    let share = total.div_ceil(count as u64).max(1);
    let (ops, fills) = (&plan.ops, &plan.fills);
    let mut spans = vec![];
    let (mut at, mut at_fill) = (0, 0);
    for (f, &size) in sizes.iter().enumerate() {
        let file = f as u32;
        let (first, first_fill) = (at, at_fill);
        while at < ops.len() && ops[at].dst == file {
            at += 1;
        }
        while at_fill < fills.len() && fills[at_fill].dst == file {
            at_fill += 1;
        }
        if size <= share {
            spans.push(Span {
                file,
                start: 0,
                end: size,
            });
            continue;
        }
        // cut at each multiple of the share, or just past the strided copy it falls in
        // (a contiguous copy can be cut at any page; a strided one's rows interleave with others)
        let blocked = strided_spans(
            ops[first..at]
                .iter()
                .filter(|o| o.count > 1)
                .map(|o| o.dst_span())
                .chain(
                    fills[first_fill..at_fill]
                        .iter()
                        .filter(|o| o.count > 1)
                        .map(|o| o.dst_span()),
                ),
        );
        let mut start = 0;
        let mut bi = 0;
        loop {
            let mut cut = (start + share).next_multiple_of(CUT_ALIGN);
            while bi < blocked.len() && blocked[bi].1 <= cut {
                bi += 1;
            }
            if let Some(&(a, b)) = blocked.get(bi) {
                if a < cut {
                    cut = b;
                }
            }
            if cut >= size {
                break;
            }
            spans.push(Span {
                file,
                start,
                end: cut,
            });
            start = cut;
        }
        spans.push(Span {
            file,
            start,
            end: size,
        });
    }
    if at != ops.len() || at_fill != fills.len() {
        return Err(Error::usage(
            "the plan writes a file the output does not have, or its copies or fills are not sorted",
        ));
    }
    // largest first, each to the part with the fewest bytes (ties: the lower index)
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by(|&a, &b| spans[b].len().cmp(&spans[a].len()).then(a.cmp(&b)));
    let mut load = vec![0u64; count as usize];
    let mut parts: Vec<Vec<Span>> = vec![vec![]; count as usize];
    for i in order {
        let p = (0..count as usize)
            .min_by_key(|&p| (load[p], p))
            .unwrap_or(0);
        load[p] += spans[i].len();
        parts[p].push(spans[i]);
    }
    for p in &mut parts {
        p.sort_by_key(|s| (s.file, s.start));
    }
    Ok(parts)
}

/// Cuts inside a file fall on multiples of this: whole pages, so no two parts write one page
/// (which file systems shared between machines handle poorly), and never inside an element.
pub const CUT_ALIGN: u64 = 4096;

/// The byte spans of a file's strided copies and fills (`count > 1`), sorted and merged where
/// they overlap: a cut inside one would split rows that interleave with other copies or fills.
fn strided_spans(spans: impl Iterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut all: Vec<(u64, u64)> = spans.collect();
    all.sort_unstable();
    let mut v: Vec<(u64, u64)> = vec![];
    for (a, b) in all {
        match v.last_mut() {
            Some(last) if a < last.1 => last.1 = last.1.max(b),
            _ => v.push((a, b)),
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{CopyOp, FillOp};

    fn op(dst: u32, off: u64, len: u64, count: u64, stride: u64) -> CopyOp {
        CopyOp {
            src: 0,
            src_offset: 0,
            dst,
            dst_offset: off,
            len,
            count,
            src_stride: len,
            dst_stride: stride,
            cast: None,
        }
    }

    #[test]
    fn parts_parse_and_come_from_launchers() {
        assert_eq!("3/8".parse::<Part>(), Ok(Part { index: 3, count: 8 }));
        assert!("8/8"
            .parse::<Part>()
            .unwrap_err()
            .contains("does not exist"));
        assert!("1/0".parse::<Part>().is_err());
        assert!("x".parse::<Part>().unwrap_err().contains("expected K/N"));
        let env = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };
        let got = |pairs: &[(&str, &str)]| Part::from_env(env(pairs));
        assert_eq!(got(&[]), Ok(None));
        assert_eq!(
            got(&[
                ("RANK", "2"),
                ("WORLD_SIZE", "4"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1")
            ]),
            Ok(Some((Part { index: 2, count: 4 }, "torchrun")))
        );
        assert_eq!(
            got(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "6")]),
            Ok(Some((Part { index: 5, count: 6 }, "Slurm tasks")))
        );
        // an array job's task is one Slurm task of its own: the array wins
        assert_eq!(
            got(&[
                ("SLURM_ARRAY_TASK_ID", "7"),
                ("SLURM_ARRAY_TASK_MIN", "3"),
                ("SLURM_ARRAY_TASK_MAX", "9"),
                ("SLURM_ARRAY_TASK_STEP", "2"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "1"),
            ]),
            Ok(Some((Part { index: 2, count: 4 }, "Slurm array job")))
        );
        assert_eq!(
            got(&[
                ("SLURM_ARRAY_TASK_ID", "1"),
                ("SLURM_ARRAY_TASK_COUNT", "3")
            ]),
            Ok(Some((Part { index: 1, count: 3 }, "Slurm array job")))
        );
        assert_eq!(
            got(&[("JOB_COMPLETION_INDEX", "0"), ("RESHARD_PARTS", "2")]),
            Ok(Some((
                Part { index: 0, count: 2 },
                "Kubernetes indexed job"
            )))
        );
        assert!(got(&[("JOB_COMPLETION_INDEX", "0")])
            .unwrap_err()
            .contains("RESHARD_PARTS"));
        assert!(got(&[("RANK", "0")])
            .unwrap_err()
            .contains("WORLD_SIZE is not"));
        assert!(got(&[("RANK", "4"), ("WORLD_SIZE", "4")])
            .unwrap_err()
            .contains("torchrun"));
        assert!(got(&[("RANK", "-1"), ("WORLD_SIZE", "4")]).is_err());
    }

    /// A plan of `ops` and `fills`.
    fn plan_of(ops: &[CopyOp], fills: &[FillOp]) -> Plan {
        Plan {
            ops: ops.to_vec(),
            fills: fills.to_vec(),
            tensors: vec![],
        }
    }

    /// Every byte once, spans never cut a strided copy or fill, every part within one span of
    /// the mean.
    fn check(sizes: &[u64], plan: &Plan, count: u32) -> Vec<Vec<Span>> {
        let parts = split(sizes, plan, count).unwrap();
        assert_eq!(parts.len(), count as usize);
        let mut all: Vec<Span> = parts.iter().flatten().copied().collect();
        all.sort_by_key(|s| (s.file, s.start));
        let mut next = vec![0u64; sizes.len()];
        for s in &all {
            assert_eq!(s.start, next[s.file as usize], "{all:?}");
            assert!(s.end > s.start || sizes[s.file as usize] == 0, "{all:?}");
            next[s.file as usize] = s.end;
        }
        assert_eq!(next, sizes.to_vec());
        let strided = plan
            .ops
            .iter()
            .filter(|o| o.count > 1)
            .map(|o| (o.dst, o.dst_span()));
        let strided_fills = plan.fills.iter().filter(|o| o.count > 1);
        for (f, (a, b)) in strided.chain(strided_fills.map(|o| (o.dst, o.dst_span()))) {
            assert!(
                all.iter()
                    .any(|s| s.file == f && s.start <= a && b <= s.end),
                "{a}..{b} of file {f} crosses a span of {all:?}"
            );
        }
        let loads: Vec<u64> = parts
            .iter()
            .map(|p| p.iter().map(Span::len).sum())
            .collect();
        let biggest = all.iter().map(Span::len).max().unwrap_or(0);
        let mean = sizes.iter().sum::<u64>() / count as u64;
        assert!(
            loads.iter().all(|&l| l <= mean + biggest),
            "{loads:?} mean {mean} biggest {biggest}"
        );
        assert_eq!(split(sizes, plan, count).unwrap(), parts, "deterministic");
        parts
    }

    #[test]
    fn many_files_are_dealt_whole_and_balanced() {
        let sizes: Vec<u64> = (0..64).map(|i| 1000 + (i * 37 % 11) * 100).collect();
        let ops: Vec<CopyOp> = (0..64).map(|f| op(f, 10, 900, 1, 900)).collect();
        let parts = check(&sizes, &plan_of(&ops, &[]), 8);
        assert!(parts.iter().flatten().all(|s| s.start == 0));
        let loads: Vec<u64> = parts
            .iter()
            .map(|p| p.iter().map(Span::len).sum())
            .collect();
        let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
        assert!(hi - lo <= 2000, "{loads:?}");
    }

    /// `n` contiguous copies of 1 MB into file 0, one after the other.
    fn megabytes(n: u64) -> Vec<CopyOp> {
        (0..n)
            .map(|i| op(0, i << 20, 1 << 20, 1, 1 << 20))
            .collect()
    }

    /// Where the parts' spans of file 0 start.
    fn starts_in_file_0(parts: &[Vec<Span>]) -> Vec<u64> {
        parts
            .iter()
            .flatten()
            .filter(|s| s.file == 0)
            .map(|s| s.start)
            .collect()
    }

    #[test]
    fn large_files_are_cut_outside_strided_copies() {
        // one 10 MB file: contiguous copies of 1 MB, then two strided copies interleaved
        // over 2 MB (no cut may fall inside them)
        let mut ops = megabytes(8);
        ops.push(op(0, 8 << 20, 4, 1 << 18, 8));
        ops.push(op(0, (8 << 20) + 4, 4, 1 << 18, 8));
        let sizes = [10u64 << 20, 300];
        for n in [1, 2, 3, 4, 7, 16] {
            let parts = check(&sizes, &plan_of(&ops, &[]), n);
            let cuts = starts_in_file_0(&parts);
            assert!(cuts.iter().all(|&c| c <= 8 << 20), "{n}: {cuts:?}");
        }
        assert_eq!(split(&sizes, &plan_of(&ops, &[]), 1).unwrap()[0].len(), 2);
        assert_eq!(
            check(&[], &plan_of(&[], &[]), 3),
            vec![vec![], vec![], vec![]]
        );
    }

    #[test]
    fn large_files_are_cut_outside_strided_fills() {
        // one 10 MB file: 6 MB copied, then 4 MB of padded rows (8 bytes filled every 16)
        // whose first half interleaves with a strided copy: no cut may fall among the fill's
        // rows either; a file the fills alone write is dealt too
        let mut ops = megabytes(6);
        ops.push(op(0, 6 << 20, 8, 1 << 17, 16));
        let fill = |dst, off, len, count, stride| FillOp {
            dst,
            dst_offset: off,
            len,
            count,
            dst_stride: stride,
            value: vec![0, 0x80],
        };
        let fills = [
            fill(0, (6 << 20) + 8, 8, 1 << 18, 16),
            fill(1, 0, 3 << 20, 1, 0),
        ];
        let sizes = [10u64 << 20, 3 << 20];
        let plan = plan_of(&ops, &fills);
        for n in [2, 3, 4, 7, 16] {
            let parts = check(&sizes, &plan, n);
            let cuts = starts_in_file_0(&parts);
            assert!(cuts.iter().all(|&c| c <= 6 << 20), "{n}: {cuts:?}");
            assert!(parts.iter().flatten().any(|s| s.file == 1));
        }
        let unsorted = plan_of(&ops, &[fills[1].clone(), fills[0].clone()]);
        assert!(split(&sizes, &unsorted, 2).is_err());
    }
}
