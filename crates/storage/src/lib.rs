//! reshard-storage: where reshard's bytes live, and reading them.
//!
//! | module | owns |
//! |---|---|
//! | [`sys`] | the Linux system calls beyond `std`: kernel copies, preallocation, page release, locks, atomic swaps, read-only mappings |
//! | [`remote`] | object stores (`s3://`, `gs://`, `az://`, `http(s)://`) through `object_store`: sparse local mirrors filled by ranged reads, streamed multipart uploads |
//! | [`read`] | performing copy ops into the caller's buffers (a region of a tensor, a rank's shards) |
//! | [`source`] | storage as an interface: [`Storage`] ([`Local`], an object store's mirror), the [`Sources`] a reader is handed, and telling paths from URLs ([`locate`], [`open`]) |
//!
//! May import: `reshard-core`. Knows no file format: a rule that depends on one (which object
//! makes a checkpoint loadable) is given by the caller.
#![deny(missing_docs)]

pub mod read;
pub mod remote;
pub mod source;
pub mod sys;

pub use source::{
    local, locate, open, Backend, Local, Location, Opened, Sources, Storage, BACKENDS,
};

/// The core floor's modules, at the paths this crate's code names them by.
pub(crate) use reshard_core::{error, layout, plan};
