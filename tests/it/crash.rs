//! Crash and fault safety of `reshard convert` (issue 6):
//!
//! - kill test: a conversion of a few hundred MB is SIGKILLed at 20 random moments (seeded;
//!   `RESHARD_CRASH_SEED` overrides the seed, `RESHARD_CRASH_MB` the size); after each the
//!   destination is absent or complete and correct, leftovers carry recognisable names and
//!   the next run removes them saying so, and the source stays byte-identical;
//! - two runs writing one destination: the second stops with a message naming the first;
//! - disk full (a small tmpfs, when mounting is permitted) and file too large (`ulimit -f`):
//!   one line naming the output file, exit 2, nothing partial left.

use crate::common;
use crate::common::{convert, fsdp_shards, s, write_hf_storage, write_safetensors, Full};
use reshard::formats::Checkpoint;
use reshard::layout::Region;
use safetensors::tensor::Dtype;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_reshard");

/// splitmix64: a small seeded generator, so a failing run can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// `n` pseudo-random bytes (8 at a time: fast enough for hundreds of MB).
fn fill(n: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed);
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        v.extend_from_slice(&r.next().to_le_bytes());
    }
    v.truncate(n);
    v
}

/// A model of about `bytes` bytes: big f32 matrices with uneven row counts (so two source
/// ranks and three target ranks cut them differently), a bf16 and an i64 tensor, a scalar.
fn big_model(bytes: usize) -> BTreeMap<String, Full> {
    let cols = 1024usize;
    let layers = 8usize;
    let rows = (bytes / layers / (cols * 4)).max(8) | 1; // odd: uneven chunks
    let mut m = BTreeMap::new();
    let mut add = |name: String, dtype: Dtype, shape: Vec<usize>, seed: u64| {
        let n = shape.iter().product::<usize>() * common::elem(dtype);
        let mut data = fill(n, seed);
        if dtype == Dtype::BF16 {
            for i in (1..n).step_by(2) {
                data[i] &= 0x3f; // finite
            }
        }
        m.insert(name, Full { dtype, shape, data });
    };
    for l in 0..layers {
        add(
            format!("model.layers.{l}.weight"),
            Dtype::F32,
            vec![rows, cols],
            l as u64 + 1,
        );
    }
    add("model.norm.weight".into(), Dtype::BF16, vec![4099], 100);
    add("model.ids".into(), Dtype::I64, vec![1001, 3], 101);
    add("opt.step".into(), Dtype::F32, vec![], 102);
    m
}

fn model_bytes(m: &BTreeMap<String, Full>) -> usize {
    m.values().map(|t| t.data.len()).sum()
}

/// Size and CRC-32 of every file under `dir`.
fn hashes(dir: &Path) -> BTreeMap<PathBuf, (u64, u32)> {
    common::snapshot(dir)
        .into_iter()
        .map(|(p, b)| (p, (b.len() as u64, crc32fast::hash(&b))))
        .collect()
}

/// Open `dst` with reshard's reader and compare every tensor's bytes with `model`; then run
/// `reshard verify` on it (structure and checksums).
fn check_complete(dst: &Path, model: &BTreeMap<String, Full>) -> Result<(), String> {
    let ck = Checkpoint::open(dst).map_err(|e| format!("does not open: {e}"))?;
    let names: BTreeSet<&str> = ck.tensors.iter().map(|t| t.name.as_str()).collect();
    let want: BTreeSet<&str> = model.keys().map(String::as_str).collect();
    if names != want {
        return Err(format!("tensor names differ: {names:?}"));
    }
    for t in &ck.tensors {
        let full = &model[&t.name];
        let shape: Vec<u64> = full.shape.iter().map(|&x| x as u64).collect();
        if t.shape != shape {
            return Err(format!("`{}` has shape {:?}", t.name, t.shape));
        }
        let got = ck
            .read_region(&t.name, &Region::full(&t.shape), None)
            .map_err(|e| format!("`{}` does not read: {e}", t.name))?;
        if got != full.data {
            return Err(format!("bytes of `{}` differ", t.name));
        }
    }
    verify_cli(dst)
}

/// `reshard verify DST` (structure and checksums). Skipped (Ok, said once) by a binary that
/// has no `verify` subcommand.
fn verify_cli(dst: &Path) -> Result<(), String> {
    static SAID: std::sync::Once = std::sync::Once::new();
    let o = Command::new(BIN).arg("verify").arg(dst).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.code() == Some(2) && err.contains("unrecognized subcommand") {
        SAID.call_once(|| eprintln!("`reshard verify` does not exist: checked by reading only"));
        return Ok(());
    }
    SAID.call_once(|| eprintln!("outputs checked by reading every tensor and `reshard verify`"));
    if !o.status.success() {
        return Err(format!("reshard verify fails: {}", err.trim()));
    }
    Ok(())
}

