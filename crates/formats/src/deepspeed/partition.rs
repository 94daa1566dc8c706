//! Where ZeRO puts each parameter's elements: the partition arithmetic of DeepSpeed's three
//! optimizers, as pure functions of the parameter sizes and the data-parallel degree, shared
//! by the reader (which finds the elements) and the writer (which lays them out for another
//! degree).
//!
//! - Stages 1 and 2 (`DeepSpeedZeroOptimizer`, and `BF16_Optimizer` for bf16 at stage 1 with
//!   fp32 gradient accumulation): a parameter group is flattened — parameters in order, each
//!   followed by its alignment padding — padded at the end to a multiple of `2·dp` elements
//!   and cut into `dp` equal partitions ([`FlatGroup`]). A parameter can straddle ranks.
//! - Stage 3: every parameter is partitioned on its own into chunks of `ceil(numel / dp)`
//!   ([`chunk`]), the last padded; a rank's flat fp32 group is its chunks in order, and a
//!   parameter group is split into sub-groups of about `sub_group_size` local elements
//!   ([`sub_groups`]).

/// One parameter group of ZeRO stage 1 or 2, flattened over `dp` ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatGroup {
    /// Elements of each parameter, in flattening order.
    pub numels: Vec<u64>,
    /// Zero elements after each parameter (DeepSpeed's `param_alignment_paddings`).
    pub paddings: Vec<u64>,
    /// Data-parallel degree.
    pub dp: u64,
}

/// A run of a parameter's flat elements held by one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The rank.
    pub rank: u64,
    /// First element, in the parameter's row-major order.
    pub start: u64,
    /// One past the last element.
    pub end: u64,
    /// Where `start` sits in the rank's flat tensor, in elements.
    pub at: u64,
}

impl FlatGroup {
    /// A group of parameters of `numels` elements without alignment padding.
    #[cfg(test)]
    pub fn new(numels: Vec<u64>, dp: u64) -> FlatGroup {
        let paddings = vec![0; numels.len()];
        FlatGroup {
            numels,
            paddings,
            dp,
        }
    }

    /// Where each parameter starts in the flat buffer.
    pub fn offsets(&self) -> Vec<u64> {
        let mut at = 0u64;
        self.numels
            .iter()
            .zip(&self.paddings)
            .map(|(n, p)| {
                let o = at;
                at = at.saturating_add(*n).saturating_add(*p);
                o
            })
            .collect()
    }

    /// Elements of the parameters and their paddings.
    pub fn padded_numel(&self) -> u64 {
        self.numels
            .iter()
            .chain(&self.paddings)
            .fold(0u64, |a, b| a.saturating_add(*b))
    }

    /// Elements of each rank's partition: the padded group rounded up to `2·dp`, over `dp`.
    pub fn partition_size(&self) -> u64 {
        let align = 2 * self.dp.max(1);
        self.padded_numel().div_ceil(align).saturating_mul(align) / self.dp.max(1)
    }

    /// Padding at the end of rank `rank`'s partition, as `DeepSpeedZeroOptimizer` records it
    /// (`group_paddings`): what it strips from the partition it saves.
    pub fn rank_padding(&self, rank: u64) -> u64 {
        let size = self.partition_size();
        let left = rank.saturating_mul(size);
        let padded = self.padded_numel();
        if padded <= left {
            size
        } else if padded < left.saturating_add(size) {
            left + size - padded
        } else {
            0
        }
    }

    /// The runs of parameter `i`'s elements, rank by rank.
    #[cfg(test)]
    pub fn spans(&self, i: usize) -> Vec<Span> {
        let size = self.partition_size();
        let start = self.offsets()[i];
        spans_over(start, self.numels[i], size)
    }

    /// The runs of every parameter, with the offsets computed once.
    pub fn all_spans(&self) -> Vec<Vec<Span>> {
        let size = self.partition_size();
        self.offsets()
            .into_iter()
            .zip(&self.numels)
            .map(|(o, &n)| spans_over(o, n, size))
            .collect()
    }
}

/// The runs of elements `start .. start + n` of a flat buffer cut into partitions of `size`.
fn spans_over(start: u64, n: u64, size: u64) -> Vec<Span> {
    let mut out = vec![];
    if size == 0 {
        return out;
    }
    let end = start.saturating_add(n);
    let mut a = start;
    while a < end {
        let rank = a / size;
        let b = end.min((rank + 1).saturating_mul(size));
        out.push(Span {
            rank,
            start: a - start,
            end: b - start,
            at: a - rank * size,
        });
        a = b;
    }
    out
}

/// `zero_optimization.round_robin_gradients` (stages 1 and 2): the order in which DeepSpeed
/// at `dp` ranks flattens a group of `n` parameters (`_round_robin_reorder`): the parameters
/// whose index is 0 modulo `dp` first, then those at 1, and so on. Entry `j` is the index, in
/// the group's own order, of the `j`-th parameter flattened.
pub fn round_robin(n: usize, dp: u64) -> Vec<usize> {
    let dp = dp.max(1) as usize;
    (0..dp.min(n.max(1)))
        .flat_map(|j| (j..n).step_by(dp))
        .collect()
}

