//! Per-rank state: entries of a checkpoint that belong to one rank of the job that saved it
//! (RNG states, data-loader positions) and so cannot be resharded, and the policy that says
//! what a conversion does with them.
//!
//! Which entries are per-rank is told from their flat names, by the conventions trainers use:
//! - a name segment that carries a rank number — `rank_3`, `rank3`, `dp_rank_0`, `rank-1`, or
//!   a number right after a `ranks` / `per_rank` segment (`sampler.per_rank.2`): the state of
//!   that rank;
//! - megatron-core's `ShardedObject` keys of RNG or data-loader state,
//!   `<key>/shard_<offsets>_<shape>`: the state of the shard at that position (its row-major
//!   index in the grid of shards; other objects, such as TransformerEngine's `_extra_state`,
//!   are not per-rank);
//! - a segment naming random-number-generator or data-loader state — `rng`, `rng_state`,
//!   `cuda_rng_state`, `random_state`, `dataloader`, `data_loader`, `sampler_state` — saved
//!   under one key: one rank's copy (DCP keeps a single copy of a key every rank saved).
//!
//! Scalars, step counters, `param_groups` and scheduler state are not per-rank and are always
//! carried as they are.

use crate::error::{Error, Hint, Result};
use serde::Serialize;
use std::fmt;
use std::str::FromStr;

/// Why an entry is per-rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PerRank {
    /// Saved under a key naming this rank.
    Rank(u64),
    /// RNG or data-loader state saved under one key: one rank's copy.
    Single,
}

impl fmt::Display for PerRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PerRank::Rank(r) => write!(f, "per-rank: rank {r}"),
            PerRank::Single => f.write_str("per-rank: one rank's copy"),
        }
    }
}

/// The rank a name segment such as `rank_3`, `dp_rank3`, `rank-1` names.
fn segment_rank(seg: &str) -> Option<u64> {
    let s = seg.to_ascii_lowercase();
    let at = s.rfind("rank")?;
    // `rank` starts the segment or follows a separator (`dp_rank_0`, not `frank0`).
    if at > 0 && !matches!(s.as_bytes()[at - 1], b'_' | b'-') {
        return None;
    }
    let digits = s[at + 4..].trim_start_matches(['_', '-']);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The shard a megatron-core `ShardedObject` key of RNG or data-loader state names,
/// `<key>/shard_<offsets>_<shape>` (offsets and shape dot-separated:
/// `rng_state/shard_0.1_1.2`): its row-major index in the grid of shards, which tells the
/// shards apart (it is the rank of the saving process only where the grid is the ranks').
/// Other objects (TransformerEngine's `_extra_state`, sharded by layer and the same at every
/// split) are not per-rank.
fn sharded_object_rank(name: &str) -> Option<u64> {
    let (base, rest) = name.rsplit_once("/shard_")?;
    let last = base.rsplit('.').next().unwrap_or(base).to_ascii_lowercase();
    if !(segment_is_state(&last)
        || last.starts_with("dataloader")
        || last.starts_with("data_loader"))
    {
        return None;
    }
    let (offsets, shape) = rest.split_once('_')?;
    let dims = |s: &str| -> Option<Vec<u64>> { s.split('.').map(|d| d.parse().ok()).collect() };
    let (offsets, shape) = (dims(offsets)?, dims(shape)?);
    if offsets.len() != shape.len() || offsets.iter().zip(&shape).any(|(o, n)| o >= n) {
        return None;
    }
    offsets
        .iter()
        .zip(&shape)
        .try_fold(0u64, |a, (&o, &n)| a.checked_mul(n)?.checked_add(o))
}

/// True when a segment names RNG or data-loader state.
fn segment_is_state(seg: &str) -> bool {
    let s = seg.to_ascii_lowercase();
    let words: Vec<&str> = s.split(['_', '-']).collect();
    words.contains(&"rng")
        || s == "random_state"
        || s.ends_with("rng_state")
        || s.ends_with("rng_states")
        || matches!(
            s.as_str(),
            "dataloader" | "data_loader" | "dataloaders" | "train_dataloader" | "sampler_state"
        )
}

/// Whether the entry named `name` (a flat, dot-separated key) is per-rank state.
pub fn classify(name: &str) -> Option<PerRank> {
    if let Some(r) = sharded_object_rank(name) {
        return Some(PerRank::Rank(r));
    }
    let segs: Vec<&str> = name.split('.').collect();
    for (i, seg) in segs.iter().enumerate() {
        if let Some(r) = segment_rank(seg) {
            return Some(PerRank::Rank(r));
        }
        if i > 0 && matches!(segs[i - 1], "ranks" | "per_rank") {
            if let Ok(r) = seg.parse() {
                return Some(PerRank::Rank(r));
            }
        }
    }
    segs.iter()
        .any(|s| segment_is_state(s))
        .then_some(PerRank::Single)
}

/// What a conversion does with per-rank entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Policy {
    /// Leave them out of the output.
    Drop,
    /// Keep rank 0's: entries of rank 0 and single-copy entries; drop other ranks' entries.
    Rank0,
    /// Carry every entry unchanged (right when the target has the source's ranks).
    Keep,
}

