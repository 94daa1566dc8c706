//! Megatron-LM's own checkpoint layouts (`megatron/training/checkpointing.py`;
//! `docs/megatron-format.md`, last section):
//!
//! - **save directories**: `latest_checkpointed_iteration.txt` (an iteration number, or
//!   `release`) beside one folder per save, `iter_{N:07}` (or `release`), each holding
//!   either format Megatron-LM writes — a `torch_dist` folder ([`crate::megatron`]) or the
//!   per-rank files below. [`tracked`] and [`step_folder`] say which folder opening one reads;
//! - **legacy per-rank checkpoints** (`--ckpt-format torch`): an iteration folder of
//!   `mp_rank_TT/model_optim_rng.pt` (no pipeline parallelism), `mp_rank_TT_PPP/…` (with it),
//!   and `…_EEE` after either with expert parallelism, each a `torch.save` of that rank's
//!   `{args, checkpoint_version, iteration, model, optimizer, opt_param_scheduler, rng_state,
//!   …}`, where `model` is the rank's module state dict: its local tensor- and
//!   pipeline-parallel shards, named by local layer index, and no global metadata. This codec
//!   presents it as global tensors under megatron-core's `torch_dist` names (global layer
//!   index, TransformerEngine's fused-norm names), each piece a stretch of one rank file's
//!   storage record: nothing is materialised. How each name is split is the table
//!   [`SPLITS`]; the saved arguments (`args`, an `argparse.Namespace`) give the parallel
//!   sizes, the pipeline split and the shapes each local tensor is checked against.
//!
//! The distributed optimizer's state (`--use-distributed-optimizer`: each rank folder's
//! `distrib_optim.pt`) is read as megatron-core's `fully_reshardable` `torch_dist` tensors
//! (`optimizer.state.<key>.<parameter>`, the `distopt` module); other optimizers' state and
//! the RNG states are each rank's own and are not read. `args`, `iteration`,
//! `checkpoint_version`, `opt_param_scheduler` and the other plain entries of rank 0's file
//! (with the distributed optimizer's state, its `optimizer` param_groups too) are non-tensor
//! entries of origin `common.pt`, so a `torch_dist` output carries them in its `common.pt`. GroupedMLP's experts
//! (`args.moe_grouped_gemm`: a layer's `mlp.experts.weight1` / `weight2`) are read as
//! SequentialMLP's, each expert's projection a strided (transposed) view of its stretch of
//! the record (their distributed optimizer's state alike). Not read: virtual pipeline stages (`model0`, `model1`, …), Megatron-LM's
//! pre-megatron-core models (`language_model.*`), TransformerEngine's `_extra_state` (FP8
//! scaling state, which has no split rule).
//!
//! The writer (`write.rs`) lays global tensors out the other way, at the tensor-, pipeline-
//! and expert-parallel sizes asked for: a save directory of per-rank files that Megatron-LM's
//! `load_checkpoint` loads into a GPTModel of that split.

use crate::error::{Error, IoContext, Result};
use crate::layout::{Loc, Piece, Region, TensorLayout};
use crate::torch::pickle::Value;
use crate::torch::short;
use crate::{
    Aliasing, Capabilities, Checkpoint, Codec, Container, Extra, Family, Format, KeyPart, Output,
    Probe, Recognition, RecordCrc, TargetTensor, WriteOptions,
};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

mod distopt;
mod write;

pub use distopt::DISTRIB_OPTIM;

/// Megatron-LM's tracker file in a save directory: the iteration (or `release`) saved last.
pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
/// The file of each rank in a legacy checkpoint.
pub const RANK_FILE: &str = "model_optim_rng.pt";
/// The folder of a release checkpoint, which a tracker file holding `release` names.
pub const RELEASE: &str = "release";
/// Largest tracker file read.
const MAX_TRACKER: u64 = 4096;

/// The folder Megatron-LM saves iteration `n` in: `iter_{n:07}` (`get_checkpoint_name`).
pub fn iteration_folder(n: u64) -> String {
    format!("iter_{n:07}")
}

/// True when `dir` is a Megatron-LM save directory: it holds the tracker file or an
/// iteration folder.
pub fn is_save_dir(dir: &Path) -> bool {
    dir.join(TRACKER).is_file()
        || std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.take(10_000).flatten().any(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with("iter_") && crate::step_of(n).is_some())
                    && e.path().is_dir()
            })
        })
}

/// The folder the tracker file of the save directory `dir` names (`iter_{N:07}`, or
/// `release`); `None` when `dir` has no tracker file. Refused, naming the file: a tracker
/// that holds neither an iteration number nor `release`, and one naming a folder that is not
/// there.
pub fn tracked(dir: &Path) -> Result<Option<PathBuf>> {
    let tracker = dir.join(TRACKER);
    if !tracker.is_file() {
        return Ok(None);
    }
    let len = std::fs::metadata(&tracker).at(&tracker)?.len();
    if len > MAX_TRACKER {
        return Err(Error::format(
            &tracker,
            format!("is {len} bytes, too large for Megatron-LM's tracker file"),
        ));
    }
    let bytes = std::fs::read(&tracker).at(&tracker)?;
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim();
    let (folder, what) = if text == RELEASE {
        (RELEASE.to_string(), "the release checkpoint".to_string())
    } else {
        match text.parse::<u64>() {
            Ok(n) => (iteration_folder(n), format!("iteration {n}")),
            Err(_) => {
                return Err(Error::format(
                    &tracker,
                    format!(
                        "holds `{}`, not an iteration number or `release` (Megatron-LM's tracker \
                         of the iteration saved last)",
                        short(text)
                    ),
                ))
            }
        }
    };
    let p = dir.join(&folder);
    if !p.is_dir() {
        return Err(Error::format(
            &tracker,
            format!("names {what}, but {} is not a folder", p.display()),
        ));
    }
    Ok(Some(p))
}

