//! The reader: a bounded, allow-listing VM that turns a pickle's opcode stream into a
//! [`Value`] tree (see the [module docs](super) for its safety model).

use super::op;
use super::{Globals, Value};
use crate::torch::short;
use std::collections::HashMap;

/// Deepest nesting of the materialised tree.
pub const MAX_DEPTH: usize = 1000;
/// Most values on the VM stack at once.
pub const MAX_STACK: usize = 1 << 22;
/// Most `MARK`s open at once.
pub const MAX_MARKS: usize = 1000;
/// Smallest value budget (values created during expansion), whatever the input size.
pub const MIN_VALUE_BUDGET: u64 = 1_000_000;
/// Smallest byte budget (bytes of strings copied during expansion), whatever the input size.
pub const MIN_BYTE_BUDGET: u64 = 64 << 20;
/// Values budget per input byte. Real DCP pickles materialise at most 0.25 values per input
/// byte (measured on every fixture); one `Value` is 80 bytes, so 2 per byte caps the tree at
/// 160 × the input (a 5 MB pickle naming one chunk a million times through the memo is
/// refused in 0.15 s instead of taking 21 s and 1.3 GiB at 16 per byte).
pub const VALUES_PER_INPUT_BYTE: u64 = 2;
/// String-bytes budget per input byte. Real DCP pickles copy at most 2.6 bytes of strings per
/// input byte (memoised class paths and keys are re-used often).
pub const BYTES_PER_INPUT_BYTE: u64 = 64;
/// Longest decimal integer accepted by the text opcodes `INT`/`LONG` (Python's own default
/// limit for int/str conversion).
pub const MAX_TEXT_INT_DIGITS: usize = 4300;

/// Highest pickle protocol understood.
pub const HIGHEST_PROTOCOL: u8 = 5;

