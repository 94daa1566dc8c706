//! PyTorch Distributed Checkpoints (`torch.distributed.checkpoint`, torch 2.1 … 2.15)
//! (`docs/pytorch-formats.md` §1–3, §5–6). This module reads them; `metadata.rs` decodes
//! `.metadata`; [`write`](mod@write) writes them.
//!
//! A DCP directory holds a `.metadata` pickle and data files `__<R>_<I>.distcp`. The metadata
//! lists every tensor's global shape and dtype and its chunks (boxes of the global index
//! space), and maps each chunk (and each non-tensor `BYTE_IO` entry) to a byte range of a data
//! file. Each range is a complete `torch.save` zip archive ([`super::torch::save`]), or, for
//! `FileSystemWriter(serialization_format=SAFETENSORS)`, the start of one safetensors blob per
//! file. `dcp.save(..., use_collectives=False)` writes no `.metadata` but one
//! `__<R>.metadata` per rank, which are merged here. Items whose `_StorageInfo` lists
//! `transform_descriptors = ['stream.zstd/1']` are zstd streams: they are decompressed into a
//! scratch file that lives as long as the [`Checkpoint`].
//!
//! Every tensor becomes a [`TensorLayout`] in `.metadata` order, one [`Piece`] per chunk,
//! located at the chunk's element 0 inside the data file (strides kept when the saved view
//! is not row-major). Locating it means reading each item's central directory and
//! `data.pkl`, which is done over memory maps, in parallel; tensor data is never read here.
//! `BYTE_IO` items and the keys of a Lightning `meta.pt` become [`Extra`]s (an item's `raw`
//! location is that of its `torch.save` archive: in the scratch file when it was zstd-compressed;
//! `meta.pt` keys have none).
//!
//! Anything damaged or hostile is an error naming the file: undecodable metadata, unknown
//! pickle globals, data paths that are absolute, contain `..` or resolve outside the directory,
//! missing or short data files, corrupt zip records, items whose dtype or shape disagree with
//! the metadata, chunks outside their tensor or overlapping (layout validation).

mod codec;
mod metadata;
pub mod write;

use super::torch::pickle::{PickleError, Value};
use super::torch::zip::TorchZipError;
use super::torch::{save, short};
use super::{Checkpoint, Extra, Format, Opaque, RecordCrc};
use crate::checkpoint::Locate;
use crate::error::{Error, IoContext, Result};
use crate::layout::{BlockFlat, DType, Loc, Piece, TensorLayout};
pub use codec::Dcp;
use memmap2::Mmap;
pub use metadata::RESHARD_VERSION;
use metadata::{load_metadata, Item, Kind, Meta};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The global metadata file.
pub const METADATA: &str = ".metadata";
/// The only stream transform torch registers.
pub const ZSTD: &str = "stream.zstd/1";
/// Lightning Fabric's / Trainer's file of non-module, non-optimizer entries.
pub const META_PT: &str = "meta.pt";
const SHARDING_INFO: &str = "DCP_SHARDING_INFO";

/// True for the name of a DCP metadata file: `.metadata`, or a per-rank `__<R>.metadata`.
pub fn is_metadata_name(name: &str) -> bool {
    name == METADATA || metadata::rank_of_metadata(name).is_some()
}

/// The rank `R` of a file named `__R_…` or `__R.metadata`.
pub fn file_rank(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("__")?;
    let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 || !matches!(rest.as_bytes().get(digits), Some(b'_' | b'.')) {
        return None;
    }
    rest[..digits].parse().ok()
}

// ---------------------------------------------------------------------------------------------
// Data files and items

/// A data file (or the scratch file) and its memory map.
struct Source {
    path: PathBuf,
    rank: Option<u32>,
    len: u64,
    map: Option<Mmap>,
}

impl Source {
    fn open(path: PathBuf, rank: Option<u32>) -> Result<Source> {
        let f = std::fs::File::open(&path).at(&path)?;
        let len = f.metadata().at(&path)?.len();
        let map = if len == 0 {
            None
        } else {
            Some(crate::sys::map_file(&f, &path)?)
        };
        Ok(Source {
            path,
            rank,
            len,
            map,
        })
    }

    fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or_default()
    }

    /// Drop the pages of `length` bytes at `offset` from this process's resident set
    /// (they stay in the page cache; a later read faults them in again).
    fn release(&self, offset: u64, length: u64) {
        if let Some(m) = &self.map {
            crate::sys::release(m, offset, offset.saturating_add(length));
        }
    }

    /// `length` bytes at `offset` (callers checked the range against `len`).
    fn slice(&self, offset: u64, length: u64) -> &[u8] {
        let (Ok(a), Ok(n)) = (usize::try_from(offset), usize::try_from(length)) else {
            return &[];
        };
        self.bytes().get(a..a.saturating_add(n)).unwrap_or_default()
    }
}

/// Check a `_StorageInfo.relative_path` and resolve it inside `dir`.
fn resolve(
    dir: &Path,
    dir_canon: &Path,
    meta_path: &Path,
    rel: &str,
    key: &str,
) -> Result<PathBuf> {
    let p = Path::new(rel);
    let plain = !rel.is_empty()
        && p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
    if !plain {
        return Err(Error::format(
            meta_path,
            format!(
                "data path `{}` of `{}` is absolute or leaves the checkpoint directory",
                short(rel),
                short(key)
            ),
        ));
    }
    let full = dir.join(p);
    let canon = match std::fs::canonicalize(&full) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::format(
                &full,
                format!("is missing: the metadata stores `{}` in it", short(key)),
            ))
        }
        Err(e) => return Err(e).at(&full),
    };
    if !canon.starts_with(dir_canon) {
        return Err(Error::format(
            &full,
            format!(
                "resolves to {}, outside the checkpoint directory",
                canon.display()
            ),
        ));
    }
    if !canon.is_file() {
        return Err(Error::format(&full, "is not a regular file"));
    }
    Ok(full)
}

/// What an item holds, per the metadata.
#[derive(Clone, Copy, Debug)]
enum Want {
    Chunk { entry: usize, chunk: usize },
    Bytes { entry: usize },
}

impl Want {
    fn entry(self) -> usize {
        match self {
            Want::Chunk { entry, .. } | Want::Bytes { entry } => entry,
        }
    }
}

/// One item to read.
#[derive(Clone, Debug)]
struct Work {
    want: Want,
    /// The data file named by the metadata.
    file: usize,
    offset: u64,
    length: u64,
    /// Index into [`Meta::transforms`] (0 = none).
    transforms: u32,
    /// Where the (decoded) item bytes are: source index, offset, length.
    at: (usize, u64, u64),
}

/// Decode every zstd frame of `src` into `out`, refusing to write more than `limit` bytes.
fn zstd_decode(src: &[u8], out: &mut impl Write, limit: u64) -> std::result::Result<u64, String> {
    use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
    let mut cur = std::io::Cursor::new(src);
    let mut total = 0u64;
    let mut frames = 0;
    while (cur.position() as usize) < src.len() {
        let start = cur.position();
        match ruzstd::decoding::StreamingDecoder::new(&mut cur) {
            Ok(mut dec) => {
                let room = limit - total;
                let n = std::io::copy(&mut (&mut dec).take(room + 1), out)
                    .map_err(|e| format!("zstd stream is corrupt: {e}"))?;
                total += n;
                if total > limit {
                    return Err(format!("zstd stream expands beyond {limit} bytes"));
                }
                frames += 1;
            }
            Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                length,
                ..
            })) => {
                let next = cur.position() + length as u64;
                if next > src.len() as u64 {
                    return Err("zstd skippable frame is truncated".into());
                }
                cur.set_position(next);
            }
            Err(e) => return Err(format!("zstd stream is corrupt: {e}")),
        }
        if cur.position() <= start {
            return Err("zstd stream is corrupt: no progress".into());
        }
    }
    if frames == 0 {
        return Err("zstd stream holds no frame".into());
    }
    Ok(total)
}

