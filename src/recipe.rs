//! Recipes applied to checkpoints: the built-in recipes, which framework a checkpoint or an
//! output format belongs to, the configuration a recipe reads (Megatron-LM's saved arguments,
//! a Hugging Face `config.json`), and which recipe applies and why. The recipe itself
//! (parameters, rules, views) is [`reshard_core::recipe`].

use crate::error::{Error, IoContext, Result};
use crate::formats::{Checkpoint, Format};
use crate::layout::{DType, View};
pub use reshard_core::recipe::{Instance, Recipe};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The built-in recipes: name and JSON text (the files of the repository's `recipes/`).
pub const BUILTIN: &[(&str, &str)] = &[
    ("llama", include_str!("../recipes/llama.json")),
    ("mistral", include_str!("../recipes/mistral.json")),
    ("qwen2", include_str!("../recipes/qwen2.json")),
    ("mixtral", include_str!("../recipes/mixtral.json")),
    ("qwen2_moe", include_str!("../recipes/qwen2_moe.json")),
];

/// How a conversion between frameworks is asked for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecipeOptions {
    /// A built-in recipe's name or a recipe file; `None` chooses one where the source and the
    /// output belong to different frameworks; `Some("none")` keeps the names as they are.
    pub recipe: Option<String>,
    /// Parameter values that override the source's configuration (`padded_vocab=256`).
    pub params: BTreeMap<String, Value>,
    /// The output's tensor-parallel size where the output states one (a legacy output's
    /// `--tp`): the value of a recipe's `tp` parameter unless `params` sets it.
    pub tp: Option<u64>,
    /// Target the names a model holds in memory where they differ from its files'
    /// ([`Recipe::for_memory`]): for a loader that fills a model, not for an output.
    pub memory: bool,
}

/// A recipe chosen and applied to a source.
#[derive(Clone, Debug)]
pub struct Applied {
    /// The recipe's name.
    pub name: String,
    /// Why it applies: named on the command line, or what of the source's configuration chose it.
    pub reason: String,
    /// The source's framework.
    pub from: &'static str,
    /// The output's framework.
    pub to: &'static str,
    /// The parameters, the targets' views and the output's configuration file.
    pub instance: Instance,
    /// What the defaults taken mean (the parameters' notes).
    pub notes: Vec<String>,
}

/// The framework whose names a format holds: `megatron` (megatron-core checkpoints), `hf`
/// (safetensors, Hugging Face folders), or none (names of any framework).
pub fn framework(format: Format) -> Option<&'static str> {
    match format.name() {
        n if n.starts_with("megatron") => Some("megatron"),
        "hf" | "safetensors" => Some("hf"),
        _ => None,
    }
}

/// Parse a `--param KEY=VALUE`: the value as JSON (a number, `true`), else as a string.
pub fn parse_param(s: &str) -> std::result::Result<(String, Value), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected KEY=VALUE"))?;
    let k = k.trim();
    if k.is_empty() {
        return Err(format!("`{s}`: empty parameter name"));
    }
    let v = v.trim();
    let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string()));
    Ok((k.to_string(), value))
}

/// The recipe named `name` (a built-in) or in the file `name`, its `extends` resolved.
pub fn load(name: &str) -> Result<Recipe> {
    let (recipe, what) = match BUILTIN.iter().find(|(n, _)| *n == name) {
        Some((n, text)) => (Recipe::from_json(text, n)?, format!("built-in recipe {n}")),
        None => {
            let path = Path::new(name);
            if !path.is_file() {
                return Err(Error::usage(format!(
                    "no recipe `{name}`: not a built-in ({}) and not a file",
                    builtin_names().join(", ")
                )));
            }
            let meta = std::fs::metadata(path).at(path)?;
            if meta.len() > 16 << 20 {
                return Err(Error::format(path, "is larger than 16 MiB: not a recipe"));
            }
            let text = std::fs::read_to_string(path).at(path)?;
            let r: Recipe = serde_json::from_str(&text)
                .map_err(|e| Error::format(path, format!("bad recipe: {e}")))?;
            (r, path.display().to_string())
        }
    };
    let mut recipe = recipe;
    let mut depth = 0;
    while let Some(base) = recipe.extends.clone() {
        depth += 1;
        let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == base) else {
            return Err(Error::usage(format!(
                "{what}: extends `{base}`, which is not a built-in recipe ({})",
                builtin_names().join(", ")
            )));
        };
        if depth > 8 {
            return Err(Error::usage(format!("{what}: extends recipes 8 deep")));
        }
        let base = Recipe::from_json(text, &base)?;
        let chained = base.extends.clone();
        recipe = recipe.over(&base);
        recipe.extends = chained;
    }
    Ok(recipe)
}

