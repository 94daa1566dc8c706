//! megatron-core distributed checkpoints (`megatron.core.dist_checkpointing`, the `torch_dist`
//! backend; `docs/megatron-format.md`). A folder of:
//!
//! - `metadata.json`: `{"sharded_backend": "torch_dist", "common_backend": "torch", …}`, the
//!   marker megatron-core itself checks;
//! - `common.pt`: a `torch.save` of the state that is not sharded (iteration, config, …),
//!   read here as non-tensor entries and written back from them;
//! - a PyTorch Distributed Checkpoint (`.metadata` + `__R_T.distcp`, two writer threads per
//!   rank), read and written by [`super::dcp`]: megatron-core's `MCoreMetadata` and the save
//!   plans it records are decoded there, and tensors stored block-flattened (its distributed
//!   optimizer's `flattened_range`, the real shape in `mcore_data`) become pieces of the real
//!   tensor ([`crate::layout::BlockFlat`]). Layer-stacked tensors (`prepend_axis_num`) are
//!   plain tensors with one more axis; `ShardedObject`s are `BYTE_IO` items named
//!   `<key>/shard_<offsets>_<shape>`.
//!
//! megatron-core's loader reads any chunking of a global tensor, so an output of any number
//! of ranks loads at any tensor- and data-parallel split whose sharded state dict names the
//! same keys and global shapes. An output is written inside a Megatron-LM save directory
//! (the tracker file beside `iter_{N:07}/`) when [`WriteOptions::save_dir`] or the source's
//! tag asks for one.

use crate::error::{Error, IoContext, Result};
use crate::{
    dcp, Aliasing, Capabilities, Checkpoint, Codec, Container, Extra, Family, Format, Output,
    Probe, Recognition, TargetTensor, WriteOptions,
};
use std::path::Path;

/// megatron-core's marker file.
pub const METADATA_JSON: &str = "metadata.json";
/// The non-sharded state.
pub const COMMON_PT: &str = "common.pt";
/// The [`Extra::origin`] of `common.pt` entries.
pub const COMMON_ORIGIN: &str = "common.pt";
/// What megatron-core 0.15 … 0.16 writes in `metadata.json` for `torch_dist`.
const METADATA_JSON_CONTENT: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;
/// Largest `metadata.json` read.
const MAX_METADATA_JSON: u64 = 1 << 20;

/// megatron-core `dist_checkpointing` checkpoints (`torch_dist`).
pub struct Megatron;

static MEGATRON_CAPS: Capabilities = Capabilities {
    name: "megatron",
    aliases: &["torch_dist", "mcore"],
    summary:
        "megatron-core dist_checkpointing (torch_dist), for dist_checkpointing.load (any split)",
    noun: "a megatron-core checkpoint",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Torch,
    extras_kept: "common.pt keys in common.pt, ShardedObjects and the rest as BYTE_IO items",
    keeps_opaque: true,
    aliasing: Aliasing::CopyPerName,
    written: true,
};

/// True when a folder's files carry megatron-core's marker: `metadata.json` beside
/// `common.pt` (also in a folder of another backend, which the reader then refuses by name;
/// a DCP folder with an unrelated `metadata.json` stays DCP).
pub(super) fn looks_like(probe: &Probe) -> bool {
    let has = |n: &str| probe.files.iter().any(|f| f == n);
    has(METADATA_JSON) && has(COMMON_PT)
}

impl Codec for Megatron {
    fn capabilities(&self) -> &'static Capabilities {
        &MEGATRON_CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        Recognition::marker_if(looks_like(probe))
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path, false)
    }
    fn read_lazy(&self, path: &Path) -> Result<Checkpoint> {
        read(path, true)
    }
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
        write(target, world, opts)
    }
    fn index(&self, files: &[(std::path::PathBuf, u64)], fetch: crate::index::Fetch) -> Result<()> {
        crate::index::dcp(files, fetch)
    }
}

/// Read a megatron-core checkpoint folder: its backends checked, the DCP part, and the
/// entries of `common.pt`.
fn read(dir: &Path, lazy: bool) -> Result<Checkpoint> {
    check_metadata_json(&dir.join(METADATA_JSON))?;
    let mut ck = if lazy {
        dcp::read_lazy(dir)?
    } else {
        dcp::read(dir)?
    };
    let common = dir.join(COMMON_PT);
    if !common.is_file() {
        return Err(Error::format(
            dir,
            "has no common.pt (megatron-core's non-sharded state, which its loader reads)",
        ));
    }
    let mut entries = dcp::read_pickled_dict(&common, COMMON_ORIGIN)?;
    // the sharded part's names win: common.pt keys the DCP part also has are left out
    let taken: std::collections::HashSet<&str> = ck
        .extras
        .iter()
        .map(|x| x.name.as_str())
        .chain(ck.tensors.iter().map(|t| t.name.as_str()))
        .collect();
    entries.retain(|e| !taken.contains(e.name.as_str()));
    ck.extras.extend(entries);
    ck.side_files.extend([common, dir.join(METADATA_JSON)]);
    ck.format = Format::MEGATRON;
    ck.producer = Some(format!(
        "megatron-core (torch_dist), {}",
        ck.producer.as_deref().unwrap_or("torch")
    ));
    Ok(ck)
}

