//! Checkpoint formats: readers turn files into tensor layouts plus byte locations, writers
//! turn a target layout into destination files. One module per format; nothing outside this
//! module knows a file format.
//!
//! - [`safetensors`]: one `.safetensors` file (a consolidated checkpoint);
//! - [`hf`]: Hugging Face sharded safetensors (`model.safetensors.index.json` + files);
//! - [`hf_storage`]: the per-rank safetensors shards PyTorch's
//!   `HuggingFaceStorageWriter(save_distributed=True)` writes, with each chunk's global
//!   offsets under `DCP_SHARDING_INFO`;
//! - [`dcp`]: PyTorch Distributed Checkpoints (`.metadata` + `.distcp` files), read only;
//!   [`torch_zip`] reads the `torch.save` archives they hold;
//! - [`pt_read`] and [`pt`]: one `torch.save` (`.pt`) file holding a state dict, read and
//!   written.

pub mod dcp;
pub mod dcp_write;
pub mod hf;
pub mod hf_storage;
pub mod pickle;
pub mod pt;
pub mod pt_read;
pub mod safetensors;
pub mod torch;
pub mod torch_save;
pub mod torch_zip;

use crate::error::{Error, IoContext, Result};
use crate::exec::OutputFile;
use crate::layout::{Region, TensorLayout};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The formats reshard reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// A single `.safetensors` file.
    Safetensors,
    /// Hugging Face sharded safetensors with `model.safetensors.index.json`.
    Hf,
    /// Per-rank safetensors shards with `DCP_SHARDING_INFO` (torch's HF storage layout).
    HfStorage,
    /// A PyTorch Distributed Checkpoint directory (`.metadata` + `__R_I.distcp`).
    Dcp,
    /// One `torch.save` file (zip format) holding a state dict: read as one rank, written
    /// so that `torch.load(weights_only=True)` opens it.
    Pt,
}

impl Format {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Format::Safetensors => "safetensors",
            Format::Hf => "hf",
            Format::HfStorage => "hf-storage",
            Format::Dcp => "dcp",
            Format::Pt => "pt",
        }
    }

    /// True when the format's output is a directory.
    pub fn is_dir(self) -> bool {
        !matches!(self, Format::Safetensors | Format::Pt)
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "safetensors" | "st" => Ok(Format::Safetensors),
            "hf" | "hf-sharded" => Ok(Format::Hf),
            "hf-storage" | "hf-distributed" => Ok(Format::HfStorage),
            "dcp" => Ok(Format::Dcp),
            "pt" | "torch" => Ok(Format::Pt),
            _ => Err(format!(
                "unknown format `{s}` (expected safetensors, hf, hf-storage, dcp or pt)"
            )),
        }
    }
}

/// One element of a key's path in the nested state dict: a dict key or a list index
/// (DCP's `planner_data`), or an int dict key (`optimizer.state_dict()["state"]` is keyed by
/// parameter number; DCP turns such keys into strings, `torch.save` files keep them).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum KeyPart {
    /// A dict key.
    Key(String),
    /// A list index.
    Index(i64),
    /// An int dict key (JSON: `{"int": 3}`).
    IntKey {
        /// The key.
        int: i64,
    },
}

impl KeyPart {
    /// The text this part adds to a flat name (Python's `str` of the key or index).
    pub fn text(&self) -> String {
        match self {
            KeyPart::Key(k) => k.clone(),
            KeyPart::Index(i) | KeyPart::IntKey { int: i } => i.to_string(),
        }
    }
}

/// A non-tensor entry of a checkpoint: a DCP `BYTE_IO` item (step counters, `param_groups`,
/// scheduler state) or a key of Lightning's `meta.pt`.
#[derive(Clone, Debug, Serialize)]
pub struct Extra {
    /// The flat key (`optimizer.param_groups.0.lr`, `step`).
    pub name: String,
    /// The decoded value, JSON-ified for display (tuples become lists, None null; values JSON
    /// cannot hold exactly are shown as strings such as `"<bytes: 12>"`).
    pub value: serde_json::Value,
    /// The decoded pickle value, for writers that re-emit it.
    #[serde(skip)]
    pub pickle: Option<pickle::Value>,
    /// Where the original serialized item lives: (file index, offset, length).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw: Option<(u32, u64, u64)>,
    /// Where it came from (`dcp`, `meta.pt`).
    pub origin: &'static str,
}

/// The safetensors `__metadata__` key under which reshard keeps non-tensor entries (DCP
/// `BYTE_IO` items, Lightning `meta.pt` keys), as one JSON object `{flat key: value}`.
pub const EXTRAS_KEY: &str = "reshard.extras";

/// The safetensors `__metadata__` key under which reshard keeps the nesting of flat names in
/// the original state dict (DCP `planner_data`), as one JSON object `{flat key: [key or
/// index, ...]}`, so that a later `.pt` or DCP output rebuilds the same structure.
pub const PATHS_KEY: &str = "reshard.paths";

