//! reshard: move distributed-training checkpoints between world sizes.
//!
//! The pipeline is read → plan → write around one algebra:
//! - [`layout`]: dtypes, regions, placements over a mesh, tensor layouts;
//! - [`formats`]: readers that turn checkpoint files into layouts plus byte locations, and
//!   writers that turn a target layout into destination files;
//! - [`plan`]: source layout × target layout → a minimal copy plan (pure, serializable);
//! - [`exec`]: runs a plan with memory-mapped sources and parallel copies, then commits
//!   the outputs atomically;
//! - [`convert`]: the end-to-end job the CLI and trainers call; [`per_rank`] says which
//!   entries belong to one rank and what a conversion does with them.

pub mod array;
pub mod checkpoint;
pub mod commit;
pub mod convert;
pub mod diff;
pub mod error;
pub mod exec;
pub mod formats;
pub mod layout;
pub mod load;
pub mod per_rank;
pub mod plan;
pub mod select;
mod sys;
pub mod target;
pub mod ties;
pub mod verify;

pub use error::{Error, Hint, Result};
