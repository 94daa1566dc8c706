//! The distributed optimizer's state of a legacy checkpoint (`--use-distributed-optimizer`):
//! each rank folder's `distrib_optim.pt`, read as megatron-core's `fully_reshardable`
//! `torch_dist` tensors (`docs/megatron-format.md`, "The distributed optimizer's state").
//!
//! `distrib_optim.pt` is `DistributedOptimizer.save_parameter_state`, written by data-parallel
//! rank 0 of each tensor/pipeline rank: `get_parameter_state_dp_zero`, the shards of every
//! data-parallel rank gathered into one flat fp32 tensor per state key and gradient buffer,
//!
//! ```text
//! {"buckets_coalesced": True,
//!  0: {(param_dtype, grad_dtype): {"param": [N], "exp_avg": [N], "exp_avg_sq": [N],
//!                                  "numel_unpadded": N}}}
//! ```
//!
//! (a list of such dicts when several optimizers are chained). The flat tensor is the
//! gradient buffer (`_ParamAndGradBuffer`) less each bucket's end padding: the parameters in
//! reverse order of `named_parameters()`, each starting at a multiple of 64 elements. Which
//! parameter lies where is not recorded: it follows from the model's parameters (the rank
//! file's `model` state dict, whose tensor order is the parameters') and the bucket rule the
//! saved arguments give. Each parameter's state is then a stretch of the flat record, a
//! contiguous tensor of the parameter's local shape, placed in the global tensor as the
//! parameter is: nothing is materialised. GroupedMLP's `weight1` / `weight2`
//! (`moe_grouped_gemm`) hold their state as they hold their weights, and are read per expert
//! as the weights are (strided views of the stretch, under SequentialMLP's names).

use super::{
    global_shape, grouped_experts, pieces, place, split_of_known, Config, RankFile, Split,
};
use crate::error::{Error, IoContext, Result};
use crate::layout::DType;
use crate::layout::{Loc, Piece, Region, TensorLayout};
use crate::torch::pickle::Value;
use crate::torch::save;
use crate::torch::short;
use crate::RecordCrc;
use std::path::{Path, PathBuf};

/// The distributed optimizer's file in each rank folder.
pub const DISTRIB_OPTIM: &str = "distrib_optim.pt";

/// The prefix of the optimizer state's names in megatron-core's `fully_reshardable` format:
/// `optimizer.state.<key>.<the parameter's torch_dist name>`.
pub const STATE_PREFIX: &str = "optimizer.state.";

/// The `param_state_sharding_type` megatron-core records for the format these names are.
pub const SHARDING_TYPE: &str = "fully_reshardable";

/// Alignment of each parameter's start in a gradient buffer (elements).
const PARAM_ALIGN: u64 = 64;

/// One flat state tensor of a `distrib_optim.pt`: its key (`param`, `exp_avg`, …), where its
/// element 0 lies in the file, its dtype and length.
struct Flat {
    key: String,
    offset: u64,
    dtype: DType,
    numel: u64,
}

/// The optimizer's state read from the rank folders: tensors, the files their pieces point
/// into (after the rank files), and the CRCs of the records they read.
pub(super) struct OptimState {
    /// The global state tensors.
    pub tensors: Vec<TensorLayout>,
    /// The `distrib_optim.pt` files, in rank order; a piece's file index is the rank files'
    /// count plus its index here.
    pub files: Vec<PathBuf>,
    /// The recorded CRCs of the records read (file indices as above).
    pub checksums: Vec<RecordCrc>,
}

