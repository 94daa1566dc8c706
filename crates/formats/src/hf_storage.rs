//! The per-rank safetensors shards that PyTorch's
//! `HuggingFaceStorageWriter(save_distributed=True)` writes: rank `r` writes
//! `shard-{r+1:05}-model-{i:05}-of-{n:05}.safetensors`, each tensor stored as the rank's chunk,
//! and the chunk's global offsets recorded in the header's `__metadata__` as
//! `DCP_SHARDING_INFO = json({fqn: {"saved_offsets": [...]}})`. There is no index: the global
//! shape of a tensor is the largest `offset + size` over its chunks
//! (torch/distributed/checkpoint/_hf_utils.py, hf_storage.py).
//!
//! A directory of plain safetensors files without `DCP_SHARDING_INFO` reads the same way,
//! every tensor at offset 0, as torch's `HuggingFaceStorageReader` does.

use super::safetensors::{
    align_order, checkpoint, files_in, header_metadata, is_shard_name, output_file, read_header,
    recorded_crcs, Entry, HeaderTensor,
};
use super::{
    Aliasing, Capabilities, Checkpoint, Codec, Container, Family, Format, Output, Probe,
    Recognition, TargetTensor, WriteOptions,
};
use crate::error::{Error, Result};
use crate::layout::{Loc, Piece, Region, TensorLayout};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The `__metadata__` key under which reshard records the number of ranks it wrote (torch
/// records none, so a missing last rank file can only be told in reshard's outputs).
pub const RANKS_KEY: &str = "reshard.ranks";

/// The `__metadata__` key holding chunk offsets.
pub const SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// The rank a file name `shard-0000R-…` belongs to (R is 1-based in the name).
fn rank_of(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("shard-")?;
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse::<u32>().ok()?.checked_sub(1)
}

/// torch's per-rank safetensors shards (`HuggingFaceStorageWriter(save_distributed=True)`).
pub struct HfStorage;

static CAPS: Capabilities = Capabilities {
    name: "hf-storage",
    aliases: &["hf-distributed"],
    summary: "per-rank safetensors shards, as torch's HuggingFaceStorageWriter (any M)",
    noun: "a directory of per-rank safetensors shards",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Safetensors,
    extras_kept: "as JSON in the safetensors __metadata__ key `reshard.extras`",
    keeps_opaque: false,
    aliasing: Aliasing::Forbidden,
    written: true,
};

impl Codec for HfStorage {
    fn capabilities(&self) -> &'static Capabilities {
        &CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        // any directory of *.safetensors files that no index or metadata file claims
        Recognition::fallback_if(probe.files.iter().any(|n| is_shard_name(n)))
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path)
    }
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
        write(target, world, opts)
    }
}

/// Read a directory of per-rank shards.
pub fn read(dir: &Path) -> Result<Checkpoint> {
    let files = files_in(dir)?;
    if files.is_empty() {
        return Err(Error::format(dir, "has no *.safetensors files"));
    }
    let mut tensors = Gathered::default();
    let mut metadata = BTreeMap::new();
    let mut ranks_seen = HashSet::new();
    let mut checksums = vec![];
    let mut world: Option<u32> = None;
    let named = files.iter().all(|f| rank_of(f).is_some());
    for (fi, path) in files.iter().enumerate() {
        let mut h = read_header(path)?;
        checksums.extend(recorded_crcs(path, fi as u32, &mut h)?);
        if let Some(w) = h.metadata.remove(RANKS_KEY) {
            world = Some(w.parse::<u32>().map_err(|_| {
                Error::format(
                    path,
                    format!("`{RANKS_KEY}` in the header is not a rank count"),
                )
            })?);
        }
        let rank = if named {
            rank_of(path).unwrap_or(0)
        } else {
            fi as u32
        };
        ranks_seen.insert(rank);
        let info = sharding_info(path, &h.metadata)?;
        for (k, v) in &h.metadata {
            if !k.starts_with("DCP_") && k != "format" {
                metadata.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        for t in h.tensors {
            let offsets = saved_offsets(path, &info, &t)?;
            let piece = Piece {
                rank,
                region: Region::new(offsets, t.shape.clone()),
                loc: Loc {
                    file: fi as u32,
                    offset: t.offset,
                    strides: None,
                    pending: None,
                },
            };
            tensors.add(path, &files, t, piece)?;
        }
    }
    let ranks = rank_count(dir, &ranks_seen, world, named)?;
    let tensors = tensors.layouts();
    checkpoint(
        Format::HF_STORAGE,
        dir,
        files,
        ranks,
        tensors,
        metadata,
        checksums,
    )
}

/// A header's `DCP_SHARDING_INFO` (an empty map when it has none).
fn sharding_info(
    path: &Path,
    metadata: &BTreeMap<String, String>,
) -> Result<serde_json::Map<String, serde_json::Value>> {
    Ok(match metadata.get(SHARDING_INFO) {
        Some(s) => match serde_json::from_str(s) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => {
                return Err(Error::format(
                    path,
                    format!("`{SHARDING_INFO}` in the header is not a JSON object"),
                ))
            }
        },
        None => Default::default(),
    })
}

/// The global offsets of the chunk `t` stores: its `saved_offsets` in `info`, else the
/// origin; one per dimension.
fn saved_offsets(
    path: &Path,
    info: &serde_json::Map<String, serde_json::Value>,
    t: &HeaderTensor,
) -> Result<Vec<u64>> {
    let offsets: Vec<u64> = match info.get(&t.name) {
        Some(v) => v
            .get("saved_offsets")
            .and_then(|o| o.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                Error::format(
                    path,
                    format!(
                        "`{SHARDING_INFO}` of `{}` has no list of saved_offsets",
                        t.name
                    ),
                )
            })?,
        None => vec![0; t.shape.len()],
    };
    if offsets.len() != t.shape.len() {
        return Err(Error::format(
            path,
            format!(
                "tensor `{}` has {} dims but {} saved_offsets",
                t.name,
                t.shape.len(),
                offsets.len()
            ),
        ));
    }
    Ok(offsets)
}

