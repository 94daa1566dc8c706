//! verl's FSDP checkpoints (`FSDPCheckpointManager`): a folder of per-rank `torch.save`
//! files, `model_world_size_W_rank_R.pt`, `optim_world_size_W_rank_R.pt` and
//! `extra_state_world_size_W_rank_R.pt`, with `fsdp_config.json` and a `huggingface/` folder
//! (the model's config and tokenizer). Any per-rank `torch.save` of an FSDP2 (DTensor) or
//! FSDP1 `SHARDED_STATE_DICT` (ShardedTensor) state dict named so reads the same way.
//!
//! No file records a global layout: each tensor's global shape and the region a rank holds
//! come from its pickled DTensor (`_spec`: the device mesh, its placements, `tensor_meta`)
//! or ShardedTensor (the local shards' `ShardMetadata` offsets and sizes, the global size),
//! read as values from an allow-list and never executed. Pieces point into the storage
//! records of the rank files (zero copy). A DTensor's region is torch's for its placements:
//! on each mesh dimension in order, `Shard(d)` keeps chunk `c` of `ceil(n / m)` rows of the
//! rows left (`c` the rank's coordinate on that dimension, `m` its size), `Replicate` keeps
//! them all; other placements (`_StridedShard`, `Partial`) and two mesh dimensions sharding
//! one tensor dimension are refused.
//!
//! Keys: the model's state dict as it is (Hugging Face names for a transformers model); the
//! optimizer's under `optim.` (`optim.state.<id>.exp_avg`, `optim.param_groups.0.lr`, ...),
//! where its states are DTensors (FSDP2). FSDP1's optimizer files hold flat padded slices of
//! flattened parameter groups, which carry no layout: they are not read (listed as the
//! checkpoint's other files). `extra_state` (scheduler, RNG) is per-rank state:
//! `extra_state.rank_<R>.<key>`. Plain tensors of the model and optimizer files (FSDP2's
//! `step`, unsharded buffers) are every rank's copy: rank 0's is read.
//!
//! Refused with one line naming the file: a missing rank file, files of two world sizes,
//! ranks that disagree on a tensor's global shape or dtype, a tensor missing on a rank,
//! malformed DTensor or ShardedTensor state.

use crate::error::{Error, IoContext, Result};
use crate::layout::{Loc, Piece, Region, TensorLayout};
use crate::torch::pickle::{self, Globals, Value};
use crate::torch::save::{self, TensorItem};
use crate::torch::short;
use crate::torch::zip::Archive;
use crate::{
    dcp, Aliasing, Capabilities, Checkpoint, Codec, Container, Extra, Family, Format, KeyPart,
    Output, Probe, Recognition, RecordCrc, TargetTensor, WriteOptions,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// verl's per-rank FSDP checkpoint folder (read only).
pub struct Verl;

static CAPS: Capabilities = Capabilities {
    name: "verl",
    aliases: &["fsdp-pt"],
    summary: "verl FSDPCheckpointManager folders (model_world_size_W_rank_R.pt: per-rank \
              DTensor / ShardedTensor shards), read as global tensors",
    noun: "a verl FSDP checkpoint (model_world_size_W_rank_R.pt files)",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Torch,
    extras_kept: "optimizer param_groups, per-rank extra_state",
    keeps_opaque: false,
    aliasing: Aliasing::StoresOnce,
    written: false,
};

impl Codec for Verl {
    fn capabilities(&self) -> &'static Capabilities {
        &CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        Recognition::marker_if(
            !probe.is_file && probe.files.iter().any(|f| rank_file("model", f).is_some()),
        )
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path)
    }
    fn write(&self, _target: &[TargetTensor], _world: u32, _opts: &WriteOptions) -> Result<Output> {
        Err(Error::usage(
            "verl checkpoints are read, not written: write hf (a model verl starts from), \
             dcp at any --to M, or load with reshard.torch.load at any world size",
        ))
    }
}

/// `(world, rank)` of `<kind>_world_size_W_rank_R.pt`.
pub fn rank_file(kind: &str, name: &str) -> Option<(u32, u32)> {
    let rest = name.strip_prefix(kind)?.strip_prefix("_world_size_")?;
    let rest = rest.strip_suffix(".pt")?;
    let (w, r) = rest.split_once("_rank_")?;
    let num = |s: &str| {
        (!s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u32>().ok())
            .flatten()
    };
    let (w, r) = (num(w)?, num(r)?);
    (r < w).then_some((w, r))
}