/// Why a pickle could not be decoded. Offsets are those of the opcode being executed.
#[derive(Debug, thiserror::Error)]
pub enum PickleError {
    /// The input ends inside an opcode.
    #[error("truncated at byte {offset} ({opcode} needs {needed} more bytes)")]
    Truncated {
        /// Byte offset of the opcode.
        offset: usize,
        /// The opcode's name.
        opcode: &'static str,
        /// Bytes missing.
        needed: u64,
    },
    /// The input ends without a `STOP`.
    #[error("input ends at byte {offset} without a STOP opcode")]
    MissingStop {
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// A byte that is no pickle opcode.
    #[error("unknown opcode 0x{byte:02x} at byte {offset}")]
    UnknownOpcode {
        /// The byte.
        byte: u8,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// An opcode this reader refuses (protocol features no checkpoint uses).
    #[error("unsupported opcode {opcode} at byte {offset}")]
    UnsupportedOpcode {
        /// The opcode's name.
        opcode: &'static str,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// A global that is not on the allow-list.
    #[error("unknown global `{}.{}` at byte {offset}", short(.module), short(.name))]
    UnknownGlobal {
        /// The global's module.
        module: String,
        /// The global's name.
        name: String,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// A memo reference to a key never stored.
    #[error("memo key {key} not found at byte {offset}")]
    MissingMemo {
        /// The memo key.
        key: u64,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// An opcode that needs more values than the stack holds.
    #[error("stack underflow at byte {offset} ({opcode})")]
    StackUnderflow {
        /// The opcode's name.
        opcode: &'static str,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// An opcode that needs a `MARK` with none open.
    #[error("{opcode} without a MARK at byte {offset}")]
    MissingMark {
        /// The opcode's name.
        opcode: &'static str,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// An operand or stack value the opcode cannot take.
    #[error("{message} at byte {offset}")]
    Invalid {
        /// What is wrong.
        message: String,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// A resource limit of the VM (stack, marks, memo).
    #[error("{what} exceeds {limit} at byte {offset}")]
    Limit {
        /// What is limited.
        what: &'static str,
        /// The limit.
        limit: usize,
        /// Byte offset of the opcode.
        offset: usize,
    },
    /// The decoded tree would have more values than the budget.
    #[error("pickle expands beyond {limit} values")]
    TooManyValues {
        /// The limit.
        limit: u64,
    },
    /// The decoded tree would hold more bytes than the budget.
    #[error("pickle expands beyond {limit} bytes")]
    TooManyBytes {
        /// The limit.
        limit: u64,
    },
    /// Nesting deeper than the limit.
    #[error("nesting deeper than {limit} levels")]
    TooDeep {
        /// The limit.
        limit: usize,
    },
    /// A container that contains itself.
    #[error("recursive structure: a {kind} contains itself")]
    Recursive {
        /// The container's kind.
        kind: &'static str,
    },
}

fn invalid(offset: usize, message: impl Into<String>) -> PickleError {
    PickleError::Invalid {
        message: message.into(),
        offset,
    }
}

/// Decode a whole pickle. Bytes after `STOP` are ignored, as Python does.
///
/// Calls of allow-listed callables become [`Value::Object`], except:
/// `collections.OrderedDict`/`builtins.dict` → [`Value::Dict`], `builtins.set`/`frozenset` →
/// [`Value::Set`], `builtins.bytearray`/`bytes` and `_codecs.encode(str, 'latin1' | 'utf-8')`
/// → [`Value::Bytes`]. `BUILD` on an object sets its state (two dict states merge); `BUILD`
/// with a dict state on a dict merges it into the dict's items (Python would set instance
/// attributes, which this model does not have).
pub fn parse(bytes: &[u8], globals: &Globals) -> Result<Value, PickleError> {
    parse_with_len(bytes, globals).map(|(v, _)| v)
}

/// Like [`parse`], also returning the number of bytes consumed (up to and including `STOP`).
pub fn parse_with_len(bytes: &[u8], globals: &Globals) -> Result<(Value, usize), PickleError> {
    let budget = Budget::for_input(bytes.len());
    let mut vm = Machine::new(globals, budget);
    let (root, end) = vm.run(bytes)?;
    let value = vm.materialize(root)?;
    Ok((value, end))
}

/// Decode a whole pickle into its value graph ([`Graph`]) without building a [`Value`] tree:
/// what large pickles (a DCP `.metadata` of a million chunks) are read through, so that no
/// string or class name is copied per use. The same checks and budgets as [`parse`] apply,
/// including the expansion bound on what the tree would be.
pub fn parse_graph(bytes: &[u8], globals: &Globals) -> Result<Graph, PickleError> {
    let budget = Budget::for_input(bytes.len());
    let mut vm = Machine::new(globals, budget);
    let (root, _) = vm.run(bytes)?;
    vm.check_expansion(root)?;
    Ok(Graph {
        nodes: vm.nodes,
        globals: vm.global_table,
        root,
    })
}

/// A decoded pickle as the VM's arena of values: shared values (memo references) are stored
/// once, and [`Obj`] handles read them in place.
pub struct Graph {
    nodes: Vec<Node>,
    globals: Vec<(String, String)>,
    root: Id,
}

impl Graph {
    /// The unpickled object.
    pub fn root(&self) -> Obj<'_> {
        Obj {
            g: self,
            id: self.root,
        }
    }
}

/// A value of a [`Graph`]; the accessors mirror [`Value`]'s.
#[derive(Clone, Copy)]
pub struct Obj<'g> {
    g: &'g Graph,
    id: Id,
}

impl<'g> Obj<'g> {
    fn node(self) -> &'g Node {
        self.g.nodes.get(self.id as usize).unwrap_or(&Node::None)
    }

    fn at(self, id: Id) -> Obj<'g> {
        Obj { g: self.g, id }
    }

    /// Short name of the kind of value, for error messages.
    pub fn kind(self) -> &'static str {
        self.node().kind()
    }

    /// True for `None`.
    pub fn is_none(self) -> bool {
        matches!(self.node(), Node::None)
    }

    /// The value of an int (not of a bool, not of one beyond `i64`).
    pub fn as_int(self) -> Option<i64> {
        match self.node() {
            Node::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The text of a str.
    pub fn as_str(self) -> Option<&'g str> {
        match self.node() {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    /// Elements of a list or a tuple.
    pub fn as_list(self) -> Option<impl ExactSizeIterator<Item = Obj<'g>> + 'g> {
        let ids = self.node().list_ids()?;
        Some(ids.iter().map(move |&i| self.at(i)))
    }

    /// Pairs of a dict, in pickle order (a key set twice appears twice; see [`Obj::get`]).
    pub fn as_dict(self) -> Option<impl ExactSizeIterator<Item = (Obj<'g>, Obj<'g>)> + 'g> {
        match self.node() {
            Node::Dict(pairs) => Some(pairs.iter().map(move |&(k, v)| (self.at(k), self.at(v)))),
            _ => None,
        }
    }

    /// `(module, name)` of a global or of an object's class/callable.
    pub fn class(self) -> Option<(&'g str, &'g str)> {
        match self.node() {
            Node::Global(g) | Node::Object { global: g, .. } => self
                .g
                .globals
                .get(*g as usize)
                .map(|(m, n)| (m.as_str(), n.as_str())),
            _ => None,
        }
    }

    /// BUILD state of an object.
    pub fn state(self) -> Option<Obj<'g>> {
        match self.node() {
            Node::Object { state, .. } => state.map(|s| self.at(s)),
            _ => None,
        }
    }

    /// Look up a str key in a dict, or in an object's state dict (also the dict half of a
    /// `(dict, slotstate)` state tuple). The last matching pair wins, as in [`Value::get`].
    pub fn get(self, key: &str) -> Option<Obj<'g>> {
        match self.node() {
            Node::Dict(pairs) => pairs
                .iter()
                .rev()
                .find(|&&(k, _)| self.at(k).as_str() == Some(key))
                .map(|&(_, v)| self.at(v)),
            Node::Object { state: Some(s), .. } => {
                let s = self.at(*s);
                match s.node().tuple_ids() {
                    Some(&[dict, _]) => self.at(dict).get(key),
                    _ => s.get(key),
                }
            }
            _ => None,
        }
    }

    /// Append the ints of a list/tuple of ints, or of a `torch.Size(...)` object, to `out`;
    /// false (with `out` unspecified) for anything else or a negative int.
    pub fn dims_into(self, out: &mut Vec<u64>) -> bool {
        let items = match self.node() {
            Node::Object { args, .. } if self.class() == Some(("torch", "Size")) => {
                return match self.at(*args).node().tuple_ids() {
                    Some(&[dims]) => self.at(dims).dims_into(out),
                    _ => false,
                };
            }
            n => match n.list_ids() {
                Some(ids) => ids,
                None => return false,
            },
        };
        for &i in items {
            match self.at(i).as_int().and_then(|v| u64::try_from(v).ok()) {
                Some(v) => out.push(v),
                None => return false,
            }
        }
        true
    }
}

// ---------------------------------------------------------------------------------------------
// Input reader

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.data.len().saturating_sub(self.pos)
    }

    fn next_byte(&mut self) -> Option<u8> {
        let b = self.data.get(self.pos).copied()?;
        self.pos += 1;
        Some(b)
    }

    /// Take `n` bytes, checking `n` against the remaining input before anything else.
    fn take(&mut self, n: u64, opcode: &'static str, at: usize) -> Result<&'a [u8], PickleError> {
        let rem = self.remaining();
        let truncated = PickleError::Truncated {
            offset: at,
            opcode,
            needed: n.saturating_sub(rem as u64),
        };
        let n = match usize::try_from(n) {
            Ok(n) if n <= rem => n,
            _ => return Err(truncated),
        };
        let end = self.pos.checked_add(n).ok_or(truncated)?;
        let slice = self.data.get(self.pos..end).ok_or(PickleError::Truncated {
            offset: at,
            opcode,
            needed: 1,
        })?;
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(
        &mut self,
        opcode: &'static str,
        at: usize,
    ) -> Result<[u8; N], PickleError> {
        let s = self.take(N as u64, opcode, at)?;
        <[u8; N]>::try_from(s).map_err(|_| PickleError::Truncated {
            offset: at,
            opcode,
            needed: N as u64,
        })
    }

    fn u8(&mut self, opcode: &'static str, at: usize) -> Result<u8, PickleError> {
        Ok(self.array::<1>(opcode, at)?[0])
    }

    fn u16(&mut self, opcode: &'static str, at: usize) -> Result<u16, PickleError> {
        Ok(u16::from_le_bytes(self.array(opcode, at)?))
    }

    fn u32(&mut self, opcode: &'static str, at: usize) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.array(opcode, at)?))
    }

    fn i32(&mut self, opcode: &'static str, at: usize) -> Result<i32, PickleError> {
        Ok(i32::from_le_bytes(self.array(opcode, at)?))
    }

    fn u64(&mut self, opcode: &'static str, at: usize) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.array(opcode, at)?))
    }

    /// A `\n`-terminated line (text opcodes), without the newline.
    fn line(&mut self, opcode: &'static str, at: usize) -> Result<&'a [u8], PickleError> {
        let rest = self.data.get(self.pos..).unwrap_or(&[]);
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            return Err(PickleError::Truncated {
                offset: at,
                opcode,
                needed: 1,
            });
        };
        let line = rest.get(..nl).unwrap_or(&[]);
        self.pos = self.pos.saturating_add(nl).saturating_add(1);
        Ok(line)
    }
}

// ---------------------------------------------------------------------------------------------
// Memo

/// The memo: keys below the dense length in a vector (what `MEMOIZE`, and Python's pickler
/// with `BINPUT`, produce: 0, 1, 2, …), any other key in a map. A key far beyond the dense
/// part (an input may name 2^32 - 1) goes to the map, so memory stays proportional to the
/// number of entries.
#[derive(Default)]
struct Memo {
    dense: Vec<Id>,
    sparse: HashMap<u64, Id>,
    /// Number of keys set (`len(memo)`, the key `MEMOIZE` uses).
    len: u64,
}

/// A vacant slot of `Memo::dense`.
const VACANT: Id = Id::MAX;
/// How far past the dense part a key may be and still grow it (the gap is filled vacant).
const DENSE_GAP: u64 = 64;

impl Memo {
    fn get(&self, key: u64) -> Option<Id> {
        match usize::try_from(key).ok().and_then(|k| self.dense.get(k)) {
            Some(&id) if id != VACANT => Some(id),
            _ => self.sparse.get(&key).copied(),
        }
    }

    fn insert(&mut self, key: u64, id: Id) {
        let dense_len = self.dense.len() as u64;
        if key < dense_len.saturating_add(DENSE_GAP) && id != VACANT {
            let k = key as usize;
            if k >= self.dense.len() {
                self.dense.resize(k + 1, VACANT);
            }
            let was_set = self.dense[k] != VACANT
                || (!self.sparse.is_empty() && self.sparse.remove(&key).is_some());
            self.dense[k] = id;
            if !was_set {
                self.len += 1;
            }
        } else if self.sparse.insert(key, id).is_none() {
            self.len += 1;
        }
    }

    fn len(&self) -> u64 {
        self.len
    }
}

// ---------------------------------------------------------------------------------------------
// Arena

type Id = u32;

/// A value of the arena. Kept at 24 bytes (a million-chunk `.metadata` decodes to some 20
/// million of them): boxed slices instead of vectors, tuples of up to three items inline.
#[derive(Debug)]
enum Node {
    None,
    Bool(bool),
    Int(i64),
    BigInt(Box<[u8]>),
    Float(f64),
    Str(Box<str>),
    Bytes(Box<[u8]>),
    List(Seq<Id>),
    /// A tuple of up to three items.
    SmallTuple {
        len: u8,
        ids: [Id; 3],
    },
    /// A longer tuple.
    Tuple(Box<[Id]>),
    Dict(Seq<(Id, Id)>),
    Set(Seq<Id>),
    /// Index into `Machine::global_table`.
    Global(u32),
    /// `args` is a `Tuple` node.
    Object {
        global: u32,
        args: Id,
        state: Option<Id>,
    },
    PersistentId(Id),
}

/// A growable sequence in the 16 bytes of a boxed slice: its spare capacity holds
/// [`Vacant::VACANT`], which no element equals (ids stay below `Id::MAX`), so its length is
/// where the vacant tail starts. Grows by doubling, like a `Vec`.
#[derive(Debug)]
struct Seq<T: Vacant>(Box<[T]>);

/// An element of a [`Seq`] and the value that marks its spare capacity.
trait Vacant: Copy + PartialEq + std::fmt::Debug {
    const VACANT: Self;
}

impl Vacant for Id {
    const VACANT: Id = Id::MAX;
}

impl Vacant for (Id, Id) {
    const VACANT: (Id, Id) = (Id::MAX, Id::MAX);
}

impl<T: Vacant> Seq<T> {
    fn new() -> Seq<T> {
        Seq(Box::new([]))
    }

    fn push(&mut self, x: T) {
        self.extend(std::slice::from_ref(&x));
    }

    fn extend(&mut self, xs: &[T]) {
        let len = self.len();
        let need = len + xs.len();
        if need <= self.0.len() {
            self.0[len..need].copy_from_slice(xs);
            return;
        }
        let cap = if len == 0 {
            need
        } else {
            need.max(self.0.len() * 2)
        };
        let mut v = std::mem::take(&mut self.0).into_vec();
        v.truncate(len);
        v.reserve_exact(cap - len);
        v.extend_from_slice(xs);
        v.resize(cap, T::VACANT);
        self.0 = v.into_boxed_slice();
    }
}

impl<T: Vacant> From<Vec<T>> for Seq<T> {
    fn from(v: Vec<T>) -> Seq<T> {
        Seq(v.into_boxed_slice())
    }
}

impl<T: Vacant> std::ops::Deref for Seq<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        let len = self.0.partition_point(|x| *x != T::VACANT);
        &self.0[..len]
    }
}

impl Node {
    /// A tuple of `items`.
    fn tuple(items: &[Id]) -> Node {
        match items.len() {
            n @ 0..=3 => {
                let mut ids = [0; 3];
                ids[..n].copy_from_slice(items);
                Node::SmallTuple { len: n as u8, ids }
            }
            _ => Node::Tuple(items.into()),
        }
    }

