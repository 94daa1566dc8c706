//! The checkpoint a reader produces and every other part of reshard consumes — the files,
//! each tensor's [`TensorLayout`] over them, non-tensor entries ([`Extra`]), the nesting of
//! flat keys ([`KeyPart`]) and the checksums the files record ([`RecordCrc`]), with the
//! format it was read as and the storage it holds on to (local files or an object store's mirror, scratch files, a
//! lazy reader's locator). Opening detects the format through the registry at this crate's
//! root and validates the result; nothing in this module knows a file format.

use crate::error::{Error, IoContext, Result};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
use crate::Format;
use reshard_core::model::{Extra, KeyPart, RecordCrc, Weights};
use reshard_storage::{Opened, Sources, Storage};
use serde::Serialize;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How to open a checkpoint: which checkpoint of a folder of several, and which copy of the
/// parameters to read where a format keeps two. The default opens the folder's own (for
/// DeepSpeed, the tag its `latest` file names; for a Megatron-LM save directory, the
/// iteration its `latest_checkpointed_iteration.txt` names) with each format's default
/// weights.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenOptions {
    /// A checkpoint in a sub-folder of the path given (`PATH/<tag>`: a DeepSpeed tag such as
    /// `global_step100`, a torchtitan step folder such as `step-1000`).
    pub tag: Option<String>,
    /// A step of a folder of step folders: torchtitan's `step-N`, or Megatron-LM's
    /// `iter_{N:07}` in a save directory. Not with [`OpenOptions::tag`].
    pub step: Option<u64>,
    /// Where parameter values come from; `None`: the format's default (master weights).
    pub weights: Option<Weights>,
}

impl OpenOptions {
    /// The path to open for `path` under these options: `path/<tag>` when a tag is given
    /// (checked to be one folder name, and a folder); for a step, its step folder
    /// ([`crate::megatron_legacy::step_folder`]); without either, the iteration a
    /// Megatron-LM save directory's tracker file names, else the newest step folder
    /// (`step-<n>`, `iter_<n>`) of a folder of them, else `path` itself.
    pub fn resolve(&self, path: &Path) -> Result<PathBuf> {
        if let Some(step) = self.step {
            if self.tag.is_some() {
                return Err(Error::usage("give a tag or a step, not both"));
            }
            return crate::megatron_legacy::step_folder(path, step);
        }
        let Some(tag) = &self.tag else {
            // a Megatron-LM save directory: the iteration its tracker file names
            if let Some(dir) = crate::megatron_legacy::tracked(path)? {
                return Ok(dir);
            }
            // a folder of step folders (torchtitan): the newest
            return Ok(match crate::latest_step(path) {
                Some(step) => path.join(step),
                None => path.to_path_buf(),
            });
        };
        let plain = !tag.is_empty()
            && tag != "."
            && tag != ".."
            && !tag.contains(['/', '\\', '\0'])
            && !tag.chars().any(char::is_control);
        if !plain {
            return Err(Error::usage(format!(
                "tag `{}` is not a folder name",
                crate::torch::short(tag)
            )));
        }
        let dir = path.join(tag);
        if !dir.is_dir() {
            return Err(Error::format(
                path,
                format!(
                    "has no checkpoint tagged `{}` ({} is not a folder)",
                    crate::torch::short(tag),
                    dir.display()
                ),
            ));
        }
        Ok(dir)
    }
}