/// The allow-list of the rank files: `torch.save`'s (with the numpy names of RNG states)
/// plus the classes a DTensor and a ShardedTensor pickle, read as values.
fn globals() -> &'static Globals {
    static G: std::sync::OnceLock<Globals> = std::sync::OnceLock::new();
    G.get_or_init(|| {
        let mut g = pickle::megatron_legacy_globals();
        for (m, n) in [
            ("torch._utils", "_rebuild_wrapper_subclass"),
            ("torch.distributed.tensor", "DTensor"),
            ("torch.distributed.tensor._api", "DTensor"),
            ("torch.distributed._tensor.api", "DTensor"),
            ("torch.distributed.device_mesh", "DeviceMesh"),
            ("torch.distributed._mesh_layout", "_MeshLayout"),
            ("torch.distributed._mesh_layout", "_FlatLayout"),
            (
                "torch.distributed._shard.sharded_tensor.api",
                "ShardedTensor",
            ),
            ("torch.distributed._shard.sharded_tensor.shard", "Shard"),
            // FSDP1's ShardedTensor pickles its process group's state as
            // `getattr(ShardedTensor, "ProcessGroupState")(...)`: a value here
            ("builtins", "getattr"),
            (
                "torch.distributed._shard.sharded_tensor.api",
                "ShardedTensor.ProcessGroupState",
            ),
            ("torch.distributed._shard.metadata", "ShardMetadata"),
            ("torch.distributed.remote_device", "_remote_device"),
            (
                "torch.distributed._shard.sharded_tensor.metadata",
                "ShardedTensorMetadata",
            ),
            (
                "torch.distributed._shard.sharded_tensor.metadata",
                "TensorProperties",
            ),
            (
                "torch.distributed._shard.sharded_tensor.metadata",
                "MEM_FORMAT_ENCODING",
            ),
            (
                "torch.distributed._shard.sharding_spec.chunk_sharding_spec",
                "ChunkShardingSpec",
            ),
            // ShardedTensor pickles `getattr(ShardedTensor, "ProcessGroupState")(...)`: read
            // as a value, never called
            ("builtins", "getattr"),
            ("torch", "layout"),
            ("torch", "memory_format"),
        ] {
            g.allow(m, n);
        }
        for m in [
            "torch.distributed.tensor._dtensor_spec",
            "torch.distributed.tensor.placement_types",
            "torch.distributed._tensor.placement_types",
        ] {
            g.allow_module(m);
        }
        g
    })
}

/// A tensor gathered over the rank files.
struct Gathered {
    dtype: crate::layout::DType,
    shape: Vec<u64>,
    pieces: Vec<Piece>,
    /// Whether some rank holds a shard of it (else every rank's copy: rank 0's is kept).
    sharded: bool,
}

/// One local part of a tensor on a rank: its stored view and global offsets.
struct Local {
    item: TensorItem,
    offsets: Vec<u64>,
}