/// Entries of `dir` that are reshard's temporary names (staging, moved-aside outputs, locks).
fn temporaries(dir: &Path) -> Vec<String> {
    common::names(dir)
        .into_iter()
        .filter(|n| {
            n.contains(".reshard-tmp-")
                || n.contains(".reshard-old-")
                || n.contains(".reshard-lock")
        })
        .collect()
}

/// What identifies an output's state: (relative path, inode, mtime s and ns, size) of every
/// file.
type Identity = Vec<(PathBuf, u64, i64, i64, u64)>;

fn identity(p: &Path) -> Option<Identity> {
    let m = std::fs::symlink_metadata(p).ok()?;
    if !m.is_dir() {
        return Some(vec![(
            PathBuf::new(),
            m.ino(),
            m.mtime(),
            m.mtime_nsec(),
            m.len(),
        )]);
    }
    let mut v: Vec<_> = common::snapshot(p)
        .keys()
        .map(|f| {
            let m = std::fs::metadata(f).unwrap();
            (
                f.strip_prefix(p).unwrap().to_path_buf(),
                m.ino(),
                m.mtime(),
                m.mtime_nsec(),
                m.len(),
            )
        })
        .collect();
    v.push((PathBuf::from("."), m.ino(), 0, 0, 0));
    v.sort();
    Some(v)
}

/// One kind of conversion the kill test runs.
struct Target {
    dst: &'static str,
    args: &'static [&'static str],
}

const TARGETS: &[Target] = &[
    Target {
        dst: "model.safetensors",
        args: &["--to", "1"],
    },
    Target {
        dst: "model.pt",
        args: &["--to", "1"],
    },
    Target {
        dst: "dcp3",
        args: &["--to", "3", "--format", "dcp"],
    },
    Target {
        dst: "hf",
        args: &["--to", "1", "--format", "hf", "--max-shard-size", "60MB"],
    },
];