/// The `param_slice_mappings` DeepSpeed 0.19.8 records for `group` (parameters in
/// flattening order): per parameter in that order, its runs by rank. `order[j]` is the
/// group's own index of the `j`-th parameter flattened ([`round_robin`], or the identity).
/// DeepSpeed places a fragment at the parameter's true offset when the group has alignment
/// padding, and otherwise at the sum of the sizes of the parameters before it in the group's
/// own order — not where round robin flattened it (its own links, and so
/// `safe_get_full_fp32_param`, read other parameters' elements then).
pub fn recorded_slices(group: &FlatGroup, order: &[usize]) -> Vec<Vec<Span>> {
    let identity = order.iter().enumerate().all(|(j, &i)| i == j);
    if identity || group.paddings.iter().any(|&p| p != 0) {
        return group.all_spans();
    }
    let n = order.len();
    let mut numels = vec![0; n];
    for (j, &i) in order.iter().enumerate() {
        numels[i] = group.numels[j];
    }
    let own = FlatGroup {
        numels,
        paddings: vec![0; n],
        dp: group.dp,
    }
    .all_spans();
    order.iter().map(|&i| own[i].clone()).collect()
}

/// The pieces of a tensor of `shape` whose flat runs `spans` lie in rank files: `at(rank)`
/// gives the file and the byte offset of the rank's flat tensor, `elem` the element size.
/// Each run is cut into the boxes of the tensor it covers
/// ([`flat_range_boxes`](crate::layout::flat_range_boxes)), each contiguous where the run is.
pub fn flat_pieces(
    shape: &[u64],
    spans: &[Span],
    at: impl Fn(u64) -> (u32, u64),
    elem: u64,
) -> Vec<crate::layout::Piece> {
    let strides = crate::layout::row_major_strides(shape);
    let mut pieces = vec![];
    for s in spans {
        let (file, base) = at(s.rank);
        for b in crate::layout::flat_range_boxes(shape, s.start, s.end) {
            let first: u64 = b.offsets.iter().zip(&strides).map(|(o, st)| o * st).sum();
            pieces.push(crate::layout::Piece {
                rank: s.rank as u32,
                loc: crate::layout::Loc {
                    file,
                    offset: base + (s.at + first - s.start) * elem,
                    strides: None,
                    pending: None,
                },
                region: b,
            });
        }
    }
    pieces
}

/// Stage 3: the elements of a parameter of `numel` elements each of `dp` ranks holds,
/// `ceil(numel / dp)` (the last rank's chunk padded).
pub fn chunk(numel: u64, dp: u64) -> u64 {
    numel.div_ceil(dp.max(1))
}

/// Stage 3: the runs of a parameter of `numel` elements whose chunk of `chunk` elements sits
/// at element `at` of every rank's flat tensor (`dp` ranks).
pub fn chunk_spans(numel: u64, chunk: u64, dp: u64, at: u64) -> Vec<Span> {
    (0..dp)
        .filter_map(|r| {
            let start = r.saturating_mul(chunk).min(numel);
            let end = (r + 1).saturating_mul(chunk).min(numel);
            (start < end).then_some(Span {
                rank: r,
                start,
                end,
                at,
            })
        })
        .collect()
}