/// Whether the distributed optimizer's state is read: the arguments say it was used, and
/// rank 0's folder holds its file (absent with `--no-save-optim`). GroupedMLP's experts
/// (`moe_grouped_gemm`) included: the state of a layer's `weight1` / `weight2` is read per
/// expert, as their weights are. Refused: the file missing where rank 0's
/// `model_optim_rng.pt` holds the optimizer's `state_dict()` (saved with the optimizer, so
/// the parameter state was saved beside it).
pub(super) fn present(files: &[RankFile]) -> Result<bool> {
    let r0 = &files[0];
    if !super::bool_arg(&r0.args, "use_distributed_optimizer") {
        return Ok(false);
    }
    let path = r0.path.with_file_name(DISTRIB_OPTIM);
    if path.is_file() {
        return Ok(true);
    }
    let saved = r0
        .ck
        .extras
        .iter()
        .any(|x| x.name == "optimizer" || x.name.starts_with("optimizer."));
    if saved {
        return Err(Error::format(
            &path,
            "is missing: the arguments say the distributed optimizer was used and \
             model_optim_rng.pt holds its state_dict, so its parameter state belongs here",
        ));
    }
    Ok(false)
}

/// Whether the local state-dict key `key` is an expert's parameter: in the expert
/// optimizer's gradient buffer (the second chained optimizer), not the dense one's.
fn is_expert(key: &str) -> bool {
    key.contains(".mlp.experts.")
}

