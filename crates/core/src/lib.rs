//! reshard-core: the lowest floor of reshard — the algebra everything else composes, and the
//! descriptions the floors above hand each other. No I/O: nothing here opens a file, maps
//! memory or reaches a network (a layout file named on the command line is read by
//! [`target::LayoutSpec::from_file`], the one exception, before anything is planned).
//!
//! | module | owns |
//! |---|---|
//! | [`layout`] | dtypes, regions, placements over a mesh, tensor layouts, cast kernels |
//! | [`plan`] | source layout × target layout → a minimal copy plan (pure, serializable) |
//! | [`recipe`] | mappings between frameworks' names and fusions, compiled to views |
//! | [`target`] | what the user asks each target rank to hold ([`target::LayoutSpec`]) |
//! | [`parts`] | which worker of many this is, and the plan's split into parts |
//! | [`output`] | the files a writer lays out ([`output::OutputFile`]) |
//! | [`model`] | the format-neutral pieces of a checkpoint (keys, extras, recorded CRCs) |
//! | [`value`] | a Python value, as non-tensor entries hold |
//! | [`per_rank`] | which entries belong to one rank of the job that saved them |
//! | [`error`] | the one error type every floor returns |
//!
//! May import: nothing of reshard. Every other reshard crate builds on this one.
#![deny(missing_docs)]

pub mod error;
pub mod layout;
pub mod model;
pub mod output;
pub mod parts;
pub mod per_rank;
pub mod plan;
pub mod recipe;
pub mod target;
pub mod value;

pub use error::{Error, Hint, Result};
