//! Hugging Face sharded safetensors: `model.safetensors.index.json` (`weight_map`: tensor →
//! file, `metadata.total_size`) plus `model-0000i-of-0000N.safetensors` files, each holding
//! whole tensors. A consolidated (one-rank) layout split across files. A model folder that
//! `save_pretrained` wrote in one file (`model.safetensors`, no index) is read as one too.
//! `config.json` and `generation_config.json` come with the folder
//! ([`Checkpoint::companions`]) and are written beside an output's weights.

use super::safetensors::{
    aligned_entries, full_layouts, output_file, read_header, recorded_crcs, Entry, FileSize,
};
use super::safetensors::{checkpoint, header_metadata, CHECKPOINT_KEYS};
use super::{
    Aliasing, Capabilities, Checkpoint, Codec, Container, Family, Format, Output, Probe,
    Recognition, TargetTensor, WriteOptions,
};
use crate::error::{Error, IoContext, Result};
use crate::layout::TensorLayout;
use reshard_core::output::OutputFile;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The index file's name.
pub const INDEX: &str = "model.safetensors.index.json";

/// The weights file of a model folder saved in one file.
pub const SINGLE: &str = "model.safetensors";

/// The index file of a Hugging Face sharded checkpoint in `dir`, if there is one
/// (`model.safetensors.index.json`, or a single other `*.safetensors.index.json`).
pub fn index_path(dir: &Path) -> Option<PathBuf> {
    let files = super::file_names(dir).ok()?;
    index_name(&files).map(|n| dir.join(n))
}

/// Among the file names `files`, the index: [`INDEX`], or the single other
/// `*.safetensors.index.json`.
fn index_name(files: &[String]) -> Option<&str> {
    if files.iter().any(|n| n == INDEX) {
        return Some(INDEX);
    }
    let mut found = files
        .iter()
        .filter(|n| n.ends_with(".safetensors.index.json"));
    let first = found.next()?;
    found.next().is_none().then_some(first.as_str())
}

/// Hugging Face sharded safetensors.
pub struct Hf;

static CAPS: Capabilities = Capabilities {
    name: "hf",
    aliases: &["hf-sharded"],
    summary: "Hugging Face sharded safetensors with an index (one rank)",
    noun: "the hf format (a consolidated model)",
    container: Container::Directory,
    extensions: &[],
    max_world: Some(1),
    family: Family::Safetensors,
    extras_kept: "as JSON under `reshard.extras` in the index's metadata",
    keeps_opaque: false,
    aliasing: Aliasing::Forbidden,
    written: true,
};

impl Codec for Hf {
    fn capabilities(&self) -> &'static Capabilities {
        &CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        Recognition::marker_if(
            index_name(&probe.files).is_some() || probe.files.iter().any(|n| n == SINGLE),
        )
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path)
    }
    fn write(&self, target: &[TargetTensor], _world: u32, opts: &WriteOptions) -> Result<Output> {
        write(target, opts)
    }
    /// The JSON files whole, however large (an index keeps the checkpoint's non-tensor
    /// entries and nesting, which can pass the size fetched whole), the rest as the family
    /// does: small files whole, the headers of large shards.
    fn index(&self, files: &[(PathBuf, u64)], fetch: crate::index::Fetch) -> Result<()> {
        let json = |p: &Path| p.extension().is_some_and(|e| e == "json");
        let (whole, rest): (Vec<_>, Vec<_>) = files.iter().cloned().partition(|(p, _)| json(p));
        for (path, size) in &whole {
            fetch(path, &[(0, *size)])?;
        }
        crate::index::small_whole_else(&rest, fetch, crate::index::safetensors_header)
    }
}

/// Read a Hugging Face sharded checkpoint.
pub fn read(dir: &Path) -> Result<Checkpoint> {
    let Some(index) = index_path(dir) else {
        // a model folder saved in one file
        let single = dir.join(SINGLE);
        if !single.is_file() {
            return Err(Error::format(
                dir,
                format!("has no {INDEX} and no {SINGLE}"),
            ));
        }
        let mut ck = super::safetensors::read(&single)?;
        ck.format = Format::HF;
        ck.path = dir.to_path_buf();
        ck.side_files = side_files(dir, None);
        return Ok(ck);
    };
    let text = std::fs::read_to_string(&index).at(&index)?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::format(&index, format!("is not valid JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::format(&index, "has no `weight_map` object"))?;
    let kept = index_metadata(&index, &json)?;
    let mut files: Vec<PathBuf> = vec![];
    let mut file_ix: HashMap<String, u32> = HashMap::new();
    let mut headers = vec![];
    let mut tensors = vec![];
    let mut metadata = Default::default();
    let mut checksums = vec![];
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::format(&index, format!("`weight_map.{name}` is not a file name"))
        })?;
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(Error::format(
                &index,
                format!("`{name}` points at `{file}`, outside the checkpoint directory"),
            ));
        }
        let ix = match file_ix.get(file) {
            Some(&ix) => ix,
            None => {
                let path = dir.join(file);
                if !path.is_file() {
                    return Err(Error::format(
                        &path,
                        format!("is missing (named by {INDEX} for `{name}`)"),
                    ));
                }
                let mut h = read_header(&path)?;
                checksums.extend(recorded_crcs(&path, files.len() as u32, &mut h)?);
                if files.is_empty() {
                    metadata = h.metadata.clone();
                }
                headers.push(h);
                files.push(path);
                file_ix.insert(file.to_string(), (files.len() - 1) as u32);
                (files.len() - 1) as u32
            }
        };
        let h = &headers[ix as usize];
        let t = h.tensors.iter().find(|t| &t.name == name).ok_or_else(|| {
            Error::format(
                &files[ix as usize],
                format!("has no tensor `{name}`, which {INDEX} maps to it"),
            )
        })?;
        tensors.push(TensorLayout::whole(
            name.clone(),
            t.dtype,
            t.shape.clone(),
            ix,
            t.offset,
            None,
        ));
    }
    for (f, h) in files.iter().zip(&headers) {
        if let Some(t) = h.tensors.iter().find(|t| !map.contains_key(&t.name)) {
            return Err(Error::format(
                f,
                format!("holds tensor `{}`, which {INDEX} does not list", t.name),
            ));
        }
    }
    // what reshard keeps once for the checkpoint, in the index (in every shard before)
    metadata.extend(kept);
    let mut ck = checkpoint(Format::HF, dir, files, 1, tensors, metadata, checksums)?;
    ck.side_files = side_files(dir, Some(index));
    Ok(ck)
}

