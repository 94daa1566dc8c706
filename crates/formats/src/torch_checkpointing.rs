//! Meta's torch_checkpointing (`torch-checkpointing`, `CheckpointManager.save`): a folder of
//! one `torch.save` file per item per rank, `<item>_<R>.pt` (`model_0.pt`, `optimizer_1.pt`,
//! `step_0.pt`, ...), and a `metadata.pkl`: a plain pickle (dicts, lists, tuples, str, int; no
//! classes) with the world size, a version, and per item and per nested path
//! (`["state",0,"exp_avg"]`) the tensor's global shape, dtype, device mesh, placements and the
//! ranks that share it.
//!
//! The rank files hold the items as saved: FSDP2 DTensors (read as the verl reader reads them:
//! their pickled spec as values from an allow-list, never executed) or plain tensors, which
//! are every rank's copy (rank 0's is read). Pieces point into the storage records of the rank
//! files (zero copy). `metadata.pkl` is read as values with no global allowed; each tensor's
//! global shape and dtype there must match what the rank files hold.
//!
//! Keys: the `model` item's state dict as it is, every other item under `<item>.`
//! (`optimizer.state.0.exp_avg`, `optimizer.param_groups.0.lr`). An item that is not a dict
//! (`step`) is a value under its own name. Non-tensor leaves are extras (rank 0's).
//!
//! Refused with one line naming the file: a malformed `metadata.pkl`, a missing rank file, a
//! tensor `metadata.pkl` lists that no rank file holds, or one whose shape or dtype differs.

use crate::error::{Error, Result};
use crate::torch::pickle::{self, Globals, Value};
use crate::torch::save;
use crate::{
    Aliasing, Capabilities, Checkpoint, Codec, Container, Family, Format, Output, Probe,
    Recognition, TargetTensor, WriteOptions,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A torch_checkpointing checkpoint folder (read only).
pub struct TorchCheckpointing;

static CAPS: Capabilities = Capabilities {
    name: "torch-checkpointing",
    aliases: &["torch_checkpointing"],
    summary: "Meta torch_checkpointing folders (metadata.pkl + <item>_R.pt per rank: DTensor \
              shards), read as global tensors",
    noun: "a torch_checkpointing checkpoint (metadata.pkl and <item>_R.pt files)",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Torch,
    extras_kept: "optimizer param_groups, non-dict items (step)",
    keeps_opaque: false,
    aliasing: Aliasing::StoresOnce,
};

impl Codec for TorchCheckpointing {
    fn capabilities(&self) -> &'static Capabilities {
        &CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        Recognition::marker_if(
            !probe.is_file
                && probe.files.iter().any(|f| f == "metadata.pkl")
                && probe.files.iter().any(|f| item_file(f).is_some()),
        )
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path)
    }
    fn write(&self, _target: &[TargetTensor], _world: u32, _opts: &WriteOptions) -> Result<Output> {
        Err(Error::usage(
            "torch_checkpointing checkpoints are read, not written: write dcp at any --to M, \
             safetensors, or hf",
        ))
    }
}

/// `(item, rank)` of `<item>_<R>.pt`.
pub fn item_file(name: &str) -> Option<(&str, u32)> {
    let (item, r) = name.strip_suffix(".pt")?.rsplit_once('_')?;
    if item.is_empty() || r.is_empty() || r.len() > 9 || !r.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((item, r.parse().ok()?))
}

/// What `metadata.pkl` says of one tensor.
struct Meta {
    shape: Vec<u64>,
    dtype: String,
}

