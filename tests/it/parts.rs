//! A conversion split over workers (`convert --part K/N`, the launchers' environments,
//! `reshard commit`): the parts, run in any order or at once, write exactly what one process
//! writes; missing, duplicate, foreign and damaged parts are refused with one line; a worker
//! killed at a random moment leaves its part missing, and running that part again completes
//! the output; sources are never written to.

use crate::common::{self, fails, fixture, ok, s, snapshot};
use reshard::commit::parts::PartsArea;
use reshard::parts::Part;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_reshard");

/// The files of an output (a file or a directory), by path relative to it, with their bytes.
fn output(p: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    if p.is_file() {
        return BTreeMap::from([(PathBuf::new(), std::fs::read(p).unwrap())]);
    }
    snapshot(p)
        .into_iter()
        .map(|(k, v)| (k.strip_prefix(p).unwrap().to_path_buf(), v))
        .collect()
}

/// `reshard convert SRC DST ARGS --part K/N -q` (required to succeed).
fn part(src: &Path, dst: &Path, args: &[&str], k: u32, n: u32) -> String {
    let p = format!("{k}/{n}");
    let mut all = vec!["convert", s(src), s(dst), "--part", &p];
    all.extend_from_slice(args);
    ok(&all)
}

/// The names beside `dst` (no staging area, lock or temporary left).
fn beside(dst: &Path) -> Vec<String> {
    common::names(dst.parent().unwrap())
}

/// Conversions of several sources into several formats, each as one process and in N parts
/// run one after another in a scrambled order: the outputs are byte-identical, the last part
/// commits, and nothing is left beside the destination.
#[test]
fn parts_in_any_order_write_what_one_process_writes() {
    let d = tempfile::tempdir().unwrap();
    let (big, _) = crate::crash::source(d.path(), 3);
    let dcp = fixture("fsdp2_w4_f32/checkpoint");
    let ds = fixture("deepspeed/zero3_dp3_f32_g2/checkpoint");
    let mcore = fixture("megatron/mcore016_tp2_dp2/checkpoint");
    let drop = ["--per-rank-state", "drop"];
    let cases: Vec<(&str, &Path, &str, Vec<&str>)> = vec![
        ("pt", &dcp, "out.pt", vec!["--to", "1"]),
        ("st", &dcp, "out.safetensors", vec!["--to", "1"]),
        (
            "st-bf16",
            &big,
            "out.safetensors",
            vec!["--to", "1", "--dtype", "bf16"],
        ),
        (
            "hf",
            &big,
            "hf",
            vec!["--to", "1", "--format", "hf", "--max-shard-size", "700KB"],
        ),
        (
            "dcp3",
            &dcp,
            "dcp3",
            [vec!["--to", "3"], drop.to_vec()].concat(),
        ),
        (
            "dcp5-big",
            &big,
            "dcp5",
            vec!["--to", "5", "--format", "dcp"],
        ),
        ("pt-big", &big, "big.pt", vec!["--to", "1"]),
        (
            "hf-storage",
            &big,
            "shards",
            vec!["--to", "3", "--format", "hf-storage"],
        ),
        (
            "deepspeed2",
            &ds,
            "ds",
            vec!["--to", "2", "--format", "deepspeed"],
        ),
        (
            "megatron1",
            &mcore,
            "mc",
            [vec!["--to", "1", "--format", "megatron"], drop.to_vec()].concat(),
        ),
    ];
    let before_big = snapshot(&big);
    for (name, src, file, args) in &cases {
        let case = d.path().join(name);
        std::fs::create_dir(&case).unwrap();
        let whole = case.join(format!("whole-{file}"));
        common::convert(src, &whole, &[args.as_slice(), &["-q"]].concat());
        let want = output(&whole);
        for n in [2u32, 3, 7] {
            let dst = case.join(format!("n{n}-{file}"));
            // a scrambled order: odd parts first, backwards, then the even ones
            let order: Vec<u32> = (0..n)
                .rev()
                .filter(|k| k % 2 == 1)
                .chain((0..n).filter(|k| k % 2 == 0))
                .collect();
            for &k in &order {
                assert!(
                    !dst.exists(),
                    "{name}: {dst:?} appeared before the last part"
                );
                part(src, &dst, &[args.as_slice(), &["-q"]].concat(), k, n);
            }
            assert!(
                output(&dst) == want,
                "{name}: {n} parts differ from one process"
            );
        }
        let mut names = beside(&case.join("x"));
        names.retain(|x| x.starts_with('.'));
        assert!(
            names.is_empty(),
            "{name}: left beside the outputs: {names:?}"
        );
    }
    assert!(snapshot(&big) == before_big, "a source changed");
}