    /// Items of a tuple.
    fn tuple_ids(&self) -> Option<&[Id]> {
        match self {
            Node::SmallTuple { len, ids } => ids.get(..usize::from(*len)),
            Node::Tuple(ids) => Some(ids),
            _ => None,
        }
    }

    /// Items of a list or a tuple.
    fn list_ids(&self) -> Option<&[Id]> {
        match self {
            Node::List(ids) => Some(ids),
            _ => self.tuple_ids(),
        }
    }

    /// Items of a list, a tuple or a set.
    fn seq_ids(&self) -> Option<&[Id]> {
        match self {
            Node::Set(ids) => Some(ids),
            _ => self.list_ids(),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Node::None => "none",
            Node::Bool(_) => "bool",
            Node::Int(_) | Node::BigInt(_) => "int",
            Node::Float(_) => "float",
            Node::Str(_) => "str",
            Node::Bytes(_) => "bytes",
            Node::List(_) => "list",
            Node::SmallTuple { .. } | Node::Tuple(_) => "tuple",
            Node::Dict(_) => "dict",
            Node::Set(_) => "set",
            Node::Global(_) => "global",
            Node::Object { .. } => "object",
            Node::PersistentId(_) => "persistent id",
        }
    }
}

const NONE_ID: Id = 0;
const TRUE_ID: Id = 1;
const FALSE_ID: Id = 2;
const EMPTY_TUPLE_ID: Id = 3;

const _: () = assert!(std::mem::size_of::<Node>() == 24);

struct Budget {
    values: u64,
    value_limit: u64,
    bytes: u64,
    byte_limit: u64,
}

impl Budget {
    fn for_input(len: usize) -> Self {
        let len = len as u64;
        Budget {
            values: 0,
            value_limit: len
                .saturating_mul(VALUES_PER_INPUT_BYTE)
                .max(MIN_VALUE_BUDGET),
            bytes: 0,
            byte_limit: len
                .saturating_mul(BYTES_PER_INPUT_BYTE)
                .max(MIN_BYTE_BUDGET),
        }
    }

    fn values(&mut self, n: usize) -> Result<(), PickleError> {
        self.values = self.values.saturating_add(n as u64);
        if self.values > self.value_limit {
            return Err(PickleError::TooManyValues {
                limit: self.value_limit,
            });
        }
        Ok(())
    }

    fn bytes(&mut self, n: usize) -> Result<(), PickleError> {
        self.bytes = self.bytes.saturating_add(n as u64);
        if self.bytes > self.byte_limit {
            return Err(PickleError::TooManyBytes {
                limit: self.byte_limit,
            });
        }
        Ok(())
    }
}

/// Special meaning given to a few allow-listed callables.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Builtin {
    Plain,
    Dict,
    Set,
    ByteArray,
    CodecsEncode,
}

fn builtin_of(module: &str, name: &str) -> Builtin {
    match (module, name) {
        ("collections", "OrderedDict") | ("builtins", "dict") => Builtin::Dict,
        ("builtins", "set") | ("builtins", "frozenset") => Builtin::Set,
        ("builtins", "bytearray") | ("builtins", "bytes") => Builtin::ByteArray,
        ("_codecs", "encode") => Builtin::CodecsEncode,
        _ => Builtin::Plain,
    }
}

struct Machine<'g> {
    globals: &'g Globals,
    nodes: Vec<Node>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: Memo,
    /// Node of each `BININT1` value met so far (0 = none yet): ints are immutable, so the
    /// tens of small ints per chunk of a DCP `.metadata` share nodes.
    small_ints: [Id; 256],
    global_table: Vec<(String, String)>,
    global_index: HashMap<(String, String), u32>,
    proto: u8,
    budget: Budget,
    /// Buffers reused by the opcodes that pop a MARK most (`TUPLE`, `APPENDS`, `SETITEMS`).
    scratch: Vec<Id>,
    scratch_pairs: Vec<(Id, Id)>,
}

impl<'g> Machine<'g> {
    fn new(globals: &'g Globals, budget: Budget) -> Self {
        Machine {
            globals,
            // Shared immutable singletons: NONE_ID, TRUE_ID, FALSE_ID, EMPTY_TUPLE_ID.
            nodes: vec![
                Node::None,
                Node::Bool(true),
                Node::Bool(false),
                Node::tuple(&[]),
            ],
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Memo::default(),
            small_ints: [0; 256],
            global_table: Vec::new(),
            global_index: HashMap::new(),
            proto: 0,
            budget,
            scratch: Vec::new(),
            scratch_pairs: Vec::new(),
        }
    }

    fn node(&self, id: Id) -> &Node {
        // Ids are only ever made by `alloc`, so this never falls back; `None` keeps it total.
        self.nodes.get(id as usize).unwrap_or(&Node::None)
    }

    fn node_mut(&mut self, id: Id, at: usize) -> Result<&mut Node, PickleError> {
        self.nodes
            .get_mut(id as usize)
            .ok_or_else(|| invalid(at, "dangling value reference"))
    }

    fn alloc(&mut self, node: Node, at: usize) -> Result<Id, PickleError> {
        // `Id::MAX` is never an id: it marks vacant memo slots and spare `Seq` capacity.
        let id = Id::try_from(self.nodes.len())
            .ok()
            .filter(|&id| id < Id::MAX)
            .ok_or(PickleError::Limit {
                what: "number of values",
                limit: Id::MAX as usize,
                offset: at,
            })?;
        self.nodes.push(node);
        Ok(id)
    }

    fn push(&mut self, id: Id, at: usize) -> Result<(), PickleError> {
        if self.stack.len() >= MAX_STACK {
            return Err(PickleError::Limit {
                what: "stack depth",
                limit: MAX_STACK,
                offset: at,
            });
        }
        self.stack.push(id);
        Ok(())
    }

