//! The two kinds of file of a ZeRO checkpoint as named records: [`ModelStates`] (the
//! engine's `*_model_states.pt`) and [`OptimStates`] (a rank's `*_optim_states.pt`), decoded
//! from their pickles with DeepSpeed's classes on the allow-list and turned into plain values
//! ([`plain`]); nothing is executed. Tensors are located in the mapped file (dtype, shape,
//! strides, offset), never read.

use crate::error::{Error, IoContext, Result};
use crate::torch::pickle::{self, Globals, Value};
use crate::torch::save::{self, TensorItem};
use crate::torch::short;
use crate::torch::zip::Archive;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

/// DeepSpeed's loss scalers (`NEWOBJ` + `BUILD` of their `__dict__`).
pub const LOSS_SCALER: (&str, &str) = ("deepspeed.runtime.fp16.loss_scaler", "LossScaler");
/// DeepSpeed's dynamic loss scaler (fp16).
pub const DYNAMIC_LOSS_SCALER: (&str, &str) =
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler");
/// `ZeroStageEnum(n)`.
pub const ZERO_STAGE_ENUM: (&str, &str) = ("deepspeed.runtime.zero.config", "ZeroStageEnum");
/// `fragment_address(numel=, start=)` of `param_slice_mappings`.
pub const FRAGMENT_ADDRESS: (&str, &str) = ("deepspeed.utils.tensor_fragment", "fragment_address");

/// The allow-list of DeepSpeed's checkpoint pickles: `torch.save`'s, DeepSpeed's own record
/// classes, and `argparse.Namespace` (trainers save their arguments as client state).
pub fn globals() -> &'static Globals {
    static GLOBALS: std::sync::OnceLock<Globals> = std::sync::OnceLock::new();
    GLOBALS.get_or_init(|| {
        let mut g = pickle::torch_save_globals();
        for (m, n) in [
            LOSS_SCALER,
            DYNAMIC_LOSS_SCALER,
            ZERO_STAGE_ENUM,
            FRAGMENT_ADDRESS,
            ("argparse", "Namespace"),
        ] {
            g.allow(m, n);
        }
        g
    })
}

/// A DeepSpeed class instance as a plain value: a loss scaler or `Namespace` as its
/// attribute dict, `ZeroStageEnum(n)` as `n`, `fragment_address` as `{numel, start}`; inside
/// containers too. Other values are returned as they are.
pub fn plain(v: &Value) -> Value {
    match v {
        Value::Object {
            module,
            name,
            args,
            state,
        } => {
            let class = (module.as_str(), name.as_str());
            if class == ZERO_STAGE_ENUM {
                if let [Value::Int(n)] = args.as_slice() {
                    return Value::Int(*n);
                }
            }
            let attrs = [
                LOSS_SCALER,
                DYNAMIC_LOSS_SCALER,
                FRAGMENT_ADDRESS,
                ("argparse", "Namespace"),
            ];
            if attrs.contains(&class) && args.is_empty() {
                if let Some(s @ Value::Dict(_)) = state.as_deref() {
                    return plain(s);
                }
            }
            Value::Object {
                module: module.clone(),
                name: name.clone(),
                args: args.iter().map(plain).collect(),
                state: state.as_ref().map(|s| Box::new(plain(s))),
            }
        }
        Value::List(items) => Value::List(items.iter().map(plain).collect()),
        Value::Tuple(items) => Value::Tuple(items.iter().map(plain).collect()),
        Value::Dict(pairs) => {
            Value::Dict(pairs.iter().map(|(k, x)| (plain(k), plain(x))).collect())
        }
        other => other.clone(),
    }
}

/// One `torch.save` file of the checkpoint, mapped, with its pickle decoded.
pub struct File {
    /// Its path.
    pub path: PathBuf,
    /// The mapped bytes.
    pub map: Mmap,
    /// The archive's directory.
    pub archive: Archive,
    /// The decoded `data.pkl`.
    pub value: Value,
}

