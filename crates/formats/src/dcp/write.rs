//! Writing a PyTorch Distributed Checkpoint at M ranks: `__R_0.distcp` per target rank, each
//! a sequence of torch.save items (one per chunk, data record filled in place by the
//! executor, CRC-32s computed over it), non-tensor values as BYTE_IO items on rank 0,
//! Lightning's `meta.pt` when the source had one, and a `.metadata` pickle in the torch 2.1
//! class layout, which torch 2.1 through 2.15 all load (docs/pytorch-formats.md §8.3).
//! A region held by several ranks is written once, by the lowest, as DCP de-duplicates.

use crate::error::{Error, Result};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
use crate::torch::dtype::torch_dtype_name;
use crate::torch::pickle::extra_value;
use crate::torch::pickle::{op, pickle, Pickler, PyValue, Slot};
use crate::torch::save::{save_to_vec, standard_records, TensorRef};
use crate::torch::zip::{layout_archive, output_parts};
use crate::{Extra, KeyPart, Output, TargetTensor, WriteOptions};
use reshard_core::output::{Checksum, Literal, OutputFile};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

/// Module of DCP's metadata classes (`Metadata`, `MetadataIndex`, chunk and storage metadata).
pub const META: &str = "torch.distributed.checkpoint.metadata";
/// Module of `TensorProperties` in the torch 2.1 class layout.
pub const ST_META: &str = "torch.distributed._shard.sharded_tensor.metadata";
/// Module of `_StorageInfo`.
pub const FS: &str = "torch.distributed.checkpoint.filesystem";

/// DCP's `TensorProperties` of a tensor of `dtype` (torch 2.1's 5-tuple state: dtype,
/// strided layout, no grad, contiguous format, not pinned), as reshard writes it.
pub fn tensor_properties(dtype: crate::layout::DType) -> PyValue {
    PyValue::object(
        ST_META,
        "TensorProperties",
        Some(PyValue::Tuple(vec![
            PyValue::Global {
                module: "torch".into(),
                name: torch_dtype_name(dtype).into(),
            },
            PyValue::call(
                "torch.serialization",
                "_get_layout",
                vec![PyValue::Str("torch.strided".into())],
            ),
            PyValue::Bool(false),
            PyValue::call(ST_META, "MEM_FORMAT_ENCODING", vec![PyValue::Int(0)]),
            PyValue::Bool(false),
        ])),
    )
}

fn path_value(path: &[KeyPart]) -> PyValue {
    PyValue::Tuple(
        path.iter()
            .map(|p| match p {
                KeyPart::Key(k) => PyValue::Str(k.clone()),
                KeyPart::Index(i) => PyValue::Int(*i),
                // DCP keys dicts by `str(key)`
                KeyPart::IntKey { int } => PyValue::Str(int.to_string()),
            })
            .collect(),
    )
}

/// Lay out `target` as a DCP checkpoint over `world` ranks.
pub fn write(target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
    let mut w = Writer::new(world);
    // Non-tensor values: BYTE_IO items on rank 0 (Lightning's meta.pt keys go to meta.pt).
    let (meta_pt, byte_io): (Vec<&Extra>, Vec<&Extra>) =
        opts.extras.iter().partition(|e| e.origin == "meta.pt");
    let byte_io_items: Vec<ItemSpan> = byte_io.iter().map(|e| w.byte_io(e)).collect();
    let (tensors, items) = w.tensors(target, world)?;
    let keys = Keys {
        byte_io: &byte_io,
        byte_io_items: &byte_io_items,
        tensors: &tensors,
        items: &items,
        world,
    };
    let metadata = keys.metadata(opts);
    let mut files = w.files;
    files.push(blocks_file(".metadata", metadata));
    if !meta_pt.is_empty() {
        files.push(meta_pt_file(&meta_pt));
    }
    Ok(Output {
        files,
        tensors,
        copies: vec![],
    })
}

/// Where an item lies: bytes `offset..offset + length` of rank `rank`'s data file.
#[derive(Clone, Copy)]
struct ItemSpan {
    rank: u32,
    offset: u64,
    length: u64,
}

