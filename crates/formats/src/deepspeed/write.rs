//! Writing a ZeRO checkpoint at M data-parallel ranks: the files DeepSpeed's engine would
//! save in a job of M ranks (`latest`, `<tag>/` model states and M optim files), laid out
//! before any data exists so that the executor fills the fp32 partitions, the optimizer state
//! and the model-dtype weights in place, each record's CRC-32 computed as the bytes stream.
//!
//! The source must be a DeepSpeed checkpoint: its model states entries (`param_shapes`,
//! `buffer_names`, `shared_params`, `ds_config`, counters, client state), its parameter
//! groups and its ZeRO wrapper's scalars come through [`WriteOptions::extras`] and say what
//! the target engine expects. The stage is the source's unless [`WriteOptions::zero_stage`]
//! chooses another; the optimizer follows from it and `ds_config` as DeepSpeed's engine
//! chooses (`BF16_Optimizer` for bf16 at stage 1 with fp32 gradient accumulation). Carried
//! with their degree changed: `dp_world_size`, `partition_count`, `group_paddings`,
//! `param_slice_mappings`, `param_shapes` (per sub-group at stage 3), and in `ds_config` the
//! micro batch (for the same global batch, when it divides) and `zero_optimization.stage`.
//! Padding elements are zeros.

use super::names;
use super::partition::{self, FlatGroup, Span};
use super::records::{DYNAMIC_LOSS_SCALER, FRAGMENT_ADDRESS, LOSS_SCALER, ZERO_STAGE_ENUM};
use crate::error::{Error, Result};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
use crate::torch::pickle::extra_value;
use crate::torch::pickle::{pickle, PyValue};
use crate::torch::save::{standard_records, TensorRef};
use crate::torch::short;
use crate::torch::zip::{layout_archive, output_parts};
use crate::{Extra, KeyPart, Output, TargetTensor, WriteOptions};
use reshard_core::output::OutputFile;
use serde_json::Value as Json;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

/// A refusal that names what a deepspeed output needs.
fn needs(msg: impl std::fmt::Display) -> Error {
    Error::usage(format!("a deepspeed output {msg}"))
}

/// The optimizer whose files to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Zero12(u8),
    Bf16,
    Zero3,
}

/// What the source's non-tensor entries say of the job.
struct Job<'a> {
    /// `param_shapes`: per parameter group, its trainable parameters.
    groups: Vec<Vec<(String, Vec<u64>)>>,
    buffers: HashSet<String>,
    /// Tied name → the parameter it shares.
    shared: Vec<(String, String)>,
    /// The model's training dtype (`ds_config`'s bf16 / fp16, else fp32).
    model_dtype: DType,
    kind: Kind,
    /// `zero_optimization.sub_group_size` (stage 3).
    sub_group_size: u64,
    /// `zero_optimization.parameter_alignment` (stages 1 and 2).
    parameter_alignment: bool,
    /// `zero_optimization.round_robin_gradients` (stages 1 and 2).
    round_robin: bool,
    /// The model states entries, in order (everything but the optimizer's).
    entries: Vec<&'a Extra>,
    /// `optimizer.param_groups.<g>.<key>` (without `params`), per group.
    hyper: Vec<Vec<(String, PyValue)>>,
    /// `optimizer_state_dict.<key>`.
    wrapper: HashMap<String, &'a Extra>,
    ds_version: PyValue,
}

/// The extra called `name`.
fn extra<'a>(opts: &'a WriteOptions, name: &str) -> Option<&'a Extra> {
    opts.extras.iter().find(|e| e.name == name)
}

fn json_shape(v: &Json) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(Json::as_u64).collect()
}

