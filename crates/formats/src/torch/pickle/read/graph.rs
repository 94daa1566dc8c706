//! The value graph: [`Graph`], the VM's arena handed over as is, and [`Obj`], a handle that
//! reads a value in place (what [`parse_graph`](super::parse_graph) returns).

use super::arena::{Id, Node};

/// A decoded pickle as the VM's arena of values: shared values (memo references) are stored
/// once, and [`Obj`] handles read them in place.
pub struct Graph {
    pub(super) nodes: Vec<Node>,
    pub(super) globals: Vec<(String, String)>,
    pub(super) root: Id,
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

/// A value of a [`Graph`]; the accessors mirror [`Value`](crate::torch::pickle::Value)'s.
#[derive(Clone, Copy)]
pub struct Obj<'g> {
    g: &'g Graph,
    id: Id,
}

impl<'g> Obj<'g> {
    /// The node this handle reads.
    fn node(self) -> &'g Node {
        self.g.nodes.get(self.id as usize).unwrap_or(&Node::None)
    }

    /// A handle on the node `id` of the same graph.
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

    /// The arguments (a tuple) an object was made with: `REDUCE`'s, `NEWOBJ`'s.
    pub fn args(self) -> Option<Obj<'g>> {
        match self.node() {
            Node::Object { args, .. } => Some(self.at(*args)),
            _ => None,
        }
    }

    /// Look up a str key in a dict, or in an object's state dict (also the dict half of a
    /// `(dict, slotstate)` state tuple). The last matching pair wins, as in
    /// [`Value::get`](crate::torch::pickle::Value::get).
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
