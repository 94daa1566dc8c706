//! The writer: a [`PyValue`] tree written as a protocol-2 pickle using only the opcodes the
//! weights-only unpickler of torch 2.1 … 2.15 accepts (`docs/pytorch-formats.md` §8.1):
//! `GLOBAL` (never `STACK_GLOBAL`), `BINUNICODE` (never `SHORT_BINUNICODE`), no
//! `FRAME`/`MEMOIZE`/memo at all, `BINFLOAT` big-endian, `bytes` as
//! `_codecs.encode(str, 'latin1')` as torch itself writes them. Tensors are written as the
//! rebuild calls of [`crate::torch::save`]. `validate` checks a tree against what
//! `torch.load(weights_only=True)` accepts; [`from_pickle`] turns a value decoded by the
//! reader back into a [`PyValue`], so non-tensor checkpoint entries (DCP `BYTE_IO` items,
//! `meta.pt`) can be re-emitted.

use super::op;
use super::Value;
use crate::torch::dtype;
use crate::torch::save::{write_tensor, TensorRef};
use reshard_core::model::Extra;
use std::sync::Arc;

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
    /// 2.15, not in torch 2.1 (see `validate_torch21`).
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<PyValue>),
    /// A tuple.
    Tuple(Vec<PyValue>),
    /// A plain `dict`, in insertion order. Keys must be hashable (no list/dict/set).
    Dict(Vec<(PyValue, PyValue)>),
    /// A `collections.OrderedDict` (what `state_dict()` returns; reshard writes plain dicts,
    /// the tests write this to check the reader and the weights-only rules).
    #[cfg_attr(not(any(test, feature = "internals")), allow(dead_code))]
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
    /// (`.metadata`); `validate` refuses it.
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
    #[cfg(any(test, feature = "internals"))]
    pub fn str_dict(items: Vec<(&str, PyValue)>) -> PyValue {
        PyValue::Dict(
            items
                .into_iter()
                .map(|(k, v)| (PyValue::Str(k.into()), v))
                .collect(),
        )
    }
}

/// Whether `module.name` may be emitted as a bare [`PyValue::Global`]: a torch dtype under its
/// canonical name.
pub fn is_allowed_global(module: &str, name: &str) -> bool {
    module == "torch" && dtype::canonical(name).is_some()
}

/// [`validate`], plus what torch 2.1's weights-only unpickler needs (verified against torch
/// 2.1.2): no `bytes`, `set`, `complex` or `torch.device`, dtype globals among
/// float16/32/64, int8/16/32/64, complex32/64/128 only, and tensors of dtypes with a legacy
/// storage class (no uint16/32/64 or float8, which need `_rebuild_tensor_v3`).
#[cfg(any(test, feature = "internals"))]
pub fn validate_torch21(v: &PyValue) -> Result<(), String> {
    validate(v)?;
    check21(v)
}

#[cfg(any(test, feature = "internals"))]
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
        PyValue::Global { name, .. } if !dtype::canonical(name).is_some_and(|d| d.torch21) => {
            not(&format!("the global torch.{name}"))
        }
        PyValue::Tensor(t) if dtype::legacy_storage(t.dtype).is_none() => {
            not(&format!("{} tensors", dtype::torch_dtype_name(t.dtype)))
        }
        PyValue::List(items) | PyValue::Tuple(items) => items.iter().try_for_each(check21),
        PyValue::Dict(pairs) | PyValue::OrderedDict(pairs) => pairs
            .iter()
            .try_for_each(|(k, x)| check21(k).and_then(|_| check21(x))),
        _ => Ok(()),
    }
}

/// Deepest nesting [`validate`] accepts (the project's reader stops at 1000 levels).
#[cfg(any(test, feature = "internals"))]
pub const MAX_DEPTH: usize = 500;

