//! Atomic commit of outputs: everything is written under a temporary name beside the
//! destination, fsynced, then renamed into place in one step.
//!
//! A single-file output is staged as `.NAME.reshard-tmp-PID`; a directory output is staged as
//! a whole directory `.NAME.reshard-tmp-PID/` and renamed at once, so an error or a kill never
//! leaves a partial output under the final name. An existing destination is replaced only
//! when asked (`force`), and only after the new output is complete: a directory (or a file
//! replaced by a directory) is swapped with the staged output in one `renameat2(EXCHANGE)`,
//! so even then the destination is always either the old output or the new one.
//!
//! While a run writes `DST` it holds an exclusive `flock` on `.NAME.reshard-lock` beside it
//! ([`Lock`]): a second run writing the same destination stops with a message naming the
//! first one's pid. The lock dies with its process; the file of a killed run is reused and
//! removed by the next run. That next run also removes the staging leftovers of killed runs
//! for the same destination (`.NAME.reshard-tmp-PID`, unless PID is a reshard process still
//! running) and says so, one line each on stderr, before removing each.

pub mod parts;

use crate::error::{Error, Hint, IoContext, Result};
use crate::sys::{exchange, try_lock};
use std::fs;
use std::io::{Read, Seek, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::sys::{dest_error, pid_alive, WriteContext, TMP_MARK};

/// The marker of a replaced destination moved aside (only where the filesystem cannot swap
/// two names atomically).
pub const OLD_MARK: &str = ".reshard-old-";

/// The suffix of the lock file beside a destination being written (`.NAME.reshard-lock`).
pub const LOCK_MARK: &str = ".reshard-lock";

/// A staged output that is removed on drop unless committed. It holds the destination's
/// [`Lock`] from creation until it is committed or dropped.
#[derive(Debug)]
pub struct Staging {
    dest: PathBuf,
    tmp: PathBuf,
    is_dir: bool,
    force: bool,
    committed: bool,
    // Dropped after `Drop::drop` has removed the staged files.
    _lock: Lock,
}

/// Refuse `dest` when the folder it is in does not exist (or is no folder), naming `dest`.
pub fn no_folder(dest: &Path) -> Result<()> {
    let parent = parent_of(dest);
    if parent.is_dir() {
        return Ok(());
    }
    Err(Error::usage(format!(
        "{}: cannot write: the folder {} {}",
        dest.display(),
        parent.display(),
        if parent.exists() {
            "is not a folder"
        } else {
            "does not exist"
        }
    )))
}

/// The folder `dest` is in (`.` for a bare name).
pub fn parent_of(dest: &Path) -> &Path {
    dest.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// The last component of `dest`, refused when it has none (`/`, `..`).
pub fn file_name(dest: &Path) -> Result<&std::ffi::OsStr> {
    dest.file_name()
        .ok_or_else(|| Error::usage(format!("{}: not a file or directory name", dest.display())))
}

fn sibling(dest: &Path, tag: &str) -> Result<PathBuf> {
    let name = file_name(dest)?;
    Ok(parent_of(dest).join(format!(
        ".{}{tag}{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// An exclusive lock on writing one destination: `flock(LOCK_EX | LOCK_NB)` on
/// `.NAME.reshard-lock` beside it, which holds the owner's pid. Released (and the file
/// removed) on drop; a killed owner's lock is released by the kernel, and its file is reused.
#[derive(Debug)]
pub struct Lock {
    path: PathBuf,
    // Held open for the lock's life: closing it releases the flock.
    _file: fs::File,
}

impl Lock {
    /// The lock file of `dest`.
    pub fn path_of(dest: &Path) -> Result<PathBuf> {
        let name = file_name(dest)?;
        Ok(parent_of(dest).join(format!(".{}{LOCK_MARK}", name.to_string_lossy())))
    }

    /// Take the lock of `dest`, or fail at once with a message naming the run holding it.
    pub fn acquire(dest: &Path) -> Result<Lock> {
        match Self::try_acquire(dest)? {
            Ok(lock) => Ok(lock),
            Err(text) => {
                let who = match text.trim().parse::<u32>() {
                    Ok(pid) => format!("another reshard run (pid {pid})"),
                    Err(_) => "another reshard run".to_string(),
                };
                Err(Error::usage(format!(
                    "{who} is writing {}; wait for it to finish or stop it (lock {})",
                    dest.display(),
                    Self::path_of(dest)?.display()
                )))
            }
        }
    }

    /// Take the lock of `dest` if no other process holds it; otherwise what its lock file
    /// says (the holder's pid). Other failures (no such directory, no permission, a read-only
    /// file system) are errors writing `dest` ([`dest_error`]): the lock file is reshard's
    /// business, the user named `dest`.
    pub fn try_acquire(dest: &Path) -> Result<std::result::Result<Lock, String>> {
        let path = Self::path_of(dest)?;
        let at_dest = |e| dest_error(dest, e);
        loop {
            let file = open_lock(&path).map_err(at_dest)?;
            let mut file = match lock_or_holder(file, &path)? {
                Ok(file) => file,
                Err(text) => return Ok(Err(text)),
            };
            // The previous owner may have removed the file between our open and our flock:
            // then we locked a file nobody else will see. Retry on the current one.
            let same = match (fs::symlink_metadata(&path), file.metadata()) {
                (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
                _ => false,
            };
            if !same {
                continue;
            }
            file.set_len(0).map_err(at_dest)?;
            file.rewind().map_err(at_dest)?;
            file.write_all(format!("{}\n", std::process::id()).as_bytes())
                .map_err(at_dest)?;
            return Ok(Ok(Lock { path, _file: file }));
        }
    }
}

/// Open (or create) `path` and take an exclusive `flock` on it without waiting: the open file
/// (the lock lives as long as it), or, when another process holds it, what the file says
/// (its holder writes who it is there).
pub fn hold(path: &Path) -> Result<std::result::Result<fs::File, String>> {
    lock_or_holder(open_lock(path).at_write(path)?, path)
}

/// Open (or create) the lock file `path`, for reading and writing.
fn open_lock(path: &Path) -> std::io::Result<fs::File> {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
}

/// Take an exclusive `flock` on `file` (the lock file `path`) without waiting: the file, or
/// what it says when another process holds it.
fn lock_or_holder(
    mut file: fs::File,
    path: &Path,
) -> Result<std::result::Result<fs::File, String>> {
    if try_lock(&file).at(path)? {
        return Ok(Ok(file));
    }
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    Ok(Err(text))
}

impl Drop for Lock {
    fn drop(&mut self) {
        // Removed while still locked; a run that opened it meanwhile sees the file is gone
        // once it gets the lock, and retries on a fresh one.
        let _ = fs::remove_file(&self.path);
    }
}

/// What [`clean_leftovers`] found beside a destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leftover {
    /// The staging file or directory (or replaced destination moved aside).
    pub path: PathBuf,
    /// The pid its name carries.
    pub pid: u32,
    /// True when it was removed; false when left in place because a reshard process with
    /// that pid is running.
    pub removed: bool,
}

/// True when `pid` is a running process called `reshard`. A leftover's pid may since have
/// been reused by another program (pids wrap quickly where `pid_max` is 32768); only a
/// reshard run could still be using it (one that predates the lock), so only then is it kept.
fn reshard_running(pid: u32) -> bool {
    if !pid_alive(pid) {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/comm")) {
        Ok(comm) => comm.trim_end() == "reshard",
        // No /proc: cannot tell, keep it while the pid lives.
        Err(_) => pid_alive(pid),
    }
}

/// Find the staging leftovers of earlier runs writing `dest` (`.NAME.reshard-tmp-PID` and
/// `.NAME.reshard-old-PID` beside it, other than this process's) and remove them, unless
/// their pid is a running reshard process. `report` is told of each one first (before it
/// is removed, so a kill during the removal cannot remove one unreported). Call it holding
/// `dest`'s [`Lock`]: then no other run is writing `dest`.
pub fn clean_leftovers(dest: &Path, mut report: impl FnMut(&Leftover)) -> Result<Vec<Leftover>> {
    let name = file_name(dest)?.as_bytes();
    let parent = parent_of(dest);
    let me = std::process::id();
    let mut out = vec![];
    let Ok(entries) = fs::read_dir(parent) else {
        return Ok(out);
    };
    for e in entries.flatten() {
        let file = e.file_name();
        let b = file.as_bytes();
        let Some(rest) = b.strip_prefix(b".").and_then(|r| r.strip_prefix(name)) else {
            continue;
        };
        let Some(pid) = [TMP_MARK, OLD_MARK].iter().find_map(|m| {
            let digits = rest.strip_prefix(m.as_bytes())?;
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            std::str::from_utf8(digits).ok()?.parse::<u32>().ok()
        }) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let l = Leftover {
            path: e.path(),
            pid,
            removed: !reshard_running(pid),
        };
        report(&l);
        if l.removed {
            let is_dir = fs::symlink_metadata(&l.path).is_ok_and(|m| m.is_dir());
            if is_dir {
                fs::remove_dir_all(&l.path).at(&l.path)?;
            } else {
                fs::remove_file(&l.path).at(&l.path)?;
            }
        }
        out.push(l);
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

impl Staging {
    /// Prepare to write `dest` (a file, or a directory when `is_dir`): take its [`Lock`]
    /// (failing if another run holds it), remove leftovers of killed runs (reported on
    /// stderr), and check it. Fails if `dest` exists and `force` is not set, or if its parent
    /// directory does not exist. Errors creating the files beside `dest` name `dest`
    /// ([`dest_error`]).
    pub fn new(dest: &Path, is_dir: bool, force: bool) -> Result<Self> {
        no_folder(dest)?;
        let lock = Lock::acquire(dest)?;
        clean_leftovers(dest, |l| {
            if l.removed {
                eprintln!(
                    "reshard: removing {}, left by an interrupted run (pid {})",
                    l.path.display(),
                    l.pid
                );
            } else {
                eprintln!(
                    "reshard: warning: leaving {} in place: reshard pid {} is still running",
                    l.path.display(),
                    l.pid
                );
            }
        })?;
        if fs::symlink_metadata(dest).is_ok() && !force {
            return Err(Error::refused(
                format!("{}: already exists", dest.display()),
                Hint::Force,
            ));
        }
        let tmp = sibling(dest, TMP_MARK)?;
        remove_any(&tmp);
        if is_dir {
            fs::create_dir(&tmp).map_err(|e| dest_error(dest, e))?;
        }
        Ok(Staging {
            dest: dest.to_path_buf(),
            tmp,
            is_dir,
            force,
            committed: false,
            _lock: lock,
        })
    }

    /// Where to write the output file `rel` (relative to a directory output; ignored for a
    /// single-file output). Creates the file, empty.
    pub fn create(&self, rel: &Path) -> Result<PathBuf> {
        let p = if self.is_dir {
            self.tmp.join(rel)
        } else {
            self.tmp.clone()
        };
        if let Some(dir) = p.parent() {
            fs::create_dir_all(dir).at_write(dir)?;
        }
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&p)
            .at_write(&p)?;
        Ok(p)
    }

    /// The final destination.
    #[cfg(any(test, feature = "internals"))]
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// The staged output (a file, or a directory for directory outputs).
    #[cfg(any(test, feature = "internals"))]
    pub fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Move the staged output into place. Files must already be fsynced.
    pub fn commit(mut self) -> Result<()> {
        publish(&self.tmp, &self.dest, self.is_dir, self.force)?;
        self.committed = true;
        Ok(())
    }
}

/// Move the staged output `tmp` (a file, or a directory when `is_dir`, its files fsynced) to
/// `dest` atomically: renamed into place, or, when `dest` exists and `force` allows replacing
/// it, swapped with it in one step where the file system can (the old output then removed).
/// If this fails before the rename, `tmp` is left for the caller to remove.
pub fn publish(tmp: &Path, dest: &Path, is_dir: bool, force: bool) -> Result<()> {
    let parent = parent_of(dest).to_path_buf();
    if is_dir {
        fsync_dir(tmp)?;
    }
    let exists = fs::symlink_metadata(dest).is_ok();
    if exists && !force {
        return Err(Error::refused(
            format!("{}: appeared while writing; not replaced", dest.display()),
            Hint::Force,
        ));
    }
    let replace_dir = exists && (is_dir || dest.is_dir());
    if replace_dir {
        // rename() cannot replace a directory: swap the two names atomically, then remove
        // the old output, now under the staging name (a kill before that leaves it as a
        // leftover the next run removes).
        if exchange(tmp, dest).at_write(dest)? {
            fsync_dir(&parent)?;
            remove_any(tmp);
            return Ok(());
        }
        // No atomic swap on this filesystem: move the old one aside first.
        let old = sibling(dest, OLD_MARK)?;
        fs::rename(dest, &old).at_write(dest)?;
        fs::rename(tmp, dest).at_write(dest)?;
        remove_any(&old);
    } else {
        fs::rename(tmp, dest).at_write(dest)?;
    }
    fsync_dir(&parent)
}

/// Remove a file or a directory tree, ignoring errors (best effort: what remains is a
/// recognisable leftover the next run removes).
pub fn remove_any(p: &Path) {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            let _ = fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = fs::remove_file(p);
        }
        Err(_) => {}
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            remove_any(&self.tmp);
        }
    }
}

/// Flush `dir`'s entries to disk, so that a rename in it survives a crash.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir).and_then(|f| f.sync_all()).at_write(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_file_appears_only_on_commit_and_never_replaces_without_force() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("out.safetensors");
        let s = Staging::new(&dest, false, false).unwrap();
        let p = s.create(Path::new("x")).unwrap();
        fs::write(&p, b"abc").unwrap();
        assert!(!dest.exists());
        s.commit().unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"abc");
        assert!(Staging::new(&dest, false, false)
            .unwrap_err()
            .to_string()
            .contains("already exists"));
        // dropped without commit: nothing left behind (no staging, no lock file)
        let s = Staging::new(&dest, false, true).unwrap();
        fs::write(s.create(Path::new("x")).unwrap(), b"new").unwrap();
        drop(s);
        assert_eq!(fs::read(&dest).unwrap(), b"abc");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn directory_outputs_replace_atomically_with_force() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("out");
        fs::create_dir(&dest).unwrap();
        fs::write(dest.join("old"), b"1").unwrap();
        let s = Staging::new(&dest, true, true).unwrap();
        fs::write(s.create(Path::new("a/new")).unwrap(), b"2").unwrap();
        s.commit().unwrap();
        assert!(!dest.join("old").exists());
        assert_eq!(fs::read(dest.join("a/new")).unwrap(), b"2");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
        // a directory output replacing a file
        let dest = d.path().join("f");
        fs::write(&dest, b"file").unwrap();
        let s = Staging::new(&dest, true, true).unwrap();
        fs::write(s.create(Path::new("x")).unwrap(), b"3").unwrap();
        s.commit().unwrap();
        assert_eq!(fs::read(dest.join("x")).unwrap(), b"3");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 2);
    }

    #[test]
    fn a_second_writer_of_the_same_destination_is_refused_naming_the_first() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("out");
        let s = Staging::new(&dest, true, false).unwrap();
        let lock = Lock::path_of(&dest).unwrap();
        assert_eq!(lock, d.path().join(".out.reshard-lock"));
        assert_eq!(
            fs::read_to_string(&lock).unwrap().trim(),
            std::process::id().to_string()
        );
        let e = Staging::new(&dest, true, true).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "another reshard run (pid {}) is writing {}; wait for it to finish or stop it (lock {})",
                std::process::id(),
                dest.display(),
                lock.display()
            )
        );
        // another destination in the same directory is not affected
        drop(Staging::new(&d.path().join("out2"), true, false).unwrap());
        drop(s);
        assert!(!lock.exists());
        // a stale lock file (its run was killed: nobody holds the flock) does not block
        fs::write(&lock, b"999999999\n").unwrap();
        let s = Staging::new(&dest, true, false).unwrap();
        fs::write(s.create(Path::new("x")).unwrap(), b"1").unwrap();
        s.commit().unwrap();
        assert!(!lock.exists());
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn leftovers_are_removed_unless_a_reshard_run_with_their_pid_is_alive() {
        let d = tempfile::tempdir().unwrap();
        let dest = d.path().join("m.safetensors");
        // A pid above any pid_max (2^22): never a process.
        let dead = (1u32 << 22) + 1;
        // A live process that is not reshard (its pid was reused), and one called reshard.
        let mut other_prog = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let bin = d.path().join("bin");
        fs::create_dir(&bin).unwrap();
        std::os::unix::fs::symlink(
            std::process::Command::new("sh")
                .args(["-c", "command -v sleep"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap(),
            bin.join("reshard"),
        )
        .unwrap();
        let mut run = std::process::Command::new(bin.join("reshard"))
            .arg("30")
            .spawn()
            .unwrap();
        let (reused, live) = (other_prog.id(), run.id());
        // Until the child has exec'd, its comm is still the test's: wait for the exec (a
        // race seen on a loaded machine), at most 10 s.
        let t0 = std::time::Instant::now();
        let execd = || {
            fs::read_to_string(format!("/proc/{live}/comm"))
                .is_ok_and(|c| c.trim_end() == "reshard")
        };
        while !execd() && t0.elapsed() < std::time::Duration::from_secs(10) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let me = std::process::id(); // this process: never a leftover of itself
        let tmp_dead = d.path().join(format!(".m.safetensors.reshard-tmp-{dead}"));
        let dir_dead = d.path().join(format!(".m.safetensors.reshard-old-{dead}"));
        let tmp_reused = d
            .path()
            .join(format!(".m.safetensors.reshard-tmp-{reused}"));
        let tmp_live = d.path().join(format!(".m.safetensors.reshard-tmp-{live}"));
        let other = d.path().join(format!(".n.safetensors.reshard-tmp-{dead}"));
        let mine = d.path().join(format!(".m.safetensors.reshard-tmp-{me}"));
        let odd = d.path().join(".m.safetensors.reshard-tmp-12x");
        for f in [&tmp_dead, &tmp_reused, &tmp_live, &other, &mine, &odd] {
            fs::write(f, b"x").unwrap();
        }
        fs::create_dir(&dir_dead).unwrap();
        fs::write(dir_dead.join("f"), b"x").unwrap();
        let mut told = vec![];
        let got = clean_leftovers(&dest, |l| {
            assert!(l.path.exists(), "told before removal");
            told.push(l.clone());
        })
        .unwrap();
        let _ = (other_prog.kill(), run.kill());
        let _ = (other_prog.wait(), run.wait());
        told.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(told, got);
        let mut want = vec![
            Leftover {
                path: dir_dead.clone(),
                pid: dead,
                removed: true,
            },
            Leftover {
                path: tmp_reused.clone(),
                pid: reused,
                removed: true,
            },
            Leftover {
                path: tmp_live.clone(),
                pid: live,
                removed: false,
            },
            Leftover {
                path: tmp_dead.clone(),
                pid: dead,
                removed: true,
            },
        ];
        want.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(got, want);
        assert!(!tmp_dead.exists() && !dir_dead.exists() && !tmp_reused.exists());
        assert!(tmp_live.exists() && other.exists() && mine.exists() && odd.exists());
    }
}