fn convert_cmd(src: &Path, dst: &Path, t: &Target) -> Command {
    let mut c = Command::new(BIN);
    c.arg("convert")
        .arg(src)
        .arg(dst)
        .args(t.args)
        .args(["--force", "-q"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

/// `reshard: removing PATH, left by an interrupted run (pid N)` lines: the names removed.
fn removed_names(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix("reshard: removing "))
        .filter_map(|l| l.split(", left by an interrupted run").next())
        .map(|p| {
            Path::new(p)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// Seconds a conversion of `bytes` takes here, from a small probe conversion.
fn probe_speed(dir: &Path) -> f64 {
    let mut m = BTreeMap::new();
    m.insert(
        "w".to_string(),
        Full {
            dtype: Dtype::F32,
            shape: vec![8 << 10, 1024],
            data: fill(32 << 20, 7),
        },
    );
    let src = dir.join("probe.safetensors");
    write_safetensors(&src, &m);
    let dst = dir.join("probe-out.safetensors");
    let t0 = Instant::now();
    convert(&src, &dst, &["--to", "1", "-q"]);
    let secs = t0.elapsed().as_secs_f64();
    std::fs::remove_file(&src).unwrap();
    std::fs::remove_file(&dst).unwrap();
    (32 << 20) as f64 / secs.max(1e-3)
}

#[test]
fn sigkill_at_random_moments_leaves_the_destination_absent_or_complete() {
    let t_start = Instant::now();
    let tmp = tempfile::tempdir().unwrap(); // on disk (the system temp dir), not /dev/shm
    let src = tmp.path().join("src");
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();

    // Size: a few hundred MB (192 to 320 MiB: what this machine converts in about 2.5 s),
    // so the test stays under a minute.
    let bytes = match std::env::var("RESHARD_CRASH_MB") {
        Ok(mb) => mb.parse::<usize>().unwrap() << 20,
        Err(_) => {
            let speed = probe_speed(tmp.path());
            ((speed * 2.5) as usize).clamp(192 << 20, 320 << 20)
        }
    };
    let seed: u64 = std::env::var("RESHARD_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_251_202);
    let model = big_model(bytes);
    write_hf_storage(&src, &fsdp_shards(&model, 2));
    let before = hashes(&src);
    let total = model_bytes(&model);
    eprintln!(
        "kill test: source {} MiB in {} files (HF storage, 2 ranks), seed {seed}, set up in {:.1} s",
        total >> 20,
        before.len(),
        t_start.elapsed().as_secs_f64()
    );

    // Measure each conversion once (its output is then the "old" output a --force run may
    // replace when killed).
    let mut dur = vec![];
    for t in TARGETS {
        let dst = out.join(t.dst);
        let t0 = Instant::now();
        let o = convert_cmd(&src, &dst, t).output().unwrap();
        assert!(
            o.status.success(),
            "{}: {}",
            t.dst,
            String::from_utf8_lossy(&o.stderr)
        );
        dur.push(t0.elapsed());
        check_complete(&dst, &model).unwrap_or_else(|e| panic!("{}: {e}", t.dst));
    }
    eprintln!(
        "full runs: {}",
        TARGETS
            .iter()
            .zip(&dur)
            .map(|(t, d)| format!("{} {:.2} s", t.dst, d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let mut rng = Rng(seed);
    let mut verified: BTreeMap<&str, Identity> = BTreeMap::new();
    let mut leftovers_seen: BTreeSet<String> = BTreeSet::new();
    let mut reported: BTreeSet<String> = BTreeSet::new();
    let (mut absent, mut old, mut new, mut finished) = (0, 0, 0, 0);
    for i in 0..20 {
        let t = &TARGETS[i % TARGETS.len()];
        let dst = out.join(t.dst);
        // Half the runs write a fresh destination, half replace a complete one (--force).
        if rng.below(2) == 0 {
            if dst.is_dir() {
                std::fs::remove_dir_all(&dst).unwrap();
            } else if dst.exists() {
                std::fs::remove_file(&dst).unwrap();
            }
        }
        let had = identity(&dst);
        let d = dur[i % TARGETS.len()];
        let delay = Duration::from_micros(rng.below(d.as_micros() as u64 * 21 / 20));
        let mut child = convert_cmd(&src, &dst, t).spawn().unwrap();
        let pid = child.id();
        std::thread::sleep(delay);
        let done_before = child.try_wait().unwrap().is_some();
        let _ = child.kill(); // SIGKILL
        let status = child.wait().unwrap();
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        reported.extend(removed_names(&stderr));

        let now = identity(&dst);
        let outcome = match (&now, done_before) {
            (None, _) => {
                absent += 1;
                "absent"
            }
            (Some(_), true) => {
                assert!(status.success(), "run {i} failed: {stderr}");
                finished += 1;
                "finished before the kill"
            }
            (Some(id), false) if Some(id) == had.as_ref() => {
                old += 1;
                "complete (the old output, untouched)"
            }
            (Some(_), false) => {
                new += 1;
                "complete (the new output)"
            }
        };
        if let Some(id) = &now {
            if verified.get(t.dst) != Some(id) {
                check_complete(&dst, &model)
                    .unwrap_or_else(|e| panic!("kill {i} ({}): {} {e}", t.dst, outcome));
                verified.insert(t.dst, id.clone());
            }
        }
        // Leftovers carry the destination's name and the killed run's pid.
        let left = temporaries(&out);
        for n in &left {
            let ok = [".reshard-tmp-", ".reshard-old-"].iter().any(|m| {
                TARGETS
                    .iter()
                    .any(|x| n.starts_with(&format!(".{}{m}", x.dst)))
            }) || TARGETS
                .iter()
                .any(|x| *n == format!(".{}.reshard-lock", x.dst));
            assert!(ok, "kill {i}: unrecognisable leftover {n}");
            if !n.ends_with(".reshard-lock") {
                leftovers_seen.insert(n.clone());
            }
        }
        let mine: Vec<&String> = left
            .iter()
            .filter(|n| n.ends_with(&format!("-{pid}")))
            .collect();
        eprintln!(
            "kill {i:2}: {:18} after {:5} ms of {:5} ms: {outcome}{}{}",
            t.dst,
            delay.as_millis(),
            d.as_millis(),
            if mine.is_empty() {
                String::new()
            } else {
                format!("; left {mine:?}")
            },
            if removed_names(&stderr).is_empty() {
                String::new()
            } else {
                format!("; removed {:?}", removed_names(&stderr))
            }
        );
    }

    // A clean run of each conversion removes what killed runs left, says so, and leaves
    // nothing temporary behind.
    for t in TARGETS {
        let dst = out.join(t.dst);
        let o = convert_cmd(&src, &dst, t).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "clean run of {}: {err}", t.dst);
        reported.extend(removed_names(&err));
        check_complete(&dst, &model).unwrap_or_else(|e| panic!("clean run {}: {e}", t.dst));
    }
    assert_eq!(temporaries(&out), Vec::<String>::new(), "after clean runs");
    let unreported: Vec<_> = leftovers_seen.difference(&reported).collect();
    assert!(
        unreported.is_empty(),
        "leftovers removed without a message: {unreported:?}"
    );
    assert_eq!(hashes(&src), before, "the source changed");
    eprintln!(
        "kill test: 20 kills: {absent} absent, {new} complete (new), {old} complete (old kept), \
         {finished} finished before the kill; {} leftovers, all removed and reported; \
         source unchanged; {:.1} s",
        leftovers_seen.len(),
        t_start.elapsed().as_secs_f64()
    );
}

/// A small two-rank source of about `mb` MiB.
pub(crate) fn source(dir: &Path, mb: usize) -> (PathBuf, BTreeMap<String, Full>) {
    let model = big_model(mb << 20);
    let src = dir.join("src");
    write_hf_storage(&src, &fsdp_shards(&model, 2));
    (src, model)
}

/// Poll until `f` holds (or panic after 30 s).
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(30), "timed out: {what}");
        std::thread::sleep(Duration::from_micros(300));
    }
}

#[test]
fn a_second_run_writing_the_same_destination_stops_naming_the_first() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, model) = source(tmp.path(), 48);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    for t in [&TARGETS[0], &TARGETS[2]] {
        let dst = out.join(t.dst);
        // Run A: stopped (SIGSTOP) once it is writing its staged output, so it holds the lock.
        let mut a = convert_cmd(&src, &dst, t).spawn().unwrap();
        let pid = a.id();
        let staged = out.join(format!(".{}.reshard-tmp-{pid}", t.dst));
        wait_for("run A staging its output", || {
            staged.exists() || a.try_wait().unwrap().is_some()
        });
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        assert!(
            a.try_wait().unwrap().is_none(),
            "run A finished before it could be stopped"
        );
        // Run B, with and without --force: refused at once, naming A and the destination.
        for force in [true, false] {
            let mut b = Command::new(BIN);
            b.arg("convert").arg(&src).arg(&dst).args(t.args);
            if force {
                b.arg("--force");
            }
            let o = b.output().unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "run B: {err}");
            assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
            let want = format!(
                "reshard: error: another reshard run (pid {pid}) is writing {}",
                dst.display()
            );
            assert!(err.starts_with(&want), "{err}");
        }
        // B left A's staging alone; A finishes and its output is intact.
        assert!(staged.exists());
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        let o = a.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        check_complete(&dst, &model).unwrap();
        assert_eq!(temporaries(&out), Vec::<String>::new());
    }

    // Two runs started together: one wins; the other either stops at the lock or (when the
    // first has already finished) replaces the output with --force. Either way it is intact.
    let t = &TARGETS[0];
    let dst = out.join("race.safetensors");
    let runs: Vec<_> = (0..2)
        .map(|_| convert_cmd(&src, &dst, t).spawn().unwrap())
        .collect();
    let outs: Vec<_> = runs
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let ok = outs.iter().filter(|o| o.status.success()).count();
    assert!(ok >= 1);
    for o in outs.iter().filter(|o| !o.status.success()) {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("is writing") && err.contains("race.safetensors"),
            "{err}"
        );
    }
    eprintln!(
        "simultaneous runs: {ok} of 2 wrote, {} stopped at the lock",
        2 - ok
    );
    check_complete(&dst, &model).unwrap();
    assert_eq!(temporaries(&out), Vec::<String>::new());
}

/// Run reshard under `ulimit -f BLOCKS` (512-byte blocks).
fn under_ulimit(blocks: u64, args: &[&str]) -> std::process::Output {
    let mut line = format!("ulimit -f {blocks}; exec \"$0\"");
    for i in 0..args.len() {
        line.push_str(&format!(" \"${}\"", i + 1));
    }
    Command::new("sh")
        .arg("-c")
        .arg(line)
        .arg(BIN)
        .args(args)
        .output()
        .unwrap()
}

/// Require a failure with one line naming `file` and containing `what`.
fn fails_naming(o: &std::process::Output, file: &Path, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "expected exit 2: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(
        err.starts_with(&format!("reshard: error: {}", file.display())),
        "does not name {}: {err}",
        file.display()
    );
    assert!(err.contains(what), "`{what}` not in: {err}");
    err
}

