//! Writing `torch.save` archives that `torch.load(path, weights_only=True)` accepts
//! (`docs/pytorch-formats.md` §3.2–3.4, §8.1, §8.3).
//!
//! Two halves:
//!
//! * **The pickle** ([`pickle`]): a [`PyValue`] tree written as a protocol-2 pickle using only
//!   the opcodes the weights-only unpickler of torch 2.1 … 2.15 accepts: `GLOBAL` (never
//!   `STACK_GLOBAL`), `BINUNICODE` (never `SHORT_BINUNICODE`), no `FRAME`/`MEMOIZE`/memo at
//!   all, `BINFLOAT` big-endian, `bytes` as `_codecs.encode(str, 'latin1')` as torch itself
//!   writes them. Tensors are `torch._utils._rebuild_tensor_v2` calls on a legacy
//!   `torch.<X>Storage` (numel in elements), or `_rebuild_tensor_v3` on a
//!   `torch.storage.UntypedStorage` (numel in bytes) plus a dtype for the dtypes without a
//!   legacy storage class (uint16/32/64, float8). They are contiguous, row-major, with storage
//!   offset 0, `requires_grad=False` and empty `OrderedDict()` backward hooks.
//!   [`from_pickle`] turns a value decoded by the project's pickle reader back into a
//!   [`PyValue`], so non-tensor checkpoint entries (DCP `BYTE_IO` items, `meta.pt`) can be
//!   re-emitted.
//!
//! * **The zip archive** ([`layout_archive`], [`archive_bytes`], [`crc_offsets`]): laid out
//!   exactly like torch's own writer (miniz), before any tensor data exists, so an executor
//!   can write the data records in place. Every record is stored (method 0); local headers
//!   carry flags `0x0808` (data descriptor + UTF-8) and crc/sizes 0; a `0x4246` ("FB") extra
//!   block filled with `'Z'` pads every record so its data starts at a multiple of 64 bytes
//!   *relative to the archive start*; a data descriptor follows each record's data (empty
//!   records have flags `0x0800` and no descriptor, like miniz writes them); the
//!   central directory holds the real CRC-32s; the zip64 end-of-central-directory record and
//!   locator are always written before the classic one. Records of 4 GiB or more, and records
//!   whose local header lies at 4 GiB or more, get zip64 extras (local header: `0x0001` block
//!   with usize/csize and/or the header offset, before the FB block, sizes left 0; 24-byte
//!   data descriptor; central directory: standard zip64 extra for the saturated fields).
//!
//! A caller that streams tensor data writes [`archive_bytes`] with a CRC of 0 for the data
//! records, writes the data at [`ArchiveLayout::data_offsets`], then patches the 4-byte CRC
//! fields at [`crc_offsets`] (or calls [`fill_crcs`], which reads the data back and does it).
//! [`output_parts`] packages the literals and those CRC patches for the executor
//! ([`crate::exec::OutputFile::literals`] and [`crate::exec::OutputFile::checksums`]).
//! torch's reader skips CRC checks, so an archive with CRC 0 already loads; standard zip tools
//! need the real values.

use crate::formats::pickle::Value;
use crate::layout::DType;
use std::fmt::Write as _;

// ---------------------------------------------------------------------------------------------
// Value model

/// A Python value to pickle.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An int.
    Int(i64),
    /// An int that does not fit `i64`: little-endian two's complement (at most 255 bytes, the
    /// limit of `LONG1`; longer values need `LONG4`, which the weights-only unpickler rejects).
    BigInt(Vec<u8>),
    /// A float.
    Float(f64),
    /// A str.
    Str(String),
    /// `bytes`, written as `_codecs.encode(latin1_str, 'latin1')` like torch. Loads in torch
    /// 2.15, not in torch 2.1 (see [`validate_torch21`]).
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<PyValue>),
    /// A tuple.
    Tuple(Vec<PyValue>),
    /// A plain `dict`, in insertion order. Keys must be hashable (no list/dict/set).
    Dict(Vec<(PyValue, PyValue)>),
    /// A `collections.OrderedDict` (what `state_dict()` returns).
    OrderedDict(Vec<(PyValue, PyValue)>),
    /// A `set` (`builtins.set([...])`; torch 2.15, not 2.1).
    Set(Vec<PyValue>),
    /// A `complex` (`builtins.complex(re, im)`; torch 2.15, not 2.1).
    Complex(f64, f64),
    /// A `torch.device` (`torch.device('cuda', 0)`; torch 2.15, not 2.1).
    Device {
        /// Device type: `cpu`, `cuda`, `meta`, …
        kind: String,
        /// Device index, if any.
        index: Option<i64>,
    },
    /// A tensor whose storage is record `data/<key>` of the archive.
    Tensor(TensorRef),
    /// An object made the protocol-2 way, `module.name.__new__()` (NEWOBJ) then `BUILD` with
    /// `state` — dataclasses such as DCP's `Metadata`. For pickles read by the full unpickler
    /// (`.metadata`); [`validate`] refuses it.
    Object {
        /// Module of the class.
        module: String,
        /// Class name.
        name: String,
        /// `BUILD` state (a dict, or a tuple for classes with `__setstate__`).
        state: Option<Box<PyValue>>,
    },
    /// A call `module.name(*args)` (REDUCE), e.g. `torch.Size((3, 4))`. Full unpickler only.
    Call {
        /// Module of the callable.
        module: String,
        /// Its name.
        name: String,
        /// Positional arguments.
        args: Vec<PyValue>,
    },
    /// A bare allow-listed global: only `torch.<dtype>` with the dtype's canonical name
    /// (`torch.float32`, not the alias `torch.float`), see [`is_allowed_global`]. torch 2.1
    /// accepts only float16/32/64, int8/16/32/64 and complex32/64/128.
    Global {
        /// Module (`torch`).
        module: String,
        /// Name (`float32`).
        name: String,
    },
}

impl PyValue {
    /// An object `module.name` built with `state` ([`PyValue::Object`]).
    pub fn object(module: &str, name: &str, state: Option<PyValue>) -> PyValue {
        PyValue::Object {
            module: module.into(),
            name: name.into(),
            state: state.map(Box::new),
        }
    }

    /// A call `module.name(*args)` ([`PyValue::Call`]).
    pub fn call(module: &str, name: &str, args: Vec<PyValue>) -> PyValue {
        PyValue::Call {
            module: module.into(),
            name: name.into(),
            args,
        }
    }

