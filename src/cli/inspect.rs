//! `reshard inspect`: a checkpoint's format, ranks, tensors and layouts, as a table or JSON.

use super::text::{clip, json, name_width, shown, size};
use super::Outcome;
use crate::formats::{Aliasing, Checkpoint, Format};
use crate::per_rank::{classify, PerRank};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::Path;

/// What `inspect` shows of a checkpoint beyond the checkpoint itself.
struct Findings<'a> {
    /// Groups of tied tensor names.
    ties: Vec<Vec<String>>,
    /// The per-rank entries (tensors and non-tensor), by name.
    per_rank: BTreeMap<&'a str, PerRank>,
    /// The checkpoints of the folder given, when it holds several (step folders, tags).
    siblings: Vec<String>,
    /// The recipe that converts it to the other framework, or why none does.
    recipe: Option<String>,
    /// Its block-quantized FP8 weights ([`crate::fp8`]).
    quantization: Option<crate::fp8::Quantization>,
}

/// Open `path` and print what it holds to `out`.
pub fn run(
    path: &Path,
    source: &crate::OpenOptions,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<Outcome> {
    let ck = Checkpoint::open_with(path, None, source)?;
    let found = Findings {
        ties: ck.tied_names()?,
        per_rank: per_rank_entries(&ck),
        siblings: crate::formats::checkpoints_in(path),
        recipe: crate::recipe::describe(&ck),
        quantization: crate::fp8::quantization(&ck)?,
    };
    if as_json {
        let mut v = serde_json::to_value(&ck).map_err(|e| Error::usage(e.to_string()))?;
        let disk = ck.disk_files();
        v["on_disk"] = serde_json::json!({
            "files": disk.len(),
            "bytes": disk.iter().map(|(_, n)| n).sum::<u64>(),
        });
        v["tensor_bytes"] = serde_json::json!(ck.nbytes());
        v["per_rank"] = serde_json::json!(found.per_rank);
        v["tied"] = serde_json::json!(found.ties);
        v["checkpoints_in_folder"] = serde_json::json!(found.siblings);
        v["recipe"] = serde_json::json!(found.recipe);
        v["quantization"] = match &found.quantization {
            Some(q) => serde_json::json!({
                "method": "fp8",
                "summary": q.to_string(),
                "weight_block_size": q.block,
                "weights": q.weights,
            }),
            None => serde_json::Value::Null,
        };
        shown(json(out, &v))?;
    } else {
        shown(print_table(out, &ck, &found))?;
    }
    Ok(Outcome::Clean)
}

/// The per-rank entries (tensors and non-tensor) of `ck`, by name.
fn per_rank_entries(ck: &Checkpoint) -> BTreeMap<&str, PerRank> {
    ck.tensors
        .iter()
        .map(|t| t.name.as_str())
        .chain(ck.extras.iter().map(|e| e.name.as_str()))
        .filter_map(|n| classify(n).map(|k| (n, k)))
        .collect()
}

/// ` (kind)` after the name of a per-rank entry, nothing after other names.
fn mark(name: &str) -> String {
    match classify(name) {
        Some(k) => format!("  ({k})"),
        None => String::new(),
    }
}

/// The table: a summary line (files and bytes on disk, then the tensors' own), metadata,
/// one line per tensor, the non-tensor entries, ties and per-rank state.
fn print_table(out: &mut dyn Write, ck: &Checkpoint, found: &Findings) -> io::Result<()> {
    // the files and bytes on disk, as `convert` counts what it writes
    let disk = ck.disk_files();
    writeln!(
        out,
        "{}: {} checkpoint, {} rank(s), {} file(s), {} tensor(s), {} ({} of tensor data)",
        ck.path.display(),
        ck.format,
        ck.ranks,
        disk.len(),
        ck.tensors.len(),
        size(disk.iter().map(|(_, n)| n).sum()),
        size(ck.nbytes())
    )?;
    for (k, v) in &ck.metadata {
        writeln!(out, "  metadata {k} = {}", clip(v, 60))?;
    }
    if let Some(p) = &ck.producer {
        writeln!(out, "  written by {p}")?;
    }
    if !found.siblings.is_empty() {
        writeln!(
            out,
            "  one of {} checkpoints in the folder: {} (read: {}; --step or --tag for another)",
            found.siblings.len(),
            clip(&found.siblings.join(", "), 200),
            ck.tag.as_deref().unwrap_or("?")
        )?;
    }
    if let Some(r) = &found.recipe {
        writeln!(out, "  {r}")?;
    }
    if let Some(q) = &found.quantization {
        writeln!(
            out,
            "  quantized: {q} (--dtype bf16 or f32 dequantizes them)"
        )?;
    }
    print_tensors(out, ck)?;
    if !ck.extras.is_empty() {
        writeln!(out, "NON-TENSOR ENTRIES ({})", ck.extras.len())?;
        for e in &ck.extras {
            let value = clip(&e.value.to_string(), 100);
            writeln!(
                out,
                "  {} [{}] = {value}{}",
                e.name,
                e.origin,
                mark(&e.name)
            )?;
        }
    }
    print_ties(out, ck, &found.ties)?;
    let n = found.per_rank.len();
    if n > 0 {
        writeln!(
            out,
            "{n} per-rank entr{} (state of one rank; not resharded: see --per-rank-state)",
            if n == 1 { "y" } else { "ies" }
        )?;
    }
    Ok(())
}

/// One line per tensor: name, dtype, shape, size and layout.
fn print_tensors(out: &mut dyn Write, ck: &Checkpoint) -> io::Result<()> {
    let w = name_width(ck.tensors.iter().map(|t| t.name.as_str()));
    writeln!(
        out,
        "{:w$}  {:7} {:16} {:>10}  LAYOUT",
        "TENSOR", "DTYPE", "SHAPE", "BYTES"
    )?;
    for t in &ck.tensors {
        writeln!(
            out,
            "{:w$}  {:7} {:16} {:>10}  {}{}",
            t.name,
            t.dtype.name(),
            format!("{:?}", t.shape),
            size(t.nbytes()),
            crate::layout::summary(t),
            mark(&t.name)
        )?;
    }
    Ok(())
}

/// One line per group of tied tensors, saying what outputs do with it.
fn print_ties(out: &mut dyn Write, ck: &Checkpoint, ties: &[Vec<String>]) -> io::Result<()> {
    for g in ties {
        writeln!(
            out,
            "tied: {} (same dtype, shape and bytes){}",
            g.join(" = "),
            tie_note(ck.format)
        )?;
    }
    Ok(())
}

/// How `format` stores a group of tied tensors, and which format would store it once.
fn tie_note(format: Format) -> String {
    let once = Format::all()
        .find(|f| f.capabilities().aliasing == Aliasing::StoresOnce)
        .map(|f| {
            let ext = f
                .capabilities()
                .extensions
                .first()
                .copied()
                .unwrap_or(f.name());
            format!("a .{ext} output stores it once")
        })
        .unwrap_or_default();
    let c = format.capabilities();
    match c.aliasing {
        Aliasing::StoresOnce => String::new(),
        Aliasing::Forbidden => format!(
            "; {} cannot alias, so each name keeps a copy ({once})",
            c.family.name()
        ),
        _ => format!("; {once}"),
    }
}
