//! reshard-formats: checkpoint formats, behind one interface and one registry. Nothing
//! outside this crate knows a file format: the rest of reshard reads a [`Checkpoint`], writes
//! through [`write()`], and asks a [`Format`] what it can hold ([`Capabilities`]) instead of
//! matching on it.
//!
//! May import: `reshard-core` and `reshard-storage` (the formats read files and mirrors;
//! they never write one — a writer describes its files as [`OutputFile`]s for the executor).
//!
//! | module | format |
//! |---|---|
//! | `checkpoint` | the [`Checkpoint`] a reader produces: opening (detection, tags, mirrors), validation, reading regions |
//! | `ties` | which tensors of a checkpoint are tied (the same bytes under several names) |
//! | `safetensors` | one `.safetensors` file, and the header code the family shares |
//! | `hf` | Hugging Face sharded safetensors (`model.safetensors.index.json` + files) |
//! | `hf_storage` | the per-rank shards of torch's `HuggingFaceStorageWriter(save_distributed=True)` |
//! | `dcp/` | PyTorch Distributed Checkpoints (`.metadata` + `__R_I.distcp`): codec, reader, writer |
//! | `pt/` | one `torch.save` file (`.pt`) holding a state dict: codec, reader, writer |
//! | `deepspeed/` | DeepSpeed ZeRO checkpoints (stages 1-3): file records, partitions, reader, writer; universal checkpoints (`ds_to_universal`), read |
//! | `megatron` | megatron-core `dist_checkpointing` (`torch_dist`): its files around a DCP checkpoint |
//! | `megatron_fsdp` | Megatron-LM's `fsdp_dtensor` checkpoints (Megatron-FSDP's DTensors in DCP), read under megatron-core's names |
//! | `megatron_legacy` | Megatron-LM's per-rank checkpoints (`--ckpt-format torch`) read as global tensors and written at a chosen TP/PP/EP, and its save directories (`latest_checkpointed_iteration.txt`, `iter_NNNNNNN/`) |
//! | `torch/` | the torch.save machinery DCP and `.pt` share: pickle, zip records, dtypes |
//! | `index` | which bytes opening a checkpoint reads, for checkpoints read from object storage |
//!
//! # Adding a format
//! 1. Write a module with a unit struct implementing [`Codec`]: its [`Capabilities`], how it
//!    recognizes a path ([`Codec::recognize`]: a marker only it uses, or a fallback), and its
//!    reader (files → [`Checkpoint`]) and writer ([`TargetTensor`]s → [`Output`]).
//! 2. Add one line to [`REGISTRY`]. Detection, `--format`, its help text, the output-format
//!    choice and the CLI's messages follow from the capabilities.
//!
//! Byte-level notes on the torch formats, with their traps: `docs/pytorch-formats.md`.

#![deny(missing_docs)]

pub mod array;
pub mod checkpoint;
pub mod dcp;
pub mod deepspeed;
pub mod hf;
pub mod hf_storage;
pub mod index;
pub mod megatron;
pub mod megatron_fsdp;
pub mod megatron_legacy;
pub mod pt;
pub mod safetensors;
pub mod ties;
pub mod torch;
pub mod torch_checkpointing;
pub mod verl;

/// The core floor's modules, at the paths this crate's code names them by.
pub(crate) use reshard_core::{error, layout, plan};
/// The storage floor's modules, at the paths this crate's code names them by.
pub(crate) use reshard_storage::{read, sys};

pub use self::safetensors::{EXTRAS_KEY, EXTRAS_PICKLE_KEY, PATHS_KEY};
pub use crate::checkpoint::{Checkpoint, Locate, OpenOptions, PathFlavor, SavedId, SavedMeta};
pub use reshard_core::model::{Extra, KeyPart, Opaque, RecordCrc, Weights};
pub use reshard_core::output::OutputFile;
pub use reshard_core::target::TargetTensor;

