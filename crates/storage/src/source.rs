//! Storage as an interface: where a checkpoint's files are ([`Storage`]), what a reader of
//! them is handed ([`Sources`]), and how a path or URL given by the user is told apart
//! ([`locate`], and [`open`] for sources) — the one place that asks whether a path is a
//! URL.
//!
//! Every reader above this floor reads local files (memory maps, `pread`, kernel copies).
//! A [`Storage`] says what must happen before bytes of those files are read: nothing for
//! [`Local`] files, ranged fetches into sparse files for an object store's
//! [`Mirror`](crate::remote::mirror::Mirror). It is passed explicitly with the files it holds;
//! nothing is looked up in a process-wide table.

use crate::error::{Error, Result};
use crate::plan::CopyOp;
use crate::remote;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a checkpoint's files are: what the floors above ask before they read bytes of them.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Make bytes `spans` (`(start, end)` pairs, sorted and disjoint) of `path` — one of the
    /// local files this storage lays out — readable through the local file system.
    fn ensure(&self, path: &Path, spans: &[(u64, u64)]) -> Result<()>;

    /// True when [`Storage::ensure`] fetches bytes (each read costs requests), false when
    /// every byte is readable as it is.
    fn fetches(&self) -> bool;

    /// Fetch ahead the bytes `wanted` (local files and their sorted spans) that a reader is
    /// about to read most of, in few large requests; a later [`Storage::ensure`] of those
    /// bytes waits for them instead of fetching them again. Blocks until done (run it on a
    /// thread of its own beside the readers, and set `stop` when they are done or failed:
    /// no request starts after); nothing to do when the storage does not fetch.
    fn prefetch(
        &self,
        _wanted: &[(PathBuf, Vec<(u64, u64)>)],
        _stop: &std::sync::atomic::AtomicBool,
    ) -> Result<()> {
        Ok(())
    }

    /// How to name `path` to the user (an object's URL); `None`: by the path itself.
    fn shown(&self, _path: &Path) -> Option<String> {
        None
    }

    /// What identifies the bytes of `path` besides its content (an object's URL, size and
    /// ETag, empty when the store gives none), for fingerprints of a job whose sources may change under it; `None` for local
    /// files, whose sizes and times say it.
    fn identity(&self, _path: &Path) -> Option<(String, u64, String)> {
        None
    }

    /// The files it lays out locally and their sizes, sorted, when it fetches (what opening
    /// a checkpoint fetches first is chosen among them); empty for local files.
    fn files(&self) -> Vec<(PathBuf, u64)> {
        vec![]
    }

    /// `e` with the local paths in it named as the user knows them (URLs).
    fn rename(&self, e: Error) -> Error {
        e
    }
}

/// A kind of storage that URLs of some schemes name (`s3://`, `gs://`): how a checkpoint
/// location under it is opened. Plain paths and `file://` URLs are [`Local`] and need none.
///
/// # Adding a storage
/// Write a module with a unit struct implementing `Backend` (its schemes, and `open`
/// returning the local stand-in of a URL with a [`Storage`] that fetches what is read), and
/// add one line to [`BACKENDS`].
pub trait Backend: Sync {
    /// The URL schemes it serves (without `://`).
    fn schemes(&self) -> &'static [&'static str];
    /// Open the checkpoint location `url`, a URL of one of its schemes; nothing is fetched
    /// yet.
    fn open(&self, url: &Path) -> Result<Opened>;
}

/// Every storage reached by URL.
pub const BACKENDS: &[&dyn Backend] = &[&remote::ObjectStores];

/// The backend that serves `path`'s scheme, if it is a URL one serves.
fn backend(path: &Path) -> Option<&'static dyn Backend> {
    let scheme = remote::scheme(path)?;
    BACKENDS
        .iter()
        .copied()
        .find(|b| b.schemes().contains(&scheme.as_str()))
}

/// Files on a local file system: every byte is readable as it is.
#[derive(Clone, Copy, Debug, Default)]
pub struct Local;

impl Storage for Local {
    fn ensure(&self, _path: &Path, _spans: &[(u64, u64)]) -> Result<()> {
        Ok(())
    }

    fn fetches(&self) -> bool {
        false
    }
}

/// The [`Local`] storage, shared.
pub fn local() -> Arc<dyn Storage> {
    Arc::new(Local)
}

