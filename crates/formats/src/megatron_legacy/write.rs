//! The writer of Megatron-LM's legacy per-rank checkpoints (`--format megatron-legacy`): a save
//! directory of `latest_checkpointed_iteration.txt` and `iter_{N:07}/mp_rank_TT[_PPP][_EEE]/
//! model_optim_rng.pt` at the tensor-, pipeline- and expert-parallel sizes asked for
//! ([`WriteOptions::tp`], `pp`, `ep`; the source's by default), each file a `torch.save` of
//! `{args, checkpoint_version, iteration, model, …}` as Megatron-LM's `save_checkpoint` writes
//! it, whose `model` is what that rank's GPTModel `load_state_dict`s: its local shards under
//! the local module names, layers numbered from 0 on every pipeline stage.
//!
//! It is the reader's table run backwards: each local tensor is regions of the global
//! tensors ([`super::SPLITS`]: rows or columns of the tensor ranks' share, SwiGLU's
//! `[gate_r; up_r]` as two regions, norms and the router whole in every tensor rank's file),
//! laid out before any data exists and filled by the executor from wherever the source keeps
//! those regions. The global tensors may be named per layer (`decoder.layers.{i}.…`, the
//! legacy reader's names) or stacked on a leading layer axis (and expert axis) as
//! megatron-core's `torch_dist` keeps them: a layer's tensor is then a region of the stacked
//! one. GroupedMLP's experts (`args.moe_grouped_gemm`) are written into `weight1` /
//! `weight2`, each expert's projection transposed in place by the strides of its region.
//!
//! `args` is the source's (`common.pt`'s, or a legacy source's rank 0 file's) with the parallel
//! sizes set to the output's; the other `common.pt` entries (`checkpoint_version`, `iteration`,
//! counters) are written into every rank file. No optimizer or RNG state is written: Megatron-LM
//! loads the output with `--no-load-optim --no-load-rng` (or `--finetune`).

use super::{iteration_folder, rank_folder, split_of, Config, Split, RANK_FILE, RELEASE, TRACKER};
use crate::error::{Error, Result};
use crate::layout::{DType, Loc, Piece, Region, TensorLayout};
use crate::megatron::COMMON_ORIGIN;
use crate::torch::pickle::write::from_pickle;
use crate::torch::pickle::{pickle, PyValue, Value};
use crate::torch::save::{standard_records, TensorRef};
use crate::torch::zip::{layout_archive, output_parts};
use crate::{Extra, Output, OutputFile, TargetTensor, WriteOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why a tensor without a split rule is refused at TP > 1.
const NO_SPLIT: &str =
    "has no tensor-parallel split rule (reshard knows megatron-core GPT's tensors): write it with --tp 1";

/// A tensor rank's share of a tensor: its local shape, and each region of the tensor it holds
/// with the local row the region starts at.
type Share = (Vec<u64>, Vec<(Region, u64)>);

/// What the saved arguments' errors name: the writer has no file of its own yet.
const ARGS: &str = "the source's args";

/// The `common.pt` entries the writer sets itself, or leaves out (megatron-core's
/// `dist_checkpointing` adds `content_metadata`; the optimizer's and RNG states are each
/// rank's own).
const NOT_CARRIED: &[&str] = &[
    "args",
    "checkpoint_version",
    "iteration",
    "model",
    "content_metadata",
    "optimizer",
    "rng_state",
    "rerun_state_machine",
];

/// One entry of a rank file's `model` dict.
struct Entry {
    /// The local state-dict key.
    key: String,
    /// Where it goes in the dict: (section, local layer, sequence).
    order: (u8, u64, u64),
    /// A tensor, or `None` (a linear layer's `_extra_state`).
    tensor: Option<Local>,
}

/// A local tensor: its dtype and shape, and the regions of global tensors it holds.
struct Local {
    dtype: DType,
    shape: Vec<u64>,
    pieces: Vec<Part>,
}

/// A region of target tensor `target` held by a local tensor from element `offset` on, with
/// `strides` (`None`: row-major over the region).
struct Part {
    target: usize,
    region: Region,
    offset: u64,
    strides: Option<Vec<u64>>,
}

/// One rank file being laid out.
#[derive(Default)]
struct RankFile {
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
}

/// An axis of a global tensor's name: a fixed index, or stacked on a leading axis.
#[derive(Clone, Copy, Debug)]
enum Axis {
    Fixed(u64),
    Stacked,
}

/// A global tensor's name taken apart: its layer and expert (when in a layer), and the rest
/// (the name after `decoder.layers.{i}.`, after the experts' prefix for an expert; the whole
/// name outside the layers).
struct Name<'a> {
    layer: Option<Axis>,
    expert: Option<Axis>,
    rest: &'a str,
}