use crate::error::{Error, Hint, IoContext, Result};
use crate::layout::TensorLayout;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// Every format reshard reads and writes, in the order help texts list them.
pub const REGISTRY: &[Format] = &[
    Format::SAFETENSORS,
    Format::HF,
    Format::HF_STORAGE,
    Format::DCP,
    Format::PT,
    Format::DEEPSPEED,
    Format::DEEPSPEED_UNIVERSAL,
    Format::MEGATRON,
    Format::MEGATRON_LEGACY,
    Format::MEGATRON_FSDP,
    Format::VERL,
    Format::TORCH_CHECKPOINTING,
];

/// One checkpoint format: what it can hold, how to recognize it, its reader and its writer.
///
/// Implemented by a unit struct in the format's module and listed once in [`REGISTRY`].
pub trait Codec: Sync + std::panic::RefUnwindSafe + 'static {
    /// What the format is and what it can hold.
    fn capabilities(&self) -> &'static Capabilities;
    /// Whether `probe` looks like this format (from the facts gathered, without I/O).
    fn recognize(&self, probe: &Probe) -> Recognition;
    /// Read the checkpoint at `path` (validation of the layouts is done by the caller).
    fn read(&self, path: &Path) -> Result<Checkpoint>;
    /// Read the checkpoint at `path` for [`Checkpoint::open_lazy`]: formats whose pieces sit
    /// in items with headers of their own may leave them pending ([`crate::layout::Loc::pending`])
    /// with a locator that reads them on demand. The default reads everything.
    fn read_lazy(&self, path: &Path) -> Result<Checkpoint> {
        self.read(path)
    }
    /// Read the checkpoint at `path` taking parameter values from `weights`, for formats
    /// that keep more than one copy (DeepSpeed's fp32 master weights and model weights). The
    /// default refuses: the format keeps one.
    fn read_weights(&self, path: &Path, weights: Weights) -> Result<Checkpoint> {
        Err(Error::usage(format!(
            "{}: is {}, which keeps one copy of its parameters: the choice of {} weights \
             applies to DeepSpeed checkpoints",
            path.display(),
            self.capabilities().noun,
            weights
        )))
    }
    /// Lay out `target`, held by `world` ranks, as this format's files. `world` is within
    /// [`Capabilities::max_world`].
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output>;
    /// Fetch, through `fetch`, the bytes of `files` (the checkpoint's local files and their
    /// sizes, laid out by an object store's mirror) that [`Codec::read`] reads before any
    /// tensor data: the format's index. The default is its family's: small files whole, and
    /// of each larger one its safetensors header, or its `torch.save` archive's records
    /// around the storages; the pieces formats compose are in [`index`].
    fn index(&self, files: &[(std::path::PathBuf, u64)], fetch: index::Fetch) -> Result<()> {
        let large = match self.capabilities().family {
            Family::Safetensors => index::safetensors_header,
            Family::Torch => index::zip_index,
        };
        index::small_whole_else(files, fetch, large)
    }
}

/// What a [`Codec`] says of a path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recognition {
    /// Not this format.
    No,
    /// A marker only this format uses (a magic number, an index or metadata file).
    Marker,
    /// Could be this format and nothing more specific matched: the reader will say what is
    /// wrong if it is not.
    Fallback,
}

impl Recognition {
    /// [`Recognition::Marker`] when `seen`, else [`Recognition::No`].
    pub fn marker_if(seen: bool) -> Recognition {
        if seen {
            Recognition::Marker
        } else {
            Recognition::No
        }
    }

    /// [`Recognition::Fallback`] when `possible`, else [`Recognition::No`].
    pub fn fallback_if(possible: bool) -> Recognition {
        if possible {
            Recognition::Fallback
        } else {
            Recognition::No
        }
    }
}

/// Whether a format's output is one file or a directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Container {
    /// One file.
    File,
    /// A directory of files.
    Directory,
}

/// The family a format belongs to, which decides the default output for a source and how
/// non-tensor entries are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Family {
    /// safetensors files: tensors and string metadata, where reshard records non-tensor
    /// entries and the state dict's nesting.
    Safetensors,
    /// `torch.save` and `torch.distributed.checkpoint` (Python values, nested state dicts).
    Torch,
}

