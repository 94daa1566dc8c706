//! Container opcodes: tuples (`TUPLE*`), lists (`LIST`, `APPEND(S)`), dicts (`DICT`,
//! `SETITEM(S)`) and sets (`ADDITEMS`, `FROZENSET`); the mutating ones act on the container on
//! the stack, which memo entries share. Also the metered copies of a container's items that
//! calls and `BUILD` make.

use super::arena::{Id, Node};
use super::budget::charged;
use super::machine::Machine;
use super::machine::Step;
use super::{invalid, op, PickleError};

impl Machine<'_> {
    /// `TUPLE`: a tuple of the values above the innermost `MARK`.
    #[inline]
    pub(super) fn tuple(&mut self, name: &'static str, at: usize) -> Step {
        let items = self.pop_mark_scratch(name, at)?;
        let node = Node::tuple(&items);
        self.scratch = items;
        self.push_node(node, at)
    }

    /// `TUPLE1`/`TUPLE2`/`TUPLE3`: a tuple of the top one, two or three values.
    #[inline]
    pub(super) fn tuple_n(&mut self, code: u8, name: &'static str, at: usize) -> Step {
        let n = usize::from(code - op::TUPLE1) + 1;
        let mut items = [0; 3];
        for slot in items[..n].iter_mut().rev() {
            *slot = self.pop(name, at)?;
        }
        self.push_node(Node::tuple(&items[..n]), at)
    }

    /// `LIST`: a list of the values above the innermost `MARK`.
    #[inline]
    pub(super) fn list(&mut self, name: &'static str, at: usize) -> Step {
        let items = self.pop_mark(name, at)?;
        self.push_node(Node::List(items.into()), at)
    }

    /// `APPEND`: append the top value to the list below it.
    #[inline]
    pub(super) fn append(&mut self, name: &'static str, at: usize) -> Step {
        let v = self.pop(name, at)?;
        let list = self.top(name, at)?;
        match self.node_mut(list, at)? {
            Node::List(items) => items.push(v),
            other => {
                let kind = other.kind();
                return Err(invalid(at, format!("APPEND to a {kind}")));
            }
        }
        Ok(())
    }

    /// `APPENDS`: append the values above the innermost `MARK` to the list below it.
    #[inline]
    pub(super) fn appends(&mut self, name: &'static str, at: usize) -> Step {
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
        Ok(())
    }

    /// `DICT`: a dict of the keys and values above the innermost `MARK`.
    #[inline]
    pub(super) fn dict(&mut self, name: &'static str, at: usize) -> Step {
        let items = self.pop_mark(name, at)?;
        let pairs = pairs_of(&items, name, at)?;
        self.push_node(Node::Dict(pairs.into()), at)
    }

    /// `SETITEM`: add the top key and value to the dict below them.
    #[inline]
    pub(super) fn setitem(&mut self, name: &'static str, at: usize) -> Step {
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
        Ok(())
    }

    /// `SETITEMS`: add the keys and values above the innermost `MARK` to the dict below it.
    #[inline]
    pub(super) fn setitems(&mut self, name: &'static str, at: usize) -> Step {
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
        Ok(())
    }

    /// `ADDITEMS`: add the values above the innermost `MARK` to the set below it.
    #[inline]
    pub(super) fn additems(&mut self, name: &'static str, at: usize) -> Step {
        let new = self.pop_mark(name, at)?;
        let set = self.top(name, at)?;
        match self.node_mut(set, at)? {
            Node::Set(items) => items.extend(&new),
            other => {
                let kind = other.kind();
                return Err(invalid(at, format!("ADDITEMS on a {kind}")));
            }
        }
        Ok(())
    }

    /// `FROZENSET`: a set of the values above the innermost `MARK`.
    #[inline]
    pub(super) fn frozenset(&mut self, name: &'static str, at: usize) -> Step {
        let items = self.pop_mark(name, at)?;
        self.push_node(Node::Set(items.into()), at)
    }

    /// Elements of a list/tuple/set node (copied, metered).
    pub(super) fn items_of(
        &mut self,
        id: Id,
        what: &str,
        at: usize,
    ) -> Result<Vec<Id>, PickleError> {
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
    pub(super) fn dict_pairs(&mut self, id: Id) -> Result<Vec<(Id, Id)>, PickleError> {
        match self.nodes.get(id as usize) {
            Some(Node::Dict(p)) => charged(&mut self.budget, p),
            _ => Ok(Vec::new()),
        }
    }
}

/// The `(key, value)` pairs of a flat run of keys and values (`DICT`).
fn pairs_of(items: &[Id], opcode: &'static str, at: usize) -> Result<Vec<(Id, Id)>, PickleError> {
    let mut out = Vec::with_capacity(items.len() / 2);
    pairs_into(items, opcode, at, &mut out)?;
    Ok(out)
}

/// [`pairs_of`] into `out` (cleared first).
fn pairs_into(items: &[Id], opcode: &'static str, at: usize, out: &mut Vec<(Id, Id)>) -> Step {
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
