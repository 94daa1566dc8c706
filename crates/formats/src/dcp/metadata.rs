//! Decoding DCP `.metadata` pickles (`docs/pytorch-formats.md` §2): the global file, or
//! every per-rank `__<R>.metadata` merged (`use_collectives=False`), into the list of keys
//! with their chunks and where each item lies.
//!
//! A large job's `.metadata` names millions of chunks, so it is decoded from the pickle's
//! value graph ([`pickle::Graph`], nothing copied per reference) straight into compact
//! arrays: per tensor, its chunks' offsets and sizes flattened ([`Chunks`]) and each chunk's
//! item ([`Item`]: integer indices into one table of data file names and one of transform
//! lists). A `storage_data` key (`MetadataIndex`) is matched to its chunk through the index
//! hint torch records in it, checked, and by offsets where the hint is absent or wrong.

use super::METADATA;
use crate::checkpoint::{PathFlavor, SavedId, SavedMeta};
use crate::error::{Error, IoContext, Result};
use crate::layout::{DType, Region};
use crate::torch::pickle::{self, Obj};
use crate::torch::{save, short};
use crate::KeyPart;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The rank `R` of a per-rank metadata file name `__R.metadata` (`use_collectives=False`).
pub(super) fn rank_of_metadata(name: &str) -> Option<u32> {
    name.strip_suffix(".metadata")?
        .strip_prefix("__")
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))?
        .parse()
        .ok()
}

/// `__<R>.metadata` files of `dir` (written by `use_collectives=False`), by rank.
pub(super) fn rank_metadata_files(dir: &Path) -> Result<Vec<(u32, PathBuf)>> {
    let mut v = vec![];
    for e in std::fs::read_dir(dir).at(dir)? {
        let e = e.at(dir)?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(r) = rank_of_metadata(name) {
            if e.path().is_file() {
                v.push((r, e.path()));
            }
        }
    }
    v.sort();
    Ok(v)
}

/// The chunks of one tensor: `len` boxes of `ndim` dimensions, offsets and sizes flattened.
#[derive(Clone, Debug, Default)]
pub(super) struct Chunks {
    ndim: usize,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
}

impl Chunks {
    fn new(ndim: usize, capacity: usize) -> Chunks {
        Chunks {
            ndim,
            offsets: Vec::with_capacity(ndim * capacity),
            sizes: Vec::with_capacity(ndim * capacity),
        }
    }

    /// Offsets of chunk `i`.
    pub(super) fn offsets(&self, i: usize) -> &[u64] {
        &self.offsets[i * self.ndim..(i + 1) * self.ndim]
    }

    /// Sizes of chunk `i`.
    pub(super) fn sizes(&self, i: usize) -> &[u64] {
        &self.sizes[i * self.ndim..(i + 1) * self.ndim]
    }

    /// Chunk `i` as a region of its tensor.
    pub(super) fn region(&self, i: usize) -> Region {
        Region::new(self.offsets(i), self.sizes(i))
    }

    fn push(&mut self, offsets: &[u64], sizes: &[u64]) {
        self.offsets.extend_from_slice(offsets);
        self.sizes.extend_from_slice(sizes);
    }
}

/// Where one item lies: its data file (an index into [`Meta::files`]), its byte range, and
/// its stream transforms (an index into [`Meta::transforms`]; 0 = none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Item {
    pub(super) file: u32,
    pub(super) transforms: u32,
    pub(super) offset: u64,
    pub(super) length: u64,
}

#[derive(Clone, Debug)]
pub(super) enum Kind {
    Tensor {
        dtype: DType,
        size: Vec<u64>,
        chunks: Chunks,
        /// Per chunk, its item (`None` while no `storage_data` entry names it).
        items: Vec<Option<Item>>,
        /// Number of chunks (kept apart from `chunks` so that 0-dim tensors count too).
        count: usize,
    },
    Bytes {
        item: Option<Item>,
    },
}

