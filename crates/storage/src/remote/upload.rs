//! Writing a checkpoint to object storage ([`Upload`]): the conversion writes its output
//! into sparse scratch files chunk by chunk, and each destination file is sent as a
//! multipart upload whose parts go as soon as their bytes are written ([`FileUpload::send`],
//! `IN_FLIGHT` at a time, read back from the scratch file whose blocks are then freed), so
//! neither memory nor scratch disk holds the whole output. The objects that make the
//! checkpoint loadable ([`UploadOptions::loadable`]) are completed last, so a reader
//! never finds a checkpoint whose data is not all there. A failed upload is aborted, and the
//! objects this run already sent are removed. Each multipart upload in progress is noted in
//! a local journal ([`journal_dir`]); one a killed run left behind is aborted by the next
//! upload to the same destination, and one that cannot be aborted is named in the error.

use super::{block_on, describe, error, Remote};
use crate::error::{Error, Hint, IoContext, Result};
use bytes::Bytes;
use futures::{stream, StreamExt, TryStreamExt};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Part size of multipart uploads (raised for files so large that 10,000 parts of it would
/// not hold them: S3's limit).
pub const CHUNK: u64 = 16 << 20;
/// The smallest part S3 takes (but the last).
pub const MIN_CHUNK: u64 = 5 << 20;

/// How an upload goes.
#[derive(Clone, Copy, Debug)]
pub struct UploadOptions {
    /// Replace the objects the destination holds (removed before anything is sent, the
    /// loadable ones first); without it, a destination that holds objects is refused.
    pub force: bool,
    /// Whether an object (a `/`-separated path inside the destination; `""` for a
    /// single-file one) makes the checkpoint loadable: sent last, removed first. The formats
    /// know which; this crate does not.
    pub loadable: fn(&str) -> bool,
    /// Part size of multipart uploads: [`CHUNK`] when `None`, at least [`MIN_CHUNK`].
    pub chunk: Option<u64>,
}

/// Parts of one file in flight at once.
const IN_FLIGHT: usize = 4;
/// Batches of chunks ([`FileUpload::send`]) of one file being sent at once: the next
/// batch's parts start as the last one's end (no drain between batches), while the scratch
/// disk holds at most this many batches not yet sent.
const BATCHES_IN_FLIGHT: usize = 2;

/// The objects under `url`, as `/`-separated paths under its prefix (the URL itself, as
/// `""`, when it names one object).
fn existing(remote: &Remote) -> Result<Vec<String>> {
    let store = remote.store.clone();
    let root = remote.key("");
    let listed: Vec<object_store::ObjectMeta> =
        block_on(async { store.list(Some(&root)).try_collect::<Vec<_>>().await })?
            .map_err(|e| error(remote.url(), &e))?;
    let prefix = root.as_ref().to_string();
    let mut out: Vec<String> = listed
        .iter()
        .filter_map(|m| {
            let k = m.location.as_ref();
            if prefix.is_empty() {
                Some(k.to_string())
            } else {
                k.strip_prefix(prefix.as_str())
                    .and_then(|r| r.strip_prefix('/'))
                    .map(str::to_string)
            }
        })
        .collect();
    if out.is_empty() {
        match block_on(store.head(&root))? {
            Ok(_) => out.push(String::new()),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(error(remote.url(), &e)),
        }
    }
    Ok(out)
}

/// Refuse a destination URL that already holds objects, unless `force`; also proves the
/// store is reachable and the credentials work before any conversion is done.
pub fn check_destination(url: &Path, force: bool) -> Result<()> {
    let remote = Remote::parse(url)?;
    if remote.multipart.is_none() {
        return Err(Error::usage(format!(
            "{}: reshard writes to s3://, gs:// and az:// URLs; http(s):// URLs are read-only",
            remote.url()
        )));
    }
    let found = existing(&remote)?;
    if !found.is_empty() && !force {
        return Err(Error::refused(
            format!(
                "{}: exists ({} object{}); --force replaces it",
                remote.url(),
                found.len(),
                if found.len() == 1 { "" } else { "s" }
            ),
            Hint::Force,
        ));
    }
    Ok(())
}

/// An upload of a checkpoint under a URL in progress: objects are sent one file at a time
/// ([`Upload::file`]); on an error, [`Upload::fail`] removes the objects already sent.
pub struct Upload {
    remote: Remote,
    opts: UploadOptions,
    /// Objects under the URL before the upload.
    before: Vec<String>,
    /// Objects this upload completed.
    done: Vec<String>,
    /// Incomplete multipart uploads of killed runs, aborted at the start.
    reclaimed: Vec<String>,
}

impl Upload {
    /// Start uploading to `url`: refuse it when it holds objects (unless `opts.force`: then
    /// they are removed now, the loadable ones first, so that no mix of the old checkpoint and
    /// the new can ever be loaded), and abort the multipart uploads killed runs to it left.
    pub fn start(url: &Path, opts: UploadOptions) -> Result<Upload> {
        let remote = Remote::parse(url)?;
        let mut before = existing(&remote)?;
        if !before.is_empty() && !opts.force {
            check_destination(url, false)?;
        }
        before.sort_by_key(|r| !(opts.loadable)(r));
        remove(&remote, &before)?;
        let reclaimed = reclaim(&remote)?;
        Ok(Upload {
            remote,
            opts,
            before,
            done: vec![],
            reclaimed,
        })
    }

    /// Begin sending the local file `path` (`size` bytes, being written) as object `rel`;
    /// with `free`, the disk blocks of each chunk are freed once it is sent (a scratch file
    /// nothing else needs: not a staged output a failed upload must be able to send again).
    pub fn file(&self, rel: &str, path: &Path, size: u64, free: bool) -> Result<FileUpload> {
        let shown = self.remote.shown(rel);
        // read and write: the blocks of the chunks sent are freed through it
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .at(path)?;
        let chunk = (self.opts.chunk.unwrap_or(CHUNK).max(MIN_CHUNK))
            .max(size.div_ceil(9_000).next_multiple_of(1 << 20));
        let key = self.remote.key(rel);
        let multipart = match (&self.remote.multipart, size > chunk) {
            (Some(mp), true) => {
                let id = block_on(mp.create_multipart(&key))?.map_err(|e| error(&shown, &e))?;
                let note = Journal::add(&self.remote, rel, &id);
                Some(Multipart {
                    store: mp.clone(),
                    id,
                    note,
                    parts: vec![None; size.div_ceil(chunk) as usize],
                    queued: vec![false; size.div_ceil(chunk) as usize],
                    slots: Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)),
                    sending: std::collections::VecDeque::new(),
                })
            }
            _ => None,
        };
        Ok(FileUpload {
            store: self.remote.store.clone(),
            key,
            rel: rel.to_string(),
            shown,
            path: path.to_path_buf(),
            file: Arc::new(file),
            size,
            chunk,
            free,
            multipart,
        })
    }

    /// The file `f` was sent whole.
    pub fn sent(&mut self, f: FileUpload) -> Result<()> {
        let rel = f.rel.clone();
        f.complete()?;
        self.done.push(rel);
        Ok(())
    }

    /// Every file is sent.
    /// Returns the objects whose incomplete uploads by killed runs were aborted.
    pub fn finish(self) -> Result<Vec<String>> {
        Ok(self.reclaimed)
    }

    /// The upload failed with `e` (while `current`, if any, was being sent): abort that,
    /// remove the objects already sent, and say so in the error.
    pub fn fail(&mut self, e: Error, current: Option<FileUpload>) -> Error {
        let mut tail = String::new();
        if let Some(f) = current {
            if let Some(left) = f.abort() {
                tail.push_str(&format!("; {left}"));
            }
        }
        let mut done = std::mem::take(&mut self.done);
        // the loadable objects go first (they were sent last)
        done.reverse();
        let n = done.len();
        let s = if n == 1 { "" } else { "s" };
        let loadable: Vec<&String> = done.iter().filter(|r| (self.opts.loadable)(r)).collect();
        tail.push_str(&match remove(&self.remote, &done) {
            Ok(()) if n == 0 => "; nothing was published".to_string(),
            Ok(()) => format!("; nothing was published (the {n} object{s} already sent were removed)"),
            Err(_) if loadable.is_empty() => format!(
                "; the checkpoint is not loadable (its loadable object was not sent), and the {n} object{s} already sent could not be removed"
            ),
            Err(_) => format!(
                "; the {n} object{s} already sent could not be removed, {} among them: remove {} by hand",
                self.remote.shown(loadable[0]),
                self.remote.url()
            ),
        });
        if self.opts.force && !self.before.is_empty() {
            tail.push_str(&format!(
                " (the {} object(s) it replaced were removed before the upload, as --force asks)",
                self.before.len()
            ));
        }
        Error::format(self.remote.url(), format!("upload failed: {e}{tail}"))
    }
}

