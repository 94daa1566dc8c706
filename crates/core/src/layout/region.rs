//! N-d regions (boxes) of a global tensor and their decomposition into contiguous byte runs.
//!
//! A [`Region`] is a box `offsets[d] .. offsets[d] + sizes[d]` in every dimension. A 0-d
//! region (no dimensions) is the single element of a scalar; a region with a zero size in
//! any dimension is empty.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Per-dimension values of a region (offsets or sizes): up to two dimensions inline, so the
/// millions of regions of a large checkpoint's layouts (mostly of 1-d and 2-d tensors) do
/// not each cost two heap allocations. Serialized as a list, like a `Vec`.
pub type Dims = smallvec::SmallVec<[u64; 2]>;

/// An N-d box in the index space of a global tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Region {
    /// First index in each dimension.
    pub offsets: Dims,
    /// Extent in each dimension.
    pub sizes: Dims,
}

impl Region {
    /// A region from offsets and sizes (same length).
    pub fn new(offsets: impl Into<Dims>, sizes: impl Into<Dims>) -> Self {
        let (offsets, sizes) = (offsets.into(), sizes.into());
        debug_assert_eq!(offsets.len(), sizes.len());
        Region { offsets, sizes }
    }

    /// The whole of a tensor of `shape`.
    pub fn full(shape: &[u64]) -> Self {
        Region {
            offsets: smallvec::smallvec![0; shape.len()],
            sizes: shape.into(),
        }
    }

    /// The whole of a tensor of `shape` cut along dimension 0 into boxes of whole rows, each
    /// about `bytes` bytes of `elem`-byte elements (at least one row); a 0-d or empty tensor
    /// is one box. For reading a tensor in bounded blocks.
    pub fn row_blocks(shape: &[u64], elem: u64, bytes: u64) -> Vec<Region> {
        let full = Region::full(shape);
        if shape.is_empty() || full.is_empty() {
            return vec![full];
        }
        let row = (full.volume() / shape[0]).max(1) * elem;
        let step = (bytes / row.max(1)).max(1);
        (0..shape[0].div_ceil(step))
            .map(|k| {
                let mut r = full.clone();
                r.offsets[0] = k * step;
                r.sizes[0] = step.min(shape[0] - k * step);
                r
            })
            .collect()
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.sizes.len()
    }

    /// Number of elements (1 for a 0-d region), or `None` if it overflows `u64`.
    pub fn checked_volume(&self) -> Option<u64> {
        self.sizes
            .iter()
            .try_fold(1u64, |acc, &s| acc.checked_mul(s))
    }

    /// Number of elements (1 for a 0-d region). Saturates on overflow.
    pub fn volume(&self) -> u64 {
        self.checked_volume().unwrap_or(u64::MAX)
    }

    /// True when the region holds no element.
    pub fn is_empty(&self) -> bool {
        self.sizes.contains(&0)
    }

    /// End (exclusive) in dimension `d`.
    pub fn end(&self, d: usize) -> u64 {
        self.offsets[d].saturating_add(self.sizes[d])
    }

    /// The common part of two regions of the same rank, or `None` when it holds no element.
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        if self.ndim() != other.ndim() {
            return None;
        }
        let mut offsets = Dims::with_capacity(self.ndim());
        let mut sizes = Dims::with_capacity(self.ndim());
        for d in 0..self.ndim() {
            let lo = self.offsets[d].max(other.offsets[d]);
            let hi = self.end(d).min(other.end(d));
            if hi <= lo {
                return None;
            }
            offsets.push(lo);
            sizes.push(hi - lo);
        }
        Some(Region { offsets, sizes })
    }

    /// True when every element of `inner` lies in `self` (an empty `inner` whose offsets lie
    /// within `self`'s closed bounds counts as contained).
    pub fn contains(&self, inner: &Region) -> bool {
        self.ndim() == inner.ndim()
            && (0..self.ndim()).all(|d| {
                inner.offsets[d] >= self.offsets[d]
                    && inner.offsets[d]
                        .checked_add(inner.sizes[d])
                        .is_some_and(|e| e <= self.end(d))
            })
    }

    /// The offsets of `self` relative to `origin` (which must contain it).
    pub fn relative_to(&self, origin: &Region) -> Vec<u64> {
        self.offsets
            .iter()
            .zip(&origin.offsets)
            .map(|(a, b)| a - b)
            .collect()
    }
}

impl fmt::Display for Region {
    /// `[0:3, 4:8]`; a 0-d region prints as `[]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for d in 0..self.ndim() {
            if d > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}:{}", self.offsets[d], self.end(d))?;
        }
        f.write_str("]")
    }
}