/// A whole file holding `bytes`.
pub fn literal_file(path: &str, bytes: Vec<u8>) -> OutputFile {
    blocks_file(path, vec![bytes.into()])
}

/// A whole file holding `blocks`, one after the other.
fn blocks_file(path: &str, blocks: Vec<Literal>) -> OutputFile {
    let mut size = 0;
    let literals = blocks
        .into_iter()
        .map(|b| {
            let at = size;
            size += b.len() as u64;
            (at, b)
        })
        .collect();
    OutputFile {
        path: PathBuf::from(path),
        size,
        literals,
        checksums: vec![],
    }
}

/// Lightning's `meta.pt`: a `torch.save` of a dict of the `meta.pt` extras.
fn meta_pt_file(extras: &[&Extra]) -> OutputFile {
    pickled_dict_file("meta.pt", "meta", extras)
}

/// A file `name` holding a `torch.save` (archive folder `prefix`) of a dict of `extras` by
/// name.
pub fn pickled_dict_file(name: &str, prefix: &str, extras: &[&Extra]) -> OutputFile {
    let v = PyValue::Dict(
        extras
            .iter()
            .map(|e| (PyValue::Str(e.name.clone()), extra_value(e)))
            .collect(),
    );
    literal_file(name, save_to_vec(prefix, &v, &[]))
}

/// A torch.save item of one dtype and shape, laid out once and placed at every chunk of that
/// dtype and shape: the items' bytes are the same but for the data record and its CRCs.
struct ItemTemplate {
    len: u64,
    /// Offset of the data record in the item.
    data_offset: u64,
    /// Literal bytes, offsets relative to the item.
    literals: Vec<(u64, Literal)>,
    /// CRCs of the data record, offsets relative to the item.
    checksums: Vec<Checksum>,
}

impl ItemTemplate {
    fn new(dtype: DType, sizes: &[u64]) -> Result<ItemTemplate> {
        let nbytes = sizes.iter().product::<u64>() * dtype.size() as u64;
        let pkl = pickle(&PyValue::Tensor(TensorRef::new("0", dtype, sizes.to_vec())));
        let records = standard_records(pkl, &[("0".to_string(), nbytes)]);
        let layout = layout_archive("archive", &records);
        let data = records
            .iter()
            .position(|x| x.name == "data/0")
            .ok_or_else(|| Error::usage("internal error: item without data/0"))?;
        let (literals, checksums) = output_parts(&layout, &records, 0);
        Ok(ItemTemplate {
            len: layout.len,
            data_offset: layout.data_offsets[data],
            literals,
            checksums,
        })
    }
}

/// The data files being laid out, one per rank, growing as items are appended.
struct Writer {
    files: Vec<OutputFile>,
}

/// The chunks of one tensor that are written, in the order they are: target rank, region,
/// and the index of the chunk's shape among the tensor's shapes (of its item template, once
/// [`Writer::tensors`] has made the templates).
type Chunks<'a> = Vec<(u32, &'a Region, u32)>;

impl Writer {
    fn new(world: u32) -> Writer {
        Writer {
            files: (0..world)
                .map(|r| OutputFile {
                    path: PathBuf::from(format!("__{r}_0.distcp")),
                    size: 0,
                    literals: vec![],
                    checksums: vec![],
                })
                .collect(),
        }
    }

    /// A non-tensor value as a `BYTE_IO` item appended to rank 0's file: an opaque value's
    /// stored `torch.save` stream as it is, any other value saved again.
    fn byte_io(&mut self, e: &Extra) -> ItemSpan {
        let item: Literal = match &e.opaque {
            Some(o) => o.bytes.clone(),
            None => save_to_vec("archive", &extra_value(e), &[]).into(),
        };
        let f = &mut self.files[0];
        let span = ItemSpan {
            rank: 0,
            offset: f.size,
            length: item.len() as u64,
        };
        f.size += span.length;
        f.literals.push((span.offset, item));
        span
    }

