//! `torch.save` archives (`docs/pytorch-formats.md` §3.2–3.4, §8.1, §8.3): what their
//! `data.pkl` means and which records they hold, on top of the [`zip`](super::zip) container
//! and the [`pickle`](mod@super::pickle) reader and writer.
//!
//! # Tensors
//!
//! A tensor is pickled as a rebuild call: `torch._utils._rebuild_tensor_v2` on a legacy
//! `torch.<X>Storage` (numel in elements), or `_rebuild_tensor_v3` on a
//! `torch.storage.UntypedStorage` (numel in bytes) plus a dtype for the dtypes without a legacy
//! storage class (uint16/32/64, float8), optionally wrapped in `_rebuild_parameter`; the
//! storage is a `BINPERSID` reference `('storage', class, key, location, numel)` to record
//! `<prefix>/data/<key>`. [`write_tensor`] writes a [`TensorRef`] that way (contiguous,
//! row-major, storage offset 0, `requires_grad=False`, empty `OrderedDict()` backward hooks);
//! [`tensor_of`] reads any such call into a [`TensorItem`]: dtype, shape, element strides,
//! storage offset and where its storage record lies in the slice, with the strided extent
//! checked against the record so later reads cannot go out of bounds.
//!
//! # Archives
//!
//! [`parse`] reads a whole archive held in a byte slice (an item of a DCP `.distcp` file, or a
//! file such as Lightning's `meta.pt`): its directory, `<prefix>/data.pkl` decoded with the
//! `torch.save` allow-list, the byte order, and the tensor if `data.pkl` is one. Only the tail
//! of the archive (its central directory), the local headers of the records used, `data.pkl`
//! and `byteorder` are touched; tensor data never is. [`standard_records`] lists the records
//! torch 2.15 writes, in its order, and [`save_to_vec`] writes a small archive in memory.

use super::dtype;
use super::pickle::write::{write_global, write_int, write_str, write_u64, write_u64_tuple};
use super::pickle::{self, op, PyValue, Value};
use super::short;
use super::zip::{
    archive_bytes, layout_archive, zip_err, Archive, Record, RecordSpan, Result, TorchZipError,
    ALIGNMENT,
};
use crate::layout::DType;
use std::fmt::Write as _;

// ---------------------------------------------------------------------------------------------
// Writing tensors

/// A contiguous tensor stored in record `data/<key>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef {
    /// Storage key: the record is `<prefix>/data/<key>`; torch numbers them `"0"`, `"1"`, …
    /// in order of appearance. Several tensors may share a storage (same dtype).
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Shape (`[]` for a 0-d tensor).
    pub shape: Vec<u64>,
    /// Elements in the storage (the record holds `storage_numel · dtype.size()` bytes); at
    /// least the tensor's element count.
    pub storage_numel: u64,
}

impl TensorRef {
    /// A tensor that owns its storage exactly (`storage_numel` = element count).
    pub fn new(key: impl Into<String>, dtype: DType, shape: Vec<u64>) -> TensorRef {
        let numel = shape.iter().product();
        TensorRef {
            key: key.into(),
            dtype,
            shape,
            storage_numel: numel,
        }
    }

    /// Number of elements of the tensor.
    #[cfg(any(test, feature = "internals"))]
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of its storage record.
    pub fn storage_bytes(&self) -> u64 {
        self.storage_numel.saturating_mul(self.dtype.size() as u64)
    }

    /// The [`crate::torch::pickle::validate`] rules for a tensor: a storage key
    /// without `/` or newlines, a storage large enough for the tensor, sizes that fit `u64`.
    #[cfg(any(test, feature = "internals"))]
    pub fn check(&self) -> Result<(), String> {
        if self.key.is_empty() || self.key.contains(['\n', '/']) {
            return Err(format!("bad storage key {:?}", self.key));
        }
        let numel = self
            .shape
            .iter()
            .try_fold(1u64, |a, &n| a.checked_mul(n))
            .ok_or("tensor element count overflows")?;
        if numel > self.storage_numel {
            return Err(format!(
                "tensor of {numel} elements on a storage of {} elements",
                self.storage_numel
            ));
        }
        self.storage_numel
            .checked_mul(self.dtype.size() as u64)
            .ok_or("storage byte count overflows")?;
        Ok(())
    }
}

