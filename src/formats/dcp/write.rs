//! Writing a PyTorch Distributed Checkpoint at M ranks: `__R_0.distcp` per target rank, each
//! a sequence of torch.save items (one per chunk, data record filled in place by the
//! executor, CRC-32s computed over it), non-tensor values as BYTE_IO items on rank 0,
//! Lightning's `meta.pt` when the source had one, and a `.metadata` pickle in the torch 2.1
//! class layout, which torch 2.1 through 2.15 all load (docs/pytorch-formats.md §8.3).
//! A region held by several ranks is written once, by the lowest, as DCP de-duplicates.

use crate::error::{Error, Result};
use crate::exec::OutputFile;
use crate::formats::torch::dtype::torch_dtype_name;
use crate::formats::torch::pickle::{pickle, PyValue};
use crate::formats::torch::save::{save_to_vec, standard_records, TensorRef};
use crate::formats::torch::zip::{layout_archive, output_parts};
use crate::formats::{Extra, KeyPart, Output, TargetTensor, WriteOptions};
use crate::layout::{Loc, Piece, Region, TensorLayout};
use std::collections::HashSet;
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
    let mut w = Writer::new(world, opts);
    // Non-tensor values: BYTE_IO items on rank 0 (Lightning's meta.pt keys go to meta.pt).
    let (meta_pt, byte_io): (Vec<&Extra>, Vec<&Extra>) =
        opts.extras.iter().partition(|e| e.origin == "meta.pt");
    for e in byte_io {
        w.byte_io(e);
    }
    let tensors = target
        .iter()
        .map(|t| w.tensor(t, world))
        .collect::<Result<Vec<_>>>()?;
    let mut files = w.finish();
    if !meta_pt.is_empty() {
        files.push(meta_pt_file(&meta_pt));
    }
    Ok(Output { files, tensors })
}

/// A `_StorageInfo`: item bytes `offset..offset + length` of rank `file`'s data file.
fn storage_info(file: u32, offset: u64, length: u64) -> PyValue {
    PyValue::object(
        FS,
        "_StorageInfo",
        Some(PyValue::str_dict(vec![
            ("relative_path", PyValue::Str(format!("__{file}_0.distcp"))),
            ("offset", PyValue::Int(offset as i64)),
            ("length", PyValue::Int(length as i64)),
        ])),
    )
}

/// A `MetadataIndex` of key `fqn`: a chunk's (with its offsets) or a `BYTE_IO` item's.
fn metadata_index(fqn: &str, offset: Option<&[u64]>, index: PyValue) -> PyValue {
    let mut items = vec![("fqn", PyValue::Str(fqn.to_string()))];
    if let Some(o) = offset {
        items.push(("offset", PyValue::torch_size(o)));
    }
    items.push(("index", index));
    PyValue::object(META, "MetadataIndex", Some(PyValue::str_dict(items)))
}