/// Parts run at once by separate processes (as a launcher starts them) write the same output
/// as one process, and exactly one of them commits.
#[test]
fn parts_run_at_once_commit_once() {
    let d = tempfile::tempdir().unwrap();
    let (src, _) = crate::crash::source(d.path(), 24);
    let whole = d.path().join("whole");
    common::convert(&src, &whole, &["--to", "3", "--format", "dcp", "-q"]);
    for round in 0..3 {
        let dst = d.path().join(format!("parts{round}"));
        let n = 4;
        let kids: Vec<_> = (0..n)
            .map(|k| {
                Command::new(BIN)
                    .args(["convert", s(&src), s(&dst), "--to", "3", "--format", "dcp"])
                    .env("RANK", k.to_string())
                    .env("WORLD_SIZE", n.to_string())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs: Vec<_> = kids
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        for o in &outs {
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        let text: Vec<String> = outs
            .iter()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .collect();
        let committed = text.iter().filter(|t| t.contains("committed ")).count();
        assert!(committed <= 1, "{text:?}");
        for (k, t) in text.iter().enumerate() {
            assert!(
                t.contains(&format!("part {k}/{n} (from torchrun's environment)")),
                "{t}"
            );
        }
        assert!(output(&dst) == output(&whole), "round {round}: differs");
        let mut left = beside(&dst);
        left.retain(|x| x.starts_with('.'));
        assert!(left.is_empty(), "{left:?}");
    }
}

/// A missing part: the commit names it; running it again completes the output. Records of
/// other parts are not redone; a finished part asked again does nothing.
#[test]
fn a_missing_part_is_named_and_running_it_again_completes_the_output() {
    let d = tempfile::tempdir().unwrap();
    let (src, _) = crate::crash::source(d.path(), 2);
    let whole = d.path().join("whole.pt");
    common::convert(&src, &whole, &["--to", "1", "-q"]);
    let dst = d.path().join("out.pt");
    for k in [0, 1, 3] {
        part(&src, &dst, &["--to", "1", "-q"], k, 4);
    }
    assert!(!dst.exists());
    let err = fails(&["commit", s(&dst)], "1 of 4 part(s) not written: 2/4");
    assert!(err.contains(s(&dst)), "{err}");
    // a finished part again: nothing written, still waiting
    let again = part(&src, &dst, &["--to", "1"], 1, 4);
    assert!(
        again.contains("part 1/4 of") && again.contains("written by an earlier run"),
        "{again}"
    );
    assert!(again.contains("waiting for part(s) 2 of 4"), "{again}");
    let area = PartsArea::dir_of(&dst).unwrap();
    let job = std::fs::read(area.join("job.json")).unwrap();
    // `reshard commit --force` over an existing destination before the parts are done: it
    // names the missing part and leaves the staging area alone
    std::fs::write(&dst, b"old").unwrap();
    fails(
        &["commit", s(&dst), "--force"],
        "1 of 4 part(s) not written: 2/4",
    );
    assert!(area.join("job.json").exists());
    std::fs::remove_file(&dst).unwrap();
    let last = part(&src, &dst, &["--to", "1"], 2, 4);
    assert!(last.contains("committed "), "{last}");
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&whole).unwrap());
    // a commit stopped after publishing, before it removed the staging area: the next commit
    // sees the output is the one it published and only cleans up
    std::fs::create_dir(&area).unwrap();
    std::fs::write(area.join("job.json"), &job).unwrap();
    let id = {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&dst).unwrap();
        format!("{}:{}", m.dev(), m.ino())
    };
    std::fs::write(area.join("publishing"), id).unwrap();
    assert!(ok(&["commit", s(&dst)]).contains("already committed"));
    assert!(!area.exists());
    // a damaged job.json is refused by name
    std::fs::create_dir(&area).unwrap();
    let text = String::from_utf8(job.clone()).unwrap();
    std::fs::write(
        area.join("job.json"),
        text.replace("\"parts\": 4", "\"parts\": 0"),
    )
    .unwrap();
    common::fails_all(&["commit", s(&dst)], &["job.json", "is damaged: 0 parts"]);
    std::fs::remove_dir_all(&area).unwrap();
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&whole).unwrap());
    // the output exists now: another run of the job is refused without --force
    fails(
        &["convert", s(&src), s(&dst), "--to", "1", "--part", "0/4"],
        "already exists",
    );
    fails(&["commit", s(&dst)], "no conversion in parts is staged");
    // explicit commit after all parts, with --force replacing an existing output
    let dst2 = d.path().join("out2.pt");
    std::fs::write(&dst2, b"old").unwrap();
    for k in 0..2 {
        // the job refuses to start over an existing destination without --force
        fails(
            &[
                "convert",
                s(&src),
                s(&dst2),
                "--to",
                "1",
                "--part",
                &format!("{k}/2"),
            ],
            "already exists",
        );
        part(&src, &dst2, &["--to", "1", "--force", "-q"], k, 2);
    }
    assert_eq!(
        std::fs::read(&dst2).unwrap(),
        std::fs::read(&whole).unwrap()
    );
}

