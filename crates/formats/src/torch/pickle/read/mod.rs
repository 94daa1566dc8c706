//! The reader: a bounded, allow-listing VM that turns a pickle's opcode stream into a
//! [`Value`] tree (see the [module docs](super) for its safety model).
//!
//! This module holds the entry points ([`parse`], [`parse_with_len`], [`parse_graph`]), the
//! limits and [`PickleError`]. The rest, in the order a pickle meets it:
//! - `cursor`: bounds-checked reads of the input;
//! - `machine`: the VM's state, its stack primitives and the dispatch on each opcode byte,
//!   whose opcode families are `scalars` (ints, floats, str, bytes), `containers` (tuples,
//!   lists, dicts, sets), `objects` (globals, calls, `BUILD`, persistent ids; `calls`: what a
//!   call of an allow-listed callable makes) and `memo` (the memo and its opcodes);
//! - `arena`: the values the VM makes, children as ids, so memo references share them;
//! - `budget`: the meter of values and bytes, and the size of the tree a graph expands to;
//! - `graph`: the arena handed over as [`Graph`], read through [`Obj`];
//! - `materialize`: the [`Value`] tree built from the arena.

mod arena;
mod budget;
mod calls;
mod containers;
mod cursor;
mod graph;
mod machine;
mod materialize;
mod memo;
mod objects;
mod scalars;

use super::op;
use super::{Globals, Value};
use crate::torch::short;
use budget::Budget;
pub use graph::{Graph, Obj};
use machine::Machine;

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

/// A [`PickleError::Invalid`] at `offset`.
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
    parse_graph_consuming(bytes, globals, |_| {})
}

/// [`parse_graph`], calling `consumed(n)` as the decoder is done with the input's first `n`
/// bytes: every few megabytes while it decodes, and with the whole input's length once the
/// graph is made (before its expansion is checked). The graph holds nothing of the input, so
/// the caller may drop those bytes' pages (a mapped `.metadata` need not stay resident
/// beside the graph decoded from it).
pub fn parse_graph_consuming(
    bytes: &[u8],
    globals: &Globals,
    mut consumed: impl FnMut(usize),
) -> Result<Graph, PickleError> {
    let budget = Budget::for_input(bytes.len());
    let mut vm = Machine::new(globals, budget);
    let (root, _) = vm.run_consuming(bytes, &mut consumed)?;
    consumed(bytes.len());
    vm.check_expansion(root)?;
    Ok(Graph {
        nodes: vm.nodes,
        globals: vm.global_table,
        root,
    })
}

#[cfg(test)]
mod tests;
