//! The command line as clap sees it (subcommands, their arguments and help texts), and the
//! translation of target arguments into the library's [`ConvertOptions`].

use crate::convert::{ConvertOptions, Selection};
use crate::formats::{Format, WriteOptions};
use crate::layout::DType;
use crate::target::LayoutSpec;
use crate::ExecOptions;
use crate::{Error, Result};
use bytesize::ByteSize;
use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;

/// The command line.
#[derive(Parser)]
#[command(
    name = "reshard",
    version,
    about = "Move distributed-training checkpoints between world sizes: offline, in bounded memory, at the speed of the disk.",
    after_help = "Checkpoints may be object-store URLs (s3://bucket/prefix, gs://, az://, https://), read with ranged requests and written with multipart uploads; credentials come from the usual environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL, ...).\n\nExit status: 0 when all is well, 1 when `diff` finds a difference or `verify` a corrupt record, 2 on any error."
)]
pub struct Cli {
    /// The command to run.
    #[command(subcommand)]
    pub cmd: Cmd,
    /// Send `s3://` requests to this S3-compatible server (MinIO, Ceph, a local test server)
    /// instead of AWS; default: the `AWS_ENDPOINT_URL` environment variable.
    #[arg(long, global = true, value_name = "URL")]
    pub endpoint_url: Option<String>,
}

/// The subcommands; each variant's doc comment is its `--help` summary.
#[derive(Subcommand)]
pub enum Cmd {
    /// Show a checkpoint's format, ranks, tensors and layouts.
    #[command(
        after_help = "Examples:\n  reshard inspect ckpt/\n  reshard inspect model.safetensors --json"
    )]
    Inspect {
        /// Checkpoint file or directory.
        path: PathBuf,
        #[command(flatten)]
        source: SourceArgs,
        /// Print JSON (every piece of every tensor) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Dry run: show what a conversion would read and write, without writing anything.
    #[command(
        after_help = "Examples:\n  reshard plan ckpt/ model.safetensors --to 1\n  reshard plan ckpt/ --to 8 --ops\n  reshard plan ckpt/ out/ --layout tp.json --json\n\nThe output format is chosen as `convert` chooses it for the same DST; without DST, as for a\nfolder (or a name without an extension)."
    )]
    Plan {
        /// Source checkpoint.
        src: PathBuf,
        /// The destination `convert` would write (optional: it guides the output format, and
        /// a name that says another output is refused as `convert` refuses it).
        dst: Option<PathBuf>,
        #[command(flatten)]
        source: SourceArgs,
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
        after_help = convert_help()
    )]
    Convert {
        /// Source checkpoint.
        src: PathBuf,
        /// Destination file or directory (must not exist unless --force).
        dst: PathBuf,
        #[command(flatten)]
        source: SourceArgs,
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        flags: ConvertFlags,
    },
    /// Finish a conversion run in parts (`convert --part K/N`): check that every part is
    /// written, by the same job, and that its bytes match their CRC-32s, then make DST appear
    /// atomically. The worker that finishes last does this itself; run it when that worker
    /// failed, or to learn which parts are missing.
    #[command(
        after_help = "Examples:\n  reshard commit out/\n  reshard commit model.safetensors --force"
    )]
    Commit {
        /// The destination the parts were written for.
        dst: PathBuf,
        /// Replace DST if it exists.
        #[arg(long)]
        force: bool,
        /// Skip reading the parts' bytes back to check their CRC-32s.
        #[arg(long)]
        no_verify: bool,
        /// For an object-store URL DST: the staging folder the parts met in (default:
        /// RESHARD_STAGING).
        #[arg(long, value_name = "DIR")]
        staging: Option<PathBuf>,
        /// Print nothing but errors.
        #[arg(short, long)]
        quiet: bool,
    },
    /// Check a checkpoint: structure (every tensor covered exactly, no conflicting overlaps,
    /// shapes and sizes agree with the files) and the CRC-32s its files record; exit status 1
    /// when a record is corrupt.
    #[command(after_help = "Examples:\n  reshard verify ckpt/\n  reshard verify model.pt --json")]
    Verify {
        /// Checkpoint file or directory.
        path: PathBuf,
        #[command(flatten)]
        source: SourceArgs,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// How records are read: pread (default) or mmap. For measurements.
        #[arg(long, hide = true, env = "RESHARD_VERIFY_READ", value_name = "HOW")]
        read: Option<crate::verify::RecordRead>,
    },
    /// Compare two checkpoints tensor by tensor, in any supported formats and layouts; exit
    /// status 1 when they differ, 2 when one cannot be read.
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