#[test]
fn a_file_over_the_size_limit_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, _) = source(tmp.path(), 8);
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // 4 MiB limit: every output is bigger (the DCP output's rank files too).
    for (dst, extra) in [
        ("m.safetensors", vec!["--to", "1"]),
        ("m.pt", vec!["--to", "1"]),
        ("dcp", vec!["--to", "2", "--format", "dcp"]),
    ] {
        let d = out.join(dst);
        let mut args = vec!["convert", s(&src), s(&d)];
        args.extend(extra);
        let o = under_ulimit(8192, &args);
        let err = fails_naming(&o, &d, "the file is larger than");
        eprintln!("{}", err.trim());
        assert!(err.contains("ulimit -f"), "{err}");
        assert_eq!(common::names(&out), Vec::<String>::new(), "{dst}");
    }
}

/// A tmpfs of `mb` MiB mounted on a new directory, unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: PathBuf, mb: u64) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(&at).unwrap();
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mb}m"), "tmpfs"])
            .arg(&at)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !o.status.success() {
            return Err(String::from_utf8_lossy(&o.stderr).trim().to_string());
        }
        Ok(Tmpfs(at))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Every file under `dir` (relative path, bytes), sorted.
fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = vec![];
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        if d.is_file() {
            let rel = d.strip_prefix(dir).unwrap().display().to_string();
            out.push((rel, std::fs::read(&d).unwrap()));
            continue;
        }
        for e in std::fs::read_dir(&d).unwrap() {
            todo.push(e.unwrap().path());
        }
    }
    out.sort();
    out
}