/// Parts of another conversion (other options, another source, another N) are refused by
/// name; a part claimed by a running worker is refused; damaged records and staged bytes are
/// found by the commit.
#[test]
fn foreign_duplicate_and_damaged_parts_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let (src, _) = crate::crash::source(d.path(), 2);
    let dst = d.path().join("out.safetensors");
    part(&src, &dst, &["--to", "1", "-q"], 0, 3);
    fails(
        &[
            "convert",
            s(&src),
            s(&dst),
            "--to",
            "1",
            "--part",
            "1/3",
            "--exclude",
            "opt.*",
        ],
        "holds parts of another conversion",
    );
    fails(
        &["convert", s(&src), s(&dst), "--to", "1", "--part", "1/4"],
        "holds a conversion in 3 parts, not 4",
    );
    // another source at the same path: rewritten since
    let other = d.path().join("other");
    common::copy_dir(&src, &other);
    fails(
        &["convert", s(&other), s(&dst), "--to", "1", "--part", "1/3"],
        "holds parts of another conversion",
    );
    // part 1 held by a live worker (this process holds its claim)
    let area = PartsArea::open(&dst).unwrap();
    let claim = area.claim(Part::new(1, 3).unwrap()).unwrap();
    fails(
        &["convert", s(&src), s(&dst), "--to", "1", "--part", "1/3"],
        "part 1/3 is being written by another worker",
    );
    drop(claim);
    part(&src, &dst, &["--to", "1", "-q"], 1, 3);
    // staged bytes changed after a part recorded them: the commit names the part
    let staged = area.dir().join("out");
    let mut bytes = std::fs::read(&staged).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0xFF;
    std::fs::write(&staged, &bytes).unwrap();
    // the part whose span holds that byte
    let owner = (0..2)
        .find(|k| {
            let rec = area.dir().join(format!("part-{k:06}-of-000003.json"));
            let v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(rec).unwrap()).unwrap();
            v["spans"].as_array().unwrap().iter().any(|sp| {
                sp["start"].as_u64().unwrap() <= at as u64
                    && (at as u64) < sp["end"].as_u64().unwrap()
            })
        })
        .expect("parts 0 and 1 hold the middle byte");
    let err = common::fails_all(
        &["convert", s(&src), s(&dst), "--to", "1", "--part", "2/3"],
        &[
            "do not match their CRC-32",
            &format!("part {owner}/3"),
            "its record is removed: run that part again",
        ],
    );
    assert!(err.contains(s(&staged)), "{err}");
    assert!(!dst.exists());
    // the commit removed that part's record: running it again rewrites it and commits
    assert!(!area
        .dir()
        .join(format!("part-{owner:06}-of-000003.json"))
        .exists());
    part(&src, &dst, &["--to", "1", "-q"], owner, 3);
    let whole = d.path().join("whole.safetensors");
    common::convert(&src, &whole, &["--to", "1", "-q"]);
    assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&whole).unwrap());
    // a record that is not JSON
    let dst = d.path().join("out3.safetensors");
    part(&src, &dst, &["--to", "1", "-q"], 0, 2);
    let rec = PartsArea::dir_of(&dst)
        .unwrap()
        .join("part-000000-of-000002.json");
    std::fs::write(&rec, b"{not json").unwrap();
    common::fails_all(
        &["convert", s(&src), s(&dst), "--to", "1", "--part", "1/2"],
        &[s(&rec), "is not a reshard part record"],
    );
}

