//! A destination written by many workers, one part each ([`crate::parts`]), with no process
//! group: the workers share only a staging area beside the destination, `.NAME.reshard-parts/`:
//!
//! - `job.json`, the [`Manifest`]: the output's files and checksums, the number of parts and
//!   a fingerprint of the plan, its sources and its options. The first worker writes it; every
//!   other one compares, so parts of different conversions never mix.
//! - `out`, the output as it is being written (a directory, or the single file).
//! - `part-K-of-N.claim`, held with an exclusive `flock` by the worker writing part K: a second
//!   worker asking for the same part while the first runs is refused; a killed worker's claim
//!   dies with it.
//! - `part-K-of-N.json`, the part's [`Record`], written once its bytes are on disk: its byte
//!   spans with their CRC-32s, its shares of the outputs' own checksums, and the bytes it left
//!   where those checksums go.
//!
//! [`commit`] (run by the worker that writes the last record, or by `reshard commit DST`)
//! takes the destination's [`Lock`], checks that every part is recorded, from the same job,
//! and that together they cover every byte once; reads every span back and checks its CRC;
//! writes the outputs' checksums; and publishes `out` as the single-process commit does.

use super::{file_name, fsync_dir, parent_of, publish, remove_any, Lock};
use crate::error::{Error, Hint, IoContext, Result};
use crate::parts::{Part, Span};
use crate::sys::WriteContext;
use crate::{ChecksumShare, OutputFile};
use rayon::prelude::*;
use reshard_core::output::{from_hex, to_hex};
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The suffix of the staging area of a destination written in parts (`.NAME.reshard-parts`).
pub const PARTS_MARK: &str = ".reshard-parts";

/// Largest record or manifest read back (they are reshard's own files, but a damaged one
/// must not exhaust memory).
const MAX_RECORD: u64 = 1 << 30;

/// A checksum an output file carries, as the manifest stores it ([`crate::Checksum`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestChecksum {
    /// First and past-the-last byte covered.
    pub range: (u64, u64),
    /// Where the CRC is written.
    pub at: Vec<u64>,
    /// Written as 8 hex digits rather than 4 little-endian bytes.
    pub hex: bool,
}

/// An output file, as the manifest stores it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Path relative to the destination (ignored for a single-file output).
    pub path: PathBuf,
    /// Size in bytes.
    pub size: u64,
    /// Its checksums, written at the commit.
    pub checksums: Vec<ManifestChecksum>,
}

impl ManifestFile {
    /// The output checksums of an [`OutputFile`], without its literal bytes.
    fn of(o: &OutputFile) -> ManifestFile {
        ManifestFile {
            path: o.path.clone(),
            size: o.size,
            checksums: o
                .checksums
                .iter()
                .map(|c| ManifestChecksum {
                    range: c.range,
                    at: c.at.clone(),
                    hex: c.hex,
                })
                .collect(),
        }
    }

    /// Back to an [`OutputFile`] (no literals: they are written by the parts).
    fn output(&self) -> OutputFile {
        OutputFile {
            path: self.path.clone(),
            size: self.size,
            literals: vec![],
            checksums: self
                .checksums
                .iter()
                .map(|c| crate::Checksum {
                    range: c.range,
                    at: c.at.clone(),
                    hex: c.hex,
                })
                .collect(),
        }
    }
}

/// What a conversion in parts writes, shared by its workers (`job.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The reshard version that planned it.
    pub reshard: String,
    /// A fingerprint of the plan, the sources (paths, sizes, modification times), the
    /// outputs and the number of parts: equal on every worker of one job.
    pub fingerprint: String,
    /// Number of parts.
    pub parts: u32,
    /// A line saying what is converted, for messages.
    pub what: String,
    /// True for a directory output.
    pub is_dir: bool,
    /// The output files.
    pub files: Vec<ManifestFile>,
}

