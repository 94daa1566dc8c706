//! reshard-exec: the executor, which runs a [`Plan`] from memory-mapped sources into
//! destination files, and the commit, which makes them appear atomically ([`commit`]).
//!
//! May import: `reshard-core` and `reshard-storage`. It knows no file format: the formats
//! describe destinations as [`OutputFile`]s (`reshard-core`), and the front door hands
//! them over.
//!
//! It knows nothing about formats. Destinations are described as [`OutputFile`]s (size plus
//! literal bytes such as headers) and written with positional writes, never mapped, so their
//! pages never count against the process. Work is cut into windows of each destination file
//! (a few MiB) and windows run in parallel on a rayon pool. Within a window, long plain
//! contiguous runs are copied by the kernel (`copy_file_range`, or written straight from
//! the source mapping where the kernel cannot), and the bytes between them (headers, short
//! or strided copies, casts, fills) are assembled in a per-thread buffer and written once per
//! stretch. Fills (a view's padding, [`reshard_core::plan::FillOp`]) are scheduled, windowed,
//! split into parts and checksummed like copies: each is clipped to the windows and spans its
//! rows reach, and written with its value even where that is zero (a destination is not
//! assumed to be fresh). Source pages a window read through the mapping are released (`MADV_DONTNEED`)
//! as soon as it is written, so resident memory stays flat whatever the checkpoint size.
//!
//! This crate's root holds the settings, the statistics and the entry points ([`prepare`]
//! then [`execute_scheduled`], or `execute_with_known` for both); `schedule` cuts windows
//! and picks the thread count, `window` runs one, `crc` streams the outputs' checksums.
//! Reading regions into the caller's buffers is `reshard_storage::read`; system calls are
//! in `reshard_storage::sys`, cast kernels in `reshard_core::layout::cast`.
#![deny(missing_docs)]

pub mod commit;
mod crc;
mod schedule;
mod window;

/// The core floor's modules, at the paths this crate's code names them by.
pub(crate) use reshard_core::{error, parts, plan};
pub use reshard_storage::Sources;
/// The storage floor's modules, at the paths this crate's code names them by.
pub(crate) use reshard_storage::{read, sys};

pub use crc::KnownCrc;
pub use reshard_core::output::{Checksum, Literal, OutputFile};
pub use reshard_storage::read::{
    map_sources, read_into, read_many_into, read_many_into_counted, read_regions, read_regions_into,
};
pub use reshard_storage::sys::release;
pub use schedule::{balance, restrict};

use crate::error::{Error, IoContext, Result};
use crate::plan::Plan;
use crate::sys::{preallocate, preallocate_range, WriteContext};
use crc::{CkRange, CrcPart};
use memmap2::Mmap;
use rayon::prelude::*;
use schedule::Window;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use window::{run_window, WindowIo};

/// Where the executor reports how far it got, in destination bytes: `start` once with the
/// total, `advance` from the worker threads as windows are written, `finish` once every
/// byte and checksum is in place (not called when the run fails).
pub trait Progress: Send + Sync {
    /// The run is about to write `total_bytes` destination bytes.
    fn start(&self, total_bytes: u64);
    /// `bytes` more destination bytes are written.
    fn advance(&self, bytes: u64);
    /// Every byte is written.
    fn finish(&self);
}

/// Executor settings.
#[derive(Clone)]
pub struct ExecOptions {
    /// Worker threads (`None`: one per core when much of the work passes through user
    /// space — gathers, casts, hashing — otherwise one).
    pub threads: Option<usize>,
    /// Bytes of destination per work unit.
    pub window: u64,
    /// Where to report progress (`None`: nowhere).
    pub progress: Option<Arc<dyn Progress>>,
    /// fsync every output before returning (needed for a durable commit; tests of the copy
    /// logic alone may turn it off).
    pub sync: bool,
}