impl Family {
    /// The family's name.
    pub fn name(self) -> &'static str {
        match self {
            Family::Safetensors => "safetensors",
            Family::Torch => "torch",
        }
    }
}

/// How a format stores tensors that share their bytes (tied weights, (tied tensors)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Aliasing {
    /// Stores a tied group once, every name pointing at it (`torch.save` storages).
    StoresOnce,
    /// Forbids aliasing: every name keeps its own copy (safetensors).
    Forbidden,
    /// Stores one copy per name (DCP: one item per key).
    CopyPerName,
}

/// What a format is and what it can hold: callers ask these instead of matching on formats.
#[derive(Clone, Debug, Serialize)]
#[non_exhaustive]
pub struct Capabilities {
    /// The name used on the command line and in messages (`hf-storage`).
    pub name: &'static str,
    /// Other names accepted for it.
    pub aliases: &'static [&'static str],
    /// A short description for help texts.
    pub summary: &'static str,
    /// How a user names it in a sentence (`a .pt file`).
    pub noun: &'static str,
    /// One file or a directory.
    pub container: Container,
    /// File name extensions that choose this format for a one-rank output (`pt`, `pth`).
    pub extensions: &'static [&'static str],
    /// The largest world size it holds; `None` when any.
    pub max_world: Option<u32>,
    /// Its family.
    pub family: Family,
    /// How it keeps non-tensor entries, in words (`as Python values`).
    pub extras_kept: &'static str,
    /// Whether it keeps an opaque non-tensor value ([`Opaque`]: known only as its stored
    /// `torch.save` stream) by copying those bytes, as the DCP writers do; other formats
    /// need the value itself and refuse one.
    pub keeps_opaque: bool,
    /// How it stores tied tensors.
    pub aliasing: Aliasing,
    /// Whether reshard writes it (a format read only refuses [`Codec::write`]).
    pub written: bool,
}

/// Facts about a path gathered once for [`Codec::recognize`].
#[derive(Debug)]
pub struct Probe<'a> {
    /// The path.
    pub path: &'a Path,
    /// True when it is a file (otherwise a directory).
    pub is_file: bool,
    /// The first bytes of a file (up to 16), empty for a directory.
    pub head: Vec<u8>,
    /// The names of the regular files in a directory (sorted), empty for a file.
    pub files: Vec<String>,
    /// The names of the sub-folders of a directory (sorted; at most the first 10,000
    /// entries are looked at), empty for a file.
    pub dirs: Vec<String>,
}

/// The names of the regular files (links followed) directly in `dir`, sorted; names that
/// are not UTF-8 are left out.
pub fn file_names(dir: &Path) -> Result<Vec<String>> {
    let mut v = vec![];
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        if let Ok(name) = e.file_name().into_string() {
            if e.path().is_file() {
                v.push(name);
            }
        }
    }
    v.sort();
    Ok(v)
}

/// The names of the sub-folders (links followed) directly in `dir`, sorted; names that are
/// not UTF-8 are left out, and at most the first 10,000 entries are looked at.
fn dir_names(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut v: Vec<String> = entries
        .take(10_000)
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            e.path().is_dir().then_some(name)
        })
        .collect();
    v.sort();
    v
}

