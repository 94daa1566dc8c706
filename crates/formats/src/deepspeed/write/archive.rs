//! The `torch.save` files being laid out ([`Archive`]), the output tensors' places in their
//! storages ([`Out`]), resolved into pieces once every file is laid out, and the pickled
//! values the files hold.

use super::super::partition::{self, Span};
use super::Writer;
use crate::error::{Error, Result};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
use crate::torch::pickle::{pickle, PyValue};
use crate::torch::save::{standard_records, TensorRef};
use crate::torch::zip::{layout_archive, output_parts};
use crate::Output;
use reshard_core::output::OutputFile;
use std::collections::HashMap;
use std::path::PathBuf;

/// One `torch.save` file being laid out: its pickle's storages, handed out in order.
pub(super) struct Archive {
    path: PathBuf,
    storages: Vec<(String, u64)>,
}

impl Archive {
    pub(super) fn new(path: PathBuf) -> Archive {
        Archive {
            path,
            storages: vec![],
        }
    }

    /// A new storage holding a contiguous tensor, and the value that pickles it.
    pub(super) fn tensor(&mut self, dtype: DType, shape: Vec<u64>) -> (PyValue, usize) {
        let k = self.storages.len();
        let t = TensorRef::new(k.to_string(), dtype, shape);
        self.storages.push((k.to_string(), t.storage_bytes()));
        (PyValue::Tensor(t), k)
    }

    /// Lay the archive out: the file, and each storage's data offset.
    pub(super) fn finish(self, value: &PyValue) -> Result<(OutputFile, Vec<u64>)> {
        let stem = self
            .path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("archive")
            .to_string();
        let records = standard_records(pickle(value), &self.storages);
        let layout = layout_archive(&stem, &records);
        let (literals, checksums) = output_parts(&layout, &records, 0);
        let at: HashMap<&str, usize> = records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.as_str(), i))
            .collect();
        let offsets = self
            .storages
            .iter()
            .map(|(k, _)| {
                let name = format!("data/{k}");
                at.get(name.as_str())
                    .map(|&i| layout.data_offsets[i])
                    .ok_or_else(|| Error::usage(format!("internal error: no record {name}")))
            })
            .collect::<Result<_>>()?;
        Ok((
            OutputFile {
                path: self.path,
                size: layout.len,
                literals,
                checksums,
            },
            offsets,
        ))
    }
}

/// A storage of one of the output files: (file index, storage index).
pub(super) type At = (usize, usize);

/// An output tensor and where its pieces go, resolved once the files are laid out.
pub(super) struct Out {
    pub(super) name: String,
    pub(super) dtype: DType,
    pub(super) shape: Vec<u64>,
    pub(super) place: Place,
}

pub(super) enum Place {
    /// Stored whole, row-major, in each of these storages (one per rank file holding it).
    Whole(Vec<At>),
    /// Runs of its flat elements in storages by rank.
    Flat(Vec<Span>, Vec<At>),
}

/// `torch.Size(shape)`.
pub(super) fn size(shape: &[u64]) -> PyValue {
    PyValue::Call {
        module: "torch".into(),
        name: "Size".into(),
        args: vec![PyValue::Tuple(
            shape.iter().map(|&d| PyValue::Int(d as i64)).collect(),
        )],
    }
}

pub(super) fn s(k: &str) -> PyValue {
    PyValue::Str(k.into())
}

pub(super) fn int(i: u64) -> PyValue {
    PyValue::Int(i as i64)
}

impl Writer<'_> {
    /// Note output tensor `name` and where it is stored.
    pub(super) fn place(&mut self, name: String, dtype: DType, shape: Vec<u64>, place: Place) {
        self.outs.push(Out {
            name,
            dtype,
            shape,
            place,
        });
    }

    /// Lay out every file and resolve the tensors' pieces; file `latest` names `tag`.
    pub(super) fn finish(self, latest: &str, tag: String) -> Result<Output> {
        let mut files = vec![];
        let mut offsets = vec![];
        for (a, v) in self.archives.into_iter().zip(&self.values) {
            let (f, o) = a.finish(v)?;
            files.push(f);
            offsets.push(o);
        }
        let base = 1u32; // file 0 is `latest` (or `latest_universal`)
        let loc = |at: At, elem: u64, first: u64| Loc {
            file: base + at.0 as u32,
            offset: offsets[at.0][at.1] + first * elem,
            strides: None,
            pending: None,
        };
        let mut tensors = vec![];
        for o in self.outs {
            let elem = o.dtype.size() as u64;
            let pieces = match o.place {
                Place::Whole(ats) => ats
                    .into_iter()
                    .enumerate()
                    .map(|(r, at)| Piece {
                        rank: r as u32,
                        region: Region::full(&o.shape),
                        loc: loc(at, elem, 0),
                    })
                    .collect(),
                Place::Flat(spans, ats) => partition::flat_pieces(
                    &o.shape,
                    &spans,
                    |r| {
                        let l = loc(ats[r as usize], elem, 0);
                        (l.file, l.offset)
                    },
                    elem,
                ),
            };
            tensors.push(TensorLayout {
                name: o.name,
                dtype: o.dtype,
                shape: o.shape,
                pieces,
            });
        }
        let text: reshard_core::output::Literal = tag.as_bytes().to_vec().into();
        let mut all = vec![OutputFile {
            path: PathBuf::from(latest),
            size: tag.len() as u64,
            literals: vec![(0, text)],
            checksums: vec![],
        }];
        all.extend(files);
        Ok(Output {
            files: all,
            tensors,
            copies: self.copies,
        })
    }
}
