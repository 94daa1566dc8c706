//! Corruption corpus (issue #6): every fixture checkpoint is damaged systematically — each
//! file truncated at many points, bytes flipped in `.metadata`, in zip headers and in tensor
//! data, a rank file missing, two rank files swapped, chunks moved outside their tensor or onto
//! another, dtypes and shapes disagreeing, data paths leaving the directory (`../`, absolute,
//! symlinks) — and the CLI converts each variant. Every variant must either be refused (exit
//! 2, one line naming a file of the checkpoint, no panic, no output, no temporary file left)
//! or convert to exactly the right tensors (a flipped byte the format does not use). Silent
//! corruption — an output that differs from the oracle — fails the test. The counts are
//! printed (`cargo test --test it corruption -- --nocapture`).

use crate::common;
use crate::common::{reshard, s};
use reshard::formats::Checkpoint;
use reshard::layout::Region;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every tensor's bytes, by name.
fn contents(p: &Path) -> BTreeMap<String, Vec<u8>> {
    let ck = Checkpoint::open(p).unwrap();
    ck.tensors
        .iter()
        .map(|t| {
            let b = ck
                .read_region(&t.name, &Region::full(&t.shape), None)
                .unwrap();
            (t.name.clone(), b)
        })
        .collect()
}

/// A damaged copy: a file (for a `.pt`) or a directory.
struct Variant {
    what: String,
    path: PathBuf,
}

fn copy_source(src: &Path, to: &Path) -> PathBuf {
    if src.is_file() {
        let p = to.join("model.pt");
        std::fs::copy(src, &p).unwrap();
        return p;
    }
    let d = to.join("ck");
    copy_tree(src, &d);
    d
}

/// Copy the folder `src` to `to`, sub-folders included (DeepSpeed's universal checkpoints
/// keep a folder per parameter, verl a `huggingface/` folder, Megatron-LM one per rank).
fn copy_tree(src: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// The files of a checkpoint (itself for a single file; those of its sub-folders too),
/// sorted.
fn files_of(p: &Path) -> Vec<PathBuf> {
    if p.is_file() {
        return vec![p.to_path_buf()];
    }
    let mut v = vec![];
    for e in std::fs::read_dir(p).unwrap() {
        let q = e.unwrap().path();
        if q.is_dir() {
            v.extend(files_of(&q));
        } else {
            v.push(q);
        }
    }
    v.sort();
    v
}

/// The checkpoints of the producers added after the first corpus, each in its own layout:
/// DeepSpeed universal folders, verl's per-rank files, torch_checkpointing folders,
/// block-FP8 Hugging Face weights, Megatron-LM's legacy rank folders (with and without the
/// distributed optimizer's state), a Megatron-FSDP `fsdp_dtensor` checkpoint.
fn producer_checkpoints() -> Vec<PathBuf> {
    let root = common::fixture("");
    [
        "deepspeed_universal/zero2_dp2_f32_g1/global_step2_universal",
        "deepspeed_universal/zero3_dp2_f32_g2_sub/global_step2_universal",
        "verl/fsdp2_w2/checkpoint",
        "torch_checkpointing/fsdp2_w2/checkpoint",
        "torch_checkpointing/w1/checkpoint",
        "fp8/checkpoint",
        "megatron_legacy/tp2_pp2/checkpoint/iter_0000007",
        "megatron_distopt/legacy/iter_0000007",
        "megatron_fsdp/llama_tp2_fsdp2/fsdp_dtensor/iter_0000007",
    ]
    .iter()
    .map(|c| root.join(c))
    .collect()
}

fn find_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    hay.windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(i, _)| i)
        .collect()
}