impl std::fmt::Debug for ExecOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecOptions")
            .field("threads", &self.threads)
            .field("window", &self.window)
            .field("progress", &self.progress.as_ref().map(|_| "dyn Progress"))
            .field("sync", &self.sync)
            .finish()
    }
}

impl Default for ExecOptions {
    fn default() -> Self {
        ExecOptions {
            threads: None,
            window: 8 << 20,
            progress: None,
            sync: true,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ExecStats {
    /// Tensor bytes read from sources.
    pub bytes_read: u64,
    /// Bytes written to destinations (tensor data copied or filled, and literals).
    pub bytes_written: u64,
    /// Work units executed.
    pub windows: usize,
    /// Threads used.
    pub threads: usize,
    /// Objects whose incomplete multipart uploads, left by an earlier run that was killed
    /// while writing to the same object-store destination, were aborted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub aborted_uploads: Vec<String>,
}

/// Run `plan`, reading `sources` and writing each of `outputs` to `dest_paths` (same order),
/// which must already exist. Files are fsynced before this returns (unless `opts.sync` is off).
#[cfg(any(test, feature = "internals"))]
pub fn execute(
    plan: &Plan,
    sources: Sources,
    outputs: &[OutputFile],
    dest_paths: &[PathBuf],
    opts: &ExecOptions,
) -> Result<ExecStats> {
    execute_with_known(plan, sources, outputs, dest_paths, opts, &[])
}

/// [`execute`], with the CRC-32s of source ranges the sources record ([`KnownCrc`]): output
/// checksums over bytes copied whole from them are combined, not hashed.
#[cfg(any(test, feature = "internals"))]
pub fn execute_with_known(
    plan: &Plan,
    sources: Sources,
    outputs: &[OutputFile],
    dest_paths: &[PathBuf],
    opts: &ExecOptions,
    known: &[KnownCrc],
) -> Result<ExecStats> {
    let sched = prepare(plan, outputs, opts, known)?;
    execute_scheduled(plan, sources, outputs, dest_paths, opts, sched)
}

/// A plan cut into work units for its outputs, with the checksum work known and the number
/// of worker threads chosen: what [`execute_scheduled`] runs. [`prepare`] makes it before any file is
/// touched, so a caller can fit work it runs beside the copy (the source CRC check) to the
/// cores the copy leaves free.
pub struct Schedule<'a> {
    wins: Vec<Window<'a>>,
    ranges: Vec<Vec<CkRange>>,
    given: Vec<CrcPart>,
    skip: Vec<Vec<(u64, u64)>>,
    threads: usize,
}

impl Schedule<'_> {
    /// Worker threads the run will use.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// Cut `plan` into work units for `outputs` and choose the worker threads (`opts.threads`,
/// else one per core when much of the work passes through user space, otherwise one);
/// checks every op stays within its destination.
pub fn prepare<'a>(
    plan: &Plan,
    outputs: &'a [OutputFile],
    opts: &ExecOptions,
    known: &[KnownCrc],
) -> Result<Schedule<'a>> {
    check_ops(plan, outputs)?;
    let ranges = crc::checked_ranges(outputs)?;
    let wins = schedule::windows(plan, outputs, opts.window);
    let (given, skip) = crc::known_parts(plan, outputs, &ranges, known);
    let threads = opts
        .threads
        .unwrap_or_else(|| schedule::default_threads(&wins, &ranges, &skip));
    Ok(Schedule {
        wins,
        ranges,
        given,
        skip,
        threads,
    })
}

