//! The end-to-end job: open a checkpoint, select tensors, compile the target layout, lay out
//! the output, plan, execute and commit. The CLI and trainers call this.

use crate::checkpoint::OpenOptions;
use crate::commit::Staging;
use crate::error::{Error, Result};
use crate::exec::{self, ExecOptions, ExecStats, KnownCrc};
use crate::formats::{self, Aliasing, Checkpoint, Choice, Format, Output, WriteOptions};
use crate::layout::{DType, TensorLayout};
use crate::per_rank::{classify, Policy};
use crate::plan::{plan_named, Plan};
pub use crate::select::Selection;
use crate::target::LayoutSpec;
use std::path::{Path, PathBuf};

/// Everything a conversion needs besides the paths.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// The target layout (mesh and placements); its world size is the target M.
    pub layout: LayoutSpec,
    /// Output format; `None` chooses it from the destination, M and the source
    /// ([`formats::choose`]).
    pub format: Option<Format>,
    /// Tensors to keep.
    pub select: Selection,
    /// Cast floating tensors (f16, bf16, f32, f64) to this dtype.
    pub dtype: Option<DType>,
    /// Writer settings.
    pub write: WriteOptions,
    /// Executor settings.
    pub exec: ExecOptions,
    /// Replace an existing destination.
    pub force: bool,
    /// What to do with per-rank state ([`crate::per_rank`]); `None` resolves it as
    /// [`Policy::resolve`] does.
    pub per_rank: Option<Policy>,
    /// Write tied tensors once per name even where the format could store
    /// them once ([`Aliasing::StoresOnce`]).
    pub untie: bool,
    /// Check the CRC-32s the sources record for the bytes the plan reads
    /// ([`crate::verify::sources_of`], on its own thread while the copy runs); a mismatch
    /// fails the run before the output is committed.
    pub verify: bool,
    /// How to open the source: which checkpoint of a folder of several (a DeepSpeed tag),
    /// which copy of the weights.
    pub open: OpenOptions,
}

impl ConvertOptions {
    /// Defaults for resharding to `world` ranks with FSDP2's `Shard(0)`.
    pub fn to(world: u64) -> Self {
        ConvertOptions {
            layout: LayoutSpec::fsdp(world),
            format: None,
            select: Selection::default(),
            dtype: None,
            write: WriteOptions::default(),
            exec: ExecOptions::default(),
            force: false,
            per_rank: None,
            untie: false,
            verify: true,
            open: OpenOptions::default(),
        }
    }
}

/// A prepared conversion: the source, the output layout and the plan. Nothing written yet.
#[derive(Debug)]
pub struct Job {
    /// The source checkpoint.
    pub source: Checkpoint,
    /// The output format.
    pub format: Format,
    /// Why that format was chosen from the destination, M and the source; `None` when the
    /// options named it.
    pub format_reason: Option<String>,
    /// Target world size.
    pub world: u32,
    /// Output files and tensor layouts.
    pub output: Output,
    /// The copy plan.
    pub plan: Plan,
    /// Non-tensor entries carried into the output (kept as the format's
    /// [`formats::Capabilities::extras_kept`] says).
    pub extras: usize,
    /// The per-rank state policy applied.
    pub per_rank: Policy,
    /// Per-rank entries (tensors and non-tensor) the policy left out, by source name.
    pub dropped: Vec<String>,
    /// Groups of tied tensors (output names) the output stores once.
    pub ties: Vec<Vec<String>>,
}

impl Job {
    /// Destination bytes each of `threads` worker threads would write, with work units of
    /// `window` bytes ([`ExecOptions::window`]).
    pub fn thread_balance(&self, threads: usize, window: u64) -> Vec<u64> {
        crate::exec::balance(&self.plan, &self.output.files, threads, window)
    }

    /// The files the output consists of, relative to the destination, with their sizes.
    pub fn output_files(&self) -> Vec<(PathBuf, u64)> {
        self.output
            .files
            .iter()
            .map(|f| (f.path.clone(), f.size))
            .collect()
    }
}