/// The state of every rank's `distrib_optim.pt` as global tensors (see the module's doc).
///
/// With experts split over expert ranks (EP > 1), megatron-core chains two optimizers, each with a gradient buffer of its own:
/// the dense parameters' (data-parallel over every rank of a tensor/pipeline rank) and the
/// experts' (over the expert-data-parallel group). Each folder's file is a list of both
/// optimizers' gathered states; an optimizer whose data-parallel rank 0 is elsewhere is
/// `None`: the dense state is in expert rank 0's folder only, each expert rank's experts in
/// its own.
pub(super) fn read(cfg: &Config, files: &[RankFile]) -> Result<OptimState> {
    let world = files.len() as u32;
    let bucket = bucket_size(&files[0])?;
    let mut out: Vec<TensorLayout> = vec![];
    let mut at: std::collections::HashMap<String, usize> = Default::default();
    let mut paths = vec![];
    let mut checksums = vec![];
    // (megatron-core marks the experts' parameters as its own only when they are split over
    // expert ranks: at EP 1 they are dense parameters, in the one buffer and optimizer)
    let chained = if cfg.experts.is_some() && cfg.ep > 1 {
        2
    } else {
        1
    };
    for (r, f) in files.iter().enumerate() {
        let path = f.path.with_file_name(DISTRIB_OPTIM);
        if !path.is_file() {
            return Err(Error::format(
                &path,
                format!(
                    "is missing: {} has the distributed optimizer's state, so every rank folder must",
                    files[0].path.with_file_name(DISTRIB_OPTIM).display()
                ),
            ));
        }
        let file = world + r as u32;
        let (states, crcs) = read_flat(&path, file)?;
        if states.len() != chained {
            return Err(Error::format(
                &path,
                if chained == 2 {
                    format!(
                        "holds the state of {} chained optimizer(s), not the 2 of a model with expert parallelism (the dense parameters', the experts')",
                        states.len()
                    )
                } else {
                    format!(
                        "holds the state of {} chained optimizers; a model without expert parallelism has one",
                        states.len()
                    )
                },
            ));
        }
        checksums.extend(crcs);
        paths.push(path.clone());
        let r = r as u64;
        let (t, e, s) = (r % cfg.tp, (r / cfg.tp) % cfg.ep, r / (cfg.tp * cfg.ep));
        // the model's parameters, in named_parameters() order
        let model = f.model()?;
        let params: Vec<(&str, &TensorLayout)> =
            model.into_iter().filter(|(k, _)| !is_buffer(k)).collect();
        let shared = |k: &str| {
            cfg.tied
                && cfg.pp > 1
                && ((s == 0 && k == "embedding.word_embeddings.weight")
                    || (s == cfg.pp - 1 && k == "output_layer.weight"))
        };
        for (o, state) in states.iter().enumerate() {
            let expert = o == 1;
            if !expert && e > 0 {
                // the dense parameters' state: in expert rank 0's folder
                continue;
            }
            let Some(state) = state else {
                return Err(Error::format(
                    &path,
                    format!(
                        "holds no state (None) for the {} parameters' optimizer",
                        if expert { "expert" } else { "dense" }
                    ),
                ));
            };
            let mine: Vec<&(&str, &TensorLayout)> = params
                .iter()
                .filter(|(k, _)| chained == 1 || is_expert(k) == expert)
                .collect();
            let sizes: Vec<(u64, bool)> = mine
                .iter()
                .map(|(k, l)| (l.shape.iter().product::<u64>(), shared(k)))
                .collect();
            let (starts, total) = buffer_starts(&sizes, bucket);
            if total != state.numel {
                let what = match (chained, expert) {
                    (1, _) => "",
                    (_, true) => "expert ",
                    _ => "dense ",
                };
                return Err(Error::format(
                    &path,
                    format!(
                        "holds {} elements per state, but the {} {what}parameters of {} make a buffer of {total} (another model, or data-parallel ranks missing)",
                        state.numel,
                        mine.len(),
                        f.path.display()
                    ),
                ));
            }
            for ((key, local), start) in mine.iter().zip(starts) {
                for fl in &state.flats {
                    let elem = fl.dtype.size() as u64;
                    // the parameter's stretch of the flat record, a contiguous tensor of its
                    // local shape
                    let stretch = TensorLayout {
                        name: key.to_string(),
                        dtype: fl.dtype,
                        shape: local.shape.clone(),
                        pieces: vec![Piece {
                            rank: r as u32,
                            region: Region::full(&local.shape),
                            loc: Loc {
                                file,
                                offset: fl.offset + start * elem,
                                strides: None,
                                pending: None,
                            },
                        }],
                    };
                    // GroupedMLP's weight1 / weight2 hold their state as they hold the
                    // weights: each local expert's a strided view of it, as the weights are read
                    for (key, stretch) in grouped_experts(cfg, vec![(key, &stretch)], &f.path)? {
                        let Some(p) = place(cfg, &key, s, e, &f.path)? else {
                            // the last stage's copy of a tied embedding: megatron-core keeps
                            // the first stage's state only
                            continue;
                        };
                        let split = if cfg.tp == 1 {
                            Split::Replicated
                        } else {
                            split_of_known(&p).unwrap_or(Split::Replicated)
                        };
                        if split == Split::Replicated && t > 0 {
                            continue;
                        }
                        let Some(global) = global_shape(split, &stretch.shape, cfg.tp) else {
                            continue;
                        };
                        let name = format!("{STATE_PREFIX}{}.{}", fl.key, p.name);
                        let idx = *at.entry(name.clone()).or_insert_with(|| {
                            out.push(TensorLayout {
                                name,
                                dtype: fl.dtype,
                                shape: global.clone(),
                                pieces: vec![],
                            });
                            out.len() - 1
                        });
                        let mut ps = pieces(split, &stretch, t, cfg.tp, r as u32, cfg.swiglu);
                        for piece in &mut ps {
                            piece.loc.file = file;
                        }
                        out[idx].pieces.extend(ps);
                    }
                }
            }
        }
    }
    for g in &out {
        let covered: u64 = g.pieces.iter().map(|p| p.region.volume()).sum();
        let volume: u64 = g.shape.iter().product();
        if covered != volume {
            return Err(Error::layout(
                &g.name,
                format!("the distrib_optim.pt files cover {covered} of its {volume} elements"),
            ));
        }
    }
    Ok(OptimState {
        tensors: out,
        files: paths,
        checksums,
    })
}

/// True for the state-dict entries of a megatron-core GPT model that are not parameters
/// (and so have no place in the gradient buffer): TransformerEngine's `_extra_state`, the
/// router's buffers.
fn is_buffer(key: &str) -> bool {
    key.ends_with("_extra_state")
        || key.ends_with(".expert_bias")
        || key.ends_with(".local_tokens_per_expert")
}