    /// Append every tensor's chunks to the files, tensor by tensor, each as [`chunks`]
    /// orders them; returns where each tensor's pieces lie and, chunk by chunk, its items.
    /// The chunks are chosen, and the layouts and file contents built, in parallel; only
    /// the templates and the items' offsets are assigned in order.
    fn tensors(
        &mut self,
        target: &[TargetTensor],
        world: u32,
    ) -> Result<(Vec<TensorLayout>, Vec<Vec<ItemSpan>>)> {
        use rayon::prelude::*;
        let mut chosen: Vec<(Chunks, Vec<&[u64]>)> =
            target.par_iter().map(|t| chunks(t, world)).collect();
        // One template per dtype and chunk shape, made in order of first use; each chunk's
        // tensor-local shape index becomes the template's.
        let mut index: HashMap<(DType, &[u64]), u32> = HashMap::new();
        let mut templates: Vec<ItemTemplate> = vec![];
        for (t, (chunks, shapes)) in target.iter().zip(&mut chosen) {
            let mut ids = Vec::with_capacity(shapes.len());
            for &sizes in shapes.iter() {
                let id = match index.entry((t.dtype, sizes)) {
                    Entry::Occupied(e) => *e.get(),
                    Entry::Vacant(e) => {
                        templates.push(ItemTemplate::new(t.dtype, sizes)?);
                        *e.insert(templates.len() as u32 - 1)
                    }
                };
                ids.push(id);
            }
            for c in chunks.iter_mut() {
                c.2 = ids[c.2 as usize];
            }
        }
        // Item offsets in file order; each file's items as (offset, template).
        let mut placed: Vec<Vec<(u64, u32)>> = vec![vec![]; self.files.len()];
        let mut offsets: Vec<Vec<u64>> = Vec::with_capacity(target.len());
        for (chunks, _) in &chosen {
            let mut at = Vec::with_capacity(chunks.len());
            for &(r, _, tpl) in chunks {
                let f = &mut self.files[r as usize];
                placed[r as usize].push((f.size, tpl));
                at.push(f.size);
                f.size += templates[tpl as usize].len;
            }
            offsets.push(at);
        }
        let templates = &templates;
        self.files
            .par_iter_mut()
            .zip(&placed)
            .for_each(|(f, items)| place(f, items, templates));
        drop(placed);
        Ok(target
            .par_iter()
            .zip(&chosen)
            .zip(&offsets)
            .map(|((t, (chunks, _)), at)| layout_of(t, chunks, at, templates))
            .unzip())
    }
}

/// The chunks of `t` that a rank below `world` holds, each written once (by the lowest rank
/// holding it), rank by rank; each with the index of its shape among the distinct shapes,
/// which are returned in order of first use.
fn chunks(t: &TargetTensor, world: u32) -> (Chunks<'_>, Vec<&[u64]>) {
    let whole = Region::full(&t.shape);
    let mut written: HashSet<&Region> = HashSet::new();
    let mut shapes: Vec<&[u64]> = vec![];
    let mut shape_index: HashMap<&[u64], u32> = HashMap::new();
    let mut out: Chunks = vec![];
    for (r, regions) in t.ranks.iter().enumerate().take(world as usize) {
        for reg in regions {
            let keep = if whole.is_empty() {
                r == 0 && written.is_empty()
            } else {
                !reg.is_empty()
            };
            if !keep || !written.insert(reg) {
                continue;
            }
            let shape = match out.last() {
                // Chunks mostly have the shape of the one before.
                Some(&(_, prev, shape)) if prev.sizes == reg.sizes => shape,
                _ => *shape_index.entry(&reg.sizes).or_insert_with(|| {
                    shapes.push(&reg.sizes);
                    shapes.len() as u32 - 1
                }),
            };
            out.push((r as u32, reg, shape));
        }
    }
    (out, shapes)
}