impl Kind {
    /// Number of chunks of a tensor.
    pub(super) fn chunk_count(&self) -> usize {
        match self {
            Kind::Tensor { count, .. } => *count,
            Kind::Bytes { .. } => 0,
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub(super) name: String,
    pub(super) kind: Kind,
    /// Index of the metadata file that first listed it.
    pub(super) origin: usize,
}

#[derive(Debug, Default)]
pub(super) struct Meta {
    pub(super) entries: Vec<Entry>,
    pub(super) planner: Vec<(String, Vec<KeyPart>)>,
    /// Data file paths (`_StorageInfo.relative_path`), in order of first mention.
    pub(super) files: Vec<String>,
    /// Stream transform lists; index 0 is the empty list.
    pub(super) transforms: Vec<Vec<String>>,
    pub(super) version: Option<String>,
    /// The version of reshard that wrote it (`Metadata.reshard_version`, [`RESHARD_VERSION`]).
    pub(super) reshard: Option<String>,
    /// Tensors stored in a block-flattened view ([`crate::layout::BlockFlat`]), with their
    /// real shapes: megatron-core's `mcore_data[key]["nd_reformulated_orig_global_shape"]`.
    pub(super) reformulated: HashMap<String, Vec<u64>>,
    /// `Metadata.storage_meta` (torch >= 2.4; absent before, or `None`).
    pub(super) saved: Option<SavedMeta>,
}

impl Meta {
    fn new() -> Meta {
        Meta {
            transforms: vec![vec![]],
            ..Meta::default()
        }
    }
}

/// Interns strings (data file names) as indices, in order of first mention.
#[derive(Default)]
struct Interner<T: std::hash::Hash + Eq + Clone> {
    index: HashMap<T, u32>,
}

impl<T: std::hash::Hash + Eq + Clone> Interner<T> {
    fn of(&mut self, table: &mut Vec<T>, v: T) -> Result<u32, String> {
        if let Some(&i) = self.index.get(&v) {
            return Ok(i);
        }
        let i = u32::try_from(table.len()).map_err(|_| "too many distinct data files")?;
        self.index.insert(v.clone(), i);
        table.push(v);
        Ok(i)
    }
}

fn non_negative(v: Option<Obj>) -> Option<u64> {
    v?.as_int().and_then(|i| u64::try_from(i).ok())
}

/// The attribute of the `Metadata` object in which reshard records its version: one torch
/// leaves alone (unpickling sets it on the instance; no torch field has that name).
pub const RESHARD_VERSION: &str = "reshard_version";

/// Decode one metadata pickle (`origin` is its index in the list of metadata files).
#[cfg(test)]
fn parse_metadata(path: &Path, bytes: &[u8], origin: usize) -> Result<Meta> {
    parse_metadata_consuming(path, bytes, origin, |_| {})
}

/// [`parse_metadata`], calling `consumed(n)` as the decoder is done with the first `n` bytes
/// (see [`pickle::parse_graph_consuming`]).
fn parse_metadata_consuming(
    path: &Path,
    bytes: &[u8],
    origin: usize,
    consumed: impl FnMut(usize),
) -> Result<Meta> {
    let err = |msg: String| Error::format(path, msg);
    let graph = pickle::parse_graph_consuming(bytes, &pickle::dcp_metadata_globals(), consumed)
        .map_err(|e| err(format!("cannot decode the metadata pickle: {e}")))?;
    let root = graph.root();
    // megatron-core's `MCoreMetadata` is a `Metadata` with `mcore_data`
    if !matches!(
        root.class().map(|c| c.1),
        Some("Metadata" | "MCoreMetadata")
    ) {
        return Err(err(format!(
            "does not hold a DCP Metadata object (found a {})",
            root.kind()
        )));
    }
    let mut meta = Meta::new();
    meta.entries = state_dict_metadata(root, origin).map_err(err)?;
    storage_data(root, &mut meta).map_err(err)?;
    meta.planner = planner_data(root).map_err(err)?;
    meta.reformulated = mcore_data(root).map_err(err)?;
    meta.version = root
        .get("version")
        .and_then(Obj::as_str)
        .map(str::to_string);
    meta.reshard = root
        .get(RESHARD_VERSION)
        .and_then(Obj::as_str)
        .map(str::to_string);
    meta.saved = root.get("storage_meta").and_then(storage_meta);
    Ok(meta)
}

/// `Metadata.storage_meta`, torch's `StorageMeta(checkpoint_id, save_id, load_id, modules)`
/// (torch >= 2.4), as a [`SavedMeta`]: `None` when absent, `None`, or not a `StorageMeta`.
/// Fields of other types than torch writes are left out (`load_id` is the reader's, never
/// read): a `checkpoint_id` that is neither a str nor a `pathlib` path of str parts, a
/// `save_id` that is no str, `modules` that are not a list of str.
fn storage_meta(sm: Obj) -> Option<SavedMeta> {
    let class = Some(("torch.distributed.checkpoint.metadata", "StorageMeta"));
    if sm.class() != class || sm.kind() != "object" {
        return None;
    }
    let modules = sm
        .get("modules")
        .and_then(Obj::as_list)
        .and_then(|l| {
            l.map(|m| m.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
        })
        .unwrap_or_default();
    Some(SavedMeta {
        checkpoint_id: sm.get("checkpoint_id").and_then(saved_id),
        save_id: sm.get("save_id").and_then(Obj::as_str).map(str::to_string),
        modules,
    })
}

/// A `StorageMeta.checkpoint_id`: a str, or a `pathlib` path made of str parts (the path's
/// text per [`PathFlavor::render`]).
fn saved_id(id: Obj) -> Option<SavedId> {
    if let Some(s) = id.as_str() {
        return Some(SavedId {
            text: s.to_string(),
            path: None,
        });
    }
    let flavor = match id.class() {
        Some(("pathlib", "PosixPath" | "PurePosixPath")) => PathFlavor::Posix,
        Some(("pathlib", "WindowsPath" | "PureWindowsPath")) => PathFlavor::Windows,
        _ => return None,
    };
    // a call of the path class (`REDUCE` with its parts): not the bare class, nor an
    // object built from a state
    if id.kind() != "object" || id.state().is_some() {
        return None;
    }
    let parts = id
        .args()?
        .as_list()?
        .map(Obj::as_str)
        .collect::<Option<Vec<&str>>>()?;
    Some(SavedId {
        text: flavor.render(parts),
        path: Some(flavor),
    })
}

/// `Metadata.state_dict_metadata`: every key, tensor or `BYTE_IO`, in order (a key listed
/// twice keeps its first position and its last description, as Python's dict does).
fn state_dict_metadata(root: Obj, origin: usize) -> Result<Vec<Entry>, String> {
    let sdm = root
        .get("state_dict_metadata")
        .and_then(Obj::as_dict)
        .ok_or("Metadata has no state_dict_metadata dict")?;
    let mut entries: Vec<Entry> = Vec::with_capacity(sdm.len());
    let mut index: HashMap<&str, usize> = HashMap::with_capacity(sdm.len());
    for (k, v) in sdm {
        let name = k
            .as_str()
            .ok_or_else(|| format!("state_dict_metadata has a {} key", k.kind()))?;
        let kind = match v.class() {
            Some((_, "TensorStorageMetadata")) => tensor_metadata(name, v)?,
            Some((_, "BytesStorageMetadata")) => Kind::Bytes { item: None },
            _ => {
                return Err(format!(
                    "`{}` is described by a {}, not by Tensor/BytesStorageMetadata",
                    short(name),
                    v.kind()
                ))
            }
        };
        match index.get(name) {
            Some(&i) => entries[i].kind = kind,
            None => {
                index.insert(name, entries.len());
                entries.push(Entry {
                    name: name.to_string(),
                    kind,
                    origin,
                });
            }
        }
    }
    Ok(entries)
}

/// `Metadata.storage_data`: where each item (`MetadataIndex`) lies, recorded on its chunk
/// (or `BYTE_IO` entry); the first entry of a key is kept. Entries of keys the
/// `state_dict_metadata` does not list are checked and ignored.
fn storage_data(root: Obj, meta: &mut Meta) -> Result<(), String> {
    let sd = root
        .get("storage_data")
        .and_then(Obj::as_dict)
        .ok_or("Metadata has no storage_data dict")?;
    let by_name: HashMap<String, usize> = meta
        .entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.name.clone(), i))
        .collect();
    let mut files = Interner::default();
    let mut transforms = Interner::default();
    // Items whose index hint did not name their chunk, by entry: matched by offsets below.
    let mut unmatched: HashMap<usize, Vec<(Vec<u64>, Item)>> = HashMap::new();
    let mut offset = Vec::new();
    for (k, v) in sd {
        let fqn = k
            .get("fqn")
            .and_then(Obj::as_str)
            .ok_or("storage_data has a key without an fqn")?;
        offset.clear();
        let has_offset = match k.get("offset") {
            None => false,
            Some(o) if o.is_none() => false,
            Some(o) => {
                if !o.dims_into(&mut offset) {
                    return Err(format!(
                        "storage_data key of `{}` has a bad offset",
                        short(fqn)
                    ));
                }
                true
            }
        };
        let bad = |what: &str| format!("storage of `{}` has no valid {what}", short(fqn));
        let relative_path = v
            .get("relative_path")
            .and_then(Obj::as_str)
            .ok_or_else(|| bad("relative_path"))?;
        let tr = match v.get("transform_descriptors") {
            None => 0,
            Some(t) if t.is_none() => 0,
            Some(list) => {
                let names = list
                    .as_list()
                    .and_then(|l| {
                        l.map(|t| t.as_str().map(str::to_string))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| bad("transform_descriptors"))?;
                if names.is_empty() {
                    0
                } else {
                    transforms.of(&mut meta.transforms, names)?
                }
            }
        };
        let item = Item {
            file: files.of(&mut meta.files, relative_path.to_string())?,
            transforms: tr,
            offset: non_negative(v.get("offset")).ok_or_else(|| bad("offset"))?,
            length: non_negative(v.get("length")).ok_or_else(|| bad("length"))?,
        };
        let Some(&ei) = by_name.get(fqn) else {
            continue;
        };
        match (&mut meta.entries[ei].kind, has_offset) {
            (Kind::Bytes { item: slot }, false) => {
                slot.get_or_insert(item);
            }
            (Kind::Tensor { chunks, items, .. }, true) => {
                let hint = k
                    .get("index")
                    .and_then(Obj::as_int)
                    .and_then(|h| usize::try_from(h).ok())
                    .filter(|&h| h < items.len() && chunks.offsets(h) == offset.as_slice());
                match hint {
                    Some(h) => {
                        items[h].get_or_insert(item);
                    }
                    None => unmatched
                        .entry(ei)
                        .or_default()
                        .push((offset.clone(), item)),
                }
            }
            _ => {}
        }
    }
    // Chunks no hint named: the first item of their offsets (chunks sharing offsets, such
    // as empty ones, share it, as torch's dict keyed by (fqn, offset) does).
    for (ei, e) in meta.entries.iter_mut().enumerate() {
        let Kind::Tensor { chunks, items, .. } = &mut e.kind else {
            continue;
        };
        let extra = unmatched.remove(&ei).unwrap_or_default();
        if extra.is_empty() && items.iter().all(Option::is_some) {
            continue;
        }
        let mut by_offsets: HashMap<&[u64], Item> = HashMap::new();
        for (o, it) in &extra {
            by_offsets.entry(o.as_slice()).or_insert(*it);
        }
        for (i, it) in items.iter().enumerate() {
            if let Some(it) = it {
                by_offsets.entry(chunks.offsets(i)).or_insert(*it);
            }
        }
        let fill: Vec<Option<Item>> = (0..items.len())
            .map(|i| items[i].or_else(|| by_offsets.get(chunks.offsets(i)).copied()))
            .collect();
        *items = fill;
    }
    Ok(())
}

/// `Metadata.planner_data`: each key's path in the nested state dict (may be absent).
fn planner_data(root: Obj) -> Result<Vec<(String, Vec<KeyPart>)>, String> {
    let pairs = match root.get("planner_data") {
        None => return Ok(vec![]),
        Some(p) if p.is_none() => return Ok(vec![]),
        Some(p) => p
            .as_dict()
            .ok_or_else(|| format!("planner_data is a {}, not a dict", p.kind()))?,
    };
    let mut planner = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        let name = k.as_str().ok_or("planner_data has a non-str key")?;
        let parts = v
            .as_list()
            .and_then(|l| {
                l.map(|p| match (p.as_str(), p.as_int()) {
                    (Some(s), _) => Some(KeyPart::Key(s.to_string())),
                    (_, Some(i)) => Some(KeyPart::Index(i)),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| {
                format!(
                    "planner_data of `{}` is not a tuple of str and int",
                    short(name)
                )
            })?;
        planner.push((name.to_string(), parts));
    }
    Ok(planner)
}

/// megatron-core's `MCoreMetadata.mcore_data` (absent elsewhere): per key a dict, whose
/// `nd_reformulated_orig_global_shape`, where present, is the real shape of a tensor stored
/// block-flattened (its distributed optimizer's flattened ranges). Other entries are ignored.
fn mcore_data(root: Obj) -> Result<HashMap<String, Vec<u64>>, String> {
    let mut out = HashMap::new();
    let pairs = match root.get("mcore_data") {
        None => return Ok(out),
        Some(p) if p.is_none() => return Ok(out),
        Some(p) => p
            .as_dict()
            .ok_or_else(|| format!("mcore_data is a {}, not a dict", p.kind()))?,
    };
    for (k, v) in pairs {
        let name = k.as_str().ok_or("mcore_data has a non-str key")?;
        let Some(shape) = v.get("nd_reformulated_orig_global_shape") else {
            continue;
        };
        if shape.is_none() {
            continue;
        }
        let mut dims = vec![];
        if !shape.dims_into(&mut dims) {
            return Err(format!(
                "mcore_data of `{}` has a bad nd_reformulated_orig_global_shape",
                short(name)
            ));
        }
        out.insert(name.to_string(), dims);
    }
    Ok(out)
}

fn tensor_metadata(name: &str, v: Obj) -> Result<Kind, String> {
    let name = short(name);
    let props = v
        .get("properties")
        .ok_or_else(|| format!("tensor `{name}` has no properties"))?;
    // TensorProperties pickles a tuple state (dtype first); accept a dict state too.
    let dtype_v = match props.state() {
        Some(s) => match s.as_dict() {
            Some(_) => s.get("dtype"),
            None if s.kind() == "tuple" => s.as_list().and_then(|mut l| l.next()),
            None => None,
        },
        None => None,
    };
    let dtype = dtype_v
        .filter(|d| d.kind() == "global")
        .and_then(|d| d.class())
        .and_then(|(m, n)| save::torch_dtype_named(m, n))
        .ok_or_else(|| format!("tensor `{name}` has no torch dtype in its properties"))?
        .map_err(|m| format!("tensor `{name}`: {m}"))?;
    let mut size = vec![];
    if !v.get("size").is_some_and(|s| s.dims_into(&mut size)) {
        return Err(format!("tensor `{name}` has no valid size"));
    }
    let list = v
        .get("chunks")
        .and_then(Obj::as_list)
        .ok_or_else(|| format!("tensor `{name}` has no list of chunks"))?;
    let ndim = size.len();
    let count = list.len();
    let mut chunks = Chunks::new(ndim, count);
    let (mut offsets, mut sizes) = (Vec::with_capacity(ndim), Vec::with_capacity(ndim));
    for c in list {
        offsets.clear();
        sizes.clear();
        let ok = c.get("offsets").is_some_and(|o| o.dims_into(&mut offsets))
            && c.get("sizes").is_some_and(|s| s.dims_into(&mut sizes))
            && offsets.len() == ndim
            && sizes.len() == ndim;
        if !ok {
            return Err(format!(
                "tensor `{name}` ({ndim} dims) has a chunk without matching offsets and sizes"
            ));
        }
        chunks.push(&offsets, &sizes);
    }
    Ok(Kind::Tensor {
        dtype,
        size,
        chunks,
        items: vec![None; count],
        count,
    })
}

/// Merge per-rank metadata (`use_collectives=False`): union of keys in rank order, identical
/// chunks de-duplicated, the first item of a chunk kept.
fn merge(paths: &[PathBuf], metas: Vec<Meta>) -> Result<Meta> {
    let mut merged = Merged::new(paths);
    for (mi, m) in metas.into_iter().enumerate() {
        merged.add(mi, m)?;
    }
    Ok(merged.out)
}

/// Per merged tensor, its chunks (offsets and sizes) → chunk index.
type ChunkIndex = HashMap<(Vec<u64>, Vec<u64>), usize>;

/// Per-rank metadata files merged into one [`Meta`], one file at a time.
struct Merged<'p> {
    /// The metadata files (an entry's `origin` indexes them).
    paths: &'p [PathBuf],
    out: Meta,
    files: Interner<String>,
    transforms: Interner<Vec<String>>,
    /// Entry name → index in `out.entries`.
    index: HashMap<String, usize>,
    /// Planner keys already listed.
    planned: HashSet<String>,
    /// By merged tensor (index in `out.entries`), once a second file lists it.
    seen: HashMap<usize, ChunkIndex>,
}

impl<'p> Merged<'p> {
    fn new(paths: &'p [PathBuf]) -> Merged<'p> {
        Merged {
            paths,
            out: Meta::new(),
            files: Interner::default(),
            transforms: Interner::default(),
            index: HashMap::new(),
            planned: HashSet::new(),
            seen: HashMap::new(),
        }
    }

    /// Merge `m`, the metadata file `mi`.
    fn add(&mut self, mi: usize, m: Meta) -> Result<()> {
        let Meta {
            entries,
            planner,
            files,
            transforms,
            version,
            reshard,
            reformulated,
            saved,
        } = m;
        let remap = self.remap(&files, &transforms)?;
        for mut e in entries {
            match &mut e.kind {
                Kind::Tensor { items, .. } => {
                    for it in items.iter_mut() {
                        *it = remap(*it);
                    }
                }
                Kind::Bytes { item } => *item = remap(*item),
            }
            self.entry(e)?;
        }
        for (k, shape) in reformulated {
            match self.out.reformulated.get(&k) {
                None => {
                    self.out.reformulated.insert(k, shape);
                }
                Some(first) if *first != shape => {
                    return Err(Error::format(
                        &self.paths[mi],
                        format!(
                            "the real shape of `{}` is {shape:?} here but {first:?} in another \
                             rank's metadata",
                            short(&k)
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
        for (k, p) in planner {
            if self.planned.insert(k.clone()) {
                self.out.planner.push((k, p));
            }
        }
        if self.out.version.is_none() {
            self.out.version = version;
        }
        if self.out.reshard.is_none() {
            self.out.reshard = reshard;
        }
        // rank 0's (the first file's), as torch's reader gives rank 0 without a global one
        if mi == 0 {
            self.out.saved = saved;
        }
        Ok(())
    }

    /// How a file's items map into the merged tables: its data file and transform indices
    /// (`files`, `transforms`) interned in the merged ones.
    fn remap(
        &mut self,
        files: &[String],
        transforms: &[Vec<String>],
    ) -> Result<impl Fn(Option<Item>) -> Option<Item>> {
        let file_map = files
            .iter()
            .map(|f| self.files.of(&mut self.out.files, f.clone()))
            .collect::<Result<Vec<u32>, String>>()
            .map_err(|e| Error::format(&self.paths[0], e))?;
        let tr_map = transforms
            .iter()
            .map(|t| {
                if t.is_empty() {
                    Ok(0)
                } else {
                    self.transforms.of(&mut self.out.transforms, t.clone())
                }
            })
            .collect::<Result<Vec<u32>, String>>()
            .map_err(|e| Error::format(&self.paths[0], e))?;
        Ok(move |it: Option<Item>| {
            it.map(|it| Item {
                file: file_map[it.file as usize],
                transforms: tr_map[it.transforms as usize],
                ..it
            })
        })
    }

    /// Merge entry `e` (its items already remapped): a new name is appended; a tensor listed
    /// before gains the chunks it lacked, and items for chunks that had none.
    fn entry(&mut self, e: Entry) -> Result<()> {
        let Some(&i) = self.index.get(&e.name) else {
            self.index.insert(e.name.clone(), self.out.entries.len());
            self.out.entries.push(e);
            return Ok(());
        };
        let path = &self.paths[e.origin];
        let first = &self.paths[self.out.entries[i].origin];
        match (&mut self.out.entries[i].kind, e.kind) {
            (
                Kind::Tensor {
                    dtype,
                    size,
                    chunks,
                    items,
                    count,
                },
                Kind::Tensor {
                    dtype: d2,
                    size: s2,
                    chunks: c2,
                    items: i2,
                    count: n2,
                },
            ) => {
                if *dtype != d2 || *size != s2 {
                    return Err(Error::format(
                        path,
                        format!(
                            "tensor `{}` is {d2} {s2:?} here but {dtype} {size:?} in {}",
                            short(&e.name),
                            first.display()
                        ),
                    ));
                }
                // A hash map per merged tensor: a linear search made merging
                // 2 × 100k chunks take over 5 minutes (tests/bounds.rs).
                let seen = self.seen.entry(i).or_insert_with(|| {
                    (0..*count)
                        .map(|c| ((chunks.offsets(c).to_vec(), chunks.sizes(c).to_vec()), c))
                        .collect()
                });
                for (c, it) in i2.into_iter().enumerate().take(n2) {
                    let key = (c2.offsets(c).to_vec(), c2.sizes(c).to_vec());
                    match seen.get(&key) {
                        Some(&at) => {
                            if items[at].is_none() {
                                items[at] = it;
                            }
                        }
                        None => {
                            chunks.push(&key.0, &key.1);
                            seen.insert(key, *count);
                            items.push(it);
                            *count += 1;
                        }
                    }
                }
            }
            (Kind::Bytes { item }, Kind::Bytes { item: i2 }) => {
                if item.is_none() {
                    *item = i2;
                }
            }
            _ => {
                return Err(Error::format(
                    path,
                    format!(
                        "`{}` is a tensor in one rank's metadata and a non-tensor in another",
                        short(&e.name)
                    ),
                ))
            }
        }
        Ok(())
    }
}

/// Read `.metadata`, or merge every `__<R>.metadata`; returns the files read.
pub(super) fn load_metadata(dir: &Path) -> Result<(Vec<PathBuf>, Meta)> {
    let global = dir.join(METADATA);
    let paths: Vec<PathBuf> = if global.is_file() {
        vec![global]
    } else {
        rank_metadata_files(dir)?
            .into_iter()
            .map(|(_, p)| p)
            .collect()
    };
    if paths.is_empty() {
        return Err(Error::format(
            dir,
            "has no .metadata (not a DCP checkpoint)",
        ));
    }
    let mut metas = Vec::with_capacity(paths.len());
    for (i, p) in paths.iter().enumerate() {
        // Mapped, not read: at a million chunks, a copy of the pickle is a fifth of a
        // gigabyte of fresh memory to fault in. The pages the decoder is done with are
        // dropped as it goes, so the file does not stay resident beside its value graph.
        let src = super::Source::open(p.clone(), None)?;
        let mut done = 0u64;
        let release = |n: usize| {
            let n = n as u64;
            if n > done {
                src.release(done, n - done);
                done = n;
            }
        };
        metas.push(parse_metadata_consuming(p, src.bytes(), i, release)?);
    }
    let meta = if metas.len() == 1 {
        metas.pop().unwrap_or_default()
    } else {
        merge(&paths, metas)?
    };
    Ok((paths, meta))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch::pickle::{pickle, PyValue};

    const META: &str = "torch.distributed.checkpoint.metadata";

    fn fixture(case: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(case)
            .join("checkpoint")
    }

    fn s(x: &str) -> PyValue {
        PyValue::Str(x.into())
    }

    fn path(class: &str, parts: &[&str]) -> PyValue {
        PyValue::call("pathlib", class, parts.iter().map(|p| s(p)).collect())
    }

    fn storage_meta(fields: Vec<(&str, PyValue)>) -> PyValue {
        PyValue::object(META, "StorageMeta", Some(PyValue::str_dict(fields)))
    }

    /// A `Metadata` of no entries whose `storage_meta` is `sm`, parsed.
    fn parsed(sm: PyValue) -> Result<Meta> {
        let md = PyValue::object(
            META,
            "Metadata",
            Some(PyValue::str_dict(vec![
                ("state_dict_metadata", PyValue::Dict(vec![])),
                ("planner_data", PyValue::Dict(vec![])),
                ("storage_data", PyValue::Dict(vec![])),
                ("storage_meta", sm),
                ("version", s("1.0.0")),
            ])),
        );
        parse_metadata(Path::new("ck/.metadata"), &pickle(&md), 0)
    }

    fn saved(sm: PyValue) -> Option<SavedMeta> {
        parsed(sm).expect("parses").saved
    }

    fn id(text: &str, path: Option<PathFlavor>) -> Option<SavedId> {
        Some(SavedId {
            text: text.into(),
            path,
        })
    }

    #[test]
    fn storage_meta_of_torch_2_4_and_later() {
        // the global .metadata (torch 2.15): PosixPath('checkpoint'), the writer's save_id
        let (_, meta) = load_metadata(&fixture("fsdp2_w4_f32_shard1")).unwrap();
        assert_eq!(
            meta.saved,
            Some(SavedMeta {
                checkpoint_id: id("checkpoint", Some(PathFlavor::Posix)),
                save_id: Some("82ecc7be-7381-4310-940d-d9c788751566".into()),
                modules: vec![],
            })
        );
        // per-rank metadata (use_collectives=False): each rank saved its own save_id;
        // merged, rank 0's
        let dir = fixture("fsdp2_w2_f32_nocoll");
        let rank1 = dir.join("__1.metadata");
        let one = parse_metadata(&rank1, &std::fs::read(&rank1).unwrap(), 0).unwrap();
        assert_eq!(
            one.saved.and_then(|s| s.save_id).as_deref(),
            Some("d7079b4f-f570-4a52-a5c4-b8a01aba80a8")
        );
        let (paths, meta) = load_metadata(&dir).unwrap();
        assert_eq!(paths.len(), 2);
        let sm = meta.saved.expect("rank 0's storage_meta");
        assert_eq!(
            sm.save_id.as_deref(),
            Some("c590468a-9815-4f46-b2d4-4bad6c2c3440")
        );
        assert_eq!(sm.checkpoint_id, id("checkpoint", Some(PathFlavor::Posix)));
    }

    #[test]
    fn no_storage_meta_before_torch_2_4() {
        let (_, meta) = load_metadata(&fixture("torch21_shardedtensor_w3")).unwrap();
        assert_eq!(meta.saved, None);
        assert_eq!(meta.version, None);
    }

    #[test]
    fn storage_meta_fields_of_each_kind() {
        let full = storage_meta(vec![
            ("checkpoint_id", path("PosixPath", &["/", "x", "ck"])),
            ("save_id", s("abc")),
            ("load_id", s("not read")),
            ("modules", PyValue::List(vec![s("m"), s("n")])),
        ]);
        assert_eq!(
            saved(full),
            Some(SavedMeta {
                checkpoint_id: id("/x/ck", Some(PathFlavor::Posix)),
                save_id: Some("abc".into()),
                modules: vec!["m".into(), "n".into()],
            })
        );
        let text = storage_meta(vec![("checkpoint_id", s("s3://bucket/ck"))]);
        assert_eq!(
            saved(text).and_then(|s| s.checkpoint_id),
            id("s3://bucket/ck", None)
        );
        let win = storage_meta(vec![("checkpoint_id", path("WindowsPath", &["C:\\", "x"]))]);
        assert_eq!(
            saved(win).and_then(|s| s.checkpoint_id),
            id("C:\\x", Some(PathFlavor::Windows))
        );
        // a StorageMeta made without a state: all fields absent
        assert_eq!(
            saved(PyValue::object(META, "StorageMeta", None)),
            Some(SavedMeta::default())
        );
    }

    #[test]
    fn storage_meta_of_other_types_is_left_out() {
        // no StorageMeta: absent, None, another value, another object
        assert_eq!(saved(PyValue::None), None);
        assert_eq!(saved(PyValue::Int(3)), None);
        assert_eq!(saved(PyValue::Dict(vec![(s("save_id"), s("x"))])), None);
        assert_eq!(
            saved(PyValue::object(META, "MetadataIndex", None)),
            None,
            "another class"
        );
        assert_eq!(saved(PyValue::torch_size(&[1])), None);
        // fields of other types: each left out, never a panic
        let odd = storage_meta(vec![
            ("checkpoint_id", PyValue::Int(3)),
            ("save_id", PyValue::List(vec![s("abc")])),
            ("modules", s("m")),
        ]);
        assert_eq!(saved(odd), Some(SavedMeta::default()));
        let odd = storage_meta(vec![
            ("checkpoint_id", path("PosixPath", &["a", "b"])),
            ("save_id", PyValue::None),
            ("modules", PyValue::List(vec![s("a"), PyValue::Int(1)])),
        ]);
        assert_eq!(
            saved(odd),
            Some(SavedMeta {
                checkpoint_id: id("a/b", Some(PathFlavor::Posix)),
                ..SavedMeta::default()
            })
        );
        // a path of other parts, a bare path class, a path made without arguments
        for cid in [
            PyValue::call("pathlib", "PosixPath", vec![s("a"), PyValue::Int(1)]),
            PyValue::call("pathlib", "PosixPath", vec![PyValue::List(vec![s("a")])]),
            PyValue::call("pathlib", "PosixPath", vec![PyValue::Tuple(vec![s("a")])]),
            PyValue::Global {
                module: "pathlib".into(),
                name: "PosixPath".into(),
            },
            PyValue::object("pathlib", "PosixPath", Some(s("/x"))),
            PyValue::torch_size(&[1, 2]),
        ] {
            let sm = storage_meta(vec![("checkpoint_id", cid), ("save_id", s("abc"))]);
            assert_eq!(
                saved(sm),
                Some(SavedMeta {
                    save_id: Some("abc".into()),
                    ..SavedMeta::default()
                })
            );
        }
        // a state that is no dict
        let listy = PyValue::object(META, "StorageMeta", Some(PyValue::List(vec![s("x")])));
        assert_eq!(saved(listy), Some(SavedMeta::default()));
    }

    #[test]
    fn a_storage_meta_naming_other_globals_is_an_error_naming_the_file() {
        // what a pickle would call (a function as checkpoint_id) is refused, not called
        let sm = storage_meta(vec![(
            "checkpoint_id",
            PyValue::call("os", "system", vec![s("true")]),
        )]);
        let e = parsed(sm).expect_err("refused").to_string();
        assert!(e.contains("ck/.metadata") && e.contains("os.system"), "{e}");
    }

    #[test]
    fn posix_paths_render_as_python_str() {
        let r = |parts: &[&str]| PathFlavor::Posix.render(parts.iter().copied());
        // each as Python's str(PurePosixPath(*parts))
        assert_eq!(r(&["/", "x", "ck"]), "/x/ck");
        assert_eq!(r(&["checkpoint"]), "checkpoint");
        assert_eq!(r(&["a", "", "b"]), "a/b");
        assert_eq!(r(&["//", "a"]), "//a");
        assert_eq!(r(&["//a", "b"]), "//a/b");
        assert_eq!(r(&["///a"]), "/a");
        assert_eq!(r(&[]), ".");
        assert_eq!(r(&["a", "/b"]), "/b");
        assert_eq!(r(&["a", "//b"]), "//b");
        assert_eq!(r(&["a/./b/"]), "a/b");
        assert_eq!(r(&["..", "a"]), "../a");
        let w = |parts: &[&str]| PathFlavor::Windows.render(parts.iter().copied());
        assert_eq!(w(&["C:\\", "x", "ck"]), "C:\\x\\ck");
        assert_eq!(w(&["x", "y/z"]), "x\\y\\z");
    }
}