/// `metadata.pkl`: the world size and, by tensor name, the global shape and dtype.
fn read_metadata(p: &Path) -> Result<(u32, BTreeMap<String, Meta>)> {
    let bytes = std::fs::read(p).map_err(|e| Error::format(p, format!("cannot be read: {e}")))?;
    let bad = |m: &str| Error::format(p, format!("is not torch_checkpointing metadata: {m}"));
    let v = pickle::parse(&bytes, &Globals::new()).map_err(|e| Error::format(p, e.to_string()))?;
    let world = v
        .get("world_size")
        .and_then(Value::as_int)
        .and_then(|w| u32::try_from(w).ok())
        .filter(|&w| w > 0)
        .ok_or_else(|| bad("no positive world_size"))?;
    let items = v
        .get("metadata")
        .and_then(Value::as_dict)
        .ok_or_else(|| bad("no metadata dict"))?;
    let mut out = BTreeMap::new();
    for (item, m) in items {
        let item = item
            .as_str()
            .ok_or_else(|| bad("an item key that is not a str"))?;
        let prefix = if item == "model" {
            String::new()
        } else {
            format!("{item}.")
        };
        let Some(paths) = m.get("nested_path_to_metadata").and_then(Value::as_dict) else {
            return Err(bad(&format!(
                "item {item} has no nested_path_to_metadata dict"
            )));
        };
        for (k, entries) in paths {
            let k = k
                .as_str()
                .ok_or_else(|| bad("a nested path that is not a str"))?;
            let parts: Vec<serde_json::Value> = serde_json::from_str(k)
                .map_err(|_| bad(&format!("nested path {k} is not a JSON list")))?;
            let parts: Vec<String> = parts
                .iter()
                .map(|x| match x {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Number(n) => Some(n.to_string()),
                    _ => None,
                })
                .collect::<Option<_>>()
                .ok_or_else(|| bad(&format!("nested path {k} holds other than str and int")))?;
            let data = entries
                .as_list()
                .and_then(|l| l.first())
                .and_then(|e| e.get("sharding_metadata"))
                .and_then(|s| s.get("data"))
                .ok_or_else(|| bad(&format!("{k}: no sharding_metadata")))?;
            let shape = data
                .get("global_shape")
                .and_then(Value::as_int_tuple)
                .and_then(|s| s.into_iter().map(|d| u64::try_from(d).ok()).collect())
                .ok_or_else(|| bad(&format!("{k}: global_shape is not a list of ints")))?;
            let dtype = data
                .get("dtype")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(&format!("{k}: dtype is not a str")))?
                .to_string();
            out.insert(
                format!("{prefix}{}", parts.join(".")),
                Meta { shape, dtype },
            );
        }
    }
    Ok((world, out))
}

/// Read the torch_checkpointing folder `path`.
pub fn read(path: &Path) -> Result<Checkpoint> {
    let meta_path = path.join("metadata.pkl");
    let (world, meta) = read_metadata(&meta_path)?;
    let names = crate::file_names(path)?;
    let mut items: Vec<&str> = names
        .iter()
        .filter_map(|n| item_file(n).map(|(i, _)| i))
        .collect();
    items.sort_unstable();
    items.dedup();
    if items.is_empty() {
        return Err(Error::format(
            path,
            "has no <item>_<R>.pt file: not a torch_checkpointing checkpoint",
        ));
    }
    // `model` first, so its tensors lead
    items.sort_by_key(|i| *i != "model");
    let mut r = crate::verl::Reader::new();
    let mut files: Vec<PathBuf> = vec![];
    for item in &items {
        for rank in 0..world {
            let p = path.join(format!("{item}_{rank}.pt"));
            if !p.is_file() {
                return Err(Error::format(
                    &p,
                    format!("is missing: metadata.pkl says world size {world}, with a {item} file per rank"),
                ));
            }
            files.push(p.clone());
            let prefix = if *item == "model" {
                String::new()
            } else {
                format!("{item}.")
            };
            r.read_file(&p, files.len() - 1, &prefix, rank, false, Some(item))?;
        }
    }
    let (tensors, extras) = r.finish();
    for (name, m) in &meta {
        let Some(t) = tensors.iter().find(|t| &t.name == name) else {
            return Err(Error::format(
                &meta_path,
                format!(
                    "lists tensor `{}`, which no rank file holds",
                    crate::torch::short(name)
                ),
            ));
        };
        let dtype = m
            .dtype
            .strip_prefix("torch.")
            .and_then(|n| save::torch_dtype_named("torch", n))
            .and_then(|d| d.ok());
        if t.shape != m.shape || dtype != Some(t.dtype) {
            return Err(Error::format(
                &meta_path,
                format!(
                    "says `{}` is {} {:?}, the rank files hold {:?} {:?}",
                    crate::torch::short(name),
                    m.dtype,
                    m.shape,
                    t.dtype,
                    t.shape
                ),
            ));
        }
    }
    Ok(Checkpoint {
        format: Format::TORCH_CHECKPOINTING,
        path: path.to_path_buf(),
        files,
        side_files: vec![meta_path],
        ranks: world,
        tensors,
        metadata: BTreeMap::new(),
        extras,
        paths: BTreeMap::new(),
        producer: Some(format!(
            "torch_checkpointing CheckpointManager (world size {world})"
        )),
        saved: None,
        tag: None,
        companions: vec![],
        scratch: vec![],
        checksums: vec![],
        locator: None,
        storage: reshard_storage::local(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_file_names() {
        assert_eq!(item_file("model_0.pt"), Some(("model", 0)));
        assert_eq!(item_file("lr_scheduler_12.pt"), Some(("lr_scheduler", 12)));
        assert_eq!(item_file("model.pt"), None);
        assert_eq!(item_file("_0.pt"), None);
        assert_eq!(item_file("model_x.pt"), None);
        assert_eq!(item_file("metadata.pkl"), None);
    }
}
