//! Writing a PyTorch Distributed Checkpoint at M ranks: `__R_0.distcp` per target rank, each
//! a sequence of torch.save items (one per chunk, data record filled in place by the
//! executor, CRC-32s computed over it), non-tensor values as BYTE_IO items on rank 0,
//! Lightning's `meta.pt` when the source had one, and a `.metadata` pickle in the torch 2.1
//! class layout, which torch 2.1 through 2.15 all load (docs/pytorch-formats.md §8.3).
//! A region held by several ranks is written once, by the lowest, as DCP de-duplicates.

use crate::error::{Error, Result};
use crate::exec::{Checksum, Literal, OutputFile};
use crate::formats::torch::dtype::torch_dtype_name;
use crate::formats::torch::pickle::{op, pickle, Pickler, PyValue};
use crate::formats::torch::save::{save_to_vec, standard_records, TensorRef};
use crate::formats::torch::zip::{layout_archive, output_parts};
use crate::formats::{Extra, KeyPart, Output, TargetTensor, WriteOptions};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
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
    let mut items = Vec::with_capacity(target.len());
    let mut tensors = Vec::with_capacity(target.len());
    for t in target {
        let (layout, spans) = w.tensor(t, world)?;
        tensors.push(layout);
        items.push(spans);
    }
    let keys = Keys {
        byte_io: &byte_io,
        byte_io_items: &byte_io_items,
        tensors: &tensors,
        items: &items,
    };
    let metadata = keys.metadata(opts);
    let mut files = w.files;
    files.push(literal_file(".metadata", metadata));
    if !meta_pt.is_empty() {
        files.push(meta_pt_file(&meta_pt));
    }
    Ok(Output { files, tensors })
}

/// Where an item lies: bytes `offset..offset + length` of rank `rank`'s data file.
#[derive(Clone, Copy)]
struct ItemSpan {
    rank: u32,
    offset: u64,
    length: u64,
}

/// A whole file holding `bytes`.
fn literal_file(path: &str, bytes: Vec<u8>) -> OutputFile {
    OutputFile {
        path: PathBuf::from(path),
        size: bytes.len() as u64,
        literals: vec![(0, bytes.into())],
        checksums: vec![],
    }
}

/// Lightning's `meta.pt`: a `torch.save` of a dict of the `meta.pt` extras.
fn meta_pt_file(extras: &[&Extra]) -> OutputFile {
    let v = PyValue::Dict(
        extras
            .iter()
            .map(|e| (PyValue::Str(e.name.clone()), e.py_value()))
            .collect(),
    );
    literal_file("meta.pt", save_to_vec("meta", &v, &[]))
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
    templates: HashMap<(DType, Vec<u64>), ItemTemplate>,
}

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
            templates: HashMap::new(),
        }
    }

    /// A non-tensor value as a `BYTE_IO` item appended to rank 0's file.
    fn byte_io(&mut self, e: &Extra) -> ItemSpan {
        let item = save_to_vec("archive", &e.py_value(), &[]);
        let f = &mut self.files[0];
        let span = ItemSpan {
            rank: 0,
            offset: f.size,
            length: item.len() as u64,
        };
        f.size += span.length;
        f.literals.push((span.offset, item.into()));
        span
    }

    /// Every chunk of `t` that a rank below `world` holds, written once (by the lowest
    /// rank holding it); returns where its pieces lie and, chunk by chunk, its items.
    fn tensor(&mut self, t: &TargetTensor, world: u32) -> Result<(TensorLayout, Vec<ItemSpan>)> {
        let whole = Region::full(&t.shape);
        let mut written: HashSet<&Region> = HashSet::new();
        let mut spans = vec![];
        let mut pieces = vec![];
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
                let (piece, span) = self.chunk(t, r as u32, reg)?;
                pieces.push(piece);
                spans.push(span);
            }
        }
        let layout = TensorLayout {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces,
        };
        Ok((layout, spans))
    }

    /// Append a chunk of `t` (region `reg`) to rank `r`'s file as a torch.save item whose
    /// data record the executor fills.
    fn chunk(&mut self, t: &TargetTensor, r: u32, reg: &Region) -> Result<(Piece, ItemSpan)> {
        let tpl = match self.templates.entry((t.dtype, reg.sizes.to_vec())) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(ItemTemplate::new(t.dtype, &reg.sizes)?),
        };
        let f = &mut self.files[r as usize];
        let offset = f.size;
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
        f.size += tpl.len;
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
        Ok((piece, span))
    }
}

/// Every key of the checkpoint and where its items lie: what `.metadata` lists.
struct Keys<'a> {
    byte_io: &'a [&'a Extra],
    byte_io_items: &'a [ItemSpan],
    tensors: &'a [TensorLayout],
    /// Per tensor, per chunk (in `pieces` order).
    items: &'a [Vec<ItemSpan>],
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
    fn metadata(&self, opts: &WriteOptions) -> Vec<u8> {
        let mut p = Pickler::with_memo();
        p.new_object(META, "Metadata");
        p.dict_with(3, |p, field| match field {
            0 => {
                p.str("state_dict_metadata");
                self.state_dict_metadata(p);
            }
            1 => {
                p.str("planner_data");
                self.planner_data(p, opts);
            }
            _ => {
                p.str("storage_data");
                self.storage_data(p);
            }
        });
        p.op(op::BUILD);
        p.finish()
    }

    fn state_dict_metadata(&self, p: &mut Pickler) {
        let nb = self.byte_io.len();
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
                    p.torch_size(&t.shape);
                }
                _ => {
                    p.str("chunks");
                    p.list_with(t.pieces.len(), |p, c| {
                        let reg = &t.pieces[c].region;
                        p.new_object(META, "ChunkStorageMetadata");
                        p.dict_with(2, |p, k| {
                            let (key, dims) = match k {
                                0 => ("offsets", &reg.offsets),
                                _ => ("sizes", &reg.sizes),
                            };
                            p.str(key);
                            p.torch_size(dims);
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
        let mut path = String::new();
        p.dict_with(all.len(), |p, j| {
            let (i, c) = all[j];
            p.new_object(META, "MetadataIndex");
            let span = match i.checked_sub(nb) {
                None => {
                    p.dict_with(2, |p, k| match k {
                        0 => {
                            p.str("fqn");
                            p.str(&self.byte_io[i].name);
                        }
                        _ => {
                            p.str("index");
                            p.op(op::NONE);
                        }
                    });
                    self.byte_io_items[i]
                }
                Some(t) => {
                    let tensor = &self.tensors[t];
                    p.dict_with(3, |p, k| match k {
                        0 => {
                            p.str("fqn");
                            p.str(&tensor.name);
                        }
                        1 => {
                            p.str("offset");
                            p.torch_size(&tensor.pieces[c].region.offsets);
                        }
                        _ => {
                            p.str("index");
                            p.int(c as i64);
                        }
                    });
                    self.items[t][c]
                }
            };
            p.op(op::BUILD);
            p.new_object(FS, "_StorageInfo");
            p.dict_with(3, |p, k| match k {
                0 => {
                    p.str("relative_path");
                    path.clear();
                    use std::fmt::Write;
                    let _ = write!(path, "__{}_0.distcp", span.rank);
                    p.str(&path);
                }
                1 => {
                    p.str("offset");
                    p.int(span.offset as i64);
                }
                _ => {
                    p.str("length");
                    p.int(span.length as i64);
                }
            });
            p.op(op::BUILD);
        });
    }
}