/// The folder of step `step` in `dir`: torchtitan's `step-N`, else Megatron-LM's
/// `iter_{N:07}`. Refused when neither is a folder (naming the iteration folder in a
/// Megatron-LM save directory, the step folder elsewhere).
pub fn step_folder(dir: &Path, step: u64) -> Result<PathBuf> {
    let titan = dir.join(format!("step-{step}"));
    if titan.is_dir() {
        return Ok(titan);
    }
    let iter = dir.join(iteration_folder(step));
    if iter.is_dir() {
        return Ok(iter);
    }
    if is_save_dir(dir) {
        return Err(Error::format(
            dir,
            format!(
                "has no iteration {step} ({} is not a folder)",
                iter.display()
            ),
        ));
    }
    Err(Error::format(
        dir,
        format!(
            "has no checkpoint tagged `step-{step}` ({} is not a folder)",
            titan.display()
        ),
    ))
}

/// Megatron-LM's legacy per-rank checkpoints (`--ckpt-format torch`), read as global tensors.
pub struct MegatronLegacy;

static CAPS: Capabilities = Capabilities {
    name: "megatron-legacy",
    aliases: &["megatron-torch"],
    summary:
        "Megatron-LM per-rank checkpoints (--ckpt-format torch: mp_rank_*/model_optim_rng.pt), \
              read as global tensors, written at --tp/--pp/--ep",
    noun: "a Megatron-LM legacy checkpoint (mp_rank_* folders)",
    container: Container::Directory,
    extensions: &[],
    // the split is --tp, --pp and --ep (M, when given, must be their product)
    max_world: None,
    family: Family::Torch,
    extras_kept: "in every rank file (args, iteration, counters)",
    keeps_opaque: false,
    aliasing: Aliasing::StoresOnce,
    written: true,
};

/// The rank folder's name for tensor rank `tp`, pipeline rank `pp` and expert rank `ep`
/// (`get_checkpoint_name`: `mp_rank_TT`, `_PPP` with pipeline parallelism, `_EEE` with
/// expert parallelism).
pub fn rank_folder(tp: u64, pp: Option<u64>, ep: Option<u64>) -> String {
    let mut s = format!("mp_rank_{tp:02}");
    if let Some(p) = pp {
        s.push_str(&format!("_{p:03}"));
    }
    if let Some(e) = ep {
        s.push_str(&format!("_{e:03}"));
    }
    s
}

/// True for a rank folder's name: `mp_rank_` and two digits, then up to two `_` and three
/// digits.
fn is_rank_folder(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("mp_rank_") else {
        return false;
    };
    let digits = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit());
    let mut parts = rest.split('_');
    let Some(tp) = parts.next() else {
        return false;
    };
    let more: Vec<&str> = parts.collect();
    digits(tp, 2) && more.len() <= 2 && more.iter().all(|p| digits(p, 3))
}

impl Codec for MegatronLegacy {
    fn capabilities(&self) -> &'static Capabilities {
        &CAPS
    }
    fn recognize(&self, probe: &Probe) -> Recognition {
        Recognition::marker_if(!probe.is_file && probe.dirs.iter().any(|d| is_rank_folder(d)))
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(path)
    }
    fn write(&self, target: &[TargetTensor], world: u32, opts: &WriteOptions) -> Result<Output> {
        write::write(target, world, opts)
    }
}

/// How a tensor is split over the tensor-parallel ranks of a legacy checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// The same on every rank: read from tensor rank 0.
    Replicated,
    /// Column-parallel (and vocabulary-parallel): rank r holds rows `r·n/T ..` of the global
    /// tensor (`Shard(0)`).
    Rows,
    /// Row-parallel: rank r holds columns `r·n/T ..` (`Shard(1)`).
    Cols,
    /// The first MLP projection: [`Split::Rows`], except with SwiGLU (`args.swiglu`), where
    /// the global tensor is `[gate; up]` and rank r holds `[gate_r; up_r]` — two pieces, rows
    /// `r·F/T ..` of the gate and `F + r·F/T ..` of the up projection.
    Fc1,
}

/// The split of each tensor of a megatron-core GPT model, by its `torch_dist` name: the whole
/// name for tensors outside the layers, else the name after `decoder.layers.{i}.` (and for
/// experts after `mlp.experts.local_experts.{e}.`). Column-parallel linears (`linear_qkv`,
/// `linear_fc1`, the vocabulary-parallel embedding and output layer) split their rows,
/// row-parallel ones (`linear_proj`, `linear_fc2`) their columns; their biases are split with
/// the rows of a column-parallel layer and replicated for a row-parallel one; norms and the
/// router are replicated. A name outside this table is read only without tensor
/// parallelism.
pub const SPLITS: &[(&str, Split)] = &[
    ("embedding.word_embeddings.weight", Split::Rows),
    ("embedding.position_embeddings.weight", Split::Replicated),
    ("output_layer.weight", Split::Rows),
    ("output_layer.bias", Split::Rows),
    ("decoder.final_layernorm.weight", Split::Replicated),
    ("decoder.final_layernorm.bias", Split::Replicated),
    ("self_attention.linear_qkv.weight", Split::Rows),
    ("self_attention.linear_qkv.bias", Split::Rows),
    (
        "self_attention.linear_qkv.layer_norm_weight",
        Split::Replicated,
    ),
    (
        "self_attention.linear_qkv.layer_norm_bias",
        Split::Replicated,
    ),
    ("self_attention.q_layernorm.weight", Split::Replicated),
    ("self_attention.q_layernorm.bias", Split::Replicated),
    ("self_attention.k_layernorm.weight", Split::Replicated),
    ("self_attention.k_layernorm.bias", Split::Replicated),
    ("self_attention.linear_proj.weight", Split::Cols),
    ("self_attention.linear_proj.bias", Split::Replicated),
    ("pre_mlp_layernorm.weight", Split::Replicated),
    ("pre_mlp_layernorm.bias", Split::Replicated),
    ("mlp.linear_fc1.weight", Split::Fc1),
    ("mlp.linear_fc1.bias", Split::Fc1),
    ("mlp.linear_fc1.layer_norm_weight", Split::Replicated),
    ("mlp.linear_fc1.layer_norm_bias", Split::Replicated),
    ("mlp.linear_fc2.weight", Split::Cols),
    ("mlp.linear_fc2.bias", Split::Replicated),
    ("mlp.router.weight", Split::Replicated),
    ("mlp.router.expert_bias", Split::Replicated),
    ("mlp.shared_experts.linear_fc1.weight", Split::Fc1),
    ("mlp.shared_experts.linear_fc2.weight", Split::Cols),
    ("mlp.shared_experts.gate_weight", Split::Replicated),
    // an expert's own, after `mlp.experts.local_experts.{e}.`
    ("linear_fc1.weight", Split::Fc1),
    ("linear_fc1.bias", Split::Fc1),
    ("linear_fc2.weight", Split::Cols),
    ("linear_fc2.bias", Split::Replicated),
];

