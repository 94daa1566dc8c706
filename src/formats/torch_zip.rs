//! One `torch.save` zip archive held in a byte slice: an item of a DCP `.distcp` file, or a
//! whole file such as Lightning's `meta.pt` (`docs/pytorch-formats.md` §3.2–3.4).
//!
//! The archive is read from its end: the end-of-central-directory record (and the zip64
//! record when a field is saturated), then the central directory. Local headers carry no
//! sizes in torch archives (data descriptors follow the data), so sizes always come from the
//! central directory, and a record's data offset is `local header + 30 + name length + extra
//! length` with the lengths of the *local* header (torch pads there, not in the directory).
//! Records must be stored (method 0).
//!
//! `<prefix>/data.pkl` is then decoded with the [`pickle`] module's `torch.save` allow-list.
//! A single tensor (`torch._utils._rebuild_tensor_v2`/`_v3`, optionally wrapped in
//! `_rebuild_parameter`) is interpreted into a [`TensorItem`]: dtype, shape, element strides,
//! storage offset and where its storage record lies in the slice, with the strided extent
//! checked against the record so later reads cannot go out of bounds.
//!
//! Nothing here panics on any input, and nothing is allocated from a length field before that
//! field has been checked against the slice. Only the tail of the archive (its central
//! directory), the local headers of the records used, `data.pkl` and `byteorder` are touched;
//! tensor data never is.

use super::pickle::{self, Value};
use crate::layout::DType;
use std::collections::HashSet;

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const LOCAL_LEN: u64 = 30;
const CENTRAL_LEN: u64 = 46;
const EOCD_LEN: u64 = 22;
const ZIP64_EOCD_LEN: u64 = 56;
const ZIP64_LOCATOR_LEN: u64 = 20;

/// Why a torch.save archive could not be read. Every message is one short line.
#[derive(Debug, thiserror::Error)]
pub enum TorchZipError {
    /// No end-of-central-directory record at the end of the slice.
    #[error("end of central directory not found")]
    NoEndOfCentralDirectory,
    /// A structural problem of the zip container.
    #[error("{0}")]
    Zip(String),
    /// A record that is not stored.
    #[error("zip record `{name}` is compressed (method {method})")]
    Compressed {
        /// Record name.
        name: String,
        /// Compression method.
        method: u16,
    },
    /// A record that the archive should hold and does not.
    #[error("zip has no record `{0}`")]
    MissingRecord(String),
    /// `data.pkl` could not be decoded.
    #[error("`{record}`: {source}")]
    Pickle {
        /// The record name.
        record: String,
        /// The pickle error.
        source: pickle::PickleError,
    },
    /// A tensor rebuild call that does not describe a readable tensor.
    #[error("{0}")]
    Tensor(String),
}

type Result<T, E = TorchZipError> = std::result::Result<T, E>;

fn zip_err(msg: impl Into<String>) -> TorchZipError {
    TorchZipError::Zip(msg.into())
}

fn tensor_err(msg: impl Into<String>) -> TorchZipError {
    TorchZipError::Tensor(msg.into())
}

/// Input-derived text for a message: escaped, at most 60 characters.
pub(crate) fn short(text: &str) -> String {
    const MAX: usize = 60;
    let mut out: String = text
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(MAX).is_some() {
        out.push('…');
    }
    out
}

fn bytes_at(b: &[u8], at: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(at).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    b.get(start..end)
}

fn u16_at(b: &[u8], at: u64) -> Option<u16> {
    bytes_at(b, at, 2).map(|s| u16::from_le_bytes([s[0], s[1]]))
}

fn u32_at(b: &[u8], at: u64) -> Option<u32> {
    bytes_at(b, at, 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn u64_at(b: &[u8], at: u64) -> Option<u64> {
    bytes_at(b, at, 8).map(|s| {
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        u64::from_le_bytes(a)
    })
}

/// One central-directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Record name (`archive/data.pkl`).
    pub name: String,
    /// Offset of the record's local header in the slice.
    pub header_offset: u64,
    /// Size of the record's data (stored, so compressed = uncompressed).
    pub size: u64,
    /// CRC-32 from the central directory (0 when the writer did not compute it).
    pub crc: u32,
}

/// Where a record's data lies in the slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// Offset of the first data byte in the slice.
    pub offset: u64,
    /// Data length.
    pub len: u64,
}