/// A checkpoint as a reader sees it: its files, and every tensor's layout over them.
#[derive(Clone, Debug, Serialize)]
pub struct Checkpoint {
    /// The format it was read as.
    pub format: Format,
    /// The path given (file or directory).
    pub path: PathBuf,
    /// Data files; [`crate::layout::Loc::file`] indexes this list.
    pub files: Vec<PathBuf>,
    /// The checkpoint's other files: those that hold no tensor data but belong to it (DCP's
    /// `.metadata` and `meta.pt`, a Hugging Face index and `config.json`, DeepSpeed's
    /// `latest`). With [`Checkpoint::files`], every file a conversion writes for it
    /// ([`Checkpoint::disk_files`]).
    pub side_files: Vec<PathBuf>,
    /// Number of ranks (shards) it was written by.
    pub ranks: u32,
    /// The tensors, in the checkpoint's own order.
    pub tensors: Vec<TensorLayout>,
    /// String metadata carried by the checkpoint (safetensors `__metadata__`).
    pub metadata: BTreeMap<String, String>,
    /// Non-tensor entries, in checkpoint order.
    pub extras: Vec<Extra>,
    /// Nesting of flat keys (tensors and extras) in the original state dict, when the format
    /// records it (DCP `planner_data`); keys absent here are top-level.
    pub paths: BTreeMap<String, Vec<KeyPart>>,
    /// What wrote the checkpoint, where that can be told (e.g. `torch >= 2.4 (DCP 1.0.0)`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub producer: Option<String>,
    /// What the writer recorded of the save itself, where the format keeps it (DCP's
    /// `Metadata.storage_meta`, torch >= 2.4): the id of the checkpoint and of the save, and
    /// the modules saved. `None` where nothing was recorded.
    #[serde(skip)]
    pub saved: Option<SavedMeta>,
    /// The checkpoint's name inside its folder of several: the DeepSpeed tag read
    /// (`global_step100`), or the sub-folder opened (`--tag`, a torchtitan `step-1000`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Small files that come with the checkpoint and go with an output that keeps them (a
    /// Hugging Face model's `config.json` and `generation_config.json`): name and bytes, found
    /// beside the checkpoint's files or in the folder given.
    #[serde(skip)]
    pub companions: Vec<(String, Vec<u8>)>,
    /// Scratch files the reader created (e.g. decompressed zstd items listed in `files`);
    /// they are deleted when the last clone of the checkpoint is dropped.
    #[serde(skip)]
    pub scratch: Vec<std::sync::Arc<tempfile::TempPath>>,
    /// CRC-32s the files record of their own bytes: torch.save data records (DCP items,
    /// `.pt`), and the `reshard.crc32` of safetensors files reshard wrote.
    #[serde(skip)]
    pub checksums: Vec<RecordCrc>,
    /// What finds the pieces a lazy reader left pending ([`Loc::pending`]); `None` when every
    /// piece is located.
    #[serde(skip)]
    pub locator: Option<Arc<dyn Locate>>,
    /// Where the files are ([`Storage::ensure`] before reading their bytes): local files,
    /// or the mirror of a checkpoint read from object storage, kept as long as the
    /// checkpoint is.
    #[serde(skip)]
    pub(crate) storage: Arc<dyn Storage>,
}

/// What a checkpoint's writer recorded of the save itself ([`Checkpoint::saved`]): for DCP,
/// torch's `StorageMeta` (`Metadata.storage_meta`) but for its `load_id`, which a reader sets.
/// Fields the file does not hold, or holds as another type, are `None` (`modules`: empty).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedMeta {
    /// The checkpoint's id as the writer gave it: a path or a str.
    pub checkpoint_id: Option<SavedId>,
    /// The id of the save (a UUID, torch's `save_id`).
    pub save_id: Option<String>,
    /// The modules the writer recorded (torch's `modules`).
    pub modules: Vec<String>,
}

/// A [`SavedMeta::checkpoint_id`]: its text, and whether it was saved as a path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedId {
    /// The text: a str as it is; a path as Python's `str()` of it would be (see
    /// [`PathFlavor::render`]).
    pub text: String,
    /// The kind of path it was (a `pathlib` path object); `None` for a str.
    pub path: Option<PathFlavor>,
}

/// The kind of a `pathlib` path a pickle holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathFlavor {
    /// `pathlib.PosixPath` (or `PurePosixPath`): `/`-separated.
    Posix,
    /// `pathlib.WindowsPath` (or `PureWindowsPath`): `\`-separated.
    Windows,
}

