//! A remote checkpoint read through a local mirror: a scratch folder holding one *sparse*
//! file per object, of the object's size, into which ranged GETs write the bytes something
//! is about to read. Which bytes were fetched is kept per file; asking again for fetched
//! bytes costs nothing. Requests are coalesced (neighbours closer than `GAP` become one),
//! cut into pieces of at most `PIECE`, and run `IN_FLIGHT` at a time, so what one call
//! holds in memory is bounded by `IN_FLIGHT × PIECE` whatever it asks for.
//!
//! The mirror lives as long as the checkpoint opened from it; its folder is
//! removed when the last reference goes. It is the [`Storage`](crate::Storage) of the
//! checkpoint's files: the executor and the loader, handed it with the files, ask it for
//! source bytes by local path before they read them.

use super::{block_on, error, Remote};
use crate::error::{Error, IoContext, Result};
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Ranges closer than this are fetched as one request (the bytes between are fetched too).
const GAP: u64 = 4 << 10;
/// Rows of a strided copy closer than this are fetched as one range with the bytes between
/// (a request costs about what this many bytes take to arrive).
pub const ROW_GAP: u64 = 256 << 10;
/// The smallest piece a long range is cut into (a range shorter than this is one GET).
const PIECE: u64 = 8 << 20;
/// The largest single ranged GET (bodies stream to disk: not a bound on memory, but a
/// request must end within the client's timeout on a slow server).
const MAX_PIECE: u64 = 16 << 20;
/// A piece's bytes are marked fetched, and its waiters told, each time this many more
/// have landed (a reader need not wait for the whole piece).
const LANDED: u64 = 1 << 20;
/// Ranged GETs one call keeps in flight.
const IN_FLIGHT: usize = 16;
/// Ranged GETs the whole process keeps in flight, however many threads fetch.
static SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(IN_FLIGHT);
/// The most objects a remote checkpoint may hold (a hostile listing stays bounded).
const MAX_OBJECTS: usize = 1 << 20;

/// Bytes and requests fetched from object stores by this process so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Ranged GET requests issued.
    pub requests: u64,
    /// Bytes those requests returned.
    pub bytes: u64,
}

static REQUESTS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// What this process has fetched from object stores so far (for figures and tests).
pub fn fetch_stats() -> FetchStats {
    FetchStats {
        requests: REQUESTS.load(Ordering::Relaxed),
        bytes: BYTES.load(Ordering::Relaxed),
    }
}

/// One mirrored object.
#[derive(Debug)]
struct MirrorFile {
    /// Its path under the prefix, `/`-separated.
    rel: String,
    /// Its key in the store, as listed (not rebuilt from `rel`: keys are not re-encoded).
    key: object_store::path::Path,
    size: u64,
    /// Its ETag when listed: every read asks for that version, so an object replaced
    /// while it is read fails the read instead of mixing two versions.
    e_tag: Option<String>,
    /// The sparse local file, open for writing fetched bytes.
    file: File,
    /// Fetched byte ranges, and those being fetched.
    state: Mutex<Fetched>,
    /// Signalled when a fetch ends: a reader that wants bytes another is fetching (the source
    /// check beside the copy) waits for them instead of fetching them again.
    landed: std::sync::Condvar,
}

/// What of a mirrored file is fetched, and what is being fetched; both sorted and disjoint.
#[derive(Debug, Default)]
struct Fetched {
    have: Vec<(u64, u64)>,
    pending: Vec<(u64, u64)>,
}

/// `a` and `b` (sorted, disjoint) merged.
fn union(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut all = [a, b].concat();
    all.sort_unstable();
    coalesce(&all, 0)
}

/// A remote checkpoint's local mirror (see the module docs).
#[derive(Debug)]
pub struct Mirror {
    remote: Remote,
    dir: tempfile::TempDir,
    /// The local path standing for the URL: the folder, or the one file.
    root: PathBuf,
    files: Vec<MirrorFile>,
    by_path: HashMap<PathBuf, usize>,
}