fn parse(name: &str) -> Name<'_> {
    let Some(r) = name.strip_prefix("decoder.layers.") else {
        return Name {
            layer: None,
            expert: None,
            rest: name,
        };
    };
    let (layer, r) = match r.split_once('.') {
        Some((i, rest)) if i.bytes().all(|b| b.is_ascii_digit()) && !i.is_empty() => {
            match i.parse() {
                Ok(i) => (Axis::Fixed(i), rest),
                Err(_) => (Axis::Stacked, r),
            }
        }
        _ => (Axis::Stacked, r),
    };
    for p in ["mlp.experts.local_experts.", "mlp.experts.experts."] {
        if let Some(x) = r.strip_prefix(p) {
            let (expert, inner) = match x.split_once('.') {
                Some((e, inner)) if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) => {
                    match e.parse() {
                        Ok(e) => (Axis::Fixed(e), inner),
                        Err(_) => (Axis::Stacked, x),
                    }
                }
                _ => (Axis::Stacked, x),
            };
            return Name {
                layer: Some(layer),
                expert: Some(expert),
                rest: inner,
            };
        }
    }
    Name {
        layer: Some(layer),
        expert: None,
        rest: r,
    }
}

/// The dict of a Namespace (or a dict) value, to change.
fn fields(args: &mut Value) -> Option<&mut Vec<(Value, Value)>> {
    match args {
        Value::Dict(p) => Some(p),
        Value::Object { state: Some(s), .. } => match s.as_mut() {
            Value::Dict(p) => Some(p),
            Value::Tuple(parts) if parts.len() == 2 => match &mut parts[0] {
                Value::Dict(p) => Some(p),
                _ => None,
            },
            _ => None,
        },
        _ => None,
    }
}

/// Set argument `key` to `v` (added when absent and `add`).
fn set_arg(args: &mut Value, key: &str, v: Value, add: bool) {
    if let Some(pairs) = fields(args) {
        match pairs
            .iter_mut()
            .rev()
            .find(|(k, _)| k.as_str() == Some(key))
        {
            Some((_, x)) => *x = v,
            None if add => pairs.push((Value::Str(key.into()), v)),
            None => {}
        }
    }
}

/// The common.pt entry `name`'s value.
fn common<'a>(opts: &'a WriteOptions, name: &str) -> Option<&'a Extra> {
    opts.extras
        .iter()
        .find(|e| e.name == name && e.origin == COMMON_ORIGIN)
}

/// The local name of a layer's tensor: the local spec's norms under their own modules'
/// names, where the global names have TransformerEngine's (the reader's renaming, undone).
fn local_rest(rest: &str, local_spec: bool) -> String {
    if !local_spec {
        return rest.to_string();
    }
    if let Some(r) = rest.strip_prefix("self_attention.linear_qkv.layer_norm_") {
        format!("input_layernorm.{r}")
    } else if let Some(r) = rest.strip_prefix("mlp.linear_fc1.layer_norm_") {
        format!("pre_mlp_layernorm.{r}")
    } else {
        rest.to_string()
    }
}

