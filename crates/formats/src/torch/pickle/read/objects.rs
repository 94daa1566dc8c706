//! Object opcodes: globals (`GLOBAL`, `STACK_GLOBAL`), calls (`INST`, `OBJ`, `REDUCE`,
//! `NEWOBJ`, `NEWOBJ_EX`; see `calls` for what a call makes), `BUILD` and persistent ids
//! (`PERSID`, `BINPERSID`).

use super::arena::{Id, Node};
use super::cursor::Reader;
use super::machine::Machine;
use super::machine::Step;
use super::{invalid, op, PickleError};

impl Machine<'_> {
    /// `GLOBAL` (push the global `module.name` read from two lines) and `INST` (call it with
    /// the values above the innermost `MARK`).
    #[inline]
    pub(super) fn global_or_inst(
        &mut self,
        code: u8,
        r: &mut Reader<'_>,
        name: &'static str,
        at: usize,
    ) -> Step {
        let module = r.line(name, at)?;
        let gname = r.line(name, at)?;
        let module = std::str::from_utf8(module)
            .map_err(|_| invalid(at, format!("invalid utf-8 in {name} module")))?;
        let gname = std::str::from_utf8(gname)
            .map_err(|_| invalid(at, format!("invalid utf-8 in {name} name")))?;
        let gid = self.resolve_global(module, gname, at)?;
        let global = self.alloc(Node::Global(gid), at)?;
        if code == op::GLOBAL {
            self.push(global, at)?;
        } else {
            let args = self.pop_mark(name, at)?;
            let args = self.alloc(Node::tuple(&args), at)?;
            let obj = self.call(global, args, name, at)?;
            self.push(obj, at)?;
        }
        Ok(())
    }

    /// `STACK_GLOBAL`: the global named by the two str on top of the stack.
    #[inline]
    pub(super) fn stack_global(&mut self, name: &'static str, at: usize) -> Step {
        let gname = self.pop(name, at)?;
        let module = self.pop(name, at)?;
        let (Some(module), Some(gname)) = (self.str_of(module), self.str_of(gname)) else {
            return Err(invalid(at, "STACK_GLOBAL needs two str"));
        };
        let (module, gname) = (module.to_owned(), gname.to_owned());
        self.budget
            .bytes(module.len().saturating_add(gname.len()))?;
        let gid = self.resolve_global(&module, &gname, at)?;
        self.push_node(Node::Global(gid), at)
    }

    /// `OBJ`: call the first value above the innermost `MARK` with the others.
    #[inline]
    pub(super) fn obj(&mut self, name: &'static str, at: usize) -> Step {
        let mut items = self.pop_mark(name, at)?;
        if items.is_empty() {
            return Err(PickleError::StackUnderflow {
                opcode: name,
                offset: at,
            });
        }
        let cls = items.remove(0);
        let args = self.alloc(Node::tuple(&items), at)?;
        let obj = self.call(cls, args, name, at)?;
        self.push(obj, at)
    }

    /// `REDUCE`/`NEWOBJ`: call the callable below the argument tuple on top.
    #[inline]
    pub(super) fn reduce(&mut self, name: &'static str, at: usize) -> Step {
        let args = self.pop(name, at)?;
        let callable = self.pop(name, at)?;
        let obj = self.call(callable, args, name, at)?;
        self.push(obj, at)
    }

    /// `NEWOBJ_EX`: `NEWOBJ` with keyword arguments, which must be empty.
    #[inline]
    pub(super) fn newobj_ex(&mut self, name: &'static str, at: usize) -> Step {
        let kwargs = self.pop(name, at)?;
        let args = self.pop(name, at)?;
        let cls = self.pop(name, at)?;
        match self.node(kwargs) {
            Node::Dict(p) if p.is_empty() => {}
            Node::Dict(_) => {
                return Err(invalid(
                    at,
                    "NEWOBJ_EX with keyword arguments is not supported",
                ))
            }
            other => {
                return Err(invalid(
                    at,
                    format!(
                        "NEWOBJ_EX keyword arguments must be a dict, got a {}",
                        other.kind()
                    ),
                ))
            }
        }
        let obj = self.call(cls, args, name, at)?;
        self.push(obj, at)
    }

    /// `PERSID`: a persistent id given as a line of ascii text.
    #[inline]
    pub(super) fn persid(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let line = r.line(name, at)?;
        let s = std::str::from_utf8(line)
            .ok()
            .filter(|s| s.is_ascii())
            .ok_or_else(|| invalid(at, "PERSID id must be ascii"))?;
        let pid = self.alloc(Node::Str(s.into()), at)?;
        self.push_node(Node::PersistentId(pid), at)
    }

    /// `BINPERSID`: the value on top of the stack as a persistent id.
    #[inline]
    pub(super) fn binpersid(&mut self, name: &'static str, at: usize) -> Step {
        let pid = self.pop(name, at)?;
        self.push_node(Node::PersistentId(pid), at)
    }

    /// `BUILD`: set the state of the object below (two dict states merge), or merge a dict
    /// state into the dict below.
    #[inline]
    pub(super) fn build(&mut self, at: usize) -> Step {
        let state = self.pop("BUILD", at)?;
        let inst = self.top("BUILD", at)?;
        let state_is_dict = match self.node(state) {
            Node::None => return Ok(()),
            Node::Dict(_) => true,
            _ => false,
        };
        match self.node(inst) {
            Node::Object { state: old, .. } => {
                let old = *old;
                let new_state = match old {
                    Some(old_id) if state_is_dict && matches!(self.node(old_id), Node::Dict(_)) => {
                        // Merge into a new dict: the old state may be shared through the memo.
                        let mut merged = self.dict_pairs(old_id)?;
                        merged.extend(self.dict_pairs(state)?);
                        self.alloc(Node::Dict(merged.into()), at)?
                    }
                    _ => state,
                };
                if let Node::Object { state: slot, .. } = self.node_mut(inst, at)? {
                    *slot = Some(new_state);
                }
                Ok(())
            }
            Node::Dict(_) => {
                if !state_is_dict {
                    let kind = self.node(state).kind();
                    return Err(invalid(at, format!("BUILD of a dict with a {kind} state")));
                }
                let new_pairs = self.dict_pairs(state)?;
                if let Node::Dict(pairs) = self.node_mut(inst, at)? {
                    pairs.extend(&new_pairs);
                }
                Ok(())
            }
            other => Err(invalid(at, format!("BUILD on a {}", other.kind()))),
        }
    }

    /// The text of a str node.
    pub(super) fn str_of(&self, id: Id) -> Option<&str> {
        match self.node(id) {
            Node::Str(s) => Some(s),
            _ => None,
        }
    }

    /// `(module, name)` of the global `gid`.
    pub(super) fn global_name(&self, gid: u32) -> (&str, &str) {
        self.global_table
            .get(gid as usize)
            .map(|(m, n)| (m.as_str(), n.as_str()))
            .unwrap_or(("?", "?"))
    }

    /// The number of the global `module.name`, checked against the allow-list (protocol < 3
    /// names are mapped to Python 3's first).
    pub(super) fn resolve_global(
        &mut self,
        module: &str,
        name: &str,
        at: usize,
    ) -> Result<u32, PickleError> {
        let module = if self.proto < 3 {
            match module {
                "__builtin__" => "builtins",
                "copy_reg" => "copyreg",
                m => m,
            }
        } else {
            module
        };
        if !self.globals.is_allowed(module, name) {
            return Err(PickleError::UnknownGlobal {
                module: module.to_owned(),
                name: name.to_owned(),
                offset: at,
            });
        }
        let key = (module.to_owned(), name.to_owned());
        if let Some(&gid) = self.global_index.get(&key) {
            return Ok(gid);
        }
        let gid = u32::try_from(self.global_table.len()).map_err(|_| PickleError::Limit {
            what: "number of globals",
            limit: u32::MAX as usize,
            offset: at,
        })?;
        self.global_table.push(key.clone());
        self.global_index.insert(key, gid);
        Ok(gid)
    }
}