/// The tensors of the shards, their chunks gathered by name in order of first mention.
#[derive(Default)]
struct Gathered {
    order: Vec<String>,
    by_name: HashMap<String, TensorLayout>,
}

impl Gathered {
    /// Add chunk `piece` of the header tensor `t` of the shard at `path` (one of `files`),
    /// checked to agree with the tensor's other chunks and not to repeat one.
    fn add(&mut self, path: &Path, files: &[PathBuf], t: HeaderTensor, piece: Piece) -> Result<()> {
        let Some(l) = self.by_name.get_mut(&t.name) else {
            self.order.push(t.name.clone());
            self.by_name.insert(
                t.name.clone(),
                TensorLayout {
                    name: t.name,
                    dtype: t.dtype,
                    shape: vec![],
                    pieces: vec![piece],
                },
            );
            return Ok(());
        };
        let ndim = l.pieces[0].region.ndim();
        if l.dtype != t.dtype || ndim != t.shape.len() {
            return Err(Error::format(
                path,
                format!(
                    "tensor `{}` is {} with {} dims here but {} with {} dims in another shard",
                    t.name,
                    t.dtype,
                    t.shape.len(),
                    l.dtype,
                    ndim
                ),
            ));
        }
        if let Some(twin) = l
            .pieces
            .iter()
            .find(|p| p.region == piece.region && !p.region.is_empty())
        {
            return Err(Error::format(
                path,
                format!(
                    "tensor `{}`: chunk {} is stored twice (also in {})",
                    t.name,
                    piece.region,
                    files[twin.loc.file as usize]
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                ),
            ));
        }
        l.pieces.push(piece);
        Ok(())
    }

    /// The layouts in order, each tensor's shape the largest extent of its chunks.
    fn layouts(mut self) -> Vec<TensorLayout> {
        self.order
            .into_iter()
            .map(|n| {
                let mut l = self
                    .by_name
                    .remove(&n)
                    .expect("every ordered name has a layout");
                l.shape = (0..l.pieces[0].region.ndim())
                    .map(|d| l.pieces.iter().map(|p| p.region.end(d)).max().unwrap_or(0))
                    .collect();
                l
            })
            .collect()
    }
}

/// The number of ranks: one past the highest seen, or the world size reshard recorded.
/// torch's writer writes no file for a rank that holds nothing to store (a replica of what a
/// lower rank stores), so its numbering may have gaps (`shard-00001-…`, `shard-00003-…`): the
/// files present are what was saved, as torch's reader takes them, and a chunk lost with a
/// file shows as a region no piece covers. reshard's outputs record their world size and
/// give every rank a file, so there a missing rank file is named.
fn rank_count(
    dir: &Path,
    ranks_seen: &HashSet<u32>,
    world: Option<u32>,
    named: bool,
) -> Result<u32> {
    let seen = ranks_seen.iter().max().map_or(1, |m| m + 1);
    let Some(world) = world.filter(|_| named) else {
        return Ok(seen);
    };
    let ranks = seen.max(world);
    if let Some(missing) = (0..ranks).find(|r| !ranks_seen.contains(r)) {
        return Err(Error::format(
            dir.join(format!("shard-{:05}-…", missing + 1)),
            format!(
                "is missing: files of {} ranks are present, up to shard {:05}",
                ranks_seen.len(),
                ranks
            ),
        ));
    }
    Ok(ranks)
}