/// Run `sched` (made by [`prepare`] from the same `plan`, `outputs` and `opts`): read
/// `sources`, write each of `outputs` to `dest_paths` (same order), which must already exist.
pub fn execute_scheduled(
    plan: &Plan,
    sources: Sources,
    outputs: &[OutputFile],
    dest_paths: &[PathBuf],
    opts: &ExecOptions,
    sched: Schedule,
) -> Result<ExecStats> {
    let src = open_sources(plan, sources.paths)?;
    let files = open_outputs(outputs, dest_paths)?;
    let Schedule {
        wins,
        ranges,
        given,
        skip,
        threads,
    } = sched;
    let shared = Shared::new(&src, sources, (&files, dest_paths), &ranges, &skip);
    let total = wins.iter().map(Window::size).sum();
    let (mut parts, threads) = run_on_pool(threads, &wins, &shared, opts, total)?;
    parts.extend(given);
    crc::write_checksums(outputs, parts, &files, dest_paths)?;
    if let Some(p) = opts.progress.as_deref() {
        p.finish();
    }
    if opts.sync {
        sync_all(&files, dest_paths)?;
    }
    Ok(ExecStats {
        bytes_read: plan.bytes_read(),
        bytes_written: plan.bytes_written()
            + plan.bytes_filled()
            + outputs
                .iter()
                .flat_map(|o| &o.literals)
                .map(|(_, b)| b.len() as u64)
                .sum::<u64>(),
        windows: wins.len(),
        threads,
        aborted_uploads: vec![],
    })
}

/// fsync every open output.
fn sync_all(files: &[Option<File>], dest_paths: &[PathBuf]) -> Result<()> {
    for (f, p) in files.iter().zip(dest_paths) {
        if let Some(f) = f {
            f.sync_all().at_write(p)?;
        }
    }
    Ok(())
}

/// One part's share of an output checksum: the CRC-32 of bytes `start..start + len` of
/// output file `file` that fall in checksum `ck`'s range ([`OutputFile::checksums`]). A part
/// of a conversion records its shares; the commit joins every part's shares in order
/// ([`write_checksum_shares`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChecksumShare {
    /// Output file index.
    pub file: u32,
    /// Index of the checksum in that file's list.
    pub ck: u32,
    /// First byte hashed.
    pub start: u64,
    /// Bytes hashed.
    pub len: u64,
    /// Their CRC-32.
    pub crc: u32,
}

/// What one part of a conversion wrote ([`execute_part`]).
#[derive(Clone, Debug)]
pub struct PartWritten {
    /// What the run did.
    pub stats: ExecStats,
    /// The CRC-32 of each span's bytes as written (bytes no copy or literal writes count as
    /// zeros), in the order of the spans given.
    pub span_crcs: Vec<u32>,
    /// The part's shares of the outputs' checksums, which only the commit can finish.
    pub shares: Vec<ChecksumShare>,
}