/// The tensors of one safetensors blob (`serialization_format=SAFETENSORS`).
struct Blob {
    /// name → (dtype, shape, absolute data offset)
    tensors: HashMap<String, (DType, Vec<u64>, u64)>,
    sharding: serde_json::Map<String, serde_json::Value>,
}

/// The safetensors blobs of a checkpoint, by (source index, offset).
type Blobs = HashMap<(usize, u64), Blob>;

/// True when `offset` starts a safetensors header rather than a zip local header.
fn is_blob(b: &[u8], offset: u64) -> bool {
    let Some(h) = usize::try_from(offset)
        .ok()
        .and_then(|o| b.get(o..o.checked_add(9)?))
    else {
        return false;
    };
    let mut n = [0u8; 8];
    n.copy_from_slice(&h[..8]);
    let n = u64::from_le_bytes(n);
    h[..4] != *b"PK\x03\x04" && (2..=100_000_000).contains(&n) && h[8] == b'{'
}

fn parse_blob(src: &Source, offset: u64) -> Result<Blob> {
    let b = src.bytes();
    let err =
        |msg: String| Error::format(&src.path, format!("safetensors blob at {offset}: {msg}"));
    let n = match src.slice(offset, 8).try_into() {
        Ok(a) => u64::from_le_bytes(a),
        Err(_) => return Err(err("no header length".into())),
    };
    let start = offset + 8;
    let data_start = start
        .checked_add(n)
        .filter(|&e| e <= src.len)
        .ok_or_else(|| {
            err(format!(
                "header of {n} bytes runs past the end of the file ({} bytes)",
                src.len
            ))
        })?;
    let header = &b[start as usize..data_start as usize];
    let meta: ::safetensors::tensor::Metadata =
        serde_json::from_slice(header).map_err(|e| err(format!("invalid header: {e}")))?;
    let end = data_start.saturating_add(meta.data_len() as u64);
    if end > src.len {
        return Err(Error::format(
            &src.path,
            format!(
                "is truncated: the safetensors blob at {offset} needs bytes up to {end}, the file has {}",
                src.len
            ),
        ));
    }
    let mut tensors = HashMap::new();
    for (name, info) in meta.tensors() {
        let dtype: DType = info.dtype.to_string().parse().map_err(|_| {
            err(format!(
                "tensor `{}` has dtype {}, which reshard does not support",
                short(&name),
                info.dtype
            ))
        })?;
        let shape = info.shape.iter().map(|&s| s as u64).collect();
        tensors.insert(
            name,
            (dtype, shape, data_start + info.data_offsets.0 as u64),
        );
    }
    let sharding = match meta.metadata().as_ref().and_then(|m| m.get(SHARDING_INFO)) {
        None => Default::default(),
        Some(s) => match serde_json::from_str(s) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => return Err(err(format!("`{SHARDING_INFO}` is not a JSON object"))),
        },
    };
    Ok(Blob { tensors, sharding })
}

/// What reading one item gave.
enum Got {
    Piece {
        entry: usize,
        piece: Piece,
        crc: Option<RecordCrc>,
    },
    Extra {
        entry: usize,
        /// Boxed: the rare variant, and much larger than a piece.
        extra: Box<Extra>,
    },
}

/// Read a DCP checkpoint directory, every item's header parsed and checked.
pub fn read(dir: &Path) -> Result<Checkpoint> {
    read_with(dir, false)
}

/// Read a DCP checkpoint directory for [`Checkpoint::open_lazy`]: the `.metadata`, the data
/// files' sizes and the non-tensor (and zstd-compressed) items are read now, and the items of
/// block-flattened tensors (megatron-core's, cut into pieces at offsets inside them); every
/// other `torch.save` or safetensors chunk item is left pending, its header parsed (with the
/// same checks) when a read needs it.
pub fn read_lazy(dir: &Path) -> Result<Checkpoint> {
    read_with(dir, true)
}

fn read_with(dir: &Path, lazy: bool) -> Result<Checkpoint> {
    let (meta_paths, meta) = load_metadata(dir)?;
    let dir_canon = std::fs::canonicalize(dir).at(dir)?;
    let located = locate_items(dir, &dir_canon, &meta, &meta_paths)?;
    let (mut sources, mut works) = open_data_files(dir, located)?;
    check_item_ranges(&works, &sources, |w| &meta.entries[w.want.entry()].name)?;
    let mut scratch = vec![];
    if let Some((src, path)) = decode_transforms(&mut works, &meta, &meta_paths, &sources)? {
        sources.push(src);
        scratch.push(Arc::new(path));
    }
    // Lazily, a plain chunk item is not looked at: its piece points at the item, pending.
    // Block-flattened tensors are located now: their chunks are cut into pieces at offsets
    // within the item.
    let pending = |w: &Work| {
        lazy && w.transforms == 0
            && matches!(w.want, Want::Chunk { entry, .. }
                if !meta.reformulated.contains_key(&meta.entries[entry].name))
    };
    let first = batches(&works, |i| !pending(&works[i]));
    // Parse every item (batches in parallel) and check it against the metadata; the items
    // of safetensors blobs are only recognised (`Ok(None)`), then their shared headers
    // parsed, once each, and then those items. The first error in metadata order is
    // reported, whichever thread met it first, so messages are stable.
    let labels: Vec<Label> = (0..meta.entries.len()).map(|_| Label::new()).collect();
    let no_blobs = Blobs::new();
    let mut parsed = in_batches(&first, &works, &sources, |i| {
        let w = &works[i];
        if in_blob(w, &sources) {
            return Ok(None);
        }
        read_item(w, false, &meta, &sources, &no_blobs, &labels).map(Some)
    });
    let blob_items: Vec<usize> = first
        .iter()
        .flat_map(|b| b.items.iter().copied())
        .filter(|&i| matches!(parsed[i].get(), Some(Ok(None))))
        .collect();
    if !blob_items.is_empty() {
        let blobs = parse_blobs(&works, &sources, &blob_items)?;
        let mut blob_of = vec![false; works.len()];
        for &i in &blob_items {
            blob_of[i] = true;
            parsed[i].take();
        }
        let again = batches(&works, |i| blob_of[i]);
        in_batches_into(&parsed, &again, &works, &sources, |i| {
            read_item(&works[i], true, &meta, &sources, &blobs, &labels).map(Some)
        });
    }
    if lazy {
        for (i, w) in works.iter().enumerate().filter(|(_, w)| pending(w)) {
            parsed[i] = OnceLock::from(Ok(Some(pending_piece(w, &meta, &sources))));
        }
    }
    let got = parsed
        .into_iter()
        .filter_map(|r| r.into_inner()?.transpose());
    let (tensors, mut extras, checksums) = assemble(&meta, &meta_paths, got)?;
    let meta_pt = dir.join(META_PT);
    if meta_pt.is_file() {
        extras.extend(read_meta_pt(&meta_pt)?);
    }
    let ranks = count_ranks(dir, &sources)?;
    let side_files = side_files(dir, &meta_paths, &sources, &meta_pt);
    let producer = Some(match (&meta.reshard, &meta.version) {
        (Some(r), _) => format!("reshard {r} (DCP in the torch 2.1 layout)"),
        (None, None) => "torch 2.1–2.3 (no DCP version)".to_string(),
        (None, Some(v)) => format!("torch >= 2.4 (DCP {v})"),
    });
    let locator: Option<Arc<dyn Locate>> = lazy.then(|| {
        Arc::new(Items {
            files: sources.iter().map(|s| (s.path.clone(), s.rank)).collect(),
            blobs: Mutex::new(HashMap::new()),
        }) as _
    });
    Ok(Checkpoint {
        format: Format::DCP,
        path: dir.to_path_buf(),
        files: sources.into_iter().map(|s| s.path).collect(),
        side_files,
        ranks,
        tensors,
        metadata: BTreeMap::new(),
        extras,
        paths: meta.planner.into_iter().collect(),
        producer,
        saved: meta.saved,
        tag: None,
        companions: vec![],
        scratch,
        checksums,
        locator,
        storage: reshard_storage::local(),
    })
}

