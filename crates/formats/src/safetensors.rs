//! A single `.safetensors` file, and the safetensors header reading and writing the other
//! safetensors-based formats share.
//!
//! Headers are parsed and validated by the `safetensors` crate over a memory map, so only the
//! header pages are touched; tensor data never passes through it. Written headers list
//! tensors in data order, are padded with spaces so data starts 8-byte aligned, and place
//! tensors by decreasing element size so every tensor is aligned to its dtype.

use super::{
    torch::pickle, Aliasing, Capabilities, Checkpoint, Codec, Container, Extra, Family, Format,
    KeyPart, Output, Probe, Recognition, TargetTensor, WriteOptions,
};
use crate::error::{Error, IoContext, Result};
use crate::layout::{DType, Region, TensorLayout};
use crate::torch::pickle::extra_value;
use ::safetensors::tensor::{Dtype, Metadata};
use ::safetensors::SafeTensors;
use reshard_core::output::{from_hex, to_hex};
use reshard_core::output::{Checksum, OutputFile};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One tensor of a safetensors file: name, dtype, shape and absolute byte offset of its data.
#[derive(Clone, Debug)]
pub struct HeaderTensor {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute offset of the first data byte in the file.
    pub offset: u64,
}

/// A parsed safetensors header.
#[derive(Clone, Debug, Default)]
pub struct Header {
    /// Tensors in data order.
    pub tensors: Vec<HeaderTensor>,
    /// `__metadata__`.
    pub metadata: BTreeMap<String, String>,
}

fn dtype_of(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::BOOL => DType::Bool,
        Dtype::U8 => DType::U8,
        Dtype::I8 => DType::I8,
        Dtype::F8_E4M3 => DType::F8E4M3,
        Dtype::F8_E5M2 => DType::F8E5M2,
        Dtype::I16 => DType::I16,
        Dtype::U16 => DType::U16,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I32 => DType::I32,
        Dtype::U32 => DType::U32,
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::U64 => DType::U64,
        Dtype::C64 => DType::C64,
        Dtype::F8_E4M3FNUZ => DType::F8E4M3FNUZ,
        Dtype::F8_E5M2FNUZ => DType::F8E5M2FNUZ,
        Dtype::F8_E8M0 => DType::F8E8M0,
        _ => return None,
    })
}

/// Parse and validate the header of the safetensors file at `path` (one file of a
/// checkpoint folder: a file that is no safetensors file is said to be one that is not valid).
pub fn read_header(path: &Path) -> Result<Header> {
    read_header_as(path, false)
}

/// The most bytes a safetensors header may have (the `safetensors` crate's limit).
const MAX_HEADER: u64 = 100_000_000;

/// [`read_header`]; `whole`: `path` is the checkpoint itself (the file a command was given,
/// which no format with a magic number claimed), so a file that is no safetensors file at all
/// (text, an empty file) is said to be no checkpoint, with what was expected. A file whose
/// header length and first header byte are a safetensors file's but which ends inside the
/// header is said to be truncated, with both sizes.
fn read_header_as(path: &Path, whole: bool) -> Result<Header> {
    let file = std::fs::File::open(path).at(path)?;
    let len = file.metadata().at(path)?.len();
    let foreign = |why: String| {
        if whole {
            Error::format(path, not_a_checkpoint(&why))
        } else {
            Error::format(path, format!("is not a valid safetensors file: {why}"))
        }
    };
    if len < 8 {
        if whole {
            return Err(foreign(match len {
                0 => "it is empty".into(),
                n => format!("it is only {n} byte(s) long"),
            }));
        }
        return Err(Error::format(
            path,
            format!(
                "is not a safetensors file: {len} bytes, shorter than the 8-byte header length"
            ),
        ));
    }
    let map = crate::sys::map_file(&file, path)?;
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
    // A header is JSON that starts with `{`; what follows the length tells a safetensors file
    // cut short from a file of something else.
    let first = map[8..].iter().find(|b| !b" \t\r\n".contains(b)).copied();
    if is_text(&map[..map.len().min(512)]) {
        return Err(foreign("it is a text file".into()));
    }
    if n > MAX_HEADER {
        return Err(foreign(format!(
            "its first 8 bytes, read as a header length, say {n} bytes, more than a \
             safetensors header may have"
        )));
    }
    if first.is_some_and(|b| b != b'{') {
        return Err(foreign("its header does not start with `{`".into()));
    }
    if n > len - 8 {
        return Err(Error::format(
            path,
            format!(
                "is truncated: its header length says {n} bytes of header follow, but the \
                 file has only {} bytes after it",
                len - 8
            ),
        ));
    }
    let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| {
        let what = match e {
            ::safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                "is truncated or has trailing bytes: its size does not match its header".to_string()
            }
            other => format!("is not a valid safetensors file: {other}"),
        };
        Error::format(path, what)
    })?;
    header_from(path, n as u64, &meta)
}