/// Where the part comes from: `--part` over the environment; torchrun, Slurm tasks, Slurm
/// arrays and Kubernetes indexed jobs; `--part 0/1` runs the whole conversion under a launcher;
/// bad values are one-line errors.
#[test]
fn the_part_comes_from_the_launcher_unless_given() {
    let d = tempfile::tempdir().unwrap();
    let (src, _) = crate::crash::source(d.path(), 1);
    let run = |dst: &str, env: &[(&str, &str)], extra: &[&str]| {
        let mut c = Command::new(BIN);
        c.args(["convert", s(&src), s(&d.path().join(dst)), "--to", "1"])
            .args(extra);
        for v in [
            "RANK",
            "WORLD_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_ARRAY_TASK_ID",
            "JOB_COMPLETION_INDEX",
        ] {
            c.env_remove(v);
        }
        for (k, v) in env {
            c.env(k, v);
        }
        c.output().unwrap()
    };
    let text = |o: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let o = run("a.pt", &[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")], &[]);
    assert!(
        text(&o).contains("part 1/2 (from Slurm tasks's environment)"),
        "{}",
        text(&o)
    );
    let o = run(
        "b.pt",
        &[
            ("SLURM_ARRAY_TASK_ID", "7"),
            ("SLURM_ARRAY_TASK_MIN", "5"),
            ("SLURM_ARRAY_TASK_MAX", "8"),
        ],
        &[],
    );
    assert!(
        text(&o).contains("part 2/4 (from Slurm array job's environment)"),
        "{}",
        text(&o)
    );
    let o = run(
        "c.pt",
        &[("JOB_COMPLETION_INDEX", "0"), ("RESHARD_PARTS", "3")],
        &[],
    );
    assert!(
        text(&o).contains("part 0/3 (from Kubernetes indexed job's environment)"),
        "{}",
        text(&o)
    );
    let o = run("d.pt", &[("JOB_COMPLETION_INDEX", "0")], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("RESHARD_PARTS"), "{}", text(&o));
    // --part wins over the environment; 0/1 is the whole conversion
    let o = run(
        "e.pt",
        &[("RANK", "1"), ("WORLD_SIZE", "4")],
        &["--part", "0/2"],
    );
    assert!(text(&o).contains("wrote part 0/2 of"), "{}", text(&o));
    let o = run(
        "f.pt",
        &[("RANK", "1"), ("WORLD_SIZE", "4")],
        &["--part", "0/1"],
    );
    assert!(
        o.status.success() && text(&o).contains("wrote ") && !text(&o).contains("part"),
        "{}",
        text(&o)
    );
    assert!(d.path().join("f.pt").is_file());
    // a world of one is the whole conversion too
    let o = run("g.pt", &[("RANK", "0"), ("WORLD_SIZE", "1")], &[]);
    assert!(
        o.status.success() && d.path().join("g.pt").is_file(),
        "{}",
        text(&o)
    );
    for (bad, needle) in [
        ("4/4", "does not exist"),
        ("x", "expected K/N"),
        ("0/0", "1 to 65536 parts"),
    ] {
        let o = run("h.pt", &[], &["--part", bad]);
        assert_eq!(o.status.code(), Some(2), "{bad}");
        assert!(text(&o).contains(needle), "{bad}: {}", text(&o));
    }
    let o = run("i.pt", &[("RANK", "2"), ("WORLD_SIZE", "2")], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("RANK/WORLD_SIZE (torchrun)"),
        "{}",
        text(&o)
    );
}

/// splitmix64, seeded, so a failing round can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n.max(1)
    }
}