/// Take the nesting reshard stored in a safetensors `__metadata__` map.
pub fn paths_from_metadata(
    path: &Path,
    metadata: &mut BTreeMap<String, String>,
) -> Result<BTreeMap<String, Vec<KeyPart>>> {
    let Some(text) = metadata.remove(PATHS_KEY) else {
        return Ok(BTreeMap::new());
    };
    serde_json::from_str(&text).map_err(|e| {
        Error::format(
            path,
            format!("`{PATHS_KEY}` in the header is not a JSON object of key paths: {e}"),
        )
    })
}

/// Take the non-tensor entries reshard stored in a safetensors `__metadata__` map.
pub fn extras_from_metadata(
    path: &Path,
    metadata: &mut BTreeMap<String, String>,
) -> Result<Vec<Extra>> {
    let pickles = metadata.remove(EXTRAS_PICKLE_KEY);
    let Some(text) = metadata.remove(EXTRAS_KEY) else {
        return Ok(vec![]);
    };
    let Ok(serde_json::Value::Object(m)) = serde_json::from_str(&text) else {
        return Err(Error::format(
            path,
            format!("`{EXTRAS_KEY}` in the header is not a JSON object"),
        ));
    };
    let pickles: BTreeMap<String, String> = match pickles {
        None => BTreeMap::new(),
        Some(p) => serde_json::from_str(&p).map_err(|_| {
            Error::format(
                path,
                format!("`{EXTRAS_PICKLE_KEY}` in the header is not a JSON object of strings"),
            )
        })?,
    };
    m.into_iter()
        .map(|(name, value)| {
            let pickle = match pickles.get(&name) {
                None => None,
                Some(hex) => {
                    let bytes = from_hex(hex).ok_or_else(|| {
                        Error::format(
                            path,
                            format!("`{EXTRAS_PICKLE_KEY}` of `{name}` is not hex"),
                        )
                    })?;
                    let v = pickle::parse(&bytes, &pickle::torch_save_globals()).map_err(|e| {
                        Error::format(path, format!("`{EXTRAS_PICKLE_KEY}` of `{name}`: {e}"))
                    })?;
                    Some(v)
                }
            };
            Ok(Extra {
                name,
                value,
                pickle,
                raw: None,
                origin: "reshard.extras",
            })
        })
        .collect()
}

/// The safetensors `__metadata__` key holding, next to [`EXTRAS_KEY`]'s JSON, each non-tensor
/// entry as a hex-encoded pickle, so Python types JSON cannot tell apart (tuples, bytes,
/// non-string keys) survive a trip through safetensors.
pub const EXTRAS_PICKLE_KEY: &str = "reshard.extras.pickle";

/// Lower-case hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Bytes of a hex string, `None` when it is not one.
fn from_hex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl Extra {
    /// The entry as a Python value: its decoded pickle when it can be re-emitted, its JSON
    /// otherwise.
    pub fn py_value(&self) -> torch_save::PyValue {
        self.pickle
            .as_ref()
            .and_then(torch_save::from_pickle)
            .unwrap_or_else(|| torch_save::from_json(&self.value))
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
    /// Scratch files the reader created (e.g. decompressed zstd items listed in `files`);
    /// they are deleted when the last clone of the checkpoint is dropped.
    #[serde(skip)]
    pub scratch: Vec<std::sync::Arc<tempfile::TempPath>>,
    /// CRC-32s the files record of their own bytes: torch.save data records (DCP items,
    /// `.pt`), and the `reshard.crc32` of safetensors files reshard wrote.
    #[serde(skip)]
    pub checksums: Vec<RecordCrc>,
}

/// A byte range of a checkpoint file and the CRC-32 the file records for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordCrc {
    /// Index into [`Checkpoint::files`].
    pub file: u32,
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The recorded CRC-32.
    pub crc: u32,
    /// What the range holds, for messages (`record archive/data/3`, `tensor w`).
    pub what: String,
    /// The file to name in messages when it is not `file` (the `.distcp` file a
    /// zstd-compressed item came from, whose decoded bytes `file` holds).
    pub shown: Option<u32>,
}