impl Mirror {
    /// List the objects under `url` (or the one object it names) and lay out their sparse
    /// local files; nothing is fetched yet.
    pub fn open(url: &Path) -> Result<Arc<Mirror>> {
        let remote = Remote::parse(url)?;
        let store = remote.store.clone();
        let root_key = remote.key("");
        let listed: Vec<object_store::ObjectMeta> = block_on(async {
            store
                .list(Some(&root_key))
                .take(MAX_OBJECTS + 1)
                .try_collect::<Vec<_>>()
                .await
        })?
        .map_err(|e| error(remote.url(), &e))?;
        if listed.len() > MAX_OBJECTS {
            return Err(Error::format(
                remote.url(),
                format!("holds more than {MAX_OBJECTS} objects"),
            ));
        }
        let prefix = root_key.as_ref().to_string();
        let mut objects: Vec<(String, u64, Option<String>, object_store::path::Path)> = vec![];
        for m in &listed {
            let key = m.location.as_ref();
            let rel = if prefix.is_empty() {
                key
            } else {
                match key
                    .strip_prefix(prefix.as_str())
                    .and_then(|r| r.strip_prefix('/'))
                {
                    Some(r) => r,
                    None => continue,
                }
            };
            if rel.is_empty()
                || rel
                    .split('/')
                    .any(|p| p.is_empty() || p == "." || p == "..")
            {
                continue;
            }
            objects.push((rel.to_string(), m.size, m.e_tag.clone(), m.location.clone()));
        }
        objects.sort_by(|a, b| a.0.cmp(&b.0));
        // empty "folder" markers (`run/step-100/`, made by consoles and sync tools) are not
        // files: they name a folder other objects are in
        let folders: Vec<bool> = objects
            .iter()
            .map(|o| {
                let under = format!("{}/", o.0);
                let at = objects.partition_point(|x| x.0.as_str() < under.as_str());
                o.1 == 0 && objects.get(at).is_some_and(|x| x.0.starts_with(&under))
            })
            .collect();
        let mut folders = folders.into_iter();
        objects.retain(|_| !folders.next().unwrap_or(false));
        let single = objects.is_empty();
        if single {
            // Not a folder: the URL may name one object.
            let head = block_on(store.head(&root_key))?.map_err(|e| error(remote.url(), &e))?;
            let name = root_key.filename().unwrap_or("object").to_string();
            objects.push((name, head.size, head.e_tag, root_key.clone()));
        }
        let dir = scratch("remote")?;
        let mut files = Vec::with_capacity(objects.len());
        let mut by_path = HashMap::with_capacity(objects.len());
        for (i, (rel, size, e_tag, key)) in objects.iter().enumerate() {
            let local = dir.path().join(rel);
            let scratch_err = |e: std::io::Error| {
                Error::format(
                    remote.shown(if single { "" } else { rel }),
                    format!(
                        "cannot lay out its copy in the scratch folder {}: {e}",
                        dir.path().display()
                    ),
                )
            };
            if let Some(parent) = local.parent() {
                std::fs::create_dir_all(parent).map_err(scratch_err)?;
            }
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&local)
                .map_err(scratch_err)?;
            file.set_len(*size).map_err(scratch_err)?;
            by_path.insert(local, i);
            files.push(MirrorFile {
                rel: if single { String::new() } else { rel.clone() },
                key: key.clone(),
                size: *size,
                e_tag: e_tag.clone(),
                file,
                state: Mutex::new(Fetched::default()),
                landed: std::sync::Condvar::new(),
            });
        }
        let root = if single {
            dir.path().join(&objects[0].0)
        } else {
            dir.path().to_path_buf()
        };
        Ok(Arc::new(Mirror {
            remote,
            dir,
            root,
            files,
            by_path,
        }))
    }

    /// The local path standing for the URL (a folder, or the one file's path).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The URL as given.
    pub fn url(&self) -> &str {
        self.remote.url()
    }

    /// `path` (a path in this mirror) named as the URL it stands for.
    pub fn shown(&self, path: &Path) -> Option<String> {
        let rel = path.strip_prefix(self.dir.path()).ok()?;
        let rel = rel.to_str()?;
        Some(match self.files.first() {
            Some(f) if f.rel.is_empty() => self.remote.url().to_string(),
            _ => self.remote.shown(rel),
        })
    }

    /// Fetch the bytes `spans` (first byte, past the last) of the mirrored file `path` that
    /// are not fetched yet. Errors for a path outside this mirror.
    pub fn fetch(&self, path: &Path, spans: &[(u64, u64)]) -> Result<()> {
        let &i = self.by_path.get(path).ok_or_else(|| {
            Error::usage(format!("{} is not part of {}", path.display(), self.url()))
        })?;
        self.fetch_file(i, spans)
    }

    fn fetch_file(&self, i: usize, spans: &[(u64, u64)]) -> Result<()> {
        let f = &self.files[i];
        let want = clip(f.size, spans);
        if want.is_empty() {
            return Ok(());
        }
        let want = coalesce(&want, GAP);
        let mut state = f.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let need = missing(&want, &state.have);
            if need.is_empty() {
                return Ok(());
            }
            // what no one is fetching is ours to fetch; the rest we wait for
            let mine = missing(&need, &state.pending);
            if mine.is_empty() {
                state = f.landed.wait(state).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            state.pending = union(&state.pending, &mine);
            drop(state);
            let pieces = cut(i, &mine, piece_for(total(&mine)));
            let r = self.fetch_pieces(&pieces, None);
            self.release(i, &mine);
            r?;
            state = f.state.lock().unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Fetch what of `wanted` (mirrored files and their sorted spans) no one has fetched or
    /// is fetching, all files together, in few large ranged GETs: for a reader about to read
    /// most of these bytes (a whole conversion's sources). A reader asking meanwhile for bytes
    /// of these ranges waits for them to land (each range is readable as soon as its request
    /// ends) instead of fetching them again. Errors are those of the first failed request;
    /// ranges left unfetched are fetched by whoever asks for them next. Once `stop` is set,
    /// no request starts (the readers are done, or failed).
    pub fn prefetch(&self, wanted: &[(PathBuf, Vec<(u64, u64)>)], stop: &AtomicBool) -> Result<()> {
        let mut claimed: Vec<(usize, Vec<(u64, u64)>)> = vec![];
        for (path, spans) in wanted {
            let Some(&i) = self.by_path.get(path) else {
                continue;
            };
            let f = &self.files[i];
            let want = coalesce(&clip(f.size, spans), GAP);
            let mut state = f.state.lock().unwrap_or_else(|e| e.into_inner());
            let mine = missing(&missing(&want, &state.have), &state.pending);
            if !mine.is_empty() {
                state.pending = union(&state.pending, &mine);
                claimed.push((i, mine));
            }
        }
        let all: u64 = claimed.iter().map(|(_, m)| total(m)).sum();
        let piece = piece_for(all);
        let pieces: Vec<(usize, u64, u64)> = claimed
            .iter()
            .flat_map(|(i, m)| cut(*i, m, piece))
            .collect();
        let r = self.fetch_pieces(&pieces, Some(stop));
        for (i, m) in &claimed {
            self.release(*i, m);
        }
        r
    }

    /// The ranges `mine` of file `i`, claimed by one fetch, no longer pending (those that
    /// did not land are fetched by whoever asks next); waiters told.
    fn release(&self, i: usize, mine: &[(u64, u64)]) {
        let f = &self.files[i];
        let mut state = f.state.lock().unwrap_or_else(|e| e.into_inner());
        state.pending = missing(&state.pending, mine);
        f.landed.notify_all();
    }

    /// GET `pieces` (file, first byte, past the last; claimed as pending by the caller) into
    /// their local copies, [`IN_FLIGHT`] at a time, each body written as it streams in (what
    /// is in memory is a few network buffers per request, whatever the piece size). A
    /// piece's bytes are marked fetched, and its waiters told, as they land. Pieces not
    /// started when `stop` is set are left unfetched.
    fn fetch_pieces(&self, pieces: &[(usize, u64, u64)], stop: Option<&AtomicBool>) -> Result<()> {
        block_on(async {
            stream::iter(pieces.iter().copied())
                .map(|(i, a, b)| async move {
                    // the process's requests in flight, whatever the callers
                    let _slot = SLOTS.acquire().await.ok();
                    if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                        return Ok(());
                    }
                    self.fetch_piece(i, a, b).await
                })
                .buffer_unordered(IN_FLIGHT)
                .try_for_each(|()| futures::future::ready(Ok(())))
                .await
        })?
    }

    /// One ranged GET of bytes `a..b` of file `i`, streamed into its local copy.
    async fn fetch_piece(&self, i: usize, a: u64, b: u64) -> Result<()> {
        let f = &self.files[i];
        let shown = self.remote.shown(&f.rel);
        let local = self.dir.path().join(&f.rel);
        let failed = |e: object_store::Error| match e {
            object_store::Error::Precondition { .. } => Error::format(
                &shown,
                "changed while it was being read (its ETag is no longer the one listed); run again",
            ),
            e => error(&shown, &e),
        };
        let opts = object_store::GetOptions {
            range: Some(object_store::GetRange::Bounded(a..b)),
            if_match: f.e_tag.clone(),
            ..Default::default()
        };
        let got = self
            .remote
            .store
            .get_opts(&f.key, opts)
            .await
            .map_err(failed)?;
        REQUESTS.fetch_add(1, Ordering::Relaxed);
        let mut body = got.into_stream();
        let mut at = a;
        // bytes written and not yet marked fetched
        let mut landed = a;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(failed)?;
            let n = chunk.len() as u64;
            if n > b - at {
                return Err(Error::format(
                    &shown,
                    format!("returned more than {} bytes for the range {a}..{b}", b - a),
                ));
            }
            f.file.write_all_at(&chunk, at).at(&local)?;
            BYTES.fetch_add(n, Ordering::Relaxed);
            at += n;
            if at - landed >= LANDED {
                // readable now: a reader waiting for the piece's first bytes goes on
                let mut state = f.state.lock().unwrap_or_else(|e| e.into_inner());
                state.have = union(&state.have, &[(landed, at)]);
                f.landed.notify_all();
                landed = at;
            }
        }
        if at != b {
            return Err(Error::format(
                &shown,
                format!("returned {} bytes for the range {a}..{b}", at - a),
            ));
        }
        let mut state = f.state.lock().unwrap_or_else(|e| e.into_inner());
        state.have = union(&state.have, &[(landed, b)]);
        state.pending = missing(&state.pending, &[(a, b)]);
        f.landed.notify_all();
        Ok(())
    }
}