/// The central directory of one archive.
#[derive(Clone, Debug)]
pub struct Archive {
    /// The archive name: the first record's name up to `/` (`archive` for DCP items, the
    /// file stem, e.g. `meta`, for files saved to a path).
    pub prefix: String,
    /// Entries in central-directory order.
    pub entries: Vec<Entry>,
    /// Index into `entries` by name (the first entry of a name), so that looking up every
    /// storage of an archive of many records stays linear.
    by_name: std::collections::HashMap<String, usize>,
    /// Where the central directory starts; all record data lies before it.
    cd_offset: u64,
}

impl Archive {
    /// Read the end records and the central directory of the archive in `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Archive> {
        let len = bytes.len() as u64;
        if len < EOCD_LEN {
            return Err(TorchZipError::NoEndOfCentralDirectory);
        }
        // The EOCD is the last record; a comment of up to 65535 bytes may follow it.
        let lowest = len.saturating_sub(EOCD_LEN + 0xFFFF);
        let mut pos = len - EOCD_LEN;
        let eocd = loop {
            if u32_at(bytes, pos) == Some(EOCD_SIG)
                && u16_at(bytes, pos + 20).map(|c| pos + EOCD_LEN + c as u64) == Some(len)
            {
                break pos;
            }
            if pos == lowest {
                return Err(TorchZipError::NoEndOfCentralDirectory);
            }
            pos -= 1;
        };
        let field16 = |at: u64| u16_at(bytes, eocd + at).unwrap_or(0);
        let field32 = |at: u64| u32_at(bytes, eocd + at).unwrap_or(0);
        let mut count = field16(10) as u64;
        let mut cd_size = field32(12) as u64;
        let mut cd_offset = field32(16) as u64;
        let mut cd_limit = eocd;
        if count == 0xFFFF || cd_size == 0xFFFF_FFFF || cd_offset == 0xFFFF_FFFF {
            let loc = eocd
                .checked_sub(ZIP64_LOCATOR_LEN)
                .filter(|&l| u32_at(bytes, l) == Some(ZIP64_LOCATOR_SIG))
                .ok_or_else(|| zip_err("zip64 end of central directory locator not found"))?;
            let z = u64_at(bytes, loc + 8).unwrap_or(u64::MAX);
            if z.checked_add(ZIP64_EOCD_LEN).is_none_or(|e| e > loc)
                || u32_at(bytes, z) != Some(ZIP64_EOCD_SIG)
            {
                return Err(zip_err("zip64 end of central directory not found"));
            }
            count = u64_at(bytes, z + 32).unwrap_or(0);
            cd_size = u64_at(bytes, z + 40).unwrap_or(0);
            cd_offset = u64_at(bytes, z + 48).unwrap_or(0);
            cd_limit = z;
        }
        let cd_end = cd_offset
            .checked_add(cd_size)
            .filter(|&e| e <= cd_limit)
            .ok_or_else(|| {
                zip_err(format!(
                    "central directory ({cd_size} bytes at {cd_offset}) lies outside the archive"
                ))
            })?;
        if count > cd_size / CENTRAL_LEN {
            return Err(zip_err(format!(
                "central directory claims {count} records in {cd_size} bytes"
            )));
        }
        let mut entries = Vec::with_capacity(count as usize);
        let mut seen = HashSet::new();
        let mut p = cd_offset;
        for i in 0..count {
            let fixed = bytes_at(bytes, p, CENTRAL_LEN)
                .filter(|_| p + CENTRAL_LEN <= cd_end)
                .ok_or_else(|| zip_err(format!("central directory record {i} is truncated")))?;
            let r16 = |at: usize| u16::from_le_bytes([fixed[at], fixed[at + 1]]);
            let r32 = |at: usize| {
                u32::from_le_bytes([fixed[at], fixed[at + 1], fixed[at + 2], fixed[at + 3]])
            };
            if r32(0) != CENTRAL_SIG {
                return Err(zip_err(format!(
                    "central directory record {i} has a bad signature"
                )));
            }
            let flags = r16(8);
            let method = r16(10);
            let crc = r32(16);
            let csize32 = r32(20);
            let usize32 = r32(24);
            let name_len = r16(28) as u64;
            let extra_len = r16(30) as u64;
            let comment_len = r16(32) as u64;
            let lho32 = r32(42);
            let var_len = name_len + extra_len + comment_len;
            if p + CENTRAL_LEN + var_len > cd_end {
                return Err(zip_err(format!(
                    "central directory record {i} is truncated"
                )));
            }
            let raw_name = bytes_at(bytes, p + CENTRAL_LEN, name_len).unwrap_or_default();
            let name = std::str::from_utf8(raw_name)
                .map_err(|_| zip_err(format!("zip record {i} has a name that is not UTF-8")))?
                .to_string();
            let extra = bytes_at(bytes, p + CENTRAL_LEN + name_len, extra_len).unwrap_or_default();
            let (mut size, mut csize, mut lho) = (usize32 as u64, csize32 as u64, lho32 as u64);
            if usize32 == u32::MAX || csize32 == u32::MAX || lho32 == u32::MAX {
                let z = zip64_extra(extra).ok_or_else(|| {
                    zip_err(format!(
                        "zip record `{}` has saturated sizes but no zip64 extra field",
                        short(&name)
                    ))
                })?;
                let mut at = 0;
                let mut next = |what: &str| -> Result<u64> {
                    let v = u64_at(z, at).ok_or_else(|| {
                        zip_err(format!(
                            "zip record `{}`: zip64 extra field lacks the {what}",
                            short(&name)
                        ))
                    })?;
                    at += 8;
                    Ok(v)
                };
                if usize32 == u32::MAX {
                    size = next("size")?;
                }
                if csize32 == u32::MAX {
                    csize = next("compressed size")?;
                }
                if lho32 == u32::MAX {
                    lho = next("local header offset")?;
                }
            }
            if method != 0 {
                return Err(TorchZipError::Compressed {
                    name: short(&name),
                    method,
                });
            }
            if flags & 1 != 0 {
                return Err(zip_err(format!(
                    "zip record `{}` is encrypted",
                    short(&name)
                )));
            }
            if csize != size {
                return Err(zip_err(format!(
                    "zip record `{}` is stored but its sizes differ ({csize} and {size})",
                    short(&name)
                )));
            }
            if !seen.insert(name.clone()) {
                return Err(zip_err(format!(
                    "zip record `{}` appears twice",
                    short(&name)
                )));
            }
            entries.push(Entry {
                name,
                header_offset: lho,
                size,
                crc,
            });
            p += CENTRAL_LEN + var_len;
        }
        let prefix = match entries.first() {
            None => return Err(zip_err("zip archive has no records")),
            Some(e) => match e.name.split_once('/') {
                Some((pre, _)) if !pre.is_empty() => pre.to_string(),
                _ => {
                    return Err(zip_err(format!(
                        "zip record `{}` has no archive prefix",
                        short(&e.name)
                    )))
                }
            },
        };
        let mut by_name = std::collections::HashMap::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            by_name.entry(e.name.clone()).or_insert(i);
        }
        Ok(Archive {
            prefix,
            entries,
            by_name,
            cd_offset,
        })
    }

    /// The entry called `name`.
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }

    /// Locate the data of record `name`: checks its local header (signature, method, name)
    /// and that the data lies before the central directory.
    pub fn record(&self, bytes: &[u8], name: &str) -> Result<Record> {
        let e = self
            .entry(name)
            .ok_or_else(|| TorchZipError::MissingRecord(short(name)))?;
        let h = e.header_offset;
        if h.checked_add(LOCAL_LEN)
            .is_none_or(|end| end > self.cd_offset)
        {
            return Err(zip_err(format!(
                "zip record `{}`: local header at {h} lies outside the archive",
                short(name)
            )));
        }
        if u32_at(bytes, h) != Some(LOCAL_SIG) {
            return Err(zip_err(format!(
                "zip record `{}`: no local header signature at {h}",
                short(name)
            )));
        }
        let method = u16_at(bytes, h + 8).unwrap_or(0);
        if method != 0 {
            return Err(TorchZipError::Compressed {
                name: short(name),
                method,
            });
        }
        let name_len = u16_at(bytes, h + 26).unwrap_or(0) as u64;
        let extra_len = u16_at(bytes, h + 28).unwrap_or(0) as u64;
        let local_name = bytes_at(bytes, h + LOCAL_LEN, name_len).unwrap_or_default();
        if local_name != e.name.as_bytes() {
            return Err(zip_err(format!(
                "zip record `{}`: its local header names `{}`",
                short(name),
                short(&String::from_utf8_lossy(local_name))
            )));
        }
        let offset = h + LOCAL_LEN + name_len + extra_len;
        if offset
            .checked_add(e.size)
            .is_none_or(|end| end > self.cd_offset)
        {
            return Err(zip_err(format!(
                "zip record `{}` ({} bytes at {offset}) runs into the central directory",
                short(name),
                e.size
            )));
        }
        Ok(Record {
            offset,
            len: e.size,
        })
    }

    /// The data of record `name`.
    pub fn read<'a>(&self, bytes: &'a [u8], name: &str) -> Result<&'a [u8]> {
        let r = self.record(bytes, name)?;
        Ok(bytes_at(bytes, r.offset, r.len).unwrap_or_default())
    }

    /// Like [`Archive::read`], also checking the record's CRC-32 when the directory has one.
    pub fn read_checked<'a>(&self, bytes: &'a [u8], name: &str) -> Result<&'a [u8]> {
        let data = self.read(bytes, name)?;
        let want = self.entry(name).map_or(0, |e| e.crc);
        if want != 0 {
            let got = crc32fast::hash(data);
            if got != want {
                return Err(zip_err(format!(
                    "zip record `{}` fails its CRC-32 check ({got:08x}, expected {want:08x})",
                    short(name)
                )));
            }
        }
        Ok(data)
    }
}

