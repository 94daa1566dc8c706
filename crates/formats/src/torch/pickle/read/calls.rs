//! Calls (`REDUCE`, `NEWOBJ`, `NEWOBJ_EX`, `INST`, `OBJ`) of allow-listed callables: recorded
//! as objects, except the few builtin containers decoded as data (`dict`, `OrderedDict`,
//! `set`, `frozenset`, `bytes`, `bytearray`, `_codecs.encode`).

use super::arena::{Id, Node, Seq};
use super::machine::Machine;
use super::{invalid, PickleError};
use crate::torch::short;

/// Special meaning given to a few allow-listed callables.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Builtin {
    Plain,
    Dict,
    Set,
    ByteArray,
    CodecsEncode,
    GetAttr,
}

/// The special meaning of `module.name`, if any.
fn builtin_of(module: &str, name: &str) -> Builtin {
    match (module, name) {
        ("collections", "OrderedDict") | ("builtins", "dict") => Builtin::Dict,
        ("builtins", "set") | ("builtins", "frozenset") => Builtin::Set,
        ("builtins", "bytearray") | ("builtins", "bytes") => Builtin::ByteArray,
        ("_codecs", "encode") => Builtin::CodecsEncode,
        ("builtins", "getattr") => Builtin::GetAttr,
        _ => Builtin::Plain,
    }
}

impl Machine<'_> {
    /// Call `callable(*args)`: `REDUCE`, `NEWOBJ`, `INST`, `OBJ`.
    pub(super) fn call(
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
        let node = self.call_builtin(builtin, gid, args, at)?;
        self.alloc(node, at)
    }

    /// What calling the special callable `builtin` (the global `gid`) with the tuple `args`
    /// makes: a dict, a set or bytes.
    fn call_builtin(
        &mut self,
        builtin: Builtin,
        gid: u32,
        args: Id,
        at: usize,
    ) -> Result<Node, PickleError> {
        let (module, name) = self.global_name(gid);
        let qual = format!("{module}.{name}");
        let arg_ids = self.node(args).tuple_ids().unwrap_or_default().to_vec();
        let node = match (builtin, arg_ids.as_slice()) {
            // `getattr(cls, "Inner")`, how pickle names a nested class: the global
            // `module.cls.Inner`, allowed only when the allow-list names it so
            (Builtin::GetAttr, [obj, attr]) => {
                let (obj, attr) = (*obj, *attr);
                let (Node::Global(owner), Node::Str(attr)) = (self.node(obj), self.node(attr))
                else {
                    return Err(invalid(
                        at,
                        format!(
                            "{qual} is only read for an allow-listed class and an attribute name"
                        ),
                    ));
                };
                let (m, n) = self.global_name(*owner);
                let (m, nested) = (m.to_owned(), format!("{n}.{attr}"));
                Node::Global(self.resolve_global(&m, &nested, at)?)
            }
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
        Ok(node)
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
}