    /// `torch.Size(dims)`.
    pub fn torch_size(dims: &[u64]) -> PyValue {
        PyValue::call(
            "torch",
            "Size",
            vec![PyValue::Tuple(
                dims.iter().map(|&x| PyValue::Int(x as i64)).collect(),
            )],
        )
    }

    /// A dict with str keys, in the given order.
    pub fn str_dict(items: Vec<(&str, PyValue)>) -> PyValue {
        PyValue::Dict(
            items
                .into_iter()
                .map(|(k, v)| (PyValue::Str(k.into()), v))
                .collect(),
        )
    }
}

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
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of its storage record.
    pub fn storage_bytes(&self) -> u64 {
        self.storage_numel.saturating_mul(self.dtype.size() as u64)
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

/// The torch name of a dtype (`float32`, `float8_e4m3fn`, …).
pub fn torch_dtype_name(d: DType) -> &'static str {
    match d {
        DType::Bool => "bool",
        DType::U8 => "uint8",
        DType::I8 => "int8",
        DType::F8E4M3 => "float8_e4m3fn",
        DType::F8E5M2 => "float8_e5m2",
        DType::I16 => "int16",
        DType::U16 => "uint16",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I32 => "int32",
        DType::U32 => "uint32",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::I64 => "int64",
        DType::U64 => "uint64",
    }
}

/// The legacy typed storage class `torch.<X>Storage` of a dtype, if it has one. Dtypes without
/// one (uint16/32/64, float8) are written with `_rebuild_tensor_v3`, which torch ≥ 2.3 reads.
pub fn legacy_storage(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F32 => "FloatStorage",
        DType::F64 => "DoubleStorage",
        DType::F16 => "HalfStorage",
        DType::BF16 => "BFloat16Storage",
        DType::I64 => "LongStorage",
        DType::I32 => "IntStorage",
        DType::I16 => "ShortStorage",
        DType::I8 => "CharStorage",
        DType::U8 => "ByteStorage",
        DType::Bool => "BoolStorage",
        DType::U16 | DType::U32 | DType::U64 | DType::F8E4M3 | DType::F8E5M2 => return None,
    })
}

/// Canonical torch dtype names (`str(dtype)` without `torch.`) that torch 2.15's weights-only
/// unpickler accepts as globals and the project's reader knows.
const CANONICAL_DTYPES: &[&str] = &[
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex32",
    "complex64",
    "complex128",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "int8",
    "int16",
    "int32",
    "int64",
    "bool",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
];

/// Whether `module.name` may be emitted as a bare [`PyValue::Global`]: a torch dtype under its
/// canonical name.
pub fn is_allowed_global(module: &str, name: &str) -> bool {
    module == "torch" && CANONICAL_DTYPES.contains(&name)
}

/// The dtype globals torch 2.1's weights-only unpickler accepts.
const TORCH21_DTYPES: &[&str] = &[
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "complex32",
    "complex64",
    "complex128",
];

/// [`validate`], plus what torch 2.1's weights-only unpickler needs (verified against torch
/// 2.1.2): no `bytes`, `set`, `complex` or `torch.device`, dtype globals among
/// float16/32/64, int8/16/32/64, complex32/64/128 only, and tensors of dtypes with a legacy
/// storage class (no uint16/32/64 or float8, which need `_rebuild_tensor_v3`).
pub fn validate_torch21(v: &PyValue) -> Result<(), String> {
    validate(v)?;
    check21(v)
}

fn check21(v: &PyValue) -> Result<(), String> {
    let not = |what: &str| {
        Err(format!(
            "torch 2.1 cannot load {what} with weights_only=True"
        ))
    };
    match v {
        PyValue::Bytes(_) | PyValue::Set(_) | PyValue::Complex(..) | PyValue::Device { .. } => {
            not(kind(v))
        }
        PyValue::Global { name, .. } if !TORCH21_DTYPES.contains(&name.as_str()) => {
            not(&format!("the global torch.{name}"))
        }
        PyValue::Tensor(t) if legacy_storage(t.dtype).is_none() => {
            not(&format!("{} tensors", torch_dtype_name(t.dtype)))
        }
        PyValue::List(items) | PyValue::Tuple(items) => items.iter().try_for_each(check21),
        PyValue::Dict(pairs) | PyValue::OrderedDict(pairs) => pairs
            .iter()
            .try_for_each(|(k, x)| check21(k).and_then(|_| check21(x))),
        _ => Ok(()),
    }
}

/// Deepest nesting [`validate`] accepts (the project's reader stops at 1000 levels).
pub const MAX_DEPTH: usize = 500;

/// Check that `v` pickles to something `torch.load(weights_only=True)` (and the project's own
/// reader) accepts: allow-listed globals only, ints within `LONG1`, strings within
/// `BINUNICODE`, hashable dict keys and set elements, storages large enough for their
/// tensors, storage keys without `/` or newlines, bounded nesting. (Which torch versions
/// accept which values is in the docs of [`PyValue`]'s variants.)
pub fn validate(v: &PyValue) -> Result<(), String> {
    check(v, 0)
}