/// Which checkpoint to read in a folder of several, and which copy of its weights.
#[derive(Args)]
pub struct SourceArgs {
    /// The checkpoint in this sub-folder of the path (a DeepSpeed tag such as global_step100;
    /// default: the one DeepSpeed's `latest` file names, the iteration Megatron-LM's
    /// latest_checkpointed_iteration.txt names, the newest step folder).
    #[arg(long, value_name = "TAG", conflicts_with = "step")]
    tag: Option<String>,
    /// The step folder `step-N` of a folder of them (torchtitan; default: the newest), or the
    /// iteration folder `iter_000000N` of a Megatron-LM save directory.
    #[arg(long, value_name = "N")]
    step: Option<u64>,
    /// DeepSpeed: where parameter values come from: the fp32 master weights of the optim
    /// files (master, the default, as zero_to_fp32) or the model-dtype weights of the model
    /// states file (model; ZeRO stages 1 and 2).
    #[arg(long, value_name = "master|model")]
    weights: Option<crate::Weights>,
}

impl SourceArgs {
    /// The library's open options.
    pub fn options(&self) -> crate::OpenOptions {
        crate::OpenOptions {
            tag: self.tag.clone(),
            step: self.step,
            weights: self.weights,
        }
    }
}

/// The switches of `convert` beyond its target.
#[derive(Args)]
pub struct ConvertFlags {
    /// Replace DST if it exists (only once the new output is complete).
    #[arg(long)]
    force: bool,
    /// Print nothing but errors.
    #[arg(short, long)]
    pub quiet: bool,
    /// Skip fsync before the final rename: faster, still atomic against a crash of
    /// reshard, but a power loss may leave a renamed output whose data never reached disk.
    #[arg(long)]
    no_fsync: bool,
    /// Skip checking the CRC-32s the sources record (torch.save records, reshard's
    /// safetensors checksums) for the bytes the conversion reads.
    #[arg(long)]
    no_verify: bool,
    /// Run only part K of N of the conversion (0 <= K < N, numbered as ranks are), beside
    /// workers running the other parts of the same command; the last to finish makes DST
    /// appear (or `reshard commit DST`). Default: from the launcher's environment — torchrun
    /// (RANK, WORLD_SIZE), Slurm tasks (SLURM_PROCID, SLURM_NTASKS), Slurm array jobs
    /// (SLURM_ARRAY_TASK_*), Kubernetes indexed jobs (JOB_COMPLETION_INDEX, with N in
    /// RESHARD_PARTS). --part 0/1 runs the whole conversion in this process.
    #[arg(long, value_name = "K/N")]
    pub part: Option<crate::parts::Part>,
    /// Where the parts of a conversion to an object-store URL meet: a folder every worker
    /// sees; the worker that commits uploads the output from there (default: RESHARD_STAGING).
    #[arg(long, value_name = "DIR")]
    pub staging: Option<PathBuf>,
    /// Converting to an object-store URL: bytes of each multipart upload's part (at least
    /// 5 MiB). For measurements and tests.
    #[arg(long, hide = true, env = "RESHARD_UPLOAD_CHUNK", value_name = "BYTES")]
    upload_chunk: Option<u64>,
    /// Converting to an object-store URL: bytes written to scratch before their parts are
    /// sent. For measurements and tests.
    #[arg(long, hide = true, env = "RESHARD_UPLOAD_BATCH", value_name = "BYTES")]
    upload_batch: Option<u64>,
    /// How the source check reads the records it checks: pread (default) or mmap. For
    /// measurements.
    #[arg(long, hide = true, env = "RESHARD_VERIFY_READ", value_name = "HOW")]
    verify_read: Option<crate::verify::RecordRead>,
}

