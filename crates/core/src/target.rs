//! Target layouts: what the user asks each of the M target ranks to hold.
//!
//! The default is FSDP2's: `Shard(0)` over a 1-D mesh of M ranks. A layout file (JSON) names
//! a mesh and per-name-glob placements, first match wins, or a flat layout:
//!
//! ```json
//! { "mesh": [2, 2],
//!   "rules": [ { "match": "*.qkv.weight", "placements": ["Shard(0)", "Shard(1)"] },
//!              { "match": "*",            "placements": ["Shard(0)", "Replicate"] } ] }
//! ```
//! `{ "mesh": [8], "flat": true }` cuts the row-major concatenation of all tensors into 8
//! equal ranges (FSDP1 flat parameters, ZeRO). A `Shard(d)` on a dimension a tensor does not
//! have (scalars; 1-d biases under `Shard(1)`) places that tensor `Replicate` on that mesh
//! dimension. Tensors no rule matches get `Shard(0)` on the first mesh dimension and
//! `Replicate` on the others.

use crate::error::{Error, IoContext, Result};
use crate::layout::{flat_ranges, DType, Mesh, Placement, Region, Sharding};
use globset::{Glob, GlobMatcher};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Most ranks a target mesh may have (2^20): the plan and the writers keep per-rank state,
/// so a mesh of billions of ranks would be accepted only to exhaust memory. The largest
/// training runs are around 10^5 ranks.
pub const MAX_WORLD: u64 = 1 << 20;

/// One rule of a layout file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Glob on tensor names (`*` matches dots too).
    #[serde(rename = "match")]
    pub pattern: String,
    /// One placement per mesh dimension.
    pub placements: Vec<Placement>,
}

/// A target layout: a mesh and how tensors are placed on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutSpec {
    /// The device mesh shape; its product is the target world size.
    pub mesh: Vec<u64>,
    /// Placement rules, first match wins.
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// Flat ranges over a 1-D mesh instead of per-tensor placements.
    #[serde(default)]
    pub flat: bool,
}

impl LayoutSpec {
    /// FSDP2's default: `Shard(0)` over `world` ranks.
    pub fn fsdp(world: u64) -> Self {
        LayoutSpec {
            mesh: vec![world],
            rules: vec![],
            flat: false,
        }
    }

