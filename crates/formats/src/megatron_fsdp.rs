//! Megatron-LM's `--ckpt-format fsdp_dtensor` checkpoints (Megatron-FSDP,
//! `--use-megatron-fsdp`; `docs/megatron-format.md`), read as megatron-core's names.
//!
//! An iteration folder of a Megatron-LM save directory holding a plain DCP checkpoint
//! (`.metadata`, `__<R>_0.distcp`; no `metadata.json`, no `common.pt`), written by
//! `torch.distributed.checkpoint.save` from DTensors over Megatron-FSDP's (dp, tp) mesh after
//! Megatron-LM's `preprocess_fsdp_dtensor_state_dict`. What that leaves on disk:
//!
//! - the model under `model.` plus the wrapper's `module.` (`model.module.decoder.layers.0.…`;
//!   `model.module.module.` when Float16Module wraps the model), per layer, each tensor at its
//!   global shape, its chunks cut unevenly along dim 0 by FSDP (and by TP along its own dim);
//! - SwiGLU's `linear_fc1.weight` (and `bias`) saved as two tensors, `…weight_w` (the gate
//!   rows of every TP rank) and `…weight_v` (the up rows);
//! - `args` (Megatron-LM's `argparse.Namespace`, with `ckpt_format='fsdp_dtensor'`),
//!   `checkpoint_version`, `iteration`, `num_floating_point_operations_so_far` and
//!   `rng_state.(<pp>, <tp>).…` as non-tensor items; the optimizer, when saved, under
//!   `optimizer.`.
//!
//! The DCP reader reads the folder and hands it here when its `args` say `fsdp_dtensor`
//! (nothing in the file names tells it from another DCP checkpoint). Here the model's tensors
//! get the names megatron-core's `torch_dist` saves them under, per layer: the wrapper's
//! prefix dropped, `weight_w` and `weight_v` joined into `linear_fc1.weight` (the gate rows
//! first, as megatron-core's own checkpoints hold it: the pieces of `weight_v` moved down by
//! the gate's rows, no bytes copied), and the local layer spec's norms under
//! TransformerEngine's names (`input_layernorm.weight` as
//! `self_attention.linear_qkv.layer_norm_weight`, and with `transformer_impl='local'`
//! `pre_mlp_layernorm.weight` as `mlp.linear_fc1.layer_norm_weight`), as megatron-core's
//! `sharded_state_dict_keys_map` of that spec does. So the megatron recipes apply, and a
//! `torch_dist` output stacks the layers as a legacy source's are. `args` is decoded, and with
//! the other top-level values it becomes a `common.pt` entry. `rng_state` (each rank's
//! generators) is left out, as the legacy reader leaves it; the optimizer's state, when
//! saved, is kept under its own names.
//!
//! Read only: written as `megatron` (`torch_dist`), `hf` through a recipe, or `dcp`.

use crate::error::{Error, Result};
use crate::layout::TensorLayout;
use crate::torch::pickle::Value;
use crate::{
    Aliasing, Capabilities, Checkpoint, Codec, Container, Extra, Family, Format, Output, Probe,
    Recognition, TargetTensor, WriteOptions,
};
use std::collections::BTreeMap;
use std::path::Path;

/// Megatron-LM `fsdp_dtensor` checkpoints (read only).
pub struct MegatronFsdp;

static CAPS: Capabilities = Capabilities {
    name: "megatron-fsdp",
    aliases: &["fsdp_dtensor"],
    summary: "Megatron-LM --ckpt-format fsdp_dtensor (Megatron-FSDP DTensors in DCP), read \
              under megatron-core's names",
    noun: "a Megatron-LM fsdp_dtensor checkpoint",
    container: Container::Directory,
    extensions: &[],
    max_world: None,
    family: Family::Torch,
    extras_kept: "args and the iteration as common.pt entries, the rest as BYTE_IO items",
    keeps_opaque: true,
    aliasing: Aliasing::CopyPerName,
    written: false,
};

/// The top-level values Megatron-LM's loader reads beside the model: `common.pt` entries of a
/// `torch_dist` output.
const COMMON: [&str; 4] = [
    "args",
    "checkpoint_version",
    "iteration",
    "num_floating_point_operations_so_far",
];

impl Codec for MegatronFsdp {
    fn capabilities(&self) -> &'static Capabilities {
        &CAPS
    }
    fn recognize(&self, _probe: &Probe) -> Recognition {
        // its files are a DCP checkpoint's: the DCP reader tells it by its `args`
        Recognition::No
    }
    fn read(&self, path: &Path) -> Result<Checkpoint> {
        read(crate::dcp::read(path)?)
    }
    fn read_lazy(&self, path: &Path) -> Result<Checkpoint> {
        read(crate::dcp::read_lazy(path)?)
    }
    fn write(&self, _target: &[TargetTensor], _world: u32, _opts: &WriteOptions) -> Result<Output> {
        Err(Error::usage(
            "Megatron-LM fsdp_dtensor checkpoints are read, not written: write megatron \
             (torch_dist, which Megatron-LM loads), hf (through a recipe) or dcp",
        ))
    }
}