impl Manifest {
    /// The manifest of a job writing `outputs` in `parts` parts.
    pub fn new(
        fingerprint: String,
        parts: u32,
        what: String,
        is_dir: bool,
        outputs: &[OutputFile],
    ) -> Manifest {
        Manifest {
            reshard: env!("CARGO_PKG_VERSION").to_string(),
            fingerprint,
            parts,
            what,
            is_dir,
            files: outputs.iter().map(ManifestFile::of).collect(),
        }
    }
}

/// A span a part wrote and the CRC-32 of its bytes as written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpanRecord {
    /// Output file index.
    pub file: u32,
    /// First byte.
    pub start: u64,
    /// Past the last byte.
    pub end: u64,
    /// CRC-32 of the bytes as the part wrote them.
    pub crc: u32,
}

/// The bytes a part left where an output checksum is written at the commit (restored before
/// the spans are checked, so a commit interrupted after writing checksums can run again).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placeholder {
    /// Output file index.
    pub file: u32,
    /// Offset.
    pub at: u64,
    /// The bytes, as lowercase hex.
    pub bytes: String,
}

/// What one part wrote (`part-K-of-N.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// The job's fingerprint ([`Manifest::fingerprint`]).
    pub fingerprint: String,
    /// Which part.
    pub part: Part,
    /// Its spans, with their CRC-32s.
    pub spans: Vec<SpanRecord>,
    /// Its shares of the outputs' checksums.
    pub shares: Vec<ChecksumShare>,
    /// What it left where those checksums go.
    pub placeholders: Vec<Placeholder>,
    /// The worker that wrote it (`host pid N`).
    pub worker: String,
    /// Destination bytes written.
    pub bytes: u64,
    /// Seconds it took.
    pub seconds: f64,
}

/// The staging area of a destination written in parts.
#[derive(Debug)]
pub struct PartsArea {
    dest: PathBuf,
    dir: PathBuf,
    manifest: Manifest,
}

/// This worker, as records and claims name it: `host pid N`.
pub fn worker() -> String {
    let host = fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    format!("{host} pid {}", std::process::id())
}

/// Read a JSON file of reshard's own, bounded in size, with errors naming it.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let f = fs::File::open(path).at(path)?;
    let mut text = vec![];
    f.take(MAX_RECORD).read_to_end(&mut text).at(path)?;
    serde_json::from_slice(&text)
        .map_err(|e| Error::format(path, format!("is not a reshard part record ({e})")))
}

/// Read a `job.json` and check it: a number of parts reshard accepts, relative file paths
/// that stay inside the output, checksums inside their files.
fn read_manifest(path: &Path) -> Result<Manifest> {
    let m: Manifest = read_json(path)?;
    let bad = |what: String| Err(Error::format(path, format!("is damaged: {what}")));
    if m.parts == 0 || m.parts > crate::parts::MAX_PARTS {
        return bad(format!("{} parts", m.parts));
    }
    for f in &m.files {
        let inside = f
            .path
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !inside {
            return bad(format!(
                "output file {} is not inside the output",
                f.path.display()
            ));
        }
        for c in &f.checksums {
            let within = |a: u64, n: u64| a.checked_add(n).is_some_and(|e| e <= f.size);
            if c.range.0 > c.range.1
                || c.range.1 > f.size
                || !c.at.iter().all(|&a| within(a, if c.hex { 8 } else { 4 }))
            {
                return bad(format!("a checksum outside {}", f.path.display()));
            }
        }
    }
    Ok(m)
}

/// Write `bytes` to `path` atomically: a temporary file beside it, fsynced, renamed.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut f = fs::File::create(&tmp).at_write(&tmp)?;
    f.write_all(bytes).at_write(&tmp)?;
    f.sync_all().at_write(&tmp)?;
    fs::rename(&tmp, path).at_write(path)
}

impl PartsArea {
    /// The staging area of `dest` (`.NAME.reshard-parts` beside it).
    pub fn dir_of(dest: &Path) -> Result<PathBuf> {
        let name = file_name(dest)?;
        Ok(parent_of(dest).join(format!(".{}{PARTS_MARK}", name.to_string_lossy())))
    }