/// Chunks being sent in the background: their indexes and part ids, or the error.
type Sending = tokio::task::JoinHandle<std::result::Result<Vec<(usize, PartId)>, String>>;

/// A multipart upload of one object in progress.
struct Multipart {
    store: Arc<dyn MultipartStore>,
    id: String,
    /// Its journal entry.
    note: Option<PathBuf>,
    /// The id of each part sent.
    parts: Vec<Option<object_store::multipart::PartId>>,
    /// Whether each part was handed to a sending task.
    queued: Vec<bool>,
    /// The file's parts in flight, [`IN_FLIGHT`] at most, whatever the batches.
    slots: Arc<tokio::sync::Semaphore>,
    /// The batches of parts being sent in the background, oldest first.
    sending: std::collections::VecDeque<Sending>,
}

/// One file being sent as one object: as chunks of [`FileUpload::chunk`] bytes once they
/// are written ([`FileUpload::send`], in the background while the next are written), or in
/// one PUT when it is small or the store has no multipart calls.
pub struct FileUpload {
    store: Arc<dyn ObjectStore>,
    key: ObjPath,
    rel: String,
    shown: String,
    path: PathBuf,
    file: Arc<std::fs::File>,
    size: u64,
    chunk: u64,
    /// Free each chunk's disk blocks once it is sent.
    free: bool,
    multipart: Option<Multipart>,
}

