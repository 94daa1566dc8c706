//! `reshard`: the command-line face of the library. Parsing and printing only; every decision
//! is made in the library.

#[path = "progress_bar.rs"]
mod progress_bar;

use clap::{Args, Parser, Subcommand};
use reshard::convert::{self, ConvertOptions, Job, Selection};
use reshard::exec::{balance, ExecOptions};
use reshard::formats::{Checkpoint, Format, WriteOptions};
use reshard::layout::{DType, Region, TensorLayout};
use reshard::per_rank::{classify, PerRank};
use reshard::target::LayoutSpec;
use reshard::{Error, Result};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "reshard",
    version,
    about = "Move distributed-training checkpoints between world sizes: offline, in bounded memory, at the speed of the disk."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show a checkpoint's format, ranks, tensors and layouts.
    #[command(
        after_help = "Examples:\n  reshard inspect ckpt/\n  reshard inspect model.safetensors --json"
    )]
    Inspect {
        /// Checkpoint file or directory.
        path: PathBuf,
        /// Print JSON (every piece of every tensor) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Dry run: show what a conversion would read and write, without writing anything.
    #[command(
        after_help = "Examples:\n  reshard plan ckpt/ --to 1\n  reshard plan ckpt/ --to 8 --ops\n  reshard plan ckpt/ --layout tp.json --json"
    )]
    Plan {
        /// Source checkpoint.
        src: PathBuf,
        #[command(flatten)]
        target: TargetArgs,
        /// Also list every copy op.
        #[arg(long)]
        ops: bool,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Reshard SRC to M ranks (M = 1 consolidates) and write DST atomically.
    #[command(
        after_help = "Examples:\n  reshard convert ckpt/ model.safetensors --to 1\n  reshard convert ckpt/ out/ --to 2\n  reshard convert ckpt/ hf/ --to 1 --format hf --max-shard-size 2GB\n  reshard convert ckpt/ out/ --to 8 --exclude 'optimizer.*' --dtype bf16\n\nThe output format follows DST: a .safetensors file for M = 1, a Hugging Face sharded\ndirectory (model.safetensors.index.json) for M = 1 otherwise, and per-rank shards\n(shard-0000R-model-…safetensors with DCP_SHARDING_INFO) for M > 1."
    )]
    Convert {
        /// Source checkpoint.
        src: PathBuf,
        /// Destination file or directory (must not exist unless --force).
        dst: PathBuf,
        #[command(flatten)]
        target: TargetArgs,
        /// Replace DST if it exists (only once the new output is complete).
        #[arg(long)]
        force: bool,
        /// Print nothing but errors.
        #[arg(short, long)]
        quiet: bool,
        /// Skip fsync before the final rename: faster, still atomic against a crash of
        /// reshard, but a power loss may leave a renamed output whose data never reached disk.
        #[arg(long)]
        no_fsync: bool,
        /// Skip checking the CRC-32s the sources record (torch.save records, reshard's
        /// safetensors checksums) for the bytes the conversion reads.
        #[arg(long)]
        no_verify: bool,
    },
    /// Check a checkpoint: structure (every tensor covered exactly, no conflicting overlaps,
    /// shapes and sizes agree with the files) and the CRC-32s its files record.
    #[command(after_help = "Examples:\n  reshard verify ckpt/\n  reshard verify model.pt --json")]
    Verify {
        /// Checkpoint file or directory.
        path: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Compare two checkpoints tensor by tensor, in any supported formats and layouts; exit
    /// status 1 when they differ.
    #[command(
        after_help = "Examples:\n  reshard diff ckpt/ model.safetensors\n  reshard diff a.pt b/ --json\n\nTensors of one dtype are compared byte for byte; floating tensors of different dtypes\nreport the largest absolute and relative differences."
    )]
    Diff {
        /// First checkpoint.
        a: PathBuf,
        /// Second checkpoint.
        b: PathBuf,
        /// Print the comparison as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct TargetArgs {
    /// Target world size M (default layout: Shard(0) over M ranks, as FSDP2).
    #[arg(long, value_name = "M")]
    to: Option<u64>,
    /// Target layout file (JSON: mesh and per-name-glob placements); see the README.
    #[arg(long, value_name = "FILE")]
    layout: Option<PathBuf>,
    /// Output format: safetensors, hf or hf-storage (default: from DST and M).
    #[arg(long)]
    format: Option<Format>,
    /// Keep only tensors whose name matches this glob (repeatable; `*` crosses dots).
    #[arg(long, value_name = "GLOB")]
    include: Vec<String>,
    /// Drop tensors whose name matches this glob (repeatable).
    #[arg(long, value_name = "GLOB")]
    exclude: Vec<String>,
    /// Remove this prefix from names that start with it (e.g. `model.`).
    #[arg(long, value_name = "PREFIX")]
    strip_prefix: Option<String>,
    /// Put this prefix in front of every name.
    #[arg(long, value_name = "PREFIX")]
    add_prefix: Option<String>,
    /// Cast floating tensors (f16, bf16, f32, f64) to this dtype.
    #[arg(long, value_name = "DTYPE")]
    dtype: Option<DType>,
    /// Largest data file of an hf output (e.g. 5GB, 500MiB).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "5GB")]
    max_shard_size: u64,
    /// Worker threads (default: one per core).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Per-rank state (RNG states, data-loader positions; `inspect` marks it): drop it, keep
    /// rank 0's, or keep every rank's. Default: rank 0's for --to 1, all of it when M equals
    /// the source's world size, otherwise an error asking for a choice.
    #[arg(long, value_name = "drop|rank0|keep")]
    per_rank_state: Option<reshard::per_rank::Policy>,
    /// Store tied tensors (two names, same dtype, shape and bytes) once per name in a .pt
    /// too, instead of sharing one storage as torch.save of a tied model does.
    #[arg(long)]
    untie: bool,
}

fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad size `{s}`"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "tb" | "t" => 1e12,
        "kib" => 1024.0,
        "mib" => 1048576.0,
        "gib" => 1073741824.0,
        "tib" => 1099511627776.0,
        _ => {
            return Err(format!(
                "bad size unit in `{s}` (use B, KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let v = n * mult;
    if v < 1.0 {
        return Err(format!("size `{s}` must be at least 1 byte"));
    }
    Ok(v as u64)
}

impl TargetArgs {
    fn options(&self, quiet: bool) -> Result<ConvertOptions> {
        let layout = match (&self.layout, self.to) {
            (Some(p), to) => {
                let spec = LayoutSpec::from_file(p)?;
                if let Some(m) = to {
                    if m != spec.world() {
                        return Err(Error::usage(format!(
                            "--to {m} disagrees with the layout file's mesh {:?} ({} ranks)",
                            spec.mesh,
                            spec.world()
                        )));
                    }
                }
                spec
            }
            (None, Some(0)) => return Err(Error::usage("--to must be at least 1")),
            (None, Some(m)) => LayoutSpec::fsdp(m),
            (None, None) => {
                return Err(Error::usage(
                    "give the target world size with --to M (or a --layout file)",
                ))
            }
        };
        Ok(ConvertOptions {
            layout,
            format: self.format,
            select: Selection {
                include: self.include.clone(),
                exclude: self.exclude.clone(),
                strip_prefix: self.strip_prefix.clone(),
                add_prefix: self.add_prefix.clone(),
            },
            dtype: self.dtype,
            write: WriteOptions {
                max_shard_size: self.max_shard_size,
                ..Default::default()
            },
            exec: ExecOptions {
                threads: self.threads,
                progress: (!quiet && std::io::stderr().is_terminal())
                    .then(|| std::sync::Arc::new(progress_bar::Bar::new()) as _),
                // RESHARD_WINDOW (bytes): the work-unit size, for the executor measurements
                // in BENCHMARKS.md; not a user setting.
                window: std::env::var("RESHARD_WINDOW")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(ExecOptions::default().window),
                ..Default::default()
            },
            force: false,
            per_rank: self.per_rank_state,
            untie: self.untie,
            verify: true,
        })
    }
}

/// Width of a name column: the longest name, at least 6.
fn name_width<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names.map(str::len).max().unwrap_or(6).max(6)
}

/// `s` cut to `n` characters, with an ellipsis when cut.
fn clip(s: &str, n: usize) -> String {
    if s.chars().count() > n {
        format!("{}…", s.chars().take(n).collect::<String>())
    } else {
        s.to_string()
    }
}

fn human(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// A short description of how a tensor is laid out over ranks.
fn describe(t: &TensorLayout) -> String {
    let distinct = reshard::layout::distinct_regions(t.pieces.iter().map(|p| &p.region));
    let ranks = t.ranks().len();
    if distinct.len() <= 1 {
        let holders = t.pieces.iter().filter(|p| !p.region.is_empty()).count();
        return match holders {
            0 => "empty".into(),
            1 => format!("whole on rank {}", t.ranks().first().copied().unwrap_or(0)),
            n => format!("replicated on {n} ranks"),
        };
    }
    let full = Region::full(&t.shape);
    let split: Vec<usize> = (0..t.shape.len())
        .filter(|&d| distinct.iter().any(|r| r.sizes[d] != full.sizes[d]))
        .collect();
    let mut starts: Vec<(u64, u64)> = distinct
        .iter()
        .map(|r| {
            let d = split.first().copied().unwrap_or(0);
            (r.offsets[d], r.end(d))
        })
        .collect();
    starts.sort_unstable();
    match split.as_slice() {
        [d] => format!(
            "{} chunks on {ranks} ranks along dim {d}: {}",
            distinct.len(),
            starts
                .iter()
                .map(|(a, b)| format!("{a}:{b}"))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        dims => format!(
            "{} boxes on {ranks} ranks, split along dims {dims:?}",
            distinct.len()
        ),
    }
}

/// The per-rank entries (tensors and non-tensor) of `ck`, by name.
fn per_rank_entries(ck: &Checkpoint) -> std::collections::BTreeMap<&str, PerRank> {
    ck.tensors
        .iter()
        .map(|t| t.name.as_str())
        .chain(ck.extras.iter().map(|e| e.name.as_str()))
        .filter_map(|n| classify(n).map(|k| (n, k)))
        .collect()
}

/// Groups of tied tensor names of `ck`.
fn tie_names(ck: &Checkpoint) -> Result<Vec<Vec<String>>> {
    let all: Vec<&TensorLayout> = ck.tensors.iter().collect();
    Ok(reshard::ties::find(&ck.files, &all)?
        .into_iter()
        .map(|g| g.into_iter().map(|i| all[i].name.clone()).collect())
        .collect())
}

fn inspect(path: &std::path::Path, json: bool) -> Result<()> {
    let ck = Checkpoint::open(path)?;
    let mut out = std::io::stdout().lock();
    if json {
        let mut v = serde_json::to_value(&ck).map_err(|e| Error::usage(e.to_string()))?;
        v["per_rank"] = serde_json::json!(per_rank_entries(&ck));
        v["tied"] = serde_json::json!(tie_names(&ck)?);
        serde_json::to_writer_pretty(&mut out, &v).map_err(|e| Error::usage(e.to_string()))?;
        let _ = writeln!(out);
        return Ok(());
    }
    let _ = writeln!(
        out,
        "{}: {} checkpoint, {} rank(s), {} file(s), {} tensor(s), {}",
        ck.path.display(),
        ck.format,
        ck.ranks,
        ck.files.len(),
        ck.tensors.len(),
        human(ck.nbytes())
    );
    for (k, v) in &ck.metadata {
        let _ = writeln!(out, "  metadata {k} = {}", clip(v, 60));
    }
    if let Some(p) = &ck.producer {
        let _ = writeln!(out, "  written by {p}");
    }
    let w = name_width(ck.tensors.iter().map(|t| t.name.as_str()));
    let _ = writeln!(
        out,
        "{:w$}  {:7} {:16} {:>10}  LAYOUT",
        "TENSOR", "DTYPE", "SHAPE", "BYTES"
    );
    let mark = |name: &str| match classify(name) {
        Some(k) => format!("  ({k})"),
        None => String::new(),
    };
    for t in &ck.tensors {
        let _ = writeln!(
            out,
            "{:w$}  {:7} {:16} {:>10}  {}{}",
            t.name,
            t.dtype.name(),
            format!("{:?}", t.shape),
            human(t.nbytes()),
            describe(t),
            mark(&t.name)
        );
    }
    if !ck.extras.is_empty() {
        let _ = writeln!(out, "NON-TENSOR ENTRIES ({})", ck.extras.len());
        for e in &ck.extras {
            let _ = writeln!(
                out,
                "  {} [{}] = {}{}",
                e.name,
                e.origin,
                clip(&e.value.to_string(), 100),
                mark(&e.name)
            );
        }
    }
    let ties = tie_names(&ck)?;
    for g in &ties {
        let _ = writeln!(
            out,
            "tied: {} (same dtype, shape and bytes){}",
            g.join(" = "),
            if ck.format == Format::Safetensors
                || ck.format == Format::Hf
                || ck.format == Format::HfStorage
            {
                "; safetensors cannot alias, so each name keeps a copy (a .pt output stores it once)"
            } else if ck.format == Format::Pt {
                ""
            } else {
                "; a .pt output stores it once"
            }
        );
    }
    let per_rank = per_rank_entries(&ck);
    if !per_rank.is_empty() {
        let _ = writeln!(
            out,
            "{} per-rank entr{} (state of one rank; not resharded: see --per-rank-state)",
            per_rank.len(),
            if per_rank.len() == 1 { "y" } else { "ies" }
        );
    }
    Ok(())
}

fn print_plan(job: &Job, opts: &ConvertOptions, ops: bool, json: bool) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let threads = opts.exec.threads.unwrap_or_else(rayon::current_num_threads);
    let load = balance(&job.plan, &job.output.files, threads, opts.exec.window);
    if json {
        let v = serde_json::json!({
            "source": {"path": job.source.path, "format": job.source.format, "ranks": job.source.ranks, "files": job.source.files},
            "target": {"format": job.format, "ranks": job.world,
                       "files": job.output.files.iter().map(|f| serde_json::json!({"path": f.path, "size": f.size})).collect::<Vec<_>>()},
            "bytes_read": job.plan.bytes_read(),
            "bytes_written": job.plan.bytes_written(),
            "thread_balance": load,
            "plan": job.plan,
        });
        serde_json::to_writer_pretty(&mut out, &v).map_err(|e| Error::usage(e.to_string()))?;
        let _ = writeln!(out);
        return Ok(());
    }
    let p = &job.plan;
    let _ = writeln!(
        out,
        "plan: {} ({} rank(s)) -> {} ({} rank(s))",
        job.source.format, job.source.ranks, job.format, job.world
    );
    let _ = writeln!(
        out,
        "{} tensor(s), {} op(s); read {} from {} of {} file(s); write {} into {} file(s)",
        p.tensors.len(),
        p.ops.len(),
        human(p.bytes_read()),
        p.src_files().len(),
        job.source.files.len(),
        human(job.output.files.iter().map(|f| f.size).sum()),
        job.output.files.len()
    );
    let _ = writeln!(
        out,
        "per-thread balance ({threads} thread(s)): {}",
        load.iter()
            .map(|b| human(*b))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    for f in &job.output.files {
        let _ = writeln!(out, "  -> {} ({})", f.path.display(), human(f.size));
    }
    let w = name_width(p.tensors.iter().map(|t| t.name.as_str()));
    let _ = writeln!(
        out,
        "{:w$}  {:11} {:16} {:>13} {:>5} {:>10}",
        "TENSOR", "DTYPE", "SHAPE", "PIECES", "OPS", "BYTES"
    );
    for t in &p.tensors {
        let dt = if t.dtype.0 == t.dtype.1 {
            t.dtype.0.name().to_string()
        } else {
            format!("{}->{}", t.dtype.0, t.dtype.1)
        };
        let _ = writeln!(
            out,
            "{:w$}  {:11} {:16} {:>13} {:>5} {:>10}",
            t.name,
            dt,
            format!("{:?}", t.shape),
            format!("{} -> {}", t.pieces.0, t.pieces.1),
            t.ops,
            human(t.bytes.1)
        );
    }
    if ops {
        let _ = writeln!(
            out,
            "OPS (src file:offset -> dst file:offset, bytes x rows, strides)"
        );
        for o in &p.ops {
            let _ = writeln!(
                out,
                "  {}:{} -> {}:{}  {} x {}  ({}, {}){}",
                job.source.files[o.src as usize].display(),
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
            );
        }
    }
    Ok(())
}

/// `reshard verify`: open (structure) and check every recorded checksum; an error when any
/// record is corrupt.
fn verify(path: &std::path::Path, json: bool) -> Result<()> {
    let ck = Checkpoint::open(path)?;
    let report = reshard::verify::checksums(&ck)?;
    let tensor_bytes = ck.nbytes();
    if json {
        let v = serde_json::json!({
            "path": ck.path, "format": ck.format, "ranks": ck.ranks, "tensors": ck.tensors.len(),
            "tensor_bytes": tensor_bytes, "structure": "ok", "checksums": report,
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::usage(e.to_string()))?
        );
    } else {
        println!(
            "{}: {} checkpoint, {} rank(s), {} tensor(s), {}: structure ok (every tensor covered exactly, pieces within their files)",
            ck.path.display(),
            ck.format,
            ck.ranks,
            ck.tensors.len(),
            human(tensor_bytes)
        );
        if report.records == 0 {
            println!("no checksums recorded: data not checked");
        } else {
            println!(
                "checked {} checksummed record(s), {}: {}",
                report.records,
                human(report.bytes),
                if report.mismatches.is_empty() {
                    "all match".to_string()
                } else {
                    format!("{} corrupt", report.mismatches.len())
                }
            );
        }
    }
    match report.mismatches.first() {
        None => Ok(()),
        Some(m) => {
            if !json {
                for m in report.mismatches.iter().skip(1) {
                    eprintln!("reshard: also corrupt: {}", m.to_error());
                }
            }
            Err(m.to_error())
        }
    }
}

/// `reshard diff`: print what differs; an error (exit 1) when anything does.
fn diff(a: &std::path::Path, b: &std::path::Path, json: bool) -> Result<()> {
    use reshard::diff::Difference as D;
    let ca = Checkpoint::open(a)?;
    let cb = Checkpoint::open(b)?;
    let d = reshard::diff::diff(&ca, &cb)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&d).map_err(|e| Error::usage(e.to_string()))?
        );
    } else {
        for (name, x) in &d.differences {
            let what = match x {
                D::OnlyInA => format!("only in {}", a.display()),
                D::OnlyInB => format!("only in {}", b.display()),
                D::Shape { a, b } => format!("shape {a:?} vs {b:?}"),
                D::DType { a, b } => format!("dtype {a} vs {b}"),
                D::Bytes { elements, first } => {
                    format!("{elements} element(s) differ, the first at flat index {first}")
                }
                D::Values { a, b, max_abs, max_rel } => format!(
                    "dtype {a} vs {b}: max abs difference {max_abs:e}, max rel difference {max_rel:e}"
                ),
                D::Value { a, b } => format!(
                    "value {} vs {}",
                    clip(&a.to_string(), 60),
                    clip(&b.to_string(), 60)
                ),
            };
            println!("{name}: {what}");
        }
        println!(
            "compared {} tensor(s) and {} non-tensor entr{}: {}",
            d.tensors,
            d.entries,
            if d.entries == 1 { "y" } else { "ies" },
            if d.is_equal() {
                "identical".to_string()
            } else {
                format!("{} difference(s)", d.differences.len())
            }
        );
    }
    if d.is_equal() {
        Ok(())
    } else {
        Err(Error::usage(format!(
            "{} and {} differ ({} difference(s))",
            a.display(),
            b.display(),
            d.differences.len()
        )))
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Verify { path, json } => verify(&path, json),
        Cmd::Diff { a, b, json } => diff(&a, &b, json),
        Cmd::Inspect { path, json } => inspect(&path, json),
        Cmd::Plan {
            src,
            target,
            ops,
            json,
        } => {
            let opts = target.options(true)?;
            let job = convert::prepare(&src, None, &opts)?;
            print_plan(&job, &opts, ops, json)
        }
        Cmd::Convert {
            src,
            dst,
            target,
            force,
            quiet,
            no_fsync,
            no_verify,
        } => {
            let mut opts = target.options(quiet)?;
            opts.force = force;
            opts.exec.sync = !no_fsync;
            opts.verify = !no_verify;
            let t0 = Instant::now();
            let (job, stats) = convert::convert(&src, &dst, &opts)?;
            if !quiet {
                let secs = t0.elapsed().as_secs_f64();
                println!(
                    "wrote {}: {}, {} rank(s), {} file(s), {} tensor(s), {} in {:.2} s ({}/s)",
                    dst.display(),
                    job.format,
                    job.world,
                    job.output.files.len(),
                    job.plan.tensors.len(),
                    human(stats.bytes_written),
                    secs,
                    human((stats.bytes_written as f64 / secs.max(1e-9)) as u64)
                );
                if !job.dropped.is_empty() {
                    println!(
                        "left out {} per-rank entr{} ({}): {}",
                        job.dropped.len(),
                        if job.dropped.len() == 1 { "y" } else { "ies" },
                        match job.per_rank {
                            reshard::per_rank::Policy::Drop => "--per-rank-state drop",
                            _ => "kept rank 0's",
                        },
                        clip(&job.dropped.join(", "), 200)
                    );
                }
                for g in &job.ties {
                    println!("tied: {} (stored once)", g.join(" = "));
                }
                if job.extras > 0 {
                    let n = job.extras;
                    let entries = if n == 1 { "entry" } else { "entries" };
                    if job.format == Format::Pt {
                        println!("kept {n} non-tensor {entries} as Python values");
                    } else if job.format == Format::Dcp {
                        println!("kept {n} non-tensor {entries} as BYTE_IO items (Lightning's meta.pt keys in meta.pt)");
                    } else {
                        println!(
                            "kept {n} non-tensor {entries} as JSON in the safetensors __metadata__ key `{}`",
                            convert::EXTRAS_KEY
                        );
                    }
                }
            }
            Ok(())
        }
    }
}

fn main() {
    // A file over `ulimit -f` must fail its write with EFBIG (reported, staging removed), not
    // kill the process with SIGXFSZ.
    // SAFETY: setting a signal's disposition to SIG_IGN before any thread starts.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let cli = Cli::parse();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(|| run(cli));
    let msg = match result {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            format!(
                "internal error: {} (please report it)",
                what.unwrap_or_default()
            )
        }
    };
    eprintln!("reshard: error: {}", msg.replace('\n', " "));
    std::process::exit(1);
}