/// Make the variants of `src` under `work` (each in its own directory).
fn variants(src: &Path, work: &Path) -> Vec<Variant> {
    let mut out = vec![];
    let mut n = 0;
    let mut fresh = |what: String, f: &dyn Fn(&Path)| {
        n += 1;
        let d = work.join(format!("v{n}"));
        std::fs::create_dir_all(&d).unwrap();
        let p = copy_source(src, &d);
        f(&p);
        out.push(Variant { what, path: p });
    };
    let rel = |p: &Path, f: &Path| -> PathBuf {
        if p.is_file() {
            p.to_path_buf()
        } else {
            p.join(f.strip_prefix(src).unwrap())
        }
    };
    let originals = files_of(src);
    for (fi, f) in originals.iter().enumerate() {
        let name = if src.is_file() {
            f.file_name().unwrap().to_string_lossy().to_string()
        } else {
            f.strip_prefix(src).unwrap().to_string_lossy().to_string()
        };
        let bytes = std::fs::read(f).unwrap();
        let len = bytes.len();
        // truncated at many points
        let mut cuts: Vec<usize> = vec![
            0,
            1,
            7,
            8,
            30,
            len / 4,
            len / 2,
            3 * len / 4,
            len - 1,
            len.saturating_sub(22),
            len.saturating_sub(60),
        ];
        cuts.sort_unstable();
        cuts.dedup();
        for cut in cuts.into_iter().filter(|&c| c < len) {
            fresh(format!("{name} truncated at {cut}"), &|p| {
                let t = rel(p, f);
                std::fs::write(&t, &bytes[..cut]).unwrap();
            });
        }
        // bytes flipped: spread over the file, and in every zip header's fields
        let mut flips: Vec<usize> = (0..12).map(|k| k * len / 12).collect();
        // zip header fields (signature, method, CRC, sizes, name length) of the first files
        if fi < 3 {
            for sig in [&b"PK\x03\x04"[..], b"PK\x01\x02", b"PK\x05\x06"] {
                for at in find_all(&bytes, sig).into_iter().take(2) {
                    for k in [0usize, 8, 14, 18, 26] {
                        flips.push(at + k);
                    }
                }
            }
        }
        flips.sort_unstable();
        flips.dedup();
        for at in flips.into_iter().filter(|&a| a < len) {
            fresh(format!("{name} byte {at} flipped"), &|p| {
                let t = rel(p, f);
                let mut b = bytes.clone();
                b[at] ^= 0x5a;
                std::fs::write(&t, b).unwrap();
            });
        }
    }
    // tensor data flipped (the first byte of a few tensors' first pieces)
    let ck = Checkpoint::open(src).unwrap();
    for t in ck.tensors.iter().filter(|t| t.nbytes() > 0).take(4) {
        let p0 = t.pieces.iter().find(|p| !p.region.is_empty()).unwrap();
        let file = ck.files[p0.loc.file as usize].clone();
        if !file.starts_with(src) && file != src {
            continue; // a scratch file (zstd-decoded)
        }
        let off = p0.loc.offset as usize;
        fresh(format!("data of `{}` flipped", t.name), &|p| {
            let target = rel(p, &file);
            let mut b = std::fs::read(&target).unwrap();
            b[off] ^= 0x01;
            std::fs::write(&target, b).unwrap();
        });
    }
    if src.is_file() {
        return out;
    }
    let data: Vec<&PathBuf> = originals
        .iter()
        .filter(|f| {
            let n = f.file_name().unwrap().to_string_lossy();
            n.ends_with(".distcp")
                || n.ends_with(".safetensors")
                || n.ends_with("_states.pt")
                || n.ends_with("model_optim_rng.pt")
                || n == "distrib_optim.pt"
                || n == "fp32.pt"
                || n.starts_with("model_world_size_")
                || reshard::formats::torch_checkpointing::item_file(&n).is_some()
        })
        .collect();
    // a rank file missing; two rank files swapped
    for f in &data {
        fresh(
            format!("{} missing", f.file_name().unwrap().to_string_lossy()),
            &|p| {
                std::fs::remove_file(rel(p, f)).unwrap();
            },
        );
    }
    // (not in a universal checkpoint: its files are named by the folder they sit in and hold
    // no name, so two parameters' files of one shape swapped are each a valid file)
    if data.len() >= 2 && !src.join("zero").is_dir() {
        let (a, b) = (data[0].clone(), data[1].clone());
        fresh("first two data files swapped".into(), &|p| {
            let (x, y) = (rel(p, &a), rel(p, &b));
            let tmp = p.join("swap.tmp");
            std::fs::rename(&x, &tmp).unwrap();
            std::fs::rename(&y, &x).unwrap();
            std::fs::rename(&tmp, &y).unwrap();
        });
    }
    let meta = src.join(".metadata");
    if meta.is_file() {
        let m = std::fs::read(&meta).unwrap();
        // dtype disagreeing with the items
        if !find_all(&m, b"float32").is_empty() {
            fresh(".metadata dtype float32 -> float64".into(), &|p| {
                let mut b = m.clone();
                let at = find_all(&b, b"float32")[0];
                b[at..at + 7].copy_from_slice(b"float64");
                std::fs::write(p.join(".metadata"), b).unwrap();
            });
        }
        // a data path leaving the directory (same length: the pickle is otherwise intact)
        for (label, to) in [("../", &b"../x"[..]), ("absolute", b"/tmp")] {
            if let Some(&at) = find_all(&m, b"__0_").first() {
                fresh(format!("data path made {label}"), &|p| {
                    let mut b = m.clone();
                    b[at..at + 4].copy_from_slice(to);
                    std::fs::write(p.join(".metadata"), b).unwrap();
                });
            }
        }
    }
    // a data file replaced by a symlink to a copy outside the directory
    if let Some(f) = data.first() {
        let f = (*f).clone();
        fresh(
            "data file is a symlink leaving the directory".into(),
            &|p| {
                let outside = p.parent().unwrap().join("outside.bin");
                std::fs::rename(rel(p, &f), &outside).unwrap();
                std::os::unix::fs::symlink(&outside, rel(p, &f)).unwrap();
            },
        );
    }
    // HF storage: chunk offsets moved outside the tensor / onto another chunk, shape disagreeing
    for f in &data {
        let b = std::fs::read(f).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let header = String::from_utf8_lossy(&b[8..8 + n.min(b.len() - 8)]).to_string();
        if let Some(at) = header.find("saved_offsets\\\":[") {
            let digit = 8 + at + "saved_offsets\\\":[".len();
            if b[digit].is_ascii_digit() {
                for (label, d) in [("outside its tensor", b'9'), ("onto another chunk", b'0')] {
                    let f = (*f).clone();
                    let bb = b.clone();
                    fresh(
                        format!(
                            "{} chunk moved {label}",
                            f.file_name().unwrap().to_string_lossy()
                        ),
                        &|p| {
                            let mut x = bb.clone();
                            x[digit] = if x[digit] == d { b'1' } else { d };
                            std::fs::write(rel(p, &f), x).unwrap();
                        },
                    );
                }
            }
        }
        if let Some(at) = header.find("\"shape\":[") {
            let digit = 8 + at + "\"shape\":[".len();
            if b[digit].is_ascii_digit() && b[digit] != b'9' {
                let f = (*f).clone();
                let bb = b.clone();
                fresh(
                    format!(
                        "{} shape disagreeing",
                        f.file_name().unwrap().to_string_lossy()
                    ),
                    &|p| {
                        let mut x = bb.clone();
                        x[digit] += 1;
                        std::fs::write(rel(p, &f), x).unwrap();
                    },
                );
            }
        }
    }
    out
}