/// The built-in recipes' names.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

/// The configuration of `ck` as its framework keeps it: Megatron-LM's `args` (from
/// `common.pt`, or the rank files of a legacy checkpoint) or the Hugging Face `config.json`
/// beside the weights, as a JSON object; `None` when there is none.
pub fn source_config(ck: &Checkpoint, framework: &str) -> Result<Option<Value>> {
    match framework {
        "megatron" => Ok(ck
            .extras
            .iter()
            .find(|e| e.name == "args")
            .and_then(|e| e.pickle.as_ref())
            .and_then(namespace_json)),
        "hf" => match ck.companions.iter().find(|(n, _)| n == "config.json") {
            Some((_, bytes)) => serde_json::from_slice(bytes)
                .map(Some)
                .map_err(|e| Error::format(ck.path.join("config.json"), format!("bad JSON: {e}"))),
            None => Ok(None),
        },
        _ => Ok(None),
    }
}

/// An `argparse.Namespace` as a JSON object of its attributes.
fn namespace_json(v: &reshard_core::value::Value) -> Option<Value> {
    use reshard_core::value::Value as P;
    match v {
        P::Object {
            module,
            name,
            state: Some(state),
            ..
        } if module == "argparse" && name == "Namespace" => {
            Some(reshard_formats::dcp::to_json(state))
        }
        _ => None,
    }
}

/// A dotted key (`rope_parameters.rope_theta`) of a JSON object.
fn lookup(config: &Value, key: &str) -> Option<Value> {
    let mut v = config;
    for part in key.split('.') {
        v = v.get(part)?;
    }
    Some(v.clone())
}

/// The built-in recipe a source's configuration calls for, and why.
fn choose(framework: &str, config: &Value) -> Option<(&'static str, String)> {
    match framework {
        "megatron" => {
            let set = |k: &str| lookup(config, k).is_some_and(|v| !v.is_null());
            if set("num_experts") && set("moe_shared_expert_intermediate_size") {
                return Some((
                    "qwen2_moe",
                    "common.pt args: num_experts and moe_shared_expert_intermediate_size are set (mixture of experts with a shared expert)".into(),
                ));
            }
            if set("num_experts") {
                return Some((
                    "mixtral",
                    "common.pt args: num_experts is set (mixture of experts)".into(),
                ));
            }
            if lookup(config, "add_qkv_bias") == Some(Value::Bool(true)) {
                return Some(("qwen2", "common.pt args: add_qkv_bias=True".into()));
            }
            let swiglu = lookup(config, "swiglu") == Some(Value::Bool(true));
            let rms = lookup(config, "normalization") == Some(Value::from("RMSNorm"));
            (swiglu && rms).then(|| {
                (
                    "llama",
                    "common.pt args: normalization=RMSNorm, swiglu=True".to_string(),
                )
            })
        }
        "hf" => {
            let t = lookup(config, "model_type")?;
            let t = t.as_str()?;
            BUILTIN
                .iter()
                .find(|(n, _)| *n == t)
                .map(|(n, _)| (*n, format!("config.json: model_type={t}")))
        }
        _ => None,
    }
}