/// Fill `f`'s literals and checksums with its items, `(offset, template)` in file order.
fn place(f: &mut OutputFile, items: &[(u64, u32)], templates: &[ItemTemplate]) {
    let count = |of: fn(&ItemTemplate) -> usize| -> usize {
        items.iter().map(|&(_, t)| of(&templates[t as usize])).sum()
    };
    f.literals.reserve(count(|t| t.literals.len()));
    f.checksums.reserve(count(|t| t.checksums.len()));
    for &(offset, tpl) in items {
        let tpl = &templates[tpl as usize];
        f.literals.extend(
            tpl.literals
                .iter()
                .map(|(at, bytes)| (offset + at, bytes.clone())),
        );
        f.checksums.extend(tpl.checksums.iter().map(|c| Checksum {
            range: (offset + c.range.0, offset + c.range.1),
            at: c.at.iter().map(|a| offset + a).collect(),
            hex: c.hex,
        }));
    }
}

/// The layout of `t` written as `chunks` at item offsets `at`, and its items.
fn layout_of(
    t: &TargetTensor,
    chunks: &[(u32, &Region, u32)],
    at: &[u64],
    templates: &[ItemTemplate],
) -> (TensorLayout, Vec<ItemSpan>) {
    let (pieces, spans) = chunks
        .iter()
        .zip(at)
        .map(|(&(r, reg, tpl), &offset)| {
            let tpl = &templates[tpl as usize];
            let piece = Piece {
                rank: r,
                region: reg.clone(),
                loc: Loc {
                    file: r,
                    offset: offset + tpl.data_offset,
                    strides: None,
                    pending: None,
                },
            };
            let span = ItemSpan {
                rank: r,
                offset,
                length: tpl.len,
            };
            (piece, span)
        })
        .unzip();
    let layout = TensorLayout {
        name: t.name.clone(),
        dtype: t.dtype,
        shape: t.shape.clone(),
        pieces,
    };
    (layout, spans)
}

/// Size of the blocks `.metadata` is written in (literals of its output file).
const METADATA_BLOCK: usize = 1 << 20;

/// Every key of the checkpoint and where its items lie: what `.metadata` lists.
struct Keys<'a> {
    byte_io: &'a [&'a Extra],
    byte_io_items: &'a [ItemSpan],
    tensors: &'a [TensorLayout],
    /// Per tensor, per chunk (in `pieces` order).
    items: &'a [Vec<ItemSpan>],
    /// Number of data files (ranks).
    world: u32,
}

