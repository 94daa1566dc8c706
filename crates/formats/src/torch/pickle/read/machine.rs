//! The VM: its state ([`Machine`]), the arena and stack primitives every opcode uses, the
//! dispatch loop ([`Machine::run`]) and the opcodes that work the stack itself (protocol and
//! framing, `MARK`, `POP`, `DUP`). The other opcode families are `impl Machine` blocks of their
//! own modules: `scalars` (ints, floats, strings, bytes), `containers` (tuples, lists, dicts,
//! sets), `objects` (globals, calls, `BUILD`, persistent ids) and `memo`.

use super::arena::{Id, Node, Seq, EMPTY_TUPLE_ID, FALSE_ID, NONE_ID, TRUE_ID};
use super::budget::{tree_size, Budget};
use super::cursor::Reader;
use super::memo::Memo;
use super::{invalid, materialize, op, Globals, PickleError, Value};
use super::{HIGHEST_PROTOCOL, MAX_MARKS, MAX_STACK};
use std::collections::HashMap;

/// What executing one opcode gives: nothing, or why the pickle cannot be decoded.
pub(super) type Step = Result<(), PickleError>;

/// How often [`Machine::run_consuming`] reports the input it is done with.
pub(super) const CONSUMED_STEP: usize = 8 << 20;

/// The VM's state while it runs a pickle: the arena of values, the stack and its marks, the
/// memo, the globals met so far and the budget.
pub(super) struct Machine<'g> {
    /// The allow-list of globals.
    pub(super) globals: &'g Globals,
    /// The arena: every value made, indexed by [`Id`].
    pub(super) nodes: Vec<Node>,
    /// The VM stack.
    pub(super) stack: Vec<Id>,
    /// Stack lengths at each open `MARK`.
    pub(super) marks: Vec<usize>,
    /// The memo.
    pub(super) memo: Memo,
    /// Node of each `BININT1` value met so far (0 = none yet): ints are immutable, so the
    /// tens of small ints per chunk of a DCP `.metadata` share nodes.
    pub(super) small_ints: [Id; 256],
    /// `(module, name)` of each global met, indexed by `Node::Global`'s number.
    pub(super) global_table: Vec<(String, String)>,
    /// Number of each global in `global_table`.
    pub(super) global_index: HashMap<(String, String), u32>,
    /// The protocol announced by `PROTO` (0 without one).
    pub(super) proto: u8,
    /// The size budget, charged while interpreting.
    pub(super) budget: Budget,
    /// Buffers reused by the opcodes that pop a MARK most (`TUPLE`, `APPENDS`, `SETITEMS`).
    pub(super) scratch: Vec<Id>,
    /// See `scratch`.
    pub(super) scratch_pairs: Vec<(Id, Id)>,
}

