//! Verification of a checkpoint's bytes against the CRC-32s its files record
//! ([`crate::formats::RecordCrc`]: torch.save data records of DCP items and `.pt` files, the
//! `reshard.crc32` of safetensors files reshard wrote). Structure — coverage without gaps or
//! conflicting overlaps, shapes and sizes against the files — is checked when a checkpoint is
//! opened; this module checks the data.
//!
//! Records are read from read-only mappings in blocks of at most 8 MiB per worker thread
//! (populated in one call, released after hashing), so memory stays bounded whatever the
//! record size, and checked in parallel.

use crate::error::{Error, IoContext, Result};
use crate::formats::{Checkpoint, RecordCrc};
use crate::plan::Plan;
use rayon::prelude::*;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Bytes of a mapping populated and released at a time.
const BLOCK: usize = 8 << 20;
/// Bytes read per `pread` of the CRC check (a buffer that stays in the core's cache).
const PREAD_BLOCK: usize = 256 << 10;

/// A record whose bytes do not match its recorded CRC-32.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Mismatch {
    /// The file.
    pub file: PathBuf,
    /// What the record holds.
    pub what: String,
    /// Its byte range.
    pub range: (u64, u64),
    /// The recorded CRC-32.
    pub recorded: u32,
    /// The CRC-32 of the bytes.
    pub actual: u32,
}

impl Mismatch {
    /// The mismatch as an error naming the file.
    pub fn to_error(&self) -> Error {
        Error::format(
            &self.file,
            format!(
                "{} (bytes {}..{}) is corrupt: its CRC-32 is {:08x}, the file records {:08x}",
                self.what, self.range.0, self.range.1, self.actual, self.recorded
            ),
        )
    }
}

/// What a checksum pass found.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    /// Records checked.
    pub records: usize,
    /// Bytes read to check them.
    pub bytes: u64,
    /// Records that do not match.
    pub mismatches: Vec<Mismatch>,
}

/// Records of at most this many bytes are read with `pread` whatever [`RecordRead`] says.
const SMALL_RECORD: u64 = 64 << 10;

/// How records are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordRead {
    /// With `pread` into a small buffer: it stays in the core's cache, and no page tables
    /// change under the copy running beside the check.
    #[default]
    Pread,
    /// From a read-only mapping, populated and released per block (a measured alternative;
    /// see BENCHMARKS.md).
    Mmap,
}

impl std::str::FromStr for RecordRead {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "pread" => Ok(RecordRead::Pread),
            "mmap" => Ok(RecordRead::Mmap),
            _ => Err(format!(
                "unknown record read `{s}` (expected pread or mmap)"
            )),
        }
    }
}

/// CRC-32 of `len` bytes of `m` (the mapping of `path`) from `offset`: each block's pages are
/// populated in one call and released after hashing, so resident memory stays bounded.
fn crc_of_map(m: &memmap2::Mmap, path: &std::path::Path, offset: u64, len: u64) -> Result<u32> {
    const PAGE: usize = 4096;
    let end = offset
        .checked_add(len)
        .filter(|&e| e <= m.len() as u64)
        .ok_or_else(|| {
            Error::format(
                path,
                format!(
                    "record bytes {offset}..{} lie past the end of the file",
                    offset + len
                ),
            )
        })?;
    let mut h = crc32fast::Hasher::new();
    let mut at = offset as usize;
    while at < end as usize {
        let n = (end as usize - at).min(BLOCK);
        let a = at / PAGE * PAGE;
        let b = ((at + n).div_ceil(PAGE) * PAGE).min(m.len());
        let _ = m.advise_range(memmap2::Advice::PopulateRead, a, b - a);
        h.update(&m[at..at + n]);
        crate::exec::release(m, at as u64, (at + n) as u64);
        at += n;
    }
    Ok(h.finalize())
}