/// The split of `key` (a name of [`SPLITS`]'s).
fn split_of(key: &str) -> Option<Split> {
    SPLITS.iter().find(|(k, _)| *k == key).map(|(_, s)| *s)
}

/// The arguments that say a model's shape and split: they must be the same in every rank
/// file.
const SHAPE_ARGS: &[&str] = &[
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "swiglu",
    "padded_vocab_size",
    "untie_embeddings_and_output_weights",
    "add_qkv_bias",
    "add_bias_linear",
    "normalization",
    "transformer_impl",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_experts",
    "moe_ffn_hidden_size",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
];

/// The saved arguments reshard needs, from rank 0's `args`.
#[derive(Debug)]
struct Config {
    tp: u64,
    pp: u64,
    ep: u64,
    layers: u64,
    /// Layers of each pipeline stage.
    stage_layers: Vec<u64>,
    hidden: Option<u64>,
    heads: Option<u64>,
    groups: Option<u64>,
    head_dim: Option<u64>,
    ffn: Option<u64>,
    expert_ffn: Option<u64>,
    swiglu: bool,
    vocab: Option<u64>,
    tied: bool,
    experts: Option<u64>,
    /// Whether the layers use the local (non-TransformerEngine) spec, whose norms are
    /// modules of their own (`input_layernorm`, `pre_mlp_layernorm`).
    local_spec: Option<bool>,
    /// Whether the experts are megatron-core's GroupedMLP (`args.moe_grouped_gemm`): each
    /// layer's local experts in two tensors, `mlp.experts.weight1` and `weight2`.
    grouped_gemm: bool,
}

/// An int argument, `None` when absent or `None`; refused when another type.
fn int_arg(file: &Path, args: &Value, name: &str) -> Result<Option<u64>> {
    match args.get(name) {
        None | Some(Value::None) => Ok(None),
        Some(Value::Int(i)) if *i >= 0 => Ok(Some(*i as u64)),
        Some(v) => Err(Error::format(
            file,
            format!("args.{name} is a {}, not a non-negative int", v.kind()),
        )),
    }
}

/// A bool argument (absent or `None`: false).
fn bool_arg(args: &Value, name: &str) -> bool {
    args.get(name).and_then(Value::as_bool).unwrap_or(false)
}

impl Config {
    fn of(file: &Path, args: &Value) -> Result<Config> {
        let int = |n: &str| int_arg(file, args, n);
        let size = |n: &str| -> Result<u64> {
            match int(n)? {
                Some(0) => Err(Error::format(file, format!("args.{n} is 0"))),
                Some(v) => Ok(v),
                None => Ok(1),
            }
        };
        let (tp, pp, ep) = (
            size("tensor_model_parallel_size")?,
            size("pipeline_model_parallel_size")?,
            size("expert_model_parallel_size")?,
        );
        let layers = int("num_layers")?.ok_or_else(|| {
            Error::format(file, "args has no num_layers (Megatron-LM's arguments)")
        })?;
        for n in [
            "virtual_pipeline_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage",
            "pipeline_model_parallel_layout",
        ] {
            if args.get(n).is_some_and(|v| !v.is_none()) {
                return Err(Error::format(
                    file,
                    format!("sets args.{n}: reshard reads legacy checkpoints without virtual pipeline stages or custom pipeline layouts"),
                ));
            }
        }
        for n in [
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        ] {
            if bool_arg(args, n) {
                return Err(Error::format(
                    file,
                    format!("sets args.{n}: reshard cannot place its layers on pipeline stages"),
                ));
            }
        }
        let stage_layers = stage_layers(
            file,
            layers,
            pp,
            int("decoder_first_pipeline_num_layers")?,
            int("decoder_last_pipeline_num_layers")?,
        )?;
        let heads = int("num_attention_heads")?;
        let groups = if bool_arg(args, "group_query_attention") {
            int("num_query_groups")?.or(heads)
        } else {
            heads
        };
        let hidden = int("hidden_size")?;
        let head_dim = match (int("kv_channels")?, hidden, heads) {
            (Some(k), _, _) => Some(k),
            (None, Some(h), Some(n)) if n > 0 => Some(h / n),
            _ => None,
        };
        let ffn = int("ffn_hidden_size")?;
        let experts = int("num_experts")?;
        if let Some(etp) = int("expert_tensor_parallel_size")? {
            if experts.is_some() && etp != tp {
                return Err(Error::format(
                    file,
                    format!("sets args.expert_tensor_parallel_size {etp}, not the tensor-parallel size {tp}: reshard reads experts split like the dense layers"),
                ));
            }
        }
        let transformer_impl = args.get("transformer_impl").and_then(Value::as_str);
        Ok(Config {
            tp,
            pp,
            ep,
            layers,
            stage_layers,
            hidden,
            heads,
            groups,
            head_dim,
            ffn,
            expert_ffn: int("moe_ffn_hidden_size")?.or(ffn),
            swiglu: bool_arg(args, "swiglu"),
            vocab: int("padded_vocab_size")?,
            tied: !bool_arg(args, "untie_embeddings_and_output_weights"),
            experts,
            local_spec: transformer_impl.map(|t| t == "local"),
            grouped_gemm: experts.is_some() && bool_arg(args, "moe_grouped_gemm"),
        })
    }

