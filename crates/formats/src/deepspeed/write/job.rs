//! What the source's non-tensor entries say of the job the writer lays out: the parameter
//! groups, the optimizer and its settings (`ds_config`), the model states entries to carry, and
//! `ds_config` for the target's degree.

use super::super::records::{DYNAMIC_LOSS_SCALER, LOSS_SCALER};
use super::archive::s;
use super::{extra, needs};
use crate::error::Result;
use crate::layout::DType;
use crate::torch::pickle::extra_value;
use crate::torch::pickle::PyValue;
use crate::torch::short;
use crate::{Extra, KeyPart, WriteOptions};
use serde_json::Value as Json;
use std::collections::{HashMap, HashSet};

/// The optimizer whose files to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Zero12(u8),
    Bf16,
    Zero3,
}

/// What the source's non-tensor entries say of the job.
pub(super) struct Job<'a> {
    /// `param_shapes`: per parameter group, its trainable parameters.
    pub(super) groups: Vec<Vec<(String, Vec<u64>)>>,
    pub(super) buffers: HashSet<String>,
    /// Tied name → the parameter it shares.
    pub(super) shared: Vec<(String, String)>,
    /// The model's training dtype (`ds_config`'s bf16 / fp16, else fp32).
    pub(super) model_dtype: DType,
    pub(super) kind: Kind,
    /// `zero_optimization.sub_group_size` (stage 3).
    pub(super) sub_group_size: u64,
    /// `zero_optimization.parameter_alignment` (stages 1 and 2).
    pub(super) parameter_alignment: bool,
    /// `zero_optimization.round_robin_gradients` (stages 1 and 2).
    pub(super) round_robin: bool,
    /// The model states entries, in order (everything but the optimizer's).
    pub(super) entries: Vec<&'a Extra>,
    /// `optimizer.param_groups.<g>.<key>` (without `params`), per group.
    pub(super) hyper: Vec<Vec<(String, PyValue)>>,
    /// `optimizer_state_dict.<key>`.
    pub(super) wrapper: HashMap<String, &'a Extra>,
    pub(super) ds_version: PyValue,
}

pub(super) fn json_shape(v: &Json) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(Json::as_u64).collect()
}