impl FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "drop" => Ok(Policy::Drop),
            "rank0" => Ok(Policy::Rank0),
            "keep" => Ok(Policy::Keep),
            _ => Err(format!(
                "unknown per-rank state policy `{s}` (expected drop, rank0 or keep)"
            )),
        }
    }
}

impl Policy {
    /// The policy to apply when converting a checkpoint of `source_ranks` ranks to
    /// `target_ranks`, given the user's choice and the per-rank entries found (`names`).
    /// Without a choice: rank 0's state for one target rank, everything when the rank count
    /// is unchanged, and an error naming the entries otherwise.
    pub fn resolve(
        chosen: Option<Policy>,
        source_ranks: u64,
        target_ranks: u64,
        names: &[&str],
    ) -> Result<Policy> {
        match chosen {
            Some(p) => Ok(p),
            None if names.is_empty() || target_ranks == source_ranks => Ok(Policy::Keep),
            None if target_ranks == 1 => Ok(Policy::Rank0),
            None => {
                let more = match names.len() {
                    1 => String::new(),
                    n => format!(" (and {} more)", n - 1),
                };
                Err(Error::refused(
                    format!(
                        "`{}`{more} is per-rank state saved by {source_ranks} rank(s), which cannot be resharded to {target_ranks}",
                        names[0]
                    ),
                    Hint::PerRankState,
                ))
            }
        }
    }

    /// Whether an entry classified as `kind` is kept under this policy.
    pub fn keeps(self, kind: Option<PerRank>) -> bool {
        match (self, kind) {
            (_, None) | (Policy::Keep, _) => true,
            (Policy::Drop, Some(_)) => false,
            (Policy::Rank0, Some(PerRank::Rank(r))) => r == 0,
            (Policy::Rank0, Some(PerRank::Single)) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_are_per_rank() {
        let r = |n| classify(n);
        assert_eq!(r("dataloader.dp_rank_0"), Some(PerRank::Rank(0)));
        assert_eq!(r("dataloader.dp_rank_3.pos"), Some(PerRank::Rank(3)));
        assert_eq!(r("state.rank3"), Some(PerRank::Rank(3)));
        assert_eq!(r("state.rank-12"), Some(PerRank::Rank(12)));
        assert_eq!(r("sampler.per_rank.2"), Some(PerRank::Rank(2)));
        assert_eq!(r("extra.rng"), Some(PerRank::Single));
        assert_eq!(r("cuda_rng_state"), Some(PerRank::Single));
        assert_eq!(r("rng_states.torch"), Some(PerRank::Single));
        assert_eq!(r("train_dataloader.epoch"), Some(PerRank::Single));
        // megatron-core ShardedObjects: the shard's index in its grid
        assert_eq!(r("rng_state/shard_0.1_1.2"), Some(PerRank::Rank(1)));
        assert_eq!(r("dataloader_state/shard_3_4"), Some(PerRank::Rank(3)));
        assert_eq!(r("model.rng_state/shard_1.0_2.3"), Some(PerRank::Rank(3)));
        assert_eq!(r("rng_state/shard_4_4"), Some(PerRank::Single));
        assert_eq!(r("x/shard_1_2"), None);
        // TransformerEngine's extra state, sharded by layer: carried as it is
        assert_eq!(
            r("decoder.layers.self_attention.linear_proj._extra_state/shard_5_24"),
            None
        );
        for plain in [
            "model.layers.0.weight",
            "optimizer.param_groups.0.lr",
            "lora.rank",
            "frank0.weight",
            "step",
            "model.strong.weight",
            "generator.conv.weight",
            "ranks.first",
            "rank_x",
        ] {
            assert_eq!(r(plain), None, "{plain}");
        }
    }

    #[test]
    fn policies() {
        let k = [
            None,
            Some(PerRank::Rank(0)),
            Some(PerRank::Rank(1)),
            Some(PerRank::Single),
        ];
        let kept = |p: Policy| k.iter().map(|&x| p.keeps(x)).collect::<Vec<_>>();
        assert_eq!(kept(Policy::Keep), [true, true, true, true]);
        assert_eq!(kept(Policy::Drop), [true, false, false, false]);
        assert_eq!(kept(Policy::Rank0), [true, true, false, true]);
        assert_eq!(Policy::resolve(None, 4, 1, &["a"]).unwrap(), Policy::Rank0);
        assert_eq!(Policy::resolve(None, 4, 4, &["a"]).unwrap(), Policy::Keep);
        assert_eq!(Policy::resolve(None, 4, 2, &[]).unwrap(), Policy::Keep);
        let e = Policy::resolve(None, 4, 2, &["x.rank_1", "y"]).unwrap_err();
        assert!(e
            .to_string()
            .contains("`x.rank_1` (and 1 more) is per-rank state"));
        assert_eq!(
            Policy::resolve(Some(Policy::Drop), 4, 2, &["a"]).unwrap(),
            Policy::Drop
        );
    }
}