/// `spans` clipped to `size`, empty ones dropped, sorted.
fn clip(size: u64, spans: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = spans
        .iter()
        .map(|&(a, b)| (a.min(size), b.min(size)))
        .filter(|(a, b)| a < b)
        .collect();
    v.sort_unstable();
    v
}

/// Bytes in `spans`.
fn total(spans: &[(u64, u64)]) -> u64 {
    spans.iter().map(|(a, b)| b - a).sum()
}

/// The largest ranged GET for a fetch of `bytes` in all: enough pieces to keep
/// [`IN_FLIGHT`] requests busy, each of [`PIECE`] at least and [`MAX_PIECE`] at most.
fn piece_for(bytes: u64) -> u64 {
    bytes.div_ceil(IN_FLIGHT as u64).clamp(PIECE, MAX_PIECE)
}

/// `spans` of file `i` cut into pieces of at most `piece` bytes.
fn cut(i: usize, spans: &[(u64, u64)], piece: u64) -> Vec<(usize, u64, u64)> {
    spans
        .iter()
        .flat_map(|&(a, b)| {
            let n = (b - a).div_ceil(piece).max(1);
            // equal pieces, not full ones and a short tail
            let each = (b - a).div_ceil(n);
            (0..n).map(move |k| (i, a + k * each, (a + (k + 1) * each).min(b)))
        })
        .filter(|(_, a, b)| a < b)
        .collect()
}