impl ConvertFlags {
    /// The library's options for a conversion to `target` with these switches.
    pub fn options(&self, target: &TargetArgs) -> Result<ConvertOptions> {
        let mut opts = target.options(self.quiet)?;
        opts.force = self.force;
        opts.exec.sync = !self.no_fsync;
        opts.verify = !self.no_verify;
        opts.staging = self.staging.clone();
        opts.upload_chunk = self.upload_chunk;
        opts.upload_batch = self.upload_batch;
        opts.verify_read = self.verify_read.unwrap_or_default();
        Ok(opts)
    }
}

/// The target of `plan` and `convert`: layout, format, selection, casts, threads.
#[derive(Args)]
pub struct TargetArgs {
    /// Target world size M (default layout: Shard(0) over M ranks, as FSDP2; default M: 1 for
    /// a one-rank format such as hf, for megatron (whose loader reads any split), for
    /// megatron-legacy (split by --tp, --pp and --ep), and with --recipe).
    #[arg(long, value_name = "M")]
    to: Option<u64>,
    /// Target layout file (JSON: mesh and per-name-glob placements); see docs/guide.md,
    /// "Layout files".
    #[arg(long, value_name = "FILE")]
    layout: Option<PathBuf>,
    #[arg(long, value_name = "FORMAT", help = format_help())]
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
    #[arg(long, value_name = "DTYPE", value_parser = DType::cast_target)]
    dtype: Option<DType>,
    /// Largest file of an hf output, its header included (e.g. 5GB, 500MiB); a tensor too
    /// large for that gets a file of its own, larger.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "5GB")]
    max_shard_size: u64,
    /// Worker threads (default: one per core).
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Per-rank state (RNG states, data-loader positions; `inspect` marks it): drop it, keep
    /// rank 0's, or keep every rank's. Default: rank 0's for --to 1, all of it when M equals
    /// the source's world size, otherwise an error asking for a choice.
    #[arg(long, value_name = "drop|rank0|keep")]
    per_rank_state: Option<crate::per_rank::Policy>,
    /// Store tied tensors (two names, same dtype, shape and bytes) once per name in a .pt
    /// too, instead of sharing one storage as torch.save of a tied model does.
    #[arg(long)]
    untie: bool,
    /// ZeRO stage of a deepspeed output (1, 2 or 3; default: the source's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=3))]
    zero_stage: Option<u8>,
    /// Tensor-parallel size of a megatron-legacy output (default: the source's, from its
    /// saved arguments).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    tp: Option<u64>,
    /// Pipeline-parallel size of a megatron-legacy output (default: the source's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pp: Option<u64>,
    /// Expert-parallel size of a megatron-legacy output (default: the source's).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    ep: Option<u64>,
    /// Write a megatron output as a Megatron-LM save directory
    /// (`latest_checkpointed_iteration.txt` beside `iter_NNNNNNN/`, which Megatron-LM's
    /// `--load` reads), at the iteration the source's common.pt holds (else `release`). A
    /// source read from a save directory gives one without this flag.
    #[arg(long)]
    save_dir: bool,
    /// The model config (`config.json`) an hf output carries, so that transformers'
    /// `from_pretrained` loads it (default: the source's own, when it has one).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Convert between frameworks (megatron <-> hf) with this recipe: a built-in (llama,
    /// mistral, qwen2) or a recipe file (docs/recipes.md); `none` keeps the names. Default:
    /// the one the source's configuration calls for (Megatron-LM's saved arguments, the
    /// config.json's model_type) when the output is the other framework's.
    #[arg(long, value_name = "NAME|FILE")]
    recipe: Option<String>,
    /// Set a recipe parameter, over what the source's configuration says (repeatable), e.g.
    /// `--param padded_vocab=256` or `--param tp=2` for a megatron output.
    #[arg(long = "param", value_name = "KEY=VALUE", value_parser = crate::recipe::parse_param)]
    params: Vec<(String, serde_json::Value)>,
}

