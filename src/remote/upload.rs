//! Writing a checkpoint to object storage: the destination, built and checked in a local
//! scratch folder like any other, is sent file by file — each as a multipart upload read
//! from disk [`CHUNK`] at a time with [`IN_FLIGHT`] parts in flight, so memory stays
//! bounded whatever the file's size — and the objects that make the checkpoint loadable
//! ([`crate::formats::loadable_last`]) go last, so a reader never finds a checkpoint whose
//! data is not all there. A failed upload is aborted, and the objects this run already sent
//! are removed. Each multipart upload in progress is noted in a local journal
//! ([`journal_dir`]); one a killed run left behind is aborted by the next upload to the
//! same destination, and one that cannot be aborted is named in the error.

use super::{block_on, describe, error, Remote};
use crate::error::{Error, Hint, IoContext, Result};
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::{ObjectStoreExt, WriteMultipart};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Part size of multipart uploads (raised for files so large that 10,000 parts of it would
/// not hold them: S3's limit).
const CHUNK: u64 = 16 << 20;
/// Parts of one file in flight at once.
const IN_FLIGHT: usize = 4;

/// What an upload sent.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sent {
    /// Objects written.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Incomplete multipart uploads of earlier, killed runs to this destination, aborted.
    pub reclaimed: Vec<String>,
}

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
pub(crate) fn check_destination(url: &Path, force: bool) -> Result<()> {
    let remote = Remote::parse(url)?;
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

/// Upload `local` (the finished destination: a file, or a folder of files) to `url`, the
/// loadable objects last; with `force`, objects under `url` the new checkpoint does not
/// have are removed afterwards.
pub(crate) fn upload(local: &Path, url: &Path, force: bool) -> Result<Sent> {
    let remote = Remote::parse(url)?;
    let before = existing(&remote)?;
    if !before.is_empty() && !force {
        check_destination(url, false)?;
    }
    let reclaimed = reclaim(&remote)?;
    let mut files: Vec<(String, PathBuf)> = vec![];
    if local.is_file() {
        files.push((String::new(), local.to_path_buf()));
    } else {
        walk(local, local, &mut files)?;
    }
    files.sort_by(|a, b| {
        (crate::formats::loadable_last(&a.0), &a.0).cmp(&(crate::formats::loadable_last(&b.0), &b.0))
    });
    let mut sent = Sent {
        reclaimed,
        ..Sent::default()
    };
    let mut done: Vec<String> = vec![];
    for (rel, path) in &files {
        match put_file(&remote, rel, path) {
            Ok(n) => {
                sent.objects += 1;
                sent.bytes += n;
                done.push(rel.clone());
            }
            Err(e) => {
                let cleaned = remove(&remote, &done);
                let tail = match cleaned {
                    Ok(()) if done.is_empty() => "; nothing was published".to_string(),
                    Ok(()) => format!(
                        "; nothing was published (the {} object{} already sent were removed)",
                        done.len(),
                        if done.len() == 1 { "" } else { "s" }
                    ),
                    Err(_) => format!(
                        "; the checkpoint is not loadable (its last object was not sent), and the {} object{} already sent could not be removed",
                        done.len(),
                        if done.len() == 1 { "" } else { "s" }
                    ),
                };
                return Err(Error::format(remote.shown(rel), format!("upload failed: {e}{tail}")));
            }
        }
    }
    if force {
        let stale: Vec<String> = before
            .into_iter()
            .filter(|r| !files.iter().any(|(f, _)| f == r))
            .collect();
        remove(&remote, &stale)?;
    }
    Ok(sent)
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

/// Send the file `path` as object `rel`: one PUT when it fits one part, else a multipart
/// upload (journaled while it runs, aborted on error). Returns its size. Errors are the
/// store's, in one line.
fn put_file(remote: &Remote, rel: &str, path: &Path) -> std::result::Result<u64, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let size = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    let store = remote.store.clone();
    let key = remote.key(rel);
    let chunk = CHUNK.max(size.div_ceil(9_000).next_multiple_of(1 << 20));
    let read = |at: u64, len: u64| -> std::result::Result<Bytes, String> {
        let mut buf = vec![0u8; len as usize];
        file.read_exact_at(&mut buf, at)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Bytes::from(buf))
    };
    if size <= chunk {
        let bytes = read(0, size)?;
        let put = block_on(async { store.put(&key, bytes.into()).await }).map_err(|e| e.to_string())?;
        put.map_err(|e| describe(&e))?;
        return Ok(size);
    }
    let Some(mp) = remote.multipart.clone() else {
        // A store without the low-level calls (plain HTTP): its own multipart writer.
        return block_on(async {
            let upload = store.put_multipart(&key).await.map_err(|e| describe(&e))?;
            let mut w = WriteMultipart::new_with_chunk_size(upload, chunk as usize);
            let mut at = 0;
            while at < size {
                let n = chunk.min(size - at);
                if let Err(e) = w.wait_for_capacity(IN_FLIGHT).await {
                    let _ = w.abort().await;
                    return Err(describe(&e));
                }
                match read(at, n) {
                    Ok(b) => w.put(b),
                    Err(e) => {
                        let _ = w.abort().await;
                        return Err(e);
                    }
                }
                at += n;
            }
            w.finish().await.map_err(|e| describe(&e))?;
            Ok(size)
        })
        .map_err(|e| e.to_string())?;
    };
    let id = block_on(mp.create_multipart(&key))
        .map_err(|e| e.to_string())?
        .map_err(|e| describe(&e))?;
    let note = Journal::add(remote, rel, &id);
    let parts = size.div_ceil(chunk) as usize;
    let sent = block_on(async {
        use futures::StreamExt;
        let ids: Vec<object_store::multipart::PartId> = futures::stream::iter(0..parts)
            .map(|i| {
                let (mp, key, id) = (mp.clone(), key.clone(), id.clone());
                let at = i as u64 * chunk;
                let bytes = read(at, chunk.min(size - at));
                async move {
                    mp.put_part(&key, &id, i, bytes?.into())
                        .await
                        .map_err(|e| describe(&e))
                }
            })
            .buffered(IN_FLIGHT)
            .try_collect()
            .await?;
        mp.complete_multipart(&key, &id, ids)
            .await
            .map_err(|e| describe(&e))
    })
    .map_err(|e| e.to_string())?;
    match sent {
        Ok(_) => {
            Journal::done(note);
            Ok(size)
        }
        Err(e) => match block_on(mp.abort_multipart(&key, &id)) {
            Ok(Ok(())) | Ok(Err(object_store::Error::NotFound { .. })) => {
                Journal::done(note);
                Err(e)
            }
            _ => Err(format!(
                "{e}; its multipart upload {id} could not be aborted either (the next upload to {} aborts it; or remove it with the store's tools)",
                remote.url()
            )),
        },
    }
}

/// Where multipart uploads in progress are noted: `$RESHARD_UPLOAD_JOURNAL`, else
/// `reshard/uploads` in the user's cache folder (`$XDG_CACHE_HOME`, `~/.cache`).
pub(crate) fn journal_dir() -> PathBuf {
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
                v.get("pid").and_then(|x| x.as_u64()).and_then(|x| u32::try_from(x).ok()),
            ) else {
                continue;
            };
            out.push((p, Entry { dest, rel, id, pid }));
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
        if e.dest != remote.url() || super::alive(e.pid) {
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