/// The recipe that applies to converting `ck` to `format` under `opts`, applied: `None` when
/// names are kept (same framework, `--recipe none`, or no recipe asked for and either the
/// output is one safetensors file or the source's configuration names no model).
pub fn apply(ck: &Checkpoint, format: Format, opts: &RecipeOptions) -> Result<Option<Applied>> {
    if opts.recipe.as_deref() == Some("none") {
        return Ok(None);
    }
    let (from, to) = (framework(ck.format), framework(format));
    let (Some(from), Some(to)) = (from, to) else {
        return match &opts.recipe {
            Some(r) => Err(Error::usage(format!(
                "recipe {r} converts between frameworks, but {} is a {} checkpoint and the output {}: recipes convert megatron and hf checkpoints",
                ck.path.display(),
                ck.format.name(),
                format.name()
            ))),
            None => Ok(None),
        };
    };
    if from == to {
        return match &opts.recipe {
            Some(r) => Err(Error::usage(format!(
                "recipe {r}: the source and the output are both {from} checkpoints (choose an output format of the other framework)"
            ))),
            None => Ok(None),
        };
    }
    let config = source_config(ck, from)?;
    let (name, reason) = match &opts.recipe {
        Some(r) => (r.clone(), "--recipe".to_string()),
        // one safetensors file is a plain tensor file as often as a model: names kept
        // unless a recipe is asked for
        None if format == Format::SAFETENSORS => return Ok(None),
        None => match config.as_ref().and_then(|c| choose(from, c)) {
            Some((n, why)) => (n.to_string(), why),
            // no configuration that names a model: names kept, as before recipes
            None => return Ok(None),
        },
    };
    let recipe = load(&name)?;
    let recipe = if opts.memory {
        recipe.for_memory()
    } else {
        recipe
    };
    let empty = Value::Object(Default::default());
    let config = config.unwrap_or(empty);
    let mut given = opts.params.clone();
    if let Some(tp) = opts.tp.filter(|_| recipe.params.contains_key("tp")) {
        given.entry("tp".into()).or_insert_with(|| tp.into());
    }
    if recipe.params.contains_key("dtype") && !given.contains_key("dtype") {
        if let Some(name) = ck.tensors.iter().find_map(|t| torch_float_name(t.dtype)) {
            given.insert("dtype".into(), Value::from(name));
        }
    }
    let (params, mut origins) = recipe.resolve(from, &|k| lookup(&config, k), &given)?;
    if !opts.params.contains_key("dtype") && params.contains_key("dtype") {
        origins.insert("dtype".into(), "the source tensors".into());
    }
    let shapes: reshard_core::recipe::SourceShapes<'_> = ck
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    let notes = recipe
        .params
        .iter()
        .filter(|(k, _)| origins.get(*k).is_some_and(|o| o == "default"))
        .filter_map(|(k, p)| Some(format!("{k}={}: {}", params[k], p.note.as_ref()?)))
        .collect();
    let instance = recipe.instantiate(from, to, params, origins, &shapes)?;
    Ok(Some(Applied {
        name: recipe.recipe.clone(),
        reason,
        from,
        to,
        instance,
        notes,
    }))
}

/// torch's name of a floating dtype, as `config.json` writes it.
fn torch_float_name(d: DType) -> Option<&'static str> {
    Some(match d {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        _ => return None,
    })
}

/// The `common.pt` entries of a megatron output converted from another framework: Megatron-LM's
/// `args` (an `argparse.Namespace` of the recipe's configuration, when it has one),
/// `checkpoint_version` 3.0 and `iteration` 0, as Megatron-LM's own saves hold them.
pub fn megatron_common(config: Option<&Value>) -> Vec<crate::Extra> {
    use reshard_core::value::Value as P;
    let entry =
        |name: &str, pickle: P| extra(name, pickle, reshard_formats::megatron::COMMON_ORIGIN);
    let mut out = vec![];
    if let Some(Value::Object(fields)) = config {
        let state = P::Dict(
            fields
                .iter()
                .map(|(k, v)| (P::Str(k.clone()), python_value(v)))
                .collect(),
        );
        let args = P::Object {
            module: "argparse".into(),
            name: "Namespace".into(),
            args: vec![],
            state: Some(Box::new(state)),
        };
        let mut e = entry("args", args);
        e.value = config.cloned().unwrap_or_default();
        out.push(e);
    }
    out.push(entry("checkpoint_version", P::Float(3.0)));
    out.push(entry("iteration", P::Int(0)));
    out
}

/// A JSON value as the Python value `json.loads` makes of it.
fn python_value(v: &Value) -> reshard_core::value::Value {
    use reshard_core::value::Value as P;
    match v {
        Value::Null => P::None,
        Value::Bool(b) => P::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => P::Int(i),
            None => P::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => P::Str(s.clone()),
        Value::Array(a) => P::List(a.iter().map(python_value).collect()),
        Value::Object(o) => P::Dict(
            o.iter()
                .map(|(k, v)| (P::Str(k.clone()), python_value(v)))
                .collect(),
        ),
    }
}

/// What converting `ck` to the other framework would do, in one line: the recipe that
/// applies and why, or why none does; `None` for a checkpoint of no framework, or one whose
/// configuration names no model (names are then kept).
pub fn describe(ck: &Checkpoint) -> Option<String> {
    let other = match framework(ck.format)? {
        "megatron" => Format::HF,
        _ => Format::MEGATRON,
    };
    match apply(ck, other, &RecipeOptions::default()) {
        Ok(Some(a)) => Some(format!(
            "recipe {} ({}) converts it to {} (--format {})",
            a.name,
            a.reason,
            a.to,
            other.name()
        )),
        Ok(None) => None,
        Err(e) => Some(format!("no recipe converts it to {}: {e}", other.name())),
    }
}