/// Check that `v` pickles to something `torch.load(weights_only=True)` (and the project's own
/// reader) accepts: allow-listed globals only, ints within `LONG1`, strings within
/// `BINUNICODE`, hashable dict keys and set elements, storages large enough for their
/// tensors, storage keys without `/` or newlines, bounded nesting. (Which torch versions
/// accept which values is in the docs of [`PyValue`]'s variants.)
#[cfg(any(test, feature = "internals"))]
pub fn validate(v: &PyValue) -> Result<(), String> {
    check(v, 0)
}

#[cfg(any(test, feature = "internals"))]
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
        PyValue::Tensor(t) => t.check(),
    }
}

#[cfg(any(test, feature = "internals"))]
fn fits_binunicode(utf8_len: u64) -> Result<(), String> {
    if utf8_len > u32::MAX as u64 {
        Err(format!(
            "string of {utf8_len} bytes is too long for BINUNICODE"
        ))
    } else {
        Ok(())
    }
}

#[cfg(any(test, feature = "internals"))]
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

/// Items per `APPENDS`/`SETITEMS` batch, as Python's pickler.
const BATCH: usize = 1000;

/// Pickle `v` (protocol 2, weights-only-safe opcodes, see the module docs). Values that fail
/// `validate` are still written (an over-long [`PyValue::BigInt`] as `LONG4`), but torch
/// will not load them; use `pickle_checked` to refuse them instead.
pub fn pickle(v: &PyValue) -> Vec<u8> {
    let mut p = Pickler::new();
    p.value(v);
    p.finish()
}

/// [`validate`] then [`pickle`].
#[cfg(any(test, feature = "internals"))]
pub fn pickle_checked(v: &PyValue) -> Result<Vec<u8>, String> {
    validate(v)?;
    Ok(pickle(v))
}

/// Write `GLOBAL module\nname\n`.
pub fn write_global(w: &mut Vec<u8>, module: &str, name: &str) {
    w.push(op::GLOBAL);
    w.extend_from_slice(module.as_bytes());
    w.push(b'\n');
    w.extend_from_slice(name.as_bytes());
    w.push(b'\n');
}