fn check(v: &PyValue, depth: usize) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("value nests deeper than {MAX_DEPTH} levels"));
    }
    match v {
        PyValue::None | PyValue::Bool(_) | PyValue::Int(_) | PyValue::Float(_) => Ok(()),
        PyValue::Complex(..) => Ok(()),
        PyValue::Object { module, name, .. } | PyValue::Call { module, name, .. } => Err(format!(
            "`{module}.{name}` objects do not load with torch.load(weights_only=True)"
        )),
        // BINUNICODE lengths are 32-bit (BINUNICODE8 is not weights-only safe).
        PyValue::Str(text) => fits_binunicode(text.len() as u64),
        PyValue::Bytes(b) => {
            fits_binunicode(b.len() as u64 + b.iter().filter(|&&c| c >= 0x80).count() as u64)
        }
        PyValue::BigInt(b) => {
            if b.len() > 255 {
                Err(format!(
                    "int of {} bytes is too long for LONG1 (255 bytes)",
                    b.len()
                ))
            } else {
                Ok(())
            }
        }
        PyValue::List(items) | PyValue::Tuple(items) => {
            items.iter().try_for_each(|x| check(x, depth + 1))
        }
        PyValue::Set(items) => items.iter().try_for_each(|x| {
            if !hashable(x) {
                return Err(format!("unhashable set element ({})", kind(x)));
            }
            check(x, depth + 1)
        }),
        PyValue::Dict(pairs) | PyValue::OrderedDict(pairs) => {
            pairs.iter().try_for_each(|(k, x)| {
                if !hashable(k) {
                    return Err(format!("unhashable dict key ({})", kind(k)));
                }
                check(k, depth + 1)?;
                check(x, depth + 1)
            })
        }
        PyValue::Device { kind, .. } => {
            if kind.is_empty() {
                Err("empty device type".into())
            } else {
                Ok(())
            }
        }
        PyValue::Global { module, name } => {
            if is_allowed_global(module, name) {
                Ok(())
            } else {
                Err(format!(
                    "global `{module}.{name}` is not allowed (only torch dtypes)"
                ))
            }
        }
        PyValue::Tensor(t) => {
            if t.key.is_empty() || t.key.contains(['\n', '/']) {
                return Err(format!("bad storage key {:?}", t.key));
            }
            let numel = t
                .shape
                .iter()
                .try_fold(1u64, |a, &n| a.checked_mul(n))
                .ok_or("tensor element count overflows")?;
            if numel > t.storage_numel {
                return Err(format!(
                    "tensor of {numel} elements on a storage of {} elements",
                    t.storage_numel
                ));
            }
            t.storage_numel
                .checked_mul(t.dtype.size() as u64)
                .ok_or("storage byte count overflows")?;
            Ok(())
        }
    }
}

fn fits_binunicode(utf8_len: u64) -> Result<(), String> {
    if utf8_len > u32::MAX as u64 {
        Err(format!(
            "string of {utf8_len} bytes is too long for BINUNICODE"
        ))
    } else {
        Ok(())
    }
}

fn kind(v: &PyValue) -> &'static str {
    match v {
        PyValue::None => "None",
        PyValue::Bool(_) => "bool",
        PyValue::Int(_) | PyValue::BigInt(_) => "int",
        PyValue::Float(_) => "float",
        PyValue::Str(_) => "str",
        PyValue::Bytes(_) => "bytes",
        PyValue::List(_) => "list",
        PyValue::Tuple(_) => "tuple",
        PyValue::Dict(_) => "dict",
        PyValue::OrderedDict(_) => "OrderedDict",
        PyValue::Set(_) => "set",
        PyValue::Complex(..) => "complex",
        PyValue::Device { .. } => "torch.device",
        PyValue::Tensor(_) => "tensor",
        PyValue::Global { .. } => "global",
        PyValue::Object { .. } => "object",
        PyValue::Call { .. } => "call",
    }
}

fn hashable(v: &PyValue) -> bool {
    match v {
        PyValue::List(_) | PyValue::Dict(_) | PyValue::OrderedDict(_) | PyValue::Set(_) => false,
        PyValue::Tuple(items) => items.iter().all(hashable),
        _ => true,
    }
}

// ---------------------------------------------------------------------------------------------
// Pickle writer

mod op {
    pub const PROTO: u8 = 0x80;
    pub const STOP: u8 = b'.';
    pub const MARK: u8 = b'(';
    pub const NONE: u8 = b'N';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINFLOAT: u8 = b'G';
    pub const BINUNICODE: u8 = b'X';
    pub const GLOBAL: u8 = b'c';
    pub const REDUCE: u8 = b'R';
    pub const BINPERSID: u8 = b'Q';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const TUPLE: u8 = b't';
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const EMPTY_LIST: u8 = b']';
    pub const APPENDS: u8 = b'e';
    pub const EMPTY_DICT: u8 = b'}';
    pub const SETITEMS: u8 = b'u';
}

/// Items per `APPENDS`/`SETITEMS` batch, as Python's pickler.
const BATCH: usize = 1000;

/// Pickle `v` (protocol 2, weights-only-safe opcodes, see the module docs). Values that fail
/// [`validate`] are still written (an over-long [`PyValue::BigInt`] as `LONG4`), but torch
/// will not load them; use [`pickle_checked`] to refuse them instead.
pub fn pickle(v: &PyValue) -> Vec<u8> {
    let mut w = Vec::with_capacity(256);
    w.extend_from_slice(&[op::PROTO, 2]);
    write_value(&mut w, v);
    w.push(op::STOP);
    w
}

/// [`validate`] then [`pickle`].
pub fn pickle_checked(v: &PyValue) -> Result<Vec<u8>, String> {
    validate(v)?;
    Ok(pickle(v))
}

fn write_global(w: &mut Vec<u8>, module: &str, name: &str) {
    w.push(op::GLOBAL);
    w.extend_from_slice(module.as_bytes());
    w.push(b'\n');
    w.extend_from_slice(name.as_bytes());
    w.push(b'\n');
}

fn write_str(w: &mut Vec<u8>, s: &str) {
    w.push(op::BINUNICODE);
    w.extend_from_slice(&(s.len() as u32).to_le_bytes());
    w.extend_from_slice(s.as_bytes());
}

/// Minimal little-endian two's complement of `x` (Python's `pickle.encode_long`).
fn encode_long(x: i64) -> Vec<u8> {
    let mut b = x.to_le_bytes().to_vec();
    while b.len() > 1 {
        let last = b[b.len() - 1];
        let prev_sign = b[b.len() - 2] & 0x80 != 0;
        if (last == 0 && !prev_sign) || (last == 0xff && prev_sign) {
            b.pop();
        } else {
            break;
        }
    }
    if x == 0 {
        b.clear();
    }
    b
}

fn write_long_bytes(w: &mut Vec<u8>, b: &[u8]) {
    if b.len() <= 255 {
        w.push(op::LONG1);
        w.push(b.len() as u8);
    } else {
        w.push(op::LONG4);
        w.extend_from_slice(&(b.len() as u32).to_le_bytes());
    }
    w.extend_from_slice(b);
}

fn write_int(w: &mut Vec<u8>, x: i64) {
    if (0..=0xff).contains(&x) {
        w.push(op::BININT1);
        w.push(x as u8);
    } else if (0..=0xffff).contains(&x) {
        w.push(op::BININT2);
        w.extend_from_slice(&(x as u16).to_le_bytes());
    } else if let Ok(i) = i32::try_from(x) {
        w.push(op::BININT);
        w.extend_from_slice(&i.to_le_bytes());
    } else {
        write_long_bytes(w, &encode_long(x));
    }
}