/// A chunk to store: its entry (name, dtype, local shape) and its global offsets.
type Chunk = (Entry, Vec<u64>);

/// Lay out `target` as per-rank shards over `world` ranks. A region held by several ranks
/// (replicated) is written once, by the lowest rank, as DCP does. A rank holding several
/// regions of one tensor (`StridedShard`, flat ranges) writes them to successive files
/// `…-model-0000i-of-0000n`. Every rank gets at least one file, so the world size survives.
pub fn write(target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
    let mut per_rank = chunks_by_rank(target, world);
    let metadata = header_metadata(target, opts)?;
    let mut files = vec![];
    let mut pieces: HashMap<String, Vec<Piece>> = HashMap::new();
    for (r, rank_files) in per_rank.iter_mut().enumerate() {
        if rank_files.is_empty() {
            rank_files.push(vec![]);
        }
        let n = rank_files.len();
        for (k, group) in rank_files.iter_mut().enumerate() {
            group.sort_by_key(|(e, _)| std::cmp::Reverse(e.dtype.size()));
            let mut info = serde_json::Map::new();
            for (e, offs) in group.iter() {
                info.insert(e.name.clone(), serde_json::json!({"saved_offsets": offs}));
            }
            let mut meta = metadata.clone();
            meta.insert(
                SHARDING_INFO.into(),
                serde_json::Value::Object(info).to_string(),
            );
            meta.insert("DCP_VERSION".into(), "1.0".into());
            meta.insert(RANKS_KEY.into(), world.to_string());
            meta.insert("format".into(), "pt".into());
            let mut entries: Vec<Entry> = group.iter().map(|(e, _)| e.clone()).collect();
            align_order(&mut entries);
            let name = PathBuf::from(format!(
                "shard-{:05}-model-{:05}-of-{:05}.safetensors",
                r + 1,
                k + 1,
                n
            ));
            let (file, offsets) = output_file(name, &entries, &meta)?;
            let fi = files.len() as u32;
            for ((e, offs), offset) in group.iter().zip(offsets) {
                pieces.entry(e.name.clone()).or_default().push(Piece {
                    rank: r as u32,
                    region: Region::new(offs.clone(), e.shape.clone()),
                    loc: Loc {
                        file: fi,
                        offset,
                        strides: None,
                        pending: None,
                    },
                });
            }
            files.push(file);
        }
    }
    let tensors = target
        .iter()
        .map(|t| TensorLayout {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces: pieces.remove(&t.name).unwrap_or_default(),
        })
        .collect();
    Ok(Output {
        files,
        tensors,
        copies: vec![],
    })
}

/// Per rank, per file index: the chunks it stores (each region once, by the lowest rank
/// holding it; a tensor without data as one chunk on rank 0).
fn chunks_by_rank(target: &[TargetTensor], world: u32) -> Vec<Vec<Vec<Chunk>>> {
    let mut per_rank: Vec<Vec<Vec<Chunk>>> = vec![vec![]; world as usize];
    for t in target {
        if Region::full(&t.shape).is_empty() {
            // No data: one chunk as large as the tensor, on rank 0, records its shape (readers,
            // torch's included, take a tensor's shape from its chunks' extents).
            let files = &mut per_rank[0];
            if files.is_empty() {
                files.push(vec![]);
            }
            files[0].push((
                Entry {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                },
                vec![0; t.shape.len()],
            ));
            continue;
        }
        let mut written: HashSet<&Region> = HashSet::new();
        for (r, files) in per_rank.iter_mut().enumerate() {
            let regions = t.ranks.get(r).map(Vec::as_slice).unwrap_or(&[]);
            let mut k = 0;
            for reg in regions {
                if reg.is_empty() || !written.insert(reg) {
                    continue;
                }
                if files.len() <= k {
                    files.push(vec![]);
                }
                files[k].push((
                    Entry {
                        name: t.name.clone(),
                        dtype: t.dtype,
                        shape: reg.sizes.to_vec(),
                    },
                    reg.offsets.to_vec(),
                ));
                k += 1;
            }
        }
    }
    per_rank
}
