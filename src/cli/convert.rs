//! `reshard convert`: run the conversion, then say what was written.

use super::args::{ConvertFlags, TargetArgs};
use super::text::{clip, shown, size};
use super::Outcome;
use crate::convert::{self, Committed, Job, PartRun};
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
    if let Some((part, from)) = crate::parts::choose(flags.part)? {
        let job = convert::prepare(src, Some(dst), &opts)?;
        let run = convert::run_part(&job, dst, &opts, part)?;
        if !flags.quiet {
            let secs = t0.elapsed().as_secs_f64();
            shown(print_part(out, dst, &job, &run, from, secs))?;
        }
        return Ok(Outcome::Clean);
    }
    let (job, stats) = convert::convert(src, dst, &opts)?;
    if !flags.quiet {
        let secs = t0.elapsed().as_secs_f64();
        shown(print(out, dst, &job, &stats, secs))?;
    }
    Ok(Outcome::Clean)
}

/// What one part wrote (or found written), and what became of the commit.
fn print_part(
    out: &mut dyn Write,
    dst: &Path,
    job: &Job,
    run: &PartRun,
    from: &str,
    secs: f64,
) -> io::Result<()> {
    let from = match from {
        "given" => String::new(),
        who => format!(" (from {who}'s environment)"),
    };
    let n = run.part.count;
    match &run.stats {
        Some(stats) => writeln!(
            out,
            "wrote part {}{from} of {}: {} span(s), {} in {:.2} s ({}/s)",
            run.part,
            dst.display(),
            run.spans.len(),
            size(stats.bytes_written),
            secs,
            size((stats.bytes_written as f64 / secs.max(1e-9)) as u64)
        )?,
        None => writeln!(
            out,
            "part {}{from} of {} was written by an earlier run; nothing to do",
            run.part,
            dst.display()
        )?,
    }
    match &run.committed {
        Some(Committed::Published { checked }) => {
            writeln!(
                out,
                "committed {}: {}, {} rank(s), {} file(s), {} tensor(s); all {n} parts, {} checked against their CRC-32s",
                dst.display(),
                job.format,
                job.world,
                job.output.files.len(),
                job.plan.tensors.len(),
                size(*checked)
            )?;
            print_aborted(out, &run.aborted_uploads)?;
        }
        Some(Committed::Already) => {
            writeln!(out, "{} was committed by another worker", dst.display())?
        }
        Some(Committed::Busy) => writeln!(
            out,
            "every part is written; another worker is committing {}",
            dst.display()
        )?,
        None => {
            let list: Vec<String> = run.missing.iter().take(8).map(|k| k.to_string()).collect();
            let more = run.missing.len().saturating_sub(8);
            writeln!(
                out,
                "waiting for part(s) {}{} of {n}: the worker that finishes last commits {} (or run `reshard commit {}`)",
                list.join(", "),
                if more > 0 { format!(" and {more} more") } else { String::new() },
                dst.display(),
                dst.display()
            )?;
        }
    }
    if let Some(reason) = &job.format_reason {
        writeln!(out, "output format {}: {reason}", job.format)?;
    }
    Ok(())
}

/// `reshard commit`: finish a conversion run in parts.
pub fn commit(
    dst: &Path,
    staging: Option<&Path>,
    force: bool,
    check: bool,
    quiet: bool,
    out: &mut dyn Write,
) -> Result<Outcome> {
    let done = convert::commit_parts(dst, staging, force, check)?;
    if !quiet {
        shown(match done {
            Committed::Published { checked } => writeln!(
                out,
                "committed {}: {} checked against the parts' CRC-32s",
                dst.display(),
                size(checked)
            ),
            Committed::Already | Committed::Busy => {
                writeln!(out, "{} was already committed", dst.display())
            }
        })?;
    }
    Ok(Outcome::Clean)
}

/// The incomplete multipart uploads of killed runs that an upload aborted, if any.
fn print_aborted(out: &mut dyn Write, objects: &[String]) -> io::Result<()> {
    if objects.is_empty() {
        return Ok(());
    }
    writeln!(
        out,
        "aborted the incomplete multipart upload(s) an earlier, killed run left: {}",
        clip(&objects.join(", "), 200)
    )
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
    if let Some(line) = recipe_line(job) {
        writeln!(out, "{line}")?;
    }
    print_aborted(out, &stats.aborted_uploads)?;
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

/// `recipe llama (config.json: model_type=llama): hf -> megatron; hidden=64 (hf: hidden_size), …`
/// for a conversion between frameworks.
pub fn recipe_line(job: &Job) -> Option<String> {
    let a = job.recipe.as_ref()?;
    let params: Vec<String> = a
        .instance
        .params
        .iter()
        .map(|(k, v)| {
            let from = a.instance.origins.get(k).map(String::as_str).unwrap_or("");
            format!("{k}={v} ({from})")
        })
        .collect();
    let mut line = format!("recipe {} ({}): {} -> {}", a.name, a.reason, a.from, a.to);
    if !params.is_empty() {
        line.push_str("; ");
        line.push_str(&params.join(", "));
    }
    for n in &a.notes {
        line.push_str("\nnote: ");
        line.push_str(n);
    }
    Some(line)
}
