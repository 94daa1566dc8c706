//! One-line, human-readable summaries of how a tensor is laid out over ranks, as `reshard
//! inspect` prints them (and any other front end that lists a checkpoint).

use super::{distinct_regions, Region, TensorLayout};

/// A short description of how `t` is laid out over ranks: `empty`, `whole on rank R`,
/// `replicated on N ranks`, `K chunks on N ranks along dim D: a:b c:d …` (the chunks' extents
/// in that dimension, in order), or `K boxes on N ranks, split along dims [..]`.
pub fn summary(t: &TensorLayout) -> String {
    let distinct = distinct_regions(t.pieces.iter().map(|p| &p.region));
    let ranks = t.ranks().len();
    if distinct.len() <= 1 {
        let holders = t.pieces.iter().filter(|p| !p.region.is_empty()).count();
        return match holders {
            0 => "empty".into(),
            1 => format!("whole on rank {}", t.ranks().first().copied().unwrap_or(0)),
            n => format!("replicated on {n} ranks"),
        };
    }
    let full = Region::full(&t.shape);
    let split: Vec<usize> = (0..t.shape.len())
        .filter(|&d| distinct.iter().any(|r| r.sizes[d] != full.sizes[d]))
        .collect();
    match split.as_slice() {
        [d] => {
            let mut extents: Vec<(u64, u64)> = distinct
                .iter()
                .map(|r| (r.offsets[*d], r.end(*d)))
                .collect();
            extents.sort_unstable();
            let extents: Vec<String> = extents.iter().map(|(a, b)| format!("{a}:{b}")).collect();
            format!(
                "{} chunks on {ranks} ranks along dim {d}: {}",
                distinct.len(),
                extents.join(" ")
            )
        }
        dims => format!(
            "{} boxes on {ranks} ranks, split along dims {dims:?}",
            distinct.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DType, Loc, Piece};

    fn layout(shape: &[u64], pieces: &[(u32, &[u64], &[u64])]) -> TensorLayout {
        TensorLayout {
            name: "w".into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces: pieces
                .iter()
                .map(|(rank, o, s)| Piece {
                    rank: *rank,
                    region: Region::new(o.to_vec(), s.to_vec()),
                    loc: Loc {
                        file: *rank,
                        offset: 0,
                        strides: None,
                        pending: None,
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn whole_replicated_and_empty() {
        assert_eq!(
            summary(&layout(&[4, 2], &[(3, &[0, 0], &[4, 2])])),
            "whole on rank 3"
        );
        let both = [(0, &[0u64, 0][..], &[4u64, 2][..]), (1, &[0, 0], &[4, 2])];
        assert_eq!(summary(&layout(&[4, 2], &both)), "replicated on 2 ranks");
        assert_eq!(summary(&layout(&[0, 2], &[(0, &[0, 0], &[0, 2])])), "empty");
    }

    #[test]
    fn chunks_along_one_dim_are_listed_in_order() {
        let t = layout(
            &[10, 12],
            &[
                (2, &[6, 0], &[3, 12]),
                (0, &[0, 0], &[3, 12]),
                (3, &[9, 0], &[1, 12]),
                (1, &[3, 0], &[3, 12]),
            ],
        );
        assert_eq!(
            summary(&t),
            "4 chunks on 4 ranks along dim 0: 0:3 3:6 6:9 9:10"
        );
    }

    #[test]
    fn boxes_split_along_several_dims() {
        let t = layout(
            &[4, 4],
            &[
                (0, &[0, 0], &[2, 2]),
                (1, &[0, 2], &[2, 2]),
                (2, &[2, 0], &[2, 2]),
                (3, &[2, 2], &[2, 2]),
            ],
        );
        assert_eq!(summary(&t), "4 boxes on 4 ranks, split along dims [0, 1]");
    }
}