/// The recipe that reads `ck` as the other framework's tensors, for a loader that fills a
/// model of that framework without writing files (a megatron-core checkpoint into a Hugging
/// Face model): as [`apply`] decides it for an output of the other framework, and an error
/// when none applies.
pub fn for_loading(ck: &Checkpoint, opts: &RecipeOptions) -> Result<Applied> {
    let other = match framework(ck.format) {
        Some("megatron") => Format::HF,
        Some(_) => Format::MEGATRON,
        None => {
            return Err(Error::usage(format!(
                "{}: a {} checkpoint belongs to no framework a recipe converts (megatron, hf)",
                ck.path.display(),
                ck.format.name()
            )))
        }
    };
    apply(ck, other, opts)?.ok_or_else(|| {
        Error::usage(format!(
            "{}: no recipe applies (its configuration names no model a built-in recipe knows, or recipe=\"none\"): name one with recipe=",
            ck.path.display()
        ))
    })
}

/// A non-tensor entry of `origin` holding `pickle`.
fn extra(name: &str, pickle: reshard_core::value::Value, origin: &'static str) -> crate::Extra {
    crate::Extra {
        name: name.into(),
        value: reshard_formats::dcp::to_json(&pickle),
        pickle: Some(pickle),
        raw: None,
        origin,
        opaque: None,
    }
}

/// The objects a recipe states for its target (megatron-core's `_extra_state`), as entries
/// a megatron output stores as `BYTE_IO` items.
pub fn objects(instance: &Instance) -> Vec<crate::Extra> {
    instance
        .objects
        .iter()
        .map(|(name, value)| extra(name, python_value(value), "dcp"))
        .collect()
}

/// The linear layers whose `_extra_state` megatron-core's sharded state dict asks for, one
/// `ShardedObject` per layer (and expert), beside their stacked weights.
const LINEAR_LAYERS: [&str; 4] = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"];

/// A legacy per-rank checkpoint's tensors, or a Megatron-LM `fsdp_dtensor` checkpoint's (per
/// layer, SequentialMLP's experts as `local_experts.{e}`), laid out as megatron-core's `torch_dist` saves the same model: layers
/// and experts stacked on leading axes under its sharded keys (`mlp.experts.experts.*`), and
/// the `_extra_state` object of each linear layer (`None`, as the local spec saves it). Every
/// target is a view of the source's own tensors, so the bytes are the source's, vocabulary
/// padding included.
pub fn legacy_torch_dist(ck: &Checkpoint) -> Result<Applied> {
    let targets: Vec<(String, View)> = ck
        .tensors
        .iter()
        .map(|t| {
            let name = t
                .name
                .replace(".mlp.experts.local_experts.", ".mlp.experts.experts.");
            (name, View::source(&t.name))
        })
        .collect();
    let mut objects = vec![];
    let mut stacks: BTreeMap<String, Vec<Vec<u64>>> = BTreeMap::new();
    for (name, _) in &targets {
        let (stacked, idx) = reshard_core::recipe::stacked_name(name);
        if !idx.is_empty() {
            stacks.entry(stacked).or_default().push(idx);
        }
    }
    let shape_of = |n: &str| ck.tensor(n).map(|t| t.shape.clone());
    let targets = reshard_core::recipe::stack(targets, &shape_of)?;
    for (stacked, members) in &stacks {
        if stacked.starts_with("optimizer.") {
            continue; // the optimizer's state of a weight: its layer has the object
        }
        let Some(module) = stacked.strip_suffix(".weight").filter(|m| {
            m.rsplit('.')
                .next()
                .is_some_and(|last| LINEAR_LAYERS.contains(&last))
        }) else {
            continue;
        };
        // the stack's extent along each index axis: the largest index + 1
        let depth = members[0].len();
        let dims: Vec<u64> = (0..depth)
            .map(|k| members.iter().map(|m| m[k] + 1).max().unwrap_or(0))
            .collect();
        let join = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
        let mut sorted = members.clone();
        sorted.sort();
        for idx in sorted {
            objects.push((
                format!("{module}._extra_state/shard_{}_{}", join(&idx), join(&dims)),
                Value::Array(vec![Value::Null]),
            ));
        }
    }
    Ok(Applied {
        name: "torch_dist".into(),
        reason: format!(
            "a {} source: layers and experts stacked as megatron-core saves them",
            ck.format
        ),
        from: "megatron",
        to: "megatron",
        instance: Instance {
            params: BTreeMap::new(),
            origins: BTreeMap::new(),
            targets,
            config: None,
            objects,
        },
        notes: vec![],
    })
}
