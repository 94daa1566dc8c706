//! A tensor's layout: its global shape and dtype, and the pieces that hold it — which rank
//! holds which region, and where that region's bytes live.

use super::{row_major_strides, DType, Region};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Where a piece's bytes live: a file (index into the checkpoint's file list), the byte offset
/// of the piece's first element, and element strides when they are not row-major.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Loc {
    /// Index of the file in the owning checkpoint's (or output's) file list.
    pub file: u32,
    /// Byte offset of the region's first element in the file.
    pub offset: u64,
    /// Element strides; `None` means row-major over the piece's region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strides: Option<Vec<u64>>,
    /// Set by a lazily opened checkpoint (`Checkpoint::open_lazy` of `reshard-formats`) on a piece whose
    /// container has not been read yet: the length of the item at `offset` (a DCP
    /// `torch.save` item) that holds the piece. Its real offset and strides are found when it
    /// is read; a plan is never made from such a piece. `None` once located.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<u64>,
}

/// Most dimensions a tensor may have (torch's own kernels stop at fewer): more is refused when
/// a checkpoint is opened, which bounds the per-dimension walks (the flat-range boxes recurse
/// once per dimension).
pub const MAX_DIMS: usize = 64;

/// One region of a tensor held by one rank, and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The rank (or shard index) that holds it.
    pub rank: u32,
    /// The region of the global tensor.
    pub region: Region,
    /// Where the bytes are.
    pub loc: Loc,
}

impl Piece {
    /// The piece's element strides (row-major unless the location says otherwise).
    pub fn strides(&self) -> super::region::Dims {
        match &self.loc.strides {
            Some(s) => s.as_slice().into(),
            None => row_major_strides(&self.region.sizes),
        }
    }

    /// Bytes spanned by the piece in its file (from its first to past its last element).
    pub fn span_bytes(&self, elem: u64) -> u64 {
        if self.region.is_empty() {
            return 0;
        }
        let strides = self.strides();
        let last: u64 = self
            .region
            .sizes
            .iter()
            .zip(&strides)
            .map(|(s, st)| (s - 1).saturating_mul(*st))
            .fold(0u64, |a, b| a.saturating_add(b));
        last.saturating_add(1).saturating_mul(elem)
    }
}

/// A tensor: name (the flat key, an fqn), dtype, global shape and the pieces that hold it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorLayout {
    /// The tensor's flat name, e.g. `model.embed.weight`.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape (empty for a scalar).
    pub shape: Vec<u64>,
    /// The pieces, in no particular order.
    pub pieces: Vec<Piece>,
}

impl TensorLayout {
    /// A tensor held whole by rank 0 in file `file`, its element 0 at byte `offset`
    /// (`strides` when the stored view is not row-major).
    pub fn whole(
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        file: u32,
        offset: u64,
        strides: Option<Vec<u64>>,
    ) -> TensorLayout {
        TensorLayout {
            name,
            dtype,
            pieces: vec![Piece {
                rank: 0,
                region: Region::full(&shape),
                loc: Loc {
                    file,
                    offset,
                    strides,
                    pending: None,
                },
            }],
            shape,
        }
    }

    /// Bytes of the whole tensor.
    pub fn nbytes(&self) -> u64 {
        Region::full(&self.shape)
            .volume()
            .saturating_mul(self.dtype.size() as u64)
    }

    /// Ranks that hold at least one non-empty piece.
    pub fn ranks(&self) -> Vec<u32> {
        let mut r: Vec<u32> = self
            .pieces
            .iter()
            .filter(|p| !p.region.is_empty())
            .map(|p| p.rank)
            .collect();
        r.sort_unstable();
        r.dedup();
        r
    }