/// A format: a handle on its [`Codec`], compared, printed and parsed by name.
#[derive(Clone, Copy)]
pub struct Format(&'static dyn Codec);

impl Format {
    /// One `.safetensors` file.
    pub const SAFETENSORS: Format = Format(&safetensors::Safetensors);
    /// Hugging Face sharded safetensors with `model.safetensors.index.json`.
    pub const HF: Format = Format(&hf::Hf);
    /// Per-rank safetensors shards with `DCP_SHARDING_INFO` (torch's HF storage layout).
    pub const HF_STORAGE: Format = Format(&hf_storage::HfStorage);
    /// A PyTorch Distributed Checkpoint directory (`.metadata` + `__R_I.distcp`).
    pub const DCP: Format = Format(&dcp::Dcp);
    /// One `torch.save` file holding a state dict, which `torch.load(weights_only=True)`
    /// opens.
    pub const PT: Format = Format(&pt::Pt);
    /// A DeepSpeed ZeRO checkpoint folder (`latest` + a tag folder of model and optim
    /// states files).
    pub const DEEPSPEED: Format = Format(&deepspeed::DeepSpeed);
    /// A DeepSpeed Universal Checkpoint (`ds_to_universal`'s `zero/<param>/*.pt` beside the
    /// model states), read.
    pub const DEEPSPEED_UNIVERSAL: Format = Format(&deepspeed::Universal);
    /// A megatron-core `dist_checkpointing` folder (`torch_dist`: `metadata.json`,
    /// `common.pt` and a DCP checkpoint).
    pub const MEGATRON: Format = Format(&megatron::Megatron);
    /// Megatron-LM's per-rank checkpoints (`--ckpt-format torch`: an `iter_NNNNNNN` folder of
    /// `mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`), read as global tensors and written at
    /// the split [`WriteOptions::tp`], `pp` and `ep` ask for.
    pub const MEGATRON_LEGACY: Format = Format(&megatron_legacy::MegatronLegacy);
    /// Megatron-LM's `--ckpt-format fsdp_dtensor` checkpoints (a DCP folder of Megatron-FSDP
    /// DTensors), read under megatron-core's names; told from other DCP checkpoints by their
    /// saved `args`.
    pub const MEGATRON_FSDP: Format = Format(&megatron_fsdp::MegatronFsdp);
    /// verl's FSDP checkpoint folders (`model_world_size_W_rank_R.pt`: per-rank DTensor or
    /// ShardedTensor state dicts), read as global tensors.
    pub const VERL: Format = Format(&verl::Verl);
    /// Meta's torch_checkpointing folders (read only).
    pub const TORCH_CHECKPOINTING: Format = Format(&torch_checkpointing::TorchCheckpointing);

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        self.capabilities().name
    }

    /// What the format can hold.
    pub fn capabilities(self) -> &'static Capabilities {
        self.0.capabilities()
    }

    /// True when the format's output is a directory.
    pub fn is_dir(self) -> bool {
        self.capabilities().container == Container::Directory
    }

    /// True when it holds `world` ranks.
    pub fn holds(self, world: u64) -> bool {
        self.capabilities()
            .max_world
            .is_none_or(|m| world <= m as u64)
    }

    /// The registered formats.
    pub fn all() -> impl Iterator<Item = Format> {
        REGISTRY.iter().copied()
    }

    /// The format named `name` (or one of its aliases).
    pub fn named(name: &str) -> Option<Format> {
        Format::all().find(|f| {
            let c = f.capabilities();
            c.name == name || c.aliases.contains(&name)
        })
    }

    /// The registered names, as `a, b, c or d`.
    pub fn names() -> String {
        or_list(Format::all().map(Format::name))
    }

    /// The format's codec: its reader, writer and recognition.
    pub fn codec(self) -> &'static dyn Codec {
        self.0
    }
}

impl PartialEq for Format {
    fn eq(&self, other: &Format) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Format {}

impl fmt::Debug for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Format {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Format::named(s)
            .ok_or_else(|| format!("unknown format `{s}` (expected {})", Format::names()))
    }
}

