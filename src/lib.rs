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
//! # The floors
//! This crate is the front door over four library crates, each of which may import only
//! those below it (the compiler holds the order):
//! - `reshard-core`: the layout algebra, the planner, target layouts, parts, the description
//!   of outputs, the format-neutral pieces of a checkpoint, errors — no I/O;
//! - `reshard-storage`: local files and object stores, reading copy ops into memory;
//! - `reshard-formats`: one module per format behind one codec interface and one registry,
//!   and the [`Checkpoint`] a reader produces;
//! - `reshard-exec`: the executor and the atomic commit, whole or in parts.
//!
//! This crate holds the jobs that use them all ([`convert`], [`load`], [`verify`], [`diff`])
//! and the command line (feature `cli`). With the `internals` feature (the project's tests,
//! benches and fuzz targets only; no stability promise) the executor, commit and tie finder
//! are re-exported at their old paths, hidden from the docs.
#![deny(missing_docs)]

#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod cli;
pub mod convert;
pub mod diff;
pub mod fp8;
pub mod load;
pub mod recipe;
mod select;
pub mod verify;

pub use reshard_core::{layout, parts, per_rank, plan, target};

/// The formats: what each can hold ([`Format`], [`formats::Capabilities`]), detecting one,
/// choosing an output format, and the interface a new one implements ([`formats::Codec`],
/// listed in [`formats::REGISTRY`]). The formats' own modules are `reshard-formats`'.
#[cfg(not(feature = "internals"))]
pub mod formats {
    pub use reshard_formats::{
        checkpoints_in, choose, detect, latest_step, output_format, step_of, write, Aliasing,
        Capabilities, Checkpoint, Choice, Codec, Container, Extra, Family, Format, KeyPart, Opaque,
        Output, Probe, Recognition, RecordCrc, WriteOptions, EXTRAS_KEY, EXTRAS_PICKLE_KEY,
        PATHS_KEY, REGISTRY,
    };
}
/// The formats crate whole, at its old path, for the project's tests, benches and fuzz
/// targets.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub use reshard_formats as formats;

/// Object storage (`s3://`, `gs://`, `az://`, `http(s)://` checkpoints): what a front end
/// sets and reports. Reading and writing URLs needs nothing else: every function that takes
/// a path takes a URL.
pub mod remote {
    pub use reshard_storage::remote::{fetch_stats, is_url, set_endpoint_url, FetchStats};
}

/// Re-exported at their old paths for the project's tests, benches and fuzz targets.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub use {reshard_exec as exec, reshard_exec::commit, reshard_formats::ties};
#[cfg(not(feature = "internals"))]
pub(crate) use {reshard_exec as exec, reshard_exec::commit, reshard_formats::ties};

pub(crate) use reshard_core::error;
pub(crate) use reshard_formats::checkpoint;
pub(crate) use reshard_storage::sys;

pub use checkpoint::{
    read_companion as read_model_config, Checkpoint, OpenOptions, PathFlavor, SavedId, SavedMeta,
};
pub use convert::{ConvertOptions, Job};
pub use error::{Error, Hint, Result};
pub use exec::{ExecOptions, ExecStats, Progress};
pub use formats::Format;
pub use reshard_core::model::{Extra, KeyPart, Opaque, RecordCrc, Weights};
pub use reshard_formats::array::Element;
pub use reshard_formats::torch::pickle::extra_pickle;
pub use select::Selection;
pub use target::LayoutSpec;