fn write_u64(w: &mut Vec<u8>, x: u64) {
    match i64::try_from(x) {
        Ok(i) => write_int(w, i),
        Err(_) => {
            // 9 bytes: the value and a 0 sign byte.
            let mut b = x.to_le_bytes().to_vec();
            b.push(0);
            write_long_bytes(w, &b);
        }
    }
}

fn write_float(w: &mut Vec<u8>, f: f64) {
    w.push(op::BINFLOAT);
    w.extend_from_slice(&f.to_be_bytes());
}

/// Tuple of already-known length: items written by `each`.
fn write_tuple_with(w: &mut Vec<u8>, n: usize, mut each: impl FnMut(&mut Vec<u8>, usize)) {
    match n {
        0 => w.push(op::EMPTY_TUPLE),
        1..=3 => {
            for i in 0..n {
                each(w, i);
            }
            w.push([op::TUPLE1, op::TUPLE2, op::TUPLE3][n - 1]);
        }
        _ => {
            w.push(op::MARK);
            for i in 0..n {
                each(w, i);
            }
            w.push(op::TUPLE);
        }
    }
}

fn write_u64_tuple(w: &mut Vec<u8>, xs: &[u64]) {
    write_tuple_with(w, xs.len(), |w, i| write_u64(w, xs[i]));
}

fn write_appends(w: &mut Vec<u8>, items: &[PyValue]) {
    for batch in items.chunks(BATCH) {
        w.push(op::MARK);
        for x in batch {
            write_value(w, x);
        }
        w.push(op::APPENDS);
    }
}

fn write_setitems(w: &mut Vec<u8>, pairs: &[(PyValue, PyValue)]) {
    for batch in pairs.chunks(BATCH) {
        w.push(op::MARK);
        for (k, x) in batch {
            write_value(w, k);
            write_value(w, x);
        }
        w.push(op::SETITEMS);
    }
}

fn write_value(w: &mut Vec<u8>, v: &PyValue) {
    match v {
        PyValue::None => w.push(op::NONE),
        PyValue::Bool(b) => w.push(if *b { op::NEWTRUE } else { op::NEWFALSE }),
        PyValue::Int(i) => write_int(w, *i),
        PyValue::BigInt(b) => write_long_bytes(w, b),
        PyValue::Float(f) => write_float(w, *f),
        PyValue::Str(s) => write_str(w, s),
        PyValue::Bytes(b) => {
            // bytes → _codecs.encode(<the bytes as latin-1 text>, 'latin1'), as Python's
            // protocol-2 pickler writes them.
            write_global(w, "_codecs", "encode");
            let text: String = b.iter().map(|&c| c as char).collect();
            write_str(w, &text);
            write_str(w, "latin1");
            w.push(op::TUPLE2);
            w.push(op::REDUCE);
        }
        PyValue::List(items) => {
            w.push(op::EMPTY_LIST);
            write_appends(w, items);
        }
        PyValue::Tuple(items) => write_tuple_with(w, items.len(), |w, i| write_value(w, &items[i])),
        PyValue::Dict(pairs) => {
            w.push(op::EMPTY_DICT);
            write_setitems(w, pairs);
        }
        PyValue::OrderedDict(pairs) => {
            write_global(w, "collections", "OrderedDict");
            w.push(op::EMPTY_TUPLE);
            w.push(op::REDUCE);
            write_setitems(w, pairs);
        }
        PyValue::Set(items) => {
            // set.__reduce__ in protocol < 4: set([items])
            write_global(w, "builtins", "set");
            w.push(op::EMPTY_LIST);
            write_appends(w, items);
            w.push(op::TUPLE1);
            w.push(op::REDUCE);
        }
        PyValue::Complex(re, im) => {
            write_global(w, "builtins", "complex");
            write_float(w, *re);
            write_float(w, *im);
            w.push(op::TUPLE2);
            w.push(op::REDUCE);
        }
        PyValue::Device { kind, index } => {
            write_global(w, "torch", "device");
            write_str(w, kind);
            match index {
                Some(i) => {
                    write_int(w, *i);
                    w.push(op::TUPLE2);
                }
                None => w.push(op::TUPLE1),
            }
            w.push(op::REDUCE);
        }
        PyValue::Global { module, name } => write_global(w, module, name),
        PyValue::Object {
            module,
            name,
            state,
        } => {
            write_global(w, module, name);
            w.push(op::EMPTY_TUPLE);
            w.push(0x81); // NEWOBJ
            if let Some(s) = state {
                write_value(w, s);
                w.push(b'b'); // BUILD
            }
        }
        PyValue::Call { module, name, args } => {
            write_global(w, module, name);
            write_tuple_with(w, args.len(), |w, i| write_value(w, &args[i]));
            w.push(op::REDUCE);
        }
        PyValue::Tensor(t) => write_tensor(w, t),
    }
}

fn write_tensor(w: &mut Vec<u8>, t: &TensorRef) {
    let legacy = legacy_storage(t.dtype);
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
        write_global(w, "torch", torch_dtype_name(t.dtype));
    }
    w.push(op::TUPLE);
    w.push(op::REDUCE);
}