/// `metadata.json` must name the `torch_dist` sharded backend and the `torch` common backend
/// (`zarr`, megatron-core's older backend, is not read).
fn check_metadata_json(path: &Path) -> Result<()> {
    let len = std::fs::metadata(path).at(path)?.len();
    if len > MAX_METADATA_JSON {
        return Err(Error::format(path, format!("is {len} bytes, too large")));
    }
    let bytes = std::fs::read(path).at(path)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::format(path, format!("is not valid JSON: {e}")))?;
    let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_string);
    match (field("sharded_backend"), field("common_backend")) {
        (Some(s), Some(c)) if s == "torch_dist" && c == "torch" => Ok(()),
        (Some(s), _) if s != "torch_dist" => Err(Error::format(
            path,
            format!("names the sharded backend `{s}`; reshard reads megatron-core's `torch_dist`"),
        )),
        (Some(_), Some(c)) => Err(Error::format(
            path,
            format!("names the common backend `{c}`; reshard reads `torch`"),
        )),
        _ => Err(Error::format(
            path,
            "has no sharded_backend / common_backend strings (not megatron-core's metadata.json)",
        )),
    }
}

/// The DCP part as [`dcp::write`] lays it out (every non-tensor entry but those of
/// `common.pt` as a `BYTE_IO` item), `common.pt` from the `common.pt` entries (an empty dict
/// when the source had none), and `metadata.json`; all of it in an iteration folder beside
/// Megatron-LM's tracker file when [`save_dir_folder`] names one.
fn write(target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
    let common: Vec<&Extra> = opts
        .extras
        .iter()
        .filter(|e| e.origin == COMMON_ORIGIN)
        .collect();
    let mut inner = opts.clone();
    inner.extras.retain(|e| e.origin != COMMON_ORIGIN);
    let mut out = dcp::write::write(target, world, &inner)?;
    // nested as the source held them (a legacy rank file's `opt_param_scheduler` dict, its
    // optimizer's `param_groups`)
    let items = crate::pt::nested_values(&common, &opts.paths)?;
    out.files.push(dcp::write::literal_file(
        COMMON_PT,
        crate::torch::save::save_to_vec("common", &crate::torch::pickle::PyValue::Dict(items), &[]),
    ));
    out.files.push(dcp::write::literal_file(
        METADATA_JSON,
        METADATA_JSON_CONTENT.as_bytes().to_vec(),
    ));
    if let Some(folder) = save_dir_folder(opts, &common) {
        for f in &mut out.files {
            f.path = Path::new(&folder).join(&f.path);
        }
        let tracker = match folder.strip_prefix("iter_") {
            Some(n) => n
                .trim_start_matches('0')
                .parse::<u64>()
                .unwrap_or(0)
                .to_string(),
            None => folder.clone(),
        };
        out.files.push(dcp::write::literal_file(
            crate::megatron_legacy::TRACKER,
            tracker.into_bytes(),
        ));
    }
    Ok(out)
}

/// The iteration folder of a Megatron-LM save directory an output is written as: the
/// source's own (`iter_{N:07}` or `release`, its [`WriteOptions::tag`]) when it was read
/// from one; with [`WriteOptions::save_dir`], that of the `iteration` entry of `common.pt`,
/// else `release`; otherwise none (a plain megatron-core folder).
fn save_dir_folder(opts: &WriteOptions, common: &[&Extra]) -> Option<String> {
    let tag = opts.tag.as_deref().filter(|t| {
        *t == crate::megatron_legacy::RELEASE
            || t.strip_prefix("iter_")
                .is_some_and(|n| n.len() >= 7 && n.bytes().all(|b| b.is_ascii_digit()))
    });
    if let Some(t) = tag {
        return Some(t.to_string());
    }
    if !opts.save_dir {
        return None;
    }
    let iteration = common
        .iter()
        .find(|e| e.name == "iteration")
        .and_then(|e| e.pickle.as_ref())
        .and_then(crate::torch::pickle::Value::as_int)
        .filter(|n| *n >= 0);
    Some(
        iteration.map_or(crate::megatron_legacy::RELEASE.to_string(), |n| {
            crate::megatron_legacy::iteration_folder(n as u64)
        }),
    )
}