/// The payload of the zip64 (`0x0001`) block of an extra field.
fn zip64_extra(extra: &[u8]) -> Option<&[u8]> {
    let mut at = 0u64;
    while let (Some(id), Some(n)) = (u16_at(extra, at), u16_at(extra, at + 2)) {
        let body = bytes_at(extra, at + 4, n as u64)?;
        if id == 1 {
            return Some(body);
        }
        at += 4 + n as u64;
    }
    None
}

/// A tensor saved in an archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorItem {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Element strides.
    pub strides: Vec<u64>,
    /// Offset of element 0 in the storage, in elements.
    pub storage_offset: u64,
    /// The storage key (record `<prefix>/data/<key>`).
    pub storage_key: String,
    /// Where the storage record lies in the slice.
    pub record: Record,
}

impl TensorItem {
    /// Offset in the slice of the tensor's element 0.
    pub fn data_offset(&self) -> u64 {
        // Checked when the item was parsed: storage_offset · itemsize fits in the record.
        self.record.offset + self.storage_offset * self.dtype.size() as u64
    }

    /// True when the strides are row-major over the shape (dimensions of size 1 ignored).
    pub fn is_row_major(&self) -> bool {
        let rm = crate::layout::row_major_strides(&self.shape);
        self.shape
            .iter()
            .zip(self.strides.iter().zip(&rm))
            .all(|(&n, (s, r))| n <= 1 || s == r)
    }