impl Checkpoint {
    /// Open a checkpoint of any supported format, detected from `path`, and validate it.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let mut ck = match detect(path)? {
            Format::Safetensors => safetensors::read(path)?,
            Format::Hf => hf::read(path)?,
            Format::HfStorage => hf_storage::read(path)?,
            Format::Dcp => dcp::read(path)?,
            Format::Pt => pt_read::read(path)?,
        };
        if ck.extras.is_empty() {
            ck.extras = extras_from_metadata(path, &mut ck.metadata)?;
        }
        if ck.paths.is_empty() {
            ck.paths = paths_from_metadata(path, &mut ck.metadata)?;
        }
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
            ranks,
            tensors,
            metadata,
            extras: vec![],
            paths: BTreeMap::new(),
            producer: None,
            scratch: vec![],
            checksums: vec![],
        }
    }

    /// Check every tensor's pieces tile it exactly and lie within their files.
    pub fn validate(&self) -> Result<()> {
        let sizes: Vec<u64> = self
            .files
            .iter()
            .map(|f| std::fs::metadata(f).map(|m| m.len()).at(f))
            .collect::<Result<_>>()?;
        for t in &self.tensors {
            t.validate()?;
            let elem = t.dtype.size() as u64;
            for p in &t.pieces {
                let end = p.loc.offset.saturating_add(p.span_bytes(elem));
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
        dtype: Option<crate::layout::DType>,
    ) -> Result<Vec<u8>> {
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
        let piece = crate::layout::Piece {
            rank: 0,
            region: region.clone(),
            loc: crate::layout::Loc {
                file: 0,
                offset: 0,
                strides: None,
            },
        };
        let mut ops = vec![];
        crate::plan::fill(t, std::slice::from_ref(&piece), dtype, &mut ops);
        let mut out = vec![0u8; (region.volume() as usize) * dtype.size()];
        crate::exec::read_into(&ops, &self.files, &mut out)?;
        Ok(out)
    }

    /// Total bytes of all tensors (each counted once).
    pub fn nbytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.nbytes()).sum()
    }
}

/// Tell which format `path` holds.
pub fn detect(path: &Path) -> Result<Format> {
    let meta = std::fs::metadata(path).at(path)?;
    if meta.is_file() {
        // a zip (torch.save) or a legacy torch.save pickle is a .pt; anything else is
        // taken for safetensors, whose reader says what is wrong with it
        let mut head = [0u8; 16];
        let n = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read(&mut f, &mut head))
            .unwrap_or(0);
        let head = &head[..n];
        let pt = head.starts_with(b"PK\x03\x04") || pt_read::is_legacy(head);
        return Ok(if pt { Format::Pt } else { Format::Safetensors });
    }
    if hf::index_path(path).is_some() {
        return Ok(Format::Hf);
    }
    if dcp::is_dcp(path)? {
        return Ok(Format::Dcp);
    }
    if !safetensors::files_in(path)?.is_empty() {
        return Ok(Format::HfStorage);
    }
    Err(Error::format(
        path,
        "is not a checkpoint: expected a .safetensors file, or a directory with \
         model.safetensors.index.json, *.safetensors shards or a DCP .metadata",
    ))
}

/// What a writer is asked to produce for one tensor: its dtype and shape in the output, and
/// the regions each target rank holds.
#[derive(Clone, Debug)]
pub struct TargetTensor {
    /// Output name.
    pub name: String,
    /// Output dtype.
    pub dtype: crate::layout::DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Per target rank, the regions it holds.
    pub ranks: Vec<Vec<Region>>,
}

/// Writer settings.
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Largest data file for [`Format::Hf`] outputs.
    pub max_shard_size: u64,
    /// String metadata to carry into safetensors headers.
    pub metadata: BTreeMap<String, String>,
    /// Non-tensor entries, for formats that hold Python values (`.pt`).
    pub extras: Vec<Extra>,
    /// Nesting of flat names, for formats that rebuild the nested state dict (`.pt`); names
    /// absent here are top-level keys.
    pub paths: BTreeMap<String, Vec<KeyPart>>,
    /// Groups of tied target names ([`crate::ties`]), stored once by formats that can alias
    /// (`.pt`); other formats write every name.
    pub ties: Vec<Vec<String>>,
}

impl Default for WriteOptions {
    fn default() -> Self {
        WriteOptions {
            max_shard_size: 5_000_000_000,
            metadata: BTreeMap::new(),
            extras: vec![],
            paths: BTreeMap::new(),
            ties: vec![],
        }
    }
}

/// A writer's answer: the files to create and every tensor's layout over them.
#[derive(Clone, Debug)]
pub struct Output {
    /// Files to create; [`crate::layout::Loc::file`] indexes this list.
    pub files: Vec<OutputFile>,
    /// The tensors as they will be laid out in those files.
    pub tensors: Vec<TensorLayout>,
}

/// Lay out `target` (over `world` ranks) in `format`.
pub fn write(
    format: Format,
    target: &[TargetTensor],
    world: u32,
    opts: &WriteOptions,
) -> Result<Output> {
    match format {
        Format::Safetensors => {
            if world != 1 {
                return Err(Error::usage(format!(
                    "a single .safetensors file holds one rank, not {world}: use --to 1, or a directory output"
                )));
            }
            safetensors::write(target, opts)
        }
        Format::Hf => {
            if world != 1 {
                return Err(Error::usage(format!(
                    "the hf format holds a consolidated model (one rank), not {world}: use --to 1, or --format hf-storage"
                )));
            }
            hf::write(target, opts)
        }
        Format::HfStorage => hf_storage::write(target, world, opts),
        Format::Dcp => dcp_write::write(target, world, opts),
        Format::Pt => {
            if world != 1 {
                return Err(Error::usage(format!(
                    "a .pt file holds a consolidated state dict (one rank), not {world}: use --to 1"
                )));
            }
            pt::write(target, opts)
        }
    }
}