impl<'a> Job<'a> {
    /// Read the job from the source's entries in `opts`.
    pub(super) fn of(opts: &'a WriteOptions) -> Result<Job<'a>> {
        let groups = param_shapes(opts)?;
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
        let config = Config(extra(opts, "ds_config").map(|e| &e.value));
        let model_dtype = config.model_dtype();
        let stage = config.stage(opts)?;
        let kind = config.kind(stage, model_dtype);
        let sub_group_size = config
            .count(&["zero_optimization", "sub_group_size"])
            .unwrap_or(1_000_000_000);
        let parameter_alignment = config.flag(&["zero_optimization", "parameter_alignment"]);
        let round_robin = config.flag(&["zero_optimization", "round_robin_gradients"]);
        let entries = opts
            .extras
            .iter()
            .filter(|e| {
                !e.name.starts_with("optimizer.param_groups.")
                    && !e.name.starts_with("optimizer.state.")
                    && !e.name.starts_with("optimizer_state_dict.")
            })
            .collect();
        let (hyper, members) = optimizer_groups(opts)?;
        let groups = regroup(groups, members, hyper.len(), round_robin)?;
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

    pub(super) fn stage(&self) -> u8 {
        match self.kind {
            Kind::Zero12(s) => s,
            Kind::Bf16 => 1,
            Kind::Zero3 => 3,
        }
    }

    /// The wrapper scalar `key`, or `default`.
    pub(super) fn scalar(&self, key: &str, default: PyValue) -> PyValue {
        self.wrapper
            .get(key)
            .map(|e| extra_value(e))
            .unwrap_or(default)
    }

    /// The loss scaler object (its class by its `dynamic` attribute).
    pub(super) fn loss_scaler(&self) -> PyValue {
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

/// Per parameter group, its trainable parameters and their shapes.
type Groups = Vec<Vec<(String, Vec<u64>)>>;

/// `param_shapes`: per parameter group (the source's flat tensors), its trainable parameters
/// and their shapes.
fn param_shapes(opts: &WriteOptions) -> Result<Groups> {
    let shapes = extra(opts, "param_shapes").ok_or_else(|| {
        needs(
            "needs a DeepSpeed source: its parameter groups, stage and engine state \
             (`param_shapes`, `ds_config`) say what the engine at M ranks expects",
        )
    })?;
    shapes
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
        .ok_or_else(|| needs("needs `param_shapes` as a list of {name: shape} dicts"))
}

/// The source's `ds_config` (if any), read by path.
struct Config<'c>(Option<&'c Json>);

impl<'c> Config<'c> {
    /// The value at `path`.
    fn at(&self, path: &[&str]) -> Option<&'c Json> {
        let mut v = self.0?;
        for k in path {
            v = v.get(k)?;
        }
        Some(v)
    }

    /// The bool at `path`, false where absent.
    fn flag(&self, path: &[&str]) -> bool {
        self.at(path).and_then(Json::as_bool).unwrap_or(false)
    }

    /// The count at `path`, which the config may write as a float (`1e9`).
    fn count(&self, path: &[&str]) -> Option<u64> {
        self.at(path).and_then(|v| {
            v.as_u64().or_else(|| {
                v.as_f64()
                    .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1.8e19)
                    .map(|f| f as u64)
            })
        })
    }

    /// The model's training dtype: bf16 / fp16 when enabled, else fp32.
    fn model_dtype(&self) -> DType {
        let enabled = |k: &str| self.at(&[k, "enabled"]).and_then(Json::as_bool) == Some(true);
        if enabled("bf16") || enabled("bfloat16") {
            DType::BF16
        } else if enabled("fp16") {
            DType::F16
        } else {
            DType::F32
        }
    }

    /// The ZeRO stage to write: the one chosen, else the source's.
    fn stage(&self, opts: &WriteOptions) -> Result<u8> {
        let source_stage = self
            .at(&["zero_optimization", "stage"])
            .and_then(Json::as_u64)
            .or_else(|| {
                extra(opts, "optimizer_state_dict.zero_stage").and_then(|e| e.value.as_u64())
            });
        match opts.zero_stage.map(u64::from).or(source_stage) {
            Some(s @ 1..=3) => Ok(s as u8),
            Some(s) => Err(needs(format!("needs ZeRO stage 1, 2 or 3, not {s}"))),
            None => Err(needs(
                "needs the source's ZeRO stage (`ds_config`), or one chosen",
            )),
        }
    }

    /// The optimizer DeepSpeed's engine chooses at `stage` for `model_dtype`:
    /// `BF16_Optimizer` for bf16 at stage 1 with fp32 gradient accumulation, not offloaded.
    fn kind(&self, stage: u8, model_dtype: DType) -> Kind {
        let fp32_accumulation = matches!(
            self.at(&["data_types", "grad_accum_dtype"])
                .and_then(Json::as_str),
            Some("fp32" | "float32" | "float" | "torch.float32")
        );
        let offload = self
            .at(&["zero_optimization", "offload_optimizer", "device"])
            .and_then(Json::as_str)
            .is_some_and(|d| d != "none");
        match stage {
            3 => Kind::Zero3,
            1 if model_dtype == DType::BF16 && fp32_accumulation && !offload => Kind::Bf16,
            s => Kind::Zero12(s),
        }
    }
}

/// Per optimizer parameter group: its hyperparameters, and its parameters' names (`params`)
/// where the source lists them.
type OptimizerGroups = (Vec<Vec<(String, PyValue)>>, Vec<Option<Vec<String>>>);

/// The optimizer's parameter groups (`optimizer.param_groups.<g>.<key>`), each checked to
/// have hyperparameters.
fn optimizer_groups(opts: &WriteOptions) -> Result<OptimizerGroups> {
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
    Ok((hyper, members))
}

/// The trainable parameters of each of the `n_groups` optimizer groups: `groups`
/// (`param_shapes`) regrouped by the groups' `members` where every group lists them, else
/// `groups` itself where it matches the optimizer's groups one to one (and is in their own
/// order: not under `round_robin`).
fn regroup(
    groups: Groups,
    members: Vec<Option<Vec<String>>>,
    n_groups: usize,
    round_robin: bool,
) -> Result<Groups> {
    if members.iter().all(Option::is_some) {
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
        Ok(regrouped)
    } else if groups.len() == n_groups && !round_robin {
        Ok(groups)
    } else {
        Err(needs(format!(
            "needs the parameters of each optimizer group (`optimizer.param_groups.<g>.params`): \
             param_shapes has {} groups, the optimizer {}",
            groups.len(),
            n_groups
        )))
    }
}

/// Set `path` of the dict `v` to `x` (nested dicts made as needed).
pub(super) fn set_in(v: &mut PyValue, path: &[&str], x: PyValue) {
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

pub(super) fn get_int(v: &PyValue, key: &str) -> Option<i64> {
    let PyValue::Dict(pairs) = v else { return None };
    pairs.iter().find_map(|(k, x)| match (k, x) {
        (PyValue::Str(n), PyValue::Int(i)) if n == key => Some(*i),
        _ => None,
    })
}

/// `ds_config` for `m` ranks at `stage`: the micro batch for the same global batch when it
/// divides (the batch sizes are left as they were otherwise: the job at M ranks sets its own).
pub(super) fn config_for(mut cfg: PyValue, m: u64, stage: u8) -> PyValue {
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