/// The [`CHECKPOINT_KEYS`] an index's `metadata` object holds (reshard writes them there, as
/// the strings a safetensors header would hold).
fn index_metadata(index: &Path, json: &serde_json::Value) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let Some(m) = json.get("metadata").and_then(|m| m.as_object()) else {
        return Ok(out);
    };
    for key in CHECKPOINT_KEYS {
        match m.get(*key) {
            None => {}
            Some(serde_json::Value::String(v)) => {
                out.insert(key.to_string(), v.clone());
            }
            Some(_) => {
                return Err(Error::format(
                    index,
                    format!("`metadata.{key}` is not a string"),
                ))
            }
        }
    }
    Ok(out)
}

/// The files of the Hugging Face folder `dir` besides its weights: its index, and the
/// companions beside them (`config.json`).
fn side_files(dir: &Path, index: Option<PathBuf>) -> Vec<PathBuf> {
    let companions = crate::checkpoint::COMPANIONS
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| p.is_file());
    index.into_iter().chain(companions).collect()
}

/// Lay out a consolidated target as Hugging Face shards of at most `max_shard_size` bytes
/// each, header included (a tensor too large for that with its header gets a file of its
/// own), plus the index. What holds for the whole checkpoint ([`CHECKPOINT_KEYS`]: non-tensor
/// entries, nesting) is kept once, in the index's `metadata`, not in every shard.
pub fn write(target: &[TargetTensor], opts: &WriteOptions) -> Result<Output> {
    let mut metadata = header_metadata(target, opts)?;
    let kept: BTreeMap<String, String> = CHECKPOINT_KEYS
        .iter()
        .filter_map(|k| Some((k.to_string(), metadata.remove(*k)?)))
        .collect();
    let empty = FileSize::new(&metadata)?;
    let mut groups: Vec<Vec<Entry>> = vec![];
    let mut size = empty;
    for e in aligned_entries(target) {
        let grown = size.with(&e);
        match groups.last_mut() {
            Some(g) if grown.bytes() <= opts.max_shard_size => {
                g.push(e);
                size = grown;
            }
            _ => {
                size = empty.with(&e);
                groups.push(vec![e]);
            }
        }
    }
    if groups.is_empty() {
        groups.push(vec![]);
    }
    let n = groups.len();
    let mut files = vec![];
    let mut tensors = vec![];
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, g) in groups.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let (file, offsets) = output_file(PathBuf::from(&name), g, &metadata)?;
        for e in g {
            weight_map.insert(e.name.clone(), name.clone().into());
            total += e.shape.iter().product::<u64>() * e.dtype.size() as u64;
        }
        tensors.extend(full_layouts(g, &offsets, i as u32));
        files.push(file);
    }
    // The index lists tensors in the order the target gave them.
    let mut ordered = serde_json::Map::new();
    for t in target {
        if let Some(v) = weight_map.get(&t.name) {
            ordered.insert(t.name.clone(), v.clone());
        }
    }
    let mut index_meta = serde_json::Map::new();
    index_meta.insert("total_size".into(), total.into());
    for (k, v) in kept {
        index_meta.insert(k, v.into());
    }
    let index = serde_json::json!({"metadata": index_meta, "weight_map": ordered});
    let mut bytes = serde_json::to_vec_pretty(&index).unwrap_or_default();
    bytes.push(b'\n');
    files.push(OutputFile {
        path: PathBuf::from(INDEX),
        size: bytes.len() as u64,
        literals: vec![(0, bytes.into())],
        checksums: vec![],
    });
    // config.json and friends: what `from_pretrained` reads beside the weights
    for (name, content) in &opts.companions {
        files.push(OutputFile {
            path: PathBuf::from(name),
            size: content.len() as u64,
            literals: vec![(0, content.clone().into())],
            checksums: vec![],
        });
    }
    Ok(Output {
        files,
        tensors,
        copies: vec![],
    })
}
