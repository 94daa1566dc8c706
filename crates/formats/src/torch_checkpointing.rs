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
//! Written at one rank ([`write`]): an `<item>_0.pt` per item — the first part of each name's
//! recorded nesting (`optimizer`, `step`), `model` for names without one — holding the item's
//! nested dict of plain tensors and values, and a `metadata.pkl` that lists every tensor as
//! replicated on rank 0, as the library records a single process's plain tensors; its
//! `CheckpointManager.load` reshards that to any world size (DTensor targets included).
//!
//! Refused with one line naming the file: a malformed `metadata.pkl`, a missing rank file, a
//! tensor `metadata.pkl` lists that no rank file holds, or one whose shape or dtype differs.

use crate::error::{Error, Result};
use crate::torch::pickle::{self, extra_value, pickle, Globals, PyValue, Value};
use crate::torch::save::{self, standard_records};
use crate::torch::zip::{layout_archive, output_parts};
use crate::{
    Aliasing, Capabilities, Checkpoint, Codec, Container, Family, Format, KeyPart, Output, Probe,
    Recognition, TargetTensor, WriteOptions,
};
use reshard_core::output::OutputFile;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A torch_checkpointing checkpoint folder (read at any world size, written as one process's).
pub struct TorchCheckpointing;

static CAPS: Capabilities = Capabilities {
    name: "torch-checkpointing",
    aliases: &["torch_checkpointing"],
    summary: "Meta torch_checkpointing folders (metadata.pkl + <item>_R.pt per rank: DTensor \
              shards), read as global tensors; written as one process's (--to 1), which its \
              loader reshards to any world size",
    noun: "a torch_checkpointing checkpoint (metadata.pkl and <item>_R.pt files)",
    container: Container::Directory,
    extensions: &[],
    max_world: Some(1),
    family: Family::Torch,
    extras_kept: "optimizer param_groups, non-dict items (step)",
    keeps_opaque: false,
    aliasing: Aliasing::StoresOnce,
    written: true,
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
    fn write(&self, target: &[TargetTensor], _world: u32, opts: &WriteOptions) -> Result<Output> {
        write(target, opts)
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
            r.nest_under((*item != "model").then(|| vec![KeyPart::Key(item.to_string())]));
            r.read_file(&p, files.len() - 1, &prefix, rank, false, Some(item))?;
        }
    }
    let paths = r.paths().clone();
    let (tensors, extras, checksums) = r.finish();
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
        paths,
        producer: Some(format!(
            "torch_checkpointing CheckpointManager (world size {world})"
        )),
        saved: None,
        tag: None,
        companions: vec![],
        scratch: vec![],
        checksums,
        locator: None,
        storage: reshard_storage::local(),
    })
}

/// The item a target name goes to and its path inside the item: the first part of its
/// recorded nesting (`optimizer` of `optimizer.state.0.exp_avg`), else the `model` item with
/// the name as a top-level key.
fn item_of(name: &str, paths: &BTreeMap<String, Vec<KeyPart>>) -> (String, Vec<KeyPart>) {
    match paths.get(name).and_then(|p| p.split_first()) {
        Some((KeyPart::Key(item), rest)) => (item.clone(), rest.to_vec()),
        _ => ("model".to_string(), vec![KeyPart::Key(name.to_string())]),
    }
}

/// The `json.dumps(..., separators=(",", ":"))` of a nested path, as torch_checkpointing
/// keys `nested_path_to_metadata` (`["state",0,"exp_avg"]`).
fn nested_path_key(path: &[KeyPart]) -> String {
    let parts: Vec<String> = path
        .iter()
        .map(|k| match k {
            KeyPart::Key(s) => serde_json::Value::String(s.clone()).to_string(),
            KeyPart::Index(i) | KeyPart::IntKey { int: i } => i.to_string(),
        })
        .collect();
    format!("[{}]", parts.join(","))
}

/// What `metadata.pkl` says of a tensor one process holds whole: replicated over a mesh of
/// one CPU rank, as torch_checkpointing records a plain tensor.
fn replicated_metadata(t: &TargetTensor) -> PyValue {
    let s = |x: &str| PyValue::Str(x.to_string());
    let ints = |v: &[u64]| PyValue::List(v.iter().map(|&x| PyValue::Int(x as i64)).collect());
    let stride = save::contiguous_strides(&t.shape);
    let data = PyValue::Dict(vec![
        (s("global_shape"), ints(&t.shape)),
        (
            s("dtype"),
            s(&format!(
                "torch.{}",
                crate::torch::dtype::torch_dtype_name(t.dtype)
            )),
        ),
        (s("stride"), ints(&stride)),
        (
            s("mesh_spec"),
            PyValue::Dict(vec![
                (s("device_type"), s("cpu")),
                (s("mesh_shape"), PyValue::Tuple(vec![PyValue::Int(1)])),
                (s("mesh_data"), PyValue::Tuple(vec![PyValue::Int(0)])),
                (s("mesh_dim_names"), PyValue::None),
            ]),
        ),
        (
            s("placements"),
            PyValue::List(vec![PyValue::Dict(vec![(s("type"), s("Replicate"))])]),
        ),
    ]);
    PyValue::List(vec![PyValue::Dict(vec![
        (
            s("sharding_metadata"),
            PyValue::Dict(vec![
                (s("type"), s("DTensorShardingMetadata")),
                (s("data"), data),
            ]),
        ),
        (s("ranks"), PyValue::Tuple(vec![PyValue::Int(0)])),
    ])])
}

