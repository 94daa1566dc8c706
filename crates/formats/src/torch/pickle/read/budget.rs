//! The size budget: the meter of values and string bytes a pickle may expand to
//! ([`Budget`]), and the tree size of a value graph computed before anything is built
//! ([`tree_size`]), so that memo-reference bombs fail early.

use super::arena::{Id, Node};
use super::machine::Step;
use super::VALUES_PER_INPUT_BYTE;
use super::{PickleError, BYTES_PER_INPUT_BYTE, MAX_DEPTH, MIN_BYTE_BUDGET, MIN_VALUE_BUDGET};
use std::collections::HashMap;

/// The meter of values created and string bytes copied, against limits proportional to the
/// input (see [`MIN_VALUE_BUDGET`], [`VALUES_PER_INPUT_BYTE`] and their byte counterparts).
pub(super) struct Budget {
    values: u64,
    value_limit: u64,
    bytes: u64,
    byte_limit: u64,
}

impl Budget {
    /// The budget of an input of `len` bytes, nothing spent.
    pub(super) fn for_input(len: usize) -> Self {
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

    /// Spend `n` values.
    #[inline]
    pub(super) fn values(&mut self, n: usize) -> Step {
        self.values = self.values.saturating_add(n as u64);
        if self.values > self.value_limit {
            return Err(PickleError::TooManyValues {
                limit: self.value_limit,
            });
        }
        Ok(())
    }

    /// Spend `n` bytes.
    #[inline]
    pub(super) fn bytes(&mut self, n: usize) -> Step {
        self.bytes = self.bytes.saturating_add(n as u64);
        if self.bytes > self.byte_limit {
            return Err(PickleError::TooManyBytes {
                limit: self.byte_limit,
            });
        }
        Ok(())
    }

    /// A budget with the same limits, nothing spent.
    pub(super) fn unspent(&self) -> Budget {
        Budget {
            values: 0,
            value_limit: self.value_limit,
            bytes: 0,
            byte_limit: self.byte_limit,
        }
    }
}

/// A copy of `items`, charged to `budget` as that many values.
pub(super) fn charged<T: Clone>(budget: &mut Budget, items: &[T]) -> Result<Vec<T>, PickleError> {
    budget.values(items.len())?;
    Ok(items.to_vec())
}

/// (values, string bytes) of the tree that materialising `root` would build, computed over
/// the graph without building it: each shared value is sized once.
pub(super) fn tree_size(
    nodes: &[Node],
    globals: &[(String, String)],
    root: Id,
) -> Result<(u64, u64), PickleError> {
    let mut sizes = Sizes {
        nodes,
        globals,
        shared: shared_nodes(nodes),
        done: HashMap::new(),
        state: vec![0; nodes.len()],
    };
    sizes.of(root, 0)
}

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

    /// The size of a leaf met at `depth` (its [`Sizes::leaf`] size), checked for depth.
    #[inline]
    fn sized_leaf(
        &mut self,
        slot: usize,
        shared: bool,
        size: (u64, u64),
        depth: usize,
    ) -> Result<(u64, u64), PickleError> {
        // As for containers, a shared leaf sized before is not checked for depth again.
        let state = self.state.get_mut(slot);
        let seen = state.as_ref().is_some_and(|s| **s & SEEN != 0);
        if depth >= MAX_DEPTH && !(shared && seen) {
            return Err(PickleError::TooDeep { limit: MAX_DEPTH });
        }
        if let Some(s) = state {
            *s |= SEEN;
        }
        Ok(size)
    }

    /// The tree size of the node `id` met at `depth`.
    fn of(&mut self, id: Id, depth: usize) -> Result<(u64, u64), PickleError> {
        let slot = id as usize;
        let nodes = self.nodes;
        let node = nodes.get(slot).unwrap_or(&Node::None);
        let shared = self.shared.get(slot).copied().unwrap_or(false);
        if let Some(size) = self.leaf(node) {
            return self.sized_leaf(slot, shared, size, depth);
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