impl Keys<'_> {
    fn name(&self, i: usize) -> &str {
        match i.checked_sub(self.byte_io.len()) {
            None => &self.byte_io[i].name,
            Some(t) => &self.tensors[t].name,
        }
    }

    /// `.metadata`: `Metadata(state_dict_metadata, planner_data, storage_data)` in the torch
    /// 2.1 class layout, pickled straight from the laid-out chunks (no value tree: at a
    /// million chunks it would be several times the pickle), each repeated global and str
    /// written once through the memo (the file is read by the full unpickler only).
    fn metadata(&self, opts: &WriteOptions) -> Vec<Literal> {
        let mut p = Pickler::with_memo().in_blocks(METADATA_BLOCK);
        p.new_object(META, "Metadata");
        p.dict_with(4, |p, field| match field {
            0 => {
                p.str("state_dict_metadata");
                self.state_dict_metadata(p);
            }
            1 => {
                p.str("planner_data");
                self.planner_data(p, opts);
            }
            2 => {
                p.str("storage_data");
                self.storage_data(p);
            }
            _ => {
                // who wrote it, for `inspect`: an attribute torch's `Metadata` does not have,
                // which unpickling sets on the instance and torch never reads
                p.str(super::RESHARD_VERSION);
                p.str(env!("CARGO_PKG_VERSION"));
            }
        });
        p.op(op::BUILD);
        p.finish_blocks()
    }

    fn state_dict_metadata(&self, p: &mut Pickler) {
        let nb = self.byte_io.len();
        let [mut chunk_cls, mut offsets, mut sizes, mut size_cls] = [Slot::default(); 4];
        p.dict_with(nb + self.tensors.len(), |p, i| {
            p.str(self.name(i));
            let Some(t) = i.checked_sub(nb).map(|t| &self.tensors[t]) else {
                return p.new_object(META, "BytesStorageMetadata");
            };
            p.new_object(META, "TensorStorageMetadata");
            p.dict_with(3, |p, k| match k {
                0 => {
                    p.str("properties");
                    p.value(&tensor_properties(t.dtype));
                }
                1 => {
                    p.str("size");
                    p.torch_size_at(&t.shape, &mut size_cls);
                }
                _ => {
                    p.str("chunks");
                    p.list_with(t.pieces.len(), |p, c| {
                        let reg = &t.pieces[c].region;
                        p.new_object_at(META, "ChunkStorageMetadata", &mut chunk_cls);
                        p.dict_with(2, |p, k| {
                            let (key, slot, dims) = match k {
                                0 => ("offsets", &mut offsets, &reg.offsets),
                                _ => ("sizes", &mut sizes, &reg.sizes),
                            };
                            p.str_at(key, slot);
                            p.torch_size_at(dims, &mut size_cls);
                        });
                        p.op(op::BUILD);
                    });
                }
            });
            p.op(op::BUILD);
        });
    }

    fn planner_data(&self, p: &mut Pickler, opts: &WriteOptions) {
        p.dict_with(self.byte_io.len() + self.tensors.len(), |p, i| {
            let name = self.name(i);
            p.str(name);
            match opts.paths.get(name) {
                Some(path) => p.value(&path_value(path)),
                None => p.value(&path_value(&[KeyPart::Key(name.to_string())])),
            }
        });
    }

    fn storage_data(&self, p: &mut Pickler) {
        let nb = self.byte_io.len();
        let mut all: Vec<(usize, usize)> = (0..nb).map(|i| (i, 0)).collect();
        for (t, spans) in self.items.iter().enumerate() {
            all.extend((0..spans.len()).map(|c| (nb + t, c)));
        }
        // Memo slots of what every item repeats: the classes, the keys, each tensor's name
        // (kept while its items follow one another) and each rank's file name.
        let [mut index_cls, mut info_cls, mut size_cls] = [Slot::default(); 3];
        let [mut fqn, mut offset, mut index, mut relative_path, mut length] = [Slot::default(); 5];
        let mut name: (usize, Slot) = (usize::MAX, Slot::default());
        let mut paths = vec![Slot::default(); self.world as usize];
        let mut path = String::new();
        p.dict_with(all.len(), |p, j| {
            let (i, c) = all[j];
            p.new_object_at(META, "MetadataIndex", &mut index_cls);
            let span = match i.checked_sub(nb) {
                None => {
                    p.dict_with(2, |p, k| match k {
                        0 => {
                            p.str_at("fqn", &mut fqn);
                            p.str(&self.byte_io[i].name);
                        }
                        _ => {
                            p.str_at("index", &mut index);
                            p.op(op::NONE);
                        }
                    });
                    self.byte_io_items[i]
                }
                Some(t) => {
                    let tensor = &self.tensors[t];
                    if name.0 != t {
                        name = (t, Slot::default());
                    }
                    p.dict_with(3, |p, k| match k {
                        0 => {
                            p.str_at("fqn", &mut fqn);
                            p.str_at(&tensor.name, &mut name.1);
                        }
                        1 => {
                            p.str_at("offset", &mut offset);
                            p.torch_size_at(&tensor.pieces[c].region.offsets, &mut size_cls);
                        }
                        _ => {
                            p.str_at("index", &mut index);
                            p.int(c as i64);
                        }
                    });
                    self.items[t][c]
                }
            };
            p.op(op::BUILD);
            p.new_object_at(FS, "_StorageInfo", &mut info_cls);
            p.dict_with(3, |p, k| match k {
                0 => {
                    p.str_at("relative_path", &mut relative_path);
                    let slot = &mut paths[span.rank as usize];
                    if !slot.is_known() {
                        path.clear();
                        use std::fmt::Write;
                        let _ = write!(path, "__{}_0.distcp", span.rank);
                    }
                    p.str_at(&path, slot);
                }
                1 => {
                    p.str_at("offset", &mut offset);
                    p.int(span.offset as i64);
                }
                _ => {
                    p.str_at("length", &mut length);
                    p.int(span.length as i64);
                }
            });
            p.op(op::BUILD);
        });
    }
}