/// Convert a value decoded by [`crate::formats::pickle::parse`] (with
/// [`crate::formats::pickle::torch_save_globals`]) into a [`PyValue`] that re-emits it:
/// None, bools, ints, floats, str, bytes, lists, tuples, dicts (an `OrderedDict` decodes to a
/// dict and comes back as a plain [`PyValue::Dict`]), sets, `complex`, `torch.device`,
/// `torch.Size` (as a tuple) and canonical torch dtype globals. `None` for anything else
/// (tensors, whose storages live in another archive; arbitrary objects; over-long ints).
pub fn from_pickle(v: &Value) -> Option<PyValue> {
    let all = |items: &[Value]| items.iter().map(from_pickle).collect::<Option<Vec<_>>>();
    Some(match v {
        Value::None => PyValue::None,
        Value::Bool(b) => PyValue::Bool(*b),
        Value::Int(i) => PyValue::Int(*i),
        Value::BigInt(b) if b.len() <= 255 => PyValue::BigInt(b.clone()),
        Value::Float(f) => PyValue::Float(*f),
        Value::Str(s) => PyValue::Str(s.clone()),
        Value::Bytes(b) => PyValue::Bytes(b.clone()),
        Value::List(items) => PyValue::List(all(items)?),
        Value::Tuple(items) => PyValue::Tuple(all(items)?),
        Value::Set(items) => {
            let items = all(items)?;
            if !items.iter().all(hashable) {
                return None;
            }
            PyValue::Set(items)
        }
        Value::Dict(pairs) => PyValue::Dict(
            pairs
                .iter()
                .map(|(k, x)| {
                    let k = from_pickle(k).filter(hashable)?;
                    Some((k, from_pickle(x)?))
                })
                .collect::<Option<Vec<_>>>()?,
        ),
        Value::Global { module, name } if is_allowed_global(module, name) => PyValue::Global {
            module: module.clone(),
            name: name.clone(),
        },
        Value::Object {
            module,
            name,
            args,
            state: None,
        } => match (module.as_str(), name.as_str(), args.as_slice()) {
            ("torch", "Size", _) => PyValue::Tuple(
                v.as_int_tuple()?
                    .into_iter()
                    .map(PyValue::Int)
                    .collect::<Vec<_>>(),
            ),
            ("builtins", "complex", []) => PyValue::Complex(0.0, 0.0),
            ("builtins", "complex", [re]) => PyValue::Complex(re.as_f64()?, 0.0),
            ("builtins", "complex", [re, im]) => PyValue::Complex(re.as_f64()?, im.as_f64()?),
            ("torch", "device", [Value::Str(kind)]) => PyValue::Device {
                kind: kind.clone(),
                index: None,
            },
            ("torch", "device", [Value::Str(kind), index]) => PyValue::Device {
                kind: kind.clone(),
                index: match index {
                    Value::None => None,
                    other => Some(other.as_int()?),
                },
            },
            _ => return None,
        },
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------------
// Zip archive

/// Data alignment of every record, relative to the archive start (torch's
/// `.storage_alignment`).
pub const ALIGNMENT: u64 = 64;

const LOCAL_SIG: u32 = 0x0403_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const LOCAL_LEN: u64 = 30;
const CENTRAL_LEN: u64 = 46;
const ZIP64_EOCD_LEN: u64 = 56;
const ZIP64_LOCATOR_LEN: u64 = 20;
const EOCD_LEN: u64 = 22;
/// Values at or above this do not fit a 32-bit zip field (torch/miniz use `>=`).
const U32_LIMIT: u64 = 0xFFFF_FFFF;
/// General-purpose flags: bit 3 (data descriptor) and bit 11 (UTF-8 names).
const FLAGS: u16 = 0x0808;
/// Flags of an empty record: UTF-8 names only, no data descriptor (as miniz writes them).
const FLAGS_EMPTY: u16 = 0x0800;
/// "Version needed to extract" for zip64 entries (4.5).
const ZIP64_VERSION: u16 = 45;

/// One record of an archive to write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Name without the archive prefix: `data.pkl`, `data/0`, `version`, `byteorder`,
    /// `.format_version`, `.storage_alignment`, `.data/serialization_id`.
    pub name: String,
    /// Data length in bytes.
    pub len: u64,
    /// The data, for literal records (`len` must equal its length); `None` for records whose
    /// data a caller writes at [`ArchiveLayout::data_offsets`] (tensor storages).
    pub content: Option<Vec<u8>>,
}

impl Record {
    /// A record with literal content.
    pub fn literal(name: impl Into<String>, content: impl Into<Vec<u8>>) -> Record {
        let content = content.into();
        Record {
            name: name.into(),
            len: content.len() as u64,
            content: Some(content),
        }
    }

    /// A record of `len` bytes whose data is written by the caller.
    pub fn data(name: impl Into<String>, len: u64) -> Record {
        Record {
            name: name.into(),
            len,
            content: None,
        }
    }
}

/// Where one record's pieces lie in the archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryLayout {
    /// Full record name (`<prefix>/<name>`).
    pub name: String,
    /// Data length.
    pub len: u64,
    /// Offset of the local header.
    pub header_offset: u64,
    /// Length of the local header's extra field (zip64 block + FB padding block).
    pub extra_len: u16,
    /// Offset of the first data byte (a multiple of [`ALIGNMENT`]).
    pub data_offset: u64,
    /// Offset of the data descriptor (right after the data). Empty records have none: torch
    /// (miniz) writes them with flags `0x0800` and no descriptor, so the next local header
    /// starts here.
    pub descriptor_offset: u64,
    /// Offset of the record's central-directory entry.
    pub central_offset: u64,
    /// The size does not fit 32 bits: zip64 sizes.
    pub zip64_size: bool,
    /// The local header offset does not fit 32 bits: zip64 offset.
    pub zip64_offset: bool,
}

impl EntryLayout {
    fn zip64(&self) -> bool {
        self.zip64_size || self.zip64_offset
    }

    /// Bytes of the data descriptor: none for an empty record (miniz writes empty records
    /// without the descriptor bit), 24 with zip64, else 16.
    fn descriptor_len(&self) -> u64 {
        if self.len == 0 {
            0
        } else if self.zip64() {
            24
        } else {
            16
        }
    }

    /// General-purpose flags: UTF-8 names, plus "data descriptor follows" unless empty.
    fn flags(&self) -> u16 {
        if self.len == 0 {
            FLAGS_EMPTY
        } else {
            FLAGS
        }
    }

    /// Length of the zip64 block in the central directory's extra field (0 when none).
    fn central_extra_len(&self) -> u64 {
        let n = 16 * self.zip64_size as u64 + 8 * self.zip64_offset as u64;
        if n == 0 {
            0
        } else {
            4 + n
        }
    }
}

/// The byte layout of an archive, computed from the records' names and lengths only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArchiveLayout {
    /// Total archive bytes.
    pub len: u64,
    /// Per record (indexed like the records), offset of its data relative to the archive
    /// start; always a multiple of [`ALIGNMENT`].
    pub data_offsets: Vec<u64>,
    /// The archive prefix (`archive`).
    pub prefix: String,
    /// Per record, where its headers lie.
    pub entries: Vec<EntryLayout>,
    /// Offset of the central directory.
    pub cd_offset: u64,
    /// Bytes of the central directory.
    pub cd_size: u64,
    /// Offset of the zip64 end-of-central-directory record (locator and classic EOCD follow).
    pub zip64_eocd_offset: u64,
}