/// The piece of a chunk item left pending: its region per the metadata, its location the
/// item itself.
fn pending_piece(w: &Work, meta: &Meta, sources: &[Source]) -> Got {
    let Want::Chunk { entry, chunk } = w.want else {
        unreachable!("only chunk items are left pending")
    };
    let Kind::Tensor { chunks, .. } = &meta.entries[entry].kind else {
        unreachable!("a chunk item belongs to a tensor entry")
    };
    Got::Piece {
        entry,
        piece: Piece {
            rank: sources[w.file].rank.unwrap_or(0),
            region: crate::layout::Region::new(chunks.offsets(chunk), chunks.sizes(chunk)),
            loc: Loc {
                file: w.file as u32,
                offset: w.offset,
                strides: None,
                pending: Some(w.length),
            },
        },
        crc: None,
    }
}

/// The data files of a lazily read checkpoint and the safetensors blob headers parsed so
/// far: what locates its pending pieces. The files are mapped afresh for each pass (a file
/// shortened since the open is then an error, not a fault on a stale mapping).
struct Items {
    files: Vec<(PathBuf, Option<u32>)>,
    blobs: Mutex<HashMap<(usize, u64), Arc<Blob>>>,
}

impl std::fmt::Debug for Items {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Items")
            .field("files", &self.files.len())
            .finish_non_exhaustive()
    }
}

impl Items {
    /// The blob at `offset` of source `file`, its header parsed once.
    fn blob(&self, sources: &[Source], file: usize, offset: u64) -> Result<Arc<Blob>> {
        let mut blobs = self.blobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = blobs.get(&(file, offset)) {
            return Ok(b.clone());
        }
        let b = Arc::new(parse_blob(&sources[file], offset)?);
        blobs.insert((file, offset), b.clone());
        Ok(b)
    }

    /// The location of pending piece `p` of `t` in its item (`w`), read from `sources`.
    fn locate_one(&self, sources: &[Source], t: &TensorLayout, p: &Piece, w: &Work) -> Result<Loc> {
        let src = &sources[w.file];
        let err = |msg: String| {
            Error::format(
                &src.path,
                format!("item `{}` at offset {}: {msg}", short(&t.name), w.offset),
            )
        };
        let want = Expected {
            name: &t.name,
            label: &Label::new(),
            dtype: t.dtype,
            offsets: &p.region.offsets,
            sizes: &p.region.sizes,
        };
        if is_blob(src.bytes(), w.offset) {
            return blob_chunk(&*self.blob(sources, w.file, w.offset)?, w.file, &want).map_err(err);
        }
        let (loc, _) = zip_chunk(w, sources, &want, "").map_err(err)?;
        Ok(loc)
    }
}

impl Locate for Items {
    /// Items are parsed as an eager open parses them: in batches of neighbouring items, in
    /// parallel, each batch's pages released when it is done.
    fn locate(&self, pieces: &[(&TensorLayout, &Piece)]) -> Result<Vec<Loc>> {
        let works: Vec<Work> = pieces
            .iter()
            .enumerate()
            .map(|(i, (t, p))| {
                let file = p.loc.file as usize;
                let length = p.loc.pending.unwrap_or(0);
                if file >= self.files.len() || p.loc.pending.is_none() {
                    return Err(Error::layout(
                        &t.name,
                        format!(
                            "piece {} is not a pending piece of this checkpoint",
                            p.region
                        ),
                    ));
                }
                Ok(Work {
                    want: Want::Chunk { entry: i, chunk: 0 },
                    file,
                    offset: p.loc.offset,
                    length,
                    transforms: 0,
                    at: (file, p.loc.offset, length),
                })
            })
            .collect::<Result<_>>()?;
        // Map the files these items are in, as they are now; the others stay closed.
        let mut used = vec![false; self.files.len()];
        for w in &works {
            used[w.file] = true;
        }
        let sources: Vec<Source> = self
            .files
            .iter()
            .zip(&used)
            .map(|((path, rank), &u)| match u {
                true => Source::open(path.clone(), *rank),
                false => Ok(Source {
                    path: path.clone(),
                    rank: *rank,
                    len: 0,
                    map: None,
                }),
            })
            .collect::<Result<_>>()?;
        check_item_ranges(&works, &sources, |w| &pieces[w.want.entry()].0.name)?;
        let found = in_batches(&batches(&works, |_| true), &works, &sources, |i| {
            let (t, p) = pieces[i];
            self.locate_one(&sources, t, p, &works[i])
        });
        found.into_iter().filter_map(OnceLock::into_inner).collect()
    }
}

/// Every item the metadata lists, and the data files they name.
struct Located {
    /// Data file paths relative to the directory, in order of first mention.
    rels: Vec<String>,
    /// Per item: what it holds, the index of its data file in `rels`, where it lies.
    items: Vec<(Want, usize, Item)>,
}

/// Locate every item in the metadata: its storage entry, and its data file, resolved (and
/// checked to stay inside the directory) once per file.
fn locate_items(
    dir: &Path,
    dir_canon: &Path,
    meta: &Meta,
    meta_paths: &[PathBuf],
) -> Result<Located> {
    let mut rels: Vec<String> = vec![];
    // Per `Meta::files` entry, its index in `rels` once resolved.
    let mut rel_of: Vec<Option<usize>> = vec![None; meta.files.len()];
    let total: usize = meta
        .entries
        .iter()
        .map(|e| e.kind.chunk_count().max(1))
        .sum();
    let mut items: Vec<(Want, usize, Item)> = Vec::with_capacity(total);
    for (ei, e) in meta.entries.iter().enumerate() {
        let meta_path = &meta_paths[e.origin];
        let mut add = |want: Want, item: Option<Item>, what: &dyn Fn() -> String| -> Result<()> {
            let item = item.ok_or_else(|| {
                Error::format(meta_path, format!("no storage_data entry for {}", what()))
            })?;
            let fi = item.file as usize;
            let ri = match rel_of[fi] {
                Some(i) => i,
                None => {
                    let rel = &meta.files[fi];
                    resolve(dir, dir_canon, meta_path, rel, &e.name)?;
                    rel_of[fi] = Some(rels.len());
                    rels.push(rel.clone());
                    rels.len() - 1
                }
            };
            items.push((want, ri, item));
            Ok(())
        };
        match &e.kind {
            Kind::Tensor {
                chunks,
                items: chunk_items,
                ..
            } => {
                for (ci, it) in chunk_items.iter().enumerate() {
                    add(
                        Want::Chunk {
                            entry: ei,
                            chunk: ci,
                        },
                        *it,
                        &|| format!("chunk {} of `{}`", chunks.region(ci), short(&e.name)),
                    )?;
                }
            }
            Kind::Bytes { item } => add(Want::Bytes { entry: ei }, *item, &|| {
                format!("`{}`", short(&e.name))
            })?,
        }
    }
    Ok(Located { rels, items })
}

