//! The memo (`PUT`/`GET` and their binary forms, `MEMOIZE`): memo keys to arena ids.

use super::arena::Id;
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