/// What a file that is no checkpoint is told (`why` it is not one): the single-file formats
/// it could have been.
fn not_a_checkpoint(why: &str) -> String {
    let nouns: Vec<&str> = Format::all()
        .filter(|f| f.capabilities().container == super::Container::File)
        .map(|f| f.capabilities().noun)
        .collect();
    format!(
        "is not a checkpoint ({why}): expected {}",
        super::or_list(nouns.into_iter())
    )
}

/// True when `head` (a file's first bytes) reads as text: UTF-8 (a character cut at its end
/// allowed) without control characters other than tabs, line ends and form feeds.
fn is_text(head: &[u8]) -> bool {
    let valid = match std::str::from_utf8(head) {
        Ok(s) => s,
        Err(e) if e.error_len().is_none() => {
            std::str::from_utf8(&head[..e.valid_up_to()]).expect("valid up to here")
        }
        Err(_) => return false,
    };
    !valid.is_empty()
        && valid
            .chars()
            .all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r' | '\x0c'))
}

fn header_from(path: &Path, n: u64, meta: &Metadata) -> Result<Header> {
    let infos = meta.tensors();
    let mut tensors = Vec::with_capacity(infos.len());
    for name in meta.offset_keys() {
        let info = infos[&name];
        let dtype = dtype_of(info.dtype).ok_or_else(|| {
            Error::format(
                path,
                format!(
                    "tensor `{name}` has dtype {:?}, which reshard does not support",
                    info.dtype
                ),
            )
        })?;
        tensors.push(HeaderTensor {
            name,
            dtype,
            shape: info.shape.iter().map(|&s| s as u64).collect(),
            offset: 8 + n + info.data_offsets.0 as u64,
        });
    }
    let metadata = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok(Header { tensors, metadata })
}

/// The `*.safetensors` files directly in `dir`, sorted by name.
pub fn files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(super::file_names(dir)?
        .into_iter()
        .filter(|n| is_shard_name(n))
        .map(|n| dir.join(n))
        .collect())
}

/// True for the name of a safetensors data file: `*.safetensors`, not hidden.
pub fn is_shard_name(name: &str) -> bool {
    name.ends_with(".safetensors") && !name.starts_with('.') && name.len() > ".safetensors".len()
}

/// A tensor to place in a safetensors file.
#[derive(Clone, Debug)]
pub struct Entry {
    /// Name in the header.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of the stored box.
    pub shape: Vec<u64>,
}

impl Entry {
    fn nbytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size() as u64
    }

    /// The dtype name and shape the header records for this entry. Safetensors has no
    /// complex32, bcomplex32 or complex128: those are stored as their real pairs (f16 / bf16 /
    /// f64, one more
    /// dimension of 2, as `torch.view_as_real` gives them; the bytes are the same). A dtype
    /// safetensors cannot hold at all (float4_e2m1fn_x2) is refused, naming the tensor.
    fn stored(&self) -> Result<(&'static str, Vec<u64>)> {
        match self.dtype {
            DType::C32 | DType::BC32 | DType::C128 => {
                let part = self.dtype.complex_part().unwrap_or(DType::F64);
                let mut shape = self.shape.clone();
                shape.push(2);
                Ok((part.name(), shape))
            }
            DType::F4E2M1X2 => Err(Error::layout(
                &self.name,
                format!(
                    "dtype {} (torch.float4_e2m1fn_x2) has no safetensors counterpart; write \
                     it to a DCP or .pt checkpoint, or leave it out with --exclude",
                    self.dtype
                ),
            )),
            d => Ok((d.name(), self.shape.clone())),
        }
    }

    /// The header's value for this entry, its data at `rel` in the data section.
    fn header_value(&self, rel: u64) -> Result<serde_json::Value> {
        let (dtype, shape) = self.stored()?;
        Ok(
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [rel, rel + self.nbytes()]}),
        )
    }
}

