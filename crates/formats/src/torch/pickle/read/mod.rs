//! The reader: a bounded, allow-listing VM that turns a pickle's opcode stream into a
//! [`Value`] tree (see the [module docs](super) for its safety model).

mod arena;
mod budget;
mod cursor;
mod graph;
mod materialize;
mod memo;

use super::op;
use super::{Globals, Value};
use crate::torch::short;
use arena::{Id, Node, Seq, EMPTY_TUPLE_ID, FALSE_ID, NONE_ID, TRUE_ID};
use budget::{charged, tree_size, Budget};
use cursor::Reader;
pub use graph::{Graph, Obj};
use memo::Memo;
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
        let mut r = Reader::new(data);
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
        let (values, bytes) = tree_size(&self.nodes, &self.global_table, root)?;
        // Charged up front; `materialize` then runs on a fresh meter with what is left.
        self.budget
            .values(usize::try_from(values).unwrap_or(usize::MAX))?;
        self.budget
            .bytes(usize::try_from(bytes).unwrap_or(usize::MAX))?;
        Ok(())
    }

    fn materialize(&mut self, root: Id) -> Result<Value, PickleError> {
        self.check_expansion(root)?;
        let mut budget = self.budget.unspent();
        materialize::tree(&self.nodes, &self.global_table, &mut budget, root)
    }
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

// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests;