    /// Bytes from element 0 to past the last element (0 for an empty tensor).
    pub fn span_bytes(&self) -> u64 {
        extent(&self.shape, &self.strides, self.dtype.size() as u64).unwrap_or(u64::MAX)
    }
}

/// Bytes spanned by a strided view (0 when empty), or `None` on overflow.
fn extent(shape: &[u64], strides: &[u64], elem: u64) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    let mut last = 0u64;
    for (&n, &s) in shape.iter().zip(strides) {
        last = last.checked_add((n - 1).checked_mul(s)?)?;
    }
    last.checked_add(1)?.checked_mul(elem)
}

/// A parsed archive: its directory, the decoded `data.pkl`, and the tensor it holds if it
/// is one.
#[derive(Clone, Debug)]
pub struct Item {
    /// The archive's central directory.
    pub archive: Archive,
    /// The decoded `data.pkl`.
    pub value: Value,
    /// The tensor, when `data.pkl` is a single tensor rebuild call.
    pub tensor: Option<TensorItem>,
}

/// Parse the torch.save archive in `bytes`.
pub fn parse(bytes: &[u8]) -> Result<Item> {
    let archive = Archive::parse(bytes)?;
    let pkl_name = format!("{}/data.pkl", archive.prefix);
    let pkl = archive.read_checked(bytes, &pkl_name)?;
    let order_name = format!("{}/byteorder", archive.prefix);
    if archive.entry(&order_name).is_some() {
        let order = archive.read_checked(bytes, &order_name)?;
        if order != b"little" {
            return Err(zip_err(format!(
                "archive byte order is `{}`; only little-endian archives are supported",
                short(&String::from_utf8_lossy(order))
            )));
        }
    }
    // Built once: a checkpoint has one archive per item, often thousands.
    static GLOBALS: std::sync::OnceLock<pickle::Globals> = std::sync::OnceLock::new();
    let globals = GLOBALS.get_or_init(pickle::torch_save_globals);
    let value = pickle::parse(pkl, globals).map_err(|source| TorchZipError::Pickle {
        record: short(&pkl_name),
        source,
    })?;
    let tensor = tensor_of(&value, &archive, bytes)?;
    Ok(Item {
        archive,
        value,
        tensor,
    })
}