    fn push_node(&mut self, node: Node, at: usize) -> Result<(), PickleError> {
        let id = self.alloc(node, at)?;
        self.push(id, at)
    }

    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self, opcode: &'static str, at: usize) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(PickleError::StackUnderflow { opcode, offset: at });
        }
        self.stack
            .pop()
            .ok_or(PickleError::StackUnderflow { opcode, offset: at })
    }

    fn top(&self, opcode: &'static str, at: usize) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(PickleError::StackUnderflow { opcode, offset: at });
        }
        self.stack
            .last()
            .copied()
            .ok_or(PickleError::StackUnderflow { opcode, offset: at })
    }

    fn pop_mark(&mut self, opcode: &'static str, at: usize) -> Result<Vec<Id>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or(PickleError::MissingMark { opcode, offset: at })?;
        if mark > self.stack.len() {
            return Err(PickleError::StackUnderflow { opcode, offset: at });
        }
        Ok(self.stack.split_off(mark))
    }

    /// [`Machine::pop_mark`] into the reused buffer `scratch`; give it back when done.
    fn pop_mark_scratch(
        &mut self,
        opcode: &'static str,
        at: usize,
    ) -> Result<Vec<Id>, PickleError> {
        let mark = self
            .marks
            .pop()
            .ok_or(PickleError::MissingMark { opcode, offset: at })?;
        let items = self
            .stack
            .get(mark..)
            .ok_or(PickleError::StackUnderflow { opcode, offset: at })?;
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        out.extend_from_slice(items);
        self.stack.truncate(mark);
        Ok(out)
    }

    fn str_of(&self, id: Id) -> Option<&str> {
        match self.node(id) {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    fn global_name(&self, gid: u32) -> (&str, &str) {
        self.global_table
            .get(gid as usize)
            .map(|(m, n)| (m.as_str(), n.as_str()))
            .unwrap_or(("?", "?"))
    }

    fn resolve_global(&mut self, module: &str, name: &str, at: usize) -> Result<u32, PickleError> {
        let module = if self.proto < 3 {
            match module {
                "__builtin__" => "builtins",
                "copy_reg" => "copyreg",
                m => m,
            }
        } else {
            module
        };
        if !self.globals.is_allowed(module, name) {
            return Err(PickleError::UnknownGlobal {
                module: module.to_owned(),
                name: name.to_owned(),
                offset: at,
            });
        }
        let key = (module.to_owned(), name.to_owned());
        if let Some(&gid) = self.global_index.get(&key) {
            return Ok(gid);
        }
        let gid = u32::try_from(self.global_table.len()).map_err(|_| PickleError::Limit {
            what: "number of globals",
            limit: u32::MAX as usize,
            offset: at,
        })?;
        self.global_table.push(key.clone());
        self.global_index.insert(key, gid);
        Ok(gid)
    }

    fn memo_get(&mut self, key: u64, at: usize) -> Result<(), PickleError> {
        let id = self
            .memo
            .get(key)
            .ok_or(PickleError::MissingMemo { key, offset: at })?;
        self.push(id, at)
    }

    fn memo_put(&mut self, key: u64, opcode: &'static str, at: usize) -> Result<(), PickleError> {
        let id = self.top(opcode, at)?;
        self.memo.insert(key, id);
        Ok(())
    }

    /// The shared node of the small int `v`.
    fn small_int(&mut self, v: u8, at: usize) -> Result<Id, PickleError> {
        let slot = usize::from(v);
        if self.small_ints[slot] == 0 {
            self.small_ints[slot] = self.alloc(Node::Int(i64::from(v)), at)?;
        }
        Ok(self.small_ints[slot])
    }

    /// Elements of a list/tuple/set node (copied, metered).
    fn items_of(&mut self, id: Id, what: &str, at: usize) -> Result<Vec<Id>, PickleError> {
        match self.nodes.get(id as usize) {
            Some(n) if n.seq_ids().is_some() => {
                charged(&mut self.budget, n.seq_ids().unwrap_or_default())
            }
            other => Err(invalid(
                at,
                format!(
                    "{what} expects a list, tuple or set, got a {}",
                    other.map_or("?", Node::kind)
                ),
            )),
        }
    }

    /// Pairs of a dict node (copied, metered).
    fn dict_pairs(&mut self, id: Id) -> Result<Vec<(Id, Id)>, PickleError> {
        match self.nodes.get(id as usize) {
            Some(Node::Dict(p)) => charged(&mut self.budget, p),
            _ => Ok(Vec::new()),
        }
    }

    /// Call `callable(*args)`: `REDUCE`, `NEWOBJ`, `INST`, `OBJ`.
    fn call(
        &mut self,
        callable: Id,
        args: Id,
        opcode: &'static str,
        at: usize,
    ) -> Result<Id, PickleError> {
        let gid = match self.node(callable) {
            Node::Global(gid) => *gid,
            other => {
                return Err(invalid(
                    at,
                    format!(
                        "{opcode} on a {} (only allow-listed globals can be called)",
                        other.kind()
                    ),
                ))
            }
        };
        let n_args = match self.nodes.get(args as usize).and_then(Node::tuple_ids) {
            Some(ids) => ids.len(),
            None => {
                return Err(invalid(
                    at,
                    format!(
                        "{opcode} arguments must be a tuple, got a {}",
                        self.nodes.get(args as usize).map_or("?", Node::kind)
                    ),
                ))
            }
        };
        self.budget.values(n_args)?;
        let (module, name) = self.global_name(gid);
        let builtin = builtin_of(module, name);
        if builtin == Builtin::Plain {
            // The common case (`torch.Size`, classes): no copy of the arguments, no name.
            let node = Node::Object {
                global: gid,
                args,
                state: None,
            };
            return self.alloc(node, at);
        }
        let qual = format!("{module}.{name}");
        let arg_ids = self.node(args).tuple_ids().unwrap_or_default().to_vec();
        let node = match (builtin, arg_ids.as_slice()) {
            (Builtin::Dict, []) => Node::Dict(Seq::new()),
            (Builtin::Dict, [src]) => {
                let src = *src;
                self.dict_from(src, &qual, at)?
            }
            (Builtin::Set, []) => Node::Set(Seq::new()),
            (Builtin::Set, [src]) => {
                let src = *src;
                Node::Set(self.items_of(src, &qual, at)?.into())
            }
            (Builtin::ByteArray, []) => Node::Bytes(Box::new([])),
            (Builtin::ByteArray, [src]) => match self.nodes.get(*src as usize) {
                Some(Node::Bytes(b)) => {
                    self.budget.bytes(b.len())?;
                    Node::Bytes(b.clone())
                }
                other => {
                    return Err(invalid(
                        at,
                        format!(
                            "{qual} of a {} is not supported",
                            other.map_or("?", Node::kind)
                        ),
                    ))
                }
            },
            (Builtin::ByteArray | Builtin::CodecsEncode, [text, encoding, rest @ ..])
                if rest.len() <= 1 =>
            {
                let (text, encoding) = (*text, *encoding);
                self.encode(text, Some(encoding), &qual, at)?
            }
            (Builtin::CodecsEncode, [text]) => {
                let text = *text;
                self.encode(text, None, &qual, at)?
            }
            _ => {
                return Err(invalid(
                    at,
                    format!("unsupported arguments ({}) to {qual}", arg_ids.len()),
                ))
            }
        };
        self.alloc(node, at)
    }

    /// `dict(src)` / `OrderedDict(src)`: a copy of a dict, or a dict of key/value pairs.
    fn dict_from(&mut self, src: Id, qual: &str, at: usize) -> Result<Node, PickleError> {
        if let Node::Dict(_) = self.node(src) {
            return Ok(Node::Dict(self.dict_pairs(src)?.into()));
        }
        let items = self.items_of(src, qual, at)?;
        let mut pairs = Vec::with_capacity(items.len());
        for item in items {
            let node = self.node(item);
            match node.list_ids() {
                Some(&[k, v]) => pairs.push((k, v)),
                _ => {
                    let other = node;
                    return Err(invalid(
                        at,
                        format!("{qual} expects key/value pairs, got a {}", other.kind()),
                    ));
                }
            }
        }
        Ok(Node::Dict(pairs.into()))
    }

    /// `_codecs.encode(text, encoding)` / `bytearray(text, encoding)`.
    fn encode(
        &mut self,
        text: Id,
        encoding: Option<Id>,
        qual: &str,
        at: usize,
    ) -> Result<Node, PickleError> {
        let encoding = match encoding {
            None => "utf-8".to_owned(),
            Some(e) => self
                .str_of(e)
                .ok_or_else(|| invalid(at, format!("{qual} encoding must be a str")))?
                .to_ascii_lowercase()
                .replace('_', "-"),
        };
        let text = match self.nodes.get(text as usize) {
            Some(Node::Str(s)) => s,
            _ => return Err(invalid(at, format!("{qual} expects a str"))),
        };
        self.budget.bytes(text.len())?;
        let bytes = match encoding.as_str() {
            "latin1" | "latin-1" | "iso-8859-1" | "iso8859-1" | "l1" => {
                let mut out = Vec::with_capacity(text.len());
                for c in text.chars() {
                    let b = u8::try_from(u32::from(c)).map_err(|_| {
                        invalid(at, format!("{qual}: character {c:?} is not latin-1"))
                    })?;
                    out.push(b);
                }
                out
            }
            "utf-8" | "utf8" => text.as_bytes().to_vec(),
            "ascii" | "us-ascii" => {
                if !text.is_ascii() {
                    return Err(invalid(at, format!("{qual}: text is not ascii")));
                }
                text.as_bytes().to_vec()
            }
            other => {
                return Err(invalid(
                    at,
                    format!("{qual}: unsupported encoding \"{}\"", short(other)),
                ))
            }
        };
        Ok(Node::Bytes(bytes.into()))
    }

    fn build(&mut self, at: usize) -> Result<(), PickleError> {
        let state = self.pop("BUILD", at)?;
        let inst = self.top("BUILD", at)?;
        let state_is_dict = match self.node(state) {
            Node::None => return Ok(()),
            Node::Dict(_) => true,
            _ => false,
        };
        match self.node(inst) {
            Node::Object { state: old, .. } => {
                let old = *old;
                let new_state = match old {
                    Some(old_id) if state_is_dict && matches!(self.node(old_id), Node::Dict(_)) => {
                        // Merge into a new dict: the old state may be shared through the memo.
                        let mut merged = self.dict_pairs(old_id)?;
                        merged.extend(self.dict_pairs(state)?);
                        self.alloc(Node::Dict(merged.into()), at)?
                    }
                    _ => state,
                };
                if let Node::Object { state: slot, .. } = self.node_mut(inst, at)? {
                    *slot = Some(new_state);
                }
                Ok(())
            }
            Node::Dict(_) => {
                if !state_is_dict {
                    let kind = self.node(state).kind();
                    return Err(invalid(at, format!("BUILD of a dict with a {kind} state")));
                }
                let new_pairs = self.dict_pairs(state)?;
                if let Node::Dict(pairs) = self.node_mut(inst, at)? {
                    pairs.extend(&new_pairs);
                }
                Ok(())
            }
            other => Err(invalid(at, format!("BUILD on a {}", other.kind()))),
        }
    }

    fn run(&mut self, data: &[u8]) -> Result<(Id, usize), PickleError> {
        use op::*;
        let mut r = Reader { data, pos: 0 };
        loop {
            let at = r.pos;
            let Some(code) = r.next_byte() else {
                return Err(PickleError::MissingStop { offset: at });
            };
            let name = match opcode_name(code) {
                Some(n) => n,
                None => {
                    return Err(PickleError::UnknownOpcode {
                        byte: code,
                        offset: at,
                    })
                }
            };
            match code {
                PROTO => {
                    let v = r.u8(name, at)?;
                    if v > HIGHEST_PROTOCOL {
                        return Err(invalid(at, format!("unsupported pickle protocol {v}")));
                    }
                    self.proto = v;
                }
                FRAME => {
                    let n = r.u64(name, at)?;
                    if n > r.remaining() as u64 {
                        return Err(PickleError::Truncated {
                            offset: at,
                            opcode: name,
                            needed: n.saturating_sub(r.remaining() as u64),
                        });
                    }
                }
                STOP => {
                    let root = self.pop(name, at)?;
                    return Ok((root, r.pos));
                }
                MARK => {
                    if self.marks.len() >= MAX_MARKS {
                        return Err(PickleError::Limit {
                            what: "MARK depth",
                            limit: MAX_MARKS,
                            offset: at,
                        });
                    }
                    self.marks.push(self.stack.len());
                }
                POP => {
                    if self.stack.len() > self.base() {
                        self.stack.pop();
                    } else {
                        self.pop_mark(name, at)?;
                    }
                }
                POP_MARK => {
                    self.pop_mark(name, at)?;
                }
                DUP => {
                    let id = self.top(name, at)?;
                    self.push(id, at)?;
                }
                NONE => self.push(NONE_ID, at)?,
                NEWTRUE => self.push(TRUE_ID, at)?,
                NEWFALSE => self.push(FALSE_ID, at)?,
                INT => {
                    let line = r.line(name, at)?;
                    let node = match line {
                        b"01" => Node::Bool(true),
                        b"00" => Node::Bool(false),
                        _ => parse_text_int(line, name, at)?,
                    };
                    self.push_node(node, at)?;
                }
                LONG => {
                    let line = r.line(name, at)?;
                    let line = line.strip_suffix(b"L").unwrap_or(line);
                    let node = parse_text_int(line, name, at)?;
                    self.push_node(node, at)?;
                }
                BININT => {
                    let v = r.i32(name, at)?;
                    self.push_node(Node::Int(i64::from(v)), at)?;
                }
                BININT1 => {
                    let v = r.u8(name, at)?;
                    let id = self.small_int(v, at)?;
                    self.push(id, at)?;
                }
                BININT2 => {
                    let v = r.u16(name, at)?;
                    self.push_node(Node::Int(i64::from(v)), at)?;
                }
                LONG1 => {
                    let n = r.u8(name, at)?;
                    let bytes = r.take(u64::from(n), name, at)?;
                    self.push_node(int_from_le(bytes), at)?;
                }
                LONG4 => {
                    let n = r.i32(name, at)?;
                    let n = u64::try_from(n)
                        .map_err(|_| invalid(at, format!("negative LONG4 length {n}")))?;
                    let bytes = r.take(n, name, at)?;
                    self.push_node(int_from_le(bytes), at)?;
                }
                FLOAT => {
                    let line = r.line(name, at)?;
                    let f = std::str::from_utf8(line)
                        .ok()
                        .and_then(|s| s.trim().parse::<f64>().ok())
                        .ok_or_else(|| invalid(at, "invalid FLOAT literal"))?;
                    self.push_node(Node::Float(f), at)?;
                }
                BINFLOAT => {
                    let f = f64::from_be_bytes(r.array(name, at)?);
                    self.push_node(Node::Float(f), at)?;
                }
                BINUNICODE | SHORT_BINUNICODE | BINUNICODE8 => {
                    let n = match code {
                        SHORT_BINUNICODE => u64::from(r.u8(name, at)?),
                        BINUNICODE => u64::from(r.u32(name, at)?),
                        _ => r.u64(name, at)?,
                    };
                    let bytes = r.take(n, name, at)?;
                    let s = std::str::from_utf8(bytes)
                        .map_err(|_| invalid(at, format!("invalid utf-8 in {name}")))?;
                    self.push_node(Node::Str(s.into()), at)?;
                }
                UNICODE => {
                    let line = r.line(name, at)?;
                    let s = decode_raw_unicode_escape(line)
                        .ok_or_else(|| invalid(at, "invalid raw-unicode-escape in UNICODE"))?;
                    self.push_node(Node::Str(s.into()), at)?;
                }
                BINSTRING | SHORT_BINSTRING | BINBYTES | SHORT_BINBYTES | BINBYTES8
                | BYTEARRAY8 => {
                    let n = match code {
                        SHORT_BINSTRING | SHORT_BINBYTES => u64::from(r.u8(name, at)?),
                        BINSTRING => {
                            let n = r.i32(name, at)?;
                            u64::try_from(n).map_err(|_| {
                                invalid(at, format!("negative BINSTRING length {n}"))
                            })?
                        }
                        BINBYTES => u64::from(r.u32(name, at)?),
                        _ => r.u64(name, at)?,
                    };
                    let bytes = r.take(n, name, at)?;
                    self.push_node(Node::Bytes(bytes.into()), at)?;
                }
                EMPTY_TUPLE => self.push(EMPTY_TUPLE_ID, at)?,
                TUPLE => {
                    let items = self.pop_mark_scratch(name, at)?;
                    let node = Node::tuple(&items);
                    self.scratch = items;
                    self.push_node(node, at)?;
                }
                TUPLE1 | TUPLE2 | TUPLE3 => {
                    let n = usize::from(code - TUPLE1) + 1;
                    let mut items = [0; 3];
                    for slot in items[..n].iter_mut().rev() {
                        *slot = self.pop(name, at)?;
                    }
                    self.push_node(Node::tuple(&items[..n]), at)?;
                }
                EMPTY_LIST => self.push_node(Node::List(Seq::new()), at)?,
                LIST => {
                    let items = self.pop_mark(name, at)?;
                    self.push_node(Node::List(items.into()), at)?;
                }
                APPEND => {
                    let v = self.pop(name, at)?;
                    let list = self.top(name, at)?;
                    match self.node_mut(list, at)? {
                        Node::List(items) => items.push(v),
                        other => {
                            let kind = other.kind();
                            return Err(invalid(at, format!("APPEND to a {kind}")));
                        }
                    }
                }
                APPENDS => {
                    let new = self.pop_mark_scratch(name, at)?;
                    let list = self.top(name, at)?;
                    match self.node_mut(list, at)? {
                        Node::List(items) => items.extend(&new),
                        other => {
                            let kind = other.kind();
                            return Err(invalid(at, format!("APPENDS to a {kind}")));
                        }
                    }
                    self.scratch = new;
                }
                EMPTY_DICT => self.push_node(Node::Dict(Seq::new()), at)?,
                DICT => {
                    let items = self.pop_mark(name, at)?;
                    let pairs = pairs_of(&items, name, at)?;
                    self.push_node(Node::Dict(pairs.into()), at)?;
                }
                SETITEM => {
                    let v = self.pop(name, at)?;
                    let k = self.pop(name, at)?;
                    let dict = self.top(name, at)?;
                    match self.node_mut(dict, at)? {
                        Node::Dict(pairs) => pairs.push((k, v)),
                        other => {
                            let kind = other.kind();
                            return Err(invalid(at, format!("SETITEM on a {kind}")));
                        }
                    }
                }
                SETITEMS => {
                    let items = self.pop_mark_scratch(name, at)?;
                    let mut new = std::mem::take(&mut self.scratch_pairs);
                    pairs_into(&items, name, at, &mut new)?;
                    self.scratch = items;
                    let dict = self.top(name, at)?;
                    match self.node_mut(dict, at)? {
                        Node::Dict(pairs) => pairs.extend(&new),
                        other => {
                            let kind = other.kind();
                            return Err(invalid(at, format!("SETITEMS on a {kind}")));
                        }
                    }
                    self.scratch_pairs = new;
                }
                EMPTY_SET => self.push_node(Node::Set(Seq::new()), at)?,
                ADDITEMS => {
                    let new = self.pop_mark(name, at)?;
                    let set = self.top(name, at)?;
                    match self.node_mut(set, at)? {
                        Node::Set(items) => items.extend(&new),
                        other => {
                            let kind = other.kind();
                            return Err(invalid(at, format!("ADDITEMS on a {kind}")));
                        }
                    }
                }
                FROZENSET => {
                    let items = self.pop_mark(name, at)?;
                    self.push_node(Node::Set(items.into()), at)?;
                }
                GLOBAL | INST => {
                    let module = r.line(name, at)?;
                    let gname = r.line(name, at)?;
                    let module = std::str::from_utf8(module)
                        .map_err(|_| invalid(at, format!("invalid utf-8 in {name} module")))?;
                    let gname = std::str::from_utf8(gname)
                        .map_err(|_| invalid(at, format!("invalid utf-8 in {name} name")))?;
                    let gid = self.resolve_global(module, gname, at)?;
                    let global = self.alloc(Node::Global(gid), at)?;
                    if code == GLOBAL {
                        self.push(global, at)?;
                    } else {
                        let args = self.pop_mark(name, at)?;
                        let args = self.alloc(Node::tuple(&args), at)?;
                        let obj = self.call(global, args, name, at)?;
                        self.push(obj, at)?;
                    }
                }
                STACK_GLOBAL => {
                    let gname = self.pop(name, at)?;
                    let module = self.pop(name, at)?;
                    let (Some(module), Some(gname)) = (self.str_of(module), self.str_of(gname))
                    else {
                        return Err(invalid(at, "STACK_GLOBAL needs two str"));
                    };
                    let (module, gname) = (module.to_owned(), gname.to_owned());
                    self.budget
                        .bytes(module.len().saturating_add(gname.len()))?;
                    let gid = self.resolve_global(&module, &gname, at)?;
                    self.push_node(Node::Global(gid), at)?;
                }
                OBJ => {
                    let mut items = self.pop_mark(name, at)?;
                    if items.is_empty() {
                        return Err(PickleError::StackUnderflow {
                            opcode: name,
                            offset: at,
                        });
                    }
                    let cls = items.remove(0);
                    let args = self.alloc(Node::tuple(&items), at)?;
                    let obj = self.call(cls, args, name, at)?;
                    self.push(obj, at)?;
                }
                REDUCE | NEWOBJ => {
                    let args = self.pop(name, at)?;
                    let callable = self.pop(name, at)?;
                    let obj = self.call(callable, args, name, at)?;
                    self.push(obj, at)?;
                }
                NEWOBJ_EX => {
                    let kwargs = self.pop(name, at)?;
                    let args = self.pop(name, at)?;
                    let cls = self.pop(name, at)?;
                    match self.node(kwargs) {
                        Node::Dict(p) if p.is_empty() => {}
                        Node::Dict(_) => {
                            return Err(invalid(
                                at,
                                "NEWOBJ_EX with keyword arguments is not supported",
                            ))
                        }
                        other => {
                            return Err(invalid(
                                at,
                                format!(
                                    "NEWOBJ_EX keyword arguments must be a dict, got a {}",
                                    other.kind()
                                ),
                            ))
                        }
                    }
                    let obj = self.call(cls, args, name, at)?;
                    self.push(obj, at)?;
                }
                BUILD => self.build(at)?,
                PUT => {
                    let line = r.line(name, at)?;
                    let key = parse_memo_key(line, name, at)?;
                    self.memo_put(key, name, at)?;
                }
                BINPUT => {
                    let key = r.u8(name, at)?;
                    self.memo_put(u64::from(key), name, at)?;
                }
                LONG_BINPUT => {
                    let key = r.u32(name, at)?;
                    self.memo_put(u64::from(key), name, at)?;
                }
                MEMOIZE => {
                    let key = self.memo.len();
                    self.memo_put(key, name, at)?;
                }
                GET => {
                    let line = r.line(name, at)?;
                    let key = parse_memo_key(line, name, at)?;
                    self.memo_get(key, at)?;
                }
                BINGET => {
                    let key = r.u8(name, at)?;
                    self.memo_get(u64::from(key), at)?;
                }
                LONG_BINGET => {
                    let key = r.u32(name, at)?;
                    self.memo_get(u64::from(key), at)?;
                }
                PERSID => {
                    let line = r.line(name, at)?;
                    let s = std::str::from_utf8(line)
                        .ok()
                        .filter(|s| s.is_ascii())
                        .ok_or_else(|| invalid(at, "PERSID id must be ascii"))?;
                    let pid = self.alloc(Node::Str(s.into()), at)?;
                    self.push_node(Node::PersistentId(pid), at)?;
                }
                BINPERSID => {
                    let pid = self.pop(name, at)?;
                    self.push_node(Node::PersistentId(pid), at)?;
                }
                // Known opcodes this reader does not implement: STRING (protocol 0 quoted
                // repr), EXT1/2/4 (copyreg extension registry), NEXT_BUFFER/READONLY_BUFFER
                // (protocol 5 out-of-band buffers).
                _ => {
                    return Err(PickleError::UnsupportedOpcode {
                        opcode: name,
                        offset: at,
                    })
                }
            }
        }
    }

    /// Size of the tree that `materialize(root)` would build, computed over the DAG without
    /// building it, so that expansion bombs fail before anything is allocated for them.
    fn check_expansion(&mut self, root: Id) -> Result<(), PickleError> {
        let mut sizes = Sizes {
            nodes: &self.nodes,
            globals: &self.global_table,
            shared: shared_nodes(&self.nodes),
            done: HashMap::new(),
            state: vec![0; self.nodes.len()],
        };
        let (values, bytes) = sizes.of(root, 0)?;
        // Charged up front; `materialize` then runs on a fresh meter with what is left.
        self.budget
            .values(usize::try_from(values).unwrap_or(usize::MAX))?;
        self.budget
            .bytes(usize::try_from(bytes).unwrap_or(usize::MAX))?;
        Ok(())
    }

    fn materialize(&mut self, root: Id) -> Result<Value, PickleError> {
        self.check_expansion(root)?;
        let mut budget = Budget {
            values: 0,
            value_limit: self.budget.value_limit,
            bytes: 0,
            byte_limit: self.budget.byte_limit,
        };
        let mut m = Materializer {
            nodes: &self.nodes,
            globals: &self.global_table,
            on_path: vec![false; self.nodes.len()],
            budget: &mut budget,
        };
        m.value(root, 0)
    }
}

fn charged<T: Clone>(budget: &mut Budget, items: &[T]) -> Result<Vec<T>, PickleError> {
    budget.values(items.len())?;
    Ok(items.to_vec())
}

fn pairs_of(items: &[Id], opcode: &'static str, at: usize) -> Result<Vec<(Id, Id)>, PickleError> {
    let mut out = Vec::with_capacity(items.len() / 2);
    pairs_into(items, opcode, at, &mut out)?;
    Ok(out)
}

/// [`pairs_of`] into `out` (cleared first).
fn pairs_into(
    items: &[Id],
    opcode: &'static str,
    at: usize,
    out: &mut Vec<(Id, Id)>,
) -> Result<(), PickleError> {
    if items.len() % 2 != 0 {
        return Err(invalid(at, format!("odd number of items for {opcode}")));
    }
    out.clear();
    out.extend(items.chunks_exact(2).filter_map(|kv| match kv {
        [k, v] => Some((*k, *v)),
        _ => None,
    }));
    Ok(())
}

fn parse_memo_key(line: &[u8], opcode: &'static str, at: usize) -> Result<u64, PickleError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| invalid(at, format!("invalid {opcode} memo key")))
}

/// Little-endian two's complement bytes (`LONG1`/`LONG4`) → `Int` or minimal `BigInt`.
fn int_from_le(bytes: &[u8]) -> Node {
    let mut len = bytes.len();
    // Drop redundant sign-extension bytes.
    while len > 1 {
        let (Some(&last), Some(&prev)) = (bytes.get(len - 1), bytes.get(len - 2)) else {
            break;
        };
        let redundant = (last == 0x00 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
        if !redundant {
            break;
        }
        len -= 1;
    }
    let bytes = bytes.get(..len).unwrap_or(&[]);
    if bytes.is_empty() {
        return Node::Int(0);
    }
    if bytes.len() <= 8 {
        let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
        let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
        for (dst, src) in buf.iter_mut().zip(bytes) {
            *dst = *src;
        }
        return Node::Int(i64::from_le_bytes(buf));
    }
    Node::BigInt(bytes.into())
}

/// Decimal text (`INT`/`LONG`) → `Int` or `BigInt`.
fn parse_text_int(line: &[u8], opcode: &'static str, at: usize) -> Result<Node, PickleError> {
    let bad = || invalid(at, format!("invalid {opcode} literal"));
    let text = std::str::from_utf8(line).map_err(|_| bad())?.trim();
    if let Ok(v) = text.parse::<i64>() {
        return Ok(Node::Int(v));
    }
    let (negative, digits) = match text.as_bytes() {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        rest => (false, rest),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(bad());
    }
    if digits.len() > MAX_TEXT_INT_DIGITS {
        return Err(invalid(
            at,
            format!("{opcode} literal longer than {MAX_TEXT_INT_DIGITS} digits"),
        ));
    }
    // Magnitude, little-endian base 256.
    let mut mag: Vec<u8> = Vec::new();
    for d in digits {
        let mut carry = u32::from(d - b'0');
        for limb in mag.iter_mut() {
            let v = u32::from(*limb) * 10 + carry;
            *limb = (v & 0xff) as u8;
            carry = v >> 8;
        }
        while carry > 0 {
            mag.push((carry & 0xff) as u8);
            carry >>= 8;
        }
    }
    // Room for the sign bit.
    mag.push(0);
    if negative {
        // Two's complement: invert and add one.
        let mut carry = 1u16;
        for limb in mag.iter_mut() {
            let v = u16::from(!*limb) + carry;
            *limb = (v & 0xff) as u8;
            carry = v >> 8;
        }
    }
    Ok(int_from_le(&mag))
}

/// Python's `raw-unicode-escape` as written by protocol 0 `UNICODE`: bytes are latin-1
/// characters, except `\uXXXX` and `\UXXXXXXXX` escapes.
fn decode_raw_unicode_escape(line: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while let Some(&b) = line.get(i) {
        if b == b'\\' {
            let width = match line.get(i + 1) {
                Some(b'u') => 4,
                Some(b'U') => 8,
                _ => 0,
            };
            if width > 0 {
                let hex = line.get(i + 2..i + 2 + width)?;
                let hex = std::str::from_utf8(hex).ok()?;
                let cp = u32::from_str_radix(hex, 16).ok()?;
                out.push(char::from_u32(cp)?);
                i += 2 + width;
                continue;
            }
        }
        out.push(char::from(b));
        i += 1;
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// Materialisation

/// Memoised (values, string bytes) of the tree each node expands to; same counting rules as
/// `Materializer` (a dict also counts one per pair, an object's argument tuple is not a value).
struct Sizes<'a> {
    nodes: &'a [Node],
    globals: &'a [(String, String)],
    /// Per node, true when more than one value refers to it (see [`shared_nodes`]).
    shared: Vec<bool>,
    /// Tree sizes of the shared containers and objects computed so far (a leaf's size is
    /// its own, so leaves are only marked [`SEEN`] in `state`).
    done: HashMap<Id, (u64, u64)>,
    /// Per node, [`ON_PATH`] while its tree is being sized, [`SEEN`] once a leaf was sized.
    state: Vec<u8>,
}

/// [`Sizes::state`]: the node is on the path being sized (met again, it contains itself).
const ON_PATH: u8 = 1;
/// [`Sizes::state`]: the leaf was sized before.
const SEEN: u8 = 2;

/// Per node, whether more than one container, object or persistent id refers to it. Only
/// those can be reached twice, so only their tree sizes need remembering: a table for every
/// node cost 24 bytes per value (half a gigabyte for a million-chunk DCP `.metadata`).
fn shared_nodes(nodes: &[Node]) -> Vec<bool> {
    let mut refs = vec![0u8; nodes.len()];
    let mut count = |id: Id| {
        if let Some(r) = refs.get_mut(id as usize) {
            *r = r.saturating_add(1);
        }
    };
    for n in nodes {
        match n {
            Node::List(_) | Node::SmallTuple { .. } | Node::Tuple(_) | Node::Set(_) => n
                .seq_ids()
                .unwrap_or_default()
                .iter()
                .for_each(|&i| count(i)),
            Node::Dict(pairs) => pairs.iter().for_each(|&(k, v)| {
                count(k);
                count(v)
            }),
            Node::Object { args, state, .. } => {
                count(*args);
                if let Some(s) = state {
                    count(*s);
                }
            }
            Node::PersistentId(p) => count(*p),
            _ => {}
        }
    }
    refs.into_iter().map(|r| r > 1).collect()
}

impl Sizes<'_> {
    /// String bytes of the global `gid` (module and name).
    fn global_len(&self, gid: u32) -> u64 {
        self.globals
            .get(gid as usize)
            .map_or(0, |(m, n)| m.len().saturating_add(n.len()) as u64)
    }

    /// The tree size of a leaf (a value without children), `None` for other nodes.
    fn leaf(&self, node: &Node) -> Option<(u64, u64)> {
        let bytes = match node {
            Node::None | Node::Bool(_) | Node::Int(_) | Node::Float(_) => 0,
            Node::BigInt(b) | Node::Bytes(b) => b.len() as u64,
            Node::Str(s) => s.len() as u64,
            Node::Global(gid) => self.global_len(*gid),
            _ => return None,
        };
        Some((1, bytes))
    }

    fn of(&mut self, id: Id, depth: usize) -> Result<(u64, u64), PickleError> {
        let slot = id as usize;
        let nodes = self.nodes;
        let node = nodes.get(slot).unwrap_or(&Node::None);
        let shared = self.shared.get(slot).copied().unwrap_or(false);
        if let Some(size) = self.leaf(node) {
            // As for containers, a shared leaf sized before is not checked for depth again.
            let state = self.state.get_mut(slot);
            let seen = state.as_ref().is_some_and(|s| **s & SEEN != 0);
            if depth >= MAX_DEPTH && !(shared && seen) {
                return Err(PickleError::TooDeep { limit: MAX_DEPTH });
            }
            if let Some(s) = state {
                *s |= SEEN;
            }
            return Ok(size);
        }
        if shared {
            if let Some(known) = self.done.get(&id) {
                return Ok(*known);
            }
        }
        if depth >= MAX_DEPTH {
            return Err(PickleError::TooDeep { limit: MAX_DEPTH });
        }
        if self.state.get(slot).is_some_and(|s| s & ON_PATH != 0) {
            return Err(PickleError::Recursive { kind: node.kind() });
        }
        if let Some(s) = self.state.get_mut(slot) {
            *s |= ON_PATH;
        }
        let mut values = 1u64;
        let mut bytes = 0u64;
        let mut children: &[Id] = &[];
        let mut extra: [Option<Id>; 1] = [None];
        match node {
            Node::None
            | Node::Bool(_)
            | Node::Int(_)
            | Node::Float(_)
            | Node::BigInt(_)
            | Node::Bytes(_)
            | Node::Str(_)
            | Node::Global(_) => {}
            Node::List(_) | Node::SmallTuple { .. } | Node::Tuple(_) | Node::Set(_) => {
                children = node.seq_ids().unwrap_or_default()
            }
            Node::Dict(pairs) => {
                values = values.saturating_add(pairs.len() as u64);
                for &(k, v) in pairs.iter() {
                    for child in [k, v] {
                        let (cv, cb) = self.of(child, depth + 1)?;
                        values = values.saturating_add(cv);
                        bytes = bytes.saturating_add(cb);
                    }
                }
            }
            Node::Object {
                global,
                args,
                state,
            } => {
                bytes = self.global_len(*global);
                if let Some(ids) = nodes.get(*args as usize).and_then(Node::tuple_ids) {
                    children = ids;
                }
                extra[0] = *state;
            }
            Node::PersistentId(pid) => extra[0] = Some(*pid),
        }
        for &child in children.iter().chain(extra.iter().flatten()) {
            let (cv, cb) = self.of(child, depth + 1)?;
            values = values.saturating_add(cv);
            bytes = bytes.saturating_add(cb);
        }
        if let Some(s) = self.state.get_mut(slot) {
            *s &= !ON_PATH;
        }
        if shared {
            self.done.insert(id, (values, bytes));
        }
        Ok((values, bytes))
    }
}

struct Materializer<'a> {
    nodes: &'a [Node],
    globals: &'a [(String, String)],
    on_path: Vec<bool>,
    budget: &'a mut Budget,
}

/// Hashable view of a simple dict key, for Python's "a key set twice keeps its first position
/// and its last value".
#[derive(PartialEq, Eq, Hash)]
enum KeyRef<'a> {
    Str(&'a str),
    Int(i64),
    Bytes(&'a [u8]),
}

impl<'a> Materializer<'a> {
    fn node(&self, id: Id) -> &'a Node {
        self.nodes.get(id as usize).unwrap_or(&Node::None)
    }

    fn key_ref(&self, id: Id) -> Option<KeyRef<'a>> {
        match self.node(id) {
            Node::Str(s) => Some(KeyRef::Str(s)),
            Node::Int(i) => Some(KeyRef::Int(*i)),
            Node::Bytes(b) => Some(KeyRef::Bytes(b)),
            _ => None,
        }
    }

    fn global(&mut self, gid: u32) -> Result<(String, String), PickleError> {
        let (m, n) = self
            .globals
            .get(gid as usize)
            .map(|(m, n)| (m.as_str(), n.as_str()))
            .unwrap_or(("?", "?"));
        self.budget.bytes(m.len().saturating_add(n.len()))?;
        Ok((m.to_owned(), n.to_owned()))
    }

    fn list(&mut self, ids: &[Id], depth: usize) -> Result<Vec<Value>, PickleError> {
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            out.push(self.value(id, depth)?);
        }
        Ok(out)
    }

    fn value(&mut self, id: Id, depth: usize) -> Result<Value, PickleError> {
        if depth >= MAX_DEPTH {
            return Err(PickleError::TooDeep { limit: MAX_DEPTH });
        }
        self.budget.values(1)?;
        let node = self.node(id);
        let slot = id as usize;
        if self.on_path.get(slot).copied().unwrap_or(false) {
            return Err(PickleError::Recursive { kind: node.kind() });
        }
        if let Some(flag) = self.on_path.get_mut(slot) {
            *flag = true;
        }
        let result = self.value_inner(node, depth + 1);
        if let Some(flag) = self.on_path.get_mut(slot) {
            *flag = false;
        }
        result
    }

    fn value_inner(&mut self, node: &'a Node, depth: usize) -> Result<Value, PickleError> {
        Ok(match node {
            Node::None => Value::None,
            Node::Bool(b) => Value::Bool(*b),
            Node::Int(i) => Value::Int(*i),
            Node::BigInt(b) => {
                self.budget.bytes(b.len())?;
                Value::BigInt(b.to_vec())
            }
            Node::Float(f) => Value::Float(*f),
            Node::Str(s) => {
                self.budget.bytes(s.len())?;
                Value::Str(s.to_string())
            }
            Node::Bytes(b) => {
                self.budget.bytes(b.len())?;
                Value::Bytes(b.to_vec())
            }
            Node::List(ids) => Value::List(self.list(ids, depth)?),
            Node::SmallTuple { .. } | Node::Tuple(_) => {
                Value::Tuple(self.list(node.tuple_ids().unwrap_or_default(), depth)?)
            }
            Node::Set(ids) => Value::Set(self.list(ids, depth)?),
            Node::Dict(pairs) => {
                self.budget.values(pairs.len())?;
                // Keep the first position and the last value of a repeated simple key.
                let mut kept: Vec<(Id, Id)> = Vec::with_capacity(pairs.len());
                let mut index: HashMap<KeyRef<'a>, usize> = HashMap::new();
                for &(k, v) in pairs.iter() {
                    match self.key_ref(k) {
                        Some(key) => match index.get(&key) {
                            Some(&pos) => {
                                if let Some(slot) = kept.get_mut(pos) {
                                    slot.1 = v;
                                }
                            }
                            None => {
                                index.insert(key, kept.len());
                                kept.push((k, v));
                            }
                        },
                        None => kept.push((k, v)),
                    }
                }
                let mut out = Vec::with_capacity(kept.len());
                for (k, v) in kept {
                    let key = self.value(k, depth)?;
                    let val = self.value(v, depth)?;
                    out.push((key, val));
                }
                Value::Dict(out)
            }
            Node::Global(gid) => {
                let (module, name) = self.global(*gid)?;
                Value::Global { module, name }
            }
            Node::Object {
                global,
                args,
                state,
            } => {
                let (module, name) = self.global(*global)?;
                let args = match self.node(*args).tuple_ids() {
                    Some(ids) => self.list(ids, depth)?,
                    None => Vec::new(),
                };
                let state = match state {
                    Some(s) => Some(Box::new(self.value(*s, depth)?)),
                    None => None,
                };
                Value::Object {
                    module,
                    name,
                    args,
                    state,
                }
            }
            Node::PersistentId(pid) => Value::PersistentId(Box::new(self.value(*pid, depth)?)),
        })
    }
}

// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests;
