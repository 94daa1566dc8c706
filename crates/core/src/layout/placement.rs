//! Placements over a device mesh, compiled to the regions each rank holds.
//!
//! Names follow PyTorch DTensor: a [`Mesh`] of ranks numbered in row-major order, and one
//! [`Placement`] per mesh dimension. Placements are applied mesh dimension by mesh dimension
//! to the rank's local tensor, exactly as `compute_local_shape_and_global_offset` does, so a
//! `[Shard(0), Shard(0)]` placement splits dim 0 twice (13 → 7 | 6 → 4, 3 | 3, 3).
//! [`flat_ranges`] covers the other family: FSDP1 flat parameters and ZeRO partitions, where
//! ranks own equal ranges of the row-major concatenation of several tensors.

use super::Region;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::fmt;
use std::str::FromStr;

/// How a tensor is distributed along one mesh dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
#[non_exhaustive]
pub enum Placement {
    /// Every rank along this mesh dimension holds the same data.
    Replicate,
    /// `torch.chunk` along `dim`: chunks of `ceil(n / k)`; trailing ranks may get a smaller or
    /// an empty chunk (what FSDP2 and DTensor do).
    Shard(usize),
    /// `numpy.array_split` along `dim`: the first `n % k` ranks get one more element.
    EvenShard(usize),
    /// DTensor's `_StridedShard(dim, split_factor)`: the local tensor is cut into
    /// `split_factor` chunks, each of those into `k` chunks, and a rank takes its chunk of
    /// every one of them (FSDP2 + tensor parallel on the same dim).
    StridedShard(usize, u64),
}

impl Placement {
    /// The tensor dimension this placement splits, if any.
    pub fn dim(&self) -> Option<usize> {
        match *self {
            Placement::Replicate => None,
            Placement::Shard(d) | Placement::EvenShard(d) | Placement::StridedShard(d, _) => {
                Some(d)
            }
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Replicate => write!(f, "Replicate()"),
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::EvenShard(d) => write!(f, "EvenShard({d})"),
            Placement::StridedShard(d, k) => write!(f, "StridedShard({d}, {k})"),
        }
    }
}

impl From<Placement> for String {
    fn from(p: Placement) -> String {
        p.to_string()
    }
}

impl TryFrom<String> for Placement {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl FromStr for Placement {
    type Err = String;

    /// Parses `Replicate`, `R`, `Shard(0)`, `S(0)`, `EvenShard(1)`, `StridedShard(0, 2)` and
    /// DTensor's repr `_StridedShard(dim=0, sf=2)`.
    fn from_str(s: &str) -> Result<Self, String> {
        let t: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        if matches!(t.as_str(), "R" | "Replicate" | "Replicate()") {
            return Ok(Placement::Replicate);
        }
        let bad = || {
            format!("bad placement `{s}` (expected Replicate, Shard(d), EvenShard(d) or StridedShard(d, k))")
        };
        let open = t.find('(').ok_or_else(bad)?;
        if !t.ends_with(')') {
            return Err(bad());
        }
        let name = &t[..open];
        let args: Vec<u64> = t[open + 1..t.len() - 1]
            .split(',')
            .map(|a| a.rsplit('=').next().unwrap_or(a).parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|_| bad())?;
        match (name, args.as_slice()) {
            ("Shard" | "S", [d]) => Ok(Placement::Shard(*d as usize)),
            ("EvenShard" | "E", [d]) => Ok(Placement::EvenShard(*d as usize)),
            ("StridedShard" | "_StridedShard", [d, k]) if *k >= 1 => {
                Ok(Placement::StridedShard(*d as usize, *k))
            }
            _ => Err(bad()),
        }
    }
}

/// `torch.chunk` of `n` into `k`: the range of chunk `i`.
pub fn chunk_range(n: u64, k: u64, i: u64) -> (u64, u64) {
    let c = n.div_ceil(k.max(1));
    let a = (i * c).min(n);
    let b = ((i + 1) * c).min(n);
    (a, b)
}

/// `numpy.array_split` of `n` into `k`: the range of part `i`.
pub fn even_range(n: u64, k: u64, i: u64) -> (u64, u64) {
    let k = k.max(1);
    let (q, r) = (n / k, n % k);
    let a = i * q + i.min(r);
    (a, a + q + u64::from(i < r))
}

/// A device mesh: its shape; ranks are numbered in row-major order over it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mesh(pub Vec<u64>);

impl Mesh {
    /// A 1-D mesh of `world` ranks.
    pub fn flat(world: u64) -> Self {
        Mesh(vec![world])
    }