/// Lay out an archive holding `records` (in that order) under `prefix`, the way torch's
/// writer does (module docs). Only names and lengths are used.
///
/// # Panics
/// If `prefix` is empty or contains `/`, if a literal record's `len` differs from its
/// content's length, or if a full record name exceeds 65535 bytes.
pub fn layout_archive(prefix: &str, records: &[Record]) -> ArchiveLayout {
    assert!(
        !prefix.is_empty() && !prefix.contains('/'),
        "archive prefix {prefix:?} must be a non-empty name without `/`"
    );
    let mut entries = Vec::with_capacity(records.len());
    let mut pos = 0u64;
    for r in records {
        if let Some(c) = &r.content {
            assert_eq!(
                c.len() as u64,
                r.len,
                "record `{}`: len differs from the content length",
                r.name
            );
        }
        let name = format!("{prefix}/{}", r.name);
        assert!(name.len() <= 0xFFFF, "record name too long: {}", name.len());
        let zip64_size = r.len >= U32_LIMIT;
        let zip64_offset = pos >= U32_LIMIT;
        let zip64_local = if zip64_size || zip64_offset {
            4 + 16 * zip64_size as u64 + 8 * zip64_offset as u64
        } else {
            0
        };
        // Data would start here with an FB block of 0 padding bytes.
        let start = pos + LOCAL_LEN + name.len() as u64 + zip64_local + 4;
        let pad = (ALIGNMENT - start % ALIGNMENT) % ALIGNMENT;
        let data_offset = start + pad;
        let e = EntryLayout {
            name,
            len: r.len,
            header_offset: pos,
            extra_len: (zip64_local + 4 + pad) as u16,
            data_offset,
            descriptor_offset: data_offset + r.len,
            central_offset: 0,
            zip64_size,
            zip64_offset,
        };
        pos = e.descriptor_offset + e.descriptor_len();
        entries.push(e);
    }
    let cd_offset = pos;
    for e in &mut entries {
        e.central_offset = pos;
        pos += CENTRAL_LEN + e.name.len() as u64 + e.central_extra_len();
    }
    let cd_size = pos - cd_offset;
    let zip64_eocd_offset = pos;
    let len = pos + ZIP64_EOCD_LEN + ZIP64_LOCATOR_LEN + EOCD_LEN;
    ArchiveLayout {
        len,
        data_offsets: entries.iter().map(|e| e.data_offset).collect(),
        prefix: prefix.to_string(),
        entries,
        cd_offset,
        cd_size,
        zip64_eocd_offset,
    }
}

fn put16(w: &mut Vec<u8>, x: u16) {
    w.extend_from_slice(&x.to_le_bytes());
}

fn put32(w: &mut Vec<u8>, x: u32) {
    w.extend_from_slice(&x.to_le_bytes());
}

fn put64(w: &mut Vec<u8>, x: u64) {
    w.extend_from_slice(&x.to_le_bytes());
}

/// A 32-bit zip field: the value, or `0xFFFFFFFF` when it lives in a zip64 extra.
fn field32(x: u64, zip64: bool) -> u32 {
    if zip64 {
        u32::MAX
    } else {
        x as u32
    }
}

fn local_header(w: &mut Vec<u8>, e: &EntryLayout) {
    put32(w, LOCAL_SIG);
    put16(w, if e.zip64() { ZIP64_VERSION } else { 0 });
    put16(w, e.flags());
    put16(w, 0); // method: stored
    put16(w, 0); // time
    put16(w, 0); // date
    put32(w, 0); // crc (in the descriptor)
    put32(w, 0); // compressed size
    put32(w, 0); // uncompressed size
    put16(w, e.name.len() as u16);
    put16(w, e.extra_len);
    w.extend_from_slice(e.name.as_bytes());
    let mut extra_used = 0u64;
    if e.zip64() {
        // As torch: usize/csize when the size is large, then the local header offset when
        // the offset is large.
        let n = 16 * e.zip64_size as u16 + 8 * e.zip64_offset as u16;
        put16(w, 0x0001);
        put16(w, n);
        if e.zip64_size {
            put64(w, e.len);
            put64(w, e.len);
        }
        if e.zip64_offset {
            put64(w, e.header_offset);
        }
        extra_used = 4 + n as u64;
    }
    let pad = e.extra_len as u64 - extra_used - 4;
    put16(w, 0x4246); // "FB"
    put16(w, pad as u16);
    w.resize(w.len() + pad as usize, b'Z');
}

fn descriptor(w: &mut Vec<u8>, e: &EntryLayout, crc: u32) {
    put32(w, DESCRIPTOR_SIG);
    put32(w, crc);
    if e.zip64() {
        put64(w, e.len);
        put64(w, e.len);
    } else {
        put32(w, e.len as u32);
        put32(w, e.len as u32);
    }
}

fn central_entry(w: &mut Vec<u8>, e: &EntryLayout, crc: u32) {
    let version = if e.zip64() { ZIP64_VERSION } else { 0 };
    put32(w, CENTRAL_SIG);
    put16(w, version); // made by
    put16(w, version); // needed
    put16(w, e.flags());
    put16(w, 0); // method
    put16(w, 0); // time
    put16(w, 0); // date
    put32(w, crc);
    put32(w, field32(e.len, e.zip64_size));
    put32(w, field32(e.len, e.zip64_size));
    put16(w, e.name.len() as u16);
    put16(w, e.central_extra_len() as u16);
    put16(w, 0); // comment
    put16(w, 0); // disk
    put16(w, 0); // internal attributes
    put32(w, 0); // external attributes
    put32(w, field32(e.header_offset, e.zip64_offset));
    w.extend_from_slice(e.name.as_bytes());
    if e.central_extra_len() > 0 {
        put16(w, 0x0001);
        put16(w, (e.central_extra_len() - 4) as u16);
        if e.zip64_size {
            put64(w, e.len);
            put64(w, e.len);
        }
        if e.zip64_offset {
            put64(w, e.header_offset);
        }
    }
}

fn end_records(w: &mut Vec<u8>, layout: &ArchiveLayout) {
    let count = layout.entries.len() as u64;
    // zip64 end of central directory
    put32(w, ZIP64_EOCD_SIG);
    put64(w, ZIP64_EOCD_LEN - 12);
    put16(w, 0x031e); // made by (as torch)
    put16(w, ZIP64_VERSION); // needed
    put32(w, 0); // this disk
    put32(w, 0); // disk with the central directory
    put64(w, count);
    put64(w, count);
    put64(w, layout.cd_size);
    put64(w, layout.cd_offset);
    // zip64 locator
    put32(w, ZIP64_LOCATOR_SIG);
    put32(w, 0);
    put64(w, layout.zip64_eocd_offset);
    put32(w, 1); // total disks
                 // classic end of central directory
    put32(w, EOCD_SIG);
    put16(w, 0);
    put16(w, 0);
    let count16 = count.min(0xFFFF) as u16;
    put16(w, count16);
    put16(w, count16);
    put32(w, field32(layout.cd_size, layout.cd_size >= U32_LIMIT));
    put32(w, field32(layout.cd_offset, layout.cd_offset >= U32_LIMIT));
    put16(w, 0); // comment
}