/// Run one part of a conversion: write only the destination bytes of `spans` (sorted by file
/// and start, disjoint, from [`crate::parts::split`]) of `outputs`, from `plan` (the whole
/// plan or the part's own, [`schedule::restrict`]). `dest_paths` are every output's path;
/// the files of the spans must exist (other processes may be writing other spans of them).
/// Output checksums are not written: their shares are returned with a CRC-32 of each span,
/// for the commit ([`write_checksum_shares`]).
pub fn execute_part(
    plan: &Plan,
    sources: Sources,
    outputs: &[OutputFile],
    dest_paths: &[PathBuf],
    opts: &ExecOptions,
    spans: &[crate::parts::Span],
) -> Result<PartWritten> {
    check_ops(plan, outputs)?;
    if spans
        .windows(2)
        .any(|w| (w[0].file, w[0].end) > (w[1].file, w[1].start))
        || spans.iter().any(|s| {
            outputs
                .get(s.file as usize)
                .is_none_or(|o| s.end > o.size || s.start > s.end)
        })
    {
        return Err(Error::usage(
            "a part's spans overlap or lie outside the output",
        ));
    }
    let ranges = crc::checked_ranges(outputs)?;
    let wins = schedule::windows_in(plan, outputs, opts.window, spans);
    let skip: Vec<Vec<(u64, u64)>> = vec![vec![]; outputs.len()];
    let threads = opts
        .threads
        .unwrap_or_else(|| schedule::default_threads(&wins, &ranges, &skip));
    let src = open_sources(plan, sources.paths)?;
    // open the files of the spans, their sizes set and the spans' blocks allocated
    let mut files: Vec<Option<File>> = (0..outputs.len()).map(|_| None).collect();
    let mut pending = 0u64;
    for s in spans {
        let (f, p) = (s.file as usize, &dest_paths[s.file as usize]);
        if files[f].is_none() {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .at_write(p)?;
            if file.metadata().at(p)?.len() != outputs[f].size {
                file.set_len(outputs[f].size).at_write(p)?;
            }
            files[f] = Some(file);
        }
        if let Some(file) = &files[f] {
            if !preallocate_range(file, s.start, s.len(), pending).at_write(p)? {
                pending = pending.saturating_add(s.len());
            }
        }
    }
    let shared = Shared::new(&src, sources, (&files, dest_paths), &ranges, &skip).hashing_all();
    let total = spans.iter().map(|s| s.len()).sum();
    let (mut parts, threads) = run_on_pool(threads, &wins, &shared, opts, total)?;
    let progress = opts.progress.as_deref();
    if opts.sync {
        sync_all(&files, dest_paths)?;
    }
    if let Some(p) = progress {
        p.finish();
    }
    parts.sort_by_key(|p| (p.file, p.ck, p.start));
    let (whole, cks): (Vec<CrcPart>, Vec<CrcPart>) =
        parts.into_iter().partition(|p| p.ck == crc::WHOLE);
    let span_crcs = spans
        .iter()
        .map(|s| {
            let i = whole.partition_point(|p| (p.file, p.start) < (s.file, s.start));
            let n = whole[i..]
                .iter()
                .take_while(|p| p.file == s.file && p.start < s.end)
                .count();
            crc::join_crc(&whole[i..i + n], (s.start, s.end))
        })
        .collect();
    let shares = cks
        .into_iter()
        .map(|p| ChecksumShare {
            file: p.file,
            ck: p.ck,
            start: p.start,
            len: p.len,
            crc: p.hash.finalize(),
        })
        .collect();
    Ok(PartWritten {
        stats: ExecStats {
            bytes_read: plan.bytes_read(),
            bytes_written: plan.bytes_written()
                + plan.bytes_filled()
                + outputs
                    .iter()
                    .enumerate()
                    .flat_map(|(f, o)| o.literals.iter().map(move |l| (f, l)))
                    .map(|(f, (at, b))| {
                        let (a, e) = (*at, at + b.len() as u64);
                        spans
                            .iter()
                            .filter(|s| s.file as usize == f)
                            .map(|s| e.min(s.end).saturating_sub(a.max(s.start)))
                            .sum::<u64>()
                    })
                    .sum::<u64>(),
            windows: wins.len(),
            threads,
            aborted_uploads: vec![],
        },
        span_crcs,
        shares,
    })
}

/// Join every part's [`ChecksumShare`]s into the outputs' checksums and write them in place
/// in the finished files at `dest_paths` (the commit of a conversion run in parts). Bytes of
/// a checksum range no share covers count as zeros.
pub fn write_checksum_shares(
    outputs: &[OutputFile],
    shares: &[ChecksumShare],
    dest_paths: &[PathBuf],
) -> Result<()> {
    write_checksum_shares_in(outputs, shares, dest_paths, None, None)
}