    /// The global shape `key` must have, where the arguments say it.
    fn expected(&self, key: &str, rest: Option<&str>, expert: bool) -> Option<Vec<u64>> {
        let h = self.hidden?;
        let gate = if self.swiglu { 2 } else { 1 };
        let qkv = || Some((self.heads? + 2 * self.groups?) * self.head_dim?);
        let ffn = if expert { self.expert_ffn } else { self.ffn };
        Some(match rest.unwrap_or(key) {
            "embedding.word_embeddings.weight" | "output_layer.weight" => vec![self.vocab?, h],
            "self_attention.linear_qkv.weight" => vec![qkv()?, h],
            "self_attention.linear_qkv.bias" => vec![qkv()?],
            "self_attention.linear_proj.weight" => vec![h, self.heads? * self.head_dim?],
            "mlp.linear_fc1.weight" | "linear_fc1.weight" => vec![gate * ffn?, h],
            "mlp.linear_fc2.weight" | "linear_fc2.weight" => vec![h, ffn?],
            "decoder.final_layernorm.weight"
            | "self_attention.linear_qkv.layer_norm_weight"
            | "mlp.linear_fc1.layer_norm_weight"
            | "pre_mlp_layernorm.weight" => vec![h],
            _ => return None,
        })
    }
}

/// The layers of each of `pp` pipeline stages: `first` and `last` where given
/// (`decoder_first_pipeline_num_layers`, `decoder_last_pipeline_num_layers`), the rest split
/// evenly; refused when it does not divide.
fn stage_layers(
    file: &Path,
    layers: u64,
    pp: u64,
    first: Option<u64>,
    last: Option<u64>,
) -> Result<Vec<u64>> {
    if pp == 1 {
        return Ok(vec![layers]);
    }
    let fixed = first.unwrap_or(0) + last.unwrap_or(0);
    let middle = pp - first.is_some() as u64 - last.is_some() as u64;
    let rest = layers.checked_sub(fixed);
    let each = match (rest, middle) {
        (Some(0), 0) => 0,
        (Some(r), m) if m > 0 && r % m == 0 => r / m,
        _ => {
            return Err(Error::format(
                file,
                format!("args say {layers} layers over {pp} pipeline stages, which reshard cannot place (first {first:?}, last {last:?})"),
            ))
        }
    };
    Ok((0..pp)
        .map(|s| match (s, first, last) {
            (0, Some(f), _) => f,
            (s, _, Some(l)) if s == pp - 1 => l,
            _ => each,
        })
        .collect())
}

/// One rank file, read.
struct RankFile {
    path: PathBuf,
    ck: Checkpoint,
    args: Value,
}

/// The allow-list the rank files are read under.
fn globals() -> &'static crate::torch::pickle::Globals {
    static G: OnceLock<crate::torch::pickle::Globals> = OnceLock::new();
    G.get_or_init(crate::torch::pickle::megatron_legacy_globals)
}

impl RankFile {
    fn read(path: PathBuf) -> Result<RankFile> {
        if !path.is_file() {
            return Err(Error::format(&path, "is missing"));
        }
        let ck = crate::pt::read::read_with(&path, Some(globals()))?;
        let args = ck
            .extras
            .iter()
            .find(|x| x.name == "args")
            .and_then(|x| x.pickle.clone())
            .filter(|v| !v.is_none())
            .ok_or_else(|| {
                Error::format(
                    &path,
                    "has no `args` (Megatron-LM's arguments, which say how its tensors are split)",
                )
            })?;
        Ok(RankFile { path, ck, args })
    }

    /// The model's tensors: name in the state dict (without `model.`), and layout.
    fn model(&self) -> Result<Vec<(&str, &TensorLayout)>> {
        let mut out = vec![];
        for t in &self.ck.tensors {
            if let Some(k) = t.name.strip_prefix("model.") {
                out.push((k, t));
            } else if t
                .name
                .strip_prefix("model")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
            {
                return Err(Error::format(
                    &self.path,
                    "holds virtual pipeline stages (model0, model1, …), which reshard does not read",
                ));
            }
        }
        if out.is_empty() {
            return Err(Error::format(&self.path, "has no `model` tensors"));
        }
        Ok(out)
    }

    fn iteration(&self) -> Option<&Value> {
        self.ck
            .extras
            .iter()
            .find(|x| x.name == "iteration")
            .and_then(|x| x.pickle.as_ref())
    }
}

/// Where a local tensor goes: its global name, its split, and for an expert the global
/// expert index.
struct Placed {
    name: String,
    split: Split,
    /// The key [`Config::expected`] checks (the name, or the part after the layer prefix).
    rest: Option<String>,
    expert: bool,
}