impl File {
    /// Map and decode the `torch.save` file at `path`.
    pub fn open(path: &Path) -> Result<File> {
        let f = std::fs::File::open(path).at(path)?;
        if f.metadata().at(path)?.len() == 0 {
            return Err(Error::format(path, "is empty, not a torch.save file"));
        }
        let map = crate::sys::map_file(&f, path)?;
        if crate::pt::read::is_legacy(&map) {
            return Err(Error::format(
                path,
                "uses the legacy (pre-1.6) torch.save format, which DeepSpeed does not write",
            ));
        }
        let item =
            save::parse_with(&map, globals()).map_err(|e| Error::format(path, e.to_string()))?;
        Ok(File {
            path: path.to_path_buf(),
            archive: item.archive,
            value: item.value,
            map,
        })
    }

    /// An error about this file.
    pub fn err(&self, msg: impl std::fmt::Display) -> Error {
        Error::format(&self.path, msg.to_string())
    }

    /// The top-level dict.
    pub fn top(&self) -> Result<&[(Value, Value)]> {
        self.value.as_dict().ok_or_else(|| {
            self.err(format!(
                "holds a pickled {}, not DeepSpeed's state dict",
                self.value.kind()
            ))
        })
    }

    /// The tensor `v` (at `what`, for messages).
    pub fn tensor(&self, v: &Value, what: &str) -> Result<TensorItem> {
        save::tensor_of(v, &self.archive, &self.map)
            .map_err(|e| self.err(format!("`{}`: {e}", short(what))))?
            .ok_or_else(|| self.err(format!("`{}` is a {}, not a tensor", short(what), v.kind())))
    }

    /// The CRC-32 the archive records for the storage of `t`.
    pub fn record_crc(&self, t: &TensorItem) -> Option<u32> {
        let name = format!("{}/data/{}", self.archive.prefix, t.storage_key);
        self.archive.entry(&name).map(|e| e.crc)
    }
}

/// A str-keyed dict's value at `key`, or an error naming it.
pub fn field<'a>(f: &File, d: &'a Value, key: &str, within: &str) -> Result<&'a Value> {
    d.get(key)
        .ok_or_else(|| f.err(format!("{within} has no `{key}`")))
}

/// A non-negative int.
pub fn count(f: &File, v: &Value, what: &str) -> Result<u64> {
    v.as_int()
        .and_then(|i| u64::try_from(i).ok())
        .ok_or_else(|| f.err(format!("`{what}` is not a non-negative int")))
}

/// The pairs of a dict whose keys are all str.
pub fn str_dict<'a>(f: &File, v: &'a Value, what: &str) -> Result<Vec<(&'a str, &'a Value)>> {
    let pairs = v
        .as_dict()
        .ok_or_else(|| f.err(format!("`{what}` is a {}, not a dict", v.kind())))?;
    pairs
        .iter()
        .map(|(k, x)| {
            k.as_str()
                .map(|k| (k, x))
                .ok_or_else(|| f.err(format!("`{what}` has a {} key", k.kind())))
        })
        .collect()
}

/// A shape (`torch.Size` or tuple of ints), with its element count checked not to overflow.
pub fn shape(f: &File, v: &Value, what: &str) -> Result<Vec<u64>> {
    let dims: Option<Vec<u64>> = v
        .as_int_tuple()
        .and_then(|t| t.into_iter().map(|i| u64::try_from(i).ok()).collect());
    let dims = dims.ok_or_else(|| f.err(format!("`{}` is not a shape", short(what))))?;
    if dims.len() > crate::layout::MAX_DIMS {
        return Err(f.err(format!(
            "`{}` has {} dimensions; reshard handles at most {}",
            short(what),
            dims.len(),
            crate::layout::MAX_DIMS
        )));
    }
    if dims
        .iter()
        .try_fold(1u64, |a, &b| a.checked_mul(b))
        .is_none()
    {
        return Err(f.err(format!("`{}`: shape {dims:?} is too large", short(what))));
    }
    Ok(dims)
}

/// Element count of a shape checked by [`shape`].
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// A list of ints.
fn ints(f: &File, v: &Value, what: &str) -> Result<Vec<u64>> {
    v.as_list()
        .ok_or_else(|| f.err(format!("`{what}` is a {}, not a list", v.kind())))?
        .iter()
        .map(|x| count(f, x, what))
        .collect()
}

