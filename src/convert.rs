//! The end-to-end job: open a checkpoint, select tensors, compile the target layout, lay out
//! the output, plan, execute and commit. The CLI and trainers call this.

use crate::checkpoint::OpenOptions;
pub use crate::commit::parts::Committed;
use crate::commit::parts::{Manifest, PartsArea, Record, SpanRecord};
use crate::commit::{self, Staging};
use crate::error::{Error, Result};
use crate::exec::{self, ExecOptions, ExecStats, KnownCrc};
use crate::formats::{self, Aliasing, Checkpoint, Format, Output, WriteOptions};
use crate::layout::{DType, TensorLayout};
use crate::parts::{split, Part, Span};
use crate::per_rank::{classify, Policy};
use crate::plan::{plan_named_scaled, plan_views, Plan};
use crate::recipe::{Applied, RecipeOptions};
pub use crate::select::Selection;
use crate::target::LayoutSpec;
use reshard_storage::remote;
use reshard_storage::Location;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Everything a conversion needs besides the paths.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// The target layout (mesh and placements); its world size is the target M.
    pub layout: LayoutSpec,
    /// Output format; `None` chooses it from the destination, M and the source. Either way
    /// a destination whose name says another output is refused ([`formats::output_format`]).
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
    /// Where the parts of a conversion to an object-store URL meet: a folder every worker
    /// sees (`None`: the `RESHARD_STAGING` environment variable).
    pub staging: Option<PathBuf>,
    /// How the source check reads the records ([`crate::verify::RecordRead`]).
    pub verify_read: crate::verify::RecordRead,
    /// Converting to an object-store URL: bytes of each multipart upload's part (`None`:
    /// 16 MiB; at least S3's 5 MiB).
    pub upload_chunk: Option<u64>,
    /// Converting to an object-store URL: destination bytes written to scratch before their
    /// parts are sent (`None`: 128 MiB).
    pub upload_batch: Option<u64>,
    /// Converting between frameworks: which recipe, with which parameters
    /// ([`crate::recipe`]); by default one is chosen where the source and the output belong
    /// to different frameworks and the source's configuration names a model.
    pub recipe: RecipeOptions,
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
            staging: None,
            verify_read: Default::default(),
            upload_chunk: None,
            upload_batch: None,
            recipe: RecipeOptions::default(),
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
    /// The recipe that converts between frameworks, if one applies.
    pub recipe: Option<Applied>,
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

/// Read `src` and prepare its conversion to `dst`: the output format as
/// [`formats::output_format`] decides it from `dst`'s name (refusing a name that says another
/// output), M, the source and the options. `dst` is `None` for a plan made before the
/// destination is named (the format is then chosen as for a folder or a name without an
/// extension). Nothing is written.
pub fn prepare(src: impl AsRef<Path>, dst: Option<&Path>, opts: &ConvertOptions) -> Result<Job> {
    let src = src.as_ref();
    opts.layout.check()?;
    let source = Checkpoint::open_with(src, None, &opts.open)?;
    let world = opts.layout.world();
    let (format, format_reason) = formats::output_format(dst, world, source.format, opts.format)?;
    if opts.write.save_dir && format != Format::MEGATRON && format != Format::MEGATRON_LEGACY {
        return Err(Error::usage(format!(
            "--save-dir writes a megatron output as a Megatron-LM save directory; this output is {format}"
        )));
    }
    // a legacy output's --tp is the split the recipe pads the vocabulary for
    let mut recipe_opts = opts.recipe.clone();
    recipe_opts.tp = recipe_opts.tp.or(opts.write.tp);
    if let Some(applied) = crate::recipe::apply(&source, format, &recipe_opts)? {
        return prepare_recipe(source, format, format_reason, applied, opts);
    }
    // a legacy or fsdp_dtensor source's per-layer tensors, stacked under megatron-core's
    // sharded keys
    if (source.format == Format::MEGATRON_LEGACY || source.format == Format::MEGATRON_FSDP)
        && format == Format::MEGATRON
    {
        let applied = crate::recipe::legacy_torch_dist(&source)?;
        return prepare_recipe(source, format, format_reason, applied, opts);
    }
    let mut selected = opts.select.apply(&source)?;
    if opts.dtype.is_some() {
        // dequantized weights need no scales
        selected.retain(|t| !crate::fp8::is_scale(&source, &t.name));
    }
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
                Some(d)
                    if t.dtype.is_castable_float()
                        || (t.dtype == DType::F8E4M3
                            && crate::fp8::has_scale(&source, &t.name)) =>
                {
                    d
                }
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
    // FP8 weights dequantized with their block scales ([`crate::fp8`])
    let scales = match opts.dtype {
        Some(_) => crate::fp8::scales(
            &source,
            selected
                .iter()
                .copied()
                .zip(tensor_names.iter().map(String::as_str)),
        )?,
        None => Default::default(),
    };
    let target = opts.layout.compile(&wanted)?;
    let mut wopts = write_options(
        opts,
        &source,
        format,
        &selected,
        tensor_names,
        &kept_extras,
        extra_names,
    )?;
    if !scales.is_empty() {
        for (name, bytes) in &mut wopts.companions {
            if name == "config.json" {
                *bytes = crate::fp8::strip_config(bytes);
            }
        }
    }
    let output = formats::write(format, &target, world as u32, &wopts)?;
    // the output's layouts say all the plan needs; the regions asked for (one per rank and
    // tensor, millions at scale) would only sit beside the plan being made
    drop(target);
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
    let plan = plan_named_scaled(
        tensor_names
            .iter()
            .map(String::as_str)
            .zip(selected.iter().copied())
            .chain(copies),
        &output.tensors,
        &scales.iter().map(|(n, s)| (n.as_str(), *s)).collect(),
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
        recipe: None,
    })
}

