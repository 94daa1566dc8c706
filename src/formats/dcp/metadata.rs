//! Decoding DCP `.metadata` pickles (`docs/pytorch-formats.md` §2): the global file, or
//! every per-rank `__<R>.metadata` merged (`use_collectives=False`), into the list of keys
//! with their chunks and where each item lies.

use super::METADATA;
use crate::error::{Error, IoContext, Result};
use crate::formats::torch::pickle::{self, Value};
use crate::formats::torch::{save, short};
use crate::formats::KeyPart;
use crate::layout::{DType, Region};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// `__<R>.metadata` files of `dir` (written by `use_collectives=False`), by rank.
/// The rank `R` of a per-rank metadata file name `__R.metadata` (`use_collectives=False`).
pub(super) fn rank_of_metadata(name: &str) -> Option<u32> {
    name.strip_suffix(".metadata")?
        .strip_prefix("__")
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))?
        .parse()
        .ok()
}

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

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct Chunk {
    pub(super) offsets: Vec<u64>,
    pub(super) sizes: Vec<u64>,
}

impl Chunk {
    /// The chunk as a region of its tensor.
    pub(super) fn region(&self) -> Region {
        Region::new(self.offsets.clone(), self.sizes.clone())
    }
}

#[derive(Clone, Debug)]
pub(super) enum Kind {
    Tensor {
        dtype: DType,
        size: Vec<u64>,
        chunks: Vec<Chunk>,
    },
    Bytes,
}

#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub(super) name: String,
    pub(super) kind: Kind,
    /// Index of the metadata file that first listed it.
    pub(super) origin: usize,
}

#[derive(Clone, Debug)]
pub(super) struct StorageInfo {
    pub(super) relative_path: String,
    pub(super) offset: u64,
    pub(super) length: u64,
    pub(super) transforms: Vec<String>,
}

/// `MetadataIndex` equality: `(fqn, offset)`; BYTE_IO entries have no offset.
pub(super) type IndexKey = (String, Option<Vec<u64>>);

#[derive(Debug, Default)]
pub(super) struct Meta {
    pub(super) entries: Vec<Entry>,
    pub(super) planner: Vec<(String, Vec<KeyPart>)>,
    pub(super) storage: HashMap<IndexKey, StorageInfo>,
    pub(super) version: Option<String>,
}

fn dims(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.as_int_tuple()?
        .into_iter()
        .map(|i| u64::try_from(i).ok())
        .collect()
}

fn non_negative(v: Option<&Value>) -> Option<u64> {
    v?.as_int().and_then(|i| u64::try_from(i).ok())
}

/// Decode one metadata pickle (`origin` is its index in the list of metadata files).
fn parse_metadata(path: &Path, bytes: &[u8], origin: usize) -> Result<Meta> {
    let err = |msg: String| Error::format(path, msg);
    let root = pickle::parse(bytes, &pickle::dcp_metadata_globals())
        .map_err(|e| err(format!("cannot decode the metadata pickle: {e}")))?;
    if root.class().map(|c| c.1) != Some("Metadata") {
        return Err(err(format!(
            "does not hold a DCP Metadata object (found a {})",
            root.kind()
        )));
    }
    Ok(Meta {
        entries: state_dict_metadata(&root, origin).map_err(err)?,
        storage: storage_data(&root).map_err(err)?,
        planner: planner_data(&root).map_err(err)?,
        version: root
            .get("version")
            .and_then(Value::as_str)
            .map(str::to_string),
    })
}

/// `Metadata.state_dict_metadata`: every key, tensor or `BYTE_IO`, in order.
fn state_dict_metadata(root: &Value, origin: usize) -> Result<Vec<Entry>, String> {
    let sdm = root
        .get("state_dict_metadata")
        .and_then(Value::as_dict)
        .ok_or("Metadata has no state_dict_metadata dict")?;
    let mut entries = Vec::with_capacity(sdm.len());
    for (k, v) in sdm {
        let name = k
            .as_str()
            .ok_or_else(|| format!("state_dict_metadata has a {} key", k.kind()))?;
        let kind = match v.class() {
            Some((_, "TensorStorageMetadata")) => tensor_metadata(name, v)?,
            Some((_, "BytesStorageMetadata")) => Kind::Bytes,
            _ => {
                return Err(format!(
                    "`{}` is described by a {}, not by Tensor/BytesStorageMetadata",
                    short(name),
                    v.kind()
                ))
            }
        };
        entries.push(Entry {
            name: name.to_string(),
            kind,
            origin,
        });
    }
    Ok(entries)
}