/// Read `src` and prepare its conversion (`dst` only guides the format choice).
pub fn prepare(src: impl AsRef<Path>, dst: Option<&Path>, opts: &ConvertOptions) -> Result<Job> {
    let src = src.as_ref();
    opts.layout.check()?;
    let source = Checkpoint::open_with(src, None, &opts.open)?;
    let world = opts.layout.world();
    let (format, format_reason) = match opts.format {
        Some(format) => (format, None),
        None => {
            let Choice { format, reason } = formats::choose(dst, world, source.format);
            (format, Some(reason))
        }
    };
    let selected = opts.select.apply(&source)?;
    let kept_extras: Vec<_> = source
        .extras
        .iter()
        .filter(|e| opts.select.keeps(&e.name))
        .collect();
    let Kept {
        policy,
        dropped,
        tensors: selected,
        extras: kept_extras,
    } = apply_policy(opts.per_rank, source.ranks, world, selected, kept_extras)?;
    if selected.is_empty() && !source.tensors.is_empty() {
        return Err(Error::usage(format!(
            "every selected tensor of {} is per-rank state the policy leaves out",
            source.path.display()
        )));
    }
    let names = opts.select.rename_all(
        selected
            .iter()
            .map(|t| t.name.as_str())
            .chain(kept_extras.iter().map(|e| e.name.as_str())),
    )?;
    let (tensor_names, extra_names) = names.split_at(selected.len());
    let wanted: Vec<(String, DType, Vec<u64>)> = selected
        .iter()
        .zip(tensor_names)
        .map(|(t, name)| {
            let dtype = match opts.dtype {
                Some(d) if t.dtype.is_castable_float() => d,
                _ => t.dtype,
            };
            (name.clone(), dtype, t.shape.clone())
        })
        .collect();
    if let Some(d) = opts.dtype {
        if !d.is_castable_float() {
            return Err(Error::usage(format!(
                "cannot cast to {d}: only floating dtypes (f16, bf16, f32, f64) can be targets"
            )));
        }
    }
    let target = opts.layout.compile(&wanted)?;
    let wopts = write_options(
        opts,
        &source,
        format,
        &selected,
        tensor_names,
        &kept_extras,
        extra_names,
    )?;
    let output = formats::write(format, &target, world as u32, &wopts)?;
    // second copies a format keeps (DeepSpeed's model-dtype weights) read what their
    // target tensor reads
    let index: std::collections::HashMap<&str, usize> = tensor_names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let copies = output
        .copies
        .iter()
        .map(|(copy, of)| {
            index
                .get(of.as_str())
                .map(|&i| (copy.as_str(), selected[i]))
                .ok_or_else(|| Error::layout(of, "is copied by the output but not in the target"))
        })
        .collect::<Result<Vec<_>>>()?;
    let plan = plan_named(
        tensor_names
            .iter()
            .map(String::as_str)
            .zip(selected.iter().copied())
            .chain(copies),
        &output.tensors,
    )?;
    Ok(Job {
        source,
        format,
        format_reason,
        world: world as u32,
        output,
        plan,
        extras: wopts.extras.len(),
        per_rank: policy,
        dropped,
        ties: wopts.ties,
    })
}

/// What the per-rank state policy keeps of a selection.
struct Kept<'a> {
    /// The policy resolved from what is selected.
    policy: Policy,
    /// The per-rank names it leaves out.
    dropped: Vec<String>,
    /// The tensors that stay.
    tensors: Vec<&'a TensorLayout>,
    /// The non-tensor entries that stay.
    extras: Vec<&'a formats::Extra>,
}

/// Per-rank state: resolve the policy from what is selected (tensors and non-tensor
/// entries), then leave out what it drops.
fn apply_policy<'a>(
    chosen: Option<Policy>,
    source_ranks: u32,
    world: u64,
    selected: Vec<&'a TensorLayout>,
    extras: Vec<&'a formats::Extra>,
) -> Result<Kept<'a>> {
    let per_rank_names: Vec<&str> = selected
        .iter()
        .map(|t| t.name.as_str())
        .chain(extras.iter().map(|e| e.name.as_str()))
        .filter(|n| classify(n).is_some())
        .collect();
    let policy = Policy::resolve(chosen, source_ranks as u64, world, &per_rank_names)?;
    let dropped = per_rank_names
        .iter()
        .filter(|n| !policy.keeps(classify(n)))
        .map(|n| n.to_string())
        .collect();
    let selected = selected
        .into_iter()
        .filter(|t| policy.keeps(classify(&t.name)))
        .collect();
    let extras = extras
        .into_iter()
        .filter(|e| policy.keeps(classify(&e.name)))
        .collect();
    Ok(Kept {
        policy,
        dropped,
        tensors: selected,
        extras,
    })
}