/// [`prepare`] for a conversion between frameworks: the targets are the recipe's, each a
/// view of the source tensors (selected and renamed by their output names); the output's
/// configuration file is the recipe's, and nothing else of the source is carried (no
/// non-tensor entries, no per-rank state).
fn prepare_recipe(
    source: Checkpoint,
    format: Format,
    format_reason: Option<String>,
    applied: Applied,
    opts: &ConvertOptions,
) -> Result<Job> {
    let world = opts.layout.world();
    let dtype_of: std::collections::HashMap<&str, DType> = source
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.dtype))
        .collect();
    let kept: Vec<&(String, crate::layout::View)> = applied
        .instance
        .targets
        .iter()
        .filter(|(n, _)| opts.select.keeps(n))
        .collect();
    if kept.is_empty() {
        return Err(Error::usage(format!(
            "no target tensor of recipe {} matches the include/exclude patterns",
            applied.name
        )));
    }
    let names = opts
        .select
        .rename_all(kept.iter().map(|(n, _)| n.as_str()))?;
    let shape_of = |n: &str| source.tensor(n).map(|t| t.shape.clone());
    let mut wanted: Vec<(String, DType, Vec<u64>)> = vec![];
    for ((target, view), name) in kept.iter().zip(&names) {
        let srcs = view.sources();
        let d = dtype_of[srcs[0]];
        if let Some(other) = srcs.iter().find(|s| dtype_of[**s] != d) {
            return Err(Error::layout(
                target,
                format!(
                    "recipe {} reads {} ({d}) and {other} ({}): one target's sources must share a dtype",
                    applied.name, srcs[0], dtype_of[*other]
                ),
            ));
        }
        let dtype = match opts.dtype {
            Some(c) if d.is_castable_float() => c,
            _ => d,
        };
        wanted.push((name.clone(), dtype, view.shape(target, &shape_of)?));
    }
    let target = opts.layout.compile(&wanted)?;
    let mut wopts = opts.write.clone();
    if wopts.tag.is_none() {
        // a Megatron-LM save directory's iteration folder, written as one again
        wopts.tag = source.tag.clone();
    }
    if let Some(config) = applied
        .instance
        .config
        .as_ref()
        .filter(|_| applied.to == "hf")
    {
        let mut text = serde_json::to_vec_pretty(config)
            .map_err(|e| Error::internal(format!("recipe config: {e}")))?;
        text.push(b'\n');
        // a config named with the options (`--config`) is the user's word
        if !wopts.companions.iter().any(|(n, _)| n == "config.json") {
            wopts.companions.push(("config.json".into(), text));
        }
    }
    if applied.to == "megatron" && applied.from == "megatron" {
        // the source's own common.pt entries (Megatron-LM's args, the iteration, …)
        wopts.extras = source
            .extras
            .iter()
            .filter(|e| e.origin == "common.pt" && opts.select.keeps(&e.name))
            .cloned()
            .collect();
        wopts.paths = source.paths.clone();
        wopts
            .extras
            .extend(crate::recipe::objects(&applied.instance));
    } else if applied.to == "megatron" {
        wopts.extras = crate::recipe::megatron_common(applied.instance.config.as_ref());
        wopts
            .extras
            .extend(crate::recipe::objects(&applied.instance));
    }
    let extras = wopts.extras.len();
    let output = formats::write(format, &target, world as u32, &wopts)?;
    let view_of: std::collections::HashMap<&str, &crate::layout::View> = names
        .iter()
        .map(String::as_str)
        .zip(kept.iter().map(|(_, v)| v))
        .collect();
    let dst = output
        .tensors
        .iter()
        .map(|t| {
            let of = output
                .copies
                .iter()
                .find(|(copy, _)| *copy == t.name)
                .map_or(t.name.as_str(), |(_, of)| of.as_str());
            let view = view_of.get(of).ok_or_else(|| {
                Error::layout(&t.name, "is in the output but no recipe rule defines it")
            })?;
            Ok((t.clone(), (*view).clone()))
        })
        .collect::<Result<Vec<_>>>()?;
    let plan = plan_views(source.tensors.iter().map(|t| (t.name.as_str(), t)), &dst)?;
    let dropped = source
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| crate::per_rank::classify(n).is_some())
        .map(String::from)
        .collect();
    Ok(Job {
        source,
        format,
        format_reason,
        world: world as u32,
        output,
        plan,
        extras,
        per_rank: Policy::Drop,
        dropped,
        ties: vec![],
        recipe: Some(applied),
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
        wopts.ties = crate::ties::find(source.sources(), selected)?
            .into_iter()
            .map(|g| g.into_iter().map(|i| tensor_names[i].clone()).collect())
            .collect();
    }
    Ok(wopts)
}