/// The files a plan's copy ops read ([`CopyOp::src`] indexes `paths`) and the storage that
/// holds them.
#[derive(Clone, Copy, Debug)]
pub struct Sources<'a> {
    /// Local paths, in the order the copy ops number them.
    pub paths: &'a [PathBuf],
    /// Where they are.
    pub storage: &'a dyn Storage,
}

impl<'a> Sources<'a> {
    /// `paths` on a local file system.
    pub fn local(paths: &'a [PathBuf]) -> Sources<'a> {
        Sources {
            paths,
            storage: &Local,
        }
    }

    /// Make sure the source bytes `ops` read can be read: row by row, so a strided copy
    /// fetches only its rows (rows close together as one range: fewer requests). Nothing
    /// to do, and nothing computed, when the storage does not fetch.
    pub fn ensure_ops<'o>(&self, ops: impl IntoIterator<Item = &'o CopyOp>) -> Result<()> {
        if !self.storage.fetches() {
            return Ok(());
        }
        for (path, s) in self.spans(ops) {
            self.storage.ensure(path, &s)?;
        }
        Ok(())
    }

    /// Fetch ahead, in few large requests, every source byte `ops` (a whole conversion's
    /// copies) read, as [`Sources::ensure_ops`] would ask for them one window at a time; the
    /// windows' own `ensure_ops` then wait for their bytes to land. Blocks until done, or
    /// until `stop` is set (no request starts after).
    pub fn prefetch_ops<'o>(
        &self,
        ops: impl IntoIterator<Item = &'o CopyOp>,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<()> {
        if !self.storage.fetches() {
            return Ok(());
        }
        let wanted: Vec<(PathBuf, Vec<(u64, u64)>)> = self
            .spans(ops)
            .into_iter()
            .map(|(p, s)| (p.clone(), s))
            .collect();
        self.storage.prefetch(&wanted, stop)
    }

    /// The source spans `ops` read, per source file (sorted, coalesced): row by row for a
    /// strided copy whose rows are far apart, else the whole span.
    fn spans<'o>(
        &self,
        ops: impl IntoIterator<Item = &'o CopyOp>,
    ) -> Vec<(&'a PathBuf, Vec<(u64, u64)>)> {
        let mut spans: Vec<Vec<(u64, u64)>> = vec![vec![]; self.paths.len()];
        for o in ops {
            // a dequantizing copy reads its block rows of scales too
            if let Some(bs) = o.cast.and_then(|c| c.scale) {
                if let Some(s) = spans.get_mut(bs.src as usize) {
                    s.push(bs.span(o));
                }
            }
            let Some(s) = spans.get_mut(o.src as usize) else {
                continue;
            };
            if o.count <= 1
                || o.src_stride == o.len
                || o.src_stride.saturating_sub(o.len) <= remote::mirror::ROW_GAP
            {
                s.push(o.src_span());
            } else {
                s.extend((0..o.count).map(|r| {
                    let a = o.src_offset + r * o.src_stride;
                    (a, a + o.len)
                }));
            }
        }
        self.paths
            .iter()
            .zip(spans)
            .filter(|(_, s)| !s.is_empty())
            .map(|(p, mut s)| {
                s.sort_unstable();
                (p, remote::mirror::coalesce(&s, 0))
            })
            .collect()
    }
}

/// A checkpoint's location as the floors above read it.
#[derive(Clone, Debug)]
pub struct Opened {
    /// The local path to read: the path given, or the local stand-in for a URL.
    pub root: PathBuf,
    /// Where its files are.
    pub storage: Arc<dyn Storage>,
    /// The URL given, when it is one.
    pub url: Option<String>,
}

/// Open the checkpoint location `path`: a local path (or `file://` URL) as it is; a URL
/// through the [`Backend`] of its scheme (an object store: a local mirror of its objects),
/// nothing fetched yet.
pub fn open(path: &Path) -> Result<Opened> {
    match backend(path) {
        Some(b) => b.open(path),
        None => Ok(Opened {
            root: remote::local_path(path),
            storage: local(),
            url: None,
        }),
    }
}

/// Where a path or URL given by the user points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// A local path (a `file://` URL made one).
    Local(PathBuf),
    /// An object-store URL: read through a mirror ([`open`]); written locally, then
    /// uploaded ([`remote::upload`]).
    Remote(PathBuf),
}

/// Tell where `path` points, without touching it.
pub fn locate(path: &Path) -> Location {
    if backend(path).is_some() {
        Location::Remote(path.to_path_buf())
    } else {
        Location::Local(remote::local_path(path))
    }
}
