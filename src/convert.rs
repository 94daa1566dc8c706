//! The end-to-end job: open a checkpoint, select tensors, compile the target layout, lay out
//! the output, plan, execute and commit. The CLI and trainers call this.

use crate::commit::Staging;
use crate::error::{Error, Result};
use crate::exec::{execute_with_known, ExecOptions, ExecStats, KnownCrc};
use crate::formats::{self, Checkpoint, Format, Output, WriteOptions};
use crate::layout::{DType, TensorLayout};
use crate::per_rank::{classify, Policy};
use crate::plan::{plan, Plan};
use crate::target::LayoutSpec;
use globset::{Glob, GlobSet, GlobSetBuilder};
use std::path::{Path, PathBuf};

/// Which tensors to keep: names matching any `include` glob (all when empty) and no
/// `exclude` glob (`*` matches across dots); and how kept names are renamed: `strip_prefix`
/// is removed where a name starts with it, then `add_prefix` is put in front.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    /// Globs of names to keep.
    pub include: Vec<String>,
    /// Globs of names to drop.
    pub exclude: Vec<String>,
    /// Prefix removed from names that start with it.
    pub strip_prefix: Option<String>,
    /// Prefix added to every name.
    pub add_prefix: Option<String>,
}

fn globset(globs: &[String]) -> Result<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).map_err(|e| Error::usage(format!("bad glob `{g}`: {e}")))?);
    }
    b.build().map_err(|e| Error::usage(e.to_string()))
}

impl Selection {
    /// The output name of `name`.
    pub fn rename(&self, name: &str) -> String {
        let stripped = match &self.strip_prefix {
            Some(p) => name.strip_prefix(p.as_str()).unwrap_or(name),
            None => name,
        };
        format!("{}{stripped}", self.add_prefix.as_deref().unwrap_or(""))
    }

    /// Rename `names`, refusing two names that would become one.
    pub fn rename_all<'a>(&self, names: impl Iterator<Item = &'a str>) -> Result<Vec<String>> {
        let mut seen: std::collections::HashMap<String, &str> = Default::default();
        let mut out = vec![];
        for n in names {
            let r = self.rename(n);
            if r.is_empty() {
                return Err(Error::usage(format!(
                    "`{n}` would be renamed to an empty name"
                )));
            }
            if let Some(prev) = seen.insert(r.clone(), n) {
                return Err(Error::usage(format!(
                    "`{prev}` and `{n}` would both be named `{r}`"
                )));
            }
            out.push(r);
        }
        Ok(out)
    }

    /// True when `name` passes the include and exclude globs.
    pub fn keeps(&self, name: &str) -> bool {
        let inc = self.include.is_empty() || globset(&self.include).is_ok_and(|g| g.is_match(name));
        inc && !globset(&self.exclude).is_ok_and(|g| g.is_match(name))
    }

    /// The names of `ck`'s tensors that are selected, in checkpoint order.
    pub fn apply<'a>(&self, ck: &'a Checkpoint) -> Result<Vec<&'a crate::layout::TensorLayout>> {
        let inc = globset(&self.include)?;
        let exc = globset(&self.exclude)?;
        let v: Vec<_> = ck
            .tensors
            .iter()
            .filter(|t| {
                (self.include.is_empty() || inc.is_match(&t.name)) && !exc.is_match(&t.name)
            })
            .collect();
        if v.is_empty() && !ck.tensors.is_empty() {
            return Err(Error::usage(format!(
                "no tensor of {} matches the --include/--exclude patterns",
                ck.path.display()
            )));
        }
        Ok(v)
    }
}