/// Refuse destinations that are, contain, or lie inside the source.
fn check_paths(src: &Path, dst: &Path) -> Result<()> {
    let local = |p: &Path| matches!(reshard_storage::locate(p), Location::Local(_));
    if !local(src) || !local(dst) {
        let (s, d) = (url_text(src), url_text(dst));
        let inside = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}/"));
        if inside(&s, &d) || inside(&d, &s) {
            return Err(Error::usage(format!(
                "{}: the destination overlaps the source {}; sources are never written to",
                dst.display(),
                src.display()
            )));
        }
        return Ok(());
    }
    let s =
        std::fs::canonicalize(src).map_err(|e| Error::usage(format!("{}: {e}", src.display())))?;
    let parent = dst
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    commit::no_folder(dst)?;
    let p = std::fs::canonicalize(parent).map_err(|e| reshard_storage::sys::dest_error(dst, e))?;
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

/// `p` as text without a trailing `/`, for comparing URLs.
fn url_text(p: &Path) -> String {
    p.display().to_string().trim_end_matches('/').to_string()
}

/// Check `dst` can take `job`'s output (not the source, not a directory for a one-file
/// output); returns whether the output is a directory.
fn check_destination(job: &Job, dst: &Path) -> Result<bool> {
    check_paths(&job.source.path, dst)?;
    let is_dir = job.format.is_dir();
    if !is_dir && matches!(reshard_storage::locate(dst), Location::Local(_)) && dst.is_dir() {
        return Err(Error::usage(format!(
            "{}: is a directory; give a file name for a {} output",
            dst.display(),
            job.format
        )));
    }
    Ok(is_dir)
}

/// Write `job`'s output to `dst` atomically. An object-store URL `dst` gets the output
/// built in a local scratch folder, then uploaded, the objects that make it loadable last.
pub fn run(job: &Job, dst: impl AsRef<Path>, opts: &ConvertOptions) -> Result<ExecStats> {
    let dst = dst.as_ref();
    match reshard_storage::locate(dst) {
        Location::Remote(url) => run_remote(job, &url, opts),
        Location::Local(path) => run_local(job, &path, opts),
    }
}

/// Destination bytes written between two sends of an upload's chunks (more when the output
/// is so large that this would mean many thousands of executor runs).
const UPLOAD_BATCH: u64 = 128 << 20;