/// Open the data files in (rank, name) order, and turn the located items into work on them.
fn open_data_files(dir: &Path, located: Located) -> Result<(Vec<Source>, Vec<Work>)> {
    let Located { rels, items } = located;
    let mut order: Vec<usize> = (0..rels.len()).collect();
    let rank_of = |rel: &str| Path::new(rel).file_name()?.to_str().and_then(file_rank);
    order.sort_by_key(|&i| (rank_of(&rels[i]).unwrap_or(u32::MAX), rels[i].clone()));
    let mut new_index = vec![0usize; rels.len()];
    let mut sources = Vec::with_capacity(rels.len() + 1);
    for (fi, &ri) in order.iter().enumerate() {
        new_index[ri] = fi;
        sources.push(Source::open(dir.join(&rels[ri]), rank_of(&rels[ri]))?);
    }
    let works = items
        .into_iter()
        .map(|(want, ri, it)| {
            let file = new_index[ri];
            Work {
                want,
                file,
                offset: it.offset,
                length: it.length,
                transforms: it.transforms,
                at: (file, it.offset, it.length),
            }
        })
        .collect();
    Ok((sources, works))
}

/// Check that every item's byte range lies inside its data file; `name` says whose item a
/// work item is, for the message.
fn check_item_ranges<'a>(
    works: &[Work],
    sources: &[Source],
    name: impl Fn(&Work) -> &'a str,
) -> Result<()> {
    for w in works {
        let src = &sources[w.file];
        let end = w.offset.checked_add(w.length);
        if end.is_none_or(|e| e > src.len) {
            return Err(Error::format(
                &src.path,
                format!(
                    "is truncated: item `{}` needs bytes {}..{}, the file has {}",
                    short(name(w)),
                    w.offset,
                    end.map_or_else(|| "overflow".to_string(), |e| e.to_string()),
                    src.len
                ),
            ));
        }
    }
    Ok(())
}

/// Items of one data file lying close together, parsed by one thread; the pages parsing
/// touched are released at the end of the batch.
struct Batch {
    /// Indices into the work list, in file order.
    items: Vec<usize>,
    /// The source and the byte range the items span there.
    source: usize,
    span: (u64, u64),
}

/// Most bytes of a data file one batch spans (a larger item is a batch of its own).
const BATCH_SPAN: u64 = 64 << 20;
/// Most items in one batch, so that threads share the work.
const BATCH_ITEMS: usize = 4096;

impl Batch {
    /// Drop the pages of the batch's span (and of the stored ranges of zstd items) from this
    /// process's resident set: parsing touched the item headers, and the page cache may map
    /// them as large folios, so opening a checkpoint would otherwise hold its data files
    /// resident. One call per batch: a call per item made opening a million-chunk checkpoint
    /// spend most of its time in TLB shootdowns.
    fn release(&self, works: &[Work], sources: &[Source]) {
        sources[self.source].release(self.span.0, self.span.1 - self.span.0);
        for &i in &self.items {
            let w = &works[i];
            if w.at.0 != w.file {
                sources[w.file].release(w.offset, w.length);
            }
        }
    }
}

/// Split the work `keep` selects (by index) into batches: items sorted by where their
/// (decoded) bytes are, cut where the source changes, the span would exceed [`BATCH_SPAN`]
/// or the count [`BATCH_ITEMS`].
fn batches(works: &[Work], keep: impl Fn(usize) -> bool) -> Vec<Batch> {
    let mut order: Vec<usize> = (0..works.len()).filter(|&i| keep(i)).collect();
    order.sort_unstable_by_key(|&i| (works[i].at.0, works[i].at.1));
    let mut out: Vec<Batch> = vec![];
    for i in order {
        let (src, off, len) = works[i].at;
        let end = off.saturating_add(len);
        match out.last_mut() {
            Some(b)
                if b.source == src
                    && b.items.len() < BATCH_ITEMS
                    && end.max(b.span.1) - b.span.0 <= BATCH_SPAN =>
            {
                b.items.push(i);
                b.span.1 = b.span.1.max(end);
            }
            _ => out.push(Batch {
                items: vec![i],
                source: src,
                span: (off, end),
            }),
        }
    }
    out
}

/// `parse` of every work item of `batches` (batches in parallel, each batch's pages released
/// when it is done), by work index (unset for works in no batch), so that callers report the
/// first error in work order whichever thread met it first. Each result is put in place by
/// the thread that made it: at a million items every copy counts.
fn in_batches<T: Send + Sync>(
    batches: &[Batch],
    works: &[Work],
    sources: &[Source],
    parse: impl Fn(usize) -> Result<T> + Sync,
) -> Vec<OnceLock<Result<T>>> {
    let slots: Vec<OnceLock<Result<T>>> = (0..works.len()).map(|_| OnceLock::new()).collect();
    in_batches_into(&slots, batches, works, sources, parse);
    slots
}

/// [`in_batches`] into `slots` (by work index), which must be unset for the batches' items.
fn in_batches_into<T: Send + Sync>(
    slots: &[OnceLock<Result<T>>],
    batches: &[Batch],
    works: &[Work],
    sources: &[Source],
    parse: impl Fn(usize) -> Result<T> + Sync,
) {
    batches.par_iter().for_each(|b| {
        for &i in &b.items {
            // Batches do not share items, so the slot is free.
            let _ = slots[i].set(parse(i));
        }
        b.release(works, sources);
    });
}

/// Whether work item `w` is a chunk stored in a safetensors blob
/// (`serialization_format=SAFETENSORS`).
fn in_blob(w: &Work, sources: &[Source]) -> bool {
    matches!(w.want, Want::Chunk { .. })
        && w.transforms == 0
        && is_blob(sources[w.file].bytes(), w.offset)
}

/// The headers of the safetensors blobs holding work `items`, each parsed once, by (source,
/// offset), in the order of `items` (the first bad one is reported). The pages this maps
/// are released when the items are parsed, batch by batch.
fn parse_blobs(works: &[Work], sources: &[Source], items: &[usize]) -> Result<Blobs> {
    let mut blobs: Blobs = HashMap::new();
    for &i in items {
        let w = &works[i];
        if let std::collections::hash_map::Entry::Vacant(v) = blobs.entry((w.file, w.offset)) {
            v.insert(parse_blob(&sources[w.file], w.offset)?);
        }
    }
    Ok(blobs)
}