/// Order entries for writing: decreasing element size (stable), so each tensor's data is
/// aligned to its dtype when the data section starts 8-byte aligned.
pub fn align_order(entries: &mut [Entry]) {
    entries.sort_by_key(|e| std::cmp::Reverse(e.dtype.size()));
}

/// Lay out a safetensors file holding `entries` in the given order: returns the file's header
/// bytes (length prefix included), each entry's absolute data offset, and the file size.
pub fn layout_file(
    entries: &[Entry],
    metadata: &BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<u64>, u64)> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).unwrap_or_default(),
        );
    }
    let mut rel = 0u64;
    let mut rels = Vec::with_capacity(entries.len());
    for e in entries {
        let n = e.nbytes();
        header.insert(e.name.clone(), e.header_value(rel)?);
        rels.push(rel);
        rel += n;
    }
    let mut json = serde_json::to_vec(&header)
        .map_err(|e| Error::usage(format!("cannot encode header: {e}")))?;
    // Validate what we emit with the safetensors crate itself.
    serde_json::from_slice::<Metadata>(&json).map_err(|e| {
        Error::usage(format!(
            "internal error: generated an invalid safetensors header: {e}"
        ))
    })?;
    while (8 + json.len()) % 8 != 0 {
        json.push(b' ');
    }
    let start = 8 + json.len() as u64;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    Ok((bytes, rels.iter().map(|r| start + r).collect(), start + rel))
}

/// The `__metadata__` key under which reshard records the CRC-32 of every tensor's data in
/// the file: a JSON array of 8-digit lowercase hex strings, in data order.
pub const CRC_KEY: &str = "reshard.crc32";

/// Placeholder for one CRC in the header, overwritten once the data is written.
const CRC_HOLE: &[u8; 8] = b"@@@@@@@@";

/// Build one output file holding `entries` (already ordered); returns the file and each
/// entry's absolute data offset. The header records each entry's CRC-32 under [`CRC_KEY`],
/// computed by the executor as the data streams.
pub fn output_file(
    path: PathBuf,
    entries: &[Entry],
    metadata: &BTreeMap<String, String>,
) -> Result<(OutputFile, Vec<u64>)> {
    let mut metadata = metadata.clone();
    let holes = vec![std::str::from_utf8(CRC_HOLE).unwrap_or_default(); entries.len()];
    metadata.insert(CRC_KEY.into(), serde_json::json!(holes).to_string());
    let (header, offsets, size) = layout_file(entries, &metadata)?;
    // The holes lie in the value of `"reshard.crc32":"` (a key can only appear with bare
    // quotes; quotes inside values are escaped), in entry order.
    let key = format!("\"{CRC_KEY}\":\"");
    let from = find(&header, key.as_bytes(), 0)
        .ok_or_else(|| Error::usage("internal error: no checksum key in the header"))?;
    let mut at = from;
    let mut checksums = Vec::with_capacity(entries.len());
    for (e, &offset) in entries.iter().zip(&offsets) {
        at = find(&header, CRC_HOLE, at)
            .ok_or_else(|| Error::usage("internal error: checksum placeholder missing"))?;
        checksums.push(Checksum {
            range: (offset, offset + e.nbytes()),
            at: vec![at as u64],
            hex: true,
        });
        at += CRC_HOLE.len();
    }
    Ok((
        OutputFile {
            path,
            size,
            literals: vec![(0, header.into())],
            checksums,
        },
        offsets,
    ))
}

