//! The memo: [`Memo`], memo keys to arena ids, and the opcodes that store and fetch
//! (`PUT`, `BINPUT`, `LONG_BINPUT`, `MEMOIZE`, `GET`, `BINGET`, `LONG_BINGET`).

use super::arena::Id;
use super::cursor::Reader;
use super::machine::Machine;
use super::machine::Step;
use super::{invalid, PickleError};
use std::collections::HashMap;

/// The memo: keys below the dense length in a vector (what `MEMOIZE`, and Python's pickler
/// with `BINPUT`, produce: 0, 1, 2, …), any other key in a map. A key far beyond the dense
/// part (an input may name 2^32 - 1) goes to the map, so memory stays proportional to the
/// number of entries.
#[derive(Default)]
pub(super) struct Memo {
    dense: Vec<Id>,
    sparse: HashMap<u64, Id>,
    /// Number of keys set (`len(memo)`, the key `MEMOIZE` uses).
    len: u64,
}

/// A vacant slot of `Memo::dense`.
const VACANT: Id = Id::MAX;
/// How far past the dense part a key may be and still grow it (the gap is filled vacant).
const DENSE_GAP: u64 = 64;

impl Memo {
    /// The id stored under `key`.
    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<Id> {
        match usize::try_from(key).ok().and_then(|k| self.dense.get(k)) {
            Some(&id) if id != VACANT => Some(id),
            _ => self.sparse.get(&key).copied(),
        }
    }

    /// Store `id` under `key` (replacing what was there).
    #[inline]
    pub(super) fn insert(&mut self, key: u64, id: Id) {
        let dense_len = self.dense.len() as u64;
        if key < dense_len.saturating_add(DENSE_GAP) && id != VACANT {
            let k = key as usize;
            if k >= self.dense.len() {
                self.dense.resize(k + 1, VACANT);
            }
            let was_set = self.dense[k] != VACANT
                || (!self.sparse.is_empty() && self.sparse.remove(&key).is_some());
            self.dense[k] = id;
            if !was_set {
                self.len += 1;
            }
        } else if self.sparse.insert(key, id).is_none() {
            self.len += 1;
        }
    }

    /// Number of keys set.
    #[inline]
    pub(super) fn len(&self) -> u64 {
        self.len
    }
}

impl Machine<'_> {
    /// `PUT`: store the top of the stack under a decimal key.
    #[inline]
    pub(super) fn put_text(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let line = r.line(name, at)?;
        let key = parse_memo_key(line, name, at)?;
        self.memo_put(key, name, at)
    }

    /// `GET`: push the value stored under a decimal key.
    #[inline]
    pub(super) fn get_text(&mut self, r: &mut Reader<'_>, name: &'static str, at: usize) -> Step {
        let line = r.line(name, at)?;
        let key = parse_memo_key(line, name, at)?;
        self.memo_get(key, at)
    }

    /// Push the value stored under `key`.
    #[inline]
    pub(super) fn memo_get(&mut self, key: u64, at: usize) -> Step {
        let id = self
            .memo
            .get(key)
            .ok_or(PickleError::MissingMemo { key, offset: at })?;
        self.push(id, at)
    }

    /// Store the top of the stack under `key`.
    #[inline]
    pub(super) fn memo_put(&mut self, key: u64, opcode: &'static str, at: usize) -> Step {
        let id = self.top(opcode, at)?;
        self.memo.insert(key, id);
        Ok(())
    }
}

/// The decimal memo key of a text `PUT`/`GET`.
fn parse_memo_key(line: &[u8], opcode: &'static str, at: usize) -> Result<u64, PickleError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| invalid(at, format!("invalid {opcode} memo key")))
}
