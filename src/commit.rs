//! Atomic commit of outputs: everything is written under a temporary name beside the
//! destination, fsynced, then renamed into place in one step.
//!
//! A single-file output is staged as `.NAME.reshard-tmp-PID`; a directory output is staged as
//! a whole directory `.NAME.reshard-tmp-PID/` and renamed at once, so an error or a kill never
//! leaves a partial output under the final name. An existing destination is replaced only
//! when asked (`force`), and only after the new output is complete.

use crate::error::{Error, IoContext, Result};
use std::fs;
use std::path::{Path, PathBuf};

/// The marker every temporary name carries, so leftovers of a killed run are recognisable.
pub const TMP_MARK: &str = ".reshard-tmp-";

/// A staged output that is removed on drop unless committed.
#[derive(Debug)]
pub struct Staging {
    dest: PathBuf,
    tmp: PathBuf,
    is_dir: bool,
    force: bool,
    committed: bool,
}

fn sibling(dest: &Path, tag: &str) -> Result<PathBuf> {
    let name = dest
        .file_name()
        .ok_or_else(|| Error::usage(format!("{}: not a file or directory name", dest.display())))?;
    let parent = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    Ok(parent.join(format!(
        ".{}{tag}{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

impl Staging {
    /// Prepare to write `dest` (a file, or a directory when `is_dir`). Fails if `dest` exists
    /// and `force` is not set, or if its parent directory does not exist.
    pub fn new(dest: &Path, is_dir: bool, force: bool) -> Result<Self> {
        if fs::symlink_metadata(dest).is_ok() && !force {
            return Err(Error::usage(format!(
                "{}: already exists (use --force to replace it)",
                dest.display()
            )));
        }
        let parent = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !parent.is_dir() {
            return Err(Error::usage(format!(
                "{}: directory does not exist",
                parent.display()
            )));
        }
        let tmp = sibling(dest, TMP_MARK)?;
        if is_dir {
            let _ = fs::remove_dir_all(&tmp);
            fs::create_dir(&tmp).at(&tmp)?;
        } else {
            let _ = fs::remove_file(&tmp);
        }
        Ok(Staging {
            dest: dest.to_path_buf(),
            tmp,
            is_dir,
            force,
            committed: false,
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
            fs::create_dir_all(dir).at(dir)?;
        }
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&p)
            .at(&p)?;
        Ok(p)
    }

    /// The final destination.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Move the staged output into place. Files must already be fsynced.
    pub fn commit(mut self) -> Result<()> {
        let parent = self
            .dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        if self.is_dir {
            fsync_dir(&self.tmp)?;
        }
        let exists = fs::symlink_metadata(&self.dest).is_ok();
        if exists && !self.force {
            return Err(Error::usage(format!(
                "{}: appeared while writing; not replaced (use --force)",
                self.dest.display()
            )));
        }
        let replace_dir = exists && (self.is_dir || self.dest.is_dir());
        if replace_dir {
            // rename() cannot replace a directory: move the old one aside first.
            let old = sibling(&self.dest, ".reshard-old-")?;
            fs::rename(&self.dest, &old).at(&self.dest)?;
            fs::rename(&self.tmp, &self.dest).at(&self.dest)?;
            if old.is_dir() {
                fs::remove_dir_all(&old).at(&old)?;
            } else {
                fs::remove_file(&old).at(&old)?;
            }
        } else {
            fs::rename(&self.tmp, &self.dest).at(&self.dest)?;
        }
        self.committed = true;
        fsync_dir(&parent)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            if self.is_dir {
                let _ = fs::remove_dir_all(&self.tmp);
            } else {
                let _ = fs::remove_file(&self.tmp);
            }
        }
    }
}

fn fsync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir).and_then(|f| f.sync_all()).at(dir)
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
        // dropped without commit: nothing left behind
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
    }
}