/// The engine's model states file (`mp_rank_00_model_states.pt`, one per rank at stage 3).
pub struct ModelStates {
    /// `module`: the model's state dict (stage 3: parameters as empty placeholders).
    pub module: Vec<(String, TensorItem)>,
    /// `buffer_names`.
    pub buffer_names: Vec<String>,
    /// `param_shapes`: per flat fp32 tensor (a parameter group at stages 1 and 2, a sub-group
    /// at stage 3), its trainable parameters in flattening order.
    pub param_shapes: Vec<Vec<(String, Vec<u64>)>>,
    /// `frozen_param_shapes` (stages 2 and 3).
    pub frozen_param_shapes: Vec<(String, Vec<u64>)>,
    /// `frozen_param_fragments`: stage 3, this rank's chunk of each frozen parameter.
    pub frozen_fragments: Vec<(String, TensorItem)>,
    /// `shared_params`: tied name → the parameter it shares.
    pub shared_params: Vec<(String, String)>,
    /// `dp_world_size`.
    pub dp_world_size: u64,
    /// Every other top-level entry (engine counters, `ds_config`, client state) in file
    /// order, DeepSpeed's classes made [`plain`]; `module` and `frozen_param_fragments` left
    /// out.
    pub others: Vec<(String, Value)>,
}

/// Keys of the model states file that hold tensors (decoded into [`ModelStates`] fields).
pub const TENSOR_KEYS: &[&str] = &["module", "frozen_param_fragments"];

impl ModelStates {
    /// Decode the model states file `f`.
    pub fn decode(f: &File) -> Result<ModelStates> {
        let top = f.top()?;
        let root = &f.value;
        if root.get("module").is_none() || root.get("param_shapes").is_none() {
            return Err(f.err(
                "is not a DeepSpeed model states file (it has no `module` and `param_shapes`)",
            ));
        }
        let module = module_entries(f, root)?;
        let buffer_names = buffer_names(f, root)?;
        let param_shapes = param_shapes(f, root)?;
        let frozen_param_shapes = match root.get("frozen_param_shapes") {
            None | Some(Value::None) => vec![],
            Some(d) => str_dict(f, d, "frozen_param_shapes")?
                .into_iter()
                .map(|(k, s)| {
                    Ok((
                        k.to_string(),
                        shape(f, s, &format!("frozen_param_shapes.{k}"))?,
                    ))
                })
                .collect::<Result<_>>()?,
        };
        let frozen_fragments = match root.get("frozen_param_fragments") {
            None | Some(Value::None) => vec![],
            Some(d) => str_dict(f, d, "frozen_param_fragments")?
                .into_iter()
                .map(|(k, v)| {
                    Ok((
                        k.to_string(),
                        f.tensor(v, &format!("frozen_param_fragments.{k}"))?,
                    ))
                })
                .collect::<Result<_>>()?,
        };
        let shared_params = match root.get("shared_params") {
            None | Some(Value::None) => vec![],
            Some(d) => str_dict(f, d, "shared_params")?
                .into_iter()
                .map(|(k, v)| {
                    v.as_str()
                        .map(|s| (k.to_string(), s.to_string()))
                        .ok_or_else(|| f.err(format!("`shared_params.{}` is not a str", short(k))))
                })
                .collect::<Result<_>>()?,
        };
        let dp_world_size = count(
            f,
            field(f, root, "dp_world_size", "the model states")?,
            "dp_world_size",
        )?;
        if dp_world_size == 0 {
            return Err(f.err("`dp_world_size` is 0"));
        }
        // `optimizer` is None under ZeRO (the optim files hold the state); kept, it would
        // clash with the `optimizer.state.*` names
        let others = top
            .iter()
            .filter_map(|(k, v)| {
                let k = k.as_str()?;
                let skip = TENSOR_KEYS.contains(&k) || (k == "optimizer" && v.is_none());
                (!skip).then(|| (k.to_string(), plain(v)))
            })
            .collect();
        Ok(ModelStates {
            module,
            buffer_names,
            param_shapes,
            frozen_param_shapes,
            frozen_fragments,
            shared_params,
            dp_world_size,
            others,
        })
    }
}