fn check_records(layout: &ArchiveLayout, records: &[Record]) {
    assert_eq!(
        layout.entries.len(),
        records.len(),
        "records differ from the layout's"
    );
    for (e, r) in layout.entries.iter().zip(records) {
        assert!(
            e.len == r.len && e.name.ends_with(&r.name),
            "record `{}` differs from the layout's `{}`",
            r.name,
            e.name
        );
    }
}

/// The CRC-32 of record `i` as written: computed for literal records, `crcs[i]` (0 when
/// missing) for data records.
fn record_crc(records: &[Record], crcs: &[u32], i: usize) -> u32 {
    match &records[i].content {
        Some(c) => crc32fast::hash(c),
        None => crcs.get(i).copied().unwrap_or(0),
    }
}

/// Every byte of the archive except the data of records with `content: None`, as
/// `(offset, bytes)` pieces relative to the archive start, sorted and non-adjacent (contiguous
/// pieces are merged). `crcs` holds the CRC-32 of the data records, indexed like `records`
/// (entries of literal records are ignored; missing entries count as 0). Never materializes
/// data records, whatever their size.
///
/// # Panics
/// If `records` are not the ones `layout` was computed from (count, names, lengths).
pub fn archive_bytes(
    layout: &ArchiveLayout,
    records: &[Record],
    crcs: &[u32],
) -> Vec<(u64, Vec<u8>)> {
    check_records(layout, records);
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut cur: Option<(u64, Vec<u8>)> = None;
    // Append bytes at `at` to the current piece (starting a new one after a gap).
    let mut emit = |at: u64, bytes: Vec<u8>, out: &mut Vec<(u64, Vec<u8>)>| match &mut cur {
        Some((start, buf)) if *start + buf.len() as u64 == at => buf.extend_from_slice(&bytes),
        _ => {
            if let Some(done) = cur.replace((at, bytes)) {
                out.push(done);
            }
        }
    };
    for (i, (e, r)) in layout.entries.iter().zip(records).enumerate() {
        let crc = record_crc(records, crcs, i);
        let mut head = Vec::with_capacity((e.data_offset - e.header_offset) as usize);
        local_header(&mut head, e);
        debug_assert_eq!(e.header_offset + head.len() as u64, e.data_offset);
        emit(e.header_offset, head, &mut out);
        if let Some(c) = &r.content {
            emit(e.data_offset, c.clone(), &mut out);
        }
        if e.descriptor_len() > 0 {
            let mut d = Vec::with_capacity(24);
            descriptor(&mut d, e, crc);
            emit(e.descriptor_offset, d, &mut out);
        }
    }
    let mut tail = Vec::with_capacity((layout.len - layout.cd_offset) as usize);
    for (i, e) in layout.entries.iter().enumerate() {
        debug_assert_eq!(layout.cd_offset + tail.len() as u64, e.central_offset);
        central_entry(&mut tail, e, record_crc(records, crcs, i));
    }
    end_records(&mut tail, layout);
    debug_assert_eq!(layout.cd_offset + tail.len() as u64, layout.len);
    emit(layout.cd_offset, tail, &mut out);
    if let Some(done) = cur.take() {
        out.push(done);
    }
    out
}

/// Offsets (relative to the archive start) of the 4-byte little-endian CRC-32 fields of record
/// `i`: in its data descriptor and in its central-directory entry (only the latter for an
/// empty record, which has no descriptor and whose CRC is 0).
pub fn crc_offsets(layout: &ArchiveLayout, i: usize) -> Vec<u64> {
    let e = &layout.entries[i];
    let mut at = Vec::with_capacity(2);
    if e.descriptor_len() > 0 {
        at.push(e.descriptor_offset + 4);
    }
    at.push(e.central_offset + 16);
    at
}

/// The executor's view of an archive placed at byte `base` of an output file
/// ([`crate::exec::OutputFile`]): its literal bytes (with CRC 0 for the data records), and one
/// [`crate::exec::Checksum`] per non-empty data record, which the executor computes over the
/// finished data and writes at the record's [`crc_offsets`]. The caller adds copy ops that
/// fill each data record `i` at `base + layout.data_offsets[i]`.
pub fn output_parts(
    layout: &ArchiveLayout,
    records: &[Record],
    base: u64,
) -> (Vec<(u64, Vec<u8>)>, Vec<crate::exec::Checksum>) {
    let literals = archive_bytes(layout, records, &[])
        .into_iter()
        .map(|(at, bytes)| (base + at, bytes))
        .collect();
    let checksums = records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.content.is_none() && r.len > 0)
        .map(|(i, r)| crate::exec::Checksum {
            range: (
                base + layout.data_offsets[i],
                base + layout.data_offsets[i] + r.len,
            ),
            at: crc_offsets(layout, i)
                .into_iter()
                .map(|o| base + o)
                .collect(),
            hex: false,
        })
        .collect();
    (literals, checksums)
}

/// For an archive written at byte `base` of `file` with CRC 0 for its data records: read each
/// data record back, compute its CRC-32 and patch it in at [`crc_offsets`]. Returns the CRCs
/// of all records (literal ones computed from their content).
pub fn fill_crcs(
    file: &std::fs::File,
    base: u64,
    layout: &ArchiveLayout,
    records: &[Record],
) -> std::io::Result<Vec<u32>> {
    use std::os::unix::fs::FileExt;
    check_records(layout, records);
    let mut buf = vec![0u8; 1 << 20];
    let mut crcs = Vec::with_capacity(records.len());
    for (i, (e, r)) in layout.entries.iter().zip(records).enumerate() {
        let crc = match &r.content {
            Some(c) => crc32fast::hash(c),
            None => {
                let mut h = crc32fast::Hasher::new();
                let mut done = 0u64;
                while done < e.len {
                    let n = (e.len - done).min(buf.len() as u64) as usize;
                    file.read_exact_at(&mut buf[..n], base + e.data_offset + done)?;
                    h.update(&buf[..n]);
                    done += n as u64;
                }
                let crc = h.finalize();
                for at in crc_offsets(layout, i) {
                    file.write_all_at(&crc.to_le_bytes(), base + at)?;
                }
                crc
            }
        };
        crcs.push(crc);
    }
    Ok(crcs)
}

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

