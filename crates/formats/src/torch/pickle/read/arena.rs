//! The value arena: [`Node`], the VM's compact form of a Python value, with children as
//! [`Id`]s into the arena, so that memo references share a value instead of copying it.

/// Index of a [`Node`] in the arena.
pub(super) type Id = u32;

/// A value of the arena. Kept at 24 bytes (a million-chunk `.metadata` decodes to some 20
/// million of them): boxed slices instead of vectors, tuples of up to three items inline.
#[derive(Debug)]
pub(super) enum Node {
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
pub(super) struct Seq<T: Vacant>(Box<[T]>);

/// An element of a [`Seq`] and the value that marks its spare capacity.
pub(super) trait Vacant: Copy + PartialEq + std::fmt::Debug {
    const VACANT: Self;
}

impl Vacant for Id {
    const VACANT: Id = Id::MAX;
}

impl Vacant for (Id, Id) {
    const VACANT: (Id, Id) = (Id::MAX, Id::MAX);
}

impl<T: Vacant> Seq<T> {
    /// An empty sequence.
    #[inline]
    pub(super) fn new() -> Seq<T> {
        Seq(Box::new([]))
    }

    /// Append `x`.
    #[inline]
    pub(super) fn push(&mut self, x: T) {
        self.extend(std::slice::from_ref(&x));
    }

    /// Append `xs`.
    #[inline]
    pub(super) fn extend(&mut self, xs: &[T]) {
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
    #[inline]
    fn deref(&self) -> &[T] {
        let len = self.0.partition_point(|x| *x != T::VACANT);
        &self.0[..len]
    }
}

impl Node {
    /// A tuple of `items`.
    #[inline]
    pub(super) fn tuple(items: &[Id]) -> Node {
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
    #[inline]
    pub(super) fn tuple_ids(&self) -> Option<&[Id]> {
        match self {
            Node::SmallTuple { len, ids } => ids.get(..usize::from(*len)),
            Node::Tuple(ids) => Some(ids),
            _ => None,
        }
    }

    /// Items of a list or a tuple.
    #[inline]
    pub(super) fn list_ids(&self) -> Option<&[Id]> {
        match self {
            Node::List(ids) => Some(ids),
            _ => self.tuple_ids(),
        }
    }

    /// Items of a list, a tuple or a set.
    #[inline]
    pub(super) fn seq_ids(&self) -> Option<&[Id]> {
        match self {
            Node::Set(ids) => Some(ids),
            _ => self.list_ids(),
        }
    }

    /// Short name of the kind of value, for error messages.
    pub(super) fn kind(&self) -> &'static str {
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

/// The shared `None` (the arena's first node; see `Machine::new`).
pub(super) const NONE_ID: Id = 0;
/// The shared `True`.
pub(super) const TRUE_ID: Id = 1;
/// The shared `False`.
pub(super) const FALSE_ID: Id = 2;
/// The shared empty tuple.
pub(super) const EMPTY_TUPLE_ID: Id = 3;

const _: () = assert!(std::mem::size_of::<Node>() == 24);