/// The bucket size of the gradient buffers, as megatron-core's DistributedDataParallel sets
/// it from Megatron-LM's arguments: none (one bucket) without `overlap_grad_reduce`, else
/// `ddp_bucket_size`, by default `max(40000000, 1000000 × data-parallel size)`.
fn bucket_size(r0: &RankFile) -> Result<Option<u64>> {
    let args = &r0.args;
    for n in ["use_custom_fsdp", "use_megatron_fsdp", "use_torch_fsdp2"] {
        if super::bool_arg(args, n) {
            return Err(Error::format(
                &r0.path,
                format!("sets args.{n}: reshard reads the distributed optimizer's state of Megatron-LM's own DDP"),
            ));
        }
    }
    if !super::bool_arg(args, "overlap_grad_reduce") {
        return Ok(None);
    }
    let int = |n: &str| super::int_arg(&r0.path, args, n);
    if let Some(b) = int("ddp_bucket_size")? {
        return Ok(Some(b));
    }
    let dp = int("data_parallel_size")?.unwrap_or(1) * int("context_parallel_size")?.unwrap_or(1);
    Ok(Some((1_000_000 * dp).max(40_000_000)))
}

/// Where each parameter (element count, whether it is a tied embedding's copy on a pipeline
/// end, which gets a bucket of its own) starts in the flat state of its buffer, and the
/// flat state's length: `_ParamAndGradBuffer`'s walk over the parameters in reverse order,
/// each start padded to [`PARAM_ALIGN`], a bucket closed once it holds `bucket` elements,
/// less each bucket's end padding (which `get_parameter_state_dp_zero` drops).
fn buffer_starts(params: &[(u64, bool)], bucket: Option<u64>) -> (Vec<u64>, u64) {
    let mut starts = vec![0; params.len()];
    // the flat length of the buckets closed so far, the position in the open bucket
    let (mut base, mut pos, mut open) = (0u64, 0u64, 0usize);
    for (i, &(numel, shared)) in params.iter().enumerate().rev() {
        pos = pos.div_ceil(PARAM_ALIGN) * PARAM_ALIGN;
        if shared && open > 0 {
            base += pos;
            pos = 0;
            open = 0;
        }
        starts[i] = base + pos;
        let end = pos + numel;
        open += 1;
        if bucket.is_some_and(|b| end >= b) || shared {
            base += end;
            pos = 0;
            open = 0;
        } else {
            pos = end;
        }
    }
    if open > 0 {
        base += pos;
    }
    (starts, base)
}

/// The flat state tensors of one gradient buffer: their keys and records, their length
/// (`numel_unpadded`).
struct FlatState {
    flats: Vec<Flat>,
    numel: u64,
}

