//! Materialisation: the [`Value`] tree built from the arena at `STOP`, metered again, with
//! Python's dict-key semantics and the depth and self-containment checks.

use super::arena::{Id, Node};
use super::budget::Budget;
use super::{PickleError, Value, MAX_DEPTH};
use std::collections::HashMap;

/// The [`Value`] tree of `root`, metered on `budget`.
pub(super) fn tree(
    nodes: &[Node],
    globals: &[(String, String)],
    budget: &mut Budget,
    root: Id,
) -> Result<Value, PickleError> {
    let mut m = Materializer {
        nodes,
        globals,
        on_path: vec![false; nodes.len()],
        budget,
    };
    m.value(root, 0)
}

/// The builder of a [`Value`] tree: copies each value, shared ones once per reference.
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
    /// The node `id`.
    fn node(&self, id: Id) -> &'a Node {
        self.nodes.get(id as usize).unwrap_or(&Node::None)
    }

    /// The hashable view of a str/int/bytes key, `None` for other keys.
    fn key_ref(&self, id: Id) -> Option<KeyRef<'a>> {
        match self.node(id) {
            Node::Str(s) => Some(KeyRef::Str(s)),
            Node::Int(i) => Some(KeyRef::Int(*i)),
            Node::Bytes(b) => Some(KeyRef::Bytes(b)),
            _ => None,
        }
    }

    /// `(module, name)` of the global `gid`, copied and metered.
    fn global(&mut self, gid: u32) -> Result<(String, String), PickleError> {
        let (m, n) = self
            .globals
            .get(gid as usize)
            .map(|(m, n)| (m.as_str(), n.as_str()))
            .unwrap_or(("?", "?"));
        self.budget.bytes(m.len().saturating_add(n.len()))?;
        Ok((m.to_owned(), n.to_owned()))
    }

    /// The values of `ids`.
    fn list(&mut self, ids: &[Id], depth: usize) -> Result<Vec<Value>, PickleError> {
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            out.push(self.value(id, depth)?);
        }
        Ok(out)
    }

    /// The value of `id` at `depth`, checked for depth and self-containment, metered.
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

    /// The value of `node`, its children at `depth`.
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
            Node::Dict(pairs) => self.dict(pairs, depth)?,
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

    /// A dict's [`Value`]: a simple key set twice keeps its first position and its last value.
    fn dict(&mut self, pairs: &'a [(Id, Id)], depth: usize) -> Result<Value, PickleError> {
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
        Ok(Value::Dict(out))
    }
}