    /// Read and check a layout file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read(path).at(path)?;
        Self::from_json(&text).map_err(|e| Error::format(path, e.to_string()))
    }

    /// Parse and check the JSON of a layout file.
    pub fn from_json(json: &[u8]) -> Result<Self> {
        let spec: LayoutSpec = serde_json::from_slice(json)
            .map_err(|e| Error::usage(format!("is not a valid layout file: {e}")))?;
        spec.check()?;
        Ok(spec)
    }

    /// Check the mesh and rules are consistent.
    pub fn check(&self) -> Result<()> {
        if self.mesh.is_empty() || self.mesh.contains(&0) {
            return Err(Error::usage(format!(
                "mesh {:?} must have at least one dimension, none of size 0",
                self.mesh
            )));
        }
        if self
            .mesh
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .is_none_or(|w| w > MAX_WORLD)
        {
            return Err(Error::usage(format!(
                "mesh {:?} has more than {MAX_WORLD} ranks, the most reshard lays out",
                self.mesh
            )));
        }
        if self.flat && self.mesh.len() != 1 {
            return Err(Error::usage("a flat layout needs a 1-D mesh"));
        }
        for r in &self.rules {
            Glob::new(&r.pattern)
                .map_err(|e| Error::usage(format!("bad glob `{}`: {e}", r.pattern)))?;
            if r.placements.len() != self.mesh.len() {
                return Err(Error::usage(format!(
                    "rule `{}` has {} placements for a {}-d mesh",
                    r.pattern,
                    r.placements.len(),
                    self.mesh.len()
                )));
            }
        }
        Ok(())
    }

    /// Number of target ranks.
    pub fn world(&self) -> u64 {
        self.mesh.iter().product()
    }

    /// The placements a tensor named `name` with `ndim` dimensions gets.
    pub fn sharding_for(
        &self,
        name: &str,
        ndim: usize,
        rules: &[(GlobMatcher, Vec<Placement>)],
    ) -> Sharding {
        let placements = rules
            .iter()
            .find(|(m, _)| m.is_match(name))
            .map(|(_, p)| p.clone())
            .unwrap_or_else(|| {
                let mut v = vec![Placement::Replicate; self.mesh.len()];
                v[0] = Placement::Shard(0);
                v
            })
            .into_iter()
            .map(|p| match p.dim() {
                Some(d) if d >= ndim => Placement::Replicate,
                _ => p,
            })
            .collect();
        Sharding {
            mesh: Mesh(self.mesh.clone()),
            placements,
        }
    }

    /// Compile the spec for tensors `(name, dtype, shape)`: the regions every rank holds.
    pub fn compile(&self, tensors: &[(String, DType, Vec<u64>)]) -> Result<Vec<TargetTensor>> {
        self.check()?;
        let world = self.world();
        if self.flat {
            let shapes: Vec<Vec<u64>> = tensors.iter().map(|t| t.2.clone()).collect();
            let (shares, _) = flat_ranges(&shapes, world);
            let mut out: Vec<TargetTensor> = tensors
                .iter()
                .map(|(n, d, s)| TargetTensor {
                    name: n.clone(),
                    dtype: *d,
                    shape: s.clone(),
                    ranks: vec![vec![]; world as usize],
                })
                .collect();
            for (r, share) in shares.into_iter().enumerate() {
                for (t, boxes) in share {
                    out[t].ranks[r] = boxes;
                }
            }
            // zero-size tensors hold no element: give rank 0 their (empty) whole region.
            for t in &mut out {
                if Region::full(&t.shape).is_empty() {
                    t.ranks[0] = vec![Region::full(&t.shape)];
                }
            }
            return Ok(out);
        }
        let rules: Vec<(GlobMatcher, Vec<Placement>)> = self
            .rules
            .iter()
            .map(|r| {
                Ok((
                    Glob::new(&r.pattern)
                        .map_err(|e| Error::usage(e.to_string()))?
                        .compile_matcher(),
                    r.placements.clone(),
                ))
            })
            .collect::<Result<_>>()?;
        Ok(tensors
            .iter()
            .map(|(name, dtype, shape)| {
                let s = self.sharding_for(name, shape.len(), &rules);
                TargetTensor {
                    name: name.clone(),
                    dtype: *dtype,
                    shape: shape.clone(),
                    ranks: (0..world).map(|r| s.rank_regions(shape, r)).collect(),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_first_match_and_missing_dims_replicate() {
        let spec: LayoutSpec = serde_json::from_str(
            r#"{"mesh":[2,2],"rules":[{"match":"*.bias","placements":["Shard(1)","R"]},{"match":"*","placements":["S(0)","S(1)"]}]}"#,
        )
        .unwrap();
        let t = spec
            .compile(&[
                ("a.bias".into(), DType::F32, vec![5]),
                ("a.w".into(), DType::F32, vec![4, 6]),
            ])
            .unwrap();
        // Shard(1) on a 1-d bias becomes Replicate: every rank holds it whole
        assert!(t[0]
            .ranks
            .iter()
            .all(|r| r == &vec![Region::new(vec![0], vec![5])]));
        assert_eq!(t[1].ranks[3], vec![Region::new(vec![2, 3], vec![2, 3])]);
        assert!(serde_json::from_str::<LayoutSpec>(r#"{"mesh":[2],"rulez":[]}"#).is_err());
        let bad = LayoutSpec {
            mesh: vec![2],
            rules: vec![Rule {
                pattern: "*".into(),
                placements: vec![],
            }],
            flat: false,
        };
        assert!(bad.check().is_err());
    }

    #[test]
    fn flat_spec_gives_each_rank_a_range() {
        let spec = LayoutSpec {
            mesh: vec![3],
            rules: vec![],
            flat: true,
        };
        let t = spec
            .compile(&[
                ("a".into(), DType::F32, vec![2, 2]),
                ("b".into(), DType::F32, vec![3]),
            ])
            .unwrap();
        let vol =
            |r: usize| -> u64 { t.iter().flat_map(|x| &x.ranks[r]).map(|g| g.volume()).sum() };
        assert_eq!((vol(0), vol(1), vol(2)), (3, 3, 1));
    }
}

/// What a writer is asked to produce for one tensor: its dtype and shape in the output, and
/// the regions each target rank holds.
#[derive(Clone, Debug)]
pub struct TargetTensor {
    /// Output name.
    pub name: String,
    /// Output dtype.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Per target rank, the regions it holds.
    pub ranks: Vec<Vec<Region>>,
}