/// How an output is uploaded to an object-store URL: replacing what is there when `force`,
/// in parts of `chunk` bytes (the default when `None`).
fn upload_options(force: bool, chunk: Option<u64>) -> remote::upload::UploadOptions {
    remote::upload::UploadOptions {
        force,
        loadable: reshard_formats::loadable_last,
        chunk,
    }
}

/// [`run`] into an object-store URL `dst`: each output file is written into a sparse scratch
/// file a batch of chunks at a time ([`exec::execute_part`] over the batch's spans), and its
/// chunks are sent as parts of a multipart upload while the next batch is written (then
/// their blocks are freed). Chunks holding an output checksum (a `.pt`'s zip CRCs) wait for
/// the file's last batch. The source checksums are checked beside the copy, and the objects
/// that make the output loadable are sent last, after that check.
fn run_remote(job: &Job, dst: &Path, opts: &ConvertOptions) -> Result<ExecStats> {
    check_destination(job, dst)?;
    remote::upload::check_destination(dst, opts.force)?;
    let scratch = remote::mirror::scratch("upload")?;
    let name = dst
        .file_name()
        .filter(|n| !n.is_empty())
        .unwrap_or(std::ffi::OsStr::new("checkpoint"));
    let root = scratch.path().join(name);
    let outputs = &job.output.files;
    let single = !job.format.is_dir();
    let dest_paths = scratch_outputs(&root, outputs, single)?;
    let total: u64 = outputs.iter().map(|o| o.size).sum();
    let progress = opts.exec.progress.clone();
    let batches = Batches {
        job,
        dest_paths: &dest_paths,
        batch: opts
            .upload_batch
            .unwrap_or(UPLOAD_BATCH)
            .max(total.div_ceil(2_000)),
        exec: ExecOptions {
            progress: progress
                .clone()
                .map(|p| Arc::new(Advance(p)) as Arc<dyn exec::Progress>),
            sync: false,
            ..opts.exec.clone()
        },
        dst,
    };
    // each file's object name under the URL ("" for a one-file output: the URL itself)
    let rels: Vec<String> = outputs
        .iter()
        .map(|o| {
            if single {
                String::new()
            } else {
                o.path.to_string_lossy().replace('\\', "/")
            }
        })
        .collect();
    // the loadable objects last, each kind in output order
    let mut order: Vec<usize> = (0..outputs.len()).collect();
    order.sort_by_key(|&f| reshard_formats::loadable_last(&rels[f]));
    let check_threads = rayon::current_num_threads().saturating_sub(1).max(1);
    let mut upload =
        remote::upload::Upload::start(dst, upload_options(opts.force, opts.upload_chunk))?;
    if let Some(p) = &progress {
        p.start(total);
    }
    let mut stats = ExecStats::default();
    std::thread::scope(|s| -> Result<()> {
        let mut check = opts.verify.then(|| {
            s.spawn(move || -> Result<crate::verify::Report> {
                exec::thread_pool(check_threads)?
                    .install(|| crate::verify::sources_of(&job.source, &job.plan, opts.verify_read))
            })
        });
        let mut current = None;
        let r = (|| -> Result<()> {
            for &f in &order {
                let rel = &rels[f];
                if reshard_formats::loadable_last(rel) {
                    if let Some(h) = check.take() {
                        h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?;
                    }
                }
                let up = current.insert(upload.file(rel, &dest_paths[f], outputs[f].size, true)?);
                batches.send_file(f, up, &mut stats)?;
                let up = current.take().expect("set above");
                upload.sent(up)?;
            }
            if let Some(h) = check.take() {
                h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            // the check thread, if still running, is joined when the scope ends
            return Err(upload.fail(e, current.take()));
        }
        Ok(())
    })?;
    stats.bytes_read = job.plan.bytes_read();
    stats.bytes_written = job.plan.bytes_written()
        + outputs
            .iter()
            .flat_map(|o| &o.literals)
            .map(|(_, b)| b.len() as u64)
            .sum::<u64>();
    stats.aborted_uploads = upload.finish()?;
    if let Some(p) = &progress {
        p.finish();
    }
    Ok(stats)
}

/// The sparse scratch files an upload's outputs are written into, under `root` (`root`
/// itself for a one-file output), each of its final size.
fn scratch_outputs(
    root: &Path,
    outputs: &[exec::OutputFile],
    single: bool,
) -> Result<Vec<PathBuf>> {
    let mut dest_paths = Vec::with_capacity(outputs.len());
    for o in outputs {
        let p = if single {
            root.to_path_buf()
        } else {
            root.join(&o.path)
        };
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| Error::format(parent, format!("cannot make a scratch folder: {e}")))?;
        }
        let f = std::fs::File::create(&p).map_err(|e| crate::sys::write_error(&p, e))?;
        f.set_len(o.size)
            .map_err(|e| crate::sys::write_error(&p, e))?;
        dest_paths.push(p);
    }
    Ok(dest_paths)
}

