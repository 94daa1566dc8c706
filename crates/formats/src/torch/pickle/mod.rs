//! Python pickles: a small, safe reader and a weights-only-safe writer.
//!
//! - [`op`]: the opcode table, one named constant per opcode, shared by both directions;
//! - [`Value`] (`reshard_core::value`): the decoded tree; [`Globals`] (in `globals.rs`): the
//!   allow-lists of names a pickle may reference;
//! - `read/`: the VM behind [`parse`] (see its module docs for the layout);
//! - `write.rs`: [`PyValue`] and [`pickle`], the protocol-2 writer of `torch.save` pickles
//!
//! # Reading
//!
//! The reader owns the decoding of the two kinds of pickle a PyTorch Distributed Checkpoint
//! contains: the `.metadata` file (`pickle.dump` with the interpreter's default protocol, 4 on
//! Python 3.8–3.13, 5 on 3.14+) and the `data.pkl` record of every `torch.save` zip archive
//! (protocol 2, storages referenced through `BINPERSID`). It turns the opcode stream into a
//! [`Value`] tree; interpreting that tree (DCP metadata, tensor rebuild calls) is left to the
//! callers.
//!
//! # Safety model
//!
//! * **No code execution.** Nothing is ever imported or called. `GLOBAL`/`STACK_GLOBAL`/`INST`
//!   only *name* a Python object, and that name must be on the caller's allow-list
//!   ([`Globals`]); any other name is an error that names it
//!   (``unknown global `os.system` at byte 12``). Calling an allow-listed callable
//!   (`REDUCE`, `NEWOBJ`, `NEWOBJ_EX`, `INST`, `OBJ`) only records the call as
//!   [`Value::Object`], except for a handful of builtin containers that are decoded as data
//!   (see [`parse`]).
//! * **No panics.** Every read is bounds-checked, every length field is checked against the
//!   remaining input *before* anything is allocated, and integer arithmetic on input-derived
//!   values is checked.
//! * **Bounded resources.** The VM stack (`MAX_STACK`) and the number of open `MARK`s
//!   (`MAX_MARKS`) are capped. Values live in an arena whose size is proportional to the
//!   input. Because memo references (`BINGET`) let a short pickle describe an exponentially
//!   large tree, the size of the final tree is computed over the memo graph *before* it is
//!   built (and metered again while building): it fails with "pickle expands beyond N
//!   values" past `max(1_000_000, 2 × input length)` values (the same budget also meters
//!   element copies made while interpreting; real DCP pickles need under 0.25 per byte), with
//!   "pickle expands beyond N bytes" past `max(64 MiB, 64 × input length)` bytes of strings,
//!   and with "nesting deeper than 1000 levels" past `MAX_DEPTH` levels. Self-containing
//!   structures (a list appended to itself) are rejected.
//!
//! # Semantics worth knowing
//!
//! * Mutating opcodes (`APPEND(S)`, `SETITEM(S)`, `ADDITEMS`, `BUILD`) act on the container on
//!   the stack, and memo entries refer to that same container, so a later `BINGET` sees the
//!   mutations (the VM keeps indices into an arena; the tree is materialised at `STOP`).
//! * Dict keys may be any value (DCP's `storage_data` uses `MetadataIndex` objects as keys),
//!   so [`Value::Dict`] is an ordered list of pairs. A str/int/bytes key that is set twice
//!   keeps its first position and its last value, as in Python.
//! * `BINSTRING`/`SHORT_BINSTRING` (Python 2 `str`) decode to [`Value::Bytes`].
//! * Protocol < 3 pickles name builtins `__builtin__.X` and `copy_reg.X`; they are mapped to
//!   `builtins.X`/`copyreg.X` before the allow-list check, as Python's `fix_imports` does.

mod globals;
pub mod op;
pub mod read;
pub mod write;

pub use globals::{
    dcp_metadata_globals, megatron_legacy_globals, pickled_dict_globals, torch_save_globals,
    Globals,
};
pub use read::{parse, parse_graph, parse_graph_consuming, Obj, PickleError};
pub use reshard_core::value::Value;
#[cfg(any(test, feature = "internals"))]
pub use write::from_pickle;
pub use write::{extra_pickle, extra_value, pickle, Pickler, PyValue, Slot};
#[cfg(any(test, feature = "internals"))]
pub use write::{pickle_checked, validate, validate_torch21};