/// A size such as `5GB`, `500MiB` or `1024` (bytes): decimal (KB, MB, GB, TB) and binary
/// (KiB, MiB, GiB, TiB) units, case-insensitive; at least one byte.
fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let n = s
        .trim()
        .parse::<ByteSize>()
        .map_err(|_| format!("bad size `{s}` (use a number and B, KB, MB, GB, KiB, MiB or GiB)"))?
        .as_u64();
    if n < 1 {
        return Err(format!("size `{s}` must be at least 1 byte"));
    }
    Ok(n)
}

impl TargetArgs {
    /// The library's conversion options for these arguments (`quiet`: no progress bar);
    /// `force`, `sync` and `verify` are left at their defaults for the caller to set.
    pub fn options(&self, quiet: bool) -> Result<ConvertOptions> {
        Ok(ConvertOptions {
            layout: self.layout()?,
            format: self.format,
            select: Selection {
                include: self.include.clone(),
                exclude: self.exclude.clone(),
                strip_prefix: self.strip_prefix.clone(),
                add_prefix: self.add_prefix.clone(),
            },
            dtype: self.dtype,
            recipe: crate::recipe::RecipeOptions {
                recipe: self.recipe.clone(),
                params: self.params.iter().cloned().collect(),
                tp: None,
                memory: false,
            },
            write: WriteOptions {
                max_shard_size: self.max_shard_size,
                zero_stage: self.zero_stage,
                tp: self.tp,
                pp: self.pp,
                ep: self.ep,
                save_dir: self.save_dir,
                companions: match &self.config {
                    Some(p) => vec![("config.json".into(), crate::checkpoint::read_companion(p)?)],
                    None => vec![],
                },
                ..Default::default()
            },
            exec: ExecOptions {
                threads: self.threads,
                progress: (!quiet && std::io::stderr().is_terminal())
                    .then(|| std::sync::Arc::new(super::progress_bar::Bar::new()) as _),
                // RESHARD_WINDOW (bytes): the work-unit size, for the executor measurements
                // in BENCHMARKS.md; not a user setting.
                window: std::env::var("RESHARD_WINDOW")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(ExecOptions::default().window),
                ..Default::default()
            },
            force: false,
            staging: None,
            verify_read: Default::default(),
            upload_chunk: None,
            upload_batch: None,
            per_rank: self.per_rank_state,
            untie: self.untie,
            verify: true,
            open: Default::default(),
        })
    }

    /// The target layout: the `--layout` file (whose world size `--to` must match, if given),
    /// or Shard(0) over `--to` ranks.
    fn layout(&self) -> Result<LayoutSpec> {
        match (&self.layout, self.to) {
            (Some(p), to) => {
                let spec = LayoutSpec::from_file(p)?;
                match to {
                    Some(m) if m != spec.world() => Err(Error::usage(format!(
                        "--to {m} disagrees with the layout file's mesh {:?} ({} ranks)",
                        spec.mesh,
                        spec.world()
                    ))),
                    _ => Ok(spec),
                }
            }
            (None, Some(0)) => Err(Error::usage("--to must be at least 1")),
            (None, Some(m)) => Ok(LayoutSpec::fsdp(m)),
            // one rank is the only choice of a one-rank format, and what a conversion between
            // frameworks is for (its megatron output loads at any split)
            (None, None)
                if self.recipe.as_deref().is_some_and(|r| r != "none")
                    || self.format.is_some_and(|f| {
                        f.capabilities().max_world == Some(1)
                            || f == Format::MEGATRON
                            || f == Format::MEGATRON_LEGACY
                    }) =>
            {
                Ok(LayoutSpec::fsdp(1))
            }
            (None, None) => Err(Error::usage(
                "give the target world size with --to M (or a --layout file)",
            )),
        }
    }
}