/// A DCP checkpoint as it was read, or as this format when it is one ([`is_fsdp_dtensor`]).
pub fn claim(ck: Checkpoint) -> Result<Checkpoint> {
    if is_fsdp_dtensor(&ck) {
        read(ck)
    } else {
        Ok(ck)
    }
}

/// True when a DCP checkpoint is Megatron-LM's `fsdp_dtensor` save: an `args` item that is
/// an `argparse.Namespace` with `ckpt_format='fsdp_dtensor'`.
pub fn is_fsdp_dtensor(ck: &Checkpoint) -> bool {
    ck.extras.iter().any(|e| {
        e.name == "args"
            && args_of(e)
                .ok()
                .flatten()
                .is_some_and(|a| str_arg(&a, "ckpt_format") == Some("fsdp_dtensor"))
    })
}

/// The `args` entry's Namespace state (a dict), decoded from its stored bytes when the DCP
/// reader kept it opaque; `None` when it is no `argparse.Namespace`.
fn args_of(e: &Extra) -> std::result::Result<Option<Value>, String> {
    let value = match (&e.pickle, &e.opaque) {
        (Some(v), _) => v.clone(),
        (None, Some(o)) if o.global == "argparse.Namespace" => {
            let globals = crate::torch::pickle::pickled_dict_globals();
            crate::torch::save::parse_with(&o.bytes, &globals)
                .map_err(|err| format!("its `args` item does not decode: {err}"))?
                .value
        }
        _ => return Ok(None),
    };
    Ok(match value {
        Value::Object {
            ref module,
            ref name,
            ..
        } if module == "argparse" && name == "Namespace" => Some(value),
        _ => None,
    })
}

/// A str attribute of a decoded Namespace.
fn str_arg<'a>(ns: &'a Value, name: &str) -> Option<&'a str> {
    match ns {
        Value::Object { state: Some(s), .. } => match s
            .as_dict()?
            .iter()
            .find(|(k, _)| matches!(k, Value::Str(k) if k == name))?
        {
            (_, Value::Str(v)) => Some(v.as_str()),
            _ => None,
        },
        _ => None,
    }
}

/// The DCP checkpoint `ck` (an `fsdp_dtensor` save) under megatron-core's names.
fn read(mut ck: Checkpoint) -> Result<Checkpoint> {
    let metadata = ck.path.join(crate::dcp::METADATA);
    let fail = |m: String| Error::format(&metadata, m);
    let args =
        ck.extras.iter().find(|e| e.name == "args").ok_or_else(|| {
            fail("has no `args` item: not a Megatron-LM fsdp_dtensor save".into())
        })?;
    let ns = args_of(args).map_err(&fail)?.ok_or_else(|| {
        fail(
            "its `args` item is not an argparse.Namespace: not a Megatron-LM fsdp_dtensor save"
                .into(),
        )
    })?;
    if str_arg(&ns, "ckpt_format") != Some("fsdp_dtensor") {
        return Err(fail(format!(
            "its args say ckpt_format={:?}, not fsdp_dtensor",
            str_arg(&ns, "ckpt_format").unwrap_or("(none)")
        )));
    }
    let local_spec = str_arg(&ns, "transformer_impl").is_none_or(|t| t == "local");
    // args decoded, and the values Megatron-LM's loader reads beside the model as common.pt's
    for e in &mut ck.extras {
        if e.name == "args" {
            e.value = crate::dcp::to_json(&ns);
            e.pickle = Some(ns.clone());
            e.opaque = None;
        }
        if COMMON.contains(&e.name.as_str()) {
            e.origin = crate::megatron::COMMON_ORIGIN;
        }
    }
    let mut model = 0;
    let mut tensors: Vec<TensorLayout> = Vec::with_capacity(ck.tensors.len());
    let mut halves: BTreeMap<String, [Option<TensorLayout>; 2]> = BTreeMap::new();
    // the generators' state of each rank of the run, which Megatron-LM's legacy reader and
    // megatron-core's torch_dist load of another split do not carry either
    let rng = |n: &str| n == "rng_state" || n.starts_with("rng_state.");
    ck.extras.retain(|e| !rng(&e.name));
    ck.tensors.retain(|t| !rng(&t.name));
    ck.paths.retain(|k, _| !rng(k));
    for mut t in std::mem::take(&mut ck.tensors) {
        let Some(name) = model_name(&t.name) else {
            tensors.push(t);
            continue;
        };
        model += 1;
        ck.paths.remove(&t.name);
        let name = te_norm_name(name, local_spec);
        if let Some((base, half)) = swiglu_half(&name) {
            let slot = &mut halves.entry(base.to_string()).or_default()[half];
            if slot.is_some() {
                return Err(fail(format!(
                    "`{}` is saved under two names",
                    crate::torch::short(&t.name)
                )));
            }
            *slot = Some(t);
            continue;
        }
        t.name = name;
        tensors.push(t);
    }
    if model == 0 {
        return Err(fail(
            "has no model tensors (`model.module.…`): not a Megatron-LM fsdp_dtensor save".into(),
        ));
    }
    for (base, [w, v]) in halves {
        let (Some(w), Some(v)) = (w, v) else {
            return Err(fail(format!(
                "`{base}`: SwiGLU's weight_w and weight_v must both be saved; one is missing"
            )));
        };
        tensors.push(join_halves(base, w, v).map_err(&fail)?);
    }
    let names: std::collections::HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    if names.len() != tensors.len() {
        return Err(fail(
            "two saved tensors have the same megatron-core name (a norm under both of its names?)"
                .into(),
        ));
    }
    ck.tensors = tensors;
    ck.format = Format::MEGATRON_FSDP;
    ck.producer = Some(format!(
        "Megatron-LM fsdp_dtensor (Megatron-FSDP), {}",
        ck.producer.as_deref().unwrap_or("torch")
    ));
    Ok(ck)
}