    /// Number of ranks.
    pub fn world(&self) -> u64 {
        self.0.iter().product()
    }

    /// Mesh coordinates of `rank` (inline: wanted for every rank of every tensor).
    pub fn coords(&self, rank: u64) -> SmallVec<[u64; 4]> {
        let mut c: SmallVec<[u64; 4]> = smallvec::smallvec![0; self.0.len()];
        let mut r = rank;
        for d in (0..self.0.len()).rev() {
            c[d] = r % self.0[d];
            r /= self.0[d];
        }
        c
    }
}

/// A placement per mesh dimension: DTensor's `(mesh, placements)` pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sharding {
    /// The device mesh.
    pub mesh: Mesh,
    /// One placement per mesh dimension.
    pub placements: Vec<Placement>,
}

/// A run of global indices `start .. start + len` in one dimension.
type Segment = (u64, u64);

/// The runs of one dimension a rank holds: one, but for `StridedShard`.
type Runs = SmallVec<[Segment; 1]>;

/// Take local indices `a .. b` of a dimension made of `segs` (in order).
fn slice_segments(segs: &[Segment], a: u64, b: u64) -> Runs {
    let mut out = Runs::new();
    let mut pos = 0u64;
    let mut end_global = segs.first().map_or(0, |s| s.0);
    for &(start, len) in segs {
        let (lo, hi) = (a.max(pos), b.min(pos + len));
        if lo < hi {
            out.push((start + (lo - pos), hi - lo));
        }
        if pos <= a && a <= pos + len {
            end_global = start + (a - pos);
        }
        pos += len;
    }
    if out.is_empty() {
        // An empty local shard sits where it would start, as DTensor reports it.
        out.push((end_global, 0));
    }
    out
}

impl Sharding {
    /// `Shard(0)` over a 1-D mesh of `world` ranks: FSDP2's default.
    pub fn fsdp(world: u64) -> Self {
        Sharding {
            mesh: Mesh::flat(world),
            placements: vec![Placement::Shard(0)],
        }
    }

