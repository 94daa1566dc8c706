//! `reshard convert`: run the conversion, then say what was written.

use super::args::{ConvertFlags, TargetArgs};
use super::text::{clip, shown, size};
use super::Outcome;
use crate::convert::{self, Job};
use crate::per_rank::Policy;
use crate::ExecStats;
use crate::Result;
use std::io::{self, Write};
use std::path::Path;
use std::time::Instant;

/// Convert `src` to `target`, writing `dst`, and report it to `out` unless quiet.
pub fn run(
    src: &Path,
    dst: &Path,
    source: &crate::OpenOptions,
    target: &TargetArgs,
    flags: &ConvertFlags,
    out: &mut dyn Write,
) -> Result<Outcome> {
    let mut opts = flags.options(target)?;
    opts.open = source.clone();
    let t0 = Instant::now();
    let (job, stats) = convert::convert(src, dst, &opts)?;
    if !flags.quiet {
        let secs = t0.elapsed().as_secs_f64();
        shown(print(out, dst, &job, &stats, secs))?;
    }
    Ok(Outcome::Clean)
}

/// What was written, in `secs` seconds; what was left out, tied or kept beside the tensors.
fn print(
    out: &mut dyn Write,
    dst: &Path,
    job: &Job,
    stats: &ExecStats,
    secs: f64,
) -> io::Result<()> {
    writeln!(
        out,
        "wrote {}: {}, {} rank(s), {} file(s), {} tensor(s), {} in {:.2} s ({}/s)",
        dst.display(),
        job.format,
        job.world,
        job.output.files.len(),
        job.plan.tensors.len(),
        size(stats.bytes_written),
        secs,
        size((stats.bytes_written as f64 / secs.max(1e-9)) as u64)
    )?;
    if let Some(reason) = &job.format_reason {
        writeln!(out, "output format {}: {reason}", job.format)?;
    }
    if !job.dropped.is_empty() {
        writeln!(
            out,
            "left out {} per-rank entr{} ({}): {}",
            job.dropped.len(),
            if job.dropped.len() == 1 { "y" } else { "ies" },
            match job.per_rank {
                Policy::Drop => "--per-rank-state drop",
                _ => "kept rank 0's",
            },
            clip(&job.dropped.join(", "), 200)
        )?;
    }
    for g in &job.ties {
        writeln!(out, "tied: {} (stored once)", g.join(" = "))?;
    }
    if job.extras > 0 {
        print_extras(out, job)?;
    }
    Ok(())
}

/// How the non-tensor entries were kept.
fn print_extras(out: &mut dyn Write, job: &Job) -> io::Result<()> {
    let n = job.extras;
    let entries = if n == 1 { "entry" } else { "entries" };
    let how = job.format.capabilities().extras_kept;
    writeln!(out, "kept {n} non-tensor {entries} {how}")
}