/// The flat state of each chained optimizer in one `distrib_optim.pt` (file index `file`;
/// `None` where the file has `None`: an optimizer whose data-parallel rank 0 saved it
/// elsewhere), and the CRCs of their records. Refused, naming the file: another layout than
/// `buckets_coalesced`, several gradient buffers in one optimizer, a state that is not a
/// flat tensor of `numel_unpadded` elements.
fn read_flat(path: &Path, file: u32) -> Result<(Vec<Option<FlatState>>, Vec<RecordCrc>)> {
    let f = std::fs::File::open(path).at(path)?;
    let map = crate::sys::map_file(&f, path)?;
    let bytes: &[u8] = &map;
    let item = save::parse_with(bytes, super::globals())
        .map_err(|e| Error::format(path, e.to_string()))?;
    let bad = |msg: String| Error::format(path, msg);
    // ChainedOptimizer.save_parameter_state with several optimizers: a list
    let tops: Vec<&Value> = match &item.value {
        Value::List(opts) => opts.iter().collect(),
        one => vec![one],
    };
    let mut crcs = vec![];
    let mut out = vec![];
    for (o, top) in tops.into_iter().enumerate() {
        if matches!(top, Value::None) {
            out.push(None);
            continue;
        }
        let which = if o > 0 {
            format!("optimizer {o}'s ")
        } else {
            String::new()
        };
        let Some(pairs) = top.as_dict() else {
            return Err(bad(format!(
                "holds a pickled {}, not DistributedOptimizer.save_parameter_state's dict",
                top.kind()
            )));
        };
        if top.get("buckets_coalesced").and_then(Value::as_bool) != Some(true) {
            return Err(bad(
                format!("is not in the buckets_coalesced layout (megatron-core's get_parameter_state_dp_zero{}); older per-bucket layouts are not read", if o > 0 { format!(", optimizer {o}") } else { String::new() }),
            ));
        }
        let buffers: Vec<&(Value, Value)> = pairs
            .iter()
            .filter(|(k, _)| k.as_str() != Some("buckets_coalesced"))
            .collect();
        let dtypes = match buffers.as_slice() {
            [(Value::Int(0), v)] => v.as_dict().unwrap_or(&[]),
            [] => return Err(bad(format!("holds no gradient buffer's state ({which}dict)"))),
            _ => {
                return Err(bad(format!(
                    "holds the state of {} gradient buffers (parameters of several dtypes); reshard reads one",
                    buffers.len()
                )))
            }
        };
        let [(_, state)] = dtypes else {
            return Err(bad(format!(
                "{which}buffer 0 holds {} dtype entries, not one",
                dtypes.len()
            )));
        };
        let Some(state) = state.as_dict() else {
            return Err(bad(format!("{which}buffer 0's state is not a dict")));
        };
        let numel = state
            .iter()
            .find(|(k, _)| k.as_str() == Some("numel_unpadded"))
            .and_then(|(_, v)| v.as_int())
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| bad(format!("{which}buffer 0 has no numel_unpadded")))?;
        let mut flats = vec![];
        for (k, v) in state {
            let Some(key) = k.as_str() else {
                return Err(bad(format!("{which}buffer 0 has a {} key", k.kind())));
            };
            if key == "numel_unpadded" {
                continue;
            }
            let t = save::tensor_of(v, &item.archive, bytes)
                .map_err(|e| bad(format!("{which}`{}`: {e}", short(key))))?
                .ok_or_else(|| {
                    bad(format!(
                        "{which}`{}` is a {}, not a tensor",
                        short(key),
                        v.kind()
                    ))
                })?;
            if t.shape != [numel] || !t.is_row_major() {
                return Err(bad(format!(
                    "{which}`{}` has the shape {:?}, not the flat [{numel}] of numel_unpadded",
                    short(key),
                    t.shape
                )));
            }
            let rec = format!("{}/data/{}", item.archive.prefix, t.storage_key);
            if let Some(entry) = item.archive.entry(&rec) {
                crcs.push(RecordCrc {
                    file,
                    offset: t.record.offset,
                    len: t.record.len,
                    crc: entry.crc,
                    what: format!("optimizer state `{}` (record {rec})", short(key)).into(),
                    shown: None,
                });
            }
            flats.push(Flat {
                key: key.to_string(),
                offset: t.data_offset(),
                dtype: t.dtype,
                numel,
            });
        }
        if flats.is_empty() {
            return Err(bad(format!("{which}buffer 0 holds no state tensors")));
        }
        debug_assert!(flats.iter().all(|f| f.numel == numel));
        out.push(Some(FlatState { flats, numel }));
    }
    Ok((out, crcs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_follow_the_buffer_walk() {
        // reverse order, 64-aligned starts, one bucket
        let (s, n) = buffer_starts(&[(10, false), (100, false), (3, false)], None);
        assert_eq!((s, n), (vec![192, 64, 0], 202));
        // a bucket closes at 100 elements: its end padding is dropped
        let (s, n) = buffer_starts(&[(10, false), (100, false), (3, false)], Some(100));
        assert_eq!((s, n), (vec![164, 64, 0], 174));
        // a tied embedding's copy gets a bucket of its own
        // (the bucket before it ends at its padded start)
        let (s, n) = buffer_starts(&[(5, true), (7, false)], None);
        assert_eq!((s, n), (vec![64, 0], 69));
    }
}