/// Gather what the items gave, in work order, into tensors (in metadata order, each
/// validated), `BYTE_IO` extras and record checksums; the first item that failed fails it.
fn assemble(
    meta: &Meta,
    meta_paths: &[PathBuf],
    got: impl Iterator<Item = Result<Got>>,
) -> Result<(Vec<TensorLayout>, Vec<Extra>, Vec<RecordCrc>)> {
    let mut pieces: Vec<Vec<Piece>> = meta
        .entries
        .iter()
        .map(|e| match &e.kind {
            Kind::Tensor { .. } => Vec::with_capacity(e.kind.chunk_count()),
            Kind::Bytes { .. } => vec![],
        })
        .collect();
    let mut extras_by_entry: Vec<Option<Extra>> = vec![None; meta.entries.len()];
    let mut checksums = vec![];
    for g in got {
        match g? {
            Got::Piece { entry, piece, crc } => {
                pieces[entry].push(piece);
                checksums.extend(crc);
            }
            Got::Extra { entry, extra } => extras_by_entry[entry] = Some(*extra),
        }
    }
    let mut tensors = vec![];
    let mut origins = vec![];
    let mut extras = vec![];
    for ((e, ps), x) in meta.entries.iter().zip(pieces).zip(extras_by_entry) {
        match &e.kind {
            Kind::Tensor { dtype, size, .. } => {
                let t = TensorLayout {
                    name: e.name.clone(),
                    dtype: *dtype,
                    shape: size.clone(),
                    pieces: ps,
                };
                let t = match meta.reformulated.get(&e.name) {
                    None => t,
                    Some(real) => {
                        unflatten(t, real).map_err(|m| Error::format(&meta_paths[e.origin], m))?
                    }
                };
                tensors.push(t);
                origins.push(e.origin);
            }
            Kind::Bytes { .. } => extras.extend(x),
        }
    }
    // Validated in parallel; the first error in metadata order is reported.
    let checked: Vec<Result<()>> = tensors
        .par_iter()
        .zip(&origins)
        .map(|(t, &o)| {
            t.validate()
                .map_err(|err| Error::format(&meta_paths[o], err.to_string()))
        })
        .collect();
    checked.into_iter().collect::<Result<()>>()?;
    Ok((tensors, extras, checksums))
}

/// A tensor stored block-flattened (megatron-core's flattened ranges, the real shape from
/// `mcore_data`): its chunks of the view as pieces of the real tensor of `shape`
/// ([`BlockFlat::to_real`]).
fn unflatten(t: TensorLayout, shape: &[u64]) -> std::result::Result<TensorLayout, String> {
    // the stored view first: its chunks in bounds, covering it once, not overlapping (boxes
    // of the real tensor cut from overlapping ranges could look like replicas)
    t.validate().map_err(|e| e.to_string())?;
    let named = |m: String| format!("tensor `{}`: {m}", short(&t.name));
    if shape.len() > crate::layout::MAX_DIMS {
        return Err(named(format!("has {} dimensions", shape.len())));
    }
    let bf = BlockFlat::new(shape, &t.shape).map_err(named)?;
    let elem = t.dtype.size() as u64;
    let mut pieces = Vec::with_capacity(t.pieces.len());
    for p in t.pieces {
        let n = p.region.ndim();
        if p.region.sizes[..n.saturating_sub(1)]
            .iter()
            .any(|&s| s != 1)
        {
            return Err(named(format!(
                "chunk {} of a block-flattened tensor spans more than one block",
                p.region
            )));
        }
        if p.region.is_empty() {
            continue;
        }
        let row_major = crate::layout::row_major_strides(&p.region.sizes);
        let contiguous = p.loc.strides.as_ref().is_none_or(|st| {
            st.iter()
                .zip(row_major.iter())
                .zip(p.region.sizes.iter())
                .all(|((a, b), &n)| n <= 1 || a == b)
        });
        if !contiguous || p.loc.pending.is_some() {
            return Err(named(format!(
                "chunk at {:?} of a block-flattened tensor is not stored contiguously",
                p.region.offsets.as_slice()
            )));
        }
        for (region, at) in bf.to_real(&p.region).map_err(named)? {
            pieces.push(Piece {
                rank: p.rank,
                region,
                loc: Loc {
                    file: p.loc.file,
                    offset: at
                        .checked_mul(elem)
                        .and_then(|b| b.checked_add(p.loc.offset))
                        .ok_or_else(|| named("a chunk's offset overflows".into()))?,
                    strides: None,
                    pending: None,
                },
            });
        }
    }
    Ok(TensorLayout {
        shape: shape.to_vec(),
        pieces,
        ..t
    })
}

/// The files of a DCP folder that hold no item its metadata names: the metadata files
/// (`meta_paths`), the data files of ranks that stored nothing (torch and reshard create them
/// empty), and Lightning's `meta.pt` when there is one.
fn side_files(
    dir: &Path,
    meta_paths: &[PathBuf],
    sources: &[Source],
    meta_pt: &Path,
) -> Vec<PathBuf> {
    let mut out = meta_paths.to_vec();
    for name in crate::file_names(dir).unwrap_or_default() {
        let path = dir.join(&name);
        if name.ends_with(".distcp") && !sources.iter().any(|s| s.path == path) {
            out.push(path);
        }
    }
    if meta_pt.is_file() {
        out.push(meta_pt.to_path_buf());
    }
    out
}

/// The world size: one more than the highest rank of every `__R_*` data file and
/// `__R.metadata` (a rank may have written nothing the metadata references).
fn count_ranks(dir: &Path, sources: &[Source]) -> Result<u32> {
    let listed: Vec<u32> = std::fs::read_dir(dir)
        .at(dir)?
        .filter_map(|e| {
            let name = e.ok()?.file_name();
            let name = name.to_str()?;
            (name.ends_with(".distcp") || name.ends_with(".metadata"))
                .then(|| file_rank(name))
                .flatten()
        })
        .collect();
    Ok(sources
        .iter()
        .filter_map(|s| s.rank)
        .chain(listed)
        .max()
        .map_or(1, |r| r + 1))
}

/// Scratch files of decoded zstd items are `$TMPDIR/.reshard-dcp-PID-XXXXXX.zst-decoded`.
const SCRATCH_PREFIX: &str = ".reshard-dcp-";
const SCRATCH_SUFFIX: &str = ".zst-decoded";

/// Remove the scratch files of processes that no longer exist (a run killed before its
/// scratch file's handle could remove it), saying so on stderr. A scratch file whose pid is
/// alive is left alone, whatever that process is: a library user (a trainer) may be
/// reading it. Errors are ignored: this is housekeeping.
fn remove_dead_scratch(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SCRATCH_PREFIX))
            .filter(|n| n.ends_with(SCRATCH_SUFFIX))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != me && !crate::sys::pid_alive(pid) && std::fs::remove_file(e.path()).is_ok() {
            eprintln!(
                "reshard: removed {}, left by an interrupted run (pid {pid})",
                e.path().display()
            );
        }
    }
}