/// The dtype of a legacy typed storage class `torch.<X>Storage`.
fn storage_dtype(name: &str) -> Result<DType> {
    Ok(match name {
        "FloatStorage" => DType::F32,
        "DoubleStorage" => DType::F64,
        "HalfStorage" => DType::F16,
        "BFloat16Storage" => DType::BF16,
        "LongStorage" => DType::I64,
        "IntStorage" => DType::I32,
        "ShortStorage" => DType::I16,
        "CharStorage" => DType::I8,
        "ByteStorage" => DType::U8,
        "BoolStorage" => DType::Bool,
        other => {
            return Err(tensor_err(format!(
                "storage type torch.{} is not supported",
                short(other)
            )))
        }
    })
}

/// A torch dtype global (`torch.float32`) as a [`DType`].
pub fn torch_dtype(v: &Value) -> Option<std::result::Result<DType, String>> {
    let (module, name) = v.as_global()?;
    if module != "torch" {
        return None;
    }
    Some(
        name.parse::<DType>()
            .map_err(|_| format!("dtype torch.{} is not supported", short(name))),
    )
}

fn non_negative(v: &Value, what: &str) -> Result<u64> {
    v.as_int()
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| tensor_err(format!("tensor {what} is not a non-negative int")))
}

fn dims(v: &Value, what: &str) -> Result<Vec<u64>> {
    v.as_int_tuple()
        .and_then(|t| t.into_iter().map(|i| u64::try_from(i).ok()).collect())
        .ok_or_else(|| tensor_err(format!("tensor {what} is not a tuple of non-negative ints")))
}