impl PathFlavor {
    /// `posix` or `windows`.
    pub fn name(self) -> &'static str {
        match self {
            PathFlavor::Posix => "posix",
            PathFlavor::Windows => "windows",
        }
    }

    /// The path made of `parts` (the arguments of the path class, as its pickle holds them)
    /// as text. Posix: as Python's `str(PurePosixPath(*parts))` — a part starting with `/`
    /// starts again from it, empty and `.` components are dropped, a leading `//` (exactly
    /// two) is kept, and nothing at all is `.`. Windows: the parts joined with `\` (`/` read
    /// as `\`, no separator doubled), without Python's drive and root rules; `PureWindowsPath`
    /// of the text gives the same path for the parts torch writes (a drive, then names).
    pub fn render<'a>(self, parts: impl IntoIterator<Item = &'a str>) -> String {
        match self {
            PathFlavor::Posix => {
                let mut root = "";
                let mut names: Vec<&str> = vec![];
                for part in parts {
                    if part.starts_with('/') {
                        names.clear();
                        let slashes = part.len() - part.trim_start_matches('/').len();
                        root = if slashes == 2 { "//" } else { "/" };
                    }
                    names.extend(part.split('/').filter(|n| !n.is_empty() && *n != "."));
                }
                let text = format!("{root}{}", names.join("/"));
                if text.is_empty() {
                    ".".to_string()
                } else {
                    text
                }
            }
            PathFlavor::Windows => {
                let mut text = String::new();
                for part in parts {
                    let part = part.replace('/', "\\");
                    if part.is_empty() {
                        continue;
                    }
                    if !text.is_empty() && !text.ends_with('\\') && !part.starts_with('\\') {
                        text.push('\\');
                    }
                    text.push_str(&part);
                }
                text
            }
        }
    }
}

/// Finds where the pieces a lazy reader left pending ([`Loc::pending`]) really are: the
/// format's own parsing of the items that hold them, with the checks an eager open makes.
pub trait Locate: Send + Sync + std::fmt::Debug {
    /// The locations of `pieces` (each of its tensor), in order, read from the items that
    /// hold them and checked against the tensor's dtype and the piece's region; the first
    /// error in that order.
    fn locate(&self, pieces: &[(&TensorLayout, &Piece)]) -> Result<Vec<Loc>>;
}