/// [`write_checksum_shares`] into output file `only` alone (all when `None`), and there only
/// the checksums of index `cks` (sorted; all when `None`): the others are not touched, and their
/// shares may be missing.
pub fn write_checksum_shares_in(
    outputs: &[OutputFile],
    shares: &[ChecksumShare],
    dest_paths: &[PathBuf],
    only: Option<usize>,
    cks: Option<&[usize]>,
) -> Result<()> {
    let parts = shares
        .iter()
        .map(|s| CrcPart {
            file: s.file,
            ck: s.ck,
            start: s.start,
            len: s.len,
            hash: crc32fast::Hasher::new_with_initial_len(s.crc, s.len),
        })
        .collect();
    let files: Vec<Option<File>> = outputs
        .iter()
        .zip(dest_paths)
        .enumerate()
        .map(|(f, (o, p))| {
            if o.checksums.iter().all(|c| c.at.is_empty()) || only.is_some_and(|x| x != f) {
                return Ok(None);
            }
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .at_write(p)
                .map(Some)
        })
        .collect::<Result<_>>()?;
    crc::write_checksums_where(outputs, parts, &files, dest_paths, &|f, i| {
        only.is_none_or(|o| o == f) && cks.is_none_or(|c| c.binary_search(&i).is_ok())
    })?;
    sync_all(&files, dest_paths)
}

/// Map and open `sources`, checking every op of `plan` stays within them.
fn open_sources(plan: &Plan, sources: &[PathBuf]) -> Result<(Vec<Mmap>, Vec<File>)> {
    let maps = map_sources(sources)?;
    let files: Vec<File> = sources
        .iter()
        .map(|p| File::open(p).at(p))
        .collect::<Result<_>>()?;
    check_sources(plan, sources, &maps)?;
    Ok((maps, files))
}

/// Run `wins` on a pool of `threads` threads, telling `opts.progress` of `total` bytes; the
/// checksum parts they hashed and the threads used.
fn run_on_pool(
    threads: usize,
    wins: &[Window],
    shared: &Shared,
    opts: &ExecOptions,
    total: u64,
) -> Result<(Vec<CrcPart>, usize)> {
    // Windows reading remote sources wait on the network more than on the cores (unless the
    // caller chose the threads).
    let threads = if shared.remote() && opts.threads.is_none() {
        threads.max(REMOTE_THREADS)
    } else {
        threads
    };
    let pool = thread_pool(threads)?;
    let progress = opts.progress.as_deref();
    if let Some(p) = progress {
        p.start(total);
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let parts = std::thread::scope(|s| {
        if shared.remote() {
            // every window's source bytes asked for at once, in few large requests; each
            // window then waits only for its own to land (a failed fetch ahead is retried
            // by the windows, whose errors are the ones reported)
            s.spawn(|| {
                let ops = wins
                    .iter()
                    .flat_map(|w| w.frags.iter())
                    .filter_map(|f| match f {
                        schedule::Frag::Op(o) => Some(o),
                        schedule::Frag::Lit { .. } | schedule::Frag::Fill(_) => None,
                    });
                let _ = shared.sources.prefetch_ops(ops, &stop);
            });
        }
        let r = pool.install(|| run_windows(wins, shared, progress));
        // done or failed: the bytes still to fetch ahead are no one's
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    })?;
    Ok((parts, pool.current_num_threads()))
}

/// Windows run at once when sources are remote (each keeps its own ranged GETs in flight).
const REMOTE_THREADS: usize = 8;

/// A rayon pool of `threads` worker threads.
pub fn thread_pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::usage(format!("cannot start worker threads: {e}")))
}

/// What every window of a run shares: the sources (mapped and opened), the destinations
/// (opened, and their paths), and per destination its checksum ranges and the ranges of
/// them that known source CRCs give.
struct Shared<'a> {
    srcs: &'a [Mmap],
    src_files: &'a [File],
    sources: Sources<'a>,
    dsts: &'a [Option<File>],
    dest_paths: &'a [PathBuf],
    ranges: &'a [Vec<CkRange>],
    skip: &'a [Vec<(u64, u64)>],
    /// Hash every byte each window writes ([`crc::WHOLE`]), for a part's records.
    whole: bool,
}