/// Element strides of a contiguous tensor as torch computes them: row-major, with dimensions
/// of size 0 counted as 1 (so `(0, 12)` has strides `(12, 1)`, `(3, 0)` has `(1, 1)`).
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1].max(1));
    }
    strides
}

/// Write `t` as torch does: `_rebuild_tensor_v2` on a legacy typed storage, or
/// `_rebuild_tensor_v3` on an `UntypedStorage` plus a dtype when the dtype has no legacy
/// storage class (module docs).
pub fn write_tensor(w: &mut Vec<u8>, t: &TensorRef) {
    let legacy = dtype::legacy_storage(t.dtype);
    write_global(
        w,
        "torch._utils",
        if legacy.is_some() {
            "_rebuild_tensor_v2"
        } else {
            "_rebuild_tensor_v3"
        },
    );
    w.push(op::MARK); // args
    {
        w.push(op::MARK); // persistent id
        write_str(w, "storage");
        match legacy {
            Some(class) => write_global(w, "torch", class),
            None => write_global(w, "torch.storage", "UntypedStorage"),
        }
        write_str(w, &t.key);
        write_str(w, "cpu");
        match legacy {
            Some(_) => write_u64(w, t.storage_numel),
            None => write_u64(w, t.storage_bytes()),
        }
        w.push(op::TUPLE);
        w.push(op::BINPERSID);
    }
    write_int(w, 0); // storage_offset
    write_u64_tuple(w, &t.shape);
    write_u64_tuple(w, &contiguous_strides(&t.shape));
    w.push(op::NEWFALSE); // requires_grad
    write_global(w, "collections", "OrderedDict"); // backward_hooks
    w.push(op::EMPTY_TUPLE);
    w.push(op::REDUCE);
    if legacy.is_none() {
        write_global(w, "torch", dtype::torch_dtype_name(t.dtype));
    }
    w.push(op::TUPLE);
    w.push(op::REDUCE);
}

// ---------------------------------------------------------------------------------------------
// Reading tensors and archives

fn tensor_err(msg: impl Into<String>) -> TorchZipError {
    TorchZipError::Tensor(msg.into())
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
    pub record: RecordSpan,
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
    #[cfg(any(test, feature = "internals"))]
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
    parse_with(bytes, globals())
}

/// [`parse`] with another allow-list of globals (the `torch.save` one plus a trainer's own
/// classes, e.g. DeepSpeed's loss scaler).
pub fn parse_with(bytes: &[u8], globals: &pickle::Globals) -> Result<Item> {
    let archive = Archive::parse(bytes)?;
    let pkl_name = format!("{}/data.pkl", archive.prefix);
    let pkl = archive.read_checked(bytes, &pkl_name)?;
    check_byte_order(&archive, bytes)?;
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
    dtype::by_storage(name)
        .and_then(|t| t.dtype)
        .ok_or_else(|| {
            tensor_err(format!(
                "storage type torch.{} is not supported",
                short(name)
            ))
        })
}

/// A torch dtype global (`torch.float32`) as a [`DType`].
pub fn torch_dtype(v: &Value) -> Option<std::result::Result<DType, String>> {
    let (module, name) = v.as_global()?;
    torch_dtype_named(module, name)
}