impl<'g> Machine<'g> {
    /// A VM with an empty stack, checking globals against `globals`.
    pub(super) fn new(globals: &'g Globals, budget: Budget) -> Self {
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

    /// Run the opcodes of `data` up to `STOP`: the id of the unpickled value and the number
    /// of bytes consumed.
    pub(super) fn run(&mut self, data: &[u8]) -> Result<(Id, usize), PickleError> {
        self.run_consuming(data, |_| {})
    }

    /// [`Machine::run`], calling `consumed(n)` about every [`CONSUMED_STEP`] bytes once the
    /// opcodes before byte `n` are done: no value refers to the input (strings and bytes are
    /// copied into the arena), so the caller may drop those bytes' pages.
    pub(super) fn run_consuming(
        &mut self,
        data: &[u8],
        mut consumed: impl FnMut(usize),
    ) -> Result<(Id, usize), PickleError> {
        use op::*;
        let mut r = Reader::new(data);
        let mut next = CONSUMED_STEP;
        loop {
            let at = r.pos;
            if at >= next {
                consumed(at);
                next = at.saturating_add(CONSUMED_STEP);
            }
            let Some(code) = r.next_byte() else {
                return Err(PickleError::MissingStop { offset: at });
            };
            let name = opcode_name(code).ok_or(PickleError::UnknownOpcode {
                byte: code,
                offset: at,
            })?;
            let r = &mut r;
            match code {
                PROTO => self.proto(r, name, at)?,
                FRAME => frame(r, name, at)?,
                STOP => return Ok((self.pop(name, at)?, r.pos)),
                MARK => self.mark(at)?,
                POP => self.pop_any(name, at)?,
                POP_MARK => drop(self.pop_mark(name, at)?),
                DUP => self.dup(name, at)?,
                NONE => self.push(NONE_ID, at)?,
                NEWTRUE => self.push(TRUE_ID, at)?,
                NEWFALSE => self.push(FALSE_ID, at)?,
                INT => self.int(r, name, at)?,
                LONG => self.long(r, name, at)?,
                BININT => self.binint(r, name, at)?,
                BININT1 => self.binint1(r, name, at)?,
                BININT2 => self.binint2(r, name, at)?,
                LONG1 | LONG4 => self.long_binary(code, r, name, at)?,
                FLOAT => self.float(r, name, at)?,
                BINFLOAT => self.binfloat(r, name, at)?,
                BINUNICODE | SHORT_BINUNICODE | BINUNICODE8 => {
                    self.binunicode(code, r, name, at)?
                }
                UNICODE => self.unicode(r, name, at)?,
                BINSTRING | SHORT_BINSTRING | BINBYTES | SHORT_BINBYTES | BINBYTES8
                | BYTEARRAY8 => self.binbytes(code, r, name, at)?,
                EMPTY_TUPLE => self.push(EMPTY_TUPLE_ID, at)?,
                TUPLE => self.tuple(name, at)?,
                TUPLE1 | TUPLE2 | TUPLE3 => self.tuple_n(code, name, at)?,
                EMPTY_LIST => self.push_node(Node::List(Seq::new()), at)?,
                LIST => self.list(name, at)?,
                APPEND => self.append(name, at)?,
                APPENDS => self.appends(name, at)?,
                EMPTY_DICT => self.push_node(Node::Dict(Seq::new()), at)?,
                DICT => self.dict(name, at)?,
                SETITEM => self.setitem(name, at)?,
                SETITEMS => self.setitems(name, at)?,
                EMPTY_SET => self.push_node(Node::Set(Seq::new()), at)?,
                ADDITEMS => self.additems(name, at)?,
                FROZENSET => self.frozenset(name, at)?,
                GLOBAL | INST => self.global_or_inst(code, r, name, at)?,
                STACK_GLOBAL => self.stack_global(name, at)?,
                OBJ => self.obj(name, at)?,
                REDUCE | NEWOBJ => self.reduce(name, at)?,
                NEWOBJ_EX => self.newobj_ex(name, at)?,
                BUILD => self.build(at)?,
                PUT => self.put_text(r, name, at)?,
                BINPUT => self.memo_put(u64::from(r.u8(name, at)?), name, at)?,
                LONG_BINPUT => self.memo_put(u64::from(r.u32(name, at)?), name, at)?,
                MEMOIZE => self.memo_put(self.memo.len(), name, at)?,
                GET => self.get_text(r, name, at)?,
                BINGET => self.memo_get(u64::from(r.u8(name, at)?), at)?,
                LONG_BINGET => self.memo_get(u64::from(r.u32(name, at)?), at)?,
                PERSID => self.persid(r, name, at)?,
                BINPERSID => self.binpersid(name, at)?,
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
    pub(super) fn check_expansion(&mut self, root: Id) -> Step {
        let (values, bytes) = tree_size(&self.nodes, &self.global_table, root)?;
        // Charged up front; `materialize` then runs on a fresh meter with what is left.
        self.budget
            .values(usize::try_from(values).unwrap_or(usize::MAX))?;
        self.budget
            .bytes(usize::try_from(bytes).unwrap_or(usize::MAX))?;
        Ok(())
    }

    /// The [`Value`] tree of `root` (after [`Machine::check_expansion`]).
    pub(super) fn materialize(&mut self, root: Id) -> Result<Value, PickleError> {
        self.check_expansion(root)?;
        let mut budget = self.budget.unspent();
        materialize::tree(&self.nodes, &self.global_table, &mut budget, root)
    }
}

// ---------------------------------------------------------------------------------------------
// Arena and stack primitives

impl Machine<'_> {
    /// The node `id`.
    #[inline]
    pub(super) fn node(&self, id: Id) -> &Node {
        // Ids are only ever made by `alloc`, so this never falls back; `None` keeps it total.
        self.nodes.get(id as usize).unwrap_or(&Node::None)
    }

    /// The node `id`, to mutate.
    #[inline]
    pub(super) fn node_mut(&mut self, id: Id, at: usize) -> Result<&mut Node, PickleError> {
        self.nodes
            .get_mut(id as usize)
            .ok_or_else(|| invalid(at, "dangling value reference"))
    }

    /// Add `node` to the arena.
    #[inline]
    pub(super) fn alloc(&mut self, node: Node, at: usize) -> Result<Id, PickleError> {
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

    /// Push `id` on the stack.
    #[inline]
    pub(super) fn push(&mut self, id: Id, at: usize) -> Step {
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

    /// Add `node` to the arena and push it.
    #[inline]
    pub(super) fn push_node(&mut self, node: Node, at: usize) -> Step {
        let id = self.alloc(node, at)?;
        self.push(id, at)
    }

    /// Stack length at the innermost open `MARK` (0 without one).
    #[inline]
    fn base(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    /// Pop the top of the stack (above the innermost `MARK`).
    #[inline]
    pub(super) fn pop(&mut self, opcode: &'static str, at: usize) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(PickleError::StackUnderflow { opcode, offset: at });
        }
        self.stack
            .pop()
            .ok_or(PickleError::StackUnderflow { opcode, offset: at })
    }

    /// The top of the stack (above the innermost `MARK`).
    #[inline]
    pub(super) fn top(&self, opcode: &'static str, at: usize) -> Result<Id, PickleError> {
        if self.stack.len() <= self.base() {
            return Err(PickleError::StackUnderflow { opcode, offset: at });
        }
        self.stack
            .last()
            .copied()
            .ok_or(PickleError::StackUnderflow { opcode, offset: at })
    }

    /// Pop the innermost `MARK`: where its values start on the stack.
    #[inline]
    fn take_mark(&mut self, opcode: &'static str, at: usize) -> Result<usize, PickleError> {
        self.marks
            .pop()
            .ok_or(PickleError::MissingMark { opcode, offset: at })
    }

    /// Pop the innermost `MARK` and the values above it.
    #[inline]
    pub(super) fn pop_mark(
        &mut self,
        opcode: &'static str,
        at: usize,
    ) -> Result<Vec<Id>, PickleError> {
        let mark = self.take_mark(opcode, at)?;
        if mark > self.stack.len() {
            return Err(PickleError::StackUnderflow { opcode, offset: at });
        }
        Ok(self.stack.split_off(mark))
    }

    /// [`Machine::pop_mark`] into the reused buffer `scratch`; give it back when done.
    #[inline]
    pub(super) fn pop_mark_scratch(
        &mut self,
        opcode: &'static str,
        at: usize,
    ) -> Result<Vec<Id>, PickleError> {
        let mark = self.take_mark(opcode, at)?;
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
}

// ---------------------------------------------------------------------------------------------
// Protocol, framing and the stack opcodes

impl Machine<'_> {
    /// `PROTO`: the protocol the rest of the pickle follows.
    #[inline]
    fn proto(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let v = r.u8(name, at)?;
        if v > HIGHEST_PROTOCOL {
            return Err(invalid(at, format!("unsupported pickle protocol {v}")));
        }
        self.proto = v;
        Ok(())
    }

    /// `MARK`: open a mark at the current stack length.
    #[inline]
    fn mark(&mut self, at: usize) -> Step {
        if self.marks.len() >= MAX_MARKS {
            return Err(PickleError::Limit {
                what: "MARK depth",
                limit: MAX_MARKS,
                offset: at,
            });
        }
        self.marks.push(self.stack.len());
        Ok(())
    }

    /// `POP`: drop the top of the stack, or close an empty `MARK` (as Python does).
    #[inline]
    fn pop_any(&mut self, name: &'static str, at: usize) -> Step {
        if self.stack.len() > self.base() {
            self.stack.pop();
        } else {
            self.pop_mark(name, at)?;
        }
        Ok(())
    }

    /// `DUP`: push the top of the stack again.
    #[inline]
    fn dup(&mut self, name: &'static str, at: usize) -> Step {
        let id = self.top(name, at)?;
        self.push(id, at)
    }
}

/// `FRAME`: only checked against the input left (frames need no buffering here).
#[inline]
fn frame(r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
    let n = r.u64(name, at)?;
    if n > r.remaining() as u64 {
        return Err(PickleError::Truncated {
            offset: at,
            opcode: name,
            needed: n.saturating_sub(r.remaining() as u64),
        });
    }
    Ok(())
}
