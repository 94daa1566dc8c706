//! `reshard verify`: a checkpoint's structure (checked on opening) and the CRC-32s its files
//! record; damage is the command's finding (exit status 1), not an error.

use super::text::{complain, json, shown, size};
use super::Outcome;
use crate::formats::Checkpoint;
use crate::verify::Report;
use crate::Result;
use std::io::{self, Write};
use std::path::Path;

/// Open `path`, check every recorded checksum and print the report to `out`; the first
/// corrupt record is the finding, the others are listed on standard error (table only).
pub fn run(
    path: &Path,
    source: &crate::OpenOptions,
    read: crate::verify::RecordRead,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<Outcome> {
    let ck = Checkpoint::open_with(path, None, source)?;
    let report = crate::verify::checksums_with(&ck, read)?;
    shown(print(out, &ck, &report, as_json))?;
    let Some((first, others)) = report.mismatches.split_first() else {
        return Ok(Outcome::Clean);
    };
    if !as_json {
        // The report first, then the other corrupt records, as on a terminal.
        shown(out.flush())?;
        for m in others {
            complain(&format!("also corrupt: {}", m.to_error()));
        }
    }
    Ok(Outcome::Found(first.to_error().to_string()))
}

/// The report as JSON, or as a line on the structure and one on the checksums.
fn print(out: &mut dyn Write, ck: &Checkpoint, report: &Report, as_json: bool) -> io::Result<()> {
    let tensor_bytes = ck.nbytes();
    if as_json {
        let v = serde_json::json!({
            "path": ck.path, "format": ck.format, "ranks": ck.ranks, "tensors": ck.tensors.len(),
            "tensor_bytes": tensor_bytes, "structure": "ok", "checksums": report,
        });
        return json(out, &v);
    }
    writeln!(
        out,
        "{}: {} checkpoint, {} rank(s), {} tensor(s), {}: structure ok (every tensor covered exactly, pieces within their files)",
        ck.path.display(),
        ck.format,
        ck.ranks,
        ck.tensors.len(),
        size(tensor_bytes)
    )?;
    if report.records == 0 {
        return writeln!(out, "no checksums recorded: data not checked");
    }
    writeln!(
        out,
        "checked {} checksummed record(s), {}: {}",
        report.records,
        size(report.bytes),
        if report.mismatches.is_empty() {
            "all match".to_string()
        } else {
            format!("{} corrupt", report.mismatches.len())
        }
    )
}
