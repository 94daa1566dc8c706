//! Folders of checkpoints and what comes with a checkpoint: torchtitan's step folders (the
//! newest opened by default, `--step N` for another, `inspect` listing them), Hugging Face
//! model folders (one-file `model.safetensors`; `config.json` carried into an `hf` output, or
//! given with `--config`).

use crate::common::{self, convert, fails, fixture, ok, read_all, s};
use reshard::formats::{Checkpoint, Format};
use reshard::OpenOptions;

#[test]
fn the_newest_step_folder_by_number_and_step_to_choose() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("checkpoint");
    // step-10 is newer than step-9, though it sorts first as text
    common::copy_dir(&fixture("fsdp2_w2_f32/checkpoint"), &dir.join("step-9"));
    common::copy_dir(&fixture("fsdp2_w4_f32/checkpoint"), &dir.join("step-10"));
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!((ck.ranks, ck.tag.as_deref()), (4, Some("step-10")));
    assert_eq!(
        reshard::formats::checkpoints_in(&dir),
        vec!["step-9".to_string(), "step-10".to_string()]
    );
    let out = ok(&["inspect", s(&dir)]);
    assert!(out.contains("dcp checkpoint, 4 rank(s)"), "{out}");
    assert!(
        out.contains("one of 2 checkpoints in the folder: step-9, step-10 (read: step-10"),
        "{out}"
    );
    let out = ok(&["inspect", s(&dir), "--step", "9"]);
    assert!(out.contains("dcp checkpoint, 2 rank(s)"), "{out}");
    fails(
        &["inspect", s(&dir), "--step", "3"],
        "has no checkpoint tagged `step-3`",
    );
    let o = common::reshard(&["inspect", s(&dir), "--step", "9", "--tag", "step-9"]);
    assert_eq!(o.status.code(), Some(2));
    // a conversion of the folder reads the newest step
    let st = d.path().join("m.safetensors");
    convert(&dir, &st, &["--to", "1", "-q"]);
    let want = read_all(&Checkpoint::open(dir.join("step-10")).unwrap());
    let got = read_all(&Checkpoint::open(&st).unwrap());
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    // folders of other names are not guessed at: the error names them
    std::fs::rename(dir.join("step-9"), dir.join("best")).unwrap();
    fails(
        &["inspect", s(&dir)],
        "holds 2 checkpoint(s) in sub-folders (best, step-10): choose one with --tag NAME",
    );
    let tagged = Checkpoint::open_with(
        &dir,
        None,
        &OpenOptions {
            tag: Some("best".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(tagged.ranks, 2);
}

#[test]
fn a_model_folder_carries_its_config_into_an_hf_output() {
    let d = tempfile::tempdir().unwrap();
    // a one-file model folder, as save_pretrained writes a small model
    let src = d.path().join("model");
    std::fs::create_dir_all(&src).unwrap();
    let fx = fixture("fsdp2_w2_f32/checkpoint");
    convert(
        &fx,
        &src.join("model.safetensors"),
        &["--to", "1", "--include", "model.*", "-q"],
    );
    let config = br#"{"architectures": ["Tiny"], "hidden_size": 12}"#;
    std::fs::write(src.join("config.json"), config).unwrap();
    std::fs::write(
        src.join("generation_config.json"),
        b"{\"do_sample\": false}",
    )
    .unwrap();
    let ck = Checkpoint::open(&src).unwrap();
    assert_eq!(ck.format, Format::HF);
    assert_eq!(ck.companions.len(), 2);
    let out = d.path().join("hf");
    convert(
        &src,
        &out,
        &[
            "--to",
            "1",
            "--format",
            "hf",
            "--max-shard-size",
            "1KB",
            "-q",
        ],
    );
    assert_eq!(std::fs::read(out.join("config.json")).unwrap(), config);
    assert!(out.join("generation_config.json").is_file());
    assert_eq!(
        read_all(&Checkpoint::open(&out).unwrap()),
        read_all(&Checkpoint::open(&src).unwrap())
    );
    // a DCP source has none: --config gives it; a config that is not a JSON object is refused
    let dcp_out = d.path().join("hf2");
    let given = d.path().join("c.json");
    std::fs::write(&given, config).unwrap();
    convert(
        &fx,
        &dcp_out,
        &["--to", "1", "--format", "hf", "--config", s(&given), "-q"],
    );
    assert_eq!(std::fs::read(dcp_out.join("config.json")).unwrap(), config);
    std::fs::write(&given, b"[]").unwrap();
    fails(
        &[
            "convert",
            s(&fx),
            s(&d.path().join("hf3")),
            "--to",
            "1",
            "--format",
            "hf",
            "--config",
            s(&given),
        ],
        "c.json: does not hold a JSON object",
    );
    assert!(!d.path().join("hf3").exists());
    // other outputs have no place for it
    let plain = d.path().join("x.safetensors");
    convert(&src, &plain, &["--to", "1", "-q"]);
    assert!(!d.path().join("config.json").exists());
}