    /// Check the pieces describe the tensor exactly: every piece inside the shape with the
    /// tensor's rank, no two different regions overlapping, and no element left uncovered.
    /// Identical regions (replicas) are allowed.
    pub fn validate(&self) -> Result<()> {
        if self.shape.len() > MAX_DIMS {
            return Err(Error::layout(
                &self.name,
                format!(
                    "has {} dimensions; reshard handles at most {MAX_DIMS}",
                    self.shape.len()
                ),
            ));
        }
        let full = Region::full(&self.shape);
        let total = full
            .checked_volume()
            .filter(|v| v.checked_mul(self.dtype.size() as u64).is_some())
            .ok_or_else(|| {
                Error::layout(&self.name, format!("shape {:?} is too large", self.shape))
            })?;
        for p in &self.pieces {
            if p.region.ndim() != self.shape.len() || !full.contains(&p.region) {
                return Err(Error::layout(
                    &self.name,
                    format!(
                        "piece {} of rank {} lies outside the tensor's shape {:?}",
                        p.region, p.rank, self.shape
                    ),
                ));
            }
        }
        let distinct = distinct_regions(self.pieces.iter().map(|p| &p.region));
        let mut overlap = None;
        join(&distinct, &distinct, |i, j| {
            if i < j && overlap.is_none() {
                overlap = Some((i, j));
            }
        });
        if let Some((i, j)) = overlap {
            return Err(Error::layout(
                &self.name,
                format!("pieces {} and {} overlap", distinct[i], distinct[j]),
            ));
        }
        let covered: u64 = distinct.iter().map(|r| r.volume()).sum();
        if covered != total {
            let gap = find_gap(&full, &distinct)
                .map_or_else(String::new, |g| format!(": region {g} is not covered"));
            return Err(Error::layout(
                &self.name,
                format!("pieces cover {covered} of {total} elements{gap}"),
            ));
        }
        Ok(())
    }
}

/// The distinct non-empty regions among `regions`, in first-seen order.
pub fn distinct_regions<'a>(regions: impl Iterator<Item = &'a Region>) -> Vec<&'a Region> {
    let out: Vec<&Region> = regions.filter(|r| !r.is_empty()).collect();
    // Pieces mostly come in increasing order, and are then distinct: no set needed.
    if out.windows(2).all(|w| w[0] < w[1]) {
        return out;
    }
    let mut seen: HashMap<&Region, ()> = HashMap::with_capacity(out.len());
    out.into_iter()
        .filter(|r| seen.insert(r, ()).is_none())
        .collect()
}

/// Calls `f(i, j)` for every pair `a[i]`, `b[j]` of non-empty regions that intersect.
///
/// A sweep along the dimension with the most distinct region starts: regions are sorted by
/// their start in it and only regions whose extents overlap in that dimension are compared, so
/// the cost is `O((|a| + |b|) log(|a| + |b|) + K)` where K counts the pairs that overlap in
/// the swept dimension — not `|a|·|b|`.
pub fn join(a: &[&Region], b: &[&Region], mut f: impl FnMut(usize, usize)) {
    let ndim = a.first().or(b.first()).map_or(0, |r| r.ndim());
    if ndim == 0 {
        for (i, x) in a.iter().enumerate() {
            for (j, y) in b.iter().enumerate() {
                if x.ndim() == 0 && y.ndim() == 0 {
                    f(i, j);
                }
            }
        }
        return;
    }
    let dim = (0..ndim)
        .max_by_key(|&d| {
            let mut starts: Vec<u64> = a.iter().chain(b).map(|r| r.offsets[d]).collect();
            starts.sort_unstable();
            starts.dedup();
            starts.len()
        })
        .unwrap_or(0);
    // Events: (start, side, index), sides interleaved by start.
    let mut ev: Vec<(u64, bool, usize)> = a
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.is_empty() && r.ndim() == ndim)
        .map(|(i, r)| (r.offsets[dim], false, i))
        .chain(
            b.iter()
                .enumerate()
                .filter(|(_, r)| !r.is_empty() && r.ndim() == ndim)
                .map(|(j, r)| (r.offsets[dim], true, j)),
        )
        .collect();
    ev.sort_unstable();
    let mut active_a: Vec<usize> = vec![];
    let mut active_b: Vec<usize> = vec![];
    for (start, side_b, idx) in ev {
        if side_b {
            active_a.retain(|&i| a[i].end(dim) > start);
            let rb = b[idx];
            for &i in &active_a {
                if a[i].intersect(rb).is_some() {
                    f(i, idx);
                }
            }
            active_b.push(idx);
        } else {
            active_b.retain(|&j| b[j].end(dim) > start);
            let ra = a[idx];
            for &j in &active_b {
                if ra.intersect(b[j]).is_some() {
                    f(idx, j);
                }
            }
            active_a.push(idx);
        }
    }
}