/// The size of a file [`output_file`] would write, or a little more, grown one entry at a
/// time: a file's header included, for packing entries into files of at most so many bytes
/// (a Hugging Face shard, [`crate::hf`]) without laying out each candidate.
#[derive(Clone, Copy, Debug)]
pub struct FileSize {
    /// The length prefix and JSON header of the entries so far (without padding).
    header: u64,
    /// Their data.
    data: u64,
}

impl FileSize {
    /// A file of no entries with `metadata` (as given to [`output_file`]).
    pub fn new(metadata: &BTreeMap<String, String>) -> Result<FileSize> {
        let mut metadata = metadata.clone();
        metadata.insert(CRC_KEY.into(), "[]".into());
        let (header, _, _) = layout_file(&[], &metadata)?;
        Ok(FileSize {
            header: header.len() as u64,
            data: 0,
        })
    }

    /// With `e` after the entries so far.
    pub fn with(self, e: &Entry) -> FileSize {
        let n = e.nbytes();
        let key = serde_json::to_string(&e.name).unwrap_or_default();
        // a dtype safetensors cannot hold is refused when the file is laid out
        let value = e.header_value(self.data).unwrap_or_default();
        // `,"name":{…}`, and its CRC placeholder: `,\"@@@@@@@@\"` inside the escaped
        // `reshard.crc32` string
        let entry = 1 + key.len() + 1 + value.to_string().len();
        let crc = 1 + 2 + CRC_HOLE.len() + 2;
        FileSize {
            header: self.header + (entry + crc) as u64,
            data: self.data + n,
        }
    }

    /// At least the file's size: header padding included.
    pub fn bytes(self) -> u64 {
        self.header + 7 + self.data
    }
}

