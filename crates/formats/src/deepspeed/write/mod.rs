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
//!
//! By concept: [`job`] reads what the source says of the job, [`flats`] places the
//! parameters in the flat tensors, [`optim`] and [`model`] build the optim and model states
//! files, and [`archive`] lays the files out and resolves each tensor's pieces in them.

mod archive;
mod flats;
mod job;
mod model;
mod optim;
mod universal;

use super::names;
use crate::error::{Error, Result};
use crate::layout::DType;
use crate::torch::pickle::extra_value;
use crate::torch::pickle::PyValue;
use crate::torch::short;
use crate::{Extra, KeyPart, Output, TargetTensor, WriteOptions};
use archive::{Archive, At, Out};
use job::{config_for, Job};
use optim::ParamState;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

/// A refusal that names what a deepspeed output needs.
fn needs(msg: impl std::fmt::Display) -> Error {
    Error::usage(format!("a deepspeed output {msg}"))
}

/// The extra called `name`.
fn extra<'a>(opts: &'a WriteOptions, name: &str) -> Option<&'a Extra> {
    opts.extras.iter().find(|e| e.name == name)
}

/// Lay out `target` as a ZeRO checkpoint of `world` data-parallel ranks.
pub fn write(target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
    lay_out(target, world, opts, false)
}

/// Lay out `target` as a DeepSpeed universal checkpoint: `latest_universal` and a tag folder
/// holding `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`, `zero/optimizer_state.pt` and
/// the model states file(s) a job of `world` data-parallel ranks at the output's stage saves.
pub fn write_universal(target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
    lay_out(target, world, opts, true)
}

/// The ZeRO or (`universal`) universal checkpoint of `target` at `world` ranks.
fn lay_out(
    target: &[TargetTensor],
    world: u32,
    opts: &WriteOptions,
    universal: bool,
) -> Result<Output> {
    let m = world.max(1) as u64;
    let job = Job::of(opts)?;
    let trainable = trainable(target, &job)?;
    let (state, module) = optimizer_state(target, opts, &trainable)?;
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
    let mut tag = opts
        .tag
        .clone()
        .filter(|t| names::is_plain_tag(t))
        .unwrap_or_else(|| {
            let steps = extra(opts, "global_steps").and_then(|e| e.value.as_u64());
            format!("global_step{}", steps.unwrap_or(0))
        });
    // `<tag>_universal`, as DeepSpeed's documentation names ds_to_universal's output
    if universal && !tag.ends_with("_universal") {
        tag.push_str("_universal");
    }
    let dir = PathBuf::from(&tag);
    // the flat tensors of every rank, and which parameters each holds
    let flats = w.flats();
    if universal {
        w.universal_files(&dir, &flats, &state, &module)?;
    } else {
        w.optim_files(&dir, &flats, &state)?;
    }
    w.model_files(&dir, &flats, &module, &frozen, &shared)?;
    let latest = if universal {
        super::universal::LATEST
    } else {
        "latest"
    };
    w.finish(latest, tag)
}

/// The trainable parameters (the job's `param_shapes`), each checked to be in the target,
/// of its shape, fp32.
fn trainable<'j>(target: &[TargetTensor], job: &'j Job) -> Result<HashSet<&'j str>> {
    let index: HashMap<&str, usize> = target
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
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
    Ok(trainable)
}

/// The optimizer state of each trainable parameter (target tensors and non-tensor entries
/// named `optimizer.state.<param>.<key>`), and the other target tensors (by index): those of
/// the model states' `module`.
fn optimizer_state(
    target: &[TargetTensor],
    opts: &WriteOptions,
    trainable: &HashSet<&str>,
) -> Result<(HashMap<String, ParamState>, Vec<usize>)> {
    // by the entry's path when it has one, else the longest parameter name it starts with
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
    Ok((state, module))
}

/// The output being laid out: its files, and the target tensors' places in them.
struct Writer<'a> {
    job: &'a Job<'a>,
    target: &'a [TargetTensor],
    /// The number of data-parallel ranks.
    m: u64,
    archives: Vec<Archive>,
    /// The pickle of each archive, once built.
    values: Vec<PyValue>,
    /// The output tensors and where they are stored.
    outs: Vec<Out>,
    /// (copy, the tensor it copies) of the output's second copies.
    copies: Vec<(String, String)>,
}

impl Writer<'_> {
    /// A new archive at `path`; its index.
    fn archive(&mut self, path: PathBuf) -> usize {
        self.archives.push(Archive::new(path));
        self.archives.len() - 1
    }

    /// A new storage in archive `file`, holding a contiguous tensor: the value that pickles
    /// it, and where it is.
    fn tensor(&mut self, file: usize, dtype: DType, shape: Vec<u64>) -> (PyValue, At) {
        let (v, k) = self.archives[file].tensor(dtype, shape);
        (v, (file, k))
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
}

#[cfg(test)]
mod tests {
    use super::archive::s;
    use super::job::{get_int, set_in, Kind};
    use super::*;
    use crate::layout::Region;

    fn extra(name: &str, value: serde_json::Value) -> Extra {
        Extra {
            name: name.into(),
            value,
            pickle: None,
            raw: None,
            origin: "deepspeed",
            opaque: None,
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
