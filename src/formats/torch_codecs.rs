//! The [`Codec`]s of the torch family: DCP directories and `torch.save` files.

use super::{
    dcp, dcp_write, pt, pt_read, Aliasing, Capabilities, Checkpoint, Codec, Container, Family,
    Output, Probe, Recognition, TargetTensor, WriteOptions,
};
use crate::error::Result;
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
    python_values: true,
    extras_kept: "as BYTE_IO items (Lightning's meta.pt keys in meta.pt)",
    aliasing: Aliasing::CopyPerName,
};

impl Codec for Dcp {
    fn capabilities(&self) -> &'static Capabilities {
        &DCP_CAPS
    }
    fn recognize(&self, probe: &Probe) -> Result<Recognition> {
        Ok(if !probe.is_file && dcp::is_dcp(probe.path)? {
            Recognition::Marker
        } else {
            Recognition::No
        })
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        dcp::read(path)
    }
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
        dcp_write::write(target, world, opts)
    }
}

/// One `torch.save` file (zip format) holding a state dict: read as one rank, written so that
/// `torch.load(weights_only=True)` opens it.
pub struct Pt;

static PT_CAPS: Capabilities = Capabilities {
    name: "pt",
    aliases: &["torch"],
    summary: "one torch.save file, for torch.load(weights_only=True) (one rank)",
    noun: "a .pt file (a consolidated state dict)",
    container: Container::File,
    extensions: &["pt", "pth"],
    max_world: Some(1),
    family: Family::Torch,
    python_values: true,
    extras_kept: "as Python values",
    aliasing: Aliasing::StoresOnce,
};

impl Codec for Pt {
    fn capabilities(&self) -> &'static Capabilities {
        &PT_CAPS
    }
    fn recognize(&self, probe: &Probe) -> Result<Recognition> {
        // a zip archive, or a legacy torch.save pickle (which the reader names and refuses)
        let pt = probe.is_file
            && (probe.head.starts_with(b"PK\x03\x04") || pt_read::is_legacy(&probe.head));
        Ok(if pt {
            Recognition::Marker
        } else {
            Recognition::No
        })
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        pt_read::read(path)
    }
    fn write(&self, target: &[TargetTensor], _world: u32, opts: &WriteOptions) -> Result<Output> {
        pt::write(target, opts)
    }
}