impl<'a> Shared<'a> {
    /// What the windows of a run reading `sources` (mapped and opened: `src`) into the
    /// destinations `dst` (opened, and their paths) share, with per destination its checksum
    /// ranges and the ranges of them that known source CRCs give (`skip`).
    fn new(
        src: &'a (Vec<Mmap>, Vec<File>),
        sources: Sources<'a>,
        dst: (&'a [Option<File>], &'a [PathBuf]),
        ranges: &'a [Vec<CkRange>],
        skip: &'a [Vec<(u64, u64)>],
    ) -> Self {
        Shared {
            srcs: &src.0,
            src_files: &src.1,
            sources,
            dsts: dst.0,
            dest_paths: dst.1,
            ranges,
            skip,
            whole: false,
        }
    }

    /// The sources' storage fetches (an object store's mirror): each window fetches its
    /// source bytes before reading them, and the pool is sized for waiting on the network.
    fn remote(&self) -> bool {
        self.sources.storage.fetches()
    }

    /// The same, hashing every byte each window writes (a part's records).
    fn hashing_all(self) -> Self {
        Shared {
            whole: true,
            ..self
        }
    }
}

/// Run `wins` in parallel on the current pool, telling `progress` as each is written;
/// returns the checksum parts they hashed.
fn run_windows(
    wins: &[Window],
    io: &Shared,
    progress: Option<&dyn Progress>,
) -> Result<Vec<CrcPart>> {
    wins.par_iter()
        .map(|w| {
            let f = w.dst as usize;
            let dst = io.dsts[f]
                .as_ref()
                .ok_or_else(|| Error::usage(format!("output file #{f} is not open")))?;
            let wio = WindowIo {
                srcs: io.srcs,
                src_files: io.src_files,
                src_paths: io.sources.paths,
                dst,
                dst_path: &io.dest_paths[f],
            };
            if io.remote() {
                let ops = w.frags.iter().filter_map(|f| match f {
                    schedule::Frag::Op(o) => Some(o),
                    schedule::Frag::Lit { .. } | schedule::Frag::Fill(_) => None,
                });
                io.sources.ensure_ops(ops)?;
            }
            let parts = run_window(w, &wio, (&io.ranges[f], &io.skip[f]), io.whole)?;
            if let Some(p) = progress {
                p.advance(w.size());
            }
            Ok(parts)
        })
        .try_reduce(Vec::new, |mut a, b| {
            a.extend(b);
            Ok(a)
        })
}

/// Open the (existing) destination files `dest_paths` for writing, their blocks allocated
/// (or, on tmpfs, the free space for all of them checked) and their sizes set to those of
/// `outputs`.
fn open_outputs(outputs: &[OutputFile], dest_paths: &[PathBuf]) -> Result<Vec<Option<File>>> {
    let mut pending = 0u64;
    dest_paths
        .iter()
        .zip(outputs)
        .map(|(p, o)| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .at_write(p)?;
            if !preallocate(&f, o.size, pending).at_write(p)? {
                pending = pending.saturating_add(o.size);
            }
            f.set_len(o.size).at_write(p)?;
            Ok(Some(f))
        })
        .collect()
}

/// Check every op names a source file of `sources` and stays within its mapping.
fn check_sources(plan: &Plan, sources: &[PathBuf], maps: &[Mmap]) -> Result<()> {
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
        read::check_scales(o, sources, maps)?;
    }
    Ok(())
}

/// Check every copy and fill is well formed and stays within its destination.
fn check_ops(plan: &Plan, outputs: &[OutputFile]) -> Result<()> {
    let output = |dst: u32| {
        outputs
            .get(dst as usize)
            .ok_or_else(|| Error::usage(format!("plan names destination file #{dst}")))
    };
    for o in &plan.ops {
        let d = output(o.dst)?;
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
    for f in &plan.fills {
        let d = output(f.dst)?;
        f.check(d.size)
            .map_err(|m| Error::usage(format!("{}: {m}", d.path.display())))?;
    }
    Ok(())
}
