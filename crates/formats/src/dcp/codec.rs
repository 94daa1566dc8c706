//! The [`Codec`] of PyTorch Distributed Checkpoints: capabilities, recognition (a
//! `.metadata` file), and the reader and writer of this folder.

use crate::error::Result;
use crate::{
    dcp, Aliasing, Capabilities, Checkpoint, Codec, Container, Family, Output, Probe, Recognition,
    TargetTensor, WriteOptions,
};
use std::path::Path;

/// PyTorch Distributed Checkpoints (`torch.distributed.checkpoint`).
pub struct Dcp;

static DCP_CAPS: Capabilities = Capabilities {
    name: "dcp",
    aliases: &[],
    summary: "PyTorch Distributed Checkpoint, for torch.distributed.checkpoint.load (any M)",
    noun: "a DCP checkpoint",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Torch,
    extras_kept: "as BYTE_IO items (Lightning's meta.pt keys in meta.pt)",
    keeps_opaque: true,
    aliasing: Aliasing::CopyPerName,
    written: true,
};

impl Codec for Dcp {
    fn capabilities(&self) -> &'static Capabilities {
        &DCP_CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        // a megatron-core folder is a DCP checkpoint and more: it is that format's
        Recognition::marker_if(
            probe.files.iter().any(|n| dcp::is_metadata_name(n))
                && !crate::megatron::looks_like(probe),
        )
    }
    // a Megatron-LM fsdp_dtensor save is a DCP checkpoint too, told by its `args`: that format's
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        crate::megatron_fsdp::claim(dcp::read(path)?)
    }
    fn read_lazy(&self, path: &Path) -> Result<Checkpoint> {
        crate::megatron_fsdp::claim(dcp::read_lazy(path)?)
    }
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
        dcp::write::write(target, world, opts)
    }
    fn index(&self, files: &[(std::path::PathBuf, u64)], fetch: crate::index::Fetch) -> Result<()> {
        crate::index::dcp(files, fetch)
    }
}
