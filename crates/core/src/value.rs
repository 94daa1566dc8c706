//! A Python value as checkpoints hold non-tensor entries ([`Value`]): what the torch formats'
//! pickles decode to and encode from, and what a checkpoint's [`crate::model::Extra`] keeps.

/// A Python value, as a pickle decodes it.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` or `False`.
    Bool(bool),
    /// An int that fits `i64`.
    Int(i64),
    /// An int that does not fit `i64`: little-endian two's complement, minimal length.
    BigInt(Vec<u8>),
    /// A float.
    Float(f64),
    /// A str.
    Str(String),
    /// `bytes`, `bytearray`, Python 2 `str` (`BINSTRING`), `_codecs.encode(s, 'latin1')`.
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<Value>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// Insertion-ordered pairs; keys may be any value (e.g. `MetadataIndex` objects).
    Dict(Vec<(Value, Value)>),
    /// `set`/`frozenset`, in pickle order (not de-duplicated).
    Set(Vec<Value>),
    /// A bare allow-listed global, e.g. `torch.float32`.
    Global {
        /// The module (`torch`).
        module: String,
        /// The name in it (`float32`).
        name: String,
    },
    /// Result of REDUCE/NEWOBJ on an allow-listed class/callable, plus BUILD state if any.
    Object {
        /// The class's or callable's module.
        module: String,
        /// Its name.
        name: String,
        /// The arguments it was called with.
        args: Vec<Value>,
        /// The state `BUILD` set, if any.
        state: Option<Box<Value>>,
    },
    /// BINPERSID's argument (torch storages: `('storage', StorageClass, key, location, numel)`).
    PersistentId(Box<Value>),
}

impl Value {
    /// Short name of the variant, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "none",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Set(_) => "set",
            Value::Global { .. } => "global",
            Value::Object { .. } => "object",
            Value::PersistentId(_) => "persistent id",
        }
    }

    /// True for `None`.
    pub fn is_none(&self) -> bool {
        matches!(self, Value::None)
    }

    /// The bool, if this is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The value of an `Int` (not of a `Bool`, not of a `BigInt`).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// A `Float`, or an `Int` converted to `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    /// The str, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The bytes, if this is one.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }

    /// Elements of a `List` or a `Tuple`.
    pub fn as_list(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) => Some(v),
            _ => None,
        }
    }

    /// The dict's pairs, if this is one.
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(v) => Some(v),
            _ => None,
        }
    }

    /// Look up a str key in a `Dict`, or in an `Object`'s state dict (also the dict half of a
    /// `(dict, slotstate)` state tuple). The last matching pair wins.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(pairs) => pairs
                .iter()
                .rev()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            Value::Object {
                state: Some(state), ..
            } => match state.as_ref() {
                Value::Tuple(parts) if parts.len() == 2 => parts.first().and_then(|d| d.get(key)),
                other => other.get(key),
            },
            _ => None,
        }
    }

    /// `(module, name)` of a `Global`.
    pub fn as_global(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }

    /// `(module, name)` of a `Global` or of an `Object`'s class/callable.
    pub fn class(&self) -> Option<(&str, &str)> {
        match self {
            Value::Global { module, name } | Value::Object { module, name, .. } => {
                Some((module, name))
            }
            _ => None,
        }
    }

    /// True for an `Object` made by calling `module.name`.
    pub fn is_object(&self, module: &str, name: &str) -> bool {
        matches!(self, Value::Object { module: m, name: n, .. } if m == module && n == name)
    }

    /// True for the bare global `module.name`.
    pub fn is_global(&self, module: &str, name: &str) -> bool {
        matches!(self, Value::Global { module: m, name: n } if m == module && n == name)
    }

    /// Call arguments of an `Object`.
    pub fn args(&self) -> Option<&[Value]> {
        match self {
            Value::Object { args, .. } => Some(args),
            _ => None,
        }
    }

    /// BUILD state of an `Object`.
    pub fn state(&self) -> Option<&Value> {
        match self {
            Value::Object { state, .. } => state.as_deref(),
            _ => None,
        }
    }

    /// The persistent id's argument, if this is one.
    pub fn as_persistent_id(&self) -> Option<&Value> {
        match self {
            Value::PersistentId(v) => Some(v),
            _ => None,
        }
    }

    /// A list/tuple of ints, or a `torch.Size(...)` object (whose single argument is one).
    pub fn as_int_tuple(&self) -> Option<Vec<i64>> {
        match self {
            Value::List(items) | Value::Tuple(items) => items.iter().map(Value::as_int).collect(),
            Value::Object {
                module, name, args, ..
            } if module == "torch" && name == "Size" => match args.as_slice() {
                [inner] => inner.as_int_tuple(),
                _ => None,
            },
            _ => None,
        }
    }
}