/// How a conversion to a URL writes each output file: a batch of chunks at a time into its
/// scratch file ([`exec::execute_part`] over the batch's span), each batch's chunks sent as
/// soon as they are final ([`CrcParking`]).
struct Batches<'a> {
    job: &'a Job,
    dest_paths: &'a [PathBuf],
    /// Destination bytes written per batch.
    batch: u64,
    exec: ExecOptions,
    /// The URL, for messages.
    dst: &'a Path,
}

impl Batches<'_> {
    /// Write output file `f` batch by batch and send its chunks through `up`.
    fn send_file(
        &self,
        f: usize,
        up: &mut remote::upload::FileUpload,
        stats: &mut ExecStats,
    ) -> Result<()> {
        let outputs = &self.job.output.files;
        let size = outputs[f].size;
        let chunk = up.chunk();
        let mut parking = CrcParking::new(&outputs[f].checksums, chunk);
        let chunks = size.div_ceil(chunk) as usize;
        let per = (self.batch / chunk).max(1) as usize;
        let mut shares = vec![];
        for first in (0..chunks).step_by(per) {
            let ks: Vec<usize> = (first..chunks.min(first + per)).collect();
            let span = Span {
                file: f as u32,
                start: first as u64 * chunk,
                end: size.min((first + ks.len()) as u64 * chunk),
            };
            let w = exec::execute_part(
                &self.job.plan,
                self.job.source.sources(),
                outputs,
                self.dest_paths,
                &self.exec,
                &[span],
            )?;
            stats.windows += w.stats.windows;
            stats.threads = stats.threads.max(w.stats.threads);
            shares.extend(w.shares);
            let mut go = parking.written(ks);
            // the checksums whose bytes are all written now
            let ready = parking.ready_upto(span.end);
            if !ready.is_empty() {
                exec::write_checksum_shares_in(
                    outputs,
                    &shares,
                    self.dest_paths,
                    Some(f),
                    Some(&ready),
                )?;
                go.extend(parking.release(&ready));
                go.sort_unstable();
            }
            up.send(go)?;
        }
        if !parking.is_clear() {
            return Err(Error::internal(format!(
                "{}: an output checksum of {} was never complete",
                self.dst.display(),
                outputs[f].path.display()
            )));
        }
        Ok(())
    }
}

/// The chunks of an output file that hold one of its checksums (a zip CRC) are parked until
/// that checksum is written: once every byte of its range and of its slots is (a later batch
/// writing a slot's placeholder must not overwrite it).
struct CrcParking<'a> {
    cks: &'a [exec::Checksum],
    chunk: u64,
    /// Per chunk, the checksums it holds that are not written yet.
    waiting: std::collections::BTreeMap<usize, usize>,
    /// The checksums by the byte after which they can be written.
    order: Vec<usize>,
    next: usize,
    /// Written chunks that wait for a checksum.
    parked: std::collections::BTreeSet<usize>,
}

impl<'a> CrcParking<'a> {
    fn new(cks: &'a [exec::Checksum], chunk: u64) -> Self {
        let mut p = CrcParking {
            cks,
            chunk,
            waiting: Default::default(),
            order: (0..cks.len()).collect(),
            next: 0,
            parked: Default::default(),
        };
        for c in cks {
            for k in p.slots(c) {
                *p.waiting.entry(k).or_default() += 1;
            }
        }
        p.order.sort_by_key(|&i| Self::ready_at(&cks[i]));
        p
    }

    /// The chunks holding `c`'s CRC.
    fn slots(&self, c: &exec::Checksum) -> Vec<usize> {
        let n = if c.hex { 8 } else { 4 };
        c.at.iter()
            .flat_map(|&at| ((at / self.chunk) as usize)..=((at + n - 1) / self.chunk) as usize)
            .collect()
    }