/// The global name of the local state-dict key `key` of pipeline stage `stage` and expert
/// rank `ep`; `None` for what is not a tensor of the model (`_extra_state`, the last stage's
/// copy of a tied embedding).
fn place(cfg: &Config, key: &str, stage: u64, ep: u64, file: &Path) -> Result<Option<Placed>> {
    if key.ends_with("_extra_state") {
        return Ok(None);
    }
    if key.starts_with("language_model.") {
        return Err(Error::format(
            file,
            "holds Megatron-LM's pre-megatron-core model (language_model.*): reshard reads megatron-core GPT models",
        ));
    }
    // the embedding lives on the first pipeline stage, the final norm and the output layer
    // on the last: a file elsewhere sits in another stage's folder
    let (first, last) = (stage == 0, stage + 1 == cfg.pp);
    let misplaced = (key.starts_with("embedding.") && !first)
        || ((key.starts_with("decoder.final_layernorm.") || key.starts_with("output_layer."))
            && !last);
    if misplaced {
        return Err(Error::format(
            file,
            format!(
                "holds `{}`, which pipeline stage {stage} of {} does not: a rank file in another stage's folder?",
                short(key),
                cfg.pp
            ),
        ));
    }
    if cfg.tied && key == "output_layer.weight" {
        return Ok(None);
    }
    let Some(local) = key.strip_prefix("decoder.layers.") else {
        let split = split_of(key).unwrap_or(Split::Replicated);
        return Ok(Some(Placed {
            name: key.to_string(),
            split,
            rest: None,
            expert: false,
        }));
    };
    let (idx, rest) = local.split_once('.').unwrap_or((local, ""));
    let i: u64 = idx.parse().map_err(|_| {
        Error::format(
            file,
            format!("`{}`: the layer index is not a number", short(key)),
        )
    })?;
    let count = cfg.stage_layers[stage as usize];
    if i >= count {
        return Err(Error::format(
            file,
            format!(
                "`{}`: layer {i} of a stage that has {count} layers by the arguments",
                short(key)
            ),
        ));
    }
    let global = cfg.stage_layers[..stage as usize].iter().sum::<u64>() + i;
    // the local spec's norms under TransformerEngine's names, as megatron-core's
    // `sharded_state_dict_keys_map` of that spec does
    let local_spec = cfg.local_spec.unwrap_or(true);
    let rest = if let Some(r) = rest.strip_prefix("input_layernorm.") {
        format!("self_attention.linear_qkv.layer_norm_{r}")
    } else if let Some(r) = rest
        .strip_prefix("pre_mlp_layernorm.")
        .filter(|_| local_spec)
    {
        format!("mlp.linear_fc1.layer_norm_{r}")
    } else {
        rest.to_string()
    };
    if let Some(e) = rest.strip_prefix("mlp.experts.local_experts.") {
        let (e, inner) = e.split_once('.').unwrap_or((e, ""));
        let e: u64 = e.parse().map_err(|_| {
            Error::format(
                file,
                format!("`{}`: the expert index is not a number", short(key)),
            )
        })?;
        let per = cfg.experts.unwrap_or(0) / cfg.ep;
        if e >= per {
            return Err(Error::format(
                file,
                format!(
                    "`{}`: local expert {e}, but the arguments give {per} per expert rank",
                    short(key)
                ),
            ));
        }
        let split = split_of(inner).unwrap_or(Split::Replicated);
        return Ok(Some(Placed {
            name: format!(
                "decoder.layers.{global}.mlp.experts.local_experts.{}.{inner}",
                ep * per + e
            ),
            split,
            rest: Some(inner.to_string()),
            expert: true,
        }));
    }
    let split = split_of(&rest).unwrap_or(Split::Replicated);
    Ok(Some(Placed {
        name: format!("decoder.layers.{global}.{rest}"),
        split,
        rest: Some(rest),
        expert: false,
    }))
}

