//! The layout algebra: dtypes, N-d regions, placements over a device mesh, and tensor layouts.
//!
//! Everything else in reshard speaks in these terms: readers describe what a checkpoint holds
//! as [`TensorLayout`]s, a target is a [`Sharding`] (or flat ranges) compiled to regions per
//! rank, and the planner intersects the two. A [`View`] defines a target tensor through
//! transforms of source tensors (slices, splits, merges, permutations, concatenation,
//! padding), compiled to strided parts the planner maps pieces through.

mod blocks;
pub mod cast;
mod dtype;
mod placement;
mod region;
mod summary;
mod tensor;
mod view;

pub use blocks::BlockFlat;
pub use dtype::DType;
pub use placement::{
    chunk_range, even_range, flat_range_boxes, flat_ranges, FlatShare, Mesh, Placement, Sharding,
};
pub use region::{for_each_run, row_major_strides, Region, Run, Strided};
pub use summary::summary;
pub use tensor::{distinct_regions, join, Loc, Piece, TensorLayout, MAX_DIMS};
pub use view::{Axis, Fill, PartFrom, View, ViewMap, ViewPart, MAX_PARTS};