    /// The byte after which `c` can be written: the end of its range and of its slots.
    fn ready_at(c: &exec::Checksum) -> u64 {
        let n = if c.hex { 8 } else { 4 };
        c.at.iter().map(|&at| at + n).fold(c.range.1, u64::max)
    }

    /// Chunks `ks` are written: those that hold no pending checksum may go; the others
    /// are parked.
    fn written(&mut self, ks: Vec<usize>) -> Vec<usize> {
        let waiting = &self.waiting;
        self.parked
            .extend(ks.iter().copied().filter(|k| waiting.contains_key(k)));
        ks.into_iter()
            .filter(|k| !waiting.contains_key(k))
            .collect()
    }

    /// The checksums (indices, sorted) whose bytes are all written once bytes up to `end`
    /// are, not handed out before.
    fn ready_upto(&mut self, end: u64) -> Vec<usize> {
        let mut ready = vec![];
        while self.next < self.order.len()
            && Self::ready_at(&self.cks[self.order[self.next]]) <= end
        {
            ready.push(self.order[self.next]);
            self.next += 1;
        }
        ready.sort_unstable();
        ready
    }

    /// Checksums `ready` are written: the parked chunks that no longer wait for one.
    fn release(&mut self, ready: &[usize]) -> Vec<usize> {
        for &i in ready {
            for k in self.slots(&self.cks[i]) {
                if let Some(n) = self.waiting.get_mut(&k) {
                    *n -= 1;
                    if *n == 0 {
                        self.waiting.remove(&k);
                    }
                }
            }
        }
        let free: Vec<usize> = self
            .parked
            .iter()
            .copied()
            .filter(|k| !self.waiting.contains_key(k))
            .collect();
        for k in &free {
            self.parked.remove(k);
        }
        free
    }

    /// Every checksum written and every chunk sent.
    fn is_clear(&self) -> bool {
        self.waiting.is_empty() && self.parked.is_empty()
    }
}

/// A progress report passed on to the executor's runs of one conversion: their advances
/// count, their starts and finishes (one per run) do not.
struct Advance(Arc<dyn exec::Progress>);

impl exec::Progress for Advance {
    fn start(&self, _total_bytes: u64) {}
    fn advance(&self, bytes: u64) {
        self.0.advance(bytes)
    }
    fn finish(&self) {}
}