/// Read the legacy checkpoint in the iteration folder `dir`.
fn read(dir: &Path) -> Result<Checkpoint> {
    // rank 0's file, as Megatron-LM's `find_checkpoint_rank_0` looks for it
    let first = ["mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"]
        .iter()
        .map(|n| dir.join(n).join(RANK_FILE))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            Error::format(
                dir,
                format!("has no mp_rank_00*/{RANK_FILE} (Megatron-LM's file of rank 0)"),
            )
        })?;
    let rank0 = RankFile::read(first.clone())?;
    let cfg = Config::of(&first, &rank0.args)?;
    let (tp, pp, ep) = (cfg.tp, cfg.pp, cfg.ep);
    let sizes = format!(
        "TP {tp}, PP {pp}{}",
        if ep > 1 {
            format!(", EP {ep}")
        } else {
            String::new()
        }
    );
    // every rank file, rank r = tp + T·ep + T·E·pp (Megatron's default order, data-parallel
    // size 1)
    let world = tp * pp * ep;
    let mut files: Vec<Option<RankFile>> = (0..world).map(|_| None).collect();
    let mut rank0 = Some(rank0);
    for s in 0..pp {
        for e in 0..ep {
            for t in 0..tp {
                let r = t + tp * e + tp * ep * s;
                let name = rank_folder(t, (pp > 1).then_some(s), (ep > 1).then_some(e));
                let path = dir.join(&name).join(RANK_FILE);
                if r == 0 {
                    if path != first {
                        return Err(Error::format(
                            &first,
                            format!(
                                "is named for another split than its arguments' ({sizes}: {name})"
                            ),
                        ));
                    }
                    files[0] = rank0.take();
                    continue;
                }
                if !path.is_file() {
                    return Err(Error::format(
                        &path,
                        format!(
                            "is missing: the arguments of {} say {sizes}",
                            first.display()
                        ),
                    ));
                }
                let f = RankFile::read(path)?;
                let r0 = files[0].as_ref().expect("rank 0 read first");
                for a in SHAPE_ARGS {
                    let (x, y) = (r0.args.get(a), f.args.get(a));
                    if x != y {
                        return Err(Error::format(
                            &f.path,
                            format!(
                                "has args.{a} = {}, but {} has {}: the ranks of one checkpoint must agree",
                                shown(y),
                                first.display(),
                                shown(x)
                            ),
                        ));
                    }
                }
                if f.iteration() != r0.iteration() {
                    return Err(Error::format(
                        &f.path,
                        format!(
                            "is of iteration {}, but {} of {}",
                            shown(f.iteration()),
                            first.display(),
                            shown(r0.iteration())
                        ),
                    ));
                }
                files[r as usize] = Some(f);
            }
        }
    }
    let files: Vec<RankFile> = files
        .into_iter()
        .map(|f| f.expect("every rank read"))
        .collect();
    let mut tensors = global_tensors(&cfg, &files)?;
    // the distributed optimizer's state, as megatron-core's fully_reshardable tensors
    let optim = if distopt::present(&files)? {
        Some(distopt::read(&cfg, &files)?)
    } else {
        None
    };
    // the plain entries of rank 0's file: arguments and counters, kept for common.pt; the
    // optimizer's (param_groups, each group's step) with the distributed optimizer's state
    let skip: &[&str] = if optim.is_some() {
        &["model", "rng_state", "rerun_state_machine"]
    } else {
        &["model", "optimizer", "rng_state", "rerun_state_machine"]
    };
    let r0 = &files[0];
    let mut extras: Vec<Extra> = vec![];
    let mut paths = BTreeMap::new();
    for x in &r0.ck.extras {
        let top = match r0.ck.paths.get(&x.name).and_then(|p| p.first()) {
            Some(KeyPart::Key(k)) => k.clone(),
            _ => x.name.clone(),
        };
        if skip.contains(&top.as_str())
            || (top.starts_with("model") && top[5..].parse::<u64>().is_ok())
        {
            continue;
        }
        if let Some(p) = r0.ck.paths.get(&x.name) {
            paths.insert(x.name.clone(), p.clone());
        }
        let mut x = x.clone();
        x.origin = crate::megatron::COMMON_ORIGIN;
        extras.push(x);
    }
    // the recorded CRCs of the storage records the tensors read
    let mut checksums = vec![];
    for (r, f) in files.iter().enumerate() {
        let used: Vec<u64> = tensors
            .iter()
            .flat_map(|t| &t.pieces)
            .filter(|p| p.loc.file as usize == r)
            .map(|p| p.loc.offset)
            .collect();
        for c in &f.ck.checksums {
            if used
                .iter()
                .any(|o| *o >= c.offset && *o < c.offset + c.len.max(1))
            {
                checksums.push(RecordCrc {
                    file: r as u32,
                    ..c.clone()
                });
            }
        }
    }
    let mut paths_of_files: Vec<PathBuf> = files.iter().map(|f| f.path.clone()).collect();
    if let Some(o) = optim {
        tensors.extend(o.tensors);
        paths_of_files.extend(o.files);
        checksums.extend(o.checksums);
        carry_optimizer_metadata(&mut extras, &mut paths, &r0.ck);
    }
    let iteration = shown(files[0].iteration());
    let mut ck = Checkpoint::of_tensors(
        Format::MEGATRON_LEGACY,
        dir,
        paths_of_files,
        world as u32,
        tensors,
        BTreeMap::new(),
    );
    ck.extras = extras;
    ck.paths = paths;
    ck.checksums = checksums;
    ck.producer = Some(format!(
        "Megatron-LM (--ckpt-format torch), {sizes}, {} layers, iteration {iteration}",
        cfg.layers
    ));
    Ok(ck)
}

/// With the distributed optimizer's state read: the entries megatron-core's loader needs
/// beside it in `common.pt` — `optimizer.param_state_sharding_type` (`fully_reshardable`) and,
/// unless rank 0's file has one, Megatron-LM's `content_metadata` naming that format. With
/// chained optimizers (a model with experts) the rank file's `optimizer` is a list of their
/// state dicts; megatron-core's `common.pt` has a dict keyed by the optimizer's index (an
/// int) instead, each with its own sharding type.
fn carry_optimizer_metadata(
    extras: &mut Vec<Extra>,
    paths: &mut BTreeMap<String, Vec<KeyPart>>,
    r0: &Checkpoint,
) {
    let entry = |name: &str, v: Value| Extra {
        name: name.to_string(),
        value: crate::dcp::to_json(&v),
        pickle: Some(v),
        raw: None,
        origin: crate::megatron::COMMON_ORIGIN,
        opaque: None,
    };
    // the chained optimizers' indices: `optimizer` a list
    let mut chained: Vec<i64> = vec![];
    for p in paths.values_mut() {
        if let [KeyPart::Key(k), at @ KeyPart::Index(_), ..] = p.as_mut_slice() {
            if k == "optimizer" {
                let KeyPart::Index(i) = *at else {
                    unreachable!()
                };
                *at = KeyPart::IntKey { int: i };
                if !chained.contains(&i) {
                    chained.push(i);
                }
            }
        }
    }
    chained.sort();
    let sharding = "param_state_sharding_type";
    extras.retain(|x| !(x.name.starts_with("optimizer.") && x.name.ends_with(sharding)));
    let heads: Vec<(String, Vec<KeyPart>)> = if chained.is_empty() {
        vec![("optimizer".into(), vec![KeyPart::Key("optimizer".into())])]
    } else {
        chained
            .iter()
            .map(|&i| {
                (
                    format!("optimizer.{i}"),
                    vec![KeyPart::Key("optimizer".into()), KeyPart::IntKey { int: i }],
                )
            })
            .collect()
    };
    for (name, mut path) in heads {
        let name = format!("{name}.{sharding}");
        extras.push(entry(&name, Value::Str(distopt::SHARDING_TYPE.to_string())));
        path.push(KeyPart::Key(sharding.into()));
        paths.insert(name, path);
    }
    let has_metadata = r0.extras.iter().any(|x| {
        x.name == "content_metadata"
            || r0
                .paths
                .get(&x.name)
                .and_then(|p| p.first())
                .is_some_and(|k| matches!(k, KeyPart::Key(k) if k == "content_metadata"))
    });
    if !has_metadata {
        let s = |k: &str| Value::Str(k.to_string());
        extras.push(entry(
            "content_metadata",
            Value::Dict(vec![
                (s("singleton_local_shards"), Value::Bool(false)),
                (s("chained_optim_avoid_prefix"), Value::Bool(true)),
                (s("distrib_optim_sharding_type"), s(distopt::SHARDING_TYPE)),
            ]),
        ));
    }
}