/// Stage 3: how DeepSpeed splits a parameter group into sub-groups, given each parameter's
/// chunk (`_create_fp16_sub_groups`): the whole group when `sub_group_size` covers it, else
/// parameters are added until the local elements reach `sub_group_size`. Returns the number of
/// parameters in each sub-group.
pub fn sub_groups(chunks: &[u64], sub_group_size: u64) -> Vec<usize> {
    let total: u64 = chunks.iter().fold(0u64, |a, b| a.saturating_add(*b));
    if chunks.is_empty() || sub_group_size >= total {
        return vec![chunks.len()];
    }
    let mut out = vec![];
    let (mut n, mut local) = (0usize, 0u64);
    for (i, &c) in chunks.iter().enumerate() {
        n += 1;
        local = local.saturating_add(c);
        if local >= sub_group_size || i + 1 == chunks.len() {
            out.push(n);
            n = 0;
            local = 0;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero12_partitions_match_deepspeed_fixtures() {
        // zero1_dp2_f32_g1: 66 + 42 + 7 + 7 + 7 + 42 + 6 = 177 elements, padded to 180 for
        // 2·dp = 4: partitions of 90, rank 1 saves 87 (group_paddings [0, 3]).
        let g = FlatGroup::new(vec![66, 42, 7, 7, 7, 42, 6], 2);
        assert_eq!(g.partition_size(), 90);
        assert_eq!((g.rank_padding(0), g.rank_padding(1)), (0, 3));
        // lin.weight (42 at 66) straddles: 24 on rank 0, 18 on rank 1 at its start
        assert_eq!(
            g.spans(1),
            vec![
                Span {
                    rank: 0,
                    start: 0,
                    end: 24,
                    at: 66
                },
                Span {
                    rank: 1,
                    start: 24,
                    end: 42,
                    at: 0
                }
            ]
        );
        // zero1_dp2_bf16_g2, group 1: 7 + 7 + 7 + 6 = 27 -> 28, partitions of 14, padding 1
        let g = FlatGroup::new(vec![7, 7, 7, 6], 2);
        assert_eq!((g.partition_size(), g.rank_padding(1)), (14, 1));
    }

    #[test]
    fn padding_larger_than_a_partition() {
        // 3 elements over 4 ranks: 8 padded, partitions of 2; ranks 2 and 3 hold only padding
        let g = FlatGroup::new(vec![3], 4);
        assert_eq!(g.partition_size(), 2);
        let pads: Vec<u64> = (0..4).map(|r| g.rank_padding(r)).collect();
        assert_eq!(pads, vec![0, 1, 2, 2]);
        assert_eq!(g.spans(0).len(), 2);
    }

    #[test]
    fn spans_tile_every_parameter() {
        for dp in 1..6 {
            let g = FlatGroup {
                numels: vec![5, 0, 13, 1, 8],
                paddings: vec![3, 0, 1, 7, 0],
                dp,
            };
            let size = g.partition_size();
            assert_eq!(size * dp % (2 * dp), 0);
            for (i, spans) in g.all_spans().into_iter().enumerate() {
                let mut next = 0;
                for s in &spans {
                    assert_eq!(s.start, next);
                    assert!(s.at + (s.end - s.start) <= size);
                    assert_eq!(s.rank * size + s.at, g.offsets()[i] + s.start);
                    next = s.end;
                }
                assert_eq!(next, g.numels[i]);
            }
        }
    }

    #[test]
    fn round_robin_is_deepspeeds_reorder() {
        assert_eq!(round_robin(7, 3), vec![0, 3, 6, 1, 4, 2, 5]);
        assert_eq!(round_robin(4, 2), vec![0, 2, 1, 3]);
        assert_eq!(round_robin(3, 8), vec![0, 1, 2]);
        assert_eq!(round_robin(0, 2), Vec::<usize>::new());
        for (n, dp) in [(10, 4), (5, 1), (9, 9)] {
            let mut v = round_robin(n, dp);
            v.sort_unstable();
            assert_eq!(v, (0..n).collect::<Vec<_>>());
        }
    }

    #[test]
    fn recorded_slices_follow_deepspeeds_own_order_under_round_robin() {
        // zero2_dp3_f32_g2_roundrobin, group 0: own order emb 66, lin 42, out 42, head 66;
        // flattened at dp 3 as emb, head, lin, out; rank 0's param_slice_mappings say emb
        // (66 at 0) and lin (6 at 66) — head's elements are there
        let order = round_robin(4, 3);
        assert_eq!(order, vec![0, 3, 1, 2]);
        let g = FlatGroup::new(vec![66, 66, 42, 42], 3);
        let rec = recorded_slices(&g, &order);
        let rank0: Vec<(usize, u64, u64)> = rec
            .iter()
            .enumerate()
            .filter_map(|(j, sp)| {
                sp.iter()
                    .find(|s| s.rank == 0)
                    .map(|s| (order[j], s.end - s.start, s.at))
            })
            .collect();
        assert_eq!(rank0, vec![(0, 66, 0), (1, 6, 66)]);
        // with alignment padding DeepSpeed records the true places
        let mut padded = g.clone();
        padded.paddings = vec![2, 2, 2, 0];
        assert_eq!(recorded_slices(&padded, &order), padded.all_spans());
    }

    #[test]
    fn stage3_chunks_and_sub_groups() {
        // zero3_dp3_f32_g2 group 0: 66, 42, 42, 66 over 3 ranks -> 22 + 14 + 14 + 22 = 72
        let chunks: Vec<u64> = [66, 42, 42, 66].iter().map(|&n| chunk(n, 3)).collect();
        assert_eq!(chunks, vec![22, 14, 14, 22]);
        assert_eq!(sub_groups(&chunks, 1_000_000_000), vec![4]);
        assert_eq!(sub_groups(&chunks, 40), vec![3, 1]);
        assert_eq!(sub_groups(&[33, 21, 21, 33], 40), vec![2, 2]);
        assert_eq!(sub_groups(&[5, 5], 0), vec![1, 1]);
        // a 7-element parameter over 3 ranks: 3, 3, 1 (2 padding)
        let s = chunk_spans(7, chunk(7, 3), 3, 10);
        let runs: Vec<(u64, u64, u64)> = s.iter().map(|s| (s.rank, s.start, s.end)).collect();
        assert_eq!(runs, vec![(0, 0, 3), (1, 3, 6), (2, 6, 7)]);
        // more ranks than elements: empty chunks past the end
        assert_eq!(chunk_spans(2, chunk(2, 4), 4, 0).len(), 2);
    }
}
