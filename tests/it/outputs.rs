//! What `convert` writes where: a destination named for another output is refused, not
//! overruled.

use crate::common::*;
use std::path::{Path, PathBuf};

/// The Lightning Fabric FSDP1 checkpoint of the issue: 4 ranks of DCP written by torch 2.1,
/// with a `meta.pt` (non-tensor entries) and nesting.
fn source() -> PathBuf {
    fixture("fabric_fsdp1_w4_f32_torch21/checkpoint")
}

#[test]
fn a_destination_named_for_another_output_is_refused_and_nothing_is_written() {
    let src = source();
    let d = tempfile::tempdir().unwrap();
    let at = |name: &str| d.path().join(name);
    // 2 ranks are a DCP folder: a .safetensors name is refused, and the shards it could mean
    // are named
    let err = fails(
        &["convert", s(&src), s(&at("x.safetensors")), "--to", "2"],
        "x.safetensors: a .safetensors name is one file, but 2 rank(s) are written as a folder (dcp)",
    );
    assert!(
        err.contains(&format!("name a folder such as {}/", s(&at("x"))))
            && err.contains("--format hf-storage"),
        "{err}"
    );
    // a folder format asked for: the name's own file format is the way out
    let err = fails(
        &[
            "convert",
            s(&src),
            s(&at("x.pt")),
            "--to",
            "1",
            "--format",
            "dcp",
        ],
        "x.pt: a .pt name is one file, but the dcp output asked for is a folder",
    );
    assert!(err.contains("drop --format to write one .pt file"), "{err}");
    // 2 ranks into a .pt name (no folder format of the torch family but DCP itself)
    fails(
        &["convert", s(&src), s(&at("x.pt")), "--to", "2"],
        "x.pt: a .pt name is one file, but 2 rank(s) are written as a folder (dcp)",
    );
    // another file format asked for
    fails(
        &[
            "convert",
            s(&src),
            s(&at("m.safetensors")),
            "--to",
            "1",
            "--format",
            "pt",
        ],
        &format!("name it {}", s(&at("m.pt"))),
    );
    // a name ending in / for one file
    let slash = format!("{}/", s(&at("one")));
    fails(
        &[
            "convert",
            s(&src),
            &slash,
            "--to",
            "1",
            "--format",
            "safetensors",
        ],
        &format!("name a file such as {}.safetensors", s(&at("one"))),
    );
    assert_eq!(
        names(d.path()),
        Vec::<String>::new(),
        "something was written"
    );
}

#[test]
fn destinations_that_name_their_output_are_written_as_before() {
    let src = source();
    let d = tempfile::tempdir().unwrap();
    let at = |name: &str| d.path().join(name);
    let open = |p: &Path| reshard::formats::Checkpoint::open(p).unwrap();
    use reshard::formats::Format;
    let cases: &[(&str, &[&str], Format, u32)] = &[
        ("model.safetensors", &["--to", "1"], Format::SAFETENSORS, 1),
        ("model.pt", &["--to", "1"], Format::PT, 1),
        ("model.pth", &["--to", "1"], Format::PT, 1),
        ("out", &["--to", "2"], Format::DCP, 2),
        ("hf", &["--to", "1"], Format::HF, 1),
        ("hf2", &["--to", "1", "--format", "hf"], Format::HF, 1),
        (
            "hfs",
            &["--to", "2", "--format", "hf-storage"],
            Format::HF_STORAGE,
            2,
        ),
        ("d1", &["--to", "1", "--format", "dcp"], Format::DCP, 1),
        ("p", &["--to", "1", "--format", "pt"], Format::PT, 1),
    ];
    for (name, args, format, ranks) in cases {
        convert(&src, &at(name), args);
        let ck = open(&at(name));
        assert_eq!((ck.format, ck.ranks), (*format, *ranks), "{name} {args:?}");
        assert_eq!(at(name).is_dir(), format.is_dir(), "{name} {args:?}");
    }
}