/// A value of the arguments, for messages.
fn shown(v: Option<&Value>) -> String {
    match v {
        None => "nothing".into(),
        Some(v) => short(&crate::dcp::to_json(v).to_string()),
    }
}

/// The global tensors of the rank files `files` (indexed by rank).
fn global_tensors(cfg: &Config, files: &[RankFile]) -> Result<Vec<TensorLayout>> {
    let (tp, ep) = (cfg.tp, cfg.ep);
    // name → (layout being built, the file and local shape of its first piece)
    let mut out: Vec<TensorLayout> = vec![];
    let mut at: HashMap<String, usize> = HashMap::new();
    for (r, f) in files.iter().enumerate() {
        let r = r as u64;
        let (t, e, s) = (r % tp, (r / tp) % ep, r / (tp * ep));
        let model = grouped_experts(cfg, f.model()?, &f.path)?;
        // every stage's file has its own layers: those the arguments give it
        let mut seen_layers = 0u64;
        for (key, local) in &model {
            let (key, local) = (key.as_str(), local);
            if let Some(i) = key
                .strip_prefix("decoder.layers.")
                .and_then(|l| l.split('.').next())
                .and_then(|i| i.parse::<u64>().ok())
            {
                seen_layers = seen_layers.max(i + 1);
            }
            let Some(p) = place(cfg, key, s, e, &f.path)? else {
                continue;
            };
            if !p.expert && e > 0 {
                // dense tensors are the same on every expert rank: read from expert rank 0
                continue;
            }
            if tp > 1 && split_of_known(&p).is_none() {
                return Err(Error::format(
                    &f.path,
                    format!(
                        "`{}`: no tensor-parallel split rule for it (reshard knows megatron-core GPT's tensors)",
                        short(key)
                    ),
                ));
            }
            let split = if tp == 1 { Split::Replicated } else { p.split };
            if split == Split::Replicated && t > 0 {
                continue;
            }
            let shape = &local.shape;
            let global = global_shape(split, shape, tp).ok_or_else(|| {
                Error::format(
                    &f.path,
                    format!(
                        "`{}`: a tensor of shape {shape:?} cannot be split that way",
                        short(key)
                    ),
                )
            })?;
            if let Some(want) = cfg.expected(&p.name, p.rest.as_deref(), p.expert) {
                if want != global {
                    let local_want = local_shape(split, &want, tp);
                    return Err(Error::format(
                        &f.path,
                        format!(
                            "`{}` has the shape {shape:?}, but the arguments make it {local_want:?} on each of {tp} tensor rank(s) (global {want:?})",
                            short(key)
                        ),
                    ));
                }
            }
            let idx = *at.entry(p.name.clone()).or_insert_with(|| {
                out.push(TensorLayout {
                    name: p.name.clone(),
                    dtype: local.dtype,
                    shape: global.clone(),
                    pieces: vec![],
                });
                out.len() - 1
            });
            let g = &mut out[idx];
            if g.dtype != local.dtype || g.shape != global {
                return Err(Error::format(
                    &f.path,
                    format!(
                        "`{}` is {} {shape:?}, another rank's is {} of global shape {:?}",
                        short(key),
                        local.dtype,
                        g.dtype,
                        g.shape
                    ),
                ));
            }
            g.pieces
                .extend(pieces(split, local, t, tp, r as u32, cfg.swiglu));
        }
        let want = cfg.stage_layers[s as usize];
        if seen_layers != want {
            return Err(Error::format(
                &f.path,
                format!(
                    "holds {seen_layers} layer(s), but the arguments give pipeline stage {s} {want}"
                ),
            ));
        }
    }
    // every tensor split over the tensor ranks must have a piece from each
    for g in &out {
        let covered: u64 = g.pieces.iter().map(|p| p.region.volume()).sum();
        let volume: u64 = g.shape.iter().product();
        if covered != volume {
            return Err(Error::layout(
                &g.name,
                format!("the rank files cover {covered} of its {volume} elements"),
            ));
        }
    }
    Ok(out)
}