/// Read the verl checkpoint folder `path`.
pub fn read(path: &Path) -> Result<Checkpoint> {
    let names = crate::file_names(path)?;
    let world = world_of(path, &names)?;
    let file = |kind: &str, r: u32| format!("{kind}_world_size_{world}_rank_{r}.pt");
    for r in 0..world {
        if !names.contains(&file("model", r)) {
            return Err(Error::format(
                path.join(file("model", r)),
                format!("is missing: a world size {world} checkpoint has a model file per rank"),
            ));
        }
    }
    let fsdp1 = std::fs::read(path.join("fsdp_config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("FSDP_version").and_then(|v| v.as_u64()))
        == Some(1);
    let mut files: Vec<PathBuf> = vec![];
    let mut side_files: Vec<PathBuf> = vec![];
    let mut r = Reader::new();
    for kind in ["model", "optim", "extra_state"] {
        let present: Vec<u32> = (0..world)
            .filter(|&r| names.contains(&file(kind, r)))
            .collect();
        if present.is_empty() {
            continue;
        }
        if present.len() as u32 != world {
            let missing = (0..world).find(|r| !present.contains(r)).unwrap_or(0);
            return Err(Error::format(
                path.join(file(kind, missing)),
                format!("is missing while other ranks have their {kind} file"),
            ));
        }
        if kind == "optim" && (fsdp1 || r.saw_sharded_tensor) {
            side_files.extend((0..world).map(|rk| path.join(file(kind, rk))));
            continue;
        }
        for rank in 0..world {
            let p = path.join(file(kind, rank));
            files.push(p.clone());
            r.file(&p, files.len() - 1, kind, rank)?;
        }
    }
    for n in ["fsdp_config.json", "huggingface/config.json"] {
        if path.join(n).is_file() {
            side_files.push(path.join(n));
        }
    }
    let fsdp1 = fsdp1 || r.saw_sharded_tensor;
    let (tensors, extras, checksums) = r.finish();
    Ok(Checkpoint {
        format: Format::VERL,
        path: path.to_path_buf(),
        files,
        side_files,
        ranks: world,
        tensors,
        metadata: BTreeMap::new(),
        extras,
        paths: BTreeMap::new(),
        producer: Some(format!(
            "verl FSDPCheckpointManager ({}, world size {world})",
            if fsdp1 {
                "FSDP1 ShardedTensor; optimizer's flat slices not read"
            } else {
                "FSDP2 DTensor"
            }
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

/// The world size the model files name (one only).
fn world_of(path: &Path, names: &[String]) -> Result<u32> {
    let mut worlds: Vec<u32> = names
        .iter()
        .filter_map(|n| rank_file("model", n).map(|(w, _)| w))
        .collect();
    worlds.sort_unstable();
    worlds.dedup();
    match worlds.as_slice() {
        [w] => Ok(*w),
        [] => Err(Error::format(
            path,
            "has no model_world_size_W_rank_R.pt file: not a verl checkpoint",
        )),
        [a, b, ..] => Err(Error::format(
            path,
            format!("holds model files of world sizes {a} and {b}: keep one checkpoint per folder"),
        )),
    }
}

/// Gathers the tensors of per-rank `torch.save` files into global layouts.
pub(crate) struct Reader {
    tensors: BTreeMap<String, Gathered>,
    order: Vec<String>,
    extras: Vec<Extra>,
    saw_sharded_tensor: bool,
    /// The zip CRC-32 of every storage record a piece reads, once per record.
    checksums: Vec<RecordCrc>,
    /// `(file, offset)` of the records in `checksums`.
    recorded: std::collections::HashSet<(u32, u64)>,
    /// Where the entry being read sits in its file's nesting, below [`Reader::nest_under`]'s
    /// base; `None` when nesting is not recorded.
    path: Option<Vec<KeyPart>>,
    /// The nesting of each leaf read while a path is recorded.
    paths: BTreeMap<String, Vec<KeyPart>>,
}

impl Reader {
    /// An empty reader.
    pub(crate) fn new() -> Reader {
        Reader {
            tensors: BTreeMap::new(),
            order: vec![],
            extras: vec![],
            saw_sharded_tensor: false,
            checksums: vec![],
            recorded: Default::default(),
            path: None,
            paths: BTreeMap::new(),
        }
    }

    /// Record the nesting of the leaves of the files read next, under `base` (`None`: stop
    /// recording).
    pub(crate) fn nest_under(&mut self, base: Option<Vec<KeyPart>>) {
        self.path = base;
    }

    /// The nesting recorded of each leaf read under [`Reader::nest_under`].
    pub(crate) fn paths(&self) -> &BTreeMap<String, Vec<KeyPart>> {
        &self.paths
    }

    /// Run `f` with `part` pushed on the recorded path.
    fn nested<T>(&mut self, part: KeyPart, f: impl FnOnce(&mut Self) -> T) -> T {
        if let Some(p) = &mut self.path {
            p.push(part);
        }
        let r = f(self);
        if let Some(p) = &mut self.path {
            p.pop();
        }
        r
    }

    /// Note the recorded path of the leaf `name`.
    fn leaf(&mut self, name: &str) {
        if let Some(p) = &self.path {
            self.paths.insert(name.to_string(), p.clone());
        }
    }

    /// The gathered tensors in the order first seen, the non-tensor leaves, and the CRCs of
    /// the records the tensors' pieces read.
    pub(crate) fn finish(mut self) -> (Vec<TensorLayout>, Vec<Extra>, Vec<RecordCrc>) {
        let mut tensors = vec![];
        for name in &self.order {
            let g = self.tensors.remove(name).expect("gathered");
            tensors.push(TensorLayout {
                name: name.clone(),
                dtype: g.dtype,
                shape: g.shape,
                pieces: g.pieces,
            });
        }
        (tensors, self.extras, self.checksums)
    }
}

/// A field of an object's state: a `BUILD` dict, or the dict of a `(dict, slots)` pair
/// (either may hold it).
fn field<'v>(obj: &'v Value, key: &str) -> Option<&'v Value> {
    state_get(obj.state()?, key)
}

/// `key` of a `__setstate__` state: a dict, or a `(dict, slots)` pair.
fn state_get<'v>(state: &'v Value, key: &str) -> Option<&'v Value> {
    match state {
        Value::Tuple(parts) if parts.len() == 2 => parts.iter().find_map(|p| p.get(key)),
        s => s.get(key),
    }
}

fn ints(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.as_int_tuple()?
        .into_iter()
        .map(|i| u64::try_from(i).ok())
        .collect()
}

impl Reader {
    fn file(&mut self, p: &Path, index: usize, kind: &str, rank: u32) -> Result<()> {
        let prefix = match kind {
            "model" => String::new(),
            "optim" => "optim.".to_string(),
            _ => format!("extra_state.rank_{rank}."),
        };
        self.read_file(p, index, &prefix, rank, kind == "extra_state", None)
    }

    /// Read the `torch.save` file `p` (the `index`th of the checkpoint's files) of `rank`:
    /// its state dict's entries under `prefix`. `per_rank`: its non-tensor leaves are kept for
    /// every rank (else rank 0's). `leaf`: the name a top-level value that is not a dict
    /// is kept under (`None`: such a file is refused).
    pub(crate) fn read_file(
        &mut self,
        p: &Path,
        index: usize,
        prefix: &str,
        rank: u32,
        per_rank: bool,
        leaf: Option<&str>,
    ) -> Result<()> {
        let f = std::fs::File::open(p).at(p)?;
        let map = crate::sys::map_file(&f, p)?;
        let item =
            save::parse_with(&map, globals()).map_err(|e| Error::format(p, e.to_string()))?;
        let mut ctx = FileCtx {
            path: p,
            index: index as u32,
            rank,
            per_rank,
            archive: &item.archive,
            bytes: &map,
        };
        match (&item.value, leaf) {
            (Value::Dict(pairs), _) => self.dict(&mut ctx, prefix, pairs),
            (v, Some(name)) => self.value(&mut ctx, name, v),
            (v, None) => Err(Error::format(
                p,
                format!("holds a pickled {}, not a state dict", v.kind()),
            )),
        }
    }

    fn dict(&mut self, ctx: &mut FileCtx, prefix: &str, pairs: &[(Value, Value)]) -> Result<()> {
        for (i, (k, v)) in pairs.iter().enumerate() {
            if crate::pt::read::is_module_metadata(pairs, i) {
                continue;
            }
            let (key, part) = match k {
                Value::Str(s) => (s.clone(), KeyPart::Key(s.clone())),
                Value::Int(i) => (i.to_string(), KeyPart::IntKey { int: *i }),
                _ => {
                    return Err(Error::format(
                        ctx.path,
                        format!("`{}`: has a {} dict key", short(prefix), k.kind()),
                    ))
                }
            };
            self.nested(part, |r| r.value(ctx, &format!("{prefix}{key}"), v))?;
        }
        Ok(())
    }

    fn value(&mut self, ctx: &mut FileCtx, name: &str, v: &Value) -> Result<()> {
        match v {
            Value::Dict(pairs) if !pairs.is_empty() => self.dict(ctx, &format!("{name}."), pairs),
            Value::List(items)
                if items
                    .iter()
                    .any(|x| matches!(x, Value::Dict(_)) || crate::pt::read::is_tensor_call(x)) =>
            {
                for (i, x) in items.iter().enumerate() {
                    self.nested(KeyPart::Index(i as i64), |r| {
                        r.value(ctx, &format!("{name}.{i}"), x)
                    })?;
                }
                Ok(())
            }
            _ if crate::pt::read::is_tensor_call(v) => {
                self.leaf(name);
                self.tensor(ctx, name, v)
            }
            _ => {
                self.leaf(name);
                // non-tensor leaves: rank 0's of shared files, every rank's of per-rank ones
                if ctx.per_rank || ctx.rank == 0 {
                    self.extras.push(Extra {
                        name: name.to_string(),
                        value: dcp::to_json(v),
                        pickle: Some(v.clone()),
                        raw: None,
                        origin: "pt",
                        opaque: None,
                    });
                }
                Ok(())
            }
        }
    }

    fn tensor(&mut self, ctx: &mut FileCtx, name: &str, v: &Value) -> Result<()> {
        let err = |m: String| Error::format(ctx.path, format!("`{}`: {m}", short(name)));
        let (shape, dtype, locals, sharded) = if let Some(t) =
            save::tensor_of(v, ctx.archive, ctx.bytes).map_err(|e| err(e.to_string()))?
        {
            let n = t.shape.len();
            (
                t.shape.clone(),
                t.dtype,
                vec![Local {
                    item: t,
                    offsets: vec![0; n],
                }],
                false,
            )
        } else {
            let (shape, dtype, locals) = self.subclass(ctx, v).map_err(err)?;
            (shape, dtype, locals, true)
        };
        let g = match self.tensors.get_mut(name) {
            Some(g) => g,
            None => {
                self.order.push(name.to_string());
                self.tensors.entry(name.to_string()).or_insert(Gathered {
                    dtype,
                    shape: shape.clone(),
                    pieces: vec![],
                    sharded,
                })
            }
        };
        if g.shape != shape {
            return Err(err(format!(
                "rank {} says its global shape is {:?}, an earlier rank {:?}",
                ctx.rank, shape, g.shape
            )));
        }
        if dtype != g.dtype {
            return Err(err(format!("rank {} holds it in another dtype", ctx.rank)));
        }
        if !sharded && (g.sharded || !g.pieces.is_empty()) && !ctx.per_rank {
            // every rank's copy of an unsharded tensor: rank 0's is kept
            return Ok(());
        }
        for l in locals {
            if l.item.dtype != g.dtype {
                return Err(err("local shards of two dtypes".into()));
            }
            let strides = (!l.item.is_row_major()).then(|| l.item.strides.clone());
            for (d, (&o, &s)) in l.offsets.iter().zip(&l.item.shape).enumerate() {
                if o.checked_add(s).is_none_or(|e| e > shape[d]) {
                    return Err(err(format!(
                        "rank {}'s shard lies outside the global shape {shape:?}",
                        ctx.rank
                    )));
                }
            }
            let rec = format!("{}/data/{}", ctx.archive.prefix, l.item.storage_key);
            if let Some(entry) = ctx.archive.entry(&rec) {
                let (file, offset) = (ctx.index, l.item.record.offset);
                if self.recorded.insert((file, offset)) {
                    self.checksums.push(RecordCrc {
                        file,
                        offset,
                        len: l.item.record.len,
                        crc: entry.crc,
                        what: format!("`{}` (record {rec})", short(name)).into(),
                        shown: None,
                    });
                }
            }
            g.pieces.push(Piece {
                rank: ctx.rank,
                region: Region::new(l.offsets.clone(), l.item.shape.clone()),
                loc: Loc {
                    file: ctx.index,
                    offset: l.item.data_offset(),
                    strides,
                    pending: None,
                },
            });
        }
        Ok(())
    }

    /// A DTensor's or ShardedTensor's global shape and local parts.
    fn subclass(
        &mut self,
        ctx: &FileCtx,
        v: &Value,
    ) -> std::result::Result<(Vec<u64>, crate::layout::DType, Vec<Local>), String> {
        let args = v.args().unwrap_or_default();
        let [func, new_type, Value::Tuple(sub_args), state, ..] = args else {
            return Err("a tensor subclass rebuild call without its arguments".into());
        };
        if !func.is_global("torch._utils", "_rebuild_wrapper_subclass") {
            return Err("a tensor subclass other than DTensor or ShardedTensor".into());
        }
        let shape = ints(sub_args.get(2)).ok_or("the subclass's global size is not a tuple")?;
        let dtype = sub_args
            .get(1)
            .and_then(save::torch_dtype)
            .ok_or("the subclass's dtype is not a torch dtype")??;
        let local_of = |t: &Value| -> std::result::Result<TensorItem, String> {
            save::tensor_of(t, ctx.archive, ctx.bytes)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "its local tensor is not a plain tensor".to_string())
        };
        match new_type.as_global() {
            Some((m, "DTensor")) if m.starts_with("torch.distributed") => {
                let local =
                    state_get(state, "_local_tensor").ok_or("a DTensor without _local_tensor")?;
                let spec = state_get(state, "_spec").ok_or("a DTensor without _spec")?;
                let item = local_of(local)?;
                let offsets = dtensor_offsets(spec, &shape, &item.shape)?;
                Ok((shape, dtype, vec![Local { item, offsets }]))
            }
            Some((_, "ShardedTensor")) => {
                self.saw_sharded_tensor = true;
                let shards = match state {
                    Value::Tuple(parts) => parts.first().and_then(Value::as_list),
                    _ => None,
                }
                .ok_or("a ShardedTensor without its local shards")?;
                let mut locals = vec![];
                for s in shards {
                    let t = field(s, "tensor").ok_or("a local shard without its tensor")?;
                    let meta = field(s, "metadata").ok_or("a local shard without metadata")?;
                    let item = local_of(t)?;
                    let offsets = ints(field(meta, "shard_offsets"))
                        .ok_or("shard_offsets is not a list of ints")?;
                    let sizes = ints(field(meta, "shard_sizes"))
                        .ok_or("shard_sizes is not a list of ints")?;
                    if sizes != item.shape || offsets.len() != shape.len() {
                        return Err(format!(
                            "a local shard of shape {:?} says it holds {sizes:?} at {offsets:?}",
                            item.shape
                        ));
                    }
                    locals.push(Local { item, offsets });
                }
                Ok((shape, dtype, locals))
            }
            _ => Err("a tensor subclass other than DTensor or ShardedTensor".into()),
        }
    }
}

/// The global offsets of a DTensor's local tensor of shape `local` in a tensor of `shape`,
/// from its spec's mesh and placements.
fn dtensor_offsets(
    spec: &Value,
    shape: &[u64],
    local: &[u64],
) -> std::result::Result<Vec<u64>, String> {
    let mesh = spec.get("mesh").ok_or("a DTensor spec without its mesh")?;
    let coords = ints(mesh.get("_coordinate_on_dim"))
        .ok_or("the device mesh does not record this rank's coordinates")?;
    let axes = mesh
        .get("_layout")
        .and_then(|l| l.get("axes"))
        .and_then(Value::as_list)
        .ok_or("the device mesh has no layout")?;
    let sizes: Vec<u64> = axes
        .iter()
        .map(|a| ints(a.get("shape")).map(|s| s.iter().product::<u64>()))
        .collect::<Option<_>>()
        .ok_or("the device mesh's layout is not a tuple of shapes")?;
    let placements = spec
        .get("placements")
        .and_then(Value::as_list)
        .ok_or("a DTensor spec without placements")?;
    if placements.len() != sizes.len() || coords.len() != sizes.len() {
        return Err(format!(
            "{} placements on a mesh of {} dimensions",
            placements.len(),
            sizes.len()
        ));
    }
    let (mut offsets, mut cur) = (vec![0u64; shape.len()], shape.to_vec());
    let mut used = vec![false; shape.len()];
    for ((p, &m), &c) in placements.iter().zip(&sizes).zip(&coords) {
        match p.class() {
            Some((_, "Replicate")) => {}
            Some((_, "Shard")) => {
                let d = p
                    .get("dim")
                    .and_then(Value::as_int)
                    .and_then(|d| usize::try_from(d).ok())
                    .filter(|&d| d < shape.len())
                    .ok_or("a Shard placement without a valid dim")?;
                if std::mem::replace(&mut used[d], true) {
                    return Err(format!("two mesh dimensions shard dimension {d}"));
                }
                if m == 0 || c >= m {
                    return Err(format!("coordinate {c} on a mesh dimension of size {m}"));
                }
                let chunk = cur[d].div_ceil(m);
                let start = (c * chunk).min(cur[d]);
                let len = chunk.min(cur[d] - start);
                offsets[d] += start;
                cur[d] = len;
            }
            Some((_, other)) => return Err(format!("placement {other} is not supported")),
            None => return Err("a placement that is not an object".into()),
        }
    }
    if cur != local {
        return Err(format!(
            "its local tensor is {local:?}, its placements give {cur:?}"
        ));
    }
    Ok(offsets)
}

struct FileCtx<'a> {
    path: &'a Path,
    index: u32,
    rank: u32,
    per_rank: bool,
    archive: &'a Archive,
    bytes: &'a [u8],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_file_names() {
        assert_eq!(
            rank_file("model", "model_world_size_2_rank_1.pt"),
            Some((2, 1))
        );
        assert_eq!(rank_file("model", "model_world_size_2_rank_2.pt"), None);
        assert_eq!(rank_file("model", "optim_world_size_2_rank_0.pt"), None);
        assert_eq!(rank_file("model", "model_world_size__rank_0.pt"), None);
        assert_eq!(
            rank_file("optim", "optim_world_size_8_rank_7.pt"),
            Some((8, 7))
        );
    }
}