/// Lay out a consolidated target as one process's torch_checkpointing folder: an
/// `<item>_0.pt` per item (a `torch.save` of its nested state dict, plain tensors) and
/// `metadata.pkl` listing every tensor replicated on rank 0, which the library's loader
/// reshards to any world size.
fn write(target: &[TargetTensor], opts: &WriteOptions) -> Result<Output> {
    // items in first-seen order, `model` first
    let mut items: Vec<String> = vec![];
    let mut tensors_of: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut extras_of: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut sub_paths: BTreeMap<String, BTreeMap<String, Vec<KeyPart>>> = BTreeMap::new();
    let note = |item: &str, items: &mut Vec<String>| {
        if !items.iter().any(|i| i == item) {
            items.push(item.to_string());
        }
    };
    for (i, t) in target.iter().enumerate() {
        let (item, rest) = item_of(&t.name, &opts.paths);
        if rest.is_empty() {
            return Err(Error::usage(format!(
                "`{}`: a tensor that is a whole torch_checkpointing item is not written \
                 (items are dicts)",
                crate::torch::short(&t.name)
            )));
        }
        note(&item, &mut items);
        tensors_of.entry(item.clone()).or_default().push(i);
        sub_paths
            .entry(item)
            .or_default()
            .insert(t.name.clone(), rest);
    }
    for (i, e) in opts.extras.iter().enumerate() {
        let (item, rest) = item_of(&e.name, &opts.paths);
        note(&item, &mut items);
        extras_of.entry(item.clone()).or_default().push(i);
        sub_paths
            .entry(item)
            .or_default()
            .insert(e.name.clone(), rest);
    }
    items.sort_by_key(|i| i != "model");
    let mut out = Output {
        files: vec![],
        tensors: vec![],
        copies: vec![],
    };
    let mut meta_items = vec![];
    for item in &items {
        if item.is_empty() || item.contains(['/', '\\']) || item.starts_with('.') {
            return Err(Error::usage(format!(
                "`{}` is not a torch_checkpointing item name (it names the item's file)",
                crate::torch::short(item)
            )));
        }
        let file_name = format!("{item}_0.pt");
        let paths = sub_paths.remove(item).unwrap_or_default();
        let ts: Vec<TargetTensor> = tensors_of
            .get(item)
            .map(|v| v.iter().map(|&i| target[i].clone()).collect())
            .unwrap_or_default();
        let extras: Vec<crate::Extra> = extras_of
            .get(item)
            .map(|v| v.iter().map(|&i| opts.extras[i].clone()).collect())
            .unwrap_or_default();
        let file_index = out.files.len() as u32;
        // an item that is one value (`step`): its pickle is the value itself
        if ts.is_empty() && extras.len() == 1 && paths.values().all(|p| p.is_empty()) {
            let value = extra_value(&extras[0]);
            let records = standard_records(pickle(&value), &[]);
            let layout = layout_archive("archive", &records);
            let (literals, checksums) = output_parts(&layout, &records, 0);
            out.files.push(OutputFile {
                path: PathBuf::from(&file_name),
                size: layout.len,
                literals,
                checksums,
            });
            continue;
        }
        if paths.values().any(|p| p.is_empty()) {
            return Err(Error::usage(format!(
                "item `{}`: holds both a value of its own and keys",
                crate::torch::short(item)
            )));
        }
        let sub = WriteOptions {
            extras,
            paths,
            ties: opts
                .ties
                .iter()
                .map(|g| {
                    g.iter()
                        .filter(|n| ts.iter().any(|t| &t.name == *n))
                        .cloned()
                        .collect::<Vec<_>>()
                })
                .filter(|g| g.len() > 1)
                .collect(),
            ..opts.clone()
        };
        let mut o = crate::pt::write(&ts, &sub)?;
        for f in &mut o.files {
            f.path = PathBuf::from(&file_name);
        }
        for t in &mut o.tensors {
            for p in &mut t.pieces {
                p.loc.file += file_index;
            }
        }
        out.files.extend(o.files);
        out.tensors.extend(o.tensors);
        if !ts.is_empty() {
            let entries: Vec<(PyValue, PyValue)> = ts
                .iter()
                .map(|t| {
                    let key = nested_path_key(&sub.paths[&t.name]);
                    (PyValue::Str(key), replicated_metadata(t))
                })
                .collect();
            meta_items.push((
                PyValue::Str(item.clone()),
                PyValue::Dict(vec![
                    (
                        PyValue::Str("nested_path_to_metadata".into()),
                        PyValue::Dict(entries),
                    ),
                    (
                        PyValue::Str("rank_to_layout_info".into()),
                        PyValue::Dict(vec![(PyValue::Int(0), PyValue::None)]),
                    ),
                ]),
            ));
        }
    }
    let meta = pickle(&PyValue::Dict(vec![
        (PyValue::Str("metadata".into()), PyValue::Dict(meta_items)),
        (PyValue::Str("world_size".into()), PyValue::Int(1)),
        (PyValue::Str("version".into()), PyValue::Str("2.0".into())),
    ]));
    out.files.push(OutputFile {
        path: PathBuf::from("metadata.pkl"),
        size: meta.len() as u64,
        literals: vec![(0, meta.into())],
        checksums: vec![],
    });
    Ok(out)
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