/// The `--format` help: every registered format's name.
fn format_help() -> String {
    format!(
        "Output format: {} (default: from DST, M and the source; see `reshard convert --help`)",
        Format::names()
    )
}

/// The `convert` help's closing text: examples, how the output format is chosen, the formats.
fn convert_help() -> String {
    let formats: Vec<String> = Format::all()
        .map(|f| {
            let c = f.capabilities();
            let read_only = if c.written { "" } else { " (read only)" };
            format!("  {:12} {}{read_only}", f.name(), c.summary)
        })
        .collect();
    let files: Vec<String> = Format::all()
        .flat_map(|f| f.capabilities().extensions)
        .map(|e| format!("*.{e}"))
        .collect();
    format!(
        "Examples:\n  reshard convert ckpt/ model.safetensors --to 1\n  reshard convert ckpt/ out/ --to 2\n  \
         reshard convert ckpt/ hf/ --to 1 --format hf --max-shard-size 2GB\n  \
         reshard convert ckpt/ out/ --to 8 --exclude 'optimizer.*' --dtype bf16\n\n\
         Without --format, the output format follows DST, M and the source: for M = 1 a file\n\
         named {} is that format, any other name a Hugging Face sharded\n\
         directory; for M > 1 a DCP or DeepSpeed source keeps its format, a safetensors\n\
         source gives per-rank safetensors shards. `plan` and `convert` say which format they chose and why.\n\
         A DST named for another output is refused, not overruled: a file name ({}) for a\n\
         folder format or another file format, a name ending in / for one file.\n\nFormats:\n{}",
        files.join(", "),
        files.join(", "),
        formats.join("\n")
    )
}

/// The command-line words for the setting that would let a refused request through.
pub fn hint(e: &Error) -> String {
    use crate::Hint;
    match (e.hint(), e) {
        (Some(Hint::Force), _) => " (use --force to replace it)".into(),
        (Some(Hint::PerRankState), _) => {
            ": add --per-rank-state drop (leave it out) or --per-rank-state rank0 (keep rank 0's)"
                .into()
        }
        (Some(Hint::Tag), _) => " with --tag NAME".into(),
        (Some(Hint::FormatFromName(ext)), _) => {
            format!(", or drop --format to write one .{ext} file")
        }
        (Some(Hint::FolderFormat(name)), _) => match Format::named(name) {
            Some(f) => format!(" (add --format {name} for {})", f.capabilities().noun),
            None => String::new(),
        },
        (Some(Hint::WorldSize), Error::TooManyRanks { world, .. }) => {
            let more: Vec<&str> = Format::all()
                .filter(|f| f.holds(*world) && f.capabilities().written)
                .map(Format::name)
                .collect();
            format!(": use --to 1, or --format {}", more.join(" or "))
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_take_decimal_and_binary_units() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("500MiB"), Ok(500 << 20));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size(" 1 kb "), Ok(1000));
        assert_eq!(parse_size("1.5KiB"), Ok(1536));
        assert_eq!(parse_size("4096"), Ok(4096));
    }

    #[test]
    fn bad_or_empty_sizes_are_refused() {
        assert!(parse_size("5XB").unwrap_err().contains("bad size `5XB`"));
        assert!(parse_size("GB").is_err());
        assert!(parse_size("0").unwrap_err().contains("at least 1 byte"));
        assert!(parse_size("0.1B").unwrap_err().contains("at least 1 byte"));
    }
}