impl FileUpload {
    /// Bytes per chunk (a multipart upload's part).
    pub fn chunk(&self) -> u64 {
        self.chunk
    }

    /// The chunks `ks` of the file are written: send them (as parts of the batches sent
    /// before free up; the batch before the last is waited for first), and free their disk
    /// blocks once sent if the upload frees them. Nothing to do when the file goes in one PUT
    /// at the end.
    pub fn send(&mut self, ks: Vec<usize>) -> Result<()> {
        let (size, chunk) = (self.size, self.chunk);
        let Some(mp) = self.multipart.as_mut() else {
            return Ok(());
        };
        while mp.sending.len() >= BATCHES_IN_FLIGHT {
            wait_one(mp, &self.shown)?;
        }
        // a chunk goes once: its blocks are freed after it is sent
        let ks: Vec<usize> = ks
            .into_iter()
            .filter(|&k| mp.queued.get(k).is_some_and(|q| !q))
            .collect();
        if ks.is_empty() {
            return Ok(());
        }
        for &k in &ks {
            mp.queued[k] = true;
        }
        let slots = mp.slots.clone();
        let (store, key, id) = (mp.store.clone(), self.key.clone(), mp.id.clone());
        let (file, path, free) = (self.file.clone(), self.path.clone(), self.free);
        let task = async move {
            stream::iter(ks)
                .map(|k| {
                    let (store, key, id, file, path, slots) = (
                        store.clone(),
                        key.clone(),
                        id.clone(),
                        file.clone(),
                        path.clone(),
                        slots.clone(),
                    );
                    async move {
                        // the part is read only once it may go: memory holds IN_FLIGHT parts
                        let _slot = slots.acquire_owned().await.ok();
                        let at = k as u64 * chunk;
                        let len = chunk.min(size - at);
                        let bytes = read_at(&file, &path, at, len)?;
                        let part = store
                            .put_part(&key, &id, k, bytes.into())
                            .await
                            .map_err(|e| describe(&e))?;
                        if free {
                            // sent: its blocks in the scratch file are no longer needed
                            let _ = crate::sys::punch_hole(&file, at, len);
                        }
                        Ok::<_, String>((k, part))
                    }
                })
                .buffer_unordered(IN_FLIGHT)
                .try_collect::<Vec<_>>()
                .await
        };
        mp.sending.push_back(super::runtime()?.spawn(task));
        Ok(())
    }

    /// Every chunk is written: send what is left and make the object appear.
    fn complete(mut self) -> Result<()> {
        let shown = self.shown.clone();
        if self.multipart.is_none() {
            let bytes = read_at(&self.file, &self.path, 0, self.size)
                .map_err(|e| Error::format(&shown, e))?;
            let store = self.store.clone();
            let key = self.key.clone();
            return block_on(async move { store.put(&key, bytes.into()).await })?
                .map(|_| ())
                .map_err(|e| error(&shown, &e));
        }
        match self.finish_parts() {
            Ok(()) => {
                if let Some(mp) = self.multipart.as_mut() {
                    Journal::done(mp.note.take());
                }
                Ok(())
            }
            Err(e) => match self.abort() {
                Some(left) => Err(match e {
                    Error::Format { path, msg } => Error::Format {
                        path,
                        msg: format!("{msg}; {left}"),
                    },
                    e => Error::format(&shown, format!("{e}; {left}")),
                }),
                None => Err(e),
            },
        }
    }