#[test]
fn outputs_on_tmpfs_equal_those_on_disk() {
    // tmpfs (where trainers stage checkpoints) takes fallocate and kernel copies its own way:
    // the files must come out the same, trailing bytes no op writes included.
    let tmp = tempfile::tempdir().unwrap();
    let (src, _model) = source(tmp.path(), 8);
    let fs = match Tmpfs::mount(tmp.path().join("shm"), 64) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipped: cannot mount a tmpfs ({why})");
            return;
        }
    };
    for (dst, extra) in [
        ("m.safetensors", vec!["--to", "1"]),
        ("m.pt", vec!["--to", "1"]),
        ("dcp", vec!["--to", "3", "--format", "dcp"]),
        (
            "hf",
            vec!["--to", "1", "--format", "hf", "--max-shard-size", "2MB"],
        ),
    ] {
        let (on_disk, on_tmpfs) = (tmp.path().join(dst), fs.0.join(dst));
        convert(&src, &on_disk, &extra);
        convert(&src, &on_tmpfs, &extra);
        assert_eq!(tree(&on_tmpfs), tree(&on_disk), "{dst}");
    }
}

#[test]
fn a_full_disk_fails_cleanly_and_keeps_the_old_output() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, model) = source(tmp.path(), 40);
    let fs = match Tmpfs::mount(tmp.path().join("small"), 24) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("skipped: cannot mount a small tmpfs ({why})");
            return;
        }
    };
    let out = fs.0.clone();
    for (dst, extra) in [
        ("m.safetensors", vec!["--to", "1"]),
        ("m.pt", vec!["--to", "1"]),
        ("dcp", vec!["--to", "3", "--format", "dcp"]),
        (
            "hf",
            vec!["--to", "1", "--format", "hf", "--max-shard-size", "9MB"],
        ),
    ] {
        let d = out.join(dst);
        let mut args = vec!["convert", s(&src), s(&d)];
        args.extend(extra);
        let o = common::reshard(&args);
        let err = fails_naming(&o, &d, "the disk is full");
        eprintln!("{}", err.trim());
        assert_eq!(common::names(&out), Vec::<String>::new(), "{dst}");
    }
    // An existing output replaced with --force stays as it was when the disk fills.
    let keep = out.join("keep.safetensors");
    convert(
        &src,
        &keep,
        &["--to", "1", "--include", "model.norm.weight"],
    );
    let before = std::fs::read(&keep).unwrap();
    let o = common::reshard(&["convert", s(&src), s(&keep), "--to", "1", "--force"]);
    fails_naming(&o, &keep, "the disk is full");
    assert_eq!(std::fs::read(&keep).unwrap(), before);
    assert_eq!(common::names(&out), vec!["keep.safetensors".to_string()]);
    let ck = Checkpoint::open(&keep).unwrap();
    assert_eq!(ck.tensors.len(), 1);
    let t = &ck.tensors[0];
    assert_eq!(
        ck.read_region(&t.name, &Region::full(&t.shape), None)
            .unwrap(),
        model["model.norm.weight"].data
    );
}