/// Decode the items that have stream transforms into one scratch file, pointing their
/// `at` there; returns the scratch file (as a source) and its handle.
fn decode_transforms(
    works: &mut [Work],
    meta: &Meta,
    meta_paths: &[PathBuf],
    sources: &[Source],
) -> Result<Option<(Source, tempfile::TempPath)>> {
    if works.iter().all(|w| w.transforms == 0) {
        return Ok(None);
    }
    let dir = std::env::temp_dir();
    remove_dead_scratch(&dir);
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!("{SCRATCH_PREFIX}{}-", std::process::id()))
        .suffix(SCRATCH_SUFFIX)
        .tempfile_in(&dir)
        .at(&dir)?;
    let tmp_path = tmp.path().to_path_buf();
    let scratch_index = sources.len();
    let mut pos = 0u64;
    let mut out = std::io::BufWriter::new(tmp.as_file_mut());
    for w in works.iter_mut().filter(|w| w.transforms != 0) {
        let e = &meta.entries[w.want.entry()];
        let meta_path = &meta_paths[e.origin];
        let transforms = &meta.transforms[w.transforms as usize];
        if let Some(t) = transforms.iter().find(|t| t.as_str() != ZSTD) {
            return Err(Error::format(
                meta_path,
                format!(
                    "`{}` uses stream transform `{}`, which reshard does not support (only {ZSTD})",
                    short(&e.name),
                    short(t)
                ),
            ));
        }
        if transforms.len() != 1 {
            return Err(Error::format(
                meta_path,
                format!(
                    "`{}` lists {} stream transforms; only a single {ZSTD} is supported",
                    short(&e.name),
                    transforms.len()
                ),
            ));
        }
        // A decompression bomb is refused: a tensor item is its chunk's bytes plus a few
        // KiB of zip and pickle.
        let expected = match (w.want, &e.kind) {
            (Want::Chunk { chunk, .. }, Kind::Tensor { dtype, chunks, .. }) => chunks
                .region(chunk)
                .volume()
                .saturating_mul(dtype.size() as u64),
            _ => 0,
        };
        let limit = expected
            .saturating_add(64 << 20)
            .saturating_add(w.length.saturating_mul(16));
        let src = &sources[w.file];
        let n = zstd_decode(src.slice(w.offset, w.length), &mut out, limit).map_err(|m| {
            Error::format(
                &src.path,
                format!("item `{}` at offset {}: {m}", short(&e.name), w.offset),
            )
        })?;
        w.at = (scratch_index, pos, n);
        pos += n;
    }
    out.flush().at(&tmp_path)?;
    drop(out);
    let path = tmp.into_temp_path();
    let src = Source::open(path.to_path_buf(), None)?;
    Ok(Some((src, path)))
}

/// Parse one item and check it against what the metadata says it holds.
fn read_item(
    w: &Work,
    blob: bool,
    meta: &Meta,
    sources: &[Source],
    blobs: &Blobs,
    labels: &[Label],
) -> Result<Got> {
    let origin = &sources[w.file];
    let (entry, chunk) = match w.want {
        Want::Chunk { entry, chunk } => (entry, Some(chunk)),
        Want::Bytes { entry } => (entry, None),
    };
    let e = &meta.entries[entry];
    let zst = if w.at.0 != w.file {
        " (zstd-decoded)"
    } else {
        ""
    };
    let err = |msg: String| {
        Error::format(
            &origin.path,
            format!(
                "item `{}` at offset {}{zst}: {msg}",
                short(&e.name),
                w.offset
            ),
        )
    };
    let (want_dtype, c) = match (&e.kind, chunk) {
        (Kind::Tensor { dtype, chunks, .. }, Some(ci)) => {
            (*dtype, (chunks.offsets(ci), chunks.sizes(ci)))
        }
        _ => {
            // A BYTE_IO item: decode the value; one whose pickle names a global outside
            // the allow-list is kept as its stored bytes, nothing of it run.
            let (si, off, len) = w.at;
            let bytes = sources[si].slice(off, len);
            let (value, pickle, opaque) = match save::parse(bytes) {
                Ok(item) => (to_json(&item.value), Some(item.value), None),
                Err(TorchZipError::Pickle {
                    source: PickleError::UnknownGlobal { module, name, .. },
                    ..
                }) => {
                    let global = format!("{}.{}", short(&module), short(&name));
                    let shown = format!("<opaque {global}>").into();
                    let bytes = bytes.into();
                    (shown, None, Some(Opaque { global, bytes }))
                }
                Err(e) => return Err(err(e.to_string())),
            };
            return Ok(Got::Extra {
                entry,
                extra: Box::new(Extra {
                    name: e.name.clone(),
                    value,
                    pickle,
                    raw: Some((si as u32, off, len)),
                    origin: "dcp",
                    opaque,
                }),
            });
        }
    };
    let want = Expected {
        name: &e.name,
        label: &labels[entry],
        dtype: want_dtype,
        offsets: c.0,
        sizes: c.1,
    };
    let (loc, crc) = if blob {
        let loc = blob_chunk(&blobs[&(w.file, w.offset)], w.file, &want).map_err(err)?;
        (loc, None)
    } else {
        zip_chunk(w, sources, &want, zst).map_err(err)?
    };
    Ok(Got::Piece {
        crc,
        entry,
        piece: Piece {
            rank: origin.rank.unwrap_or(0),
            region: want.region(),
            loc,
        },
    })
}

/// A tensor's label for its records' checksums (`item `w` record archive/data/0`), made
/// once and shared by its chunks while their records have the same name.
type Label = OnceLock<(String, Arc<str>)>;

/// What the metadata says a chunk item holds.
struct Expected<'a> {
    name: &'a str,
    label: &'a Label,
    dtype: DType,
    offsets: &'a [u64],
    sizes: &'a [u64],
}

impl Expected<'_> {
    /// The checksum label of the record `record` of this chunk's item.
    fn label(&self, record: &str, zst: &str) -> Arc<str> {
        let make =
            || -> Arc<str> { format!("item `{}` record {record}{zst}", short(self.name)).into() };
        let (key, label) = self
            .label
            .get_or_init(|| (format!("{record}{zst}"), make()));
        if key.len() == record.len() + zst.len() && key.starts_with(record) && key.ends_with(zst) {
            label.clone()
        } else {
            make()
        }
    }

    /// The chunk as a region of its tensor.
    fn region(&self) -> crate::layout::Region {
        crate::layout::Region::new(self.offsets, self.sizes)
    }

    /// Check an item's dtype and shape against the metadata's.
    fn check(&self, dtype: DType, shape: &[u64]) -> std::result::Result<(), String> {
        let want = self.dtype;
        if dtype != want {
            return Err(format!("holds {dtype} but the metadata says {want}"));
        }
        if shape != self.sizes {
            return Err(format!(
                "has shape {shape:?} but its chunk {} has sizes {:?}",
                self.region(),
                self.sizes
            ));
        }
        Ok(())
    }
}

/// Locate a chunk inside a safetensors blob of data file `file`, checked against the
/// metadata (and the blob's `DCP_SHARDING_INFO` offsets when it has them).
fn blob_chunk(b: &Blob, file: usize, want: &Expected) -> std::result::Result<Loc, String> {
    let (dtype, shape, abs) = b
        .tensors
        .get(want.name)
        .ok_or("the safetensors blob there has no such tensor")?;
    want.check(*dtype, shape)?;
    if let Some(saved) = b
        .sharding
        .get(want.name)
        .and_then(|v| v.get("saved_offsets"))
    {
        let saved: Option<Vec<u64>> = saved
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect());
        if saved.as_deref() != Some(want.offsets) {
            return Err(format!(
                "`{SHARDING_INFO}` offsets {saved:?} disagree with the chunk {}",
                want.region()
            ));
        }
    }
    Ok(Loc {
        file: file as u32,
        offset: *abs,
        strides: None,
        pending: None,
    })
}

