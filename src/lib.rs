//! reshard: move distributed-training checkpoints between world sizes — offline or at load
//! time, with no process group, in bounded memory.
//!
//! The pipeline is read → plan → write around one algebra:
//! - [`layout`]: dtypes, regions, placements over a mesh, tensor layouts;
//! - [`formats`]: the format registry — each format's reader turns files into a
//!   [`Checkpoint`] (layouts plus byte locations), its writer turns a target layout into
//!   destination files; [`Format`] says what each can hold;
//! - [`plan`]: source layout × target layout → a minimal copy plan (pure, serializable);
//! - the executor runs a plan with memory-mapped sources and parallel copies
//!   ([`ExecOptions`], [`Progress`]), and the commit makes the output appear atomically;
//! - [`convert`]: the end-to-end job; [`load`]: what rank r of M reads, for trainers.
//!
//! # The library API
//! - [`Checkpoint::open`]: any supported format; [`Checkpoint::tensors`] lists its tensors
//!   (each a [`layout::TensorLayout`]), [`Checkpoint::extras`] its non-tensor entries;
//!   [`Checkpoint::open_lazy`] for reading only (item headers read when a read needs them);
//! - [`Checkpoint::read_region`] / [`Checkpoint::read_region_into`]: one region of one
//!   tensor, into a new buffer or the caller's;
//! - [`load::local_shards`] / [`load::local_shards_into`]: every region rank r of M holds
//!   under a [`LayoutSpec`];
//! - [`convert::convert`] (or [`convert::prepare`] then [`convert::run`]) with
//!   [`ConvertOptions`]; [`verify::checksums`]; [`diff::diff`];
//! - [`Error`]: one line naming the file; [`Error::hint`] says which setting would help.
//!
//! Everything else is crate-private. With the `internals` feature (tests, benches and fuzz
//! targets only; no stability promise) the format, executor and commit modules are public,
//! hidden from the docs.
#![warn(missing_docs)]

/// Declares modules that are crate-private, and public but hidden with the `internals`
/// feature (for the project's tests, benches and fuzz targets).
macro_rules! internal {
    ($($(#[$m:meta])* mod $name:ident;)*) => {$(
        $(#[$m])*
        #[cfg(feature = "internals")]
        #[doc(hidden)]
        pub mod $name;
        $(#[$m])*
        #[cfg(not(feature = "internals"))]
        pub(crate) mod $name;
    )*};
}
pub(crate) use internal;

mod array;
mod checkpoint;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod cli;
pub mod convert;
pub mod diff;
mod error;
pub mod formats;
pub mod layout;
pub mod load;
pub mod parts;
pub mod per_rank;
pub mod plan;
pub mod remote;
mod select;
mod sys;
pub mod target;
pub mod verify;

internal! {
    mod commit;
    mod exec;
    mod ties;
}

pub use array::Element;
pub use checkpoint::{
    read_companion as read_model_config, Checkpoint, Extra, KeyPart, OpenOptions, RecordCrc,
    Weights,
};
pub use convert::{ConvertOptions, Job};
pub use error::{Error, Hint, Result};
pub use exec::{ExecOptions, ExecStats, Progress};
pub use formats::Format;
pub use select::Selection;
pub use target::LayoutSpec;