/// The writer's settings: the options' own, the source's string metadata, the non-tensor
/// entries under their output names, the nesting when names are unchanged (renamed names are
/// written flat), and the tied groups where the format stores them once. Each format keeps
/// the entries and nesting its own way.
fn write_options(
    opts: &ConvertOptions,
    source: &Checkpoint,
    format: Format,
    selected: &[&TensorLayout],
    tensor_names: &[String],
    extras: &[&formats::Extra],
    extra_names: &[String],
) -> Result<WriteOptions> {
    let mut wopts = opts.write.clone();
    if wopts.tag.is_none() {
        wopts.tag = source.tag.clone();
    }
    for (name, bytes) in &source.companions {
        if !wopts.companions.iter().any(|(n, _)| n == name) {
            wopts.companions.push((name.clone(), bytes.clone()));
        }
    }
    for (k, v) in &source.metadata {
        wopts.metadata.entry(k.clone()).or_insert_with(|| v.clone());
    }
    wopts.extras = extras
        .iter()
        .zip(extra_names)
        .map(|(e, name)| formats::Extra {
            name: name.clone(),
            ..(*e).clone()
        })
        .collect();
    if opts.select.strip_prefix.is_none() && opts.select.add_prefix.is_none() {
        wopts.paths = source.paths.clone();
    }
    if format.capabilities().aliasing == Aliasing::StoresOnce && !opts.untie {
        wopts.ties = crate::ties::find(&source.files, selected)?
            .into_iter()
            .map(|g| g.into_iter().map(|i| tensor_names[i].clone()).collect())
            .collect();
    }
    Ok(wopts)
}

/// Refuse destinations that are, contain, or lie inside the source.
fn check_paths(src: &Path, dst: &Path) -> Result<()> {
    let s =
        std::fs::canonicalize(src).map_err(|e| Error::usage(format!("{}: {e}", src.display())))?;
    let parent = dst
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let p = std::fs::canonicalize(parent)
        .map_err(|_| Error::usage(format!("{}: directory does not exist", parent.display())))?;
    let d = p.join(dst.file_name().unwrap_or_default());
    if d == s || d.starts_with(&s) || s.starts_with(&d) {
        return Err(Error::usage(format!(
            "{}: the destination overlaps the source {}; sources are never written to",
            dst.display(),
            src.display()
        )));
    }
    Ok(())
}

/// Write `job`'s output to `dst` atomically.
pub fn run(job: &Job, dst: impl AsRef<Path>, opts: &ConvertOptions) -> Result<ExecStats> {
    let dst = dst.as_ref();
    check_paths(&job.source.path, dst)?;
    let is_dir = job.format.is_dir();
    if !is_dir && dst.is_dir() {
        return Err(Error::usage(format!(
            "{}: is a directory; give a file name for a {} output",
            dst.display(),
            job.format
        )));
    }
    let staging = Staging::new(dst, is_dir, opts.force)?;
    let dest_paths: Vec<PathBuf> = job
        .output
        .files
        .iter()
        .map(|f| staging.create(&f.path))
        .collect::<Result<_>>()?;
    // The CRC-32s the sources record: output checksums over whole source records are
    // combined from them rather than hashed (so kernel copies stay in the kernel).
    let known: Vec<KnownCrc> = job
        .source
        .checksums
        .iter()
        .map(|r| KnownCrc {
            src: r.file,
            offset: r.offset,
            len: r.len,
            crc: r.crc,
        })
        .collect();
    let sched = exec::prepare(&job.plan, &job.output.files, &opts.exec, &known)?;
    // Source checksums are checked on other threads while the copy runs, as many as the copy
    // leaves cores for (at least one: more would take cores from the copy itself); a
    // mismatch fails the run before anything is committed (the staging area is then removed).
    let check_threads = rayon::current_num_threads()
        .saturating_sub(sched.threads())
        .max(1);
    let (checked, stats) = std::thread::scope(|s| {
        let check = opts.verify.then(|| {
            s.spawn(move || -> Result<crate::verify::Report> {
                exec::thread_pool(check_threads)?
                    .install(|| crate::verify::sources_of(&job.source, &job.plan))
            })
        });
        let stats = exec::execute_scheduled(
            &job.plan,
            &job.source.files,
            &job.output.files,
            &dest_paths,
            &opts.exec,
            sched,
        );
        let checked = check.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        (checked, stats)
    });
    if let Some(c) = checked {
        c?;
    }
    let stats = stats?;
    staging.commit()?;
    Ok(stats)
}

/// Convert `src` into `dst`: [`prepare`] then [`run`].
pub fn convert(
    src: impl AsRef<Path>,
    dst: impl AsRef<Path>,
    opts: &ConvertOptions,
) -> Result<(Job, ExecStats)> {
    let (src, dst) = (src.as_ref(), dst.as_ref());
    let job = prepare(src, Some(dst), opts)?;
    let stats = run(&job, dst, opts)?;
    Ok((job, stats))
}