/// The global `module.name` as a [`DType`], when it names a torch dtype.
pub fn torch_dtype_named(module: &str, name: &str) -> Option<std::result::Result<DType, String>> {
    if module != "torch" {
        return None;
    }
    Some(
        dtype::by_name(name)
            .and_then(|t| t.dtype)
            .ok_or_else(|| format!("dtype torch.{} is not supported", short(name))),
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
pub fn tensor_of(value: &Value, archive: &Archive, bytes: &[u8]) -> Result<Option<TensorItem>> {
    match decode_tensor(value)? {
        Some(d) => d.locate(archive, bytes).map(Some),
        None => Ok(None),
    }
}

/// What a `data.pkl` alone says of the tensor it rebuilds: a function of its bytes only, so
/// it is decoded once for the many items of a checkpoint that share one (see
/// [`parse_tensor`]).
#[derive(Clone, Debug)]
struct Decoded {
    dtype: DType,
    shape: Vec<u64>,
    strides: Vec<u64>,
    storage_offset: u64,
    key: String,
    storage_bytes: u64,
}

impl Decoded {
    /// The tensor, with its storage record found in `archive` and its view checked to lie
    /// inside it.
    fn locate(self, archive: &Archive, bytes: &[u8]) -> Result<TensorItem> {
        let record = archive.record(bytes, &format!("{}/data/{}", archive.prefix, self.key))?;
        let t = TensorItem {
            dtype: self.dtype,
            shape: self.shape,
            strides: self.strides,
            storage_offset: self.storage_offset,
            storage_key: self.key,
            record,
        };
        check_view(&t, self.storage_bytes)?;
        Ok(t)
    }
}

/// The tensor rebuild call `value`, decoded; `None` when `value` is no such call.
fn decode_tensor(value: &Value) -> Result<Option<Decoded>> {
    let Some((args, v3)) = rebuild_call(value)? else {
        return Ok(None);
    };
    let pid = args[0]
        .as_persistent_id()
        .and_then(Value::as_list)
        .ok_or_else(|| tensor_err("tensor storage is not a persistent id tuple"))?;
    if pid.len() < 5 || pid[0].as_str() != Some("storage") {
        return Err(tensor_err(
            "tensor storage id is not ('storage', class, key, location, numel)",
        ));
    }
    let (typed, class_name) = storage_class(&pid[1])?;
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
    // A legacy typed storage counts elements, an untyped one bytes.
    let numel = non_negative(&pid[4], "storage size")?;
    let storage_bytes = if typed.is_some() {
        numel.checked_mul(dtype.size() as u64)
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
    Ok(Some(Decoded {
        dtype,
        shape,
        strides,
        storage_offset,
        key,
        storage_bytes,
    }))
}

/// A `torch.save` archive of (usually) one tensor, as [`parse_tensor`] gives it.
#[derive(Debug)]
pub struct TensorArchive {
    /// The archive's central directory.
    pub archive: Archive,
    /// The tensor, when `data.pkl` is a single tensor rebuild call.
    pub tensor: Option<TensorItem>,
    /// The kind of value `data.pkl` holds (for messages when it is not a tensor).
    pub kind: &'static str,
}

/// `data.pkl` bytes → what they decode to, per thread, for the items of a checkpoint that
/// share them (every chunk of one shape and dtype).
type DecodeCache = std::collections::HashMap<Box<[u8]>, (&'static str, Option<Decoded>)>;

/// Largest `data.pkl` kept in the decode cache, and most entries per thread.
const CACHE_PICKLE_BYTES: usize = 4096;
const CACHE_ENTRIES: usize = 1024;

/// Parse a `torch.save` archive for its tensor, as [`parse`] does (same checks and errors),
/// without keeping the decoded pickle: the `data.pkl` of a chunk item is the same for every
/// chunk of its shape and dtype, so it is decoded once per thread and reused.
pub fn parse_tensor(bytes: &[u8]) -> Result<TensorArchive> {
    thread_local! {
        static CACHE: std::cell::RefCell<DecodeCache> = Default::default();
    }
    let archive = Archive::parse(bytes)?;
    let pkl_name = format!("{}/data.pkl", archive.prefix);
    let pkl = archive.read_checked(bytes, &pkl_name)?;
    check_byte_order(&archive, bytes)?;
    let hit = CACHE.with(|c| c.borrow().get(pkl).cloned());
    let (kind, decoded) = match hit {
        Some(h) => h,
        None => {
            let value = pickle::parse(pkl, globals()).map_err(|source| TorchZipError::Pickle {
                record: short(&pkl_name),
                source,
            })?;
            let d = (value.kind(), decode_tensor(&value)?);
            if pkl.len() <= CACHE_PICKLE_BYTES {
                CACHE.with(|c| {
                    let mut c = c.borrow_mut();
                    if c.len() < CACHE_ENTRIES {
                        c.insert(pkl.into(), d.clone());
                    }
                });
            }
            d
        }
    };
    let tensor = match decoded {
        Some(d) => Some(d.locate(&archive, bytes)?),
        None => None,
    };
    Ok(TensorArchive {
        archive,
        tensor,
        kind,
    })
}

/// The allow-list of `torch.save` pickles, built once: a checkpoint has one archive per
/// item, often millions.
fn globals() -> &'static pickle::Globals {
    static GLOBALS: std::sync::OnceLock<pickle::Globals> = std::sync::OnceLock::new();
    GLOBALS.get_or_init(pickle::torch_save_globals)
}

/// Refuse an archive whose `byteorder` record says other than `little`.
fn check_byte_order(archive: &Archive, bytes: &[u8]) -> Result<()> {
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
    Ok(())
}

/// The arguments of the tensor rebuild call `value` (looking through `_rebuild_parameter`,
/// and through `_rebuild_from_type_v2` of a plain `torch.Tensor` or `Parameter`: a tensor
/// saved with Python attributes, such as DeepSpeed's `ds_id`, which are dropped), and whether
/// it is `_rebuild_tensor_v3`; `None` when `value` is no such call (tensor subclasses
/// included).
fn rebuild_call(value: &Value) -> Result<Option<(&[Value], bool)>> {
    let mut call = value;
    if call.is_object("torch._utils", "_rebuild_parameter")
        || call.is_object("torch._utils", "_rebuild_parameter_with_state")
    {
        match call.args().and_then(|a| a.first()) {
            Some(inner) => call = inner,
            None => return Ok(None),
        }
    }
    if call.is_object("torch._tensor", "_rebuild_from_type_v2") {
        // _rebuild_from_type_v2(func, new_type, args, state): func(*args) as new_type
        let Some([func, new_type, Value::Tuple(args), ..]) = call.args() else {
            return Ok(None);
        };
        let plain = new_type.is_global("torch", "Tensor")
            || new_type.is_global("torch.nn.parameter", "Parameter");
        let v3 = func.is_global("torch._utils", "_rebuild_tensor_v3");
        if !plain || !(v3 || func.is_global("torch._utils", "_rebuild_tensor_v2")) {
            return Ok(None);
        }
        return rebuild_args(args, v3).map(Some);
    }
    let v3 = call.is_object("torch._utils", "_rebuild_tensor_v3");
    if !v3 && !call.is_object("torch._utils", "_rebuild_tensor_v2") {
        return Ok(None);
    }
    rebuild_args(call.args().unwrap_or_default(), v3).map(Some)
}

/// The arguments of a `_rebuild_tensor_v2` (`v3`: `_rebuild_tensor_v3`) call, checked for
/// their number.
fn rebuild_args(args: &[Value], v3: bool) -> Result<(&[Value], bool)> {
    let need = if v3 { 7 } else { 6 };
    if args.len() < need {
        return Err(tensor_err(format!(
            "tensor rebuild call has {} arguments, expected at least {need}",
            args.len()
        )));
    }
    Ok((args, v3))
}

/// The storage class of a persistent id: the dtype of a legacy typed storage (`None` for
/// `torch.storage.UntypedStorage`), and the class name.
fn storage_class(class: &Value) -> Result<(Option<DType>, &str)> {
    let (module, name) = class
        .as_global()
        .ok_or_else(|| tensor_err("tensor storage class is not a global"))?;
    match (module, name) {
        ("torch.storage", "UntypedStorage") => Ok((None, name)),
        ("torch", name) => Ok((Some(storage_dtype(name)?), name)),
        (m, n) => Err(tensor_err(format!(
            "storage type {}.{} is not supported",
            short(m),
            short(n)
        ))),
    }
}

/// Check that the storage fits its record and the strided view of `t` fits its storage of
/// `storage_bytes` bytes, so reads of the tensor cannot go out of bounds.
fn check_view(t: &TensorItem, storage_bytes: u64) -> Result<()> {
    if storage_bytes > t.record.len {
        return Err(tensor_err(format!(
            "storage `{}` has {storage_bytes} bytes but its record holds {}",
            short(&t.storage_key),
            t.record.len
        )));
    }
    let (shape, strides, storage_offset) = (&t.shape, &t.strides, t.storage_offset);
    let elem = t.dtype.size() as u64;
    let start = storage_offset
        .checked_mul(elem)
        .filter(|&s| s <= storage_bytes)
        .ok_or_else(|| {
            tensor_err(format!(
                "tensor storage offset {storage_offset} lies past its {storage_bytes}-byte storage"
            ))
        })?;
    let span = extent(shape, strides, elem).ok_or_else(|| tensor_err("tensor extent overflows"))?;
    if start.checked_add(span).is_none_or(|e| e > storage_bytes) {
        return Err(tensor_err(format!(
            "tensor {shape:?} with strides {strides:?} at offset {storage_offset} overruns its {storage_bytes}-byte storage"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Writing archives

/// 40 decimal digits derived from `seed` (torch writes 40 random digits; a content-derived id
/// keeps outputs reproducible).
fn serialization_id(seed: u64) -> String {
    let mut s = String::with_capacity(40);
    let mut x = seed;
    while s.len() < 40 {
        // splitmix64
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let _ = write!(s, "{:010}", z % 10_000_000_000);
    }
    s.truncate(40);
    s
}

fn fnv1a(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x0100_0000_01b3);
    }
}

/// The seed of the `.data/serialization_id` reshard writes for an archive of `data.pkl`
/// `pickle_bytes` and `storages` (keys and byte lengths, in record order).
fn content_seed(pickle_bytes: &[u8], storages: &[(String, u64)]) -> u64 {
    let mut seed = 0xcbf2_9ce4_8422_2325u64;
    fnv1a(&mut seed, pickle_bytes);
    for (key, len) in storages {
        fnv1a(&mut seed, key.as_bytes());
        fnv1a(&mut seed, &len.to_le_bytes());
    }
    seed
}

/// Whether reshard wrote the archive in `bytes`: its `.data/serialization_id` is the one
/// [`standard_records`] derives from the archive's content, where torch writes 40 random
/// digits (a chance of 1 in 10^40 of matching).
pub fn written_by_reshard(archive: &Archive, bytes: &[u8]) -> bool {
    let p = &archive.prefix;
    let (Ok(id), Ok(pkl)) = (
        archive.read(bytes, &format!("{p}/.data/serialization_id")),
        archive.read(bytes, &format!("{p}/data.pkl")),
    ) else {
        return false;
    };
    let data = format!("{p}/data/");
    let storages: Vec<(String, u64)> = archive
        .entries
        .iter()
        .filter_map(|e| Some((e.name.strip_prefix(&data)?.to_string(), e.size)))
        .collect();
    id == serialization_id(content_seed(pkl, &storages)).as_bytes()
}

/// The records torch 2.15 writes, in its order: `data.pkl`, `.format_version` (`1`),
/// `.storage_alignment` (`64`), `byteorder` (`little`), `data/<key>` per storage (data
/// records of the given byte lengths, in the given order), `version` (`3\n`),
/// `.data/serialization_id` (40 digits derived from the content).
pub fn standard_records(pickle_bytes: Vec<u8>, storages: &[(String, u64)]) -> Vec<Record> {
    let seed = content_seed(&pickle_bytes, storages);
    let mut records = vec![
        Record::literal("data.pkl", pickle_bytes),
        Record::literal(".format_version", b"1".to_vec()),
        Record::literal(".storage_alignment", ALIGNMENT.to_string().into_bytes()),
        Record::literal("byteorder", b"little".to_vec()),
    ];
    for (key, len) in storages {
        records.push(Record::data(format!("data/{key}"), *len));
    }
    records.push(Record::literal("version", b"3\n".to_vec()));
    records.push(Record::literal(
        ".data/serialization_id",
        serialization_id(seed).into_bytes(),
    ));
    records
}

/// A whole archive in memory: `v` pickled, plus one `data/<key>` record per storage (raw
/// little-endian bytes). For small archives (non-tensor items, tests).
pub fn save_to_vec(prefix: &str, v: &PyValue, storages: &[(String, Vec<u8>)]) -> Vec<u8> {
    let sizes: Vec<(String, u64)> = storages
        .iter()
        .map(|(k, d)| (k.clone(), d.len() as u64))
        .collect();
    let records = standard_records(pickle::pickle(v), &sizes);
    let layout = layout_archive(prefix, &records);
    let mut crcs = vec![0u32; records.len()];
    let mut out = vec![0u8; layout.len as usize];
    let mut s = 0;
    for (i, r) in records.iter().enumerate() {
        if r.content.is_none() {
            let data = &storages[s].1;
            s += 1;
            crcs[i] = crc32fast::hash(data);
            let at = layout.data_offsets[i] as usize;
            out[at..at + data.len()].copy_from_slice(data);
        }
    }
    for (at, bytes) in archive_bytes(&layout, &records, &crcs) {
        let at = at as usize;
        out[at..at + bytes.len()].copy_from_slice(&bytes);
    }
    out
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch::pickle::{parse as parse_pickle, pickle, torch_save_globals};
    use crate::torch::zip::{
        write_padding, CentralHeader, DataDescriptor, EndOfCentralDirectory, LocalHeader,
        Zip64EndOfCentralDirectory, Zip64Extra, Zip64Locator,
    };
    use proptest::prelude::*;

    fn fixture(case: &str, file: &str) -> Vec<u8> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
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
    pub fn build_zip(records: &[(&str, &[u8])], zip64: bool, method: u16) -> Vec<u8> {
        let mut out = vec![];
        let mut cd = vec![];
        for (name, data) in records {
            let lho = out.len() as u64;
            let crc = crc32fast::hash(data);
            let len = data.len() as u64;
            // local header with the FB padding extra making the data 64-byte aligned
            let base = 30 + name.len() + 4;
            let pad = (64 - base % 64) % 64;
            LocalHeader {
                flags: 0x0808,
                method,
                name_len: name.len() as u16,
                extra_len: (4 + pad) as u16,
                ..LocalHeader::default()
            }
            .write(&mut out);
            out.extend_from_slice(name.as_bytes());
            write_padding(&mut out, pad as u16);
            out.extend_from_slice(data);
            DataDescriptor {
                crc32: crc,
                compressed_size: len,
                uncompressed_size: len,
                zip64: false,
            }
            .write(&mut out);
            let mut extra = vec![];
            if zip64 {
                Zip64Extra {
                    size: Some(len),
                    compressed_size: Some(len),
                    header_offset: Some(lho),
                }
                .write(&mut extra);
            }
            let field = |x: u64| if zip64 { u32::MAX } else { x as u32 };
            CentralHeader {
                version_made_by: 0x031e,
                version_needed: 45,
                flags: 0x0808,
                method,
                crc32: crc,
                compressed_size: field(len),
                uncompressed_size: field(len),
                name_len: name.len() as u16,
                extra_len: extra.len() as u16,
                header_offset: field(lho),
                ..CentralHeader::default()
            }
            .write(&mut cd);
            cd.extend_from_slice(name.as_bytes());
            cd.extend_from_slice(&extra);
        }
        let cd_off = out.len() as u64;
        out.extend_from_slice(&cd);
        let z = out.len() as u64;
        let n = records.len() as u64;
        Zip64EndOfCentralDirectory {
            record_size: 44,
            version_made_by: 0x031e,
            version_needed: 45,
            entries_on_disk: n,
            entries: n,
            cd_size: cd.len() as u64,
            cd_offset: cd_off,
            ..Zip64EndOfCentralDirectory::default()
        }
        .write(&mut out);
        Zip64Locator {
            eocd_disk: 0,
            eocd_offset: z,
            disks: 1,
        }
        .write(&mut out);
        let (n16, size32, off32) = if zip64 {
            (0xFFFF, u32::MAX, u32::MAX)
        } else {
            (n as u16, cd.len() as u32, cd_off as u32)
        };
        EndOfCentralDirectory {
            entries_on_disk: n16,
            entries: n16,
            cd_size: size32,
            cd_offset: off32,
            ..EndOfCentralDirectory::default()
        }
        .write(&mut out);
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
    pub fn tensor_pickle(
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
            RecordSpan {
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
        let pkl = tensor_pickle("QInt8Storage", 1, 0, &[1], &[1]);
        let z = tensor_zip(&pkl, &[0u8; 8], false);
        let e = parse(&z).unwrap_err().to_string();
        assert_eq!(e, "storage type torch.QInt8Storage is not supported");
    }

    #[test]
    fn names_what_is_wrong_with_the_container() {
        let e = parse(b"not a zip at all, no end record").unwrap_err();
        assert_eq!(
            e.to_string(),
            "is truncated or not a torch.save archive (no zip end record)"
        );
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
            "is truncated or not a torch.save archive (no zip end record)"
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

    #[test]
    fn tensor_pickle_matches_torch() {
        // §3.3: fsdp2_w4_f32 model.cls chunk 0, without the BINPUTs.
        let t = PyValue::Tensor(TensorRef::new("0", DType::F32, vec![1, 12]));
        let want: &[u8] = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQK\x00K\x01K\x0c\x86K\x0cK\x01\x86\x89ccollections\nOrderedDict\n)RtR.";
        assert_eq!(pickle(&t), want);
        let v = parse_pickle(&pickle(&t), &torch_save_globals()).unwrap();
        assert!(v.is_object("torch._utils", "_rebuild_tensor_v2"));
    }

    #[test]
    fn v3_tensor_counts_bytes() {
        let t = PyValue::Tensor(TensorRef::new("3", DType::U16, vec![2, 3]));
        let v = parse_pickle(&pickle(&t), &torch_save_globals()).unwrap();
        assert!(v.is_object("torch._utils", "_rebuild_tensor_v3"));
        let args = v.args().unwrap();
        let pid = args[0].as_persistent_id().unwrap().as_list().unwrap();
        assert!(pid[1].is_global("torch.storage", "UntypedStorage"));
        assert_eq!(pid[4], Value::Int(12));
        assert!(args[6].is_global("torch", "uint16"));
        assert_eq!(args[2].as_int_tuple(), Some(vec![2, 3]));
        assert_eq!(args[3].as_int_tuple(), Some(vec![3, 1]));
    }

    #[test]
    fn strides_follow_torch() {
        assert_eq!(contiguous_strides(&[]), Vec::<u64>::new());
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(contiguous_strides(&[0, 12]), vec![12, 1]);
        assert_eq!(contiguous_strides(&[3, 0]), vec![1, 1]);
    }

    #[test]
    fn serialization_id_is_40_digits() {
        let r = standard_records(vec![1, 2, 3], &[("0".into(), 8)]);
        let id = r.last().unwrap().content.clone().unwrap();
        assert_eq!(id.len(), 40);
        assert!(id.iter().all(u8::is_ascii_digit));
    }
}