/// `module`: the model's state dict, each entry a located tensor (none when it is `None`).
fn module_entries(f: &File, root: &Value) -> Result<Vec<(String, TensorItem)>> {
    Ok(match field(f, root, "module", "the model states")? {
        Value::None => vec![],
        m => {
            // nn.Module.state_dict()'s `_metadata` attribute is not an entry
            let pairs = m.as_dict().unwrap_or_default();
            let n = pairs.len()
                - usize::from(
                    !pairs.is_empty()
                        && crate::pt::read::is_module_metadata(pairs, pairs.len() - 1),
                );
            str_dict(f, m, "module")?
                .into_iter()
                .take(n)
                .map(|(k, v)| Ok((k.to_string(), f.tensor(v, &format!("module.{k}"))?)))
                .collect::<Result<_>>()?
        }
    })
}

/// `buffer_names` (none when absent or `None`).
fn buffer_names(f: &File, root: &Value) -> Result<Vec<String>> {
    Ok(match root.get("buffer_names") {
        None | Some(Value::None) => vec![],
        Some(v) => v
            .as_list()
            .ok_or_else(|| f.err("`buffer_names` is not a list"))?
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| f.err("`buffer_names` holds a non-str"))
            })
            .collect::<Result<_>>()?,
    })
}

/// Per flat tensor, its parameters' names and shapes.
type ParamShapes = Vec<Vec<(String, Vec<u64>)>>;