/// Row-major element strides of a tensor of `shape` (inline: wanted for every copied pair
/// of pieces).
pub fn row_major_strides(shape: &[u64]) -> Dims {
    let mut strides: Dims = smallvec::smallvec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1]);
    }
    strides
}

/// A block of memory holding one region of a tensor: `region` stored from byte `base` with
/// element `strides` (row-major unless the producer saved a permuted view).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Strided<'a> {
    /// The region of the global tensor this block holds.
    pub region: &'a Region,
    /// Byte offset of the region's first element.
    pub base: u64,
    /// Element strides, one per dimension.
    pub strides: &'a [u64],
    /// Bytes per element.
    pub elem: u64,
}

/// One run of a copy: `count` rows of `len` bytes, row `i` starting at
/// `src + i * src_stride` and `dst + i * dst_stride` (strides in bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// First source byte.
    pub src: u64,
    /// First destination byte.
    pub dst: u64,
    /// Elements per row.
    pub elems: u64,
    /// Number of rows.
    pub count: u64,
    /// Source bytes between row starts.
    pub src_stride: u64,
    /// Destination bytes between row starts.
    pub dst_stride: u64,
}

/// Decompose the copy of `b` (a region inside both blocks) from `src` to `dst` into maximal
/// runs: dimensions are merged from the innermost outward while both sides stay contiguous,
/// the next dimension out becomes the row dimension of a strided run, and any dimensions
/// further out are enumerated. Calls `f` once per run.
pub fn for_each_run(b: &Region, src: &Strided, dst: &Strided, mut f: impl FnMut(Run)) {
    let n = b.ndim();
    let ls = b.relative_to(src.region);
    let ld = b.relative_to(dst.region);
    let elem_offset = |local: &[u64], strides: &[u64]| -> u64 {
        local.iter().zip(strides).map(|(i, s)| i * s).sum::<u64>()
    };
    let src0 = src.base + elem_offset(&ls, src.strides) * src.elem;
    let dst0 = dst.base + elem_offset(&ld, dst.strides) * dst.elem;
    if n == 0 {
        f(Run {
            src: src0,
            dst: dst0,
            elems: 1,
            count: 1,
            src_stride: 0,
            dst_stride: 0,
        });
        return;
    }
    // Merge a contiguous suffix of dimensions into one run of `elems` elements.
    let mut k = n;
    let mut elems = 1u64;
    if src.strides[n - 1] == 1 && dst.strides[n - 1] == 1 {
        elems = b.sizes[n - 1];
        k = n - 1;
        while k > 0 && src.strides[k - 1] == elems && dst.strides[k - 1] == elems {
            elems *= b.sizes[k - 1];
            k -= 1;
        }
    }
    // The next dimension out (if any) is the row dimension.
    let (count, src_stride, dst_stride, outer) = if k > 0 {
        (
            b.sizes[k - 1],
            src.strides[k - 1] * src.elem,
            dst.strides[k - 1] * dst.elem,
            k - 1,
        )
    } else {
        (1, 0, 0, 0)
    };
    // Enumerate the remaining outer dimensions 0..outer with an odometer.
    let mut idx = vec![0u64; outer];
    loop {
        let so: u64 = idx.iter().zip(src.strides).map(|(i, s)| i * s).sum();
        let dos: u64 = idx.iter().zip(dst.strides).map(|(i, s)| i * s).sum();
        f(Run {
            src: src0 + so * src.elem,
            dst: dst0 + dos * dst.elem,
            elems,
            count,
            src_stride,
            dst_stride,
        });
        // advance
        let mut d = outer;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < b.sizes[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_tile_dimension_zero() {
        // 10 rows of 3 f32 (12 B): 25 B blocks hold 2 rows
        let b = Region::row_blocks(&[10, 3], 4, 25);
        assert_eq!(b.len(), 5);
        assert!(b
            .iter()
            .enumerate()
            .all(|(k, r)| r.offsets[..] == [2 * k as u64, 0] && r.sizes[..] == [2, 3]));
        // a row larger than the block: one row each; 0-d and empty: one box
        assert_eq!(Region::row_blocks(&[3, 100], 8, 16).len(), 3);
        assert_eq!(Region::row_blocks(&[], 4, 1), vec![Region::full(&[])]);
        assert_eq!(
            Region::row_blocks(&[0, 5], 4, 1),
            vec![Region::full(&[0, 5])]
        );
        assert_eq!(
            Region::row_blocks(&[7, 2], 1, 1 << 20),
            vec![Region::full(&[7, 2])]
        );
    }

    fn r(o: &[u64], s: &[u64]) -> Region {
        Region::new(o.to_vec(), s.to_vec())
    }

    #[test]
    fn intersection_volume_containment() {
        let a = r(&[0, 0], &[4, 6]);
        let b = r(&[2, 3], &[4, 6]);
        assert_eq!(a.intersect(&b), Some(r(&[2, 3], &[2, 3])));
        assert_eq!(a.volume(), 24);
        assert!(a.contains(&r(&[1, 1], &[2, 2])));
        assert!(!a.contains(&b));
        assert_eq!(a.intersect(&r(&[4, 0], &[1, 6])), None);
        // 0-d regions
        let s = r(&[], &[]);
        assert_eq!(s.volume(), 1);
        assert_eq!(s.intersect(&s), Some(s.clone()));
        assert!(s.contains(&s));
        // empty region at the end of a dim is contained
        assert!(r(&[0, 0], &[3, 12]).contains(&r(&[3, 0], &[0, 12])));
        assert!(r(&[3, 0], &[0, 12]).is_empty());
        assert_eq!(format!("{}", a), "[0:4, 0:6]");
    }

    fn runs(b: &Region, s: &Strided, d: &Strided) -> Vec<Run> {
        let mut v = vec![];
        for_each_run(b, s, d, |r| v.push(r));
        v
    }

    #[test]
    fn dim0_pieces_merge_into_one_run() {
        let full = r(&[0, 0], &[10, 12]);
        let piece = r(&[3, 0], &[3, 12]);
        let fs = row_major_strides(&full.sizes);
        let ps = row_major_strides(&piece.sizes);
        let src = Strided {
            region: &piece,
            base: 100,
            strides: &ps,
            elem: 4,
        };
        let dst = Strided {
            region: &full,
            base: 8,
            strides: &fs,
            elem: 4,
        };
        let v = runs(&piece, &src, &dst);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].elems, 36);
        assert_eq!(v[0].count, 1);
        assert_eq!(v[0].src, 100);
        assert_eq!(v[0].dst, 8 + 3 * 12 * 4);
    }

    #[test]
    fn column_pieces_become_one_strided_run() {
        let full = r(&[0, 0], &[4, 8]);
        let piece = r(&[0, 4], &[4, 4]);
        let fs = row_major_strides(&full.sizes);
        let ps = row_major_strides(&piece.sizes);
        let src = Strided {
            region: &piece,
            base: 0,
            strides: &ps,
            elem: 2,
        };
        let dst = Strided {
            region: &full,
            base: 0,
            strides: &fs,
            elem: 2,
        };
        let v = runs(&piece, &src, &dst);
        assert_eq!(
            v,
            vec![Run {
                src: 0,
                dst: 8,
                elems: 4,
                count: 4,
                src_stride: 8,
                dst_stride: 16
            }]
        );
    }

    #[test]
    fn transposed_source_walks_elements() {
        // a (3,2) tensor stored with strides (1,3)
        let full = r(&[0, 0], &[3, 2]);
        let st = [1u64, 3];
        let fs = row_major_strides(&full.sizes);
        let src = Strided {
            region: &full,
            base: 0,
            strides: &st,
            elem: 4,
        };
        let dst = Strided {
            region: &full,
            base: 0,
            strides: &fs,
            elem: 4,
        };
        let v = runs(&full, &src, &dst);
        // innermost not contiguous on the source: rows of 1 element along dim 1, dim 0 enumerated
        assert_eq!(v.len(), 3);
        assert_eq!(
            v[1],
            Run {
                src: 4,
                dst: 8,
                elems: 1,
                count: 2,
                src_stride: 12,
                dst_stride: 4
            }
        );
    }

    #[test]
    fn three_d_enumerates_outer_dims() {
        let full = r(&[0, 0, 0], &[2, 3, 4]);
        let b = r(&[0, 1, 0], &[2, 2, 2]);
        let fs = row_major_strides(&full.sizes);
        let bs = row_major_strides(&b.sizes);
        let src = Strided {
            region: &b,
            base: 0,
            strides: &bs,
            elem: 1,
        };
        let dst = Strided {
            region: &full,
            base: 0,
            strides: &fs,
            elem: 1,
        };
        let v = runs(&b, &src, &dst);
        assert_eq!(v.len(), 2);
        assert_eq!(
            v[0],
            Run {
                src: 0,
                dst: 4,
                elems: 2,
                count: 2,
                src_stride: 2,
                dst_stride: 4
            }
        );
        assert_eq!(v[1].src, 4);
        assert_eq!(v[1].dst, 16);
    }
}
