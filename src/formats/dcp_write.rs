//! Writing a PyTorch Distributed Checkpoint at M ranks: `__R_0.distcp` per target rank, each
//! a sequence of torch.save items (one per chunk, data record filled in place by the
//! executor, CRC-32s computed over it), non-tensor values as BYTE_IO items on rank 0,
//! Lightning's `meta.pt` when the source had one, and a `.metadata` pickle in the torch 2.1
//! class layout, which torch 2.1 through 2.15 all load (docs/pytorch-formats.md §8.3).
//! A region held by several ranks is written once, by the lowest, as DCP de-duplicates.

use super::torch_save::{
    layout_archive, output_parts, pickle, save_to_vec, standard_records, torch_dtype_name, PyValue,
    TensorRef,
};
use super::{Extra, KeyPart, Output, TargetTensor, WriteOptions};
use crate::error::{Error, Result};
use crate::exec::OutputFile;
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
    let mut files: Vec<OutputFile> = (0..world)
        .map(|r| OutputFile {
            path: PathBuf::from(format!("__{r}_0.distcp")),
            size: 0,
            literals: vec![],
            checksums: vec![],
        })
        .collect();
    let mut sdm: Vec<(PyValue, PyValue)> = vec![];
    let mut storage: Vec<(PyValue, PyValue)> = vec![];
    let mut planner: Vec<(PyValue, PyValue)> = vec![];
    let path_of = |name: &str| -> Vec<KeyPart> {
        opts.paths
            .get(name)
            .cloned()
            .unwrap_or_else(|| vec![KeyPart::Key(name.to_string())])
    };
    let storage_info = |file: u32, offset: u64, length: u64| {
        PyValue::object(
            FS,
            "_StorageInfo",
            Some(PyValue::str_dict(vec![
                ("relative_path", PyValue::Str(format!("__{file}_0.distcp"))),
                ("offset", PyValue::Int(offset as i64)),
                ("length", PyValue::Int(length as i64)),
            ])),
        )
    };
    // Non-tensor values: BYTE_IO items on rank 0 (Lightning's meta.pt keys go to meta.pt).
    let (meta_pt, byte_io): (Vec<&Extra>, Vec<&Extra>) =
        opts.extras.iter().partition(|e| e.origin == "meta.pt");
    for e in byte_io {
        let item = save_to_vec("archive", &e.py_value(), &[]);
        let f = &mut files[0];
        let offset = f.size;
        f.size += item.len() as u64;
        storage.push((
            PyValue::object(
                META,
                "MetadataIndex",
                Some(PyValue::str_dict(vec![
                    ("fqn", PyValue::Str(e.name.clone())),
                    ("index", PyValue::None),
                ])),
            ),
            storage_info(0, offset, item.len() as u64),
        ));
        f.literals.push((offset, item));
        sdm.push((
            PyValue::Str(e.name.clone()),
            PyValue::object(META, "BytesStorageMetadata", None),
        ));
        planner.push((PyValue::Str(e.name.clone()), path_value(&path_of(&e.name))));
    }
    let mut tensors = vec![];
    for t in target {
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
                let f = &mut files[r];
                let offset = f.size;
                let (lits, crcs) = output_parts(&layout, &records, offset);
                f.literals.extend(lits);
                f.checksums.extend(crcs);
                f.size += layout.len;
                pieces.push(Piece {
                    rank: r as u32,
                    region: reg.clone(),
                    loc: Loc {
                        file: r as u32,
                        offset: offset + layout.data_offsets[data],
                        strides: None,
                    },
                });
                storage.push((
                    PyValue::object(
                        META,
                        "MetadataIndex",
                        Some(PyValue::str_dict(vec![
                            ("fqn", PyValue::Str(t.name.clone())),
                            ("offset", PyValue::torch_size(&reg.offsets)),
                            ("index", PyValue::Int(chunks.len() as i64)),
                        ])),
                    ),
                    storage_info(r as u32, offset, layout.len),
                ));
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
        let properties = tensor_properties(t.dtype);
        sdm.push((
            PyValue::Str(t.name.clone()),
            PyValue::object(
                META,
                "TensorStorageMetadata",
                Some(PyValue::str_dict(vec![
                    ("properties", properties),
                    ("size", PyValue::torch_size(&t.shape)),
                    ("chunks", PyValue::List(chunks)),
                ])),
            ),
        ));
        planner.push((PyValue::Str(t.name.clone()), path_value(&path_of(&t.name))));
        tensors.push(TensorLayout {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces,
        });
    }
    let metadata = PyValue::object(
        META,
        "Metadata",
        Some(PyValue::str_dict(vec![
            ("state_dict_metadata", PyValue::Dict(sdm)),
            ("planner_data", PyValue::Dict(planner)),
            ("storage_data", PyValue::Dict(storage)),
        ])),
    );
    let bytes = pickle(&metadata);
    files.push(OutputFile {
        path: PathBuf::from(".metadata"),
        size: bytes.len() as u64,
        literals: vec![(0, bytes)],
        checksums: vec![],
    });
    if !meta_pt.is_empty() {
        let v = PyValue::Dict(
            meta_pt
                .iter()
                .map(|e| (PyValue::Str(e.name.clone()), e.py_value()))
                .collect(),
        );
        let bytes = save_to_vec("meta", &v, &[]);
        files.push(OutputFile {
            path: PathBuf::from("meta.pt"),
            size: bytes.len() as u64,
            literals: vec![(0, bytes)],
            checksums: vec![],
        });
    }
    Ok(Output { files, tensors })
}
