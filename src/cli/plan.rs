//! `reshard plan`: what a conversion would read and write, without writing anything.

use super::args::TargetArgs;
use super::text::{clip, json, name_width, shown, size};
use super::Outcome;
use crate::convert::{self, ConvertOptions, Job};
use crate::Result;
use std::io::{self, Write};
use std::path::Path;

/// Plan the conversion of `src` to `target`, written to `dst` when given, and print it to
/// `out` (`ops`: every copy op too). The output format is decided as `convert` decides it
/// ([`convert::prepare`]), refusals included.
pub fn run(
    src: &Path,
    dst: Option<&Path>,
    source: &crate::OpenOptions,
    target: &TargetArgs,
    ops: bool,
    as_json: bool,
    out: &mut dyn Write,
) -> Result<Outcome> {
    let mut opts = target.options(true)?;
    opts.open = source.clone();
    let job = convert::prepare(src, dst, &opts)?;
    shown(print(out, &job, dst, &opts, ops, as_json))?;
    Ok(Outcome::Clean)
}

/// What the plan writes into: `dst` and whether it is one file or a folder, or, without
/// one, the kind of destination it assumes.
fn destination(job: &Job, dst: Option<&Path>) -> String {
    let kind = if job.format.is_dir() {
        "a folder"
    } else {
        "one file"
    };
    match dst {
        Some(d) => format!("{} ({kind})", d.display()),
        None => format!("{kind} (no DST given)"),
    }
}

/// The plan as JSON, or as a summary, a table of tensors and (with `ops`) the copy ops.
fn print(
    out: &mut dyn Write,
    job: &Job,
    dst: Option<&Path>,
    opts: &ConvertOptions,
    ops: bool,
    as_json: bool,
) -> io::Result<()> {
    let threads = opts.exec.threads.unwrap_or_else(rayon::current_num_threads);
    let load = job.thread_balance(threads, opts.exec.window);
    if as_json {
        let v = serde_json::json!({
            "source": {"path": job.source.path, "format": job.source.format, "ranks": job.source.ranks, "files": job.source.file_names()},
            "recipe": job.recipe.as_ref().map(|a| serde_json::json!({"name": a.name, "reason": a.reason, "from": a.from, "to": a.to, "params": a.instance.params, "origins": a.instance.origins})),
            "target": {"path": dst, "container": job.format.capabilities().container, "format": job.format, "format_reason": job.format_reason, "ranks": job.world,
                       "files": job.output.files.iter().map(|f| serde_json::json!({"path": f.path, "size": f.size})).collect::<Vec<_>>()},
            "bytes_read": job.plan.bytes_read(),
            "bytes_written": job.plan.bytes_written(),
            "thread_balance": load,
            "plan": job.plan,
        });
        return json(out, &v);
    }
    print_summary(out, job, dst, threads, &load)?;
    print_tensors(out, job)?;
    if ops {
        print_ops(out, job)?;
    }
    Ok(())
}

/// Formats and ranks, the destination, bytes read and written, the per-thread balance and
/// the output files.
fn print_summary(
    out: &mut dyn Write,
    job: &Job,
    dst: Option<&Path>,
    threads: usize,
    load: &[u64],
) -> io::Result<()> {
    let p = &job.plan;
    writeln!(
        out,
        "plan: {} ({} rank(s)) -> {} ({} rank(s)); output format {}: {}",
        job.source.format,
        job.source.ranks,
        job.format,
        job.world,
        job.format,
        job.format_reason.as_deref().unwrap_or("as asked")
    )?;
    writeln!(out, "into {}", destination(job, dst))?;
    if let Some(line) = super::convert::recipe_line(job) {
        writeln!(out, "{line}")?;
    }
    writeln!(
        out,
        "{} tensor(s), {} op(s); read {} from {} of {} file(s); write {} into {} file(s)",
        p.tensors.len(),
        p.ops.len(),
        size(p.bytes_read()),
        p.src_files().len(),
        job.source.files.len(),
        size(job.output.files.iter().map(|f| f.size).sum()),
        job.output.files.len()
    )?;
    let load: Vec<String> = load.iter().map(|b| size(*b)).collect();
    writeln!(
        out,
        "per-thread balance ({threads} thread(s)): {}",
        load.join(" / ")
    )?;
    for f in &job.output.files {
        writeln!(out, "  -> {} ({})", f.path.display(), size(f.size))?;
    }
    Ok(())
}

/// One line per tensor: dtypes (a cast as `from->to`), shape, pieces before and after, ops
/// and bytes written.
fn print_tensors(out: &mut dyn Write, job: &Job) -> io::Result<()> {
    let p = &job.plan;
    let w = name_width(p.tensors.iter().map(|t| t.name.as_str()));
    writeln!(
        out,
        "{:w$}  {:11} {:16} {:>13} {:>5} {:>10}",
        "TENSOR", "DTYPE", "SHAPE", "PIECES", "OPS", "BYTES"
    )?;
    for t in &p.tensors {
        let dt = if t.dtype.0 == t.dtype.1 {
            t.dtype.0.name().to_string()
        } else {
            format!("{}->{}", t.dtype.0, t.dtype.1)
        };
        writeln!(
            out,
            "{:w$}  {:11} {:16} {:>13} {:>5} {:>10}",
            t.name,
            dt,
            format!("{:?}", t.shape),
            format!("{} -> {}", t.pieces.0, t.pieces.1),
            t.ops,
            size(t.bytes.1)
        )?;
        if let Some(v) = &t.view {
            writeln!(out, "{:w$}    = {}", "", clip(&v.to_string(), 300))?;
        }
    }
    let fills = p.bytes_filled();
    if fills > 0 {
        writeln!(
            out,
            "{} fill op(s), {} of padding",
            p.fills.len(),
            size(fills)
        )?;
    }
    Ok(())
}

/// Every copy op: source and destination file and offset, run length and count, strides,
/// cast.
fn print_ops(out: &mut dyn Write, job: &Job) -> io::Result<()> {
    writeln!(
        out,
        "OPS (src file:offset -> dst file:offset, bytes x rows, strides)"
    )?;
    let names = job.source.file_names();
    for o in &job.plan.ops {
        writeln!(
            out,
            "  {}:{} -> {}:{}  {} x {}  ({}, {}){}",
            names[o.src as usize].display(),
            o.src_offset,
            job.output.files[o.dst as usize].path.display(),
            o.dst_offset,
            o.len,
            o.count,
            o.src_stride,
            o.dst_stride,
            o.cast
                .map(|c| format!(" cast {}->{}", c.from, c.to))
                .unwrap_or_default()
        )?;
    }
    Ok(())
}