/// Everything a conversion needs besides the paths.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// The target layout (mesh and placements); its world size is the target M.
    pub layout: LayoutSpec,
    /// Output format; `None` infers it from the destination and M.
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
    /// Write tied tensors ([`crate::ties`]) once per name even where the format could store
    /// them once (`.pt`).
    pub untie: bool,
    /// Check the CRC-32s the sources record for the bytes the plan reads
    /// ([`crate::verify::sources_of`], on its own thread while the copy runs); a mismatch
    /// fails the run before the output is committed.
    pub verify: bool,
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
    /// Target world size.
    pub world: u32,
    /// Output files and tensor layouts.
    pub output: Output,
    /// The copy plan.
    pub plan: Plan,
    /// Non-tensor entries carried into the output (as JSON under [`EXTRAS_KEY`] in the
    /// safetensors `__metadata__`).
    pub extras: usize,
    /// The per-rank state policy applied.
    pub per_rank: Policy,
    /// Per-rank entries (tensors and non-tensor) the policy left out, by source name.
    pub dropped: Vec<String>,
    /// Groups of tied tensors (output names) the output stores once.
    pub ties: Vec<Vec<String>>,
}

pub use crate::formats::EXTRAS_KEY;

/// The output format for `dst` at world size `world` when none is given: for one rank a
/// `.safetensors` or `.pt`/`.pth` file as named, a Hugging Face sharded directory otherwise;
/// per-rank shards for more.
pub fn infer_format(dst: Option<&Path>, world: u64) -> Format {
    let ext = dst
        .and_then(|d| d.extension())
        .and_then(|e| e.to_str())
        .unwrap_or("");
    match (world, ext) {
        (1, "safetensors") => Format::Safetensors,
        (1, "pt" | "pth") => Format::Pt,
        (1, _) => Format::Hf,
        _ => Format::HfStorage,
    }
}