/// `param_shapes`: per flat tensor, its parameters' names and shapes.
fn param_shapes(f: &File, root: &Value) -> Result<ParamShapes> {
    let groups = field(f, root, "param_shapes", "the model states")?;
    groups
        .as_list()
        .ok_or_else(|| f.err("`param_shapes` is not a list of dicts"))?
        .iter()
        .enumerate()
        .map(|(g, d)| {
            str_dict(f, d, &format!("param_shapes.{g}"))?
                .into_iter()
                .map(|(k, s)| {
                    Ok((
                        k.to_string(),
                        shape(f, s, &format!("param_shapes.{g}.{k}"))?,
                    ))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()
}

/// Which of DeepSpeed's ZeRO optimizers wrote an optim states file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optimizer {
    /// `DeepSpeedZeroOptimizer`, stage 1 or 2: fp32 partitions saved without their tail
    /// padding, optimizer state with it.
    Zero12 {
        /// 1 or 2.
        stage: u8,
    },
    /// `BF16_Optimizer` (stage 1, bf16 with fp32 gradient accumulation): fp32 partitions
    /// saved padded; no `zero_stage`, no loss scaler.
    Bf16,
    /// `DeepSpeedZeroOptimizer_Stage3`.
    Zero3,
}

impl Optimizer {
    /// The ZeRO stage.
    pub fn stage(self) -> u8 {
        match self {
            Optimizer::Zero12 { stage } => stage,
            Optimizer::Bf16 => 1,
            Optimizer::Zero3 => 3,
        }
    }
}

/// One entry of the wrapped torch optimizer's per-parameter state.
pub enum StateEntry {
    /// A tensor (`exp_avg`, `step`).
    Tensor(TensorItem),
    /// Anything else, made [`plain`].
    Value(Value),
}

/// A rank's optim states file (`[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`).
pub struct OptimStates {
    /// The optimizer that wrote it.
    pub optimizer: Optimizer,
    /// The fp32 master weights of each flat tensor (one per parameter group; stage 3: per
    /// sub-group): `single_partition_of_fp32_groups` / `fp32_flat_groups`.
    pub flat: Vec<TensorItem>,
    /// The wrapped optimizer's state of each flat tensor (`state[i]`), in its key order.
    pub state: Vec<Vec<(String, StateEntry)>>,
    /// The wrapped optimizer's `param_groups`, each without `params`, in order.
    pub param_groups: Vec<Vec<(String, Value)>>,
    /// Per parameter group, the flat tensors (indices into `flat`) it holds.
    pub group_flats: Vec<Vec<usize>>,
    /// `group_paddings` (stages 1 and 2).
    pub group_paddings: Vec<u64>,
    /// `partition_count`, per parameter group (stage 3 records one number).
    pub partition_count: Vec<u64>,
    /// `param_alignment_paddings`, per group and parameter, when recorded.
    pub param_alignment_paddings: Option<Vec<Vec<u64>>>,
    /// `param_slice_mappings` (stages 1 and 2): per group, each parameter with elements in
    /// this rank's partition, with their number and where they start in it.
    pub slice_mappings: Option<Vec<Vec<(String, u64, u64)>>>,
    /// The wrapper's scalars that are the same at any degree (`loss_scaler`,
    /// `dynamic_loss_scale`, `overflow`, `clip_grad`, `zero_stage`), [`plain`].
    pub scalars: Vec<(String, Value)>,
}

/// The wrapper's entries that hold tensors or depend on the data-parallel degree (decoded
/// into [`OptimStates`] fields, or recomputed by the writer).
const LAYOUT_KEYS: &[&str] = &[
    "base_optimizer_state",
    "optimizer_state_dict",
    "single_partition_of_fp32_groups",
    "fp32_flat_groups",
    "group_paddings",
    "param_alignment_paddings",
    "partition_count",
    "param_slice_mappings",
    "ds_version",
    "universal_checkpoint_info",
    "ds_zero_partition_groups",
];

impl OptimStates {
    /// Decode the optim states file `f`.
    pub fn decode(f: &File) -> Result<OptimStates> {
        f.top()?;
        let osd = f.value.get("optimizer_state_dict").ok_or_else(|| {
            f.err("is not a DeepSpeed optim states file (it has no `optimizer_state_dict`)")
        })?;
        if osd.as_dict().is_none() {
            return Err(f.err("`optimizer_state_dict` is not a dict"));
        }
        let optimizer = optimizer_of(f, osd)?;
        let (flat_key, base_key) = match optimizer {
            Optimizer::Zero3 => ("fp32_flat_groups", "optimizer_state_dict"),
            _ => ("single_partition_of_fp32_groups", "base_optimizer_state"),
        };
        let flat = flat_tensors(f, osd, flat_key)?;
        let base = field(f, osd, base_key, "`optimizer_state_dict`")?;
        if base.as_list().is_some() {
            return Err(f.err(
                "was saved with zero_optimization.elastic_checkpoint (per-group optimizer \
                 state), which is not supported",
            ));
        }
        let state = wrapped_state(f, base, base_key, flat.len())?;
        let (param_groups, group_flats) = param_groups(f, base, base_key, flat.len())?;
        each_flat_in_one_group(f, &group_flats, flat.len(), flat_key, base_key)?;
        let group_paddings = match osd.get("group_paddings") {
            Some(v) => ints(f, v, "group_paddings")?,
            None if optimizer == Optimizer::Zero3 => vec![],
            None => return Err(f.err("`optimizer_state_dict` has no `group_paddings`")),
        };
        let partition_count = match field(f, osd, "partition_count", "`optimizer_state_dict`")? {
            v @ Value::Int(_) => vec![count(f, v, "partition_count")?],
            v => ints(f, v, "partition_count")?,
        };
        let param_alignment_paddings = alignment_paddings(f, osd)?;
        let slice_mappings = slice_mappings(f, osd)?;
        let scalars = osd
            .as_dict()
            .unwrap_or_default()
            .iter()
            .filter_map(|(k, v)| {
                let k = k.as_str()?;
                (!LAYOUT_KEYS.contains(&k)).then(|| (k.to_string(), plain(v)))
            })
            .collect();
        Ok(OptimStates {
            optimizer,
            flat,
            state,
            param_groups,
            group_flats,
            group_paddings,
            partition_count,
            param_alignment_paddings,
            slice_mappings,
            scalars,
        })
    }
}

/// The optimizer that wrote the wrapper dict `osd`: by its `zero_stage`, else (no stage
/// recorded) `BF16_Optimizer` by its `single_partition_of_fp32_groups`.
fn optimizer_of(f: &File, osd: &Value) -> Result<Optimizer> {
    let stage = match osd.get("zero_stage") {
        None => None,
        Some(v) => Some(count(f, &plain(v), "zero_stage")?),
    };
    Ok(match stage {
        Some(s @ (1 | 2)) => Optimizer::Zero12 { stage: s as u8 },
        Some(3) => Optimizer::Zero3,
        Some(s) => return Err(f.err(format!("`zero_stage` is {s}, not 1, 2 or 3"))),
        None if osd.get("single_partition_of_fp32_groups").is_some() => Optimizer::Bf16,
        None => return Err(f.err("`optimizer_state_dict` has no `zero_stage`")),
    })
}

/// The fp32 master weights `osd[flat_key]`: a list of flat, row-major tensors.
fn flat_tensors(f: &File, osd: &Value, flat_key: &str) -> Result<Vec<TensorItem>> {
    let flat = field(f, osd, flat_key, "`optimizer_state_dict`")?
        .as_list()
        .ok_or_else(|| f.err(format!("`{flat_key}` is not a list")))?
        .iter()
        .enumerate()
        .map(|(i, v)| f.tensor(v, &format!("{flat_key}.{i}")))
        .collect::<Result<Vec<_>>>()?;
    for (i, t) in flat.iter().enumerate() {
        if t.shape.len() != 1 || !t.is_row_major() {
            return Err(f.err(format!(
                "`{flat_key}.{i}` is not a flat tensor (shape {:?})",
                t.shape
            )));
        }
    }
    Ok(flat)
}

/// The wrapped optimizer's `state` (in `base`, the dict at `base_key`): per flat tensor of
/// `n_flat`, its entries in key order, tensors located and other values made [`plain`].
fn wrapped_state(
    f: &File,
    base: &Value,
    base_key: &str,
    n_flat: usize,
) -> Result<Vec<Vec<(String, StateEntry)>>> {
    let mut state: Vec<Vec<(String, StateEntry)>> = (0..n_flat).map(|_| vec![]).collect();
    let st = field(f, base, "state", &format!("`{base_key}`"))?;
    let st = st
        .as_dict()
        .ok_or_else(|| f.err(format!("`{base_key}.state` is not a dict")))?;
    for (k, per) in st {
        let i = k
            .as_int()
            .and_then(|i| usize::try_from(i).ok())
            .filter(|&i| i < n_flat)
            .ok_or_else(|| {
                f.err(format!(
                    "`{base_key}.state` has key {} for {} flat tensors",
                    short(&crate::dcp::to_json(k).to_string()),
                    n_flat
                ))
            })?;
        let what = format!("{base_key}.state.{i}");
        for (name, v) in str_dict(f, per, &what)? {
            let entry = match save::tensor_of(v, &f.archive, &f.map)
                .map_err(|e| f.err(format!("`{what}.{}`: {e}", short(name))))?
            {
                Some(t) => StateEntry::Tensor(t),
                None => StateEntry::Value(plain(v)),
            };
            state[i].push((name.to_string(), entry));
        }
    }
    Ok(state)
}

/// Per parameter group: its hyperparameters, and the flat tensors its `params` names.
type Groups = (Vec<Vec<(String, Value)>>, Vec<Vec<usize>>);

/// The wrapped optimizer's `param_groups` (in `base`, the dict at `base_key`), each group's
/// `params` checked to name flat tensors of the `n_flat`.
fn param_groups(f: &File, base: &Value, base_key: &str, n_flat: usize) -> Result<Groups> {
    let groups = field(f, base, "param_groups", &format!("`{base_key}`"))?
        .as_list()
        .ok_or_else(|| f.err(format!("`{base_key}.param_groups` is not a list")))?;
    let mut param_groups = vec![];
    let mut group_flats = vec![];
    for (g, d) in groups.iter().enumerate() {
        let what = format!("{base_key}.param_groups.{g}");
        let mut hyper = vec![];
        let mut flats = None;
        for (k, v) in str_dict(f, d, &what)? {
            if k == "params" {
                let ids = ints(f, v, &format!("{what}.params"))?;
                if let Some(bad) = ids.iter().find(|&&i| i >= n_flat as u64) {
                    return Err(f.err(format!(
                        "`{what}.params` names flat tensor {bad} of {n_flat}"
                    )));
                }
                flats = Some(ids.into_iter().map(|i| i as usize).collect::<Vec<_>>());
            } else {
                hyper.push((k.to_string(), plain(v)));
            }
        }
        param_groups.push(hyper);
        group_flats.push(flats.ok_or_else(|| f.err(format!("`{what}` has no `params`")))?);
    }
    Ok((param_groups, group_flats))
}

/// Check that each of the `n_flat` flat tensors is in exactly one parameter group.
fn each_flat_in_one_group(
    f: &File,
    group_flats: &[Vec<usize>],
    n_flat: usize,
    flat_key: &str,
    base_key: &str,
) -> Result<()> {
    let mut seen = vec![false; n_flat];
    for &i in group_flats.iter().flatten() {
        if std::mem::replace(&mut seen[i], true) {
            return Err(f.err(format!(
                "flat tensor {i} is in two of `{base_key}.param_groups`"
            )));
        }
    }
    if let Some(i) = seen.iter().position(|s| !s) {
        return Err(f.err(format!(
            "flat tensor {i} of `{flat_key}` is in no parameter group"
        )));
    }
    Ok(())
}

/// `param_alignment_paddings`, per group and parameter, when recorded.
fn alignment_paddings(f: &File, osd: &Value) -> Result<Option<Vec<Vec<u64>>>> {
    Ok(match osd.get("param_alignment_paddings") {
        None | Some(Value::None) => None,
        Some(v) => Some(
            v.as_list()
                .ok_or_else(|| f.err("`param_alignment_paddings` is not a list"))?
                .iter()
                .map(|g| ints(f, g, "param_alignment_paddings"))
                .collect::<Result<Vec<_>>>()?,
        ),
    })
}

/// Per group, each parameter's `fragment_address` as (name, numel, start).
type SliceMappings = Vec<Vec<(String, u64, u64)>>;

/// `param_slice_mappings`, when recorded: per group, each parameter's `fragment_address` as
/// (name, numel, start).
fn slice_mappings(f: &File, osd: &Value) -> Result<Option<SliceMappings>> {
    Ok(match osd.get("param_slice_mappings") {
        None | Some(Value::None) => None,
        Some(v) => Some(
            v.as_list()
                .ok_or_else(|| f.err("`param_slice_mappings` is not a list"))?
                .iter()
                .enumerate()
                .map(|(g, d)| {
                    str_dict(f, d, &format!("param_slice_mappings.{g}"))?
                        .into_iter()
                        .map(|(name, a)| {
                            let a = plain(a);
                            let what = format!("param_slice_mappings.{g}.{}", short(name));
                            let n = count(f, a.get("numel").unwrap_or(&Value::None), &what)?;
                            let at = count(f, a.get("start").unwrap_or(&Value::None), &what)?;
                            Ok((name.to_string(), n, at))
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deepspeed_objects_become_plain_values() {
        let obj = |c: (&str, &str), args: Vec<Value>, state: Option<Value>| Value::Object {
            module: c.0.into(),
            name: c.1.into(),
            args,
            state: state.map(Box::new),
        };
        let d = Value::Dict(vec![(Value::Str("cur_scale".into()), Value::Float(1.0))]);
        assert_eq!(plain(&obj(LOSS_SCALER, vec![], Some(d.clone()))), d);
        assert_eq!(
            plain(&obj(ZERO_STAGE_ENUM, vec![Value::Int(3)], None)),
            Value::Int(3)
        );
        let l = Value::List(vec![obj(FRAGMENT_ADDRESS, vec![], Some(d.clone()))]);
        assert_eq!(plain(&l), Value::List(vec![d]));
        // anything else is kept
        let size = obj(("torch", "Size"), vec![Value::Tuple(vec![])], None);
        assert_eq!(plain(&size), size);
    }
}