/// Write `s` as a `BINUNICODE` string.
pub fn write_str(w: &mut Vec<u8>, s: &str) {
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

/// Write `x` as the shortest int opcode that holds it.
pub fn write_int(w: &mut Vec<u8>, x: i64) {
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

/// Write `x` as an int (a `LONG1` past `i64`).
pub fn write_u64(w: &mut Vec<u8>, x: u64) {
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

/// Write `xs` as a tuple of ints.
pub fn write_u64_tuple(w: &mut Vec<u8>, xs: &[u64]) {
    write_tuple_with(w, xs.len(), |w, i| write_u64(w, xs[i]));
}

/// A pickle written piece by piece: [`pickle`] of a whole [`PyValue`] tree, or, for pickles
/// too large to hold as a tree (DCP's `.metadata` at a million chunks), a caller that writes
/// the outer containers itself ([`Pickler::dict_with`]) and [`PyValue`]s inside them.
///
/// With [`Pickler::with_memo`], each distinct global and str is written once and stored in
/// the memo (`BINPUT`), and fetched (`BINGET`) where it repeats, as Python's pickler does.
/// Only for pickles read by the full unpickler: torch's weights-only unpickler of torch 2.1
/// refuses memo opcodes (`docs/pytorch-formats.md` §8.1).
pub struct Pickler {
    w: Vec<u8>,
    memo: Option<Memo>,
    /// With [`Pickler::in_blocks`]: the block size and the blocks written so far.
    blocks: Option<(usize, Vec<Arc<[u8]>>)>,
}

/// Where a caller remembers the memo slot of a str or global it pushes many times
/// ([`Pickler::str_at`], [`Pickler::global_at`]): once memoised, a value is always fetched
/// from the same slot, so the memo need not be searched again.
#[derive(Clone, Copy, Debug, Default)]
pub struct Slot(Option<u32>);

impl Slot {
    /// Whether the slot is known: [`Pickler::str_at`] and [`Pickler::global_at`] then push
    /// what it holds, whatever they are given.
    pub fn is_known(&self) -> bool {
        self.0.is_some()
    }
}

/// Memo slots of the globals (few: a list) and strs written so far.
#[derive(Default)]
struct Memo {
    globals: Vec<(String, String, u32)>,
    strs: std::collections::HashMap<String, u32>,
    next: u32,
}

impl Memo {
    fn slot(&mut self) -> u32 {
        let i = self.next;
        self.next += 1;
        i
    }
}

impl Pickler {
    /// A protocol-2 pickle without memo.
    pub fn new() -> Pickler {
        let mut w = Vec::with_capacity(256);
        w.extend_from_slice(&[op::PROTO, 2]);
        Pickler {
            w,
            memo: None,
            blocks: None,
        }
    }

    /// Keep the pickle in blocks of about `size` bytes ([`Pickler::finish_blocks`]): the
    /// bytes written are cut off between the items of a dict or list once there are `size`
    /// of them, and the buffer is reused, so a large pickle is neither copied whole nor held
    /// twice.
    pub fn in_blocks(mut self, size: usize) -> Pickler {
        self.blocks = Some((size, vec![]));
        self
    }

    /// With [`Pickler::in_blocks`], cut off a block if there is one.
    fn end_item(&mut self) {
        if let Some((size, done)) = &mut self.blocks {
            if self.w.len() >= *size {
                done.push(Arc::from(&self.w[..]));
                self.w.clear();
            }
        }
    }

    /// A protocol-2 pickle that writes each global and str once (see the type's docs).
    pub fn with_memo() -> Pickler {
        Pickler {
            memo: Some(Memo::default()),
            ..Pickler::new()
        }
    }

    /// Push one opcode without argument.
    pub fn op(&mut self, code: u8) {
        self.w.push(code);
    }

    /// The finished pickle (`STOP` appended).
    pub fn finish(mut self) -> Vec<u8> {
        match self.blocks {
            Some(_) => self.finish_blocks().concat(),
            None => {
                self.w.push(op::STOP);
                self.w
            }
        }
    }

    /// The finished pickle (`STOP` appended) in blocks (one unless [`Pickler::in_blocks`]).
    pub fn finish_blocks(mut self) -> Vec<Arc<[u8]>> {
        self.w.push(op::STOP);
        let mut blocks = self.blocks.map(|(_, done)| done).unwrap_or_default();
        blocks.push(Arc::from(self.w));
        blocks
    }

    fn put(&mut self, slot: u32) {
        if let Ok(b) = u8::try_from(slot) {
            self.w.extend_from_slice(&[op::BINPUT, b]);
        } else {
            self.w.push(op::LONG_BINPUT);
            self.w.extend_from_slice(&slot.to_le_bytes());
        }
    }

    fn get(&mut self, slot: u32) {
        if let Ok(b) = u8::try_from(slot) {
            self.w.extend_from_slice(&[op::BINGET, b]);
        } else {
            self.w.push(op::LONG_BINGET);
            self.w.extend_from_slice(&slot.to_le_bytes());
        }
    }

    /// Push global `module.name`.
    pub fn global(&mut self, module: &str, name: &str) {
        self.memo_global(module, name);
    }

    /// [`Pickler::global`], returning the memo slot that now holds the global, if any.
    fn memo_global(&mut self, module: &str, name: &str) -> Option<u32> {
        let Some(memo) = self.memo.as_mut() else {
            write_global(&mut self.w, module, name);
            return None;
        };
        if let Some(&(_, _, i)) = memo
            .globals
            .iter()
            .find(|(m, n, _)| n == name && m == module)
        {
            self.get(i);
            return Some(i);
        }
        let i = memo.slot();
        memo.globals.push((module.to_string(), name.to_string(), i));
        write_global(&mut self.w, module, name);
        self.put(i);
        Some(i)
    }

    /// Push str `s`.
    pub fn str(&mut self, s: &str) {
        self.memo_str(s);
    }

    /// [`Pickler::str`], returning the memo slot that now holds `s`, if any.
    fn memo_str(&mut self, s: &str) -> Option<u32> {
        let Some(memo) = self.memo.as_mut() else {
            write_str(&mut self.w, s);
            return None;
        };
        if let Some(&i) = memo.strs.get(s) {
            self.get(i);
            return Some(i);
        }
        let i = memo.slot();
        memo.strs.insert(s.to_string(), i);
        write_str(&mut self.w, s);
        self.put(i);
        Some(i)
    }

    /// Push str `s` as [`Pickler::str`] does, the memo looked up only the first time:
    /// `slot` remembers where `s` is memoised. Use a slot for one str of one pickler only.
    pub fn str_at(&mut self, s: &str, slot: &mut Slot) {
        match slot.0 {
            Some(i) => self.get(i),
            None => slot.0 = self.memo_str(s),
        }
    }

    /// Push global `module.name` as [`Pickler::global`] does, the memo looked up only the
    /// first time: `slot` remembers where it is memoised. Use a slot for one global of one
    /// pickler only.
    pub fn global_at(&mut self, module: &str, name: &str, slot: &mut Slot) {
        match slot.0 {
            Some(i) => self.get(i),
            None => slot.0 = self.memo_global(module, name),
        }
    }

    /// Push int `x`.
    pub fn int(&mut self, x: i64) {
        write_int(&mut self.w, x);
    }

    /// Push `torch.Size(dims)`, `slot` remembering where `torch.Size` is memoised (see
    /// [`Pickler::global_at`]).
    pub fn torch_size_at(&mut self, dims: &[u64], slot: &mut Slot) {
        self.global_at("torch", "Size", slot);
        write_u64_tuple(&mut self.w, dims);
        self.w.push(op::TUPLE1);
        self.w.push(op::REDUCE);
    }

    /// Push an empty `module.name` object (`NEWOBJ`); its state follows, then `BUILD`.
    pub fn new_object(&mut self, module: &str, name: &str) {
        self.new_object_at(module, name, &mut Slot::default());
    }

    /// [`Pickler::new_object`], `slot` remembering where the class is memoised (see
    /// [`Pickler::global_at`]).
    pub fn new_object_at(&mut self, module: &str, name: &str, slot: &mut Slot) {
        self.global_at(module, name, slot);
        self.w.push(op::EMPTY_TUPLE);
        self.w.push(op::NEWOBJ);
    }

    /// Push a dict of `n` items, item `i` (its key, then its value) pushed by `each`, in
    /// `SETITEMS` batches as Python's pickler writes them.
    pub fn dict_with(&mut self, n: usize, each: impl FnMut(&mut Pickler, usize)) {
        self.batched(op::EMPTY_DICT, op::SETITEMS, n, each);
    }

    /// Push a list of `n` items, item `i` pushed by `each`, in `APPENDS` batches.
    pub fn list_with(&mut self, n: usize, each: impl FnMut(&mut Pickler, usize)) {
        self.batched(op::EMPTY_LIST, op::APPENDS, n, each);
    }

    /// Push the empty container `empty`, then its `n` items in batches of `BATCH`, each batch
    /// a `MARK`, its items (pushed by `each`) and `add` (`SETITEMS`, `APPENDS`).
    fn batched(&mut self, empty: u8, add: u8, n: usize, mut each: impl FnMut(&mut Pickler, usize)) {
        self.w.push(empty);
        let mut i = 0;
        while i < n {
            self.w.push(op::MARK);
            for j in i..(i + BATCH).min(n) {
                each(self, j);
                self.end_item();
            }
            self.w.push(add);
            i += BATCH;
        }
    }

    /// Tuple of already-known length: items written by `each`.
    fn tuple_with(&mut self, n: usize, mut each: impl FnMut(&mut Pickler, usize)) {
        match n {
            0 => self.w.push(op::EMPTY_TUPLE),
            1..=3 => {
                for i in 0..n {
                    each(self, i);
                }
                self.w.push([op::TUPLE1, op::TUPLE2, op::TUPLE3][n - 1]);
            }
            _ => {
                self.w.push(op::MARK);
                for i in 0..n {
                    each(self, i);
                }
                self.w.push(op::TUPLE);
            }
        }
    }

    /// Push `v`.
    pub fn value(&mut self, v: &PyValue) {
        match v {
            PyValue::None => self.w.push(op::NONE),
            PyValue::Bool(b) => self.w.push(if *b { op::NEWTRUE } else { op::NEWFALSE }),
            PyValue::Int(i) => self.int(*i),
            PyValue::BigInt(b) => write_long_bytes(&mut self.w, b),
            PyValue::Float(f) => write_float(&mut self.w, *f),
            PyValue::Str(s) => self.str(s),
            PyValue::Bytes(b) => {
                // bytes → _codecs.encode(<the bytes as latin-1 text>, 'latin1'), as Python's
                // protocol-2 pickler writes them.
                self.global("_codecs", "encode");
                let text: String = b.iter().map(|&c| c as char).collect();
                self.str(&text);
                self.str("latin1");
                self.w.push(op::TUPLE2);
                self.w.push(op::REDUCE);
            }
            PyValue::List(items) => self.list_with(items.len(), |p, i| p.value(&items[i])),
            PyValue::Tuple(items) => self.tuple_with(items.len(), |p, i| p.value(&items[i])),
            PyValue::Dict(pairs) => self.dict_with(pairs.len(), |p, i| {
                p.value(&pairs[i].0);
                p.value(&pairs[i].1);
            }),
            PyValue::OrderedDict(pairs) => {
                self.global("collections", "OrderedDict");
                self.w.push(op::EMPTY_TUPLE);
                self.w.push(op::REDUCE);
                let mut i = 0;
                while i < pairs.len() {
                    self.w.push(op::MARK);
                    for (k, x) in &pairs[i..(i + BATCH).min(pairs.len())] {
                        self.value(k);
                        self.value(x);
                    }
                    self.w.push(op::SETITEMS);
                    i += BATCH;
                }
            }
            PyValue::Set(items) => {
                // set.__reduce__ in protocol < 4: set([items])
                self.global("builtins", "set");
                self.list_with(items.len(), |p, i| p.value(&items[i]));
                self.w.push(op::TUPLE1);
                self.w.push(op::REDUCE);
            }
            PyValue::Complex(re, im) => {
                self.global("builtins", "complex");
                write_float(&mut self.w, *re);
                write_float(&mut self.w, *im);
                self.w.push(op::TUPLE2);
                self.w.push(op::REDUCE);
            }
            PyValue::Device { kind, index } => {
                self.global("torch", "device");
                self.str(kind);
                match index {
                    Some(i) => {
                        self.int(*i);
                        self.w.push(op::TUPLE2);
                    }
                    None => self.w.push(op::TUPLE1),
                }
                self.w.push(op::REDUCE);
            }
            PyValue::Global { module, name } => self.global(module, name),
            PyValue::Object {
                module,
                name,
                state,
            } => {
                self.new_object(module, name);
                if let Some(s) = state {
                    self.value(s);
                    self.w.push(op::BUILD);
                }
            }
            PyValue::Call { module, name, args } => {
                self.global(module, name);
                self.tuple_with(args.len(), |p, i| p.value(&args[i]));
                self.w.push(op::REDUCE);
            }
            PyValue::Tensor(t) => write_tensor(&mut self.w, t),
        }
    }
}

impl Default for Pickler {
    fn default() -> Pickler {
        Pickler::new()
    }
}

/// An entry as a Python value to pickle: its decoded value when it can be re-emitted, its
/// JSON otherwise.
pub fn extra_value(e: &Extra) -> PyValue {
    e.pickle
        .as_ref()
        .and_then(from_pickle)
        .unwrap_or_else(|| from_json(&e.value))
}

/// An entry as a protocol-2 pickle of plain Python values (what the pickle writers emit for
/// it): its decoded value where it can be re-emitted, its JSON otherwise. The only globals
/// it names are `_codecs.encode`, `builtins.set`/`complex`, `collections.OrderedDict`,
/// `torch.device` and torch dtypes.
pub fn extra_pickle(e: &Extra) -> Vec<u8> {
    pickle(&extra_value(e))
}

/// Convert a value decoded by [`super::parse`] (with
/// [`crate::torch::pickle::torch_save_globals`]) into a [`PyValue`] that re-emits it:
/// None, bools, ints, floats, str, bytes, lists, tuples, dicts (an `OrderedDict` decodes to a
/// dict and comes back as a plain [`PyValue::Dict`]), sets, `complex`, `torch.device`,
/// `torch.Size` (as a tuple), canonical torch dtype globals, `io.BytesIO` buffers,
/// `argparse.Namespace` objects and megatron-core's enums (Megatron-LM's arguments in `common.pt`). `None` for anything else
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
        // Megatron-LM's `args`: made again as pickled, `argparse.Namespace.__new__()` and its
        // `__dict__` set by BUILD
        Value::Object {
            module,
            name,
            args,
            state,
        } if module == "argparse" && name == "Namespace" && args.is_empty() => PyValue::Object {
            module: module.clone(),
            name: name.clone(),
            state: match state {
                Some(s) => Some(Box::new(from_pickle(s)?)),
                None => None,
            },
        },
        // `io.BytesIO` (torch's own pattern for train state kept beside tensors): made
        // again as pickled, `_io.BytesIO.__new__()` and `(bytes, position, __dict__)` set by
        // BUILD
        Value::Object {
            module,
            name,
            args,
            state: Some(state),
        } if module == "_io" && name == "BytesIO" && args.is_empty() => match state.as_ref() {
            Value::Tuple(parts)
                if matches!(
                    parts.as_slice(),
                    [Value::Bytes(_), Value::Int(_), Value::None | Value::Dict(_)]
                ) =>
            {
                PyValue::object(module, name, Some(from_pickle(state)?))
            }
            _ => return None,
        },
        // megatron-core's enums in those arguments: `AttnBackend(5)`, and Megatron-LM's
        // `exit_signal` (`signal.Signals(15)`), called again by the unpickler that reads the
        // file (megatron-core's own, not torch's weights-only one)
        Value::Object {
            module,
            name,
            args,
            state: None,
        } if (is_megatron_enum(module) || (module == "signal" && name == "Signals"))
            && matches!(args.as_slice(), [Value::Int(_) | Value::Str(_)]) =>
        {
            PyValue::Call {
                module: module.clone(),
                name: name.clone(),
                args: vec![from_pickle(&args[0])?],
            }
        }
        Value::Object {
            module,
            name,
            args,
            state: None,
        } => match (module.as_str(), name.as_str(), args.as_slice()) {
            // a torch.Size again (torch's weights-only unpickler allows it), as torch.load
            // gives it back
            ("torch", "Size", _) => {
                let dims = v.as_int_tuple()?;
                let dims: Vec<u64> = dims
                    .iter()
                    .map(|&d| u64::try_from(d).ok())
                    .collect::<Option<_>>()?;
                PyValue::torch_size(&dims)
            }
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

/// The megatron-core modules whose enums a `common.pt` may hold
/// ([`super::pickled_dict_globals`]).
fn is_megatron_enum(module: &str) -> bool {
    matches!(
        module,
        "megatron.core.enums" | "megatron.core.transformer.enums"
    )
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
    use crate::layout::DType;
    use crate::torch::pickle::{parse, torch_save_globals};
    use crate::torch::save::TensorRef;

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
}