/// Interpret a tensor rebuild call found anywhere in `data.pkl` of the archive in `bytes`;
/// `None` when `value` is not one.
pub(crate) fn tensor_of(
    value: &Value,
    archive: &Archive,
    bytes: &[u8],
) -> Result<Option<TensorItem>> {
    let mut call = value;
    if call.is_object("torch._utils", "_rebuild_parameter")
        || call.is_object("torch._utils", "_rebuild_parameter_with_state")
    {
        match call.args().and_then(|a| a.first()) {
            Some(inner) => call = inner,
            None => return Ok(None),
        }
    }
    let v3 = call.is_object("torch._utils", "_rebuild_tensor_v3");
    if !v3 && !call.is_object("torch._utils", "_rebuild_tensor_v2") {
        return Ok(None);
    }
    let args = call.args().unwrap_or_default();
    let need = if v3 { 7 } else { 6 };
    if args.len() < need {
        return Err(tensor_err(format!(
            "tensor rebuild call has {} arguments, expected at least {need}",
            args.len()
        )));
    }
    let pid = args[0]
        .as_persistent_id()
        .and_then(Value::as_list)
        .ok_or_else(|| tensor_err("tensor storage is not a persistent id tuple"))?;
    if pid.len() < 5 || pid[0].as_str() != Some("storage") {
        return Err(tensor_err(
            "tensor storage id is not ('storage', class, key, location, numel)",
        ));
    }
    let (class_module, class_name) = pid[1]
        .as_global()
        .ok_or_else(|| tensor_err("tensor storage class is not a global"))?;
    let typed = match (class_module, class_name) {
        ("torch.storage", "UntypedStorage") => None,
        ("torch", name) => Some(storage_dtype(name)?),
        (m, n) => {
            return Err(tensor_err(format!(
                "storage type {}.{} is not supported",
                short(m),
                short(n)
            )))
        }
    };
    let dtype = if v3 {
        let d = torch_dtype(&args[6])
            .ok_or_else(|| tensor_err("tensor dtype argument is not a torch dtype"))?
            .map_err(tensor_err)?;
        if typed.is_some_and(|t| t != d) {
            return Err(tensor_err(format!(
                "tensor dtype {d} disagrees with its storage type torch.{class_name}"
            )));
        }
        d
    } else {
        typed.ok_or_else(|| tensor_err("untyped storage without a dtype argument"))?
    };
    let key = match &pid[2] {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => return Err(tensor_err("tensor storage key is not a str")),
    };
    let numel = non_negative(&pid[4], "storage size")?;
    let elem = dtype.size() as u64;
    let storage_bytes = if typed.is_some() {
        numel.checked_mul(elem)
    } else {
        Some(numel)
    }
    .ok_or_else(|| tensor_err("tensor storage size overflows"))?;
    let storage_offset = non_negative(&args[1], "storage offset")?;
    let shape = dims(&args[2], "size")?;
    let strides = dims(&args[3], "stride")?;
    if shape.len() != strides.len() {
        return Err(tensor_err(format!(
            "tensor has {} dims but {} strides",
            shape.len(),
            strides.len()
        )));
    }
    let record_name = format!("{}/data/{key}", archive.prefix);
    let record = archive.record(bytes, &record_name)?;
    if storage_bytes > record.len {
        return Err(tensor_err(format!(
            "storage `{}` has {storage_bytes} bytes but its record holds {}",
            short(&key),
            record.len
        )));
    }
    let start = storage_offset
        .checked_mul(elem)
        .filter(|&s| s <= storage_bytes)
        .ok_or_else(|| {
            tensor_err(format!(
                "tensor storage offset {storage_offset} lies past its {storage_bytes}-byte storage"
            ))
        })?;
    let span =
        extent(&shape, &strides, elem).ok_or_else(|| tensor_err("tensor extent overflows"))?;
    if start.checked_add(span).is_none_or(|e| e > storage_bytes) {
        return Err(tensor_err(format!(
            "tensor {shape:?} with strides {strides:?} at offset {storage_offset} overruns its {storage_bytes}-byte storage"
        )));
    }
    Ok(Some(TensorItem {
        dtype,
        shape,
        strides,
        storage_offset,
        storage_key: key,
        record,
    }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fixture(case: &str, file: &str) -> Vec<u8> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(case)
            .join("checkpoint")
            .join(file);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// `model.cls` chunk 0 of fsdp2_w4_f32 (torch 2.15): offset 0, length 1577.
    fn item_215() -> Vec<u8> {
        fixture("fsdp2_w4_f32", "__0_0.distcp")[..1577].to_vec()
    }

    /// A stored zip of `records`, laid out like torch's writer (data descriptors, zip64
    /// end records); with `zip64` the directory and EOCD fields are saturated.
    pub(crate) fn build_zip(records: &[(&str, &[u8])], zip64: bool, method: u16) -> Vec<u8> {
        let mut out = vec![];
        let mut cd = vec![];
        for (name, data) in records {
            let lho = out.len() as u64;
            let crc = crc32fast::hash(data);
            // local header with the FB padding extra making the data 64-byte aligned
            let base = 30 + name.len() + 4;
            let pad = (64 - base % 64) % 64;
            out.extend_from_slice(&LOCAL_SIG.to_le_bytes());
            out.extend_from_slice(&[0, 0, 8, 8]);
            out.extend_from_slice(&method.to_le_bytes());
            out.extend_from_slice(&[0; 16]);
            out.extend_from_slice(&(name.len() as u16).to_le_bytes());
            out.extend_from_slice(&((4 + pad) as u16).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&0x4246u16.to_le_bytes());
            out.extend_from_slice(&(pad as u16).to_le_bytes());
            out.extend(std::iter::repeat_n(b'Z', pad));
            out.extend_from_slice(data);
            out.extend_from_slice(&0x0807_4b50u32.to_le_bytes());
            out.extend_from_slice(&crc.to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            out.extend_from_slice(&(data.len() as u32).to_le_bytes());
            cd.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
            cd.extend_from_slice(&[0x1e, 3, 0x2d, 0, 8, 8]);
            cd.extend_from_slice(&method.to_le_bytes());
            cd.extend_from_slice(&[0; 4]);
            cd.extend_from_slice(&crc.to_le_bytes());
            let mut extra = vec![];
            if zip64 {
                cd.extend_from_slice(&u32::MAX.to_le_bytes());
                cd.extend_from_slice(&u32::MAX.to_le_bytes());
                extra.extend_from_slice(&1u16.to_le_bytes());
                extra.extend_from_slice(&24u16.to_le_bytes());
                extra.extend_from_slice(&(data.len() as u64).to_le_bytes());
                extra.extend_from_slice(&(data.len() as u64).to_le_bytes());
                extra.extend_from_slice(&lho.to_le_bytes());
            } else {
                cd.extend_from_slice(&(data.len() as u32).to_le_bytes());
                cd.extend_from_slice(&(data.len() as u32).to_le_bytes());
            }
            cd.extend_from_slice(&(name.len() as u16).to_le_bytes());
            cd.extend_from_slice(&(extra.len() as u16).to_le_bytes());
            cd.extend_from_slice(&[0; 10]);
            if zip64 {
                cd.extend_from_slice(&u32::MAX.to_le_bytes());
            } else {
                cd.extend_from_slice(&(lho as u32).to_le_bytes());
            }
            cd.extend_from_slice(name.as_bytes());
            cd.extend_from_slice(&extra);
        }
        let cd_off = out.len() as u64;
        out.extend_from_slice(&cd);
        let z = out.len() as u64;
        let n = records.len() as u64;
        out.extend_from_slice(&ZIP64_EOCD_SIG.to_le_bytes());
        out.extend_from_slice(&44u64.to_le_bytes());
        out.extend_from_slice(&[0x1e, 3, 0x2d, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(cd.len() as u64).to_le_bytes());
        out.extend_from_slice(&cd_off.to_le_bytes());
        out.extend_from_slice(&ZIP64_LOCATOR_SIG.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&z.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&EOCD_SIG.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        if zip64 {
            out.extend_from_slice(&[0xFF; 4]);
            out.extend_from_slice(&[0xFF; 8]);
        } else {
            out.extend_from_slice(&(n as u16).to_le_bytes());
            out.extend_from_slice(&(n as u16).to_le_bytes());
            out.extend_from_slice(&(cd.len() as u32).to_le_bytes());
            out.extend_from_slice(&(cd_off as u32).to_le_bytes());
        }
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }

    fn tuple(items: &[u64]) -> Vec<u8> {
        let mut b = vec![b'('];
        for &i in items {
            b.push(b'J');
            b.extend_from_slice(&(i as i32).to_le_bytes());
        }
        b.push(b't');
        b
    }

    fn unicode(s: &str) -> Vec<u8> {
        let mut b = vec![b'X'];
        b.extend_from_slice(&(s.len() as u32).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
        b
    }

    /// A protocol-2 `data.pkl` of `_rebuild_tensor_v2` over a `torch.<class>` storage.
    pub(crate) fn tensor_pickle(
        class: &str,
        numel: u64,
        offset: u64,
        size: &[u64],
        stride: &[u64],
    ) -> Vec<u8> {
        let mut b = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((".to_vec();
        b.extend(unicode("storage"));
        b.extend(format!("ctorch\n{class}\n").bytes());
        b.extend(unicode("0"));
        b.extend(unicode("cpu"));
        b.push(b'J');
        b.extend_from_slice(&(numel as i32).to_le_bytes());
        b.extend_from_slice(b"tQJ");
        b.extend_from_slice(&(offset as i32).to_le_bytes());
        b.extend(tuple(size));
        b.extend(tuple(stride));
        b.extend_from_slice(b"\x89ccollections\nOrderedDict\n)RtR.");
        b
    }

    fn tensor_zip(pkl: &[u8], data: &[u8], zip64: bool) -> Vec<u8> {
        build_zip(
            &[
                ("archive/data.pkl", pkl),
                ("archive/byteorder", b"little"),
                ("archive/data/0", data),
                ("archive/version", b"3\n"),
            ],
            zip64,
            0,
        )
    }

    #[test]
    fn reads_a_real_torch_215_tensor_item() {
        let item = item_215();
        let it = parse(&item).unwrap();
        assert_eq!(it.archive.prefix, "archive");
        assert_eq!(it.archive.entries.len(), 7);
        let t = it.tensor.unwrap();
        assert_eq!(t.dtype, DType::F32);
        assert_eq!(t.shape, vec![1, 12]);
        assert_eq!(t.strides, vec![12, 1]);
        assert_eq!(t.storage_offset, 0);
        assert_eq!(t.storage_key, "0");
        assert_eq!(
            t.record,
            Record {
                offset: 704,
                len: 48
            }
        );
        assert_eq!(t.data_offset(), 704);
        assert!(t.is_row_major());
        assert_eq!(t.span_bytes(), 48);
    }

    #[test]
    fn reads_a_real_torch_21_tensor_item() {
        // fabric_fsdp1_w4_f32_torch21: `model.cls` chunk at file offset 1440, length 1180.
        let file = fixture("fabric_fsdp1_w4_f32_torch21", "__0_0.distcp");
        let it = parse(&file[1440..1440 + 1180]).unwrap();
        let t = it.tensor.unwrap();
        assert_eq!(t.dtype, DType::F32);
        assert_eq!(t.record.offset, 448);
        assert_eq!(it.archive.entries.len(), 5);
    }

    #[test]
    fn reads_a_real_bytes_item() {
        // fsdp2_w4_f32_threads2 `extra.note` = "fixture": __1_0.distcp offset 0, length 1261.
        let file = fixture("fsdp2_w4_f32_threads2", "__1_0.distcp");
        let it = parse(&file[..1261]).unwrap();
        assert!(it.tensor.is_none());
        assert_eq!(it.value, Value::Str("fixture".into()));
    }

    #[test]
    fn reads_zip64_directories_and_strided_tensors() {
        let data: Vec<u8> = (0..24u8).collect();
        let pkl = tensor_pickle("FloatStorage", 6, 0, &[3, 2], &[1, 3]);
        for zip64 in [false, true] {
            let z = tensor_zip(&pkl, &data, zip64);
            let t = parse(&z).unwrap().tensor.unwrap();
            assert_eq!(t.shape, vec![3, 2]);
            assert_eq!(t.strides, vec![1, 3]);
            assert!(!t.is_row_major());
            assert_eq!(&z[t.data_offset() as usize..][..24], &data[..]);
        }
        // an offset view: element 1 onwards of a 4-element storage
        let pkl = tensor_pickle("IntStorage", 4, 1, &[3], &[1]);
        let z = tensor_zip(&pkl, &[0u8; 16], false);
        let t = parse(&z).unwrap().tensor.unwrap();
        assert_eq!(t.data_offset(), t.record.offset + 4);
        assert_eq!(t.dtype, DType::I32);
    }

    #[test]
    fn refuses_extents_past_the_record() {
        let pkl = tensor_pickle("FloatStorage", 6, 1, &[3, 2], &[2, 1]);
        let z = tensor_zip(&pkl, &[0u8; 24], false);
        let e = parse(&z).unwrap_err().to_string();
        assert!(e.contains("overruns its 24-byte storage"), "{e}");
        let pkl = tensor_pickle("FloatStorage", 8, 0, &[2], &[1]);
        let z = tensor_zip(&pkl, &[0u8; 24], false);
        let e = parse(&z).unwrap_err().to_string();
        assert_eq!(e, "storage `0` has 32 bytes but its record holds 24");
        let pkl = tensor_pickle("ComplexFloatStorage", 1, 0, &[1], &[1]);
        let z = tensor_zip(&pkl, &[0u8; 8], false);
        let e = parse(&z).unwrap_err().to_string();
        assert_eq!(e, "storage type torch.ComplexFloatStorage is not supported");
    }

    #[test]
    fn names_what_is_wrong_with_the_container() {
        let e = parse(b"not a zip at all, no end record").unwrap_err();
        assert_eq!(e.to_string(), "end of central directory not found");
        let z = build_zip(&[("archive/data.pkl", b"\x80\x02K\x01.")], false, 8);
        assert_eq!(
            parse(&z).unwrap_err().to_string(),
            "zip record `archive/data.pkl` is compressed (method 8)"
        );
        let z = build_zip(&[("archive/version", b"3\n")], false, 0);
        assert_eq!(
            parse(&z).unwrap_err().to_string(),
            "zip has no record `archive/data.pkl`"
        );
        let mut item = item_215();
        item[0] = b'X';
        assert_eq!(
            parse(&item).unwrap_err().to_string(),
            "zip record `archive/data.pkl`: no local header signature at 0"
        );
        let mut item = item_215();
        item[30] = b'A'; // first byte of the local name
        assert!(parse(&item)
            .unwrap_err()
            .to_string()
            .contains("its local header names `Archive/data.pkl`"));
        let mut item = item_215();
        item[64] ^= 0xff; // first byte of data.pkl: the CRC catches it
        assert!(parse(&item).unwrap_err().to_string().contains("CRC-32"));
        let item = item_215();
        assert_eq!(
            parse(&item[..item.len() - 1]).unwrap_err().to_string(),
            "end of central directory not found"
        );
    }

    #[test]
    fn decodes_non_tensor_archives_with_any_prefix() {
        let z = build_zip(
            &[(
                "meta/data.pkl",
                b"\x80\x02}q\x00X\x04\x00\x00\x00stepq\x01K\x01s.",
            )],
            false,
            0,
        );
        let it = parse(&z).unwrap();
        assert_eq!(it.archive.prefix, "meta");
        assert!(it.tensor.is_none());
        assert_eq!(it.value.get("step"), Some(&Value::Int(1)));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any mutation of a real item is parsed or refused, never a panic, and a parsed
        /// tensor's bytes always lie inside the slice.
        #[test]
        fn mutated_items_never_panic(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
            cut in proptest::option::of(any::<prop::sample::Index>()),
            tail in any::<bool>(),
        ) {
            let mut item = item_215();
            let n = item.len();
            for (i, b) in flips {
                // bias half of the edits towards the directory and end records
                let at = if tail { n - 1 - i.index(400) } else { i.index(n) };
                item[at] = b;
            }
            if let Some(c) = cut {
                item.truncate(c.index(n));
            }
            if let Ok(it) = parse(&item) {
                if let Some(t) = it.tensor {
                    prop_assert!(t.data_offset() + t.span_bytes() <= item.len() as u64);
                }
            }
        }
    }
}