    /// Send the chunks never sent, wait for all, and complete the multipart upload.
    fn finish_parts(&mut self) -> Result<()> {
        let shown = self.shown.clone();
        let Some(mp) = self.multipart.as_mut() else {
            return Ok(());
        };
        // the chunks sent so far first: only those never sent go now
        wait(mp, &shown)?;
        let unsent: Vec<usize> = (0..mp.parts.len()).filter(|&k| !mp.queued[k]).collect();
        self.send(unsent)?;
        let Some(mp) = self.multipart.as_mut() else {
            return Ok(());
        };
        wait(mp, &shown)?;
        let ids: Vec<PartId> = mp
            .parts
            .iter()
            .map(|p| {
                p.clone()
                    .ok_or_else(|| Error::format(&shown, "a part was not sent"))
            })
            .collect::<Result<_>>()?;
        block_on(mp.store.complete_multipart(&self.key, &mp.id, ids))?
            .map(|_| ())
            .map_err(|e| error(&shown, &e))
    }

    /// Abort the multipart upload; what was left behind when that failed too.
    fn abort(mut self) -> Option<String> {
        let mut mp = self.multipart.take()?;
        for h in mp.sending.drain(..) {
            h.abort();
        }
        match block_on(mp.store.abort_multipart(&self.key, &mp.id)) {
            Ok(Ok(())) | Ok(Err(object_store::Error::NotFound { .. })) => {
                Journal::done(mp.note.take());
                None
            }
            _ => Some(format!(
                "its multipart upload {} of {} could not be aborted either (the next upload to this destination aborts it; or remove it with the store's tools)",
                mp.id, self.shown
            )),
        }
    }
}

/// Wait for the chunks being sent of `mp`, and note their part ids.
fn wait(mp: &mut Multipart, shown: &str) -> Result<()> {
    while !mp.sending.is_empty() {
        wait_one(mp, shown)?;
    }
    Ok(())
}

/// Wait for the oldest batch of chunks being sent of `mp`, and note their part ids.
fn wait_one(mp: &mut Multipart, shown: &str) -> Result<()> {
    let Some(h) = mp.sending.pop_front() else {
        return Ok(());
    };
    let sent = block_on(h)?
        .map_err(|e| Error::format(shown, format!("a sending task failed: {e}")))?
        .map_err(|e| Error::format(shown, e))?;
    for (k, id) in sent {
        if let Some(slot) = mp.parts.get_mut(k) {
            *slot = Some(id);
        }
    }
    Ok(())
}

/// `len` bytes at `at` of `file` (at `path`).
fn read_at(
    file: &std::fs::File,
    path: &Path,
    at: u64,
    len: u64,
) -> std::result::Result<Bytes, String> {
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, at)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Bytes::from(buf))
}

/// Upload the finished local output `local` (a file, or a folder of files) to `url`, the
/// loadable objects last, then remove it (kept whole until then, so that a failed upload can
/// be run again). Returns the
/// objects whose incomplete uploads by killed runs were aborted first.
pub fn upload_tree(local: &Path, url: &Path, opts: UploadOptions) -> Result<Vec<String>> {
    let mut files: Vec<(String, PathBuf)> = vec![];
    if local.is_file() {
        files.push((String::new(), local.to_path_buf()));
    } else {
        walk(local, local, &mut files)?;
    }
    files.sort_by(|a, b| ((opts.loadable)(&a.0), &a.0).cmp(&((opts.loadable)(&b.0), &b.0)));
    let mut up = Upload::start(url, opts)?;
    for (rel, path) in &files {
        let size = std::fs::metadata(path).at(path)?.len();
        let mut f = match up.file(rel, path, size, false) {
            Ok(f) => f,
            Err(e) => return Err(up.fail(e, None)),
        };
        let chunks = size.div_ceil(f.chunk()) as usize;
        if let Err(e) = f.send((0..chunks).collect()) {
            return Err(up.fail(e, Some(f)));
        }
        if let Err(e) = up.sent(f) {
            return Err(up.fail(e, None));
        }
    }
    let reclaimed = up.finish()?;
    let gone = if local.is_dir() {
        std::fs::remove_dir_all(local)
    } else {
        std::fs::remove_file(local)
    };
    gone.at(local)?;
    Ok(reclaimed)
}