impl crate::Storage for Mirror {
    /// Fetch the bytes of `spans` of `path` not fetched yet; nothing for a path that is not
    /// one of the mirror's files.
    fn ensure(&self, path: &Path, spans: &[(u64, u64)]) -> Result<()> {
        if spans.is_empty() || !self.by_path.contains_key(path) {
            return Ok(());
        }
        self.fetch(path, spans)
    }

    fn fetches(&self) -> bool {
        true
    }

    fn prefetch(&self, wanted: &[(PathBuf, Vec<(u64, u64)>)], stop: &AtomicBool) -> Result<()> {
        Mirror::prefetch(self, wanted, stop)
    }

    fn shown(&self, path: &Path) -> Option<String> {
        Mirror::shown(self, path)
    }

    /// What identifies the version of the object `path` stands for: its URL, size and ETag.
    fn identity(&self, path: &Path) -> Option<(String, u64, String)> {
        let f = &self.files[*self.by_path.get(path)?];
        Some((
            self.shown(path)?,
            f.size,
            f.e_tag.clone().unwrap_or_default(),
        ))
    }

    /// The local files and their sizes.
    fn files(&self) -> Vec<(PathBuf, u64)> {
        let mut v: Vec<(PathBuf, u64)> = self
            .by_path
            .iter()
            .map(|(p, &i)| (p.clone(), self.files[i].size))
            .collect();
        v.sort();
        v
    }

    /// An error naming paths of this mirror, named by their URLs instead.
    fn rename(&self, e: Error) -> Error {
        match e {
            Error::Io { path, source } => match self.shown(&path) {
                Some(s) => Error::Io {
                    path: PathBuf::from(s),
                    source,
                },
                None => Error::Io { path, source },
            },
            Error::Format { path, msg } => {
                let msg = msg.replace(&self.dir.path().display().to_string(), self.remote.url());
                match self.shown(&path) {
                    Some(s) => Error::Format {
                        path: PathBuf::from(s),
                        msg,
                    },
                    None => Error::Format { path, msg },
                }
            }
            Error::Refused { msg, hint } => Error::Refused {
                msg: msg.replace(&self.dir.path().display().to_string(), self.remote.url()),
                hint,
            },
            e => e,
        }
    }
}