/// One of several workers SIGKILLed at a random moment while the others run: the output is
/// not there; if the killed part had not recorded, the commit names it as missing; running
/// that part again (same command, same K/N) commits an output byte-identical to one
/// process's, and the source is unchanged. `RESHARD_CRASH_SEED` replays other moments.
#[test]
fn a_worker_killed_at_a_random_moment_is_completed_by_running_its_part_again() {
    let seed: u64 = std::env::var("RESHARD_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let mut rng = Rng(seed);
    let d = tempfile::tempdir().unwrap();
    let (src, _) = crate::crash::source(d.path(), 48);
    let before = snapshot(&src);
    let whole = d.path().join("whole");
    let args = ["--to", "1", "--format", "hf", "--max-shard-size", "10MB"];
    let t0 = std::time::Instant::now();
    common::convert(&src, &whole, &[args.as_slice(), &["-q"]].concat());
    // kill within the time one process takes for everything (a part's run starts as long)
    let span = t0.elapsed().as_micros() as u64;
    let want = output(&whole);
    let n = 3u32;
    let mut missing_seen = 0;
    for round in 0..6 {
        let dst = d.path().join(format!("out{round}"));
        let victim = rng.below(n as u64) as u32;
        let delay = Duration::from_micros(rng.below(span));
        let spawn = |k: u32| {
            Command::new(BIN)
                .args(["convert", s(&src), s(&dst)])
                .args(args)
                .args(["--part", &format!("{k}/{n}")])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        };
        let mut kids: Vec<_> = (0..n).map(spawn).collect();
        std::thread::sleep(delay);
        let _ = kids[victim as usize].kill();
        let mut killed_ok = false;
        for (k, c) in kids.into_iter().enumerate() {
            let o = c.wait_with_output().unwrap();
            if k as u32 == victim {
                killed_ok = o.status.success();
            } else {
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            }
        }
        if !killed_ok && !dst.exists() {
            let area = PartsArea::dir_of(&dst).unwrap();
            let recorded = area
                .join(format!("part-{victim:06}-of-{n:06}.json"))
                .exists();
            if !recorded {
                missing_seen += 1;
                assert!(
                    !dst.exists(),
                    "round {round}: published without part {victim}"
                );
                fails(
                    &["commit", s(&dst)],
                    &format!("1 of {n} part(s) not written: {victim}/{n}"),
                );
            }
            let o = ok(&[
                &["convert", s(&src), s(&dst)][..],
                &args,
                &["--part", &format!("{victim}/{n}")],
            ]
            .concat());
            assert!(
                o.contains("committed ") || dst.exists(),
                "round {round}: {o}"
            );
            if !dst.exists() {
                ok(&["commit", s(&dst)]);
            }
        }
        assert!(
            output(&dst) == want,
            "round {round} (victim {victim}, {delay:?}): differs"
        );
        let mut left = beside(&dst);
        left.retain(|x| x.starts_with('.'));
        assert!(left.is_empty(), "round {round}: {left:?}");
    }
    eprintln!("seed {seed}: {missing_seen} of 6 rounds killed a worker before it recorded");
    assert!(
        missing_seen > 0,
        "no round killed a worker before it recorded; seed {seed}"
    );
    assert!(snapshot(&src) == before, "the source changed");
}