impl Checkpoint {
    /// Open a checkpoint of any supported format, detected from `path`, and validate it.
    /// A folder of torchtitan step folders opens its newest step (see [`OpenOptions`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        Checkpoint::open_with(path, None, &OpenOptions::default())
    }

    /// Open `path` as a checkpoint of `format` (no detection), and validate it.
    pub fn open_as(path: impl AsRef<Path>, format: Format) -> Result<Checkpoint> {
        let opened = reshard_storage::open(path.as_ref())?;
        match opened.url {
            None => Self::opened(&opened.root, format, false, None),
            Some(_) => Self::resolved_at(opened, Some(format), &OpenOptions::default(), false),
        }
    }

    /// [`Checkpoint::open`] under `opts`: the checkpoint tagged `opts.tag` inside `path`, with
    /// parameter values from `opts.weights`; `format` when given (no detection).
    pub fn open_with(
        path: impl AsRef<Path>,
        format: Option<Format>,
        opts: &OpenOptions,
    ) -> Result<Checkpoint> {
        Self::resolved(path.as_ref(), format, opts, false)
    }

    /// Open a checkpoint for reading parts of it ([`Checkpoint::read_region`], the
    /// `reshard::load` functions): like [`Checkpoint::open`], but the per-item headers of a DCP
    /// checkpoint are read only when a read needs that item (a rank loading its shards of a
    /// million-chunk checkpoint touches the `.metadata` and its own items, nothing else).
    /// The layouts are validated as by `open`; an error in an item's own header is reported
    /// by the read that needs it. Pieces left to locate have [`Loc::pending`] set: a
    /// conversion or a plan needs a checkpoint from [`Checkpoint::open`].
    pub fn open_lazy(path: impl AsRef<Path>, format: Option<Format>) -> Result<Checkpoint> {
        Self::open_lazy_with(path, format, &OpenOptions::default())
    }

    /// [`Checkpoint::open_lazy`] under `opts` (see [`Checkpoint::open_with`]).
    pub fn open_lazy_with(
        path: impl AsRef<Path>,
        format: Option<Format>,
        opts: &OpenOptions,
    ) -> Result<Checkpoint> {
        Self::resolved(path.as_ref(), format, opts, true)
    }

    /// `path` resolved under `opts` (its tag), the format detected unless given, opened. An
    /// object-store URL is opened through a local mirror, fetching what opening reads.
    fn resolved(
        path: &Path,
        format: Option<Format>,
        opts: &OpenOptions,
        lazy: bool,
    ) -> Result<Checkpoint> {
        Self::resolved_at(reshard_storage::open(path)?, format, opts, lazy)
    }

    /// [`Checkpoint::resolved`] of a location opened.
    fn resolved_at(
        opened: Opened,
        format: Option<Format>,
        opts: &OpenOptions,
        lazy: bool,
    ) -> Result<Checkpoint> {
        let storage = opened.storage;
        let mut ck = Self::resolved_in(&opened.root, format, opts, lazy, &*storage)
            .map_err(|e| storage.rename(e))?;
        if let Some(url) = opened.url {
            ck.path = PathBuf::from(url);
        }
        ck.storage = storage;
        Ok(ck)
    }

    /// [`Checkpoint::resolved`] of the local path `path`, whose files `storage` holds: where
    /// it fetches (an object store's mirror), what opening reads is fetched first.
    fn resolved_in(
        path: &Path,
        format: Option<Format>,
        opts: &OpenOptions,
        lazy: bool,
        storage: &dyn Storage,
    ) -> Result<Checkpoint> {
        let fetch = |p: &Path, spans: &[(u64, u64)]| storage.ensure(p, spans);
        // the files it fetches from (none for local files)
        let listed = storage.files();
        let among = |keep: &dyn Fn(&Path) -> bool| -> Vec<(PathBuf, u64)> {
            listed.iter().filter(|(p, _)| keep(p)).cloned().collect()
        };
        // the small files beside the checkpoint's folders first: DeepSpeed's `latest`, which
        // the resolution reads, and the companions (`config.json`)
        let top = among(&|p| p.parent() == Some(path));
        crate::index::small_whole_else(&top, &fetch, crate::index::later)?;
        let resolved = opts.resolve(path)?;
        let files = among(&|p| p.starts_with(&resolved));
        if let [(file, size)] = files.as_slice() {
            // one object: the first bytes, by which its format is told
            if *file == resolved {
                fetch(file, &[(0, (*size).min(16))])?;
            }
        }
        let format = match format {
            Some(f) => f,
            None => crate::detect(&resolved)?,
        };
        if storage.fetches() {
            // what the format's reader reads before any tensor data
            format.codec().index(&files, &fetch)?;
        }
        let mut ck = Self::opened(&resolved, format, lazy, opts.weights)?;
        if ck.tag.is_none() && resolved != path {
            ck.tag = resolved
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string);
        }
        // a verl checkpoint keeps the model's config in its `huggingface/` folder
        ck.companions = companions(&[&resolved, path, &resolved.join("huggingface")])?;
        Ok(ck)
    }

    fn opened(
        path: &Path,
        format: Format,
        lazy: bool,
        weights: Option<Weights>,
    ) -> Result<Checkpoint> {
        let ck = match (weights, lazy) {
            (Some(w), _) => format.codec().read_weights(path, w)?,
            (None, true) => format.codec().read_lazy(path)?,
            (None, false) => format.codec().read(path)?,
        };
        ck.validate().map_err(|e| match e {
            Error::Layout { .. } => Error::format(path, e.to_string()),
            e => e,
        })?;
        Ok(ck)
    }

    /// A checkpoint holding only tensors and string metadata (the safetensors family): no
    /// non-tensor entries, no nesting, no known producer.
    pub fn of_tensors(
        format: Format,
        path: &Path,
        files: Vec<PathBuf>,
        ranks: u32,
        tensors: Vec<TensorLayout>,
        metadata: BTreeMap<String, String>,
    ) -> Checkpoint {
        Checkpoint {
            format,
            path: path.to_path_buf(),
            files,
            side_files: vec![],
            ranks,
            tensors,
            metadata,
            extras: vec![],
            paths: BTreeMap::new(),
            producer: None,
            saved: None,
            tag: None,
            companions: vec![],
            scratch: vec![],
            checksums: vec![],
            locator: None,
            storage: reshard_storage::local(),
        }
    }

    /// `t` (a tensor of this checkpoint) ready to read `regions` of: [`Checkpoint::located_many`]
    /// of one.
    pub fn located<'a>(
        &self,
        t: &'a TensorLayout,
        regions: Option<&[&Region]>,
    ) -> Result<Cow<'a, TensorLayout>> {
        let mut v = self.located_many(&[(t, regions)])?;
        Ok(v.pop().expect("one tensor in, one out"))
    }

    /// Each `(t, regions)` of `want` (tensors of this checkpoint) ready to read those regions
    /// of: `t` itself when every piece is located; otherwise, located, its pieces that
    /// overlap one of `regions` (all of them for `None`) — the only items read, all in one
    /// pass of the format's locator.
    pub fn located_many<'a>(
        &self,
        want: &[(&'a TensorLayout, Option<&[&Region]>)],
    ) -> Result<Vec<Cow<'a, TensorLayout>>> {
        let needs = |p: &Piece, regions: Option<&[&Region]>| {
            regions.is_none_or(|rs| rs.iter().any(|r| p.region.intersect(r).is_some()))
        };
        let mut pending: Vec<(&TensorLayout, &Piece)> = vec![];
        for &(t, regions) in want {
            pending.extend(
                t.pieces
                    .iter()
                    .filter(|p| p.loc.pending.is_some() && needs(p, regions))
                    .map(|p| (t, p)),
            );
        }
        let mut locs = match (&self.locator, pending.first()) {
            (_, None) => vec![],
            (Some(l), Some(_)) => l.locate(&pending)?,
            (None, Some((t, _))) => {
                return Err(Error::layout(
                    &t.name,
                    "has pieces left to locate and no reader to locate them",
                ))
            }
        }
        .into_iter();
        let mut out = Vec::with_capacity(want.len());
        for &(t, regions) in want {
            if t.pieces.iter().all(|p| p.loc.pending.is_none()) {
                out.push(Cow::Borrowed(t));
                continue;
            }
            let mut pieces = vec![];
            for p in t.pieces.iter().filter(|p| needs(p, regions)) {
                let loc = match p.loc.pending {
                    None => p.loc.clone(),
                    Some(_) => locs.next().expect("one location per pending piece"),
                };
                pieces.push(Piece {
                    rank: p.rank,
                    region: p.region.clone(),
                    loc,
                });
            }
            out.push(Cow::Owned(TensorLayout {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                pieces,
            }));
        }
        Ok(out)
    }

    /// Check every tensor's pieces tile it exactly and lie within their files.
    pub fn validate(&self) -> Result<()> {
        let sizes: Vec<u64> = self
            .files
            .iter()
            .map(|f| std::fs::metadata(f).map(|m| m.len()).at(f))
            .collect::<Result<_>>()?;
        // Tilings in parallel (the first error in tensor order), then every piece's bytes.
        use rayon::prelude::*;
        let tilings: Vec<Result<()>> = self.tensors.par_iter().map(|t| t.validate()).collect();
        tilings.into_iter().collect::<Result<()>>()?;
        for t in &self.tensors {
            let elem = t.dtype.size() as u64;
            for p in &t.pieces {
                // A pending piece lies in its item: the item must lie in the file.
                let len = p.loc.pending.unwrap_or_else(|| p.span_bytes(elem));
                let end = p.loc.offset.saturating_add(len);
                let size = sizes.get(p.loc.file as usize).copied().unwrap_or(0);
                if end > size {
                    let f = self
                        .files
                        .get(p.loc.file as usize)
                        .cloned()
                        .unwrap_or_default();
                    return Err(Error::format(
                        f,
                        format!(
                            "is truncated: tensor `{}` {} needs bytes up to {end}, the file has {size}",
                            t.name, p.region
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The checkpoint's files and where they are, as the readers of their bytes take them.
    pub fn sources(&self) -> Sources<'_> {
        Sources {
            paths: &self.files,
            storage: &*self.storage,
        }
    }

    /// Where the checkpoint's files are.
    pub fn storage(&self) -> &dyn Storage {
        &*self.storage
    }

    /// How to name the checkpoint's file `path` to the user: its object's URL for a
    /// checkpoint read from object storage, else the path.
    pub fn shown(&self, path: &Path) -> PathBuf {
        self.storage
            .shown(path)
            .map(PathBuf::from)
            .unwrap_or_else(|| path.to_path_buf())
    }

    /// Groups of tied tensors (same dtype, shape and bytes), by name.
    pub fn tied_names(&self) -> Result<Vec<Vec<String>>> {
        crate::ties::tied_names(self)
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorLayout> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Read `region` of tensor `name` as row-major little-endian bytes of `dtype` (the
    /// tensor's own dtype when `None`), touching only the bytes of the pieces that overlap it.
    pub fn read_region(
        &self,
        name: &str,
        region: &Region,
        dtype: Option<DType>,
    ) -> Result<Vec<u8>> {
        let t = self.checked(name, region, dtype)?;
        let dtype = dtype.unwrap_or(t.dtype);
        let t = self.located(t, Some(&[region]))?;
        let mut out = vec![0u8; (region.volume() as usize) * dtype.size()];
        crate::read::read_into(
            &crate::plan::region_ops(&t, region, dtype),
            self.sources(),
            &mut out,
        )?;
        Ok(out)
    }

    /// [`Checkpoint::read_region`] into the caller's buffer `out`, which must hold exactly
    /// `region.volume()` elements of `dtype` (e.g. a tensor's memory).
    pub fn read_region_into(
        &self,
        name: &str,
        region: &Region,
        dtype: Option<DType>,
        out: &mut [u8],
    ) -> Result<()> {
        let t = self.checked(name, region, dtype)?;
        let dtype = dtype.unwrap_or(t.dtype);
        check_buffer(name, region, dtype, out.len())?;
        let t = self.located(t, Some(&[region]))?;
        let ops = crate::plan::region_ops(&t, region, dtype);
        crate::read::read_into(&ops, self.sources(), out)
    }

    /// The tensor `name`, when `region` lies within its shape and it casts to `dtype` (its
    /// own when `None`).
    pub fn checked(
        &self,
        name: &str,
        region: &Region,
        dtype: Option<DType>,
    ) -> Result<&TensorLayout> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::usage(format!("{}: no tensor `{name}`", self.path.display())))?;
        let dtype = dtype.unwrap_or(t.dtype);
        if region.ndim() != t.shape.len() || !Region::full(&t.shape).contains(region) {
            return Err(Error::layout(
                name,
                format!("region {region} is outside the shape {:?}", t.shape),
            ));
        }
        if !t.dtype.can_cast_to(dtype) {
            return Err(Error::layout(
                name,
                format!("cannot convert {} to {dtype}", t.dtype),
            ));
        }
        Ok(t)
    }

    /// Total bytes of all tensors (each counted once).
    pub fn nbytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes()).sum()
    }

    /// Every file the checkpoint consists of, with its size in bytes: its data files (less
    /// the reader's scratch files), then its [`Checkpoint::side_files`]. What `convert`
    /// counts of the outputs it writes: its files, headers and metadata included.
    pub fn disk_files(&self) -> Vec<(PathBuf, u64)> {
        let listed = self.storage.files();
        let size = |p: &Path| {
            listed
                .iter()
                .find(|(q, _)| q == p)
                .map(|(_, n)| *n)
                .or_else(|| std::fs::metadata(p).ok().map(|m| m.len()))
                .unwrap_or(0)
        };
        let scratch = |p: &Path| self.scratch.iter().any(|s| s.as_ref() as &Path == p);
        self.files
            .iter()
            .filter(|p| !scratch(p))
            .chain(&self.side_files)
            .map(|p| (self.shown(p), size(p)))
            .collect()
    }

    /// The checkpoint's files as its user names them: their URLs when it is in object
    /// storage (where [`Checkpoint::files`] are the local copies fetched into), else the paths.
    pub fn file_names(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| self.shown(f)).collect()
    }

    /// `len` bytes at `offset` of the checkpoint's file number `file` (a non-tensor item's
    /// bytes), fetched first when the checkpoint is in object storage.
    pub fn read_bytes(&self, file: usize, offset: u64, len: u64) -> Result<Vec<u8>> {
        use std::io::{Read, Seek, SeekFrom};
        let path = self.files.get(file).ok_or_else(|| {
            Error::format(
                &self.path,
                format!("an item names file {file}, which it does not have"),
            )
        })?;
        let mut f = std::fs::File::open(path).at(path)?;
        let size = f.metadata().at(path)?.len();
        let end = offset.saturating_add(len);
        if end > size {
            return Err(Error::format(
                path,
                format!("is truncated: an item needs bytes up to {end}, the file has {size}"),
            ));
        }
        self.storage.ensure(path, &[(offset, end)])?;
        f.seek(SeekFrom::Start(offset)).at(path)?;
        let mut buf = vec![0u8; len as usize];
        f.read_exact(&mut buf).at(path)?;
        Ok(buf)
    }
}

/// The companion files a checkpoint may come with ([`Checkpoint::companions`]).
pub const COMPANIONS: &[&str] = &["config.json", "generation_config.json"];

/// Largest companion file read (a model config is a few KB).
const MAX_COMPANION: u64 = 16 << 20;

/// The [`COMPANIONS`] found in the first of `dirs` (folders; files are skipped) that holds
/// each, checked to be JSON objects.
pub fn companions(dirs: &[&Path]) -> Result<Vec<(String, Vec<u8>)>> {
    let mut out = vec![];
    for name in COMPANIONS {
        let Some(p) = dirs
            .iter()
            .filter(|d| d.is_dir())
            .map(|d| d.join(name))
            .find(|p| p.is_file())
        else {
            continue;
        };
        out.push((name.to_string(), read_companion(&p)?));
    }
    Ok(out)
}

/// The bytes of the JSON file at `p` (a model's `config.json`), checked to hold an object.
pub fn read_companion(p: &Path) -> Result<Vec<u8>> {
    let len = std::fs::metadata(p).at(p)?.len();
    if len > MAX_COMPANION {
        return Err(Error::format(
            p,
            format!("is {len} bytes, too large for a model config"),
        ));
    }
    let bytes = std::fs::read(p).at(p)?;
    match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(_)) => Ok(bytes),
        Ok(_) => Err(Error::format(p, "does not hold a JSON object")),
        Err(e) => Err(Error::format(p, format!("is not valid JSON: {e}"))),
    }
}

/// Refuse a buffer of `len` bytes that does not hold exactly `region` of tensor `name` as
/// `dtype`.
pub fn check_buffer(name: &str, region: &Region, dtype: DType, len: usize) -> Result<()> {
    let want = region.volume().saturating_mul(dtype.size() as u64);
    if len as u64 != want {
        return Err(Error::layout(
            name,
            format!("region {region} of {dtype} is {want} bytes, the buffer {len}"),
        ));
    }
    Ok(())
}
