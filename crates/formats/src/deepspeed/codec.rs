//! The [`Codec`] of DeepSpeed ZeRO checkpoints: capabilities, recognition (a `latest` file or
//! DeepSpeed's model states file names), and the reader and writer of this folder.

use super::{names, read};
use crate::checkpoint::OpenOptions;
use crate::error::Result;
use crate::{
    Aliasing, Capabilities, Checkpoint, Codec, Container, Family, Output, Probe, Recognition,
    TargetTensor, WriteOptions,
};
use reshard_core::model::Weights;
use std::path::Path;

/// DeepSpeed ZeRO checkpoints (stages 1, 2 and 3).
pub struct DeepSpeed;

static DEEPSPEED_CAPS: Capabilities = Capabilities {
    name: "deepspeed",
    aliases: &["zero"],
    summary: "DeepSpeed ZeRO checkpoint (stages 1-3), for engine.load_checkpoint at M data-parallel ranks",
    noun: "a DeepSpeed ZeRO checkpoint",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Torch,
    extras_kept: "as the model states' entries (engine counters, ds_config, client state)",
    keeps_opaque: false,
    aliasing: Aliasing::CopyPerName,
    written: true,
};

impl Codec for DeepSpeed {
    fn capabilities(&self) -> &'static Capabilities {
        &DEEPSPEED_CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        Recognition::marker_if(
            !probe.is_file
                && !super::universal::is_tag_folder(probe)
                && probe.files.iter().any(|n| {
                    n == "latest"
                        || matches!(
                            names::kind(n),
                            Some(
                                names::Kind::ModelStates { .. }
                                    | names::Kind::RankModelStates { .. }
                            )
                        )
                }),
        )
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read::read(path, &OpenOptions::default())
    }
    fn read_weights(&self, path: &Path, weights: Weights) -> Result<Checkpoint> {
        read::read(
            path,
            &OpenOptions {
                weights: Some(weights),
                ..Default::default()
            },
        )
    }
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
        super::write::write(target, world, opts)
    }
}