/// Position of `needle` in `hay` at or after `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// The CRC-32s a header records under [`CRC_KEY`] (removed from `metadata`), one per tensor
/// in data order, as checksums of file `file`; none when the key is absent.
pub fn recorded_crcs(path: &Path, file: u32, h: &mut Header) -> Result<Vec<crate::RecordCrc>> {
    let Some(text) = h.metadata.remove(CRC_KEY) else {
        return Ok(vec![]);
    };
    let bad = || {
        Error::format(
            path,
            format!("`{CRC_KEY}` in the header is not a list of CRC-32s"),
        )
    };
    let list: Vec<String> = serde_json::from_str(&text).map_err(|_| bad())?;
    if list.len() != h.tensors.len() {
        return Err(Error::format(
            path,
            format!(
                "`{CRC_KEY}` lists {} checksums for {} tensors",
                list.len(),
                h.tensors.len()
            ),
        ));
    }
    list.iter()
        .zip(&h.tensors)
        .map(|(c, t)| {
            let crc = u32::from_str_radix(c, 16).map_err(|_| bad())?;
            Ok(crate::RecordCrc {
                file,
                offset: t.offset,
                len: Region::full(&t.shape).volume() * t.dtype.size() as u64,
                crc,
                what: format!("tensor `{}`", t.name).into(),
                shown: None,
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// reshard's own `__metadata__` keys

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
                    let v =
                        pickle::parse(&bytes, &pickle::pickled_dict_globals()).map_err(|e| {
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
                opaque: None,
            })
        })
        .collect()
}

/// The safetensors `__metadata__` key holding, next to [`EXTRAS_KEY`]'s JSON, each non-tensor
/// entry as a hex-encoded pickle, so Python types JSON cannot tell apart (tuples, bytes,
/// non-string keys) survive a trip through safetensors.
pub const EXTRAS_PICKLE_KEY: &str = "reshard.extras.pickle";

/// The safetensors `__metadata__` key under which reshard records its version (`0.1.0`) in
/// every file it writes, so that `inspect` can say what wrote it.
pub const VERSION_KEY: &str = "reshard.version";

/// The keys of [`header_metadata`] that hold for a whole checkpoint rather than for the file
/// they are in (non-tensor entries, nesting): a Hugging Face sharded output keeps them once,
/// in its index, instead of in every shard ([`crate::hf`]).
pub const CHECKPOINT_KEYS: &[&str] = &[EXTRAS_KEY, EXTRAS_PICKLE_KEY, PATHS_KEY];

/// The string metadata a safetensors-family header carries for `opts`: the caller's
/// metadata, `format: pt` (the Hugging Face convention) unless set, reshard's version
/// ([`VERSION_KEY`]), and what safetensors
/// cannot hold itself — non-tensor entries as JSON under [`EXTRAS_KEY`] (and their exact
/// Python values under [`EXTRAS_PICKLE_KEY`]), and the nesting of the names written (tensors
/// in `target`, entries in `opts.extras`) under [`PATHS_KEY`].
pub fn header_metadata(
    target: &[TargetTensor],
    opts: &WriteOptions,
) -> Result<BTreeMap<String, String>> {
    let mut metadata = opts.metadata.clone();
    metadata
        .entry("format".into())
        .or_insert_with(|| "pt".into());
    metadata.insert(VERSION_KEY.into(), env!("CARGO_PKG_VERSION").into());
    if !opts.extras.is_empty() {
        let json: serde_json::Map<String, serde_json::Value> = opts
            .extras
            .iter()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect();
        metadata.insert(
            EXTRAS_KEY.into(),
            serde_json::Value::Object(json).to_string(),
        );
        let pickles: serde_json::Map<String, serde_json::Value> = opts
            .extras
            .iter()
            .map(|e| {
                let bytes = pickle::pickle(&extra_value(e));
                (e.name.clone(), to_hex(&bytes).into())
            })
            .collect();
        metadata.insert(
            EXTRAS_PICKLE_KEY.into(),
            serde_json::Value::Object(pickles).to_string(),
        );
    }
    if !opts.paths.is_empty() {
        let written: std::collections::HashSet<&str> = target
            .iter()
            .map(|t| t.name.as_str())
            .chain(opts.extras.iter().map(|e| e.name.as_str()))
            .collect();
        let kept: BTreeMap<&String, &Vec<KeyPart>> = opts
            .paths
            .iter()
            .filter(|(n, _)| written.contains(n.as_str()))
            .collect();
        if !kept.is_empty() {
            metadata.insert(
                PATHS_KEY.into(),
                serde_json::to_string(&kept).map_err(|e| Error::usage(e.to_string()))?,
            );
        }
    }
    Ok(metadata)
}

/// A safetensors-family checkpoint: tensors and string metadata, with the non-tensor entries
/// and nesting reshard recorded in the metadata taken out of it, and the CRC-32s its files
/// record ([`recorded_crcs`]). Its producer is reshard when the metadata names reshard's
/// version ([`VERSION_KEY`], taken out too) or the files record CRC-32s (which only reshard
/// writes).
pub fn checkpoint(
    format: Format,
    path: &Path,
    files: Vec<PathBuf>,
    ranks: u32,
    tensors: Vec<TensorLayout>,
    mut metadata: BTreeMap<String, String>,
    checksums: Vec<crate::RecordCrc>,
) -> Result<Checkpoint> {
    let extras = extras_from_metadata(path, &mut metadata)?;
    let paths = paths_from_metadata(path, &mut metadata)?;
    let producer = match metadata.remove(VERSION_KEY) {
        Some(v) => Some(format!("reshard {}", crate::error::one_line(&v))),
        None if !checksums.is_empty() => Some("reshard (no version recorded)".to_string()),
        None => None,
    };
    let mut ck = Checkpoint::of_tensors(format, path, files, ranks, tensors, metadata);
    ck.extras = extras;
    ck.paths = paths;
    ck.checksums = checksums;
    ck.producer = producer;
    Ok(ck)
}

// ---------------------------------------------------------------------------------------------
// the single-file format

/// The single `.safetensors` file format.
pub struct Safetensors;

static CAPS: Capabilities = Capabilities {
    name: "safetensors",
    aliases: &["st"],
    summary: "one .safetensors file (one rank)",
    noun: "a single .safetensors file",
    container: Container::File,
    extensions: &["safetensors"],
    max_world: Some(1),
    family: Family::Safetensors,
    extras_kept: "as JSON in the safetensors __metadata__ key `reshard.extras`",
    keeps_opaque: false,
    aliasing: Aliasing::Forbidden,
    written: true,
};

impl Codec for Safetensors {
    fn capabilities(&self) -> &'static Capabilities {
        &CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        // any file that no format with a magic number claims; the reader says what is wrong
        Recognition::fallback_if(probe.is_file)
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path)
    }
    fn write(&self, target: &[TargetTensor], _world: u32, opts: &WriteOptions) -> Result<Output> {
        write(target, opts)
    }
}