/// Locate a chunk inside its `torch.save` item (in the scratch file when zstd-decoded),
/// checked against the metadata, with the CRC-32 of its storage record.
fn zip_chunk(
    w: &Work,
    sources: &[Source],
    want: &Expected,
    zst: &str,
) -> std::result::Result<(Loc, Option<RecordCrc>), String> {
    let (si, off, len) = w.at;
    let item = save::parse_tensor(sources[si].slice(off, len)).map_err(|e| e.to_string())?;
    let t = item
        .tensor
        .ok_or_else(|| format!("holds a pickled {}, not a tensor", item.kind))?;
    want.check(t.dtype, &t.shape)?;
    let record = format!("{}/data/{}", item.archive.prefix, t.storage_key);
    let crc = item.archive.entry(&record).map(|x| RecordCrc {
        file: si as u32,
        offset: off + t.record.offset,
        len: t.record.len,
        crc: x.crc,
        what: want.label(&record, zst),
        shown: (si != w.file).then_some(w.file as u32),
    });
    let loc = Loc {
        file: si as u32,
        offset: off + t.data_offset(),
        strides: (!t.is_row_major()).then(|| t.strides.clone()),
        pending: None,
    };
    Ok((loc, crc))
}

/// The top-level keys of a Lightning `meta.pt` as extras.
fn read_meta_pt(path: &Path) -> Result<Vec<Extra>> {
    read_pickled_dict(path, "meta.pt")
}