    /// Join (or start) the staging area of `dest` for the job `manifest` describes. Refused
    /// when `dest` exists and `force` is not set, or when the area holds another job's parts
    /// (another source, plan, options or number of parts).
    pub fn join(dest: &Path, manifest: &Manifest, force: bool) -> Result<PartsArea> {
        super::no_folder(dest)?;
        if fs::symlink_metadata(dest).is_ok() && !force {
            return Err(Error::refused(
                format!("{}: already exists", dest.display()),
                Hint::Force,
            ));
        }
        let dir = Self::dir_of(dest)?;
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(crate::sys::dest_error(dest, e)),
        }
        let path = dir.join("job.json");
        let mine = serde_json::to_vec_pretty(manifest)
            .map_err(|e| Error::usage(format!("cannot encode the job: {e}")))?;
        if !path.exists() {
            // written beside, then linked: of two workers starting at once, one links first
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let tmp = dir.join(format!(
                "job.json.tmp-{}-{nanos}",
                worker().replace([' ', '/'], "-")
            ));
            fs::write(&tmp, &mine).at_write(&tmp)?;
            fs::File::open(&tmp)
                .and_then(|f| f.sync_all())
                .at_write(&tmp)?;
            let linked = fs::hard_link(&tmp, &path);
            let _ = fs::remove_file(&tmp);
            match linked {
                Ok(()) => fsync_dir(&dir)?,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e).at_write(&path),
            }
        }
        let theirs: Manifest = read_manifest(&path)?;
        if theirs.parts != manifest.parts {
            return Err(Error::usage(format!(
                "{}: the staging area {} holds a conversion in {} parts, not {}; run every \
                 part with the same --part K/{}, or remove it to start again",
                dest.display(),
                dir.display(),
                theirs.parts,
                manifest.parts,
                theirs.parts
            )));
        }
        if theirs.fingerprint != manifest.fingerprint || theirs.files != manifest.files {
            return Err(Error::usage(format!(
                "{}: the staging area {} holds parts of another conversion ({}, reshard {}); \
                 this one is {} (reshard {}): another source, other options or another \
                 version; finish that one or remove the staging area",
                dest.display(),
                dir.display(),
                theirs.what,
                theirs.reshard,
                manifest.what,
                manifest.reshard
            )));
        }
        Ok(PartsArea {
            dest: dest.to_path_buf(),
            dir,
            manifest: theirs,
        })
    }

    /// Open the staging area of `dest` as it is (for [`commit`]).
    pub fn open(dest: &Path) -> Result<PartsArea> {
        let dir = Self::dir_of(dest)?;
        let path = dir.join("job.json");
        if !dir.is_dir() {
            return Err(Error::usage(format!(
                "{}: no conversion in parts is staged for it (no {})",
                dest.display(),
                dir.display()
            )));
        }
        if !path.exists() {
            return Err(Error::format(
                &path,
                "is missing: the staging area was not started by reshard",
            ));
        }
        Ok(PartsArea {
            dest: dest.to_path_buf(),
            manifest: read_manifest(&path)?,
            dir,
        })
    }

    /// The staging area's directory.
    #[cfg(any(test, feature = "internals"))]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the output is staged.
    fn out(&self) -> PathBuf {
        self.dir.join("out")
    }

    /// The staged path of every output file (same order as the manifest's).
    pub fn paths(&self) -> Vec<PathBuf> {
        let out = self.out();
        self.manifest
            .files
            .iter()
            .map(|f| {
                if self.manifest.is_dir {
                    out.join(&f.path)
                } else {
                    out.clone()
                }
            })
            .collect()
    }

    /// Create the staged files `files` (indices into the manifest) if they do not exist yet,
    /// leaving what other parts wrote in them.
    pub fn create(&self, files: impl IntoIterator<Item = u32>) -> Result<()> {
        let paths = self.paths();
        if self.manifest.is_dir {
            fs::create_dir_all(self.out()).at_write(self.out())?;
        }
        for f in files {
            let p = &paths[f as usize];
            if let Some(d) = p.parent() {
                fs::create_dir_all(d).at_write(d)?;
            }
            fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(p)
                .at_write(p)?;
        }
        Ok(())
    }

    fn name(&self, part: Part, ext: &str) -> PathBuf {
        self.dir
            .join(format!("part-{:06}-of-{:06}.{ext}", part.index, part.count))
    }

    /// The record of `part`, if it was written.
    pub fn record(&self, part: Part) -> Result<Option<Record>> {
        let p = self.name(part, "json");
        if !p.exists() {
            return Ok(None);
        }
        let r: Record = read_json(&p)?;
        if r.part != part || r.fingerprint != self.manifest.fingerprint {
            return Err(Error::format(
                &p,
                "is the record of another part or another job; remove the staging area and start again",
            ));
        }
        Ok(Some(r))
    }

    /// Claim `part` for this process until the returned [`Claim`] is dropped; refused, naming
    /// the holder, while another process holds it.
    pub fn claim(&self, part: Part) -> Result<Claim> {
        let path = self.name(part, "claim");
        let file = match super::hold(&path)? {
            Ok(file) => file,
            Err(who) => {
                return Err(Error::usage(format!(
                    "{}: part {part} is being written by another worker ({}); each part runs \
                     once (claim {})",
                    self.dest.display(),
                    who.trim(),
                    path.display()
                )))
            }
        };
        file.set_len(0).at_write(&path)?;
        file.write_all_at(format!("{}\n", worker()).as_bytes(), 0)
            .at_write(&path)?;
        Ok(Claim { _file: file })
    }

    /// Write `part`'s record (its bytes must be on disk).
    pub fn write_record(&self, record: &Record) -> Result<()> {
        let p = self.name(record.part, "json");
        let text = serde_json::to_vec(record)
            .map_err(|e| Error::usage(format!("cannot encode the part record: {e}")))?;
        write_atomic(&p, &text)?;
        fsync_dir(&self.dir)
    }

    /// The parts with no record yet.
    pub fn missing(&self) -> Vec<u32> {
        let n = self.manifest.parts;
        (0..n)
            .filter(|&k| !self.name(Part { index: k, count: n }, "json").exists())
            .collect()
    }

    /// The bytes at `part`'s checksum positions within `spans`, read back from the staged
    /// files (what the part left there: the commit restores them before checking spans).
    pub fn placeholders(&self, spans: &[Span]) -> Result<Vec<Placeholder>> {
        let paths = self.paths();
        let mut out = vec![];
        for (f, file) in self.manifest.files.iter().enumerate() {
            for c in &file.checksums {
                let n = if c.hex { 8 } else { 4 };
                for &at in &c.at {
                    // the bytes of at..at + n inside this part's spans (a cut may fall inside)
                    for s in spans.iter().filter(|s| s.file as usize == f) {
                        let (a, b) = (at.max(s.start), (at + n as u64).min(s.end));
                        if a >= b {
                            continue;
                        }
                        let p = &paths[f];
                        let mut bytes = vec![0u8; (b - a) as usize];
                        fs::File::open(p)
                            .and_then(|h| h.read_exact_at(&mut bytes, a))
                            .at(p)?;
                        out.push(Placeholder {
                            file: f as u32,
                            at: a,
                            bytes: to_hex(&bytes),
                        });
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A worker's hold on its part ([`PartsArea::claim`]); released when dropped or when the
/// process dies.
#[derive(Debug)]
pub struct Claim {
    // Held open for the claim's life: closing it releases the flock.
    _file: fs::File,
}

/// What [`commit`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Committed {
    /// The output was checked and published.
    Published {
        /// Destination bytes checked against the parts' CRC-32s.
        checked: u64,
    },
    /// The output had already been published by an earlier commit (stopped before it removed
    /// the staging area, which is now removed).
    Already,
    /// Another process holds the destination's lock (another worker committing); nothing done.
    Busy,
}

/// Check and publish the output staged in parts for `dest`: every part recorded, by the same
/// job, together covering every byte once; every span's bytes read back equal to its CRC-32
/// (skipped when `check` is false); the outputs' checksums written; then the output renamed
/// into place (replacing `dest` only with `force`) and the staging area removed. With `wait`
/// false, returns [`Committed::Busy`] at once if another process holds the destination's
/// lock; otherwise that is an error naming it.
pub fn commit(dest: &Path, force: bool, check: bool, wait: bool) -> Result<Committed> {
    let lock = if wait {
        Lock::acquire(dest)?
    } else {
        match Lock::try_acquire(dest)? {
            Ok(l) => l,
            Err(_) => return Ok(Committed::Busy),
        }
    };
    let dir = PartsArea::dir_of(dest)?;
    if !dir.exists() && fs::symlink_metadata(dest).is_ok() && !wait {
        // another worker committed between our last record and the lock
        return Ok(Committed::Already);
    }
    let area = PartsArea::open(dest)?;
    let out = area.out();
    // a commit stopped after it started publishing: `publishing` names the staged output
    let marker = area.dir.join("publishing");
    if let Ok(text) = fs::read_to_string(&marker) {
        let ours = identity(dest).is_some_and(|id| id == text.trim());
        let staged = identity(&out).is_some_and(|id| id == text.trim());
        if ours || !staged {
            // published (what `out` holds now, if anything, is the output it replaced)
            remove_any(&area.dir);
            return Ok(Committed::Already);
        }
    }
    let missing = area.missing();
    if !missing.is_empty() {
        let n = area.manifest.parts;
        let list: Vec<String> = missing.iter().map(|k| format!("{k}/{n}")).collect();
        return Err(Error::usage(format!(
            "{}: {} of {n} part(s) not written: {} (a worker stopped, or has not run yet); \
             run {} again with the same command and --part K/{n}, then commit",
            dest.display(),
            missing.len(),
            listed(&list, 12),
            if missing.len() == 1 { "it" } else { "them" },
        )));
    }
    let n = area.manifest.parts;
    let records: Vec<Record> = (0..n)
        .map(|k| {
            area.record(Part { index: k, count: n })?.ok_or_else(|| {
                Error::usage(format!(
                    "{}: part {k}/{n} vanished while committing",
                    dest.display()
                ))
            })
        })
        .collect::<Result<_>>()?;
    check_cover(&area, &records)?;
    check_shares(&area, &records)?;
    let paths = area.paths();
    area.create(0..area.manifest.files.len() as u32)?;
    // put back what the parts left where checksums go (a commit stopped after writing them)
    for r in &records {
        for ph in &r.placeholders {
            let p = paths.get(ph.file as usize).ok_or_else(|| {
                Error::format(
                    area.name(r.part, "json"),
                    "names an output file the job does not have",
                )
            })?;
            let bytes = from_hex(&ph.bytes).ok_or_else(|| {
                Error::format(area.name(r.part, "json"), "has a malformed placeholder")
            })?;
            fs::OpenOptions::new()
                .write(true)
                .open(p)
                .and_then(|f| f.write_all_at(&bytes, ph.at))
                .at_write(p)?;
        }
    }
    let mut checked = 0;
    if check {
        let spans: Vec<(&Record, &SpanRecord)> = records
            .iter()
            .flat_map(|r| r.spans.iter().map(move |s| (r, s)))
            .collect();
        spans.par_iter().try_for_each(|(r, s)| -> Result<()> {
            let p = &paths[s.file as usize];
            let crc = crc_of(p, s.start, s.end)?;
            if crc != s.crc {
                // its record goes, so that running the part again rewrites it
                let _ = fs::remove_file(area.name(r.part, "json"));
                return Err(Error::format(
                    p,
                    format!(
                        "bytes {}..{} (part {}, written by {}) do not match their CRC-32 \
                         ({crc:08x}, recorded {:08x}): they changed after the part was written; \
                         its record is removed: run that part again",
                        s.start, s.end, r.part, r.worker, s.crc
                    ),
                ));
            }
            Ok(())
        })?;
        checked = spans.iter().map(|(_, s)| s.end - s.start).sum();
    }
    let outputs: Vec<OutputFile> = area
        .manifest
        .files
        .iter()
        .map(ManifestFile::output)
        .collect();
    let shares: Vec<ChecksumShare> = records
        .iter()
        .flat_map(|r| r.shares.iter().copied())
        .collect();
    crate::write_checksum_shares(&outputs, &shares, &paths)?;
    for p in &paths {
        fs::File::open(p).and_then(|f| f.sync_all()).at_write(p)?;
    }
    let id = identity(&out).ok_or_else(|| Error::usage(format!("{}: vanished", out.display())))?;
    write_atomic(&marker, id.as_bytes())?;
    publish(&out, dest, area.manifest.is_dir, force)?;
    remove_any(&area.dir);
    drop(lock);
    Ok(Committed::Published { checked })
}

/// A file's identity (`dev:ino`), or `None` when it does not exist.
fn identity(p: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    fs::symlink_metadata(p)
        .ok()
        .map(|m| format!("{}:{}", m.dev(), m.ino()))
}

/// `items` joined by commas, the first `max` of them and a count of the rest.
fn listed(items: &[String], max: usize) -> String {
    if items.len() <= max {
        return items.join(", ");
    }
    format!("{} and {} more", items[..max].join(", "), items.len() - max)
}

/// Check the records' spans cover every byte of every output file exactly once.
fn check_cover(area: &PartsArea, records: &[Record]) -> Result<()> {
    let mut spans: Vec<(u32, u64, u64, Part)> = records
        .iter()
        .flat_map(|r| {
            r.spans
                .iter()
                .map(move |s| (s.file, s.start, s.end, r.part))
        })
        .collect();
    spans.sort_unstable_by_key(|s| (s.0, s.1));
    let files = &area.manifest.files;
    let mut next = (0u32, 0u64);
    let bad = |what: String| {
        Error::usage(format!(
            "{}: the parts' records do not add up to the output ({what}); remove {} and \
             run the conversion again",
            area.dest.display(),
            area.dir.display()
        ))
    };
    for &(f, a, b, part) in &spans {
        // skip files that are complete (or empty) before this one
        while next.0 < f && next.1 == files.get(next.0 as usize).map_or(0, |x| x.size) {
            next = (next.0 + 1, 0);
        }
        if (f, a) != next || b < a || files.get(f as usize).is_none_or(|x| b > x.size) {
            return Err(bad(format!(
                "part {part} has bytes {a}..{b} of file #{f}, expected file #{} from byte {}",
                next.0, next.1
            )));
        }
        next = (f, b);
    }
    while (next.0 as usize) < files.len() && next.1 == files[next.0 as usize].size {
        next = (next.0 + 1, 0);
    }
    if (next.0 as usize) < files.len() {
        return Err(bad(format!(
            "no part has file #{} from byte {}",
            next.0, next.1
        )));
    }
    Ok(())
}

/// Check every checksum share lies in its checksum's range and in its part's spans.
fn check_shares(area: &PartsArea, records: &[Record]) -> Result<()> {
    for r in records {
        for sh in &r.shares {
            let end = sh.start.checked_add(sh.len);
            let range = area
                .manifest
                .files
                .get(sh.file as usize)
                .and_then(|f| f.checksums.get(sh.ck as usize))
                .map(|c| c.range);
            let ok = match (end, range) {
                (Some(e), Some((a, b))) => {
                    a <= sh.start
                        && e <= b
                        && r.spans
                            .iter()
                            .any(|s| s.file == sh.file && s.start <= sh.start && e <= s.end)
                }
                _ => false,
            };
            if !ok {
                return Err(Error::format(
                    area.name(r.part, "json"),
                    "is damaged: a checksum share outside its checksum or its part",
                ));
            }
        }
    }
    Ok(())
}

/// The CRC-32 of bytes `start..end` of `path`.
fn crc_of(path: &Path, start: u64, end: u64) -> Result<u32> {
    let f = fs::File::open(path).at(path)?;
    let mut buf = vec![0u8; (1usize << 20).min((end - start) as usize)];
    let mut h = crc32fast::Hasher::new();
    let mut at = start;
    while at < end {
        let n = buf.len().min((end - at) as usize);
        f.read_exact_at(&mut buf[..n], at).at(path)?;
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(h.finalize())
}