/// The megatron-core name of a saved model tensor: `model.` and the wrappers' `module.`
/// prefixes dropped; `None` for a key outside the model.
fn model_name(key: &str) -> Option<&str> {
    let mut rest = key.strip_prefix("model.")?;
    while let Some(r) = rest.strip_prefix("module.") {
        rest = r;
    }
    Some(rest)
}

/// The local layer spec's norms under TransformerEngine's names, as megatron-core's
/// `sharded_state_dict_keys_map` of that spec names them.
fn te_norm_name(name: &str, local_spec: bool) -> String {
    let Some((layer, rest)) = split_layer(name) else {
        return name.to_string();
    };
    if let Some(r) = rest.strip_prefix("input_layernorm.") {
        return format!("{layer}self_attention.linear_qkv.layer_norm_{r}");
    }
    match rest.strip_prefix("pre_mlp_layernorm.") {
        Some(r) if local_spec => format!("{layer}mlp.linear_fc1.layer_norm_{r}"),
        _ => name.to_string(),
    }
}

/// `decoder.layers.<i>.` and the rest of a layer's tensor name.
fn split_layer(name: &str) -> Option<(&str, &str)> {
    let at = name.find("layers.")? + "layers.".len();
    let digits = name[at..].bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || name.as_bytes().get(at + digits) != Some(&b'.') {
        return None;
    }
    Some(name.split_at(at + digits + 1))
}

/// For one half of SwiGLU's first projection (`….linear_fc1.weight_w`, `…bias_v`, a grouped
/// expert's `…weight3_w`): the joined tensor's name and which half (0: `_w`, 1: `_v`).
fn swiglu_half(name: &str) -> Option<(&str, usize)> {
    let (base, half) = match name.as_bytes() {
        [.., b'_', b'w'] => (&name[..name.len() - 2], 0),
        [.., b'_', b'v'] => (&name[..name.len() - 2], 1),
        _ => return None,
    };
    let last = base.rsplit('.').next()?;
    let kind = last.trim_end_matches(|c: char| c.is_ascii_digit());
    let fc1 = base[..base.len() - last.len()].ends_with("linear_fc1.");
    (fc1 && (kind == "weight" || kind == "bias")).then_some((base, half))
}

/// `w` over `v` along dim 0, as one tensor named `name`: `v`'s pieces moved down by `w`'s rows.
fn join_halves(
    name: String,
    w: TensorLayout,
    v: TensorLayout,
) -> std::result::Result<TensorLayout, String> {
    if w.dtype != v.dtype || w.shape != v.shape || w.shape.is_empty() {
        return Err(format!(
            "`{name}`: SwiGLU's halves differ ({} {:?} and {} {:?}) or are scalars",
            w.dtype, w.shape, v.dtype, v.shape
        ));
    }
    let rows = w.shape[0];
    let mut shape = w.shape.clone();
    shape[0] = rows * 2;
    let mut pieces = w.pieces;
    pieces.extend(v.pieces.into_iter().map(|mut p| {
        p.region.offsets[0] += rows;
        p
    }));
    Ok(TensorLayout {
        name,
        dtype: w.dtype,
        shape,
        pieces,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            model_name("model.module.module.decoder.final_layernorm.weight"),
            Some("decoder.final_layernorm.weight")
        );
        assert_eq!(model_name("optimizer.state.x"), None);
        assert_eq!(
            te_norm_name("decoder.layers.3.input_layernorm.weight", false),
            "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
        );
        assert_eq!(
            te_norm_name("decoder.layers.3.pre_mlp_layernorm.weight", true),
            "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
        );
        assert_eq!(
            te_norm_name("decoder.layers.3.pre_mlp_layernorm.weight", false),
            "decoder.layers.3.pre_mlp_layernorm.weight"
        );
        assert_eq!(
            swiglu_half("decoder.layers.0.mlp.linear_fc1.weight_v"),
            Some(("decoder.layers.0.mlp.linear_fc1.weight", 1))
        );
        assert_eq!(
            swiglu_half("decoder.layers.0.mlp.experts.linear_fc1.weight3_w"),
            Some(("decoder.layers.0.mlp.experts.linear_fc1.weight3", 0))
        );
        assert_eq!(
            swiglu_half("decoder.layers.0.mlp.linear_fc2.weight_w"),
            None
        );
        assert_eq!(swiglu_half("decoder.layers.0.mlp.linear_fc1.scale_w"), None);
    }
}