/// [`run`] into a local `dst`.
fn run_local(job: &Job, dst: &Path, opts: &ConvertOptions) -> Result<ExecStats> {
    let is_dir = check_destination(job, dst)?;
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
                    .install(|| crate::verify::sources_of(&job.source, &job.plan, opts.verify_read))
            })
        });
        let stats = exec::execute_scheduled(
            &job.plan,
            job.source.sources(),
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

/// What one worker's part of a conversion did ([`run_part`]).
#[derive(Clone, Debug)]
pub struct PartRun {
    /// The part.
    pub part: Part,
    /// The destination byte spans it owns.
    pub spans: Vec<Span>,
    /// What it wrote; `None` when an earlier run of the same part had already written it.
    pub stats: Option<ExecStats>,
    /// The parts with no record yet, after this one (empty once all are written).
    pub missing: Vec<u32>,
    /// The commit this worker ran, when it wrote the last part.
    pub committed: Option<Committed>,
    /// For a destination in object storage, committed by this worker: the objects whose
    /// incomplete uploads by killed runs were aborted before the output was uploaded.
    pub aborted_uploads: Vec<String>,
}

/// A fingerprint of what a job writes and from what: the plan, the output files (paths,
/// sizes, literal bytes, checksums), the sources (paths, sizes, modification times), the
/// reshard version and the number of parts. Workers of one conversion in parts compare it,
/// so a part planned from another source, other options or another version is refused.
pub fn fingerprint(job: &Job, parts: u32) -> Result<String> {
    /// FNV-1a, 64 bits: stable across platforms and releases, which `std`'s hasher is not.
    struct Fnv(u64);
    impl Fnv {
        fn bytes(&mut self, b: &[u8]) {
            for &x in b {
                self.0 = (self.0 ^ x as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        fn num(&mut self, v: u64) {
            self.bytes(&v.to_le_bytes());
        }
        fn text(&mut self, s: &str) {
            self.num(s.len() as u64);
            self.bytes(s.as_bytes());
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    h.text(env!("CARGO_PKG_VERSION"));
    h.num(parts as u64);
    h.text(&job.format.to_string());
    h.num(job.world as u64);
    for p in &job.source.files {
        if let Some((url, size, e_tag)) = job.source.storage().identity(p) {
            h.text(&url);
            h.num(size);
            h.text(&e_tag);
            continue;
        }
        let m = std::fs::metadata(p).map_err(|e| Error::usage(format!("{}: {e}", p.display())))?;
        let canonical = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        h.text(&canonical.to_string_lossy());
        h.num(m.len());
        let mtime = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos() as u64);
        h.num(mtime);
    }
    for o in &job.plan.ops {
        for v in [
            o.src as u64,
            o.src_offset,
            o.dst as u64,
            o.dst_offset,
            o.len,
            o.count,
            o.src_stride,
            o.dst_stride,
        ] {
            h.num(v);
        }
        match o.cast {
            Some(c) => h.text(&format!("{}>{}", c.from, c.to)),
            None => h.num(0),
        }
    }
    for f in &job.plan.fills {
        let n = f.value.len() as u64;
        for v in [f.dst as u64, f.dst_offset, f.len, f.count, f.dst_stride, n] {
            h.num(v);
        }
        h.bytes(&f.value);
    }
    for f in &job.output.files {
        h.text(&f.path.to_string_lossy());
        h.num(f.size);
        for (at, b) in &f.literals {
            h.num(*at);
            h.num(b.len() as u64);
            h.bytes(b);
        }
        for c in &f.checksums {
            h.num(c.range.0);
            h.num(c.range.1);
            h.num(c.hex as u64);
            for &a in &c.at {
                h.num(a);
            }
        }
    }
    Ok(format!("{:016x}", h.0))
}

/// Run part `part` of `job`'s conversion into `dst`, beside the workers running the other
/// parts ([`crate::parts`]): only its share of the destination bytes is written, into the
/// staging area they share ([`crate::commit::parts`]), then recorded. The worker that records
/// the last part commits (unless another is already committing); until then `dst` does not
/// exist. A part an earlier run recorded is not written again. Refused while another worker
/// runs the same part, or when the staging area holds another conversion's parts.
pub fn run_part(
    job: &Job,
    dst: impl AsRef<Path>,
    opts: &ConvertOptions,
    part: Part,
) -> Result<PartRun> {
    let dst = match reshard_storage::locate(dst.as_ref()) {
        Location::Local(path) => return run_part_local(job, &path, opts, part),
        Location::Remote(url) => url,
    };
    let dst = dst.as_path();
    check_paths(&job.source.path, dst)?;
    remote::upload::check_destination(dst, opts.force)?;
    let local = staged_destination(dst, opts.staging.as_deref())?;
    let mut run = run_part_local(job, &local, opts, part)?;
    if let Some(Committed::Published { .. }) = run.committed {
        run.aborted_uploads = remote::upload::upload_tree(
            &local,
            dst,
            upload_options(opts.force, opts.upload_chunk),
        )?;
    }
    Ok(run)
}

/// The local destination the parts of a conversion to the URL `url` meet at: in `staging`
/// (else `RESHARD_STAGING`), named after the URL. The worker that commits uploads it.
fn staged_destination(url: &Path, staging: Option<&Path>) -> Result<PathBuf> {
    let dir = staging
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("RESHARD_STAGING").map(PathBuf::from))
        .ok_or_else(|| {
            Error::usage(format!(
                "{}: the parts of a conversion to object storage meet in a staging folder on a file system every worker sees: give it with --staging DIR (or RESHARD_STAGING)",
                url.display()
            ))
        })?;
    if !dir.is_dir() {
        return Err(Error::usage(format!(
            "{}: the staging folder is not a folder (or does not exist)",
            dir.display()
        )));
    }
    // readable, and unique: the URL's characters (the last 100) and a hash of all of it
    let text = url.to_string_lossy().trim_end_matches('/').to_string();
    let readable: Vec<char> = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || ".-_".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let tail: String = readable[readable.len().saturating_sub(100)..]
        .iter()
        .collect();
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    Ok(dir.join(format!("{hash:016x}-{tail}")))
}

/// [`run_part`] into a local `dst`.
fn run_part_local(job: &Job, dst: &Path, opts: &ConvertOptions, part: Part) -> Result<PartRun> {
    let is_dir = check_destination(job, dst)?;
    let sizes: Vec<u64> = job.output.files.iter().map(|f| f.size).collect();
    let spans = split(&sizes, &job.plan, part.count)?.swap_remove(part.index as usize);
    let what = format!(
        "{} ({}) to {} at {} rank(s)",
        job.source.path.display(),
        job.source.format,
        job.format,
        job.world
    );
    let manifest = Manifest::new(
        fingerprint(job, part.count)?,
        part.count,
        what,
        is_dir,
        &job.output.files,
    );
    let area = PartsArea::join(dst, &manifest, opts.force)?;
    let finish = |stats: Option<ExecStats>| -> Result<PartRun> {
        let missing = area.missing();
        let committed = if missing.is_empty() {
            Some(commit::parts::commit(dst, opts.force, opts.verify, false)?)
        } else {
            None
        };
        Ok(PartRun {
            part,
            spans: spans.clone(),
            stats,
            missing,
            committed,
            aborted_uploads: vec![],
        })
    };
    if area.record(part)?.is_some() {
        return finish(None);
    }
    let _claim = area.claim(part)?;
    // the claim's previous holder may have finished between the look and the claim
    if area.record(part)?.is_some() {
        return finish(None);
    }
    let t0 = std::time::Instant::now();
    let mut files: Vec<u32> = spans.iter().map(|s| s.file).collect();
    files.dedup();
    area.create(files)?;
    let plan = exec::restrict(&job.plan, &spans);
    let paths = area.paths();
    let check_threads = rayon::current_num_threads().saturating_sub(1).max(1);
    let (checked, written) = std::thread::scope(|s| {
        let check = opts.verify.then(|| {
            s.spawn(|| -> Result<crate::verify::Report> {
                exec::thread_pool(check_threads)?
                    .install(|| crate::verify::sources_of(&job.source, &plan, opts.verify_read))
            })
        });
        let written = exec::execute_part(
            &plan,
            job.source.sources(),
            &job.output.files,
            &paths,
            &opts.exec,
            &spans,
        );
        let checked = check.map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        (checked, written)
    });
    if let Some(c) = checked {
        c?;
    }
    let written = written?;
    let record = Record {
        fingerprint: manifest.fingerprint.clone(),
        part,
        spans: spans
            .iter()
            .zip(&written.span_crcs)
            .map(|(s, &crc)| SpanRecord {
                file: s.file,
                start: s.start,
                end: s.end,
                crc,
            })
            .collect(),
        shares: written.shares,
        placeholders: area.placeholders(&spans)?,
        worker: commit::parts::worker(),
        bytes: spans.iter().map(|s| s.len()).sum(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    area.write_record(&record)?;
    finish(Some(written.stats))
}

/// Commit a conversion run in parts into `dst` ([`commit::parts::commit`]): every part must be
/// recorded; their bytes are checked against their CRC-32s unless `check` is false. For an
/// object-store URL `dst`, the parts met in `staging` (else `RESHARD_STAGING`): the output
/// published there is uploaded to `dst`, then removed — also one an earlier commit published
/// whose upload failed (reported as published, with no bytes checked again).
pub fn commit_parts(
    dst: impl AsRef<Path>,
    staging: Option<&Path>,
    force: bool,
    check: bool,
) -> Result<Committed> {
    let dst = match reshard_storage::locate(dst.as_ref()) {
        Location::Local(path) => return commit::parts::commit(&path, force, check, true),
        Location::Remote(url) => url,
    };
    let dst = dst.as_path();
    let local = staged_destination(dst, staging)?;
    let staged = PartsArea::dir_of(&local)?.exists();
    let published = std::fs::symlink_metadata(&local).is_ok();
    let done = if !staged && published {
        // published here and not uploaded (the committing worker's upload failed)
        Committed::Published { checked: 0 }
    } else {
        commit::parts::commit(&local, force, check, true)?
    };
    if std::fs::symlink_metadata(&local).is_ok() {
        remote::upload::upload_tree(&local, dst, upload_options(force, None))?;
    }
    Ok(done)
}