/// Every file under `dir`, with its path relative to `root` (`/`-separated).
fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) -> Result<()> {
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let p = e.path();
        if e.file_type().at(&p)?.is_dir() {
            walk(root, &p, out)?;
        } else {
            let rel = p
                .strip_prefix(root)
                .ok()
                .and_then(|r| r.to_str())
                .ok_or_else(|| Error::format(&p, "has a name that is not UTF-8"))?
                .to_string();
            out.push((rel, p));
        }
    }
    Ok(())
}

/// Where multipart uploads in progress are noted: `$RESHARD_UPLOAD_JOURNAL`, else
/// `reshard/uploads` in the user's cache folder (`$XDG_CACHE_HOME`, `~/.cache`).
pub fn journal_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("RESHARD_UPLOAD_JOURNAL") {
        return PathBuf::from(d);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    cache.join("reshard").join("uploads")
}

/// One journal entry: a multipart upload of `key` under the destination `dest`.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    dest: String,
    rel: String,
    id: String,
    pid: u32,
    /// The machine the upload ran on ([`super::host_tag`]).
    host: String,
}

/// Largest journal entry read (an entry is a few hundred bytes).
const MAX_ENTRY: u64 = 64 << 10;

/// The local record of multipart uploads in progress: one small JSON file each, written
/// when an upload starts and removed when it completes or is aborted. Best effort: a
/// journal that cannot be written costs only the cleanup of a killed run.
struct Journal;

impl Journal {
    /// Note the upload `id` of `rel` under `remote`; the entry's path.
    fn add(remote: &Remote, rel: &str, id: &str) -> Option<PathBuf> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = journal_dir();
        std::fs::create_dir_all(&dir).ok()?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let pid = std::process::id();
        let name = format!("{pid}-{nanos}-{}.json", SEQ.fetch_add(1, Ordering::Relaxed));
        let text = serde_json::json!({
            "dest": remote.url(),
            "rel": rel,
            "id": id,
            "pid": pid,
            "host": super::host_tag(),
        })
        .to_string();
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).ok()?;
        let path = dir.join(name);
        std::fs::rename(&tmp, &path).ok()?;
        Some(path)
    }

    /// The upload an entry noted is over.
    fn done(entry: Option<PathBuf>) {
        if let Some(p) = entry {
            let _ = std::fs::remove_file(p);
        }
    }

    /// The entries (and their files) under `dir`; unreadable or malformed ones are skipped.
    fn entries(dir: &Path) -> Vec<(PathBuf, Entry)> {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return vec![];
        };
        let mut out = vec![];
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().and_then(|x| x.to_str()) != Some("json") {
                continue;
            }
            let ok = std::fs::metadata(&p).map(|m| m.is_file() && m.len() <= MAX_ENTRY);
            if !matches!(ok, Ok(true)) {
                continue;
            }
            let Ok(text) = std::fs::read_to_string(&p) else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
            let (Some(dest), Some(rel), Some(id), Some(pid)) = (
                field("dest"),
                field("rel"),
                field("id"),
                v.get("pid")
                    .and_then(|x| x.as_u64())
                    .and_then(|x| u32::try_from(x).ok()),
            ) else {
                continue;
            };
            let host = field("host").unwrap_or_default();
            out.push((
                p,
                Entry {
                    dest,
                    rel,
                    id,
                    pid,
                    host,
                },
            ));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// Abort the incomplete multipart uploads the journal holds for `remote`'s destination from
/// runs that are no longer alive; the objects they were for.
fn reclaim(remote: &Remote) -> Result<Vec<String>> {
    let Some(mp) = remote.multipart.clone() else {
        return Ok(vec![]);
    };
    let mut out = vec![];
    for (path, e) in Journal::entries(&journal_dir()) {
        // another machine's upload may still be running: only this machine's are judged
        if e.dest != remote.url() || e.host != super::host_tag() || crate::sys::pid_alive(e.pid) {
            continue;
        }
        let key = remote.key(&e.rel);
        match block_on(mp.abort_multipart(&key, &e.id))? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                let _ = std::fs::remove_file(&path);
                out.push(remote.shown(&e.rel));
            }
            Err(err) => {
                return Err(Error::format(
                    remote.shown(&e.rel),
                    format!(
                        "an earlier run's multipart upload {} cannot be aborted: {} (its journal entry: {})",
                        e.id,
                        describe(&err),
                        path.display()
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// Delete the objects `rels` under `remote`.
fn remove(remote: &Remote, rels: &[String]) -> Result<()> {
    let store = remote.store.clone();
    for rel in rels {
        let key = remote.key(rel);
        match block_on(store.delete(&key))? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(error(&remote.shown(rel), &e)),
        }
    }
    Ok(())
}
