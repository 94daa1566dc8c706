//! What the user is told when a run cannot go on: one `reshard: error: …` line, exit status
//! 2, naming the path the user gave (not a hidden file of reshard's own) and saying the
//! problem in plain words; no output, no staging file or lock left behind, the source
//! untouched.

use crate::common::*;
use std::path::Path;

/// `reshard ARGS` fails with exactly `want` (one line, `reshard: error: ` then `want`), exit
/// status 2.
fn says(args: &[&str], want: &str) {
    let o = reshard(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        (o.status.code(), err.as_ref()),
        (Some(2), format!("reshard: error: {want}\n").as_str()),
        "reshard {args:?}"
    );
    assert!(
        o.stdout.is_empty(),
        "reshard {args:?}: printed {:?}",
        o.stdout
    );
}

/// A conversion to `dst` from the fixture's checkpoint fails with one line starting with
/// `start`, naming no lock or staging file; nothing is left in `dir` (where `dst` would be,
/// when that folder is the test's) and the source is untouched.
fn cannot_write(dst: &Path, extra: &[&str], start: &str) -> String {
    let src = fixture("fabric_fsdp1_w4_f32_torch21/checkpoint");
    let before = snapshot(&src);
    let mut args = vec!["convert", s(&src), s(dst), "--to", "1"];
    args.extend_from_slice(extra);
    let err = fails(&args, start);
    assert!(
        err.starts_with(&format!("reshard: error: {start}")),
        "reshard {args:?}: {err}"
    );
    for hidden in [".reshard-lock", ".reshard-tmp", ".reshard-parts"] {
        assert!(
            !err.contains(hidden),
            "reshard {args:?} names {hidden}: {err}"
        );
    }
    assert_eq!(snapshot(&src), before, "the source changed");
    err
}

#[test]
fn an_unwritable_destination_is_named_not_its_lock_file() {
    let d = tempfile::tempdir().unwrap();
    // a folder that does not exist: every output kind, and `commit`
    let nope = d.path().join("nope/dir");
    for (name, extra) in [
        ("model.safetensors", &[][..]),
        ("model.pt", &[]),
        ("out", &["--format", "dcp"]),
        ("parts.pt", &["--part", "0/2"]),
    ] {
        let dst = nope.join(name);
        let want = format!(
            "{}: cannot write: the folder {} does not exist",
            dst.display(),
            nope.display()
        );
        let err = cannot_write(&dst, extra, &want);
        assert_eq!(err, format!("reshard: error: {want}\n"));
    }
    says(
        &["commit", s(&nope.join("parts.pt"))],
        &format!(
            "{}: cannot write: the folder {} does not exist (os error 2)",
            nope.join("parts.pt").display(),
            nope.display()
        ),
    );
    // a file where the folder should be
    let file = d.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    cannot_write(
        &file.join("model.pt"),
        &[],
        &format!(
            "{}: cannot write: the folder {} is not a folder",
            file.join("model.pt").display(),
            file.display()
        ),
    );
    assert_eq!(names(d.path()), vec!["file"]);
    // folders no process may create files in, whoever runs the tests (root included): the
    // reason is the kernel's (/proc takes no new files; /sys refuses them, or is mounted
    // read-only in containers), the path is the destination
    // (a folder format gets a folder's name: a `.safetensors` name is refused for it first)
    for (dst, extra) in [
        ("/proc/model.safetensors", &[][..]),
        ("/proc/model.safetensors", &["--part", "0/2"]),
        ("/proc/model", &["--format", "dcp"]),
        ("/sys/model.pt", &[]),
        ("/sys/model.pt", &["--part", "0/2"]),
        ("/sys/model", &["--format", "dcp"]),
    ] {
        cannot_write(Path::new(dst), extra, &format!("{dst}: cannot write: "));
    }
    cannot_write(
        Path::new("/proc/model.safetensors"),
        &[],
        "/proc/model.safetensors: cannot write: the folder /proc takes no new files (os error 2)",
    );
    // a read-only folder: root writes into it anyway, so only checked for other users
    let ro = d.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::os::unix::fs::PermissionsExt::from_mode(0o555)).unwrap();
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        eprintln!("running as root, which writes into read-only folders: that case is skipped");
    } else {
        let dst = ro.join("model.safetensors");
        cannot_write(
            &dst,
            &[],
            &format!(
                "{}: cannot write: permission denied: no new files may be created in the \
                 folder {} (os error 13)",
                dst.display(),
                ro.display()
            ),
        );
        assert!(names(&ro).is_empty());
    }
}

#[test]
fn a_safetensors_file_cut_inside_its_header_is_said_to_be_truncated() {
    let d = tempfile::tempdir().unwrap();
    let whole = d.path().join("whole.safetensors");
    write_safetensors(&whole, &model());
    let bytes = std::fs::read(&whole).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let cut = d.path().join("cut.safetensors");
    for len in [8, 9, 20, 8 + n as usize - 1] {
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let want = format!(
            "{}: is truncated: its header length says {n} bytes of header follow, but the \
             file has only {} bytes after it",
            cut.display(),
            len - 8
        );
        says(&["inspect", s(&cut)], &want);
        let out = d.path().join("out.pt");
        says(&["convert", s(&cut), s(&out), "--to", "1"], &want);
        assert_eq!(
            names(d.path()),
            vec!["cut.safetensors", "whole.safetensors"]
        );
    }
}