/// `Metadata.storage_data`: where each item (`MetadataIndex`) lies; the first entry of a
/// key is kept.
fn storage_data(root: &Value) -> Result<HashMap<IndexKey, StorageInfo>, String> {
    let sd = root
        .get("storage_data")
        .and_then(Value::as_dict)
        .ok_or("Metadata has no storage_data dict")?;
    let mut storage = HashMap::with_capacity(sd.len());
    for (k, v) in sd {
        let fqn = k
            .get("fqn")
            .and_then(Value::as_str)
            .ok_or("storage_data has a key without an fqn")?;
        let offset =
            match k.get("offset") {
                None | Some(Value::None) => None,
                Some(o) => Some(dims(Some(o)).ok_or_else(|| {
                    format!("storage_data key of `{}` has a bad offset", short(fqn))
                })?),
            };
        let bad = |what: &str| format!("storage of `{}` has no valid {what}", short(fqn));
        let relative_path = v
            .get("relative_path")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("relative_path"))?
            .to_string();
        let transforms = match v.get("transform_descriptors") {
            None | Some(Value::None) => vec![],
            Some(list) => list
                .as_list()
                .and_then(|l| {
                    l.iter()
                        .map(|t| t.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| bad("transform_descriptors"))?,
        };
        let info = StorageInfo {
            relative_path,
            offset: non_negative(v.get("offset")).ok_or_else(|| bad("offset"))?,
            length: non_negative(v.get("length")).ok_or_else(|| bad("length"))?,
            transforms,
        };
        storage.entry((fqn.to_string(), offset)).or_insert(info);
    }
    Ok(storage)
}

/// `Metadata.planner_data`: each key's path in the nested state dict (may be absent).
fn planner_data(root: &Value) -> Result<Vec<(String, Vec<KeyPart>)>, String> {
    let pairs = match root.get("planner_data") {
        None | Some(Value::None) => return Ok(vec![]),
        Some(Value::Dict(pairs)) => pairs,
        Some(other) => return Err(format!("planner_data is a {}, not a dict", other.kind())),
    };
    let mut planner = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        let name = k.as_str().ok_or("planner_data has a non-str key")?;
        let parts = v
            .as_list()
            .and_then(|l| {
                l.iter()
                    .map(|p| match p {
                        Value::Str(s) => Some(KeyPart::Key(s.clone())),
                        Value::Int(i) => Some(KeyPart::Index(*i)),
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

fn tensor_metadata(name: &str, v: &Value) -> Result<Kind, String> {
    let name = short(name);
    let props = v
        .get("properties")
        .ok_or_else(|| format!("tensor `{name}` has no properties"))?;
    // TensorProperties pickles a tuple state (dtype first); accept a dict state too.
    let dtype_v = match props.state() {
        Some(Value::Tuple(t)) => t.first(),
        Some(d @ Value::Dict(_)) => d.get("dtype"),
        _ => None,
    };
    let dtype = dtype_v
        .and_then(save::torch_dtype)
        .ok_or_else(|| format!("tensor `{name}` has no torch dtype in its properties"))?
        .map_err(|m| format!("tensor `{name}`: {m}"))?;
    let size = dims(v.get("size")).ok_or_else(|| format!("tensor `{name}` has no valid size"))?;
    let list = v
        .get("chunks")
        .and_then(Value::as_list)
        .ok_or_else(|| format!("tensor `{name}` has no list of chunks"))?;
    let mut chunks = Vec::with_capacity(list.len());
    for c in list {
        let offsets = dims(c.get("offsets"));
        let sizes = dims(c.get("sizes"));
        match (offsets, sizes) {
            (Some(offsets), Some(sizes))
                if offsets.len() == size.len() && sizes.len() == size.len() =>
            {
                chunks.push(Chunk { offsets, sizes })
            }
            _ => {
                return Err(format!(
                    "tensor `{name}` ({} dims) has a chunk without matching offsets and sizes",
                    size.len()
                ))
            }
        }
    }
    Ok(Kind::Tensor {
        dtype,
        size,
        chunks,
    })
}

/// Merge per-rank metadata (`use_collectives=False`): union of keys in rank order, identical
/// chunks de-duplicated, the first storage entry of a chunk kept.
fn merge(paths: &[PathBuf], metas: Vec<Meta>) -> Result<Meta> {
    let mut out = Meta::default();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut planned: HashSet<String> = HashSet::new();
    let mut seen: HashMap<usize, HashSet<Chunk>> = HashMap::new();
    for m in metas {
        for e in m.entries {
            let Some(&i) = index.get(&e.name) else {
                index.insert(e.name.clone(), out.entries.len());
                out.entries.push(e);
                continue;
            };
            let path = &paths[e.origin];
            let first = &paths[out.entries[i].origin];
            match (&mut out.entries[i].kind, e.kind) {
                (
                    Kind::Tensor {
                        dtype,
                        size,
                        chunks,
                    },
                    Kind::Tensor {
                        dtype: d2,
                        size: s2,
                        chunks: c2,
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
                    // A hash set per merged tensor: a linear `contains` made merging
                    // 2 × 100k chunks take over 5 minutes (tests/bounds.rs).
                    let seen = seen
                        .entry(i)
                        .or_insert_with(|| chunks.iter().cloned().collect::<HashSet<Chunk>>());
                    for c in c2 {
                        if seen.insert(c.clone()) {
                            chunks.push(c);
                        }
                    }
                }
                (Kind::Bytes, Kind::Bytes) => {}
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
        }
        for (k, p) in m.planner {
            if planned.insert(k.clone()) {
                out.planner.push((k, p));
            }
        }
        for (k, v) in m.storage {
            out.storage.entry(k).or_insert(v);
        }
        if out.version.is_none() {
            out.version = m.version;
        }
    }
    Ok(out)
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
        let bytes = std::fs::read(p).at(p)?;
        metas.push(parse_metadata(p, &bytes, i)?);
    }
    let meta = if metas.len() == 1 {
        metas.pop().unwrap_or_default()
    } else {
        merge(&paths, metas)?
    };
    Ok((paths, meta))
}