/// Tell which format `path` holds: the one format whose marker it carries, else the one that
/// takes it as a fallback. A folder that is none but holds checkpoints in sub-folders (tags,
/// steps) is refused with [`crate::error::Hint::Tag`], naming them.
pub fn detect(path: &Path) -> Result<Format> {
    let found = candidates(path)?;
    match found.as_slice() {
        [f] => Ok(*f),
        [] => {
            let inner = checkpoint_subdirs(path);
            if !inner.is_empty() {
                let shown: Vec<&str> = inner.iter().take(5).map(String::as_str).collect();
                return Err(Error::refused(
                    format!(
                        "{}: holds {} checkpoint(s) in sub-folders ({}{}): choose one",
                        path.display(),
                        inner.len(),
                        shown.join(", "),
                        if inner.len() > shown.len() {
                            ", …"
                        } else {
                            ""
                        }
                    ),
                    crate::error::Hint::Tag,
                ));
            }
            Err(Error::format(
                path,
                format!(
                    "is not a checkpoint: expected {}",
                    or_list(Format::all().map(|f| f.capabilities().noun))
                ),
            ))
        }
        several => Err(Error::format(
            path,
            format!(
                "is ambiguous: it looks like {}",
                or_list(several.iter().map(|f| f.capabilities().noun))
            ),
        )),
    }
}

/// The formats that recognize `path`: those whose marker it carries, else those that take it
/// as a fallback.
fn candidates(path: &Path) -> Result<Vec<Format>> {
    let meta = std::fs::metadata(path).at(path)?;
    let mut head = vec![];
    if meta.is_file() {
        let mut buf = [0u8; 16];
        let n = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read(&mut f, &mut buf))
            .unwrap_or(0);
        head.extend_from_slice(&buf[..n]);
    }
    let (files, dirs) = if meta.is_file() {
        (vec![], vec![])
    } else {
        (file_names(path)?, dir_names(path))
    };
    let probe = Probe {
        path,
        is_file: meta.is_file(),
        head,
        files,
        dirs,
    };
    let mut markers = vec![];
    let mut fallbacks = vec![];
    for f in Format::all() {
        match f.codec().recognize(&probe) {
            Recognition::Marker => markers.push(f),
            Recognition::Fallback => fallbacks.push(f),
            Recognition::No => {}
        }
    }
    Ok(if markers.is_empty() {
        fallbacks
    } else {
        markers
    })
}

/// The checkpoints a folder holds in sub-folders, when it is not a checkpoint itself: the
/// names of the sub-folders a format recognizes, sorted (step folders `step-<n>` and
/// Megatron-LM's `iter_<n>` by `n`);
/// empty when `dir` is a checkpoint (or no folder). At most the first 10,000 entries are
/// looked at.
pub fn checkpoints_in(dir: &Path) -> Vec<String> {
    if !dir.is_dir() || candidates(dir).is_ok_and(|c| !c.is_empty()) {
        return vec![];
    }
    let mut v = checkpoint_subdirs(dir);
    v.sort_by_key(|n| (step_of(n), n.clone()));
    v
}

/// The step number of a step folder's name: `step-1000` (torchtitan's layout) or
/// `iter_0001000` (Megatron-LM's, [`megatron_legacy::iteration_folder`]).
pub fn step_of(name: &str) -> Option<u64> {
    let n = name
        .strip_prefix("step-")
        .or_else(|| name.strip_prefix("iter_").filter(|n| n.len() >= 7))?;
    (!n.is_empty() && n.len() <= 19 && n.bytes().all(|b| b.is_ascii_digit()))
        .then(|| n.parse().ok())
        .flatten()
}

/// The newest checkpoint of a folder of step folders (`step-<n>` or `iter_<n>`, the largest n), when
/// `dir` is not a checkpoint itself and every checkpoint in it is a step folder.
pub fn latest_step(dir: &Path) -> Option<String> {
    let inner = checkpoints_in(dir);
    if inner.is_empty() || !inner.iter().all(|n| step_of(n).is_some()) {
        return None;
    }
    inner.into_iter().max_by_key(|n| step_of(n))
}

/// The names of the sub-folders of `dir` that a format recognizes (sorted; at most the first
/// 10,000 entries of `dir` are looked at).
fn checkpoint_subdirs(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return vec![];
    };
    let mut out: Vec<String> = entries
        .take(10_000)
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            let p = e.path();
            (p.is_dir() && candidates(&p).is_ok_and(|c| !c.is_empty())).then_some(name)
        })
        .collect();
    out.sort();
    out
}