#[test]
fn a_file_that_is_no_checkpoint_says_so_and_what_was_expected() {
    let expected = "expected a single .safetensors file or a .pt file (a consolidated state dict)";
    let readme = root().join("README.md");
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("out.safetensors");
    for args in [
        &["inspect", s(&readme)][..],
        &["verify", s(&readme)],
        &["convert", s(&readme), s(&out), "--to", "1"],
    ] {
        says(
            args,
            &format!(
                "{}: is not a checkpoint (it is a text file): {expected}",
                readme.display()
            ),
        );
    }
    let empty = d.path().join("empty.pt");
    std::fs::write(&empty, b"").unwrap();
    says(
        &["inspect", s(&empty)],
        &format!(
            "{}: is not a checkpoint (it is empty): {expected}",
            empty.display()
        ),
    );
    let short = d.path().join("short");
    std::fs::write(&short, b"\x01\x02\x03").unwrap();
    says(
        &["inspect", s(&short)],
        &format!(
            "{}: is not a checkpoint (it is only 3 byte(s) long): {expected}",
            short.display()
        ),
    );
    // binary bytes whose first 8, as a header length, are more than a header may have
    let junk = d.path().join("junk.bin");
    std::fs::write(&junk, [0xffu8; 64]).unwrap();
    let err = fails(
        &["inspect", s(&junk)],
        "is not a checkpoint (its first 8 bytes",
    );
    assert!(err.ends_with(&format!("): {expected}\n")), "{err}");
    assert_eq!(names(d.path()), vec!["empty.pt", "junk.bin", "short"]);
}

#[test]
fn a_pt_file_cut_short_is_said_to_be_truncated() {
    let d = tempfile::tempdir().unwrap();
    let whole = d.path().join("whole.pt");
    convert(
        &fixture("fabric_fsdp1_w4_f32_torch21/checkpoint"),
        &whole,
        &["--to", "1", "-q"],
    );
    let bytes = std::fs::read(&whole).unwrap();
    let cut = d.path().join("cut.pt");
    for len in [4, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let want = format!(
            "{}: is truncated or not a torch.save archive (no zip end record)",
            cut.display()
        );
        says(&["inspect", s(&cut)], &want);
        says(&["verify", s(&cut)], &want);
        let out = d.path().join("out.safetensors");
        says(&["convert", s(&cut), s(&out), "--to", "1"], &want);
        assert_eq!(names(d.path()), vec!["cut.pt", "whole.pt"]);
    }
}

#[test]
fn a_bad_value_of_an_enumerated_option_lists_the_accepted_values() {
    let (d, ck) = synthetic(2);
    let out = d.path().join("out.safetensors");
    let convert = |opt: &str, value: &str| {
        vec![
            "convert".to_string(),
            s(&ck).to_string(),
            s(&out).to_string(),
            "--to".into(),
            "1".into(),
            opt.into(),
            value.into(),
        ]
    };
    let cases: Vec<(Vec<String>, &[&str])> = vec![
        (convert("--dtype", "fp8"), &["f16", "bf16", "f32", "f64"]),
        (convert("--dtype", "i32"), &["f16", "bf16", "f32", "f64"]),
        (
            convert("--format", "PT"),
            &[
                "safetensors",
                "hf",
                "hf-storage",
                "dcp",
                "pt",
                "deepspeed",
                "megatron",
            ],
        ),
        (convert("--weights", "bf16"), &["master", "model"]),
        (
            convert("--per-rank-state", "all"),
            &["drop", "rank0", "keep"],
        ),
        (convert("--zero-stage", "4"), &["1..=3"]),
        (convert("--verify-read", "read"), &["pread", "mmap"]),
        (
            vec![
                "verify".into(),
                s(&ck).into(),
                "--read".into(),
                "read".into(),
            ],
            &["pread", "mmap"],
        ),
    ];
    for (args, values) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let opt = args[args.len() - 2];
        let value = args[args.len() - 1];
        let err = fails_all(&args, values);
        assert!(
            err.starts_with(&format!(
                "reshard: error: invalid value '{value}' for '{opt} "
            )),
            "{err}"
        );
        assert_eq!(reshard(&args).status.code(), Some(2));
    }
    fails(
        &["convert", s(&ck), s(&out), "--to", "1", "--dtype", "fp8"],
        "unknown dtype `fp8` (expected f16, bf16, f32 or f64",
    );
    // every usage error clap finds is one line too, its usage and tips kept
    fails(
        &["convert", s(&ck)],
        "the following required arguments were not provided: <DST>; usage: ",
    );
    fails(
        &["inspect", s(&ck), "--no-such-flag"],
        "unexpected argument '--no-such-flag' found",
    );
    fails(&["frobnicate"], "unrecognized subcommand 'frobnicate'");
    assert_eq!(names(d.path()), vec!["ck"]);
}