/// CRC-32 of `len` bytes of `f` from `offset`.
fn crc_of(f: &File, path: &std::path::Path, offset: u64, len: u64) -> Result<u32> {
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.resize((len as usize).min(PREAD_BLOCK), 0);
        let mut h = crc32fast::Hasher::new();
        let mut at = offset;
        while at < offset + len {
            let n = ((offset + len - at) as usize).min(PREAD_BLOCK);
            f.read_exact_at(&mut buf[..n], at).at(path)?;
            h.update(&buf[..n]);
            at += n as u64;
        }
        Ok(h.finalize())
    })
}

/// Check `records` of `ck`, reading them as `how` says.
fn check(ck: &Checkpoint, records: &[&RecordCrc], how: RecordRead) -> Result<Report> {
    let files: Vec<File> = ck
        .files
        .iter()
        .map(|p| File::open(p).at(p))
        .collect::<Result<_>>()?;
    let maps: Vec<Option<memmap2::Mmap>> = if how == RecordRead::Mmap {
        files
            .iter()
            .zip(&ck.files)
            .map(|(f, p)| crate::sys::map_file(f, p).map(Some))
            .collect::<Result<_>>()?
    } else {
        files.iter().map(|_| None).collect()
    };
    let results: Vec<Result<Option<Mismatch>>> = records
        .par_iter()
        .map(|r| {
            let path = &ck.files[r.file as usize];
            ck.storage()
                .ensure(path, &[(r.offset, r.offset.saturating_add(r.len))])?;
            // Small records are read: through the mapping, each would cost two madvise
            // calls (populate, release) and a TLB shootdown, a million of them seconds.
            let actual = match &maps[r.file as usize] {
                Some(m) if r.len > SMALL_RECORD => crc_of_map(m, path, r.offset, r.len)?,
                _ => crc_of(&files[r.file as usize], path, r.offset, r.len)?,
            };
            let shown = ck.shown(&ck.files[r.shown.unwrap_or(r.file) as usize]);
            Ok((actual != r.crc).then(|| Mismatch {
                file: shown,
                what: r.what.to_string(),
                range: (r.offset, r.offset + r.len),
                recorded: r.crc,
                actual,
            }))
        })
        .collect();
    let mut report = Report {
        records: records.len(),
        bytes: records.iter().map(|r| r.len).sum(),
        mismatches: vec![],
    };
    for r in results {
        report.mismatches.extend(r?);
    }
    report
        .mismatches
        .sort_by(|a, b| (&a.file, a.range).cmp(&(&b.file, b.range)));
    Ok(report)
}

/// Check every checksum `ck`'s files record.
pub fn checksums(ck: &Checkpoint) -> Result<Report> {
    checksums_with(ck, RecordRead::default())
}

/// [`checksums`], reading the records as `how` says.
pub fn checksums_with(ck: &Checkpoint, how: RecordRead) -> Result<Report> {
    let all: Vec<&RecordCrc> = ck.checksums.iter().collect();
    check(ck, &all, how)
}

/// Check the checksummed records of `ck` that `plan` reads from (a conversion's sources),
/// failing on the first mismatch with an error naming the file; records are read as `how`
/// says.
pub fn sources_of(ck: &Checkpoint, plan: &Plan, how: RecordRead) -> Result<Report> {
    // per source file, the byte spans the plan reads, sorted and merged
    let mut spans: Vec<Vec<(u64, u64)>> = vec![vec![]; ck.files.len()];
    for o in &plan.ops {
        if let Some(v) = spans.get_mut(o.src as usize) {
            v.push(o.src_span());
        }
    }
    for v in &mut spans {
        v.sort_unstable();
        let mut merged: Vec<(u64, u64)> = vec![];
        for &(a, b) in v.iter() {
            match merged.last_mut() {
                Some(l) if a <= l.1 => l.1 = l.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        *v = merged;
    }
    let read = |r: &RecordCrc| {
        let v = &spans[r.file as usize];
        let (a, b) = (r.offset, r.offset + r.len);
        let i = v.partition_point(|s| s.1 <= a);
        v.get(i).is_some_and(|s| s.0 < b)
    };
    let used: Vec<&RecordCrc> = ck.checksums.iter().filter(|r| read(r)).collect();
    let report = check(ck, &used, how)?;
    if let Some(m) = report.mismatches.first() {
        return Err(m.to_error());
    }
    Ok(report)
}