/// The records torch 2.15 writes, in its order: `data.pkl`, `.format_version` (`1`),
/// `.storage_alignment` (`64`), `byteorder` (`little`), `data/<key>` per storage (data
/// records of the given byte lengths, in the given order), `version` (`3\n`),
/// `.data/serialization_id` (40 digits derived from the content).
pub fn standard_records(pickle_bytes: Vec<u8>, storages: &[(String, u64)]) -> Vec<Record> {
    let mut seed = 0xcbf2_9ce4_8422_2325u64;
    fnv1a(&mut seed, &pickle_bytes);
    for (key, len) in storages {
        fnv1a(&mut seed, key.as_bytes());
        fnv1a(&mut seed, &len.to_le_bytes());
    }
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
    let records = standard_records(pickle(v), &sizes);
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

/// A JSON value as Python (null → None, numbers → int or float, arrays → lists, objects →
/// dicts): for non-tensor values known only as JSON.
pub fn from_json(v: &serde_json::Value) -> PyValue {
    match v {
        serde_json::Value::Null => PyValue::None,
        serde_json::Value::Bool(b) => PyValue::Bool(*b),
        serde_json::Value::Number(n) => n
            .as_i64()
            .map_or(PyValue::Float(n.as_f64().unwrap_or(f64::NAN)), PyValue::Int),
        serde_json::Value::String(s) => PyValue::Str(s.clone()),
        serde_json::Value::Array(a) => PyValue::List(a.iter().map(from_json).collect()),
        serde_json::Value::Object(m) => PyValue::Dict(
            m.iter()
                .map(|(k, v)| (PyValue::Str(k.clone()), from_json(v)))
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::pickle::{parse, torch_save_globals};

    #[test]
    fn ints_use_the_smallest_opcode() {
        let p = |i| pickle(&PyValue::Int(i));
        assert_eq!(p(1), b"\x80\x02K\x01.");
        assert_eq!(p(300), b"\x80\x02M\x2c\x01.");
        assert_eq!(p(-1), b"\x80\x02J\xff\xff\xff\xff.");
        assert_eq!(p(1 << 31), b"\x80\x02\x8a\x05\x00\x00\x00\x80\x00.");
        assert_eq!(p(-(1 << 31) - 1), b"\x80\x02\x8a\x05\xff\xff\xff\x7f\xff.");
        assert_eq!(p(i64::MIN), b"\x80\x02\x8a\x08\0\0\0\0\0\0\0\x80.");
        for i in [0, 255, 256, 65535, 65536, -5, 1 << 40, i64::MAX, i64::MIN] {
            let v = parse(&p(i), &torch_save_globals()).unwrap();
            assert_eq!(v, Value::Int(i));
        }
        let mut w = vec![];
        write_u64(&mut w, u64::MAX);
        assert_eq!(w, b"\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00");
    }

    #[test]
    fn float_is_big_endian() {
        assert_eq!(
            pickle(&PyValue::Float(0.005)),
            [&b"\x80\x02G"[..], &0.005f64.to_be_bytes(), b"."].concat()
        );
    }

    #[test]
    fn tensor_pickle_matches_torch() {
        // §3.3: fsdp2_w4_f32 model.cls chunk 0, without the BINPUTs.
        let t = PyValue::Tensor(TensorRef::new("0", DType::F32, vec![1, 12]));
        let want: &[u8] = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x0ctQK\x00K\x01K\x0c\x86K\x0cK\x01\x86\x89ccollections\nOrderedDict\n)RtR.";
        assert_eq!(pickle(&t), want);
        let v = parse(&pickle(&t), &torch_save_globals()).unwrap();
        assert!(v.is_object("torch._utils", "_rebuild_tensor_v2"));
    }

    #[test]
    fn v3_tensor_counts_bytes() {
        let t = PyValue::Tensor(TensorRef::new("3", DType::U16, vec![2, 3]));
        let v = parse(&pickle(&t), &torch_save_globals()).unwrap();
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
    fn validate_refuses_unsafe_values() {
        assert!(validate(&PyValue::Global {
            module: "os".into(),
            name: "system".into()
        })
        .is_err());
        assert!(validate(&PyValue::Global {
            module: "torch".into(),
            name: "float".into()
        })
        .is_err());
        assert!(validate(&PyValue::BigInt(vec![1; 256])).is_err());
        assert!(validate(&PyValue::Dict(vec![(PyValue::List(vec![]), PyValue::None)])).is_err());
        let mut t = TensorRef::new("0", DType::F32, vec![4]);
        t.storage_numel = 3;
        assert!(validate(&PyValue::Tensor(t)).is_err());
        assert!(validate(&PyValue::Tensor(TensorRef::new(
            "0",
            DType::F32,
            vec![0, 4]
        )))
        .is_ok());
    }

    #[test]
    fn layout_matches_torch_offsets() {
        // §3.2: fsdp2_w4_f32 item model.cls chunk 0, 1577 bytes.
        let records = vec![
            Record::literal("data.pkl", vec![0; 154]),
            Record::literal(".format_version", b"1".to_vec()),
            Record::literal(".storage_alignment", b"64".to_vec()),
            Record::literal("byteorder", b"little".to_vec()),
            Record::data("data/0", 48),
            Record::literal("version", b"3\n".to_vec()),
            Record::literal(".data/serialization_id", vec![b'1'; 40]),
        ];
        let l = layout_archive("archive", &records);
        let headers: Vec<u64> = l.entries.iter().map(|e| e.header_offset).collect();
        assert_eq!(headers, [0, 234, 337, 466, 598, 768, 850]);
        assert_eq!(l.data_offsets, [64, 320, 448, 576, 704, 832, 960]);
        assert_eq!(l.len, 1577);
        assert_eq!(l.cd_offset, 0x3f8);
        assert_eq!(l.cd_size, 0x1cf);
    }

    #[test]
    fn serialization_id_is_40_digits() {
        let r = standard_records(vec![1, 2, 3], &[("0".into(), 8)]);
        let id = r.last().unwrap().content.clone().unwrap();
        assert_eq!(id.len(), 40);
        assert!(id.iter().all(u8::is_ascii_digit));
    }
}