    /// Check the placements fit the mesh and a tensor of rank `ndim`.
    pub fn check(&self, ndim: usize) -> Result<()> {
        if self.placements.len() != self.mesh.0.len() {
            return Err(Error::usage(format!(
                "{} placements for a {}-d mesh {:?}",
                self.placements.len(),
                self.mesh.0.len(),
                self.mesh.0
            )));
        }
        if self.mesh.0.contains(&0) {
            return Err(Error::usage("a mesh dimension of size 0"));
        }
        for p in &self.placements {
            if let Some(d) = p.dim() {
                if d >= ndim {
                    return Err(Error::usage(format!(
                        "placement {p} on a tensor with {ndim} dimension(s)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// The regions rank `rank` holds of a tensor of `shape` (more than one for
    /// `StridedShard`; one empty region for a rank that gets nothing). A placement that splits
    /// a dimension the tensor does not have acts as `Replicate`.
    pub fn rank_regions(&self, shape: &[u64], rank: u64) -> Vec<Region> {
        let dims = self.segments(shape, rank);
        if let Some(one) = dims
            .iter()
            .map(|segs| match segs.as_slice() {
                [seg] => Some(*seg),
                _ => None,
            })
            .collect::<Option<SmallVec<[Segment; 4]>>>()
        {
            // One run per dimension (all but `StridedShard`): one region.
            let (offsets, sizes) = one.into_iter().unzip();
            return vec![Region { offsets, sizes }];
        }
        // Cartesian product of the per-dimension segment lists.
        let mut out = vec![Region::new(vec![], vec![])];
        for segs in &dims {
            let mut next = Vec::with_capacity(out.len() * segs.len());
            for r in &out {
                for &(s, l) in segs {
                    let mut o = r.offsets.clone();
                    let mut z = r.sizes.clone();
                    o.push(s);
                    z.push(l);
                    next.push(Region::new(o, z));
                }
            }
            out = next;
        }
        out
    }

    /// Per tensor dimension, the runs `(start, len)` of global indices rank `rank` holds, in
    /// the order its local tensor holds them (DTensor's `to_local()` is their product).
    pub fn rank_segments(&self, shape: &[u64], rank: u64) -> Vec<Vec<(u64, u64)>> {
        self.segments(shape, rank)
            .into_iter()
            .map(|segs| segs.to_vec())
            .collect()
    }

    /// [`Sharding::rank_segments`] in inline vectors (this runs for every rank of every
    /// tensor).
    fn segments(&self, shape: &[u64], rank: u64) -> SmallVec<[Runs; 4]> {
        let coords = self.mesh.coords(rank);
        let mut dims: SmallVec<[Runs; 4]> =
            shape.iter().map(|&n| smallvec::smallvec![(0, n)]).collect();
        for (m, p) in self.placements.iter().enumerate() {
            let (k, c) = (self.mesh.0[m], coords[m]);
            // A split of a dimension the tensor lacks (a scalar under Shard(0)) replicates.
            let p = match p.dim() {
                Some(d) if d >= shape.len() => Placement::Replicate,
                _ => *p,
            };
            match p {
                Placement::Replicate => {}
                Placement::Shard(d) | Placement::EvenShard(d) => {
                    let n: u64 = dims[d].iter().map(|s| s.1).sum();
                    let (a, b) = if matches!(p, Placement::Shard(_)) {
                        chunk_range(n, k, c)
                    } else {
                        even_range(n, k, c)
                    };
                    dims[d] = slice_segments(&dims[d], a, b);
                }
                Placement::StridedShard(d, sf) => {
                    let n: u64 = dims[d].iter().map(|s| s.1).sum();
                    let mut segs = Runs::new();
                    // Chunks j >= n are empty (chunk_range gives (n, n)): with sf > n, stop
                    // at n rather than loop up to a huge sf from a layout file.
                    for j in 0..sf.min(n) {
                        let (a, b) = chunk_range(n, sf, j);
                        let (x, y) = chunk_range(b - a, k, c);
                        segs.extend(
                            slice_segments(&dims[d], a + x, a + y)
                                .into_iter()
                                .filter(|s| s.1 > 0),
                        );
                    }
                    if segs.is_empty() {
                        segs = slice_segments(&dims[d], n, n);
                    }
                    dims[d] = segs;
                }
            }
        }
        dims
    }
}

/// The boxes making up elements `a .. b` of the row-major flattening of a tensor of `shape`:
/// at most `2·ndim − 1` of them.
pub fn flat_range_boxes(shape: &[u64], a: u64, b: u64) -> Vec<Region> {
    let mut out = vec![];
    flat_rec(shape, a, b, &mut vec![], &mut out);
    out
}

fn flat_rec(shape: &[u64], a: u64, b: u64, prefix: &mut Vec<u64>, out: &mut Vec<Region>) {
    if a >= b {
        return;
    }
    let Some((&_n0, rest)) = shape.split_first() else {
        out.push(Region::new(prefix.clone(), vec![1; prefix.len()]));
        return;
    };
    let inner: u64 = rest.iter().product();
    if inner == 0 {
        return;
    }
    let (mut ra, rb) = (a / inner, b / inner);
    if ra == rb {
        prefix.push(ra);
        flat_rec(rest, a % inner, b % inner, prefix, out);
        prefix.pop();
        return;
    }
    if a % inner != 0 {
        prefix.push(ra);
        flat_rec(rest, a % inner, inner, prefix, out);
        prefix.pop();
        ra += 1;
    }
    if rb > ra {
        let p = prefix.len();
        let mut offsets = prefix.clone();
        let mut sizes = vec![1; p];
        offsets.push(ra);
        sizes.push(rb - ra);
        offsets.extend(std::iter::repeat_n(0, rest.len()));
        sizes.extend_from_slice(rest);
        out.push(Region::new(offsets, sizes));
    }
    if b % inner != 0 {
        prefix.push(rb);
        flat_rec(rest, 0, b % inner, prefix, out);
        prefix.pop();
    }
}

/// One rank's share of a flat group: for each tensor of the group that the rank's range
/// touches, the tensor's index and the boxes of it, in flat order.
pub type FlatShare = Vec<(usize, Vec<Region>)>;

/// Ranks' shares of the row-major concatenation of `shapes`, cut into `world` equal ranges of
/// `ceil(total / world)` elements (the last range padded), as FSDP1 flat parameters and ZeRO
/// partitions do. Also returns the per-rank range length (elements, padding included).
pub fn flat_ranges(shapes: &[Vec<u64>], world: u64) -> (Vec<FlatShare>, u64) {
    let numels: Vec<u64> = shapes.iter().map(|s| s.iter().product()).collect();
    let total: u64 = numels.iter().sum();
    let chunk = total.div_ceil(world.max(1));
    let mut out = vec![];
    for r in 0..world {
        let (lo, hi) = (r * chunk, ((r + 1) * chunk).min(total));
        let mut share = vec![];
        let mut start = 0u64;
        for (t, &n) in numels.iter().enumerate() {
            let (a, b) = (lo.max(start), hi.min(start + n));
            if a < b {
                share.push((t, flat_range_boxes(&shapes[t], a - start, b - start)));
            }
            start += n;
        }
        out.push(share);
    }
    (out, chunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boxes(s: &Sharding, shape: &[u64]) -> Vec<Vec<(Vec<u64>, Vec<u64>)>> {
        (0..s.mesh.world())
            .map(|r| {
                s.rank_regions(shape, r)
                    .into_iter()
                    .map(|g| (g.offsets.to_vec(), g.sizes.to_vec()))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn torch_chunk_and_array_split() {
        assert_eq!(chunk_range(5, 4, 0), (0, 2));
        assert_eq!(chunk_range(5, 4, 2), (4, 5));
        assert_eq!(chunk_range(5, 4, 3), (5, 5));
        assert_eq!(chunk_range(1, 4, 1), (1, 1));
        assert_eq!(even_range(5, 4, 0), (0, 2));
        assert_eq!(even_range(5, 4, 1), (2, 3));
        assert_eq!(even_range(5, 4, 3), (4, 5));
    }

    #[test]
    fn fsdp2_head_weight_over_4() {
        // torch fixture fsdp2_w4_f32: head.weight (5,12) -> (0,0)/(2,12) (2,0)/(2,12) (4,0)/(1,12) (5,0)/(0,12)
        let b = boxes(&Sharding::fsdp(4), &[5, 12]);
        assert_eq!(b[0], vec![(vec![0, 0], vec![2, 12])]);
        assert_eq!(b[2], vec![(vec![4, 0], vec![1, 12])]);
        assert_eq!(b[3], vec![(vec![5, 0], vec![0, 12])]);
    }

    #[test]
    fn two_d_meshes_match_dtensor() {
        // dtensor2d_manual_w4, mesh (2,2): [Shard(0), Shard(1)] of (13,11)
        let s = Sharding {
            mesh: Mesh(vec![2, 2]),
            placements: vec![Placement::Shard(0), Placement::Shard(1)],
        };
        let b = boxes(&s, &[13, 11]);
        assert_eq!(b[0], vec![(vec![0, 0], vec![7, 6])]);
        assert_eq!(b[1], vec![(vec![0, 6], vec![7, 5])]);
        assert_eq!(b[2], vec![(vec![7, 0], vec![6, 6])]);
        assert_eq!(b[3], vec![(vec![7, 6], vec![6, 5])]);
        // [Shard(0), Shard(0)] of (13,3): offsets 0,4,7,10
        let s = Sharding {
            mesh: Mesh(vec![2, 2]),
            placements: vec![Placement::Shard(0), Placement::Shard(0)],
        };
        let offs: Vec<u64> = boxes(&s, &[13, 3]).iter().map(|v| v[0].0[0]).collect();
        assert_eq!(offs, vec![0, 4, 7, 10]);
    }

    #[test]
    fn strided_shard_matches_fsdp_tp_fixture() {
        // dtensor2d_fsdp_tp_w4: fc1.weight (14,12), (_StridedShard(0, sf=2), Shard(0)) on (dp=2, tp=2)
        // gives chunks (0,0)/(4,12) (7,0)/(4,12) (4,0)/(3,12) (11,0)/(3,12) in rank order.
        let s = Sharding {
            mesh: Mesh(vec![2, 2]),
            placements: vec![Placement::StridedShard(0, 2), Placement::Shard(0)],
        };
        let b = boxes(&s, &[14, 12]);
        assert_eq!(b[0], vec![(vec![0, 0], vec![4, 12])]);
        assert_eq!(b[1], vec![(vec![7, 0], vec![4, 12])]);
        assert_eq!(b[2], vec![(vec![4, 0], vec![3, 12])]);
        assert_eq!(b[3], vec![(vec![11, 0], vec![3, 12])]);
        // alone on a 1-D mesh a rank owns split_factor boxes
        let s = Sharding {
            mesh: Mesh(vec![2]),
            placements: vec![Placement::StridedShard(0, 2)],
        };
        assert_eq!(
            boxes(&s, &[14, 12])[0],
            vec![(vec![0, 0], vec![4, 12]), (vec![7, 0], vec![4, 12])]
        );
    }

    #[test]
    fn flat_boxes_cover_range() {
        let shape = [3u64, 4, 5];
        for a in 0..60 {
            for b in a..=60 {
                let bx = flat_range_boxes(&shape, a, b);
                assert!(bx.len() < 2 * shape.len(), "{a}..{b}: {bx:?}");
                let vol: u64 = bx.iter().map(|r| r.volume()).sum();
                assert_eq!(vol, b - a);
                // every element of every box lies inside [a, b) in flat order, and the boxes
                // are disjoint: with the volume check, they tile the range exactly
                let flat = |i: &[u64]| i[0] * 20 + i[1] * 5 + i[2];
                for (i, r) in bx.iter().enumerate() {
                    let last: Vec<u64> = (0..3).map(|d| r.end(d) - 1).collect();
                    assert!(flat(&r.offsets) >= a && flat(&last) < b, "{a}..{b}: {r}");
                    for q in &bx[i + 1..] {
                        assert!(r.intersect(q).is_none());
                    }
                }
            }
        }
        assert_eq!(flat_range_boxes(&[], 0, 1).len(), 1);
    }

    #[test]
    fn flat_group_pads_last_rank() {
        let (shares, chunk) = flat_ranges(&[vec![3, 4], vec![5]], 4);
        assert_eq!(chunk, 5);
        let total: u64 = shares
            .iter()
            .flatten()
            .flat_map(|(_, b)| b)
            .map(|r| r.volume())
            .sum();
        assert_eq!(total, 17);
        assert_eq!(shares[3], vec![(1, vec![Region::new(vec![3], vec![2])])]);
    }

    #[test]
    fn parse_placements() {
        assert_eq!(
            "Shard(1)".parse::<Placement>().unwrap(),
            Placement::Shard(1)
        );
        assert_eq!("R".parse::<Placement>().unwrap(), Placement::Replicate);
        assert_eq!(
            "_StridedShard(dim=0, sf=2)".parse::<Placement>().unwrap(),
            Placement::StridedShard(0, 2)
        );
        assert!("Shard(x)".parse::<Placement>().is_err());
        assert!("Spread(1)".parse::<Placement>().is_err());
    }
}