/// `a, b or c`.
fn or_list<'a>(items: impl Iterator<Item = &'a str>) -> String {
    let v: Vec<&str> = items.collect();
    match v.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// The output format chosen when none is given, and why.
#[derive(Clone, Debug, Serialize)]
pub struct Choice {
    /// The format.
    pub format: Format,
    /// Why it was chosen, in words (`DST ends in .pt`).
    pub reason: String,
}

/// The output format for `dst` at world size `world` from a `source` checkpoint. For one
/// rank: the file format whose extension `dst` has, else the consolidated directory format
/// (Hugging Face sharded safetensors). For more: the source's own format when it holds them
/// in a directory (DCP stays DCP), else the directory format of the source's family that
/// does (per-rank safetensors shards for a safetensors source).
pub fn choose(dst: Option<&Path>, world: u64, source: Format) -> Choice {
    let ext = dst
        .and_then(|d| d.extension())
        .and_then(|e| e.to_str())
        .unwrap_or("");
    let dirs = || Format::all().filter(|f| f.is_dir() && f.holds(world));
    if world == 1 {
        if let Some(f) =
            Format::all().find(|f| !ext.is_empty() && f.capabilities().extensions.contains(&ext))
        {
            return Choice {
                format: f,
                reason: format!("the destination ends in .{ext}"),
            };
        }
        let format = dirs()
            .find(|f| f.capabilities().max_world == Some(1))
            .unwrap_or(Format::HF);
        return Choice {
            format,
            reason: "a consolidated model in a directory".into(),
        };
    }
    if source.is_dir() && source.holds(world) {
        return Choice {
            format: source,
            reason: "the source's format".into(),
        };
    }
    let family = source.capabilities().family;
    match dirs().find(|f| f.capabilities().family == family) {
        Some(format) => Choice {
            format,
            reason: format!("the {} family's format for {world} ranks", family.name()),
        },
        None => Choice {
            format: dirs().next().unwrap_or(Format::HF_STORAGE),
            reason: format!("a format that holds {world} ranks"),
        },
    }
}

/// The output format of a conversion to `dst` at `world` ranks from a `source` checkpoint,
/// and why: `asked` when given (the reason is then `None`), else [`choose`]'s. The one place
/// the front door decides it, for a conversion and for its plan alike. `dst` is `None` for a
/// plan made before the destination is named: nothing is checked against a name then.
///
/// Refused when the name of `dst` says another output than the format writes, rather than
/// overruled: a name with a file format's extension ([`Capabilities::extensions`]:
/// `x.safetensors`, `x.pt`) for a folder format or another file format, and a name ending in
/// `/` for a one-file format. The refusal says what to name instead; its [`Hint`] says which
/// setting would let the name through.
///
/// [`Hint`]: crate::error::Hint
pub fn output_format(
    dst: Option<&Path>,
    world: u64,
    source: Format,
    asked: Option<Format>,
) -> Result<(Format, Option<String>)> {
    let (format, reason) = match asked {
        Some(f) => (f, None),
        None => {
            let Choice { format, reason } = choose(dst, world, source);
            (format, Some(reason))
        }
    };
    if let Some(dst) = dst {
        check_name(dst, format, world, asked.is_some())?;
    }
    Ok((format, reason))
}

/// The file format whose extension ([`Capabilities::extensions`]) the last component of
/// `dst` has, and that extension.
pub fn named_by(dst: &Path) -> Option<(Format, &'static str)> {
    let ext = dst.extension()?.to_str()?;
    Format::all().find_map(|f| {
        let e = f.capabilities().extensions.iter().find(|e| **e == ext)?;
        Some((f, *e))
    })
}

/// Whether `dst` is written as a folder: its text ends in `/` (or the platform's separator).
fn names_folder(dst: &Path) -> bool {
    let text = dst.as_os_str().to_string_lossy();
    text.ends_with('/') || text.ends_with(std::path::MAIN_SEPARATOR)
}

/// Refuse a destination whose name says another output than `format` writes at `world`
/// ranks (`asked`: the format was asked for, not chosen); see [`output_format`].
fn check_name(dst: &Path, format: Format, world: u64, asked: bool) -> Result<()> {
    let shown = dst.display();
    let what = if asked {
        format!("the {format} output asked for")
    } else {
        format!("the {format} output for {world} rank(s)")
    };
    if names_folder(dst) {
        if format.is_dir() {
            return Ok(());
        }
        let text = dst.to_string_lossy();
        let file = text.trim_end_matches(['/', std::path::MAIN_SEPARATOR]);
        let ext = format.capabilities().extensions.first().copied();
        let suggestion = match ext {
            Some(e) if !file.ends_with(&format!(".{e}")) => format!("{file}.{e}"),
            _ => file.to_string(),
        };
        return Err(Error::usage(format!(
            "{shown}: a name ending in / is a folder, but {what} is one file: name a file such as {suggestion}"
        )));
    }
    let Some((named, ext)) = named_by(dst) else {
        return Ok(());
    };
    if format == named {
        return Ok(());
    }
    if format.is_dir() {
        let folder = format!("{}/", dst.with_extension("").display());
        let why = if asked {
            format!("{what} is a folder")
        } else {
            format!("{world} rank(s) are written as a folder ({format})")
        };
        let msg = format!(
            "{shown}: a .{ext} name is one file, but {why}: name a folder such as {folder}"
        );
        if asked && named.holds(world) {
            return Err(Error::refused(msg, Hint::FormatFromName(ext)));
        }
        let family = named.capabilities().family;
        let alternative = Format::all()
            .find(|f| f.is_dir() && f.holds(world) && f.capabilities().family == family)
            .filter(|f| !asked && *f != format);
        return Err(match alternative {
            Some(f) => Error::refused(msg, Hint::FolderFormat(f.name())),
            None => Error::usage(msg),
        });
    }
    // another file format, which only asking for it gives
    let renamed = match format.capabilities().extensions.first() {
        Some(e) => dst.with_extension(e).display().to_string(),
        None => format!("{} without the .{ext}", dst.display()),
    };
    Err(Error::refused(
        format!(
            "{shown}: a .{ext} name is a .{ext} file, but {what} is {}: name it {renamed}",
            format.capabilities().noun
        ),
        Hint::FormatFromName(ext),
    ))
}

/// Writer settings.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Largest file of a Hugging Face sharded output, its header included (a tensor too large
    /// for that gets a file of its own).
    pub max_shard_size: u64,
    /// String metadata to carry into safetensors headers.
    pub metadata: BTreeMap<String, String>,
    /// Non-tensor entries: the torch family stores them as Python values, the safetensors
    /// family records them in its string metadata ([`Capabilities::extras_kept`]).
    pub extras: Vec<Extra>,
    /// Nesting of flat names in the original state dict; names absent here are top-level.
    pub paths: BTreeMap<String, Vec<KeyPart>>,
    /// Groups of tied target names (see `inspect`), stored once by formats whose
    /// [`Capabilities::aliasing`] is [`Aliasing::StoresOnce`]; other formats write every name.
    pub ties: Vec<Vec<String>>,
    /// The name of the checkpoint inside its folder, for formats that keep several (a
    /// DeepSpeed tag): the source's ([`Checkpoint::tag`]) when it has one.
    pub tag: Option<String>,
    /// The ZeRO stage of a DeepSpeed output (1, 2 or 3); `None`: the source's.
    pub zero_stage: Option<u8>,
    /// Files to write beside the tensors where the format keeps them (a Hugging Face
    /// folder's `config.json`): the source's [`Checkpoint::companions`], overridden by name
    /// by those given here.
    pub companions: Vec<(String, Vec<u8>)>,
    /// The tensor-parallel size of a `megatron-legacy` output; `None`: the source's (its
    /// saved arguments').
    pub tp: Option<u64>,
    /// The pipeline-parallel size of a `megatron-legacy` output; `None`: the source's.
    pub pp: Option<u64>,
    /// The expert-parallel size of a `megatron-legacy` output; `None`: the source's.
    pub ep: Option<u64>,
    /// Write a `megatron` output as a Megatron-LM save directory (the tracker file beside an
    /// `iter_{N:07}` folder) even when the source is not one; a source read from a save
    /// directory ([`WriteOptions::tag`] `iter_{N:07}` or `release`) gives one anyway.
    pub save_dir: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            max_shard_size: 5_000_000_000,
            metadata: BTreeMap::new(),
            extras: vec![],
            paths: BTreeMap::new(),
            ties: vec![],
            tag: None,
            zero_stage: None,
            companions: vec![],
            tp: None,
            pp: None,
            ep: None,
            save_dir: false,
        }
    }
}