/// The model's tensors with GroupedMLP's experts (`args.moe_grouped_gemm`) presented as
/// SequentialMLP's: a layer's `mlp.experts.weight1`, shaped `[H, E_local·c]` but holding
/// `[E_local, H, c]` (each local expert's first projection, `c` = 2F/TP with SwiGLU, stored
/// transposed one after the other: a reshape, not experts side by side), becomes
/// `mlp.experts.local_experts.{j}.linear_fc1.weight` `[c, H]` of strides `[1, c]`; `weight2`,
/// `[E_local·r, H]` holding `[E_local, r, H]` (r = F/TP), becomes `….linear_fc2.weight`
/// `[H, r]` of strides `[1, H]`. Nothing is copied: each is a strided view of its record.
fn grouped_experts(
    cfg: &Config,
    model: Vec<(&str, &TensorLayout)>,
    file: &Path,
) -> Result<Vec<(String, TensorLayout)>> {
    let mut out = Vec::with_capacity(model.len());
    for (key, local) in model {
        let which = key
            .strip_suffix(".mlp.experts.weight1")
            .map(|p| (p, 1))
            .or_else(|| key.strip_suffix(".mlp.experts.weight2").map(|p| (p, 2)));
        let Some((layer, which)) = which.filter(|_| key.starts_with("decoder.layers.")) else {
            out.push((key.to_string(), local.clone()));
            continue;
        };
        let bad = |why: String| Error::format(file, format!("`{}`: {why}", short(key)));
        if !cfg.grouped_gemm {
            return Err(bad(
                "grouped-GEMM experts, but args.moe_grouped_gemm is not set".into(),
            ));
        }
        let per = cfg.experts.unwrap_or(0) / cfg.ep;
        let (Some(h), [rows, cols], [piece]) =
            (cfg.hidden, local.shape.as_slice(), local.pieces.as_slice())
        else {
            return Err(bad(format!(
                "a grouped-GEMM weight of shape {:?} (expected 2-d, in one piece)",
                local.shape
            )));
        };
        if piece.loc.strides.is_some() {
            return Err(bad("a grouped-GEMM weight stored strided".into()));
        }
        // (the stored dimension holding the experts, the hidden size's)
        let (stacked, hidden) = if which == 1 {
            (*cols, *rows)
        } else {
            (*rows, *cols)
        };
        if per == 0 || hidden != h || stacked % per != 0 {
            return Err(bad(format!(
                "shape {:?} is not {per} local experts of hidden size {h}",
                local.shape
            )));
        }
        let c = stacked / per;
        let elem = local.dtype.size() as u64;
        for j in 0..per {
            let (name, shape, strides) = if which == 1 {
                ("linear_fc1.weight", vec![c, h], vec![1, c])
            } else {
                ("linear_fc2.weight", vec![h, c], vec![1, h])
            };
            let mut loc = piece.loc.clone();
            loc.offset += j * c * h * elem;
            loc.strides = Some(strides);
            out.push((
                format!("{layer}.mlp.experts.local_experts.{j}.{name}"),
                TensorLayout {
                    name: local.name.clone(),
                    dtype: local.dtype,
                    shape: shape.clone(),
                    pieces: vec![Piece {
                        rank: piece.rank,
                        region: Region::full(&shape),
                        loc,
                    }],
                },
            ));
        }
    }
    Ok(out)
}

/// The split of a placed tensor when its name is in [`SPLITS`].
fn split_of_known(p: &Placed) -> Option<Split> {
    split_of(p.rest.as_deref().unwrap_or(&p.name))
}

/// The global shape of a local tensor of shape `local` split by `split` over `tp` ranks.
fn global_shape(split: Split, local: &[u64], tp: u64) -> Option<Vec<u64>> {
    let mut g = local.to_vec();
    match split {
        Split::Replicated => {}
        Split::Rows | Split::Fc1 => *g.first_mut()? *= tp,
        Split::Cols => *g.get_mut(1)? *= tp,
    }
    Some(g)
}

/// Each tensor rank's shape of a global tensor of shape `global`.
fn local_shape(split: Split, global: &[u64], tp: u64) -> Vec<u64> {
    let mut l = global.to_vec();
    let d = match split {
        Split::Replicated => return l,
        Split::Rows | Split::Fc1 => 0,
        Split::Cols => 1,
    };
    if let Some(x) = l.get_mut(d) {
        *x /= tp;
    }
    l
}

/// The pieces of the global tensor that tensor rank `t` of `tp` holds as `local` (rank
/// `rank`'s file).
fn pieces(
    split: Split,
    local: &TensorLayout,
    t: u64,
    tp: u64,
    rank: u32,
    swiglu: bool,
) -> Vec<Piece> {
    let src = &local.pieces[0];
    let shape = &local.shape;
    let loc = |offset: u64| Loc {
        file: rank,
        offset,
        strides: src.loc.strides.clone(),
        pending: None,
    };
    let whole = |offsets: Vec<u64>| Piece {
        rank,
        region: Region::new(offsets, shape.clone()),
        loc: loc(src.loc.offset),
    };
    let zeros = vec![0u64; shape.len()];
    match split {
        Split::Replicated => vec![whole(zeros)],
        Split::Rows => {
            let mut o = zeros;
            o[0] = t * shape[0];
            vec![whole(o)]
        }
        Split::Fc1 if !swiglu || shape[0] % 2 != 0 => {
            let mut o = zeros;
            o[0] = t * shape[0];
            vec![whole(o)]
        }
        Split::Cols => {
            let mut o = zeros;
            o[1] = t * shape[1];
            vec![whole(o)]
        }
        Split::Fc1 => {
            // [gate_t; up_t]: rows t·h.. of the gate, F + t·h.. of the up projection
            let h = shape[0] / 2;
            let f = h * tp;
            let stride0 = match &src.loc.strides {
                Some(s) => s[0],
                None => shape[1..].iter().product(),
            };
            let elem = local.dtype.size() as u64;
            let mut half = shape.clone();
            half[0] = h;
            [(0, t * h), (h, f + t * h)]
                .into_iter()
                .map(|(from, to)| {
                    let mut o = zeros.clone();
                    o[0] = to;
                    Piece {
                        rank,
                        region: Region::new(o, half.clone()),
                        loc: loc(src.loc.offset + from * stride0 * elem),
                    }
                })
                .collect()
        }
    }
}