/// A whole file holding `bytes`.
fn literal_file(path: &str, bytes: Vec<u8>) -> OutputFile {
    OutputFile {
        path: PathBuf::from(path),
        size: bytes.len() as u64,
        literals: vec![(0, bytes)],
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

/// The checkpoint being laid out: one data file per rank, growing as items are appended,
/// and the three dicts of `.metadata`.
struct Writer<'a> {
    opts: &'a WriteOptions,
    files: Vec<OutputFile>,
    /// `state_dict_metadata`.
    sdm: Vec<(PyValue, PyValue)>,
    /// `storage_data`.
    storage: Vec<(PyValue, PyValue)>,
    /// `planner_data`.
    planner: Vec<(PyValue, PyValue)>,
}

impl<'a> Writer<'a> {
    fn new(world: u32, opts: &'a WriteOptions) -> Writer<'a> {
        Writer {
            opts,
            files: (0..world)
                .map(|r| OutputFile {
                    path: PathBuf::from(format!("__{r}_0.distcp")),
                    size: 0,
                    literals: vec![],
                    checksums: vec![],
                })
                .collect(),
            sdm: vec![],
            storage: vec![],
            planner: vec![],
        }
    }

    /// Record the nested-dict path of key `name` in `planner_data`.
    fn plan(&mut self, name: &str) {
        let path = self
            .opts
            .paths
            .get(name)
            .cloned()
            .unwrap_or_else(|| vec![KeyPart::Key(name.to_string())]);
        self.planner
            .push((PyValue::Str(name.to_string()), path_value(&path)));
    }

    /// A non-tensor value as a `BYTE_IO` item appended to rank 0's file.
    fn byte_io(&mut self, e: &Extra) {
        let item = save_to_vec("archive", &e.py_value(), &[]);
        let f = &mut self.files[0];
        let offset = f.size;
        f.size += item.len() as u64;
        self.storage.push((
            metadata_index(&e.name, None, PyValue::None),
            storage_info(0, offset, item.len() as u64),
        ));
        f.literals.push((offset, item));
        self.sdm.push((
            PyValue::Str(e.name.clone()),
            PyValue::object(META, "BytesStorageMetadata", None),
        ));
        self.plan(&e.name);
    }

    /// Every chunk of `t` that a rank below `world` holds, written once (by the lowest
    /// rank holding it), and `t`'s `TensorStorageMetadata`; returns where its pieces lie.
    fn tensor(&mut self, t: &TargetTensor, world: u32) -> Result<TensorLayout> {
        let whole = Region::full(&t.shape);
        let mut written: HashSet<&Region> = HashSet::new();
        let mut chunks = vec![];
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
                pieces.push(self.chunk(t, r as u32, reg, chunks.len())?);
                chunks.push(PyValue::object(
                    META,
                    "ChunkStorageMetadata",
                    Some(PyValue::str_dict(vec![
                        ("offsets", PyValue::torch_size(&reg.offsets)),
                        ("sizes", PyValue::torch_size(&reg.sizes)),
                    ])),
                ));
            }
        }
        self.sdm.push((
            PyValue::Str(t.name.clone()),
            PyValue::object(
                META,
                "TensorStorageMetadata",
                Some(PyValue::str_dict(vec![
                    ("properties", tensor_properties(t.dtype)),
                    ("size", PyValue::torch_size(&t.shape)),
                    ("chunks", PyValue::List(chunks)),
                ])),
            ),
        ));
        self.plan(&t.name);
        Ok(TensorLayout {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces,
        })
    }

    /// Append chunk `index` of `t` (region `reg`) to rank `r`'s file as a torch.save item
    /// whose data record the executor fills, and list it in `storage_data`.
    fn chunk(&mut self, t: &TargetTensor, r: u32, reg: &Region, index: usize) -> Result<Piece> {
        let nbytes = reg.volume() * t.dtype.size() as u64;
        let pkl = pickle(&PyValue::Tensor(TensorRef::new(
            "0",
            t.dtype,
            reg.sizes.clone(),
        )));
        let records = standard_records(pkl, &[("0".to_string(), nbytes)]);
        let layout = layout_archive("archive", &records);
        let data = records
            .iter()
            .position(|x| x.name == "data/0")
            .ok_or_else(|| Error::usage("internal error: item without data/0"))?;
        let f = &mut self.files[r as usize];
        let offset = f.size;
        let (lits, crcs) = output_parts(&layout, &records, offset);
        f.literals.extend(lits);
        f.checksums.extend(crcs);
        f.size += layout.len;
        self.storage.push((
            metadata_index(&t.name, Some(&reg.offsets), PyValue::Int(index as i64)),
            storage_info(r, offset, layout.len),
        ));
        Ok(Piece {
            rank: r,
            region: reg.clone(),
            loc: Loc {
                file: r,
                offset: offset + layout.data_offsets[data],
                strides: None,
            },
        })
    }

    /// The data files and `.metadata`.
    fn finish(self) -> Vec<OutputFile> {
        let metadata = PyValue::object(
            META,
            "Metadata",
            Some(PyValue::str_dict(vec![
                ("state_dict_metadata", PyValue::Dict(self.sdm)),
                ("planner_data", PyValue::Dict(self.planner)),
                ("storage_data", PyValue::Dict(self.storage)),
            ])),
        );
        let mut files = self.files;
        files.push(literal_file(".metadata", pickle(&metadata)));
        files
    }
}