/// A region of `within` covered by none of `pieces` (which must not overlap), if any.
fn find_gap(within: &Region, pieces: &[&Region]) -> Option<Region> {
    let covered = |r: &Region| -> u64 {
        pieces
            .iter()
            .filter_map(|p| p.intersect(r))
            .map(|x| x.volume())
            .sum()
    };
    let mut cur = within.clone();
    // Descend: split `cur` around a piece that touches it and keep a part that is short.
    for _ in 0..=pieces.len() {
        let Some(p) = pieces.iter().find_map(|p| p.intersect(&cur)) else {
            return Some(cur);
        };
        let mut parts = vec![];
        let mut rest = cur.clone();
        for d in 0..cur.ndim() {
            if p.offsets[d] > rest.offsets[d] {
                let mut lo = rest.clone();
                lo.sizes[d] = p.offsets[d] - rest.offsets[d];
                parts.push(lo);
            }
            if p.end(d) < rest.end(d) {
                let mut hi = rest.clone();
                hi.offsets[d] = p.end(d);
                hi.sizes[d] = rest.end(d) - p.end(d);
                parts.push(hi);
            }
            rest.offsets[d] = p.offsets[d];
            rest.sizes[d] = p.sizes[d];
        }
        cur = parts.into_iter().find(|r| covered(r) < r.volume())?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(rank: u32, o: &[u64], s: &[u64]) -> Piece {
        Piece {
            rank,
            region: Region::new(o.to_vec(), s.to_vec()),
            loc: Loc {
                file: rank,
                offset: 0,
                strides: None,
                pending: None,
            },
        }
    }

    fn t(shape: &[u64], pieces: Vec<Piece>) -> TensorLayout {
        TensorLayout {
            name: "w".into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces,
        }
    }

    #[test]
    fn more_dimensions_than_reshard_handles_are_refused() {
        let ones = vec![1u64; MAX_DIMS + 1];
        let zeros = vec![0u64; MAX_DIMS + 1];
        let e = t(&ones, vec![piece(0, &zeros, &ones)])
            .validate()
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `w`: has 65 dimensions; reshard handles at most 64"
        );
        let ones = vec![1u64; MAX_DIMS];
        let zeros = vec![0u64; MAX_DIMS];
        t(&ones, vec![piece(0, &zeros, &ones)]).validate().unwrap();
    }

    #[test]
    fn exact_cover_with_replicas_and_empty_pieces_is_valid() {
        let l = t(
            &[5, 4],
            vec![
                piece(0, &[0, 0], &[3, 4]),
                piece(1, &[3, 0], &[2, 4]),
                piece(2, &[3, 0], &[2, 4]),
                piece(3, &[5, 0], &[0, 4]),
            ],
        );
        l.validate().unwrap();
        assert_eq!(l.ranks(), vec![0, 1, 2]);
        t(&[], vec![piece(0, &[], &[])]).validate().unwrap();
        t(&[0, 3], vec![]).validate().unwrap();
    }

    #[test]
    fn gaps_overlaps_and_outside_pieces_are_named() {
        let gap = t(
            &[5, 4],
            vec![piece(0, &[0, 0], &[3, 4]), piece(1, &[3, 0], &[2, 2])],
        );
        let e = gap.validate().unwrap_err().to_string();
        assert_eq!(
            e,
            "tensor `w`: pieces cover 16 of 20 elements: region [3:5, 2:4] is not covered"
        );
        let ov = t(
            &[5, 4],
            vec![piece(0, &[0, 0], &[3, 4]), piece(1, &[2, 0], &[3, 4])],
        );
        let e = ov.validate().unwrap_err().to_string();
        assert_eq!(e, "tensor `w`: pieces [0:3, 0:4] and [2:5, 0:4] overlap");
        let out = t(&[5, 4], vec![piece(0, &[0, 0], &[6, 4])]);
        assert!(out.validate().unwrap_err().to_string().contains("outside"));
        let missing_scalar = t(&[], vec![]);
        assert!(missing_scalar.validate().is_err());
    }

    #[test]
    fn join_finds_exactly_the_intersecting_pairs() {
        let a: Vec<Region> = (0..6)
            .map(|i| Region::new(vec![i * 2, 0], vec![2, 8]))
            .collect();
        let b: Vec<Region> = (0..4)
            .map(|j| Region::new(vec![0, j * 2], vec![12, 2]))
            .collect();
        let ar: Vec<&Region> = a.iter().collect();
        let br: Vec<&Region> = b.iter().collect();
        let mut got = vec![];
        join(&ar, &br, |i, j| got.push((i, j)));
        got.sort();
        let mut want = vec![];
        for (i, x) in a.iter().enumerate() {
            for (j, y) in b.iter().enumerate() {
                if x.intersect(y).is_some() {
                    want.push((i, j));
                }
            }
        }
        assert_eq!(got, want);
    }
}
