//! Replays of the fuzz targets (`fuzz/`, cargo-fuzz) as ordinary tests.
//!
//! Each target's body lives in `fuzz/src/lib.rs`, compiled here as a module, so these tests
//! run exactly the code path the fuzzer ran. For every target they replay:
//! - the committed seed corpus, `fuzz/seeds/<target>/` (real fixtures, cheap), and
//! - every input a fuzzer crashed on, `tests/fixtures/fuzz/<target>/`, kept after the fix.
//!
//! A body panics (and the test fails naming the input) when reshard panics, when an error
//! message spans several lines, or when a checkpoint that opens cannot be read back. The
//! crash inputs are also checked one by one below for the clean error they now give.
//!
//! To fuzz further: `scripts/fuzz.sh` (docs/guide.md, "Fuzzing").

#[allow(dead_code)]
#[path = "../../fuzz/src/lib.rs"]
mod targets;

use crate::common::root;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// The files directly in `dir` (none when it does not exist), sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Run `body` on every seed and regression input of `target`; fail naming each input that
/// panicked. Returns how many inputs ran.
fn replay(target: &str, body: fn(&[u8])) -> usize {
    let seeds = files(&root().join("fuzz/seeds").join(target));
    assert!(!seeds.is_empty(), "no seeds in fuzz/seeds/{target}");
    let crashes = files(&root().join("tests/fixtures/fuzz").join(target));
    let mut failed = vec![];
    for p in seeds.iter().chain(&crashes) {
        let data = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        if catch_unwind(AssertUnwindSafe(|| body(&data))).is_err() {
            failed.push(p.display().to_string());
        }
    }
    assert!(
        failed.is_empty(),
        "{target}: {} input(s) panicked (messages above): {failed:?}",
        failed.len()
    );
    seeds.len() + crashes.len()
}

#[test]
fn pickle_corpus() {
    replay("pickle", targets::pickle);
}

#[test]
fn torch_zip_corpus() {
    replay("torch_zip", targets::torch_zip);
}

#[test]
fn safetensors_header_corpus() {
    replay("safetensors_header", targets::safetensors_header);
}

#[test]
fn hf_index_corpus() {
    replay("hf_index", targets::hf_index);
}

#[test]
fn layout_corpus() {
    replay("layout", targets::layout);
}

#[test]
fn open_dcp_corpus() {
    replay("open_dcp", targets::open_dcp);
}

#[test]
fn open_deepspeed_corpus() {
    replay("open_deepspeed", targets::open_deepspeed);
}

#[test]
fn open_producers_corpus() {
    replay("open_producers", targets::open_producers);
}