#[derive(Default, Debug)]
struct Tally {
    refused: usize,
    converted_exactly: usize,
    /// Converted with damaged tensor bytes (or without its last rank's file), from a
    /// checkpoint whose format records no checksum of its data and no world size (torch's HF
    /// storage shards, safetensors-serialized DCP items).
    unprotected: usize,
}

/// True when the checkpoint's files record a checksum for every tensor byte.
fn protected(p: &Path) -> bool {
    let ck = Checkpoint::open(p).unwrap();
    ck.checksums.iter().map(|c| c.len).sum::<u64>() >= ck.nbytes()
}

#[test]
fn every_damaged_variant_is_refused_or_converted_exactly() {
    let total = corpus(common::fixture_checkpoints());
    assert!(total.refused > 500, "{total:?}");
}

#[test]
fn every_damaged_variant_of_the_newer_producers_is_refused_or_converted_exactly() {
    let total = corpus(producer_checkpoints());
    assert!(total.refused > 500, "{total:?}");
}

/// Damage each checkpoint of `sources` every way [`variants`] knows, convert each variant,
/// and check the outcome (see the module's doc); prints the counts.
fn corpus(sources: Vec<PathBuf>) -> Tally {
    let mut total = Tally::default();
    let mut lines = vec![];
    for src in sources {
        let want = contents(&src);
        let guarded = protected(&src);
        let work = tempfile::tempdir().unwrap();
        let mut t = Tally::default();
        for v in variants(&src, work.path()) {
            let before: Vec<(PathBuf, Vec<u8>)> = files_of(&v.path)
                .into_iter()
                .filter(|f| f.is_file())
                .map(|f| (f.clone(), std::fs::read(&f).unwrap_or_default()))
                .collect();
            let outdir = v.path.parent().unwrap().join("out");
            std::fs::create_dir_all(&outdir).unwrap();
            let out = outdir.join("o.safetensors");
            let o = reshard(&[
                "convert",
                s(&v.path),
                s(&out),
                "--to",
                "1",
                "--per-rank-state",
                "keep",
                "-q",
            ]);
            let err = String::from_utf8_lossy(&o.stderr).to_string();
            let leftovers: Vec<String> = std::fs::read_dir(&outdir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .filter(|n| n != "o.safetensors")
                .collect();
            assert!(
                leftovers.is_empty(),
                "{} / {}: left {leftovers:?}",
                src.display(),
                v.what
            );
            assert!(
                !err.contains("internal error"),
                "{} / {}: {err}",
                src.display(),
                v.what
            );
            match o.status.code() {
                Some(0) => {
                    let got = contents(&out);
                    if got == want {
                        t.converted_exactly += 1;
                    } else {
                        assert!(
                            !guarded
                                && (v.what.starts_with("data of")
                                    || v.what.contains("flipped")
                                    || v.what.ends_with("missing")),
                            "{} / {}: converted, but the output differs from the oracle (silent corruption)",
                            src.display(),
                            v.what
                        );
                        t.unprotected += 1;
                    }
                }
                Some(2) => {
                    assert_eq!(
                        err.trim_end().lines().count(),
                        1,
                        "{} / {}: {err}",
                        src.display(),
                        v.what
                    );
                    assert!(err.starts_with("reshard: error: "), "{err}");
                    let root = if v.path.is_file() {
                        v.path.parent().unwrap()
                    } else {
                        &v.path
                    };
                    assert!(
                        err.contains(s(root)),
                        "{} / {}: the message names no file of the checkpoint: {err}",
                        src.display(),
                        v.what
                    );
                    assert!(!out.exists(), "{} / {}: output left", src.display(), v.what);
                    t.refused += 1;
                }
                other => panic!(
                    "{} / {}: exit {other:?} (a signal or panic): {err}",
                    src.display(),
                    v.what
                ),
            }
            // sources are never written to
            for (f, b) in &before {
                assert_eq!(
                    &std::fs::read(f).unwrap_or_default(),
                    b,
                    "{} / {}: {} changed",
                    src.display(),
                    v.what,
                    f.display()
                );
            }
        }
        lines.push(format!(
            "{}: {} variants, {} refused, {} converted exactly, {} converted with damaged data (no checksum recorded)",
            src.display(),
            t.refused + t.converted_exactly + t.unprotected,
            t.refused,
            t.converted_exactly,
            t.unprotected
        ));
        total.refused += t.refused;
        total.converted_exactly += t.converted_exactly;
        total.unprotected += t.unprotected;
    }
    for l in &lines {
        eprintln!("{l}");
    }
    eprintln!(
        "corruption corpus: {} variants of {} checkpoints: {} refused with one line naming the file, {} converted exactly (bytes the formats do not use), {} converted with damaged tensor data from formats that record no checksum, 0 silent corruptions of checksummed data",
        total.refused + total.converted_exactly + total.unprotected,
        lines.len(),
        total.refused,
        total.converted_exactly,
        total.unprotected
    );
    total
}
