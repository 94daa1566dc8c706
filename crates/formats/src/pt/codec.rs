//! The [`Codec`] of `torch.save` files: capabilities, recognition (a zip or legacy
//! torch.save magic number), and the reader and writer of this folder.

use crate::error::Result;
use crate::{
    pt, Aliasing, Capabilities, Checkpoint, Codec, Container, Family, Output, Probe, Recognition,
    TargetTensor, WriteOptions,
};
use std::path::Path;

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
    extras_kept: "as Python values",
    keeps_opaque: false,
    aliasing: Aliasing::StoresOnce,
    written: true,
};

impl Codec for Pt {
    fn capabilities(&self) -> &'static Capabilities {
        &PT_CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        // a zip archive, or a legacy torch.save pickle (which the reader names and refuses)
        Recognition::marker_if(
            probe.is_file
                && (probe.head.starts_with(b"PK\x03\x04") || pt::read::is_legacy(&probe.head)),
        )
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        pt::read::read(path)
    }
    fn write(&self, target: &[TargetTensor], _world: u32, opts: &WriteOptions) -> Result<Output> {
        pt::write(target, opts)
    }
}