/// The seeds are what they claim: the real fixtures open (so the fuzzers start from inputs
/// that reach deep into each parser).
#[test]
fn seeds_are_valid_inputs() {
    use reshard::formats::torch::{pickle, save as torch_zip};
    let seeds = |t: &str| files(&root().join("fuzz/seeds").join(t));
    for p in seeds("pickle") {
        let data = std::fs::read(&p).unwrap();
        let mut g = pickle::dcp_metadata_globals();
        g.extend(&pickle::torch_save_globals());
        g.extend(reshard::formats::deepspeed::records::globals());
        pickle::parse(&data, &g).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
    for p in seeds("torch_zip") {
        let data = std::fs::read(&p).unwrap();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        // pt/bad/legacy.pt is the pre-1.6 (non-zip) format; the other pt/bad fixtures are
        // archives that parse, their problems are the .pt reader's
        if name == "bad_legacy.pt" {
            assert!(torch_zip::parse(&data).is_err());
            continue;
        }
        torch_zip::parse(&data).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    for p in seeds("layout") {
        reshard::target::LayoutSpec::from_json(&std::fs::read(&p).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
    // The valid HF index opens next to the target's two shard files.
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in targets::hf_files() {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    std::fs::copy(
        root().join("fuzz/seeds/hf_index/valid.json"),
        dir.path().join("model.safetensors.index.json"),
    )
    .unwrap();
    let ck = reshard::formats::Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.tensors.len(), 4);
    // Each open_dcp / open_deepspeed seed is its fixture's own file, behind the selector byte
    // naming it; every file of every fixture has its seed.
    for (target, set) in [
        ("open_dcp", targets::Set::Dcp),
        ("open_deepspeed", targets::Set::DeepSpeed),
        ("open_producers", targets::Set::Producers),
    ] {
        let mut seen = std::collections::BTreeSet::new();
        for p in seeds(target) {
            let data = std::fs::read(&p).unwrap();
            let (fixture, file) = set.pick(data[0]);
            assert_eq!(
                &data[1..],
                set.file(fixture, file),
                "{}: selector {:#04x} picks {}/{}",
                p.display(),
                data[0],
                set.dirs()[fixture],
                set.file_names(fixture)[file]
            );
            assert_eq!(data[0], set.selector(fixture, file));
            seen.insert((fixture, file));
        }
        let all: usize = (0..set.dirs().len()).map(|f| set.file_names(f).len()).sum();
        if target == "open_deepspeed" {
            assert_eq!(seen.len(), all, "{target}: a seed per fixture file");
        }
        if target == "open_producers" {
            // a seed per file a selector reaches (a fixture's first 16)
            let reach: usize = (0..set.dirs().len())
                .map(|f| set.file_names(f).len().min(16))
                .sum();
            assert_eq!(
                seen.len(),
                reach,
                "{target}: a seed per reachable fixture file"
            );
        }
    }
    // DeepSpeed's pickles decode with its allow-list
    for p in seeds("pickle")
        .iter()
        .filter(|p| p.to_string_lossy().contains("deepspeed"))
    {
        let data = std::fs::read(p).unwrap();
        pickle::parse(&data, reshard::formats::deepspeed::records::globals())
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    }
}

/// The error a regression input now gives, through the path its target took.
fn layout_error(name: &str) -> String {
    let data = std::fs::read(root().join("tests/fixtures/fuzz/layout").join(name)).unwrap();
    match reshard::target::LayoutSpec::from_json(&data) {
        Ok(spec) => {
            // valid files must compile quickly
            let t = std::time::Instant::now();
            spec.compile(&[("w".into(), reshard::layout::DType::F32, vec![12, 4])])
                .unwrap();
            assert!(
                t.elapsed().as_secs() < 5,
                "{name}: compile took {:?}",
                t.elapsed()
            );
            String::new()
        }
        Err(e) => e.to_string(),
    }
}

#[test]
fn layout_placement_with_a_carriage_return_is_one_line() {
    // `"Sh\rd(0)"`: the bad placement was quoted raw into the message, breaking it.
    let e = layout_error("cr_in_placement.json");
    assert!(e.contains(r"bad placement `Sh\rd(0)`"), "{e}");
    assert!(!e.contains('\r') && !e.contains('\n'), "{e:?}");
}

#[test]
fn layout_strided_shard_with_a_huge_factor_compiles_at_once() {
    // `StridedShard(0, 2^63-1)` looped over every one of its 2^63 strides.
    assert_eq!(layout_error("strided_shard_huge_factor.json"), "");
}

#[test]
fn hf_index_file_name_with_control_characters_is_one_line() {
    // A `weight_map` file name holding `\r` was quoted raw into "points at ... outside the
    // checkpoint directory".
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in targets::hf_files() {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    std::fs::copy(
        root().join("tests/fixtures/fuzz/hf_index/backslash_cr_in_file_name.json"),
        dir.path().join("model.safetensors.index.json"),
    )
    .unwrap();
    let e = reshard::formats::Checkpoint::open(dir.path())
        .expect_err("an index naming a file outside the directory is refused")
        .to_string();
    assert!(e.contains("outside the checkpoint directory"), "{e}");
    assert!(e.contains(r"\r"), "{e}");
    assert!(!e.contains('\r') && !e.contains('\n'), "{e:?}");
}