/// Where mirrors and staged uploads are made: `RESHARD_SCRATCH`, else the system's
/// temporary folder.
pub fn scratch_dir() -> PathBuf {
    std::env::var_os("RESHARD_SCRATCH")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// A new scratch folder `reshard-KIND-PID.HOST-XXXXXX` under [`scratch_dir`], removed when
/// dropped. Folders of this kind that processes of this machine no longer alive left behind
/// (a run that was killed) are removed first.
pub fn scratch(kind: &str) -> Result<tempfile::TempDir> {
    let base = scratch_dir();
    let prefix = format!("reshard-{kind}-");
    if let Ok(rd) = std::fs::read_dir(&base) {
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
                continue;
            };
            // `PID.HOST-XXXXXX`: only this machine's processes can be known to be gone
            let Some((pid, host)) = rest
                .rsplit_once('-')
                .and_then(|(owner, _)| owner.split_once('.'))
                .and_then(|(p, h)| Some((p.parse::<u32>().ok()?, h)))
            else {
                continue;
            };
            if host != crate::remote::host_tag() {
                continue;
            }
            let owned = e
                .metadata()
                .map(|m| {
                    use std::os::unix::fs::MetadataExt;
                    m.is_dir() && m.uid() == own_uid()
                })
                .unwrap_or(false);
            if owned && !crate::sys::pid_alive(pid) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    tempfile::Builder::new()
        .prefix(&format!(
            "{prefix}{}.{}-",
            std::process::id(),
            crate::remote::host_tag()
        ))
        .tempdir_in(&base)
        .map_err(|e| Error::format(&base, format!("cannot make a scratch folder: {e}")))
}

/// This process's user id (scratch folders of other users are left alone).
fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX)
}

/// Sorted ranges with those closer than `gap` merged.
pub fn coalesce(sorted: &[(u64, u64)], gap: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for &(a, b) in sorted {
        match out.last_mut() {
            Some(l) if a <= l.1.saturating_add(gap) => l.1 = l.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// The parts of sorted disjoint `want` not covered by sorted disjoint `have`.
fn missing(want: &[(u64, u64)], have: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = vec![];
    for &(a, b) in want {
        let mut at = a;
        let first = have.partition_point(|h| h.1 <= a);
        for &(x, y) in &have[first..] {
            if x >= b {
                break;
            }
            if x > at {
                out.push((at, x));
            }
            at = at.max(y);
            if at >= b {
                break;
            }
        }
        if at < b {
            out.push((at, b));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(
            coalesce(&[(0, 4), (6, 9), (100, 110)], 2),
            vec![(0, 9), (100, 110)]
        );
        assert_eq!(
            missing(&[(0, 10)], &[(2, 4), (6, 8)]),
            vec![(0, 2), (4, 6), (8, 10)]
        );
        assert_eq!(missing(&[(0, 10)], &[(0, 10)]), vec![]);
        assert_eq!(
            missing(&[(5, 10), (20, 30)], &[(0, 7), (25, 40)]),
            vec![(7, 10), (20, 25)]
        );
    }

    #[test]
    fn pieces() {
        // small fetches in PIECE-sized GETs; large ones in IN_FLIGHT of them, up to MAX_PIECE
        assert_eq!(piece_for(1 << 20), PIECE);
        assert_eq!(piece_for(IN_FLIGHT as u64 * (12 << 20)), 12 << 20);
        assert_eq!(piece_for(1 << 40), MAX_PIECE);
        // equal pieces covering each span exactly, none longer than asked
        let got = cut(3, &[(0, 10), (20, 21), (30, 30)], 4);
        assert_eq!(got, vec![(3, 0, 4), (3, 4, 8), (3, 8, 10), (3, 20, 21)]);
        let got = cut(0, &[(100, 100 + 3 * PIECE + 1)], PIECE);
        assert_eq!(got.len(), 4);
        assert!(got.iter().all(|&(_, a, b)| b - a <= PIECE));
        assert_eq!(got.first().map(|p| p.1), Some(100));
        assert_eq!(got.last().map(|p| p.2), Some(100 + 3 * PIECE + 1));
        assert!(got.windows(2).all(|w| w[0].2 == w[1].1));
    }
}