/// Read a single safetensors file as a one-rank checkpoint.
pub fn read(path: &Path) -> Result<Checkpoint> {
    let mut h = read_header_as(path, true)?;
    let checksums = recorded_crcs(path, 0, &mut h)?;
    let tensors = h
        .tensors
        .into_iter()
        .map(|t| TensorLayout::whole(t.name, t.dtype, t.shape, 0, t.offset, None))
        .collect();
    checkpoint(
        Format::SAFETENSORS,
        path,
        vec![path.to_path_buf()],
        1,
        tensors,
        h.metadata,
        checksums,
    )
}

/// `target`'s tensors as header entries, in the order that aligns their data.
pub fn aligned_entries(target: &[TargetTensor]) -> Vec<Entry> {
    let mut entries: Vec<Entry> = target
        .iter()
        .map(|t| Entry {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
        })
        .collect();
    align_order(&mut entries);
    entries
}

/// Lay out a consolidated target as one safetensors file.
pub fn write(target: &[TargetTensor], opts: &WriteOptions) -> Result<Output> {
    let entries = aligned_entries(target);
    let metadata = header_metadata(target, opts)?;
    let (file, offsets) = output_file(PathBuf::from("model.safetensors"), &entries, &metadata)?;
    Ok(Output {
        files: vec![file],
        tensors: full_layouts(&entries, &offsets, 0),
        copies: vec![],
    })
}

/// Layouts of whole tensors stored row-major at `offsets` in output file `file`.
pub fn full_layouts(entries: &[Entry], offsets: &[u64], file: u32) -> Vec<TensorLayout> {
    entries
        .iter()
        .zip(offsets)
        .map(|(e, &offset)| {
            TensorLayout::whole(e.name.clone(), e.dtype, e.shape.clone(), file, offset, None)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, dtype: DType, shape: &[u64]) -> Entry {
        Entry {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn dtypes_safetensors_lacks_are_stored_as_real_pairs_or_refused() {
        let entries = [
            entry("c128", DType::C128, &[3]),
            entry("c64", DType::C64, &[3]),
            entry("c32", DType::C32, &[2, 1]),
            entry("e8m0", DType::F8E8M0, &[4]),
            entry("fnuz", DType::F8E4M3FNUZ, &[4]),
        ];
        let (bytes, offsets, size) = layout_file(&entries, &BTreeMap::new()).unwrap();
        let meta: Metadata = serde_json::from_slice(&bytes[8..]).unwrap();
        let infos = meta.tensors();
        let got = |n: &str| (infos[n].dtype, infos[n].shape.clone());
        assert_eq!(got("c128"), (Dtype::F64, vec![3, 2]));
        assert_eq!(got("c64"), (Dtype::C64, vec![3]));
        assert_eq!(got("c32"), (Dtype::F16, vec![2, 1, 2]));
        assert_eq!(got("e8m0"), (Dtype::F8_E8M0, vec![4]));
        assert_eq!(got("fnuz"), (Dtype::F8_E4M3FNUZ, vec![4]));
        // the same bytes as the complex tensors: 48 + 24 + 8 + 4 + 4
        assert_eq!(size - offsets[0], 88);
        // what the crate reads back is what reshard reads
        for (n, d) in [("c64", DType::C64), ("e8m0", DType::F8E8M0)] {
            assert_eq!(dtype_of(infos[n].dtype), Some(d));
        }
        let e = layout_file(&[entry("x", DType::F4E2M1X2, &[2])], &BTreeMap::new())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`x`") && e.contains("F4_E2M1FN_X2") && e.contains("no safetensors"),
            "{e}"
        );
    }
}
