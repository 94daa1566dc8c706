//! Block-flattened views: a tensor cut into a regular grid of equal blocks, each block's
//! elements flattened in row-major order. A tensor of shape `[X, Y]` in blocks of `[x, y]`
//! is viewed as `[X/x, Y/y, x·y]`; element `(i, j, f)` of the view is element `f` of the
//! row-major flattening of block `(i, j)`. megatron-core stores its distributed optimizer's
//! flattened tensors this way (the block is a tensor-parallel shard, the last axis holds the
//! data-parallel ranks' flat ranges of it).
//!
//! [`BlockFlat::to_real`] maps a region of the view to the regions of the real tensor it
//! holds ([`flat_range_boxes`] per block), so a reader states a stored chunk as pieces of the
//! real tensor and the planner and executor need nothing more.

use super::{flat_range_boxes, row_major_strides, Region};

/// The block-flattened view of a tensor: its real shape and its block shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockFlat {
    shape: Vec<u64>,
    block: Vec<u64>,
    view: Vec<u64>,
}

impl BlockFlat {
    /// The view of a tensor of real shape `shape` stored as `view` (`[shape[d] / block[d]
    /// for each d] + [Π block]`): checks that `view` is such a shape and finds the blocks.
    pub fn new(shape: &[u64], view: &[u64]) -> Result<BlockFlat, String> {
        let bad = || {
            format!("a stored shape {view:?} is not a block-flattened view of the shape {shape:?}")
        };
        if view.len() != shape.len() + 1 {
            return Err(bad());
        }
        let mut block = Vec::with_capacity(shape.len());
        for (&n, &k) in shape.iter().zip(view) {
            if k == 0 || n % k != 0 {
                return Err(bad());
            }
            block.push(n / k);
        }
        let per_block = block
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(b))
            .ok_or_else(bad)?;
        if view[shape.len()] != per_block {
            return Err(bad());
        }
        Ok(BlockFlat {
            shape: shape.to_vec(),
            block,
            view: view.to_vec(),
        })
    }

    /// The real shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The shape of one block.
    pub fn block(&self) -> &[u64] {
        &self.block
    }

    /// The view's shape: blocks per dimension, then the elements of a block.
    pub fn view_shape(&self) -> Vec<u64> {
        self.view.clone()
    }

    /// The regions of the real tensor that the region `view` of the view holds, each with
    /// the position of its first element in `view`'s row-major order; every region is
    /// row-major contiguous from there. In the view's order: block by block, each block's
    /// range in flat order.
    pub fn to_real(&self, view: &Region) -> Result<Vec<(Region, u64)>, String> {
        let n = self.shape.len();
        let vshape = self.view_shape();
        if view.ndim() != n + 1 || (0..=n).any(|d| view.end(d) > vshape[d]) {
            return Err(format!(
                "region {view} lies outside the block-flattened view {vshape:?}"
            ));
        }
        let (a, len) = (view.offsets[n], view.sizes[n]);
        let cells: Vec<u64> = view.sizes[..n].to_vec();
        let mut out = vec![];
        if len == 0 || cells.contains(&0) {
            return Ok(out);
        }
        let count = cells
            .iter()
            .try_fold(1u64, |acc, &c| acc.checked_mul(c))
            .filter(|c| c.checked_mul(len).is_some())
            .ok_or_else(|| format!("region {view} is too large"))?;
        let strides = row_major_strides(&self.block);
        let mut cell = vec![0u64; n];
        for k in 0..count {
            // the k-th block of the region, in row-major order
            let mut rest = k;
            for d in (0..n).rev() {
                cell[d] = view.offsets[d] + rest % cells[d];
                rest /= cells[d];
            }
            for b in flat_range_boxes(&self.block, a, a + len) {
                let first: u64 = b.offsets.iter().zip(&strides).map(|(o, s)| o * s).sum();
                let offsets: Vec<u64> = (0..n)
                    .map(|d| cell[d] * self.block[d] + b.offsets[d])
                    .collect();
                out.push((Region::new(offsets, b.sizes), k * len + first - a));
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of the view, mapped back through `to_real`, lands on the real element
    /// the definition says, once.
    #[test]
    fn view_elements_map_to_their_real_elements() {
        let (shape, view) = ([6u64, 4, 3], [3u64, 2, 1, 12]);
        let bf = BlockFlat::new(&shape, &view).unwrap();
        assert_eq!(bf.block(), &[2, 2, 3]);
        assert_eq!(bf.view_shape(), view.to_vec());
        // the real flat index of view element (i, j, k, f)
        let real = |c: &[u64], f: u64| {
            let (b0, b1, b2) = (f / 6, (f / 3) % 2, f % 3);
            let (r0, r1, r2) = (c[0] * 2 + b0, c[1] * 2 + b1, c[2] * 3 + b2);
            r0 * 12 + r1 * 3 + r2
        };
        for (offs, sizes) in [
            (vec![1, 0, 0, 0], vec![1, 1, 1, 6]),
            (vec![2, 1, 0, 1], vec![1, 1, 1, 4]),
            (vec![0, 0, 0, 5], vec![3, 2, 1, 1]),
            (vec![1, 1, 0, 2], vec![2, 1, 1, 3]),
        ] {
            let r = Region::new(offs.clone(), sizes.clone());
            let got = bf.to_real(&r).unwrap();
            // expected: view elements in row-major order of the region
            let mut want = vec![];
            for i in 0..sizes[0] {
                for j in 0..sizes[1] {
                    for f in 0..sizes[3] {
                        want.push(real(&[offs[0] + i, offs[1] + j, 0], offs[3] + f));
                    }
                }
            }
            let mut seen = vec![None; want.len()];
            for (reg, at) in &got {
                let st = row_major_strides(reg.sizes.as_slice());
                for e in 0..reg.volume() {
                    let mut idx = 0;
                    let mut rest = e;
                    for d in 0..3 {
                        let i = rest / st[d];
                        rest %= st[d];
                        idx += (reg.offsets[d] + i) * [12, 3, 1][d];
                    }
                    let pos = (at + e) as usize;
                    assert!(seen[pos].is_none(), "{r}: element {pos} twice");
                    seen[pos] = Some(idx);
                }
            }
            let seen: Vec<u64> = seen.into_iter().map(|s| s.expect("covered")).collect();
            assert_eq!(seen, want, "{r}");
        }
    }

    #[test]
    fn shapes_that_are_not_views_are_refused() {
        assert!(BlockFlat::new(&[16, 8], &[2, 1, 64]).is_ok());
        assert!(BlockFlat::new(&[16], &[2, 8]).is_ok());
        assert!(BlockFlat::new(&[16, 8], &[2, 1, 63]).is_err());
        assert!(BlockFlat::new(&[16, 8], &[3, 1, 40]).is_err());
        assert!(BlockFlat::new(&[16, 8], &[0, 1, 64]).is_err());
        assert!(BlockFlat::new(&[16, 8], &[16, 8]).is_err());
        // an empty real tensor: no block to divide by
        let empty = BlockFlat::new(&[0, 4], &[1, 1, 0]).unwrap();
        assert_eq!(empty.view_shape(), vec![1, 1, 0]);
        assert!(empty
            .to_real(&Region::new(vec![0, 0, 0], vec![1, 1, 0]))
            .unwrap()
            .is_empty());
        // hostile sizes: an error or nothing, no overflow
        let big = 1u64 << 33;
        let huge = BlockFlat::new(&[big, big], &[big, big, 1]).unwrap();
        assert!(huge
            .to_real(&Region::new(vec![0, 0, 0], vec![big, big, 0]))
            .unwrap()
            .is_empty());
        let huge = BlockFlat::new(&[big << 20, big << 20], &[big, big, 1 << 40]).unwrap();
        assert!(huge
            .to_real(&Region::new(vec![0, 0, 0], vec![big, big, 1 << 40]))
            .is_err());
        let bf = BlockFlat::new(&[16, 8], &[2, 1, 64]).unwrap();
        assert!(bf
            .to_real(&Region::new(vec![1, 0, 60], vec![1, 1, 5]))
            .is_err());
        assert!(bf.to_real(&Region::new(vec![1, 0], vec![1, 1])).is_err());
    }
}
