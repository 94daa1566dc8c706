//! Platform I/O: the Linux system calls reshard makes beyond `std` (kernel copies, block
//! preallocation, page release, process checks, locks, atomic name swaps, read-only
//! mappings) and how an I/O error on an output file is said.
//!
//! Calls go through `rustix` where it has them, so the only `unsafe` left here is what no
//! safe wrapper can promise: mapping a file and dropping a mapping's pages. The executor
//! (`reshard-exec`) and the commit both build on this module; it
//! depends on neither.

use crate::error::{Error, IoContext, Result};
use memmap2::Mmap;
use rustix::io::Errno;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// The marker every temporary name carries (`.NAME.reshard-tmp-PID`), so leftovers of a
/// killed run are recognisable and write errors can name a staged file by its final name.
pub const TMP_MARK: &str = ".reshard-tmp-";

/// The final name of `path` when it lies in a staged output: `DIR/.NAME.reshard-tmp-PID/x`
/// is shown as `DIR/NAME/x`. Other paths are returned unchanged.
pub fn final_path(path: &Path) -> PathBuf {
    path.components()
        .map(|c| match c {
            Component::Normal(n) => {
                let b = n.as_bytes();
                let name = b.strip_prefix(b".").and_then(|rest| {
                    let mark = TMP_MARK.as_bytes();
                    let at = rest.windows(mark.len()).rposition(|w| w == mark)?;
                    let pid = &rest[at + mark.len()..];
                    (at > 0 && !pid.is_empty() && pid.iter().all(u8::is_ascii_digit))
                        .then(|| &rest[..at])
                });
                match name {
                    Some(n) => PathBuf::from(std::ffi::OsStr::from_bytes(n)),
                    None => PathBuf::from(n),
                }
            }
            c => PathBuf::from(c.as_os_str()),
        })
        .collect()
}

/// An I/O error met while writing output file `path` (staged or final). A full disk
/// (`ENOSPC`, `EDQUOT`) or a file over the size limit (`EFBIG`, e.g. `ulimit -f`) is said in
/// those words, naming the file by its final name.
pub fn write_error(path: &Path, e: std::io::Error) -> Error {
    let what = match Errno::from_io_error(&e) {
        Some(Errno::NOSPC) => Some("cannot write: the disk is full"),
        Some(Errno::DQUOT) => Some("cannot write: the disk quota is exhausted"),
        Some(Errno::FBIG) => Some(
            "cannot write: the file is larger than the filesystem or the file size limit \
             (`ulimit -f`) allows",
        ),
        _ => None,
    };
    match (what, e.raw_os_error()) {
        (Some(what), Some(code)) => Error::Io {
            path: final_path(path),
            source: std::io::Error::new(e.kind(), format!("{what} (os error {code})")),
        },
        _ => Error::Io {
            path: path.to_path_buf(),
            source: e,
        },
    }
}

/// An I/O error met creating what reshard keeps beside the destination `dest` while writing
/// it (its lock file `.NAME.reshard-lock`, its staged output, the staging area of a run in
/// parts), said as an error writing `dest`: those hidden names are reshard's own, the user
/// named `dest`. A read-only file system, a folder the process may not create files in, and a
/// folder that does not exist or takes no new files (`/proc`) are said in those words, naming
/// the folder; a full disk as [`write_error`] says it. Other errors keep their system message.
pub fn dest_error(dest: &Path, e: std::io::Error) -> Error {
    let folder = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let shown = folder.display();
    let why = match Errno::from_io_error(&e) {
        Some(Errno::ROFS) => format!("the folder {shown} is on a read-only file system"),
        Some(Errno::ACCESS | Errno::PERM) => {
            format!("permission denied: no new files may be created in the folder {shown}")
        }
        Some(Errno::NOENT) if folder.is_dir() => {
            format!("the folder {shown} takes no new files")
        }
        Some(Errno::NOENT) => format!("the folder {shown} does not exist"),
        Some(Errno::NOTDIR) => format!("{shown} is not a folder"),
        Some(Errno::NOSPC) => "the disk is full".into(),
        Some(Errno::DQUOT) => "the disk quota is exhausted".into(),
        _ => e.to_string(),
    };
    let why = match e.raw_os_error() {
        Some(code) if !why.contains("(os error") => {
            format!("cannot write: {why} (os error {code})")
        }
        _ => format!("cannot write: {why}"),
    };
    Error::Io {
        path: dest.to_path_buf(),
        source: std::io::Error::new(e.kind(), why),
    }
}