/// A writer's answer: the files to create and every tensor's layout over them.
#[derive(Clone, Debug)]
pub struct Output {
    /// Files to create; [`crate::layout::Loc::file`] indexes this list.
    pub files: Vec<OutputFile>,
    /// The tensors as they will be laid out in those files.
    pub tensors: Vec<TensorLayout>,
    /// Tensors of `tensors` that are a second copy of a target tensor, as
    /// `(output name, target name)`: formats that store a tensor twice, possibly in another
    /// dtype (DeepSpeed keeps the model-dtype weights beside the fp32 master copy). The plan
    /// fills them from the target tensor's source.
    pub copies: Vec<(String, String)>,
}

/// Lay out `target` (over `world` ranks) in `format`; refused when the format holds fewer
/// ranks.
pub fn write(
    format: Format,
    target: &[TargetTensor],
    world: u32,
    opts: &WriteOptions,
) -> Result<Output> {
    if format.capabilities().max_world == Some(0) {
        // a format reshard only reads: its writer says so
        return format.codec().write(target, world, opts);
    }
    if format != Format::MEGATRON_LEGACY {
        if let Some((flag, _)) = [("--tp", opts.tp), ("--pp", opts.pp), ("--ep", opts.ep)]
            .into_iter()
            .find(|(_, v)| v.is_some())
        {
            return Err(Error::usage(format!(
                "{flag} splits a megatron-legacy output; {} is split by --to M or a --layout file",
                format.capabilities().noun
            )));
        }
    }
    if !format.holds(world as u64) {
        return Err(Error::TooManyRanks {
            format: format.name(),
            noun: format.capabilities().noun,
            max: format.capabilities().max_world.unwrap_or(u32::MAX),
            world: world as u64,
        });
    }
    if !format.capabilities().keeps_opaque {
        // (a legacy output writes only the `common.pt` entries, in every rank file)
        if let Some((e, reason)) = opts
            .extras
            .iter()
            .filter(|e| format != Format::MEGATRON_LEGACY || e.origin == megatron::COMMON_ORIGIN)
            .find_map(|e| Some((e, e.opaque_reason()?)))
        {
            return Err(Error::usage(format!(
                "{reason}; {} needs it as a value (a DCP output keeps its stored bytes): \
                 leave it out with --exclude '{}' (exclude=[{:?}] in Python)",
                format.capabilities().noun,
                e.name,
                e.name
            )));
        }
    }
    format.codec().write(target, world, opts)
}

/// Whether `rel` (a `/`-separated path inside a destination; `""` for a single-file one) is
/// an object that makes a checkpoint loadable — `.metadata` (or `__<R>.metadata`), a
/// Hugging Face `*.index.json`, DeepSpeed's `latest`, megatron's `metadata.json`,
/// Megatron-LM's `latest_checkpointed_iteration.txt`, or the
/// one file — and so is written after every other object when uploading.
pub fn loadable_last(rel: &str) -> bool {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    rel.is_empty()
        || name == ".metadata"
        || (name.starts_with("__") && name.ends_with(".metadata"))
        || name.ends_with(".index.json")
        || name == "latest"
        || name == "metadata.json"
        || name == megatron_legacy::TRACKER
}