/// What tensor rank `t` of `tp` holds of a tensor of shape `shape` split by `split`: its
/// local shape, and each region of the tensor it holds with the local row it starts at
/// (whole rows of the local tensor, one after another).
fn local_pieces(
    name: &str,
    split: Split,
    shape: &[u64],
    t: u64,
    tp: u64,
    swiglu: bool,
) -> Result<Share> {
    let zeros = vec![0u64; shape.len()];
    let cut = |d: usize, parts: u64| -> Result<u64> {
        let n = *shape.get(d).ok_or_else(|| {
            Error::layout(
                name,
                format!("has shape {shape:?}, no dimension {d} to split over tensor ranks"),
            )
        })?;
        if n % parts != 0 {
            return Err(Error::layout(
                name,
                format!(
                    "has {n} {} (dimension {d}), which --tp {tp} does not divide{}",
                    if d == 0 { "rows" } else { "columns" },
                    if parts != tp {
                        " into [gate; up] halves"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(n / parts)
    };
    let block = |d: usize, size: u64, at: u64| {
        let mut o = zeros.clone();
        o[d] = at;
        let mut s = shape.to_vec();
        s[d] = size;
        Region::new(o, s)
    };
    Ok(match split {
        Split::Replicated => (shape.to_vec(), vec![(Region::full(shape), 0)]),
        Split::Rows | Split::Fc1 if !(split == Split::Fc1 && swiglu) => {
            let h = cut(0, tp)?;
            let r = block(0, h, t * h);
            (r.sizes.to_vec(), vec![(r, 0)])
        }
        Split::Cols => {
            let h = cut(1, tp)?;
            let r = block(1, h, t * h);
            (r.sizes.to_vec(), vec![(r, 0)])
        }
        _ => {
            // SwiGLU's [gate; up]: rank t holds [gate_t; up_t]
            let h = cut(0, 2 * tp)?;
            let f = h * tp;
            let mut local = shape.to_vec();
            local[0] = 2 * h;
            (
                local,
                vec![(block(0, h, t * h), 0), (block(0, h, f + t * h), h)],
            )
        }
    })
}

/// Lay out `target` as a Megatron-LM save directory of legacy per-rank checkpoints.
pub(super) fn write(target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
    let here = Path::new(ARGS);
    let src = common(opts, "args")
        .and_then(|e| e.pickle.as_ref())
        .filter(|v| !v.is_none())
        .ok_or_else(|| {
            Error::usage(
                "a megatron-legacy output needs Megatron-LM's arguments (`args`, which a megatron \
                 or megatron-legacy source carries): they say how each tensor is split",
            )
        })?;
    let old = Config::of(here, src)?;
    let (tp, pp, ep) = (
        opts.tp.unwrap_or(old.tp),
        opts.pp.unwrap_or(old.pp),
        opts.ep.unwrap_or(old.ep),
    );
    for (flag, v) in [("--tp", tp), ("--pp", pp), ("--ep", ep)] {
        if v == 0 {
            return Err(Error::usage(format!("{flag} must be at least 1")));
        }
    }
    let ranks = tp
        .checked_mul(pp)
        .and_then(|x| x.checked_mul(ep))
        .filter(|r| *r <= reshard_core::target::MAX_WORLD)
        .ok_or_else(|| Error::usage(format!("TP {tp} × PP {pp} × EP {ep} is too many ranks")))?;
    if world != 1 && world as u64 != ranks {
        return Err(Error::usage(format!(
            "--to {world}: a megatron-legacy output is split by --tp, --pp and --ep (here TP {tp} × PP {pp} × EP {ep} = {ranks} rank file(s)); leave --to out"
        )));
    }
    let mut args = src.clone();
    for (k, v) in [
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("expert_model_parallel_size", ep),
    ] {
        set_arg(&mut args, k, Value::Int(v as i64), true);
    }
    if matches!(args.get("expert_tensor_parallel_size"), Some(Value::Int(_))) {
        set_arg(
            &mut args,
            "expert_tensor_parallel_size",
            Value::Int(tp as i64),
            false,
        );
    }
    if pp != old.pp {
        // a split of the stages the source's arguments gave no longer applies
        for k in [
            "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers",
        ] {
            set_arg(&mut args, k, Value::None, false);
        }
    }
    set_arg(&mut args, "ckpt_format", Value::Str("torch".into()), false);
    set_arg(&mut args, "world_size", Value::Int(ranks as i64), false);
    set_arg(
        &mut args,
        "data_parallel_size",
        Value::Int(ep as i64),
        false,
    );
    let cfg = Config::of(here, &args)?;
    if let Some(v) = cfg.vocab.filter(|v| v % tp != 0) {
        return Err(Error::usage(format!(
            "--tp {tp} does not divide args.padded_vocab_size {v}: each tensor rank holds an equal share of the embedding's rows"
        )));
    }
    if let Some(g) = cfg.groups.filter(|g| g % tp != 0) {
        return Err(Error::usage(format!(
            "--tp {tp} does not divide the {g} query groups (args.num_query_groups): each tensor rank holds whole groups"
        )));
    }
    let experts = cfg.experts.unwrap_or(0);
    if experts % ep != 0 {
        return Err(Error::usage(format!(
            "--ep {ep} does not divide args.num_experts {experts}"
        )));
    }
    let per = experts / ep;
    let local_spec = cfg.local_spec.unwrap_or(true);
    let first_layer: Vec<u64> = cfg
        .stage_layers
        .iter()
        .scan(0u64, |acc, n| {
            let s = *acc;
            *acc += n;
            Some(s)
        })
        .collect();
    let stage_of = |l: u64| -> (u64, u64) {
        let s = first_layer.iter().rposition(|f| *f <= l).unwrap_or(0);
        (s as u64, l - first_layer[s])
    };
    let rank = |t: u64, e: u64, s: u64| (t + tp * e + tp * ep * s) as usize;
    let mut files: Vec<RankFile> = (0..ranks).map(|_| RankFile::default()).collect();
    let mut seq = 0u64;
    let has_output_layer = target.iter().any(|t| t.name == "output_layer.weight");

    // place every region of every target tensor
    for (ti, t) in target.iter().enumerate() {
        let n = parse(&t.name);
        let bad = |msg: String| Error::layout(&t.name, msg);
        let Some(layer) = n.layer else {
            // outside the layers: the embedding on the first stage, the final norm and the
            // output layer on the last
            let stages: Vec<u64> = if t.name.starts_with("embedding.") {
                let mut v = vec![0];
                if t.name == "embedding.word_embeddings.weight"
                    && cfg.tied
                    && pp > 1
                    && !has_output_layer
                {
                    // the last stage's copy of a tied embedding, which its output layer holds
                    v.push(pp - 1);
                }
                v
            } else if t.name.starts_with("output_layer.") || t.name.starts_with("decoder.final_") {
                if cfg.tied && pp == 1 && t.name == "output_layer.weight" {
                    // tied with the embedding on one stage: not a tensor of its own
                    continue;
                }
                vec![pp - 1]
            } else if t.name.starts_with("decoder.") && pp == 1 {
                vec![0]
            } else {
                return Err(bad(
                    "is not a tensor of megatron-core's GPT model that a megatron-legacy output holds (leave it out with --exclude)".into(),
                ));
            };
            let split = if tp == 1 {
                Split::Replicated
            } else {
                split_of(&t.name).ok_or_else(|| bad(NO_SPLIT.into()))?
            };
            if let Some(want) = cfg.expected(&t.name, None, false) {
                if want != t.shape {
                    return Err(bad(format!(
                        "has the shape {:?}, but the arguments make it {want:?}",
                        t.shape
                    )));
                }
            }
            for s in stages {
                let key = if s == pp - 1 && s > 0 && t.name == "embedding.word_embeddings.weight" {
                    "output_layer.weight".to_string()
                } else {
                    t.name.clone()
                };
                let section = if key.starts_with("embedding.") {
                    0
                } else if key.starts_with("output_layer.") {
                    3
                } else {
                    2
                };
                for e in 0..ep {
                    for tr in 0..tp {
                        let (shape, regions) =
                            local_pieces(&t.name, split, &t.shape, tr, tp, cfg.swiglu)?;
                        seq += 1;
                        let row: u64 = shape[1.min(shape.len())..].iter().product();
                        let parts = regions
                            .into_iter()
                            .map(|(region, r0)| Part {
                                target: ti,
                                region,
                                offset: r0 * row,
                                strides: None,
                            })
                            .collect();
                        add(
                            &mut files[rank(tr, e, s)],
                            &t.name,
                            key.clone(),
                            (section, 0, seq),
                            t.dtype,
                            shape,
                            parts,
                        )?;
                    }
                }
            }
            continue;
        };
        // a layer's tensor, or a stack of them
        let mut axes: Vec<(Axis, u64, &str)> = vec![(layer, cfg.layers, "layer")];
        if let Some(x) = n.expert {
            if experts == 0 {
                return Err(bad(
                    "is an expert's, but the arguments have no num_experts".into()
                ));
            }
            axes.push((x, experts, "expert"));
        }
        let stacked = axes
            .iter()
            .filter(|(a, _, _)| matches!(a, Axis::Stacked))
            .count();
        let mut indices: Vec<Vec<u64>> = vec![];
        for (k, (a, count, what)) in axes.iter().enumerate() {
            let stacked_before = axes[..k]
                .iter()
                .filter(|(a, _, _)| matches!(a, Axis::Stacked))
                .count();
            match a {
                Axis::Fixed(i) if i < count => indices.push(vec![*i]),
                Axis::Fixed(i) => {
                    return Err(bad(format!(
                        "{what} {i}, but the arguments give {count} {what}s"
                    )))
                }
                Axis::Stacked => {
                    if t.shape.get(stacked_before) != Some(count) {
                        return Err(bad(format!(
                            "stacks {what}s on dimension {stacked_before} of its shape {:?}, but the arguments give {count} {what}s",
                            t.shape
                        )));
                    }
                    indices.push((0..*count).collect());
                }
            }
        }
        let inner = &t.shape[stacked..];
        let expert = n.expert.is_some();
        let rest = n.rest;
        let split = if tp == 1 {
            Split::Replicated
        } else {
            split_of(rest).ok_or_else(|| bad(NO_SPLIT.into()))?
        };
        let check_name = if expert {
            rest.to_string()
        } else {
            format!("decoder.layers.0.{rest}")
        };
        if let Some(want) = cfg.expected(&check_name, Some(rest), expert) {
            if want != inner {
                return Err(bad(format!(
                    "has the shape {inner:?} per {}, but the arguments make it {want:?}",
                    if expert { "expert" } else { "layer" }
                )));
            }
        }
        let grouped = expert && cfg.grouped_gemm;
        if grouped && !matches!(rest, "linear_fc1.weight" | "linear_fc2.weight") {
            return Err(bad(
                "is not a weight grouped-GEMM experts hold (weight1, weight2)".into(),
            ));
        }
        let local_name = local_rest(rest, local_spec);
        let ls: &[u64] = &indices[0];
        let es: &[u64] = indices.get(1).map_or(&[][..], |v| &v[..]);
        for &l in ls {
            let (s, li) = stage_of(l);
            let expert_ranks: Vec<(u64, Option<u64>)> = if expert {
                es.iter().map(|&e| (e / per, Some(e))).collect()
            } else {
                (0..ep).map(|e| (e, None)).collect()
            };
            for (er, e) in expert_ranks {
                let key = match e {
                    None => format!("decoder.layers.{li}.{local_name}"),
                    Some(e) if !grouped => {
                        format!(
                            "decoder.layers.{li}.mlp.experts.local_experts.{}.{rest}",
                            e % per
                        )
                    }
                    Some(_) if rest == "linear_fc1.weight" => {
                        format!("decoder.layers.{li}.mlp.experts.weight1")
                    }
                    Some(_) => format!("decoder.layers.{li}.mlp.experts.weight2"),
                };
                // the stacked axes' offsets
                let mut prefix = vec![];
                if matches!(layer, Axis::Stacked) {
                    prefix.push(l);
                }
                if let (Some(Axis::Stacked), Some(e)) = (n.expert, e) {
                    prefix.push(e);
                }
                for tr in 0..tp {
                    let (shape, regions) = local_pieces(&t.name, split, inner, tr, tp, cfg.swiglu)?;
                    let ones = vec![1u64; prefix.len()];
                    let lift = |r: Region| {
                        Region::new(
                            [prefix.as_slice(), &r.offsets[..]].concat(),
                            [ones.as_slice(), &r.sizes[..]].concat(),
                        )
                    };
                    seq += 1;
                    let (stored, parts): (Vec<u64>, Vec<Part>) = match e {
                        Some(e) if grouped => {
                            // GroupedMLP: local expert j's [c, H] (fc1) or [H, c] (fc2)
                            // transposed, at its place in [per, H, c] or [per, c, H]
                            let j = e % per;
                            let (c, h, stored) = if rest == "linear_fc1.weight" {
                                (shape[0], shape[1], vec![shape[1], per * shape[0]])
                            } else {
                                (shape[1], shape[0], vec![per * shape[1], shape[0]])
                            };
                            let st = if rest == "linear_fc1.weight" {
                                vec![1, c]
                            } else {
                                vec![1, h]
                            };
                            let strides: Vec<u64> = ones.iter().map(|_| c * h).chain(st).collect();
                            let parts = regions
                                .into_iter()
                                .map(|(region, r0)| Part {
                                    target: ti,
                                    region: lift(region),
                                    offset: j * c * h + r0,
                                    strides: Some(strides.clone()),
                                })
                                .collect();
                            (stored, parts)
                        }
                        _ => {
                            let row: u64 = shape[1.min(shape.len())..].iter().product();
                            let parts = regions
                                .into_iter()
                                .map(|(region, r0)| Part {
                                    target: ti,
                                    region: lift(region),
                                    offset: r0 * row,
                                    strides: None,
                                })
                                .collect();
                            (shape, parts)
                        }
                    };
                    add(
                        &mut files[rank(tr, er, s)],
                        &t.name,
                        key.clone(),
                        (1, li, seq),
                        t.dtype,
                        stored,
                        parts,
                    )?;
                }
            }
        }
    }

    // what Megatron-LM writes besides the model: args, checkpoint_version, iteration, counters
    let iteration = common(opts, "iteration")
        .and_then(|e| e.pickle.as_ref())
        .and_then(Value::as_int)
        .filter(|i| *i >= 0);
    let folder = iteration.map_or(RELEASE.to_string(), |n| iteration_folder(n as u64));
    let args_value = from_pickle(&args).ok_or_else(|| {
        Error::usage(
            "the source's args hold a value reshard cannot write again (it re-emits argparse.Namespace, megatron-core's enums and plain values)",
        )
    })?;
    let mut head = vec![
        (PyValue::Str("args".into()), args_value),
        (
            PyValue::Str("checkpoint_version".into()),
            common(opts, "checkpoint_version")
                .map(crate::torch::pickle::extra_value)
                .unwrap_or(PyValue::Float(3.0)),
        ),
    ];
    if let Some(n) = iteration {
        head.push((PyValue::Str("iteration".into()), PyValue::Int(n)));
    }
    let rest: Vec<&Extra> = opts
        .extras
        .iter()
        .filter(|e| e.origin == COMMON_ORIGIN)
        .filter(|e| {
            let top = match opts.paths.get(&e.name).and_then(|p| p.first()) {
                Some(crate::KeyPart::Key(k)) => k.as_str(),
                _ => e.name.split('.').next().unwrap_or(&e.name),
            };
            !NOT_CARRIED.contains(&top)
        })
        .collect();
    let tail = crate::pt::nested_values(&rest, &opts.paths)?;

    let mut out_files = vec![];
    let mut pieces: Vec<Vec<Piece>> = vec![vec![]; target.len()];
    for (r, f) in files.into_iter().enumerate() {
        let r64 = r as u64;
        let (t, e, s) = (r64 % tp, (r64 / tp) % ep, r64 / (tp * ep));
        let mut entries = f.entries;
        extra_states(&mut entries, s == pp - 1);
        entries.sort_by_key(|x| x.order);
        let mut model = vec![];
        let mut storages: Vec<(String, u64)> = vec![];
        let mut stored: Vec<&Local> = vec![];
        for x in &entries {
            let v = match &x.tensor {
                None => PyValue::None,
                Some(l) => {
                    let covered: u64 = l.pieces.iter().map(|p| p.region.volume()).sum();
                    let volume: u64 = l.shape.iter().product();
                    if covered != volume {
                        let name = &target[l.pieces[0].target].name;
                        return Err(Error::layout(
                            name,
                            format!(
                                "the output's `{}` would be left partly unwritten: the target covers {covered} of its {volume} elements",
                                x.key
                            ),
                        ));
                    }
                    let k = storages.len().to_string();
                    storages.push((k.clone(), volume * l.dtype.size() as u64));
                    stored.push(l);
                    PyValue::Tensor(TensorRef::new(k, l.dtype, l.shape.clone()))
                }
            };
            model.push((PyValue::Str(x.key.clone()), v));
        }
        let mut top = head.clone();
        top.push((PyValue::Str("model".into()), PyValue::Dict(model)));
        top.extend(tail.iter().cloned());
        let records = standard_records(pickle(&PyValue::Dict(top)), &storages);
        let layout = layout_archive("model_optim_rng", &records);
        let (literals, checksums) = output_parts(&layout, &records, 0);
        for (k, l) in stored.iter().enumerate() {
            let name = format!("data/{k}");
            let at = records
                .iter()
                .position(|x| x.name == name)
                .map(|i| layout.data_offsets[i])
                .ok_or_else(|| Error::internal(format!("no record {name}")))?;
            let elem = l.dtype.size() as u64;
            for p in &l.pieces {
                pieces[p.target].push(Piece {
                    rank: r as u32,
                    region: p.region.clone(),
                    loc: Loc {
                        file: r as u32,
                        offset: at + p.offset * elem,
                        strides: p.strides.clone(),
                        pending: None,
                    },
                });
            }
        }
        let path = PathBuf::from(&folder)
            .join(rank_folder(t, (pp > 1).then_some(s), (ep > 1).then_some(e)))
            .join(RANK_FILE);
        out_files.push(OutputFile {
            path,
            size: layout.len,
            literals,
            checksums,
        });
    }
    let tracker = iteration.map_or(RELEASE.to_string(), |n| n.to_string());
    out_files.push(crate::dcp::write::literal_file(
        TRACKER,
        tracker.into_bytes(),
    ));
    let tensors = target
        .iter()
        .zip(pieces)
        .filter(|(_, p)| !p.is_empty())
        .map(|(t, pieces)| TensorLayout {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces,
        })
        .collect();
    Ok(Output {
        files: out_files,
        tensors,
        copies: vec![],
    })
}

/// Add `parts` of target `name` to the local tensor `key` of rank file `f` (made on first
/// use; GroupedMLP's `weight1`/`weight2` gather a layer's local experts).
fn add(
    f: &mut RankFile,
    name: &str,
    key: String,
    order: (u8, u64, u64),
    dtype: DType,
    shape: Vec<u64>,
    parts: Vec<Part>,
) -> Result<()> {
    match f.index.get(&key) {
        Some(&i) => {
            let l = f.entries[i]
                .tensor
                .as_mut()
                .ok_or_else(|| Error::internal("a tensor entry without a tensor"))?;
            if l.dtype != dtype || l.shape != shape {
                return Err(Error::layout(
                    name,
                    format!(
                        "goes into the output's `{key}` as {dtype} {shape:?}, where another tensor put {} {:?}",
                        l.dtype, l.shape
                    ),
                ));
            }
            l.pieces.extend(parts);
        }
        None => {
            f.index.insert(key.clone(), f.entries.len());
            f.entries.push(Entry {
                key,
                order,
                tensor: Some(Local {
                    dtype,
                    shape,
                    pieces: parts,
                }),
            });
        }
    }
    Ok(())
}

/// The linear layers' `_extra_state` entries (the value `None`, as megatron-core's local
/// linear layers save it and TransformerEngine's accept it), each after its layer's
/// parameters; on the last stage `output_layer._extra_state` also when a tied output layer has
/// no weight of its own.
fn extra_states(entries: &mut Vec<Entry>, last_stage: bool) {
    let linear = |m: &str| {
        m == "output_layer"
            || [".linear_qkv", ".linear_proj", ".linear_fc1", ".linear_fc2"]
                .iter()
                .any(|s| m.ends_with(s))
    };
    // module → the order of its last parameter
    let mut modules: Vec<(String, (u8, u64, u64))> = vec![];
    for x in entries.iter() {
        let Some(m) = x
            .key
            .strip_suffix(".weight")
            .or_else(|| x.key.strip_suffix(".bias"))
        else {
            continue;
        };
        if !linear(m) {
            continue;
        }
        match modules.iter_mut().find(|(n, _)| n == m) {
            Some((_, o)) => *o = (*o).max(x.order),
            None => modules.push((m.to_string(), x.order)),
        }
    }
    if last_stage && !modules.iter().any(|(m, _)| m == "output_layer") {
        modules.push(("output_layer".into(), (3, 0, 0)));
    }
    for (m, (a, b, c)) in modules {
        // tensors' sequence numbers are distinct; an extra state sorts right after
        entries.push(Entry {
            key: format!("{m}._extra_state"),
            order: (a, b, c),
            tensor: None,
        });
    }
    // a stable sort keeps each extra state after the parameter of the same order
}