/// [`write_error`] for `std::io::Result`s.
pub trait WriteContext<T> {
    /// Turn an I/O error on output file `path` into an [`Error::Io`] ([`write_error`]).
    fn at_write(self, path: impl AsRef<Path>) -> Result<T>;
}

impl<T> WriteContext<T> for std::io::Result<T> {
    fn at_write(self, path: impl AsRef<Path>) -> Result<T> {
        self.map_err(|e| write_error(path.as_ref(), e))
    }
}

/// True when a process with this pid exists (it may not be reshard: pids are reused).
pub fn pid_alive(pid: u32) -> bool {
    let Some(p) = i32::try_from(pid)
        .ok()
        .filter(|&p| p > 0)
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    // kill(pid, 0): fails with ESRCH only when no such process exists (EPERM means it does).
    rustix::process::test_kill_process(p).map_or_else(|e| e != Errno::SRCH, |()| true)
}

/// Take an exclusive `flock` on `file` without waiting: `Ok(false)` when another open file
/// holds it. Interrupted calls are retried.
pub fn try_lock(file: &File) -> std::io::Result<bool> {
    loop {
        match rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(true),
            Err(Errno::INTR) => continue,
            Err(Errno::WOULDBLOCK) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Swap the names `a` and `b` in one step (`renameat2(RENAME_EXCHANGE)`). `Ok(false)` when
/// the kernel or filesystem cannot, having changed nothing.
pub fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    match renameat_with(CWD, a, CWD, b, RenameFlags::EXCHANGE) {
        Ok(()) => Ok(true),
        Err(Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether `copy_file_range` is worth trying (cleared the first time the kernel refuses it).
static COPY_FILE_RANGE: AtomicBool = AtomicBool::new(true);

/// False once the kernel or filesystem has refused `copy_file_range` in this process: callers
/// then write from user space without trying it again.
pub fn kernel_copy_available() -> bool {
    COPY_FILE_RANGE.load(Ordering::Relaxed)
}

/// Copy `len` bytes between files in the kernel (`copy_file_range`), without mapping or
/// buffering them in user space. Returns `Ok(false)`, having copied nothing, when the kernel
/// or filesystem does not support it (and clears [`kernel_copy_available`]), so the caller
/// falls back to `pwrite`.
pub fn copy_range(
    src: &File,
    src_off: u64,
    dst: &File,
    dst_off: u64,
    len: u64,
) -> std::io::Result<bool> {
    let (mut off_in, mut off_out) = (src_off, dst_off);
    let mut left = len;
    while left > 0 {
        let chunk = usize::try_from(left).unwrap_or(usize::MAX);
        match rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), chunk) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "source ended early",
                ))
            }
            Ok(n) => left -= n as u64,
            Err(Errno::XDEV | Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) if left == len => {
                COPY_FILE_RANGE.store(false, Ordering::Relaxed);
                return Ok(false);
            }
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Allocate `size` bytes of blocks for a fresh destination (`fallocate`) before any data is
/// written: large files are laid out in fewer extents than delayed allocation gives them,
/// and a full disk is found before any copying. On tmpfs, where `fallocate` allocates every
/// page up front (the copy then looks each up again, costing more than allocating it as it
/// writes), the free space is checked instead, for `size` plus `pending` bytes (what other
/// destinations checked this way still need). Returns whether blocks were allocated (false
/// for a tmpfs check). Filesystems without `fallocate` are left to allocate as they write.
pub fn preallocate(f: &File, size: u64, pending: u64) -> std::io::Result<bool> {
    preallocate_range(f, 0, size, pending)
}

/// [`preallocate`] for bytes `offset..offset + len` of a destination (one part's share of a
/// file other processes write too).
pub fn preallocate_range(f: &File, offset: u64, len: u64, pending: u64) -> std::io::Result<bool> {
    if len == 0 || i64::try_from(offset.saturating_add(len)).is_err() {
        return Ok(false);
    }
    if let Some(free) = tmpfs_free(f) {
        return if free < len.saturating_add(pending) {
            Err(Errno::NOSPC.into())
        } else {
            Ok(false)
        };
    }
    loop {
        // Mode 0 allocates and extends.
        match rustix::fs::fallocate(f, rustix::fs::FallocateFlags::empty(), offset, len) {
            Ok(()) => return Ok(true),
            Err(Errno::INTR) => continue,
            Err(Errno::OPNOTSUPP | Errno::NOSYS | Errno::INVAL) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Free the disk blocks of bytes `offset..offset + len` of `f` (they read as zeros after;
/// the size stays): a scratch file whose bytes were sent elsewhere. Returns whether the
/// file system did it.
pub fn punch_hole(f: &File, offset: u64, len: u64) -> std::io::Result<bool> {
    use rustix::fs::FallocateFlags;
    if len == 0 || i64::try_from(offset.saturating_add(len)).is_err() {
        return Ok(false);
    }
    loop {
        match rustix::fs::fallocate(
            f,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        ) {
            Ok(()) => return Ok(true),
            Err(Errno::INTR) => continue,
            Err(Errno::OPNOTSUPP | Errno::NOSYS | Errno::INVAL) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
    }
}

/// The bytes free for unprivileged use on the file system of `f` when it is a tmpfs (as
/// `/dev/shm` is); `None` on any other file system.
fn tmpfs_free(f: &File) -> Option<u64> {
    /// `statfs`'s file-system type of tmpfs.
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    let st = rustix::fs::fstatfs(f).ok()?;
    // (the casts: statfs field types differ between targets)
    #[allow(clippy::unnecessary_cast)]
    let (kind, free) = (
        st.f_type as i64,
        (st.f_bavail as u64).saturating_mul(st.f_bsize as u64),
    );
    (kind == TMPFS_MAGIC).then_some(free)
}

/// Map file `path` read-only, with an access-pattern hint.
pub fn map_readonly(path: &Path, advice: memmap2::Advice) -> Result<Mmap> {
    let f = File::open(path).at(path)?;
    let m = map_file(&f, path)?;
    let _ = m.advise(advice);
    Ok(m)
}

/// Map `file` (opened read-only from `path`, named in errors) read-only: the one place
/// reshard maps a source. Callers bound every access by the length they checked.
pub fn map_file(file: &File, path: &Path) -> Result<Mmap> {
    // SAFETY: the file is opened read-only; reshard never writes to sources. Another
    // process truncating the file while it is mapped would be undefined behaviour in
    // any mmap-based reader; sizes are checked against the metadata before copying, and
    // every access is bounds-checked against the mapped length.
    unsafe { Mmap::map(file) }.at(path)
}

/// Drop the pages of bytes `a..b` of a source mapping (rounded out to whole pages), so
/// resident memory stays bounded; later reads fault them in again from the page cache.
pub fn release(map: &Mmap, a: u64, b: u64) {
    const PAGE: u64 = 4096;
    let a = a / PAGE * PAGE;
    let b = b.div_ceil(PAGE) * PAGE;
    let b = b.min(map.len() as u64);
    if b > a {
        // SAFETY: the mapping is a read-only shared file mapping; dropping its pages only makes
        // later reads fault them in again from the page cache. No reference into it is held
        // across this call by this thread, and other threads' reads refault transparently.
        unsafe {
            let _ = map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                a as usize,
                (b - a) as usize,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn preallocation_on_tmpfs_checks_the_free_space_instead() {
        let Ok(d) = tempfile::tempdir_in("/dev/shm") else {
            return; // no /dev/shm here
        };
        let f = File::create(d.path().join("x")).unwrap();
        let Some(free) = super::tmpfs_free(&f) else {
            return; // /dev/shm is not a tmpfs here
        };
        assert!(!super::preallocate(&f, 1 << 20, 0).unwrap());
        assert_eq!(f.metadata().unwrap().len(), 0, "a check allocates nothing");
        let e = super::preallocate(&f, free / 2 + 1, free / 2 + 1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(Errno::NOSPC.raw_os_error()));
    }

    use super::*;

    #[test]
    fn staged_paths_are_named_by_their_final_names_in_write_errors() {
        let pid = std::process::id();
        assert_eq!(
            final_path(Path::new(&format!(
                "/a/.out.reshard-tmp-{pid}/model-1.safetensors"
            ))),
            Path::new("/a/out/model-1.safetensors")
        );
        assert_eq!(
            final_path(Path::new("d/.m.safetensors.reshard-tmp-12")),
            Path::new("d/m.safetensors")
        );
        for p in [
            ".reshard-tmp-12",
            "d/.x.reshard-tmp-",
            "d/.x.reshard-tmp-1a",
            "d/x",
        ] {
            assert_eq!(final_path(Path::new(p)), Path::new(p));
        }
        let os = |e: Errno| std::io::Error::from_raw_os_error(e.raw_os_error());
        let e = write_error(Path::new("d/.m.pt.reshard-tmp-7"), os(Errno::NOSPC)).to_string();
        assert!(
            e == "d/m.pt: cannot write: the disk is full (os error 28)",
            "{e}"
        );
        let e = write_error(
            Path::new("d/.o.reshard-tmp-7/__0_0.distcp"),
            os(Errno::FBIG),
        )
        .to_string();
        assert!(
            e.starts_with("d/o/__0_0.distcp: cannot write: the file is larger than"),
            "{e}"
        );
        // other errors keep the path as it is
        let e = write_error(Path::new("d/.o.reshard-tmp-7/x"), os(Errno::IO)).to_string();
        assert!(e.starts_with("d/.o.reshard-tmp-7/x: "), "{e}");
    }

    #[test]
    fn errors_beside_a_destination_name_the_destination_and_its_folder() {
        let os = |e: Errno| std::io::Error::from_raw_os_error(e.raw_os_error());
        let said = |dest: &str, e: Errno| dest_error(Path::new(dest), os(e)).to_string();
        assert_eq!(
            said("ro/m.safetensors", Errno::ROFS),
            "ro/m.safetensors: cannot write: the folder ro is on a read-only file system \
             (os error 30)"
        );
        assert_eq!(
            said("ro/m.pt", Errno::ACCESS),
            "ro/m.pt: cannot write: permission denied: no new files may be created in the \
             folder ro (os error 13)"
        );
        assert_eq!(
            said("m.pt", Errno::PERM),
            "m.pt: cannot write: permission denied: no new files may be created in the \
             folder . (os error 1)"
        );
        assert_eq!(
            said("/no/such/folder/m.pt", Errno::NOENT),
            "/no/such/folder/m.pt: cannot write: the folder /no/such/folder does not exist \
             (os error 2)"
        );
        assert_eq!(
            said("/proc/m.pt", Errno::NOENT),
            "/proc/m.pt: cannot write: the folder /proc takes no new files (os error 2)"
        );
        assert_eq!(
            said("d/m.pt", Errno::NOSPC),
            "d/m.pt: cannot write: the disk is full (os error 28)"
        );
        let e = said("d/m.pt", Errno::IO);
        assert!(
            e.starts_with("d/m.pt: cannot write: ") && e.ends_with("(os error 5)"),
            "{e}"
        );
    }

    #[test]
    fn pids_of_no_process_are_not_alive() {
        assert!(pid_alive(std::process::id()));
        // Above any pid_max (2^22), zero, and past i32: never a process.
        for pid in [(1u32 << 22) + 1, 0, u32::MAX] {
            assert!(!pid_alive(pid), "{pid}");
        }
    }
}