/// The top-level keys of a `torch.save` file holding a dict of plain values (Lightning's
/// `meta.pt`, megatron-core's `common.pt`) as extras of the given origin.
pub fn read_pickled_dict(path: &Path, origin: &'static str) -> Result<Vec<Extra>> {
    static GLOBALS: OnceLock<crate::torch::pickle::Globals> = OnceLock::new();
    let globals = GLOBALS.get_or_init(crate::torch::pickle::pickled_dict_globals);
    let src = Source::open(path.to_path_buf(), None)?;
    let item =
        save::parse_with(src.bytes(), globals).map_err(|e| Error::format(path, e.to_string()))?;
    let pairs = item.value.as_dict().ok_or_else(|| {
        Error::format(
            path,
            format!("holds a pickled {}, not a dict", item.value.kind()),
        )
    })?;
    pairs
        .iter()
        .map(|(k, v)| {
            let name = match k {
                Value::Str(s) => s.clone(),
                Value::Int(i) => i.to_string(),
                other => {
                    return Err(Error::format(
                        path,
                        format!(
                            "has a {} key; only str and int keys are supported",
                            other.kind()
                        ),
                    ))
                }
            };
            Ok(Extra {
                name,
                value: to_json(v),
                pickle: Some(v.clone()),
                raw: None,
                origin,
                opaque: None,
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// JSON

/// A decoded pickle value as JSON, for display and comparison: tuples, lists and sets become
/// arrays; dicts with str/int/bool/None keys objects (other dicts arrays of `[key, value]`);
/// None null; NaN and infinities the strings `nan`, `inf`, `-inf`; globals (torch dtypes)
/// their dotted name; `torch.Size` an array; `torch.device` its string; bytes
/// `"<bytes: N>"`; other objects `"<module.name>"`.
pub fn to_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::BigInt(b) => big_int(b),
        Value::Float(f) => float(*f),
        Value::Str(s) => J::String(s.clone()),
        Value::Bytes(b) => J::String(format!("<bytes: {}>", b.len())),
        Value::List(items) | Value::Tuple(items) | Value::Set(items) => {
            J::Array(items.iter().map(to_json).collect())
        }
        Value::Dict(pairs) => {
            let keys: Option<Vec<String>> = pairs
                .iter()
                .map(|(k, _)| match k {
                    Value::Str(s) => Some(s.clone()),
                    Value::Int(i) => Some(i.to_string()),
                    Value::Bool(b) => Some(b.to_string()),
                    Value::None => Some("null".into()),
                    _ => None,
                })
                .collect();
            match keys {
                Some(keys) => J::Object(
                    keys.into_iter()
                        .zip(pairs)
                        .map(|(k, (_, v))| (k, to_json(v)))
                        .collect(),
                ),
                None => J::Array(
                    pairs
                        .iter()
                        .map(|(k, v)| J::Array(vec![to_json(k), to_json(v)]))
                        .collect(),
                ),
            }
        }
        Value::Global { module, name } => J::String(format!("{module}.{name}")),
        Value::Object {
            module, name, args, ..
        } => match (module.as_str(), name.as_str(), args.as_slice()) {
            ("torch", "Size", [inner]) => to_json(inner),
            ("torch", "device", [Value::Str(t)]) => J::String(t.clone()),
            ("torch", "device", [Value::Str(t), Value::Int(i)]) => J::String(format!("{t}:{i}")),
            _ => J::String(format!("<{module}.{name}>")),
        },
        Value::PersistentId(_) => J::String("<persistent id>".into()),
    }
}

fn float(f: f64) -> serde_json::Value {
    match serde_json::Number::from_f64(f) {
        Some(n) => serde_json::Value::Number(n),
        None if f.is_nan() => "nan".into(),
        None if f > 0.0 => "inf".into(),
        None => "-inf".into(),
    }
}

/// A little-endian two's complement int (pickle `LONG1`) that does not fit `i64`.
fn big_int(b: &[u8]) -> serde_json::Value {
    if b.is_empty() || b.len() > 16 {
        return if b.is_empty() {
            0.into()
        } else {
            format!("<int: {} bytes>", b.len()).into()
        };
    }
    let neg = b[b.len() - 1] & 0x80 != 0;
    let mut a = [if neg { 0xFF } else { 0 }; 16];
    a[..b.len()].copy_from_slice(b);
    let v = i128::from_le_bytes(a);
    if let Ok(u) = u64::try_from(v) {
        u.into()
    } else if let Ok(i) = i64::try_from(v) {
        i.into()
    } else {
        v.to_string().into()
    }
}

/// A data file and byte ranges `(start, end)` of it.
pub type FileRanges = (PathBuf, Vec<(u64, u64)>);

/// The bytes of the data files of the DCP checkpoint in `dir` that opening it reads, per
/// file: each item's `torch.save` records around its tensor data (the bytes before and
/// after it, at most the item's length less the tensor's bytes at either end), and whole
/// items that are not plain tensors (pickled values, stream-transformed items). The
/// metadata file(s) must be readable.
pub fn index_ranges(dir: &Path) -> Result<Vec<FileRanges>> {
    let (_, meta) = load_metadata(dir)?;
    let mut out: Vec<Vec<(u64, u64)>> = vec![vec![]; meta.files.len()];
    let mut add = |item: &Item, data: Option<u64>| {
        let Some(spans) = out.get_mut(item.file as usize) else {
            return;
        };
        let (a, len) = (item.offset, item.length);
        let end = a.saturating_add(len);
        match data.and_then(|d| len.checked_sub(d)) {
            Some(around) if item.transforms == 0 => {
                let around = around.min(len);
                spans.push((a, a.saturating_add(around)));
                spans.push((end.saturating_sub(around), end));
            }
            _ => spans.push((a, end)),
        }
    };
    for e in &meta.entries {
        match &e.kind {
            Kind::Tensor {
                dtype,
                chunks,
                items,
                ..
            } => {
                for (i, item) in items.iter().enumerate() {
                    if let Some(item) = item {
                        let elems = chunks
                            .sizes(i)
                            .iter()
                            .try_fold(1u64, |n, &s| n.checked_mul(s));
                        add(item, elems.and_then(|n| n.checked_mul(dtype.size() as u64)));
                    }
                }
            }
            Kind::Bytes { item: Some(item) } => add(item, None),
            Kind::Bytes { item: None } => {}
        }
    }
    Ok(meta
        .files
        .iter()
        .zip(out)
        .filter(|(_, s)| !s.is_empty())
        .map(|(f, s)| (dir.join(f), s))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Region;
    use crate::KeyPart;
    use serde_json::json;

    fn fixture(case: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(case)
            .join("checkpoint")
    }

    #[test]
    fn file_ranks() {
        assert_eq!(file_rank("__0_0.distcp"), Some(0));
        assert_eq!(file_rank("__12_3.distcp"), Some(12));
        assert_eq!(file_rank("__3.metadata"), Some(3));
        assert_eq!(file_rank("__x_0.distcp"), None);
        assert_eq!(file_rank("__3"), None);
        assert_eq!(file_rank("shard-00001.safetensors"), None);
    }

    #[test]
    fn json_of_pickle_values() {
        let v = Value::Dict(vec![
            (Value::Str("lr".into()), Value::Float(0.5)),
            (
                Value::Str("betas".into()),
                Value::Tuple(vec![Value::Float(0.9), Value::Float(0.95)]),
            ),
            (Value::Int(3), Value::None),
            (Value::Str("nan".into()), Value::Float(f64::NAN)),
            (Value::Str("inf".into()), Value::Float(f64::NEG_INFINITY)),
            (Value::Str("b".into()), Value::Bytes(vec![1, 2, 3])),
            (
                Value::Str("dt".into()),
                Value::Global {
                    module: "torch".into(),
                    name: "bfloat16".into(),
                },
            ),
            (
                Value::Str("obj".into()),
                Value::Object {
                    module: "my.mod".into(),
                    name: "Thing".into(),
                    args: vec![],
                    state: None,
                },
            ),
            (
                Value::Str("big".into()),
                Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 1]),
            ),
            (
                Value::Str("neg".into()),
                Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x7f, 0xff]),
            ),
        ]);
        assert_eq!(
            to_json(&v),
            json!({"lr": 0.5, "betas": [0.9, 0.95], "3": null, "nan": "nan", "inf": "-inf",
                   "b": "<bytes: 3>", "dt": "torch.bfloat16", "obj": "<my.mod.Thing>",
                   "big": "18446744073709551616", "neg": "-9295429630892703744"})
        );
        let odd = Value::Dict(vec![(Value::Tuple(vec![]), Value::Int(1))]);
        assert_eq!(to_json(&odd), json!([[[], 1]]));
    }

    #[test]
    fn reads_fsdp2_metadata_and_item_offsets() {
        let ck = read(&fixture("fsdp2_w4_f32")).unwrap();
        assert_eq!(ck.ranks, 4);
        assert_eq!(ck.files.len(), 4);
        assert_eq!(ck.producer.as_deref(), Some("torch >= 2.4 (DCP 1.0.0)"));
        let cls = ck.tensor("model.cls").unwrap();
        assert_eq!(cls.shape, vec![3, 12]);
        assert_eq!(cls.pieces.len(), 4);
        // chunk 0: __0_0.distcp offset 0, data record at 704 (docs §3.2)
        assert_eq!(cls.pieces[0].loc.offset, 704);
        assert_eq!(cls.pieces[0].rank, 0);
        assert_eq!(cls.pieces[3].region, Region::new(vec![3, 0], vec![0, 12]));
        let tr = ck.tensor("extra.transposed").unwrap();
        assert_eq!(tr.pieces[0].loc.strides, Some(vec![1, 3]));
        assert_eq!(
            ck.paths["optimizer.state.blocks.0.fc1.weight.exp_avg"],
            vec![
                KeyPart::Key("optimizer".into()),
                KeyPart::Key("state".into()),
                KeyPart::Key("blocks.0.fc1.weight".into()),
                KeyPart::Key("exp_avg".into())
            ]
        );
        assert_eq!(
            ck.paths["extra.hist.0"][2],
            KeyPart::Index(0),
            "int path parts are list indices"
        );
        let note = ck.extras.iter().find(|x| x.name == "extra.note").unwrap();
        assert_eq!(note.value, json!("fixture"));
        assert_eq!(note.origin, "dcp");
        assert!(ck.scratch.is_empty());
    }

    #[test]
    fn scratch_files_of_dead_processes_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let me = std::process::id();
        let name = |pid: u32| {
            dir.path()
                .join(format!("{SCRATCH_PREFIX}{pid}-aB3xYz{SCRATCH_SUFFIX}"))
        };
        let other = dir
            .path()
            .join(format!("{SCRATCH_PREFIX}{dead}-aB3xYz.other"));
        for p in [name(dead), name(me), name(1), other.clone()] {
            std::fs::write(&p, b"x").unwrap();
        }
        remove_dead_scratch(dir.path());
        assert!(!name(dead).exists(), "a dead pid's scratch file is removed");
        assert!(name(me).exists(), "this process's own is kept");
        assert!(name(1).exists(), "a live process's is kept");
        assert!(other.exists(), "other names are not touched");
    }

    #[test]
    fn reads_torch21_and_fabric_meta_pt() {
        let ck = read(&fixture("fabric_fsdp1_w4_f32_torch21")).unwrap();
        assert_eq!(
            ck.producer.as_deref(),
            Some("torch 2.1–2.3 (no DCP version)")
        );
        let step = ck.extras.iter().find(|x| x.origin == "meta.pt").unwrap();
        assert_eq!((step.name.as_str(), &step.value), ("step", &json!(1)));
        let pg = ck
            .extras
            .iter()
            .find(|x| x.name == "optimizer.param_groups")
            .unwrap();
        assert_eq!(pg.value[0]["betas"], json!([0.9, 0.95]));
    }

    #[test]
    fn zstd_items_live_in_a_scratch_file_that_goes_with_the_checkpoint() {
        let ck = read(&fixture("fsdp2_w2_f32_zstd")).unwrap();
        assert_eq!(ck.scratch.len(), 1);
        let scratch = ck.files.last().unwrap().clone();
        assert!(scratch.is_file());
        assert!(ck.tensors.iter().all(|t| t
            .pieces
            .iter()
            .all(|p| p.loc.file as usize == ck.files.len() - 1)));
        let copy = ck.clone();
        drop(ck);
        assert!(scratch.is_file(), "a clone keeps the scratch file");
        drop(copy);
        assert!(!scratch.exists(), "the last clone removes it");
    }

    #[test]
    fn zstd_decoder_handles_frames_and_refuses_bombs() {
        // A raw-block frame without content size: magic, FHD=0 (window descriptor follows),
        // window descriptor, one last raw block of 5 bytes.
        let mut frame = vec![0x28, 0xB5, 0x2F, 0xFD, 0x00, 0x00];
        frame.extend_from_slice(&[(5 << 3) | 1, 0, 0]);
        frame.extend_from_slice(b"hello");
        let mut two = frame.clone();
        // a skippable frame between the two
        two.extend_from_slice(&[0x50, 0x2A, 0x4D, 0x18, 3, 0, 0, 0, 1, 2, 3]);
        two.extend_from_slice(&frame);
        let mut out = vec![];
        assert_eq!(zstd_decode(&two, &mut out, 100), Ok(10));
        assert_eq!(out, b"hellohello");
        let mut out = vec![];
        assert!(zstd_decode(&two, &mut out, 7)
            .unwrap_err()
            .contains("beyond 7"));
        assert!(zstd_decode(b"\x28\xb5\x2f", &mut vec![], 100).is_err());
        assert!(zstd_decode(&frame[..8], &mut vec![], 100).is_err());
        assert!(zstd_decode(b"", &mut vec![], 100).is_err());
    }
}