impl<'a> Job<'a> {
    fn of(opts: &'a WriteOptions) -> Result<Job<'a>> {
        let shapes = extra(opts, "param_shapes").ok_or_else(|| {
            needs(
                "needs a DeepSpeed source: its parameter groups, stage and engine state \
                 (`param_shapes`, `ds_config`) say what the engine at M ranks expects",
            )
        })?;
        let groups = shapes
            .value
            .as_array()
            .and_then(|gs| {
                gs.iter()
                    .map(|g| {
                        g.as_object()?
                            .iter()
                            .map(|(k, s)| Some((k.clone(), json_shape(s)?)))
                            .collect::<Option<Vec<_>>>()
                    })
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| needs("needs `param_shapes` as a list of {name: shape} dicts"))?;
        let buffers = extra(opts, "buffer_names")
            .and_then(|e| e.value.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        let shared = extra(opts, "shared_params")
            .and_then(|e| e.value.as_object())
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        let config = extra(opts, "ds_config").map(|e| &e.value);
        let at = |path: &[&str]| -> Option<&Json> {
            let mut v = config?;
            for k in path {
                v = v.get(k)?;
            }
            Some(v)
        };
        let enabled = |k: &str| at(&[k, "enabled"]).and_then(Json::as_bool) == Some(true);
        let model_dtype = if enabled("bf16") || enabled("bfloat16") {
            DType::BF16
        } else if enabled("fp16") {
            DType::F16
        } else {
            DType::F32
        };
        let source_stage = at(&["zero_optimization", "stage"])
            .and_then(Json::as_u64)
            .or_else(|| {
                extra(opts, "optimizer_state_dict.zero_stage").and_then(|e| e.value.as_u64())
            });
        let stage = match opts.zero_stage.map(u64::from).or(source_stage) {
            Some(s @ 1..=3) => s as u8,
            Some(s) => return Err(needs(format!("needs ZeRO stage 1, 2 or 3, not {s}"))),
            None => {
                return Err(needs(
                    "needs the source's ZeRO stage (`ds_config`), or one chosen",
                ))
            }
        };
        let fp32_accumulation = matches!(
            at(&["data_types", "grad_accum_dtype"]).and_then(Json::as_str),
            Some("fp32" | "float32" | "float" | "torch.float32")
        );
        let offload = at(&["zero_optimization", "offload_optimizer", "device"])
            .and_then(Json::as_str)
            .is_some_and(|d| d != "none");
        let kind = match stage {
            3 => Kind::Zero3,
            1 if model_dtype == DType::BF16 && fp32_accumulation && !offload => Kind::Bf16,
            s => Kind::Zero12(s),
        };
        // a count the config may write as a float (`1e9`)
        let count = |v: &Json| {
            v.as_u64().or_else(|| {
                v.as_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1.8e19)
                    .map(|f| f as u64)
            })
        };
        let sub_group_size = at(&["zero_optimization", "sub_group_size"])
            .and_then(count)
            .unwrap_or(1_000_000_000);
        let parameter_alignment = at(&["zero_optimization", "parameter_alignment"])
            .and_then(Json::as_bool)
            .unwrap_or(false);
        let round_robin = at(&["zero_optimization", "round_robin_gradients"])
            .and_then(Json::as_bool)
            .unwrap_or(false);
        let entries = opts
            .extras
            .iter()
            .filter(|e| {
                !e.name.starts_with("optimizer.param_groups.")
                    && !e.name.starts_with("optimizer.state.")
                    && !e.name.starts_with("optimizer_state_dict.")
            })
            .collect();
        // the optimizer's parameter groups: hyperparameters, and the parameters of each
        // (`params`; param_shapes lists flat tensors, which at stage 3 are sub-groups)
        let mut hyper: Vec<Vec<(String, PyValue)>> = vec![];
        let mut members: Vec<Option<Vec<String>>> = vec![];
        for e in &opts.extras {
            let Some(rest) = e.name.strip_prefix("optimizer.param_groups.") else {
                continue;
            };
            let (g, key) = match opts.paths.get(&e.name).map(Vec::as_slice) {
                Some([_, _, KeyPart::Index(g), KeyPart::Key(k)]) => (*g as usize, k.clone()),
                _ => match rest.split_once('.') {
                    Some((g, k)) => (g.parse().unwrap_or(usize::MAX), k.to_string()),
                    None => continue,
                },
            };
            if g > 1 << 20 {
                return Err(needs(format!("cannot hold parameter group {g}")));
            }
            if hyper.len() <= g {
                hyper.resize(g + 1, vec![]);
                members.resize(g + 1, None);
            }
            if key == "params" {
                let names = e.value.as_array().and_then(|a| {
                    a.iter()
                        .map(|v| v.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                });
                members[g] = Some(names.ok_or_else(|| {
                    needs(format!(
                        "needs `{}` as a list of parameter names",
                        short(&e.name)
                    ))
                })?);
            } else {
                hyper[g].push((key, extra_value(e)));
            }
        }
        if hyper.is_empty() {
            return Err(needs(
                "needs the optimizer's parameter groups (`optimizer.param_groups.*`)",
            ));
        }
        if let Some(g) = hyper.iter().position(Vec::is_empty) {
            return Err(needs(format!(
                "needs the hyperparameters of parameter group {g} (`optimizer.param_groups.{g}.*`)"
            )));
        }
        let groups = if members.iter().all(Option::is_some) {
            let shape_of: HashMap<&str, &Vec<u64>> = groups
                .iter()
                .flatten()
                .map(|(n, s)| (n.as_str(), s))
                .collect();
            let regrouped = members
                .into_iter()
                .flatten()
                .map(|names| {
                    names
                        .into_iter()
                        .map(|n| {
                            let s = shape_of.get(n.as_str()).map(|s| (*s).clone());
                            s.map(|s| (n.clone(), s)).ok_or_else(|| {
                                needs(format!(
                                    "has no shape for parameter `{}` of the optimizer's groups \
                                     in `param_shapes`",
                                    short(&n)
                                ))
                            })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            let listed: usize = regrouped.iter().map(Vec::len).sum();
            if listed != shape_of.len() {
                return Err(needs(format!(
                    "needs every parameter of `param_shapes` in one optimizer group ({} of {} are)",
                    listed,
                    shape_of.len()
                )));
            }
            regrouped
        } else if groups.len() == hyper.len() && !round_robin {
            groups
        } else {
            return Err(needs(format!(
                "needs the parameters of each optimizer group (`optimizer.param_groups.<g>.params`): \
                 param_shapes has {} groups, the optimizer {}",
                groups.len(),
                hyper.len()
            )));
        };
        let wrapper = opts
            .extras
            .iter()
            .filter_map(|e| {
                let k = e.name.strip_prefix("optimizer_state_dict.")?;
                Some((k.to_string(), e))
            })
            .collect();
        let ds_version = extra(opts, "ds_version")
            .map(extra_value)
            .unwrap_or(PyValue::Str("0.19.8".into()));
        Ok(Job {
            groups,
            buffers,
            shared,
            model_dtype,
            kind,
            sub_group_size,
            parameter_alignment,
            round_robin,
            entries,
            hyper,
            wrapper,
            ds_version,
        })
    }

    fn stage(&self) -> u8 {
        match self.kind {
            Kind::Zero12(s) => s,
            Kind::Bf16 => 1,
            Kind::Zero3 => 3,
        }
    }

    /// The wrapper scalar `key`, or `default`.
    fn scalar(&self, key: &str, default: PyValue) -> PyValue {
        self.wrapper
            .get(key)
            .map(|e| extra_value(e))
            .unwrap_or(default)
    }

    /// The loss scaler object (its class by its `dynamic` attribute).
    fn loss_scaler(&self) -> PyValue {
        let state = self.scalar(
            "loss_scaler",
            PyValue::Dict(vec![
                (PyValue::Str("cur_scale".into()), PyValue::Float(1.0)),
                (PyValue::Str("dynamic".into()), PyValue::Bool(false)),
            ]),
        );
        let dynamic = matches!(&state, PyValue::Dict(pairs)
            if pairs.iter().any(|(k, v)| *k == PyValue::Str("dynamic".into()) && *v == PyValue::Bool(true)));
        let (module, name) = if dynamic {
            DYNAMIC_LOSS_SCALER
        } else {
            LOSS_SCALER
        };
        PyValue::Object {
            module: module.into(),
            name: name.into(),
            state: Some(Box::new(state)),
        }
    }
}

/// One `torch.save` file being laid out: its pickle's storages, handed out in order.
struct Archive {
    path: PathBuf,
    storages: Vec<(String, u64)>,
}

impl Archive {
    fn new(path: PathBuf) -> Archive {
        Archive {
            path,
            storages: vec![],
        }
    }

    /// A new storage holding a contiguous tensor, and the value that pickles it.
    fn tensor(&mut self, dtype: DType, shape: Vec<u64>) -> (PyValue, usize) {
        let k = self.storages.len();
        let t = TensorRef::new(k.to_string(), dtype, shape);
        self.storages.push((k.to_string(), t.storage_bytes()));
        (PyValue::Tensor(t), k)
    }

    /// Lay the archive out: the file, and each storage's data offset.
    fn finish(self, value: &PyValue) -> Result<(OutputFile, Vec<u64>)> {
        let stem = self
            .path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("archive")
            .to_string();
        let records = standard_records(pickle(value), &self.storages);
        let layout = layout_archive(&stem, &records);
        let (literals, checksums) = output_parts(&layout, &records, 0);
        let at: HashMap<&str, usize> = records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.as_str(), i))
            .collect();
        let offsets = self
            .storages
            .iter()
            .map(|(k, _)| {
                let name = format!("data/{k}");
                at.get(name.as_str())
                    .map(|&i| layout.data_offsets[i])
                    .ok_or_else(|| Error::usage(format!("internal error: no record {name}")))
            })
            .collect::<Result<_>>()?;
        Ok((
            OutputFile {
                path: self.path,
                size: layout.len,
                literals,
                checksums,
            },
            offsets,
        ))
    }
}

/// A storage of one of the output files: (file index, storage index).
type At = (usize, usize);

/// An output tensor and where its pieces go, resolved once the files are laid out.
struct Out {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    place: Place,
}

enum Place {
    /// Stored whole, row-major, in each of these storages (one per rank file holding it).
    Whole(Vec<At>),
    /// Runs of its flat elements in storages by rank.
    Flat(Vec<Span>, Vec<At>),
}

/// How each parameter state key is kept: per element, or one per flat tensor.
#[derive(Clone)]
enum StateKind {
    Flat(DType),
    Scalar(DType),
}

/// A parameter's optimizer state entries: per key, a target tensor or a value.
#[derive(Clone, Default)]
struct ParamState {
    tensors: Vec<(String, usize)>,
    values: Vec<(String, PyValue)>,
}

/// `torch.Size(shape)`.
fn size(shape: &[u64]) -> PyValue {
    PyValue::Call {
        module: "torch".into(),
        name: "Size".into(),
        args: vec![PyValue::Tuple(
            shape.iter().map(|&d| PyValue::Int(d as i64)).collect(),
        )],
    }
}

fn s(k: &str) -> PyValue {
    PyValue::Str(k.into())
}

fn int(i: u64) -> PyValue {
    PyValue::Int(i as i64)
}

/// Set `path` of the dict `v` to `x` (nested dicts made as needed).
fn set_in(v: &mut PyValue, path: &[&str], x: PyValue) {
    let PyValue::Dict(pairs) = v else { return };
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    let key = s(first);
    let slot = match pairs.iter().position(|(k, _)| *k == key) {
        Some(i) => &mut pairs[i].1,
        None => {
            pairs.push((key, PyValue::Dict(vec![])));
            &mut pairs.last_mut().expect("just pushed").1
        }
    };
    if rest.is_empty() {
        *slot = x;
    } else {
        set_in(slot, rest, x);
    }
}

fn get_int(v: &PyValue, key: &str) -> Option<i64> {
    let PyValue::Dict(pairs) = v else { return None };
    pairs.iter().find_map(|(k, x)| match (k, x) {
        (PyValue::Str(n), PyValue::Int(i)) if n == key => Some(*i),
        _ => None,
    })
}

/// `ds_config` for `m` ranks at `stage`: the micro batch for the same global batch when it
/// divides (the batch sizes are left as they were otherwise: the job at M ranks sets its own).
fn config_for(mut cfg: PyValue, m: u64, stage: u8) -> PyValue {
    if !matches!(cfg, PyValue::Dict(_)) {
        return cfg;
    }
    let m = m as i64;
    let gas = get_int(&cfg, "gradient_accumulation_steps")
        .unwrap_or(1)
        .max(1);
    if let (Some(t), Some(per_step)) = (get_int(&cfg, "train_batch_size"), gas.checked_mul(m)) {
        if t > 0 && t % per_step == 0 && get_int(&cfg, "train_micro_batch_size_per_gpu").is_some() {
            set_in(
                &mut cfg,
                &["train_micro_batch_size_per_gpu"],
                PyValue::Int(t / per_step),
            );
        }
    }
    set_in(
        &mut cfg,
        &["zero_optimization", "stage"],
        PyValue::Int(stage as i64),
    );
    cfg
}

/// Lay out `target` as a ZeRO checkpoint of `world` data-parallel ranks.
pub fn write(target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
    let m = world.max(1) as u64;
    let job = Job::of(opts)?;
    let index: HashMap<&str, usize> = target
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    // trainable parameters: in the target, fp32
    let mut trainable: HashSet<&str> = HashSet::new();
    for (name, shape) in job.groups.iter().flatten() {
        let i = *index.get(name.as_str()).ok_or_else(|| {
            needs(format!(
                "needs every parameter of the source; `{}` is not selected",
                short(name)
            ))
        })?;
        let t = &target[i];
        if &t.shape != shape {
            return Err(Error::layout(
                name,
                format!("has shape {:?}, param_shapes {shape:?}", t.shape),
            ));
        }
        if t.dtype != DType::F32 {
            return Err(Error::layout(
                name,
                format!(
                    "is {} in the target: a deepspeed output holds fp32 master weights (read \
                     the source's master weights, without a cast)",
                    t.dtype
                ),
            ));
        }
        trainable.insert(name.as_str());
    }
    // optimizer state, by parameter: `optimizer.state.<param>.<key>` (by its path when it has
    // one, else the longest parameter name it starts with)
    let owner = |name: &str| -> Option<(String, String)> {
        if let Some([KeyPart::Key(a), KeyPart::Key(b), KeyPart::Key(p), KeyPart::Key(k)]) =
            opts.paths.get(name).map(Vec::as_slice)
        {
            if a == "optimizer" && b == "state" && trainable.contains(p.as_str()) {
                return Some((p.clone(), k.clone()));
            }
        }
        let rest = name.strip_prefix("optimizer.state.")?;
        rest.char_indices()
            .filter(|&(_, c)| c == '.')
            .map(|(i, _)| i)
            .rev()
            .find(|&i| trainable.contains(&rest[..i]))
            .map(|i| (rest[..i].to_string(), rest[i + 1..].to_string()))
    };
    let mut state: HashMap<String, ParamState> = HashMap::new();
    let mut module: Vec<usize> = vec![];
    for (i, t) in target.iter().enumerate() {
        match owner(&t.name) {
            Some((p, k)) => state.entry(p).or_default().tensors.push((k, i)),
            None if t.name.starts_with("optimizer.state.") => {
                return Err(needs(format!(
                    "keeps optimizer state of trainable parameters only; `{}` is not one's",
                    short(&t.name)
                )))
            }
            None => module.push(i),
        }
    }
    for e in &opts.extras {
        if let Some((p, k)) = owner(&e.name) {
            state.entry(p).or_default().values.push((k, extra_value(e)));
        }
    }
    let shared: HashMap<&str, &str> = job
        .shared
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let frozen: Vec<usize> = module
        .iter()
        .copied()
        .filter(|&i| {
            let n = target[i].name.as_str();
            !trainable.contains(n) && !job.buffers.contains(n) && !shared.contains_key(n)
        })
        .collect();

    let mut w = Writer {
        job: &job,
        target,
        m,
        archives: vec![],
        values: vec![],
        outs: vec![],
        copies: vec![],
    };
    let tag = opts
        .tag
        .clone()
        .filter(|t| names::is_plain_tag(t))
        .unwrap_or_else(|| {
            let steps = extra(opts, "global_steps").and_then(|e| e.value.as_u64());
            format!("global_step{}", steps.unwrap_or(0))
        });
    let dir = PathBuf::from(&tag);
    // the flat tensors of every rank, and which parameters each holds
    let flats = w.flats();
    w.optim_files(&dir, &flats, &state)?;
    w.model_files(&dir, &flats, &module, &frozen, &shared)?;
    w.finish(tag)
}

/// One flat tensor of the output (a parameter group at stages 1 and 2, a sub-group at 3):
/// its parameter group, its parameters (indices into the group) and their runs.
struct Flat {
    group: usize,
    params: Vec<(String, Vec<u64>, Vec<Span>)>,
    /// Elements of every rank's fp32 tensor (stage 1/2: the partition; 3: the chunks).
    len: u64,
    /// Stages 1 and 2: the group's layout.
    layout: Option<FlatGroup>,
    /// Indices into `params` in the group's own order (the flattening order but under
    /// `round_robin_gradients`).
    mapping_order: Vec<usize>,
    /// Stages 1 and 2: per parameter (flattening order), the runs `param_slice_mappings`
    /// records, as DeepSpeed computes them ([`partition::recorded_slices`]).
    recorded: Vec<Vec<Span>>,
}

struct Writer<'a> {
    job: &'a Job<'a>,
    target: &'a [TargetTensor],
    m: u64,
    archives: Vec<Archive>,
    /// The pickle of each archive, once built.
    values: Vec<PyValue>,
    outs: Vec<Out>,
    copies: Vec<(String, String)>,
}

impl<'a> Writer<'a> {
    /// The flat tensors at M ranks.
    fn flats(&self) -> Vec<Flat> {
        let mut out = vec![];
        for (g, params) in self.job.groups.iter().enumerate() {
            let numels: Vec<u64> = params.iter().map(|(_, s)| s.iter().product()).collect();
            match self.job.kind {
                Kind::Zero3 => {
                    let chunks: Vec<u64> = numels
                        .iter()
                        .map(|&n| partition::chunk(n, self.m))
                        .collect();
                    let mut at_param = 0;
                    for n in partition::sub_groups(&chunks, self.job.sub_group_size) {
                        let mut at = 0u64;
                        let mut ps = vec![];
                        for i in at_param..at_param + n {
                            let (name, shape) = &params[i];
                            ps.push((
                                name.clone(),
                                shape.clone(),
                                partition::chunk_spans(numels[i], chunks[i], self.m, at),
                            ));
                            at += chunks[i];
                        }
                        at_param += n;
                        let mapping_order = (0..ps.len()).collect();
                        out.push(Flat {
                            group: g,
                            params: ps,
                            len: at,
                            layout: None,
                            mapping_order,
                            recorded: vec![],
                        });
                    }
                }
                Kind::Zero12(_) | Kind::Bf16 => {
                    // round_robin_gradients flattens the group in DeepSpeed's order at M
                    let own = if self.job.round_robin && self.job.kind != Kind::Bf16 {
                        partition::round_robin(params.len(), self.m)
                    } else {
                        (0..params.len()).collect()
                    };
                    let params: Vec<&(String, Vec<u64>)> =
                        own.iter().map(|&i| &params[i]).collect();
                    let numels: Vec<u64> = own.iter().map(|&i| numels[i]).collect();
                    // DeepSpeed aligns each parameter but the last to 16 bytes of the model
                    // dtype when parameter_alignment is on (stage 1/2 optimizer only)
                    let align = if self.job.parameter_alignment && self.job.kind != Kind::Bf16 {
                        let e = self.job.model_dtype.size() as u64;
                        16 / gcd(16, e)
                    } else {
                        1
                    };
                    let mut paddings = vec![];
                    let mut at = 0u64;
                    for (i, n) in numels.iter().enumerate() {
                        at += n;
                        let p = if i + 1 == numels.len() {
                            0
                        } else {
                            (align - at % align) % align
                        };
                        paddings.push(p);
                        at += p;
                    }
                    let layout = FlatGroup {
                        numels,
                        paddings,
                        dp: self.m,
                    };
                    let ps = params
                        .iter()
                        .zip(layout.all_spans())
                        .map(|((n, s), spans)| (n.clone(), s.clone(), spans))
                        .collect();
                    let recorded = partition::recorded_slices(&layout, &own);
                    // the group's own order, in which DeepSpeed lists the slice mappings
                    let mut mapping_order = vec![0; own.len()];
                    for (j, &i) in own.iter().enumerate() {
                        mapping_order[i] = j;
                    }
                    out.push(Flat {
                        group: g,
                        params: ps,
                        len: layout.partition_size(),
                        layout: Some(layout),
                        mapping_order,
                        recorded,
                    });
                }
            }
        }
        out
    }

    fn archive(&mut self, path: PathBuf) -> usize {
        self.archives.push(Archive::new(path));
        self.archives.len() - 1
    }

    fn tensor(&mut self, file: usize, dtype: DType, shape: Vec<u64>) -> (PyValue, At) {
        let (v, k) = self.archives[file].tensor(dtype, shape);
        (v, (file, k))
    }

    /// The M optim files: the fp32 master partitions and the optimizer state of every flat
    /// tensor, and the wrapper's scalars.
    fn optim_files(
        &mut self,
        dir: &std::path::Path,
        flats: &[Flat],
        state: &HashMap<String, ParamState>,
    ) -> Result<()> {
        let job = self.job;
        let target = self.target;
        // each flat tensor's state: the keys of its first parameter, which all must share
        let mut flat_state: Vec<Vec<(String, StateKind, usize)>> = vec![];
        let mut flat_values: Vec<Vec<(String, PyValue)>> = vec![];
        for f in flats {
            // (a group without trainable parameters has a flat tensor without state)
            let first = f
                .params
                .first()
                .and_then(|p| state.get(&p.0))
                .cloned()
                .unwrap_or_default();
            let mut keys = vec![];
            for (k, i) in &first.tensors {
                let t = &target[*i];
                let kind = if t.shape.is_empty() {
                    StateKind::Scalar(t.dtype)
                } else {
                    StateKind::Flat(t.dtype)
                };
                keys.push((k.clone(), kind, *i));
            }
            for (name, shape, _) in &f.params {
                let ps = state.get(name).cloned().unwrap_or_default();
                let have: HashSet<&str> = ps.tensors.iter().map(|(k, _)| k.as_str()).collect();
                let want: HashSet<&str> = keys.iter().map(|(k, _, _)| k.as_str()).collect();
                if have != want {
                    return Err(needs(format!(
                        "needs the same optimizer state keys for every parameter of a group: \
                         `{}` has {:?}, `{}` {:?}",
                        short(&f.params[0].0),
                        sorted(&want),
                        short(name),
                        sorted(&have)
                    )));
                }
                for (k, i) in &ps.tensors {
                    let t = &target[*i];
                    let flat = keys.iter().find(|(key, _, _)| key == k);
                    if let Some((_, StateKind::Flat(d), _)) = flat {
                        if &t.shape != shape || t.dtype != *d {
                            return Err(Error::layout(
                                &t.name,
                                format!(
                                    "is {} {:?}; a parameter's `{k}` must be {d} of its shape {shape:?}",
                                    t.dtype, t.shape
                                ),
                            ));
                        }
                    } else if !t.shape.is_empty() {
                        return Err(Error::layout(
                            &t.name,
                            "must be a scalar, as the group's first parameter's",
                        ));
                    }
                }
            }
            flat_state.push(keys);
            flat_values.push(first.values);
        }
        let groups = job.groups.len();
        let mut fp32: Vec<Vec<At>> = vec![vec![]; flats.len()];
        // per flat tensor and state key: the storage of each rank
        let mut state_at: Vec<Vec<Vec<At>>> = flat_state
            .iter()
            .map(|keys| vec![vec![]; keys.len()])
            .collect();
        let bf16_files = job.model_dtype == DType::BF16;
        for r in 0..self.m {
            let file = self.archive(dir.join(names::optim_states(r, bf16_files)));
            // the wrapped optimizer's state dict over the flat tensors
            let mut st = vec![];
            for (fi, f) in flats.iter().enumerate() {
                let mut entries = vec![];
                for (ki, (k, kind, _)) in flat_state[fi].iter().enumerate() {
                    let (v, at) = match kind {
                        StateKind::Scalar(d) => self.tensor(file, *d, vec![]),
                        StateKind::Flat(d) => self.tensor(file, *d, vec![f.len]),
                    };
                    state_at[fi][ki].push(at);
                    entries.push((s(k), v));
                }
                for (k, v) in &flat_values[fi] {
                    entries.push((s(k), v.clone()));
                }
                st.push((int(fi as u64), PyValue::Dict(entries)));
            }
            let param_groups = (0..groups)
                .map(|g| {
                    let mut d: Vec<(PyValue, PyValue)> = job.hyper[g]
                        .iter()
                        .map(|(k, v)| (s(k), v.clone()))
                        .collect();
                    let ids = flats
                        .iter()
                        .enumerate()
                        .filter(|(_, f)| f.group == g)
                        .map(|(i, _)| int(i as u64))
                        .collect();
                    d.push((s("params"), PyValue::List(ids)));
                    PyValue::Dict(d)
                })
                .collect();
            let base = PyValue::Dict(vec![
                (s("state"), PyValue::Dict(st)),
                (s("param_groups"), PyValue::List(param_groups)),
            ]);
            // the fp32 master weights
            let mut masters = vec![];
            for (fi, f) in flats.iter().enumerate() {
                let len = match (&f.layout, job.kind) {
                    (Some(l), Kind::Zero12(_)) => f.len - l.rank_padding(r),
                    _ => f.len,
                };
                let (v, at) = self.tensor(file, DType::F32, vec![len]);
                fp32[fi].push(at);
                masters.push(v);
            }
            let osd = match job.kind {
                Kind::Zero3 => PyValue::Dict(vec![
                    (s("zero_stage"), zero_stage(3)),
                    (s("loss_scaler"), job.loss_scaler()),
                    (
                        s("dynamic_loss_scale"),
                        job.scalar("dynamic_loss_scale", PyValue::Bool(false)),
                    ),
                    (s("overflow"), job.scalar("overflow", PyValue::Bool(false))),
                    (s("partition_count"), int(self.m)),
                    (s("optimizer_state_dict"), base),
                    (s("fp32_flat_groups"), PyValue::List(masters)),
                ]),
                Kind::Zero12(stage) => {
                    let layouts: Vec<&FlatGroup> =
                        flats.iter().filter_map(|f| f.layout.as_ref()).collect();
                    PyValue::Dict(vec![
                        (s("loss_scaler"), job.loss_scaler()),
                        (
                            s("dynamic_loss_scale"),
                            job.scalar("dynamic_loss_scale", PyValue::Bool(false)),
                        ),
                        (s("overflow"), job.scalar("overflow", PyValue::Bool(false))),
                        (s("clip_grad"), job.scalar("clip_grad", PyValue::Float(1.0))),
                        (s("base_optimizer_state"), base),
                        (s("single_partition_of_fp32_groups"), PyValue::List(masters)),
                        (s("zero_stage"), zero_stage(stage)),
                        (
                            s("group_paddings"),
                            PyValue::List(layouts.iter().map(|l| int(l.rank_padding(r))).collect()),
                        ),
                        (
                            s("param_alignment_paddings"),
                            PyValue::List(
                                layouts
                                    .iter()
                                    .map(|l| {
                                        PyValue::List(l.paddings.iter().map(|&p| int(p)).collect())
                                    })
                                    .collect(),
                            ),
                        ),
                        (
                            s("partition_count"),
                            PyValue::List(vec![int(self.m); groups]),
                        ),
                        (s("ds_version"), job.ds_version.clone()),
                        (s("param_slice_mappings"), slice_mappings(flats, r)),
                    ])
                }
                Kind::Bf16 => {
                    let pads = flats
                        .iter()
                        .map(|f| {
                            let real: u64 = f.layout.as_ref().map_or(0, |l| l.numels.iter().sum());
                            int(if r + 1 == self.m {
                                f.len * self.m - real
                            } else {
                                0
                            })
                        })
                        .collect();
                    PyValue::Dict(vec![
                        (s("clip_grad"), job.scalar("clip_grad", PyValue::Float(1.0))),
                        (s("base_optimizer_state"), base),
                        (s("single_partition_of_fp32_groups"), PyValue::List(masters)),
                        (s("group_paddings"), PyValue::List(pads)),
                        (
                            s("partition_count"),
                            PyValue::List(vec![int(self.m); groups]),
                        ),
                        (s("ds_version"), job.ds_version.clone()),
                        (s("param_slice_mappings"), slice_mappings(flats, r)),
                    ])
                }
            };
            let top = PyValue::Dict(vec![
                (s("optimizer_state_dict"), osd),
                (s("ds_config"), self.config()),
                (s("ds_version"), job.ds_version.clone()),
            ]);
            self.values.push(top);
        }
        // parameters and their state over the rank files
        for (fi, f) in flats.iter().enumerate() {
            for (name, shape, spans) in &f.params {
                self.outs.push(Out {
                    name: name.clone(),
                    dtype: DType::F32,
                    shape: shape.clone(),
                    place: Place::Flat(spans.clone(), fp32[fi].clone()),
                });
            }
            for (ki, (k, kind, first)) in flat_state[fi].iter().enumerate() {
                match kind {
                    StateKind::Scalar(d) => self.outs.push(Out {
                        // the group's first parameter's value stands for the flat tensor
                        name: target[*first].name.clone(),
                        dtype: *d,
                        shape: vec![],
                        place: Place::Whole(state_at[fi][ki].clone()),
                    }),
                    StateKind::Flat(d) => {
                        for (name, shape, spans) in &f.params {
                            let ps = &state[name];
                            let i = ps
                                .tensors
                                .iter()
                                .find(|(key, _)| key == k)
                                .map(|(_, i)| *i)
                                .expect("keys checked equal");
                            self.outs.push(Out {
                                name: target[i].name.clone(),
                                dtype: *d,
                                shape: shape.clone(),
                                place: Place::Flat(spans.clone(), state_at[fi][ki].clone()),
                            });
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `ds_config` for the output.
    fn config(&self) -> PyValue {
        let cfg = self
            .job
            .entries
            .iter()
            .find(|e| e.name == "ds_config")
            .map(|e| extra_value(e))
            .unwrap_or(PyValue::Dict(vec![]));
        config_for(cfg, self.m, self.job.stage())
    }

    /// The model states file(s): one at stages 1 and 2, one per rank at stage 3.
    fn model_files(
        &mut self,
        dir: &std::path::Path,
        flats: &[Flat],
        module: &[usize],
        frozen: &[usize],
        shared: &HashMap<&str, &str>,
    ) -> Result<()> {
        let job = self.job;
        let target = self.target;
        let stage3 = job.kind == Kind::Zero3;
        let files = if stage3 { self.m } else { 1 };
        let frozen_names: HashSet<&str> = frozen.iter().map(|&i| target[i].name.as_str()).collect();
        let trainable: HashSet<&str> = flats
            .iter()
            .flat_map(|f| f.params.iter().map(|(n, _, _)| n.as_str()))
            .collect();
        let mut whole: HashMap<usize, Vec<At>> = HashMap::new();
        let mut copies: Vec<(String, DType, Vec<u64>, String, At)> = vec![];
        let mut frags: HashMap<usize, Vec<At>> = HashMap::new();
        for r in 0..files {
            let path = if stage3 {
                dir.join(names::rank_model_states(r))
            } else {
                dir.join(names::model_states())
            };
            let file = self.archive(path);
            let mut module_dict = vec![];
            let mut stored: HashMap<&str, PyValue> = HashMap::new();
            for &i in module {
                let t = &target[i];
                let n = t.name.as_str();
                if let Some(of) = shared.get(n) {
                    if let Some(v) = stored.get(of) {
                        module_dict.push((s(n), v.clone()));
                        continue;
                    }
                }
                let v = if stage3 && (trainable.contains(n) || frozen_names.contains(n)) {
                    // partitioned: an empty placeholder of the parameter's dtype
                    let dtype = if trainable.contains(n) {
                        job.model_dtype
                    } else {
                        t.dtype
                    };
                    self.tensor(file, dtype, vec![0]).0
                } else if trainable.contains(n) {
                    // stages 1 and 2: the model-dtype copy of the master weights
                    let (v, at) = self.tensor(file, job.model_dtype, t.shape.clone());
                    copies.push((
                        format!("module:{n}"),
                        job.model_dtype,
                        t.shape.clone(),
                        n.to_string(),
                        at,
                    ));
                    v
                } else {
                    let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                    whole.entry(i).or_default().push(at);
                    v
                };
                stored.insert(n, v.clone());
                module_dict.push((s(n), v));
            }
            // frozen parameters: stage 2 keeps a second whole copy, stage 3 this rank's chunk
            let fragments = match job.kind {
                Kind::Zero12(2) => PyValue::Dict(
                    frozen
                        .iter()
                        .map(|&i| {
                            let t = &target[i];
                            let (v, at) = self.tensor(file, t.dtype, t.shape.clone());
                            copies.push((
                                format!("frozen_param_fragments:{}", t.name),
                                t.dtype,
                                t.shape.clone(),
                                t.name.clone(),
                                at,
                            ));
                            (s(&t.name), v)
                        })
                        .collect(),
                ),
                Kind::Zero3 => PyValue::Dict(
                    frozen
                        .iter()
                        .map(|&i| {
                            let t = &target[i];
                            let n: u64 = t.shape.iter().product();
                            let c = partition::chunk(n, self.m);
                            let (v, at) = self.tensor(file, t.dtype, vec![c]);
                            frags.entry(i).or_default().push(at);
                            (s(&t.name), v)
                        })
                        .collect(),
                ),
                _ => PyValue::None,
            };
            let frozen_shapes = if job.stage() >= 2 {
                PyValue::Dict(
                    frozen
                        .iter()
                        .map(|&i| (s(&target[i].name), size(&target[i].shape)))
                        .collect(),
                )
            } else {
                PyValue::None
            };
            // per flat tensor: a group at stages 1 and 2, a sub-group at 3
            let param_shapes = PyValue::List(
                flats
                    .iter()
                    .map(|f| {
                        PyValue::OrderedDict(
                            f.params.iter().map(|(n, sh, _)| (s(n), size(sh))).collect(),
                        )
                    })
                    .collect(),
            );
            let mut top = vec![(s("module"), PyValue::OrderedDict(module_dict))];
            let mut placed = HashSet::new();
            let mut put = |top: &mut Vec<(PyValue, PyValue)>, k: &str, v: PyValue| {
                if placed.insert(k.to_string()) {
                    top.push((s(k), v));
                }
            };
            for e in &job.entries {
                match e.name.as_str() {
                    "buffer_names" => {
                        put(&mut top, "buffer_names", extra_value(e));
                        put(&mut top, "optimizer", PyValue::None);
                    }
                    "param_shapes" => put(&mut top, "param_shapes", param_shapes.clone()),
                    "frozen_param_shapes" => {
                        put(&mut top, "frozen_param_shapes", frozen_shapes.clone())
                    }
                    "shared_params" => {
                        put(&mut top, "shared_params", extra_value(e));
                        put(&mut top, "frozen_param_fragments", fragments.clone());
                    }
                    "dp_world_size" => put(&mut top, "dp_world_size", int(self.m)),
                    "ds_config" => put(&mut top, "ds_config", self.config()),
                    "frozen_param_fragments" | "optimizer" | "module" => {}
                    n => put(&mut top, n, extra_value(e)),
                }
            }
            // what the engine always saves, where the source lacked it
            put(&mut top, "buffer_names", PyValue::List(vec![]));
            put(&mut top, "optimizer", PyValue::None);
            put(&mut top, "param_shapes", param_shapes);
            put(&mut top, "frozen_param_shapes", frozen_shapes);
            put(&mut top, "shared_params", PyValue::Dict(vec![]));
            put(&mut top, "frozen_param_fragments", fragments);
            put(&mut top, "dp_world_size", int(self.m));
            self.values.push(PyValue::Dict(top));
        }
        for &i in module {
            if let Some(ats) = whole.remove(&i) {
                let t = &target[i];
                self.outs.push(Out {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    place: Place::Whole(ats),
                });
            }
        }
        for &i in frozen {
            if let Some(ats) = frags.remove(&i) {
                let t = &target[i];
                let n: u64 = t.shape.iter().product();
                let spans = partition::chunk_spans(n, partition::chunk(n, self.m), self.m, 0);
                self.outs.push(Out {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    place: Place::Flat(spans, ats),
                });
            }
        }
        for (name, dtype, shape, of, at) in copies {
            self.copies.push((name.clone(), of));
            self.outs.push(Out {
                name,
                dtype,
                shape,
                place: Place::Whole(vec![at]),
            });
        }
        Ok(())
    }

    /// Lay out every file and resolve the tensors' pieces.
    fn finish(self, tag: String) -> Result<Output> {
        let mut files = vec![];
        let mut offsets = vec![];
        for (a, v) in self.archives.into_iter().zip(&self.values) {
            let (f, o) = a.finish(v)?;
            files.push(f);
            offsets.push(o);
        }
        let base = 1u32; // file 0 is `latest`
        let loc = |at: At, elem: u64, first: u64| Loc {
            file: base + at.0 as u32,
            offset: offsets[at.0][at.1] + first * elem,
            strides: None,
            pending: None,
        };
        let mut tensors = vec![];
        for o in self.outs {
            let elem = o.dtype.size() as u64;
            let pieces = match o.place {
                Place::Whole(ats) => ats
                    .into_iter()
                    .enumerate()
                    .map(|(r, at)| Piece {
                        rank: r as u32,
                        region: Region::full(&o.shape),
                        loc: loc(at, elem, 0),
                    })
                    .collect(),
                Place::Flat(spans, ats) => partition::flat_pieces(
                    &o.shape,
                    &spans,
                    |r| {
                        let l = loc(ats[r as usize], elem, 0);
                        (l.file, l.offset)
                    },
                    elem,
                ),
            };
            tensors.push(TensorLayout {
                name: o.name,
                dtype: o.dtype,
                shape: o.shape,
                pieces,
            });
        }
        let latest: reshard_core::output::Literal = tag.as_bytes().to_vec().into();
        let mut all = vec![OutputFile {
            path: PathBuf::from("latest"),
            size: tag.len() as u64,
            literals: vec![(0, latest)],
            checksums: vec![],
        }];
        all.extend(files);
        Ok(Output {
            files: all,
            tensors,
            copies: self.copies,
        })
    }
}

fn zero_stage(stage: u8) -> PyValue {
    PyValue::Call {
        module: ZERO_STAGE_ENUM.0.into(),
        name: ZERO_STAGE_ENUM.1.into(),
        args: vec![PyValue::Int(stage as i64)],
    }
}

/// `param_slice_mappings` of rank `r`: per group, each parameter with elements in the rank's
/// partition → `fragment_address(numel, start)` (its run's length and place in the
/// partition).
fn slice_mappings(flats: &[Flat], r: u64) -> PyValue {
    PyValue::List(
        flats
            .iter()
            .map(|f| {
                PyValue::OrderedDict(
                    f.mapping_order
                        .iter()
                        .map(|&i| (&f.params[i].0, &f.recorded[i]))
                        .filter_map(|(n, spans)| {
                            let sp = spans.iter().find(|s| s.rank == r)?;
                            Some((
                                s(n),
                                PyValue::Object {
                                    module: FRAGMENT_ADDRESS.0.into(),
                                    name: FRAGMENT_ADDRESS.1.into(),
                                    state: Some(Box::new(PyValue::Dict(vec![
                                        (s("numel"), int(sp.end - sp.start)),
                                        (s("start"), int(sp.at)),
                                    ]))),
                                },
                            ))
                        })
                        .collect(),
                )
            })
            .collect(),
    )
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn sorted<'s>(set: &HashSet<&'s str>) -> Vec<&'s str> {
    let mut v: Vec<&str> = set.iter().copied().collect();
    v.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Region;

    fn extra(name: &str, value: serde_json::Value) -> Extra {
        Extra {
            name: name.into(),
            value,
            pickle: None,
            raw: None,
            origin: "deepspeed",
        }
    }

    /// The non-tensor entries of a stage-3 source with two groups, the second empty.
    fn opts(config: serde_json::Value) -> WriteOptions {
        WriteOptions {
            extras: vec![
                extra("param_shapes", serde_json::json!([{"w": [5, 3]}, {}])),
                extra("ds_config", config),
                extra("optimizer.param_groups.0.lr", serde_json::json!(0.1)),
                extra("optimizer.param_groups.0.params", serde_json::json!(["w"])),
                extra("optimizer.param_groups.1.lr", serde_json::json!(0.2)),
                extra("optimizer.param_groups.1.params", serde_json::json!([])),
            ],
            ..Default::default()
        }
    }

    fn target() -> Vec<TargetTensor> {
        vec![TargetTensor {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![5, 3],
            ranks: vec![vec![Region::full(&[5, 3])]],
        }]
    }

    #[test]
    fn a_float_sub_group_size_counts() {
        // JSON configs write `1e9`-style counts, which pickle as floats
        let cfg = serde_json::json!({"zero_optimization": {"stage": 3, "sub_group_size": 4.0}});
        let o = opts(cfg);
        let job = Job::of(&o).unwrap();
        assert_eq!(job.sub_group_size, 4);
        assert_eq!(job.kind, Kind::Zero3);
        let cfg = serde_json::json!({"zero_optimization": {"stage": 3, "sub_group_size": 4.5}});
        assert_eq!(Job::of(&opts(cfg)).unwrap().sub_group_size, 1_000_000_000);
    }

    #[test]
    fn a_group_without_trainable_parameters_is_written() {
        for stage in [1, 2, 3] {
            let cfg = serde_json::json!({"zero_optimization": {"stage": stage}});
            let out = write(&target(), 2, &opts(cfg)).unwrap();
            // `latest`, one model states file (three at stage 3: one a rank), two optim files
            let files = if stage == 3 { 5 } else { 4 };
            assert_eq!(out.files.len(), files, "stage {stage}");
            let w = out.tensors.iter().find(|t| t.name == "w").unwrap();
            let covered: u64 = w.pieces.iter().map(|p| p.region.volume()).sum();
            assert_eq!(covered, 15);
        }
    }

    #[test]
    fn batch_sizes_follow_the_degree_when_they_divide() {
        let cfg = |tbs: i64, mb: i64| {
            PyValue::Dict(vec![
                (s("train_batch_size"), PyValue::Int(tbs)),
                (s("train_micro_batch_size_per_gpu"), PyValue::Int(mb)),
                (s("gradient_accumulation_steps"), PyValue::Int(1)),
            ])
        };
        let out = config_for(cfg(12, 6), 4, 2);
        assert_eq!(get_int(&out, "train_micro_batch_size_per_gpu"), Some(3));
        // 12 over 5 ranks does not divide: left as it was
        let out = config_for(cfg(12, 6), 5, 2);
        assert_eq!(get_int(&out, "train_micro_batch_size_per_gpu"), Some(6));
        // an absurd accumulation count does not overflow
        let mut big = cfg(12, 6);
        set_in(
            &mut big,
            &["gradient_accumulation_steps"],
            PyValue::Int(i64::MAX),
        );
        let out = config_for(big, 4, 3);
        assert_eq!(get_int(&out, "train_micro_batch_size_per_gpu"), Some(6));
    }
}