/// Read `src` and prepare its conversion (`dst` only guides the format choice).
pub fn prepare(src: &Path, dst: Option<&Path>, opts: &ConvertOptions) -> Result<Job> {
    opts.layout.check()?;
    let source = Checkpoint::open(src)?;
    let world = opts.layout.world();
    let format = opts.format.unwrap_or_else(|| infer_format(dst, world));
    let selected = opts.select.apply(&source)?;
    let kept_extras: Vec<_> = source
        .extras
        .iter()
        .filter(|e| opts.select.keeps(&e.name))
        .collect();
    // Per-rank state: resolve the policy from what is selected, then leave out what it drops.
    let per_rank_names: Vec<&str> = selected
        .iter()
        .map(|t| t.name.as_str())
        .chain(kept_extras.iter().map(|e| e.name.as_str()))
        .filter(|n| classify(n).is_some())
        .collect();
    let policy = Policy::resolve(opts.per_rank, source.ranks as u64, world, &per_rank_names)?;
    let dropped: Vec<String> = per_rank_names
        .iter()
        .filter(|n| !policy.keeps(classify(n)))
        .map(|n| n.to_string())
        .collect();
    let selected: Vec<_> = selected
        .into_iter()
        .filter(|t| policy.keeps(classify(&t.name)))
        .collect();
    let kept_extras: Vec<_> = kept_extras
        .into_iter()
        .filter(|e| policy.keeps(classify(&e.name)))
        .collect();
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
                "--dtype {d}: only floating dtypes (f16, bf16, f32, f64) can be targets"
            )));
        }
    }
    let target = opts.layout.compile(&wanted)?;
    let mut wopts = opts.write.clone();
    for (k, v) in &source.metadata {
        wopts.metadata.entry(k.clone()).or_insert_with(|| v.clone());
    }
    wopts
        .metadata
        .entry("format".into())
        .or_insert_with(|| "pt".into());
    let extras: serde_json::Map<String, serde_json::Value> = kept_extras
        .iter()
        .zip(extra_names)
        .map(|(e, name)| (name.clone(), e.value.clone()))
        .collect();
    // Formats that hold Python values get the entries themselves, and the nesting when names
    // are unchanged (renamed names are written flat).
    wopts.extras = kept_extras
        .iter()
        .zip(extra_names)
        .map(|(e, name)| crate::formats::Extra {
            name: name.clone(),
            ..(*e).clone()
        })
        .collect();
    if opts.select.strip_prefix.is_none() && opts.select.add_prefix.is_none() {
        wopts.paths = source.paths.clone();
    }
    if !extras.is_empty() && !matches!(format, Format::Pt | Format::Dcp) {
        wopts.metadata.insert(
            EXTRAS_KEY.into(),
            serde_json::Value::Object(extras.clone()).to_string(),
        );
        // the exact Python values, for a later .pt or DCP output
        let pickles: serde_json::Map<String, serde_json::Value> = wopts
            .extras
            .iter()
            .map(|e| {
                let bytes = formats::torch_save::pickle(&e.py_value());
                (e.name.clone(), formats::to_hex(&bytes).into())
            })
            .collect();
        wopts.metadata.insert(
            formats::EXTRAS_PICKLE_KEY.into(),
            serde_json::Value::Object(pickles).to_string(),
        );
    }
    if !wopts.paths.is_empty() && !matches!(format, Format::Pt | Format::Dcp) {
        // the nesting of the names written (tensors and non-tensor entries)
        let written: std::collections::HashSet<&str> = tensor_names
            .iter()
            .chain(extra_names)
            .map(String::as_str)
            .collect();
        let kept: std::collections::BTreeMap<&String, &Vec<formats::KeyPart>> = wopts
            .paths
            .iter()
            .filter(|(n, _)| written.contains(n.as_str()))
            .collect();
        if !kept.is_empty() {
            wopts.metadata.insert(
                formats::PATHS_KEY.into(),
                serde_json::to_string(&kept).map_err(|e| Error::usage(e.to_string()))?,
            );
        }
    }
    if format == Format::Pt && !opts.untie {
        wopts.ties = crate::ties::find(&source.files, &selected)?
            .into_iter()
            .map(|g| g.into_iter().map(|i| tensor_names[i].clone()).collect())
            .collect();
    }
    let output = formats::write(format, &target, world as u32, &wopts)?;
    let src_tensors: Vec<_> = selected
        .into_iter()
        .zip(tensor_names)
        .map(|(t, name)| TensorLayout {
            name: name.clone(),
            ..t.clone()
        })
        .collect();
    let plan = plan(&src_tensors, &output.tensors)?;
    Ok(Job {
        source,
        format,
        world: world as u32,
        output,
        plan,
        extras: extras.len(),
        per_rank: policy,
        dropped,
        ties: wopts.ties,
    })
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
pub fn run(job: &Job, dst: &Path, opts: &ConvertOptions) -> Result<ExecStats> {
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
    // Source checksums are checked on another thread while the copy runs; a mismatch fails
    // the run before anything is committed (the staging area is then removed).
    let (checked, stats) = std::thread::scope(|s| {
        let check = opts
            .verify
            .then(|| s.spawn(|| crate::verify::sources_of(&job.source, &job.plan)));
        let stats = execute_with_known(
            &job.plan,
            &job.source.files,
            &job.output.files,
            &dest_paths,
            &opts.exec,
            &known,
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
pub fn convert(src: &Path, dst: &Path, opts: &ConvertOptions) -> Result<(Job, ExecStats)> {
    let job = prepare(src, Some(dst), opts)?;
    let stats = run(&job, dst, opts)?;
    Ok((job, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renaming_strips_adds_and_refuses_collisions() {
        let sel = Selection {
            strip_prefix: Some("model.".into()),
            add_prefix: Some("s.".into()),
            ..Default::default()
        };
        assert_eq!(sel.rename("model.w"), "s.w");
        assert_eq!(sel.rename("opt.w"), "s.opt.w");
        let sel = Selection {
            strip_prefix: Some("a.".into()),
            ..Default::default()
        };
        let e = sel
            .rename_all(["a.x", "x"].into_iter())
            .unwrap_err()
            .to_string();
        assert_eq!(e, "`a.x` and `x` would both be named `x`");
    }
}
