//! Block-quantized FP8 weights (DeepSeek-V3's, and `transformers`' `FineGrainedFP8Config`):
//! a `float8_e4m3fn` weight `W` `[M, N]` beside its `f32` `W_scale_inv`
//! `[⌈M/128⌉, ⌈N/128⌉]` (one scale per block of 128 × 128, the edge blocks partial), and
//! `config.json`'s `quantization_config` (`"quant_method": "fp8"`, `"weight_block_size"`).
//!
//! Dequantizing is a cast of the executor, not a pass of its own: a conversion with a
//! target dtype (`--dtype bf16`) plans each quantized weight as a copy whose
//! [`Cast`](crate::plan::Cast) carries a [`BlockScale`] — where the scale tensor's bytes
//! are, the block size, and where the weight's element `[0, 0]` is. The plan stays pure and
//! serializable (it names bytes, it reads none); the executor reads, for the rows a copy
//! covers, the block rows of scales it needs beside its source bytes, so memory stays within
//! its window however large the tensor, and every way a copy is cut (windows, threads,
//! strided pieces of a sharded target) finds each element's block from its byte offset.
//! Each element is `f32(x) · scale` rounded once to the target dtype, DeepSeek-V3's
//! `weight_dequant` bit for bit. The scale tensors are left out of such an output and
//! `quantization_config` out of its `config.json`. Without a target dtype an FP8 checkpoint
//! is copied as it is, scales included.
//!
//! Why not a second source of a view, or a pass before planning: a view maps target
//! elements to source elements one to one, while a scale is shared by a block, and a pass
//! before planning would hold dequantized tensors in memory or on disk.
//!
//! Not covered: quantizing (bf16/f32 → FP8 needs each block's maximum before any of its
//! elements is written, a reduction no copy does), and gpt-oss's MXFP4 (`*_blocks` of two
//! fp4 values per byte with E8M0 `*_scales` per 32 values: one source byte becomes two
//! elements, and the weight's shape and axes differ from the blocks', which a cast that
//! keeps the element count and the shape cannot express).

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::layout::{DType, TensorLayout};
use crate::plan::BlockScale;
use std::collections::HashMap;

/// The suffix that names a weight's scales: `W` → `W_scale_inv`.
pub const SCALE_SUFFIX: &str = "_scale_inv";

/// The block size when `config.json` does not say it.
pub const DEFAULT_BLOCK: [u64; 2] = [128, 128];

/// The FP8 quantization of a checkpoint: its block size and its quantized weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quantization {
    /// Rows and columns of a block.
    pub block: [u64; 2],
    /// Names of the quantized weights (each with a scale tensor beside it), in checkpoint order.
    pub weights: Vec<String>,
}

impl std::fmt::Display for Quantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FP8 block {}×{}, {} tensor{}",
            self.block[0],
            self.block[1],
            self.weights.len(),
            if self.weights.len() == 1 { "" } else { "s" }
        )
    }
}

/// The `quantization_config` of the checkpoint's `config.json`, when it is FP8's.
fn config(ck: &Checkpoint) -> Option<serde_json::Value> {
    let (_, bytes) = ck.companions.iter().find(|(n, _)| n == "config.json")?;
    let v: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let q = v.get("quantization_config")?;
    (q.get("quant_method").and_then(|m| m.as_str()) == Some("fp8")).then(|| q.clone())
}

/// The block size of `ck`'s FP8 quantization: `config.json`'s `weight_block_size`, else
/// [`DEFAULT_BLOCK`]. A malformed one is an error naming the checkpoint.
pub fn block_size(ck: &Checkpoint) -> Result<[u64; 2]> {
    let Some(q) = config(ck) else {
        return Ok(DEFAULT_BLOCK);
    };
    match q.get("weight_block_size") {
        None | Some(serde_json::Value::Null) => Ok(DEFAULT_BLOCK),
        Some(v) => match v.as_array().map(|a| a.iter().map(|x| x.as_u64()).collect::<Vec<_>>()) {
            Some(a) if a.len() == 2 && a.iter().all(|x| x.is_some_and(|x| x > 0)) => {
                Ok([a[0].unwrap_or(1), a[1].unwrap_or(1)])
            }
            _ => Err(Error::format(
                &ck.path,
                format!("config.json: quantization_config.weight_block_size is {v}, not two positive integers"),
            )),
        },
    }
}

/// Whether the `F8_E4M3` tensor `name` of `ck` has a scale tensor beside it (and so is
/// dequantized by a `--dtype` cast).
pub fn has_scale(ck: &Checkpoint, name: &str) -> bool {
    ck.tensor(&scale_name(name)).is_some()
}

/// Whether tensor `name` of `ck` is the scale tensor of an FP8 weight.
pub fn is_scale(ck: &Checkpoint, name: &str) -> bool {
    name.strip_suffix(SCALE_SUFFIX)
        .and_then(|w| ck.tensor(w))
        .is_some_and(|w| w.dtype == DType::F8E4M3)
}

/// The FP8 quantization of `ck`: the `F8_E4M3` tensors with a scale tensor beside them;
/// `None` when it has none.
pub fn quantization(ck: &Checkpoint) -> Result<Option<Quantization>> {
    let weights: Vec<String> = ck
        .tensors
        .iter()
        .filter(|t| t.dtype == DType::F8E4M3 && ck.tensor(&scale_name(&t.name)).is_some())
        .map(|t| t.name.clone())
        .collect();
    if weights.is_empty() {
        return Ok(None);
    }
    Ok(Some(Quantization {
        block: block_size(ck)?,
        weights,
    }))
}

/// The name of weight `name`'s scale tensor.
pub fn scale_name(name: &str) -> String {
    format!("{name}{SCALE_SUFFIX}")
}

/// The file a tensor's first piece is in, to name in errors (the checkpoint's path if none).
fn file_of<'a>(ck: &'a Checkpoint, t: &TensorLayout) -> &'a std::path::Path {
    t.pieces
        .first()
        .and_then(|p| ck.files.get(p.loc.file as usize))
        .unwrap_or(&ck.path)
}

/// The [`BlockScale`]s that dequantize the `F8_E4M3` tensors of `selected` (source layouts,
/// their output names beside them), by output name, each from the `f32` scale tensor beside
/// it, of the shape its blocks need (else a one-line error naming the file). An `F8_E4M3`
/// tensor without a scale is left as it is, unless the model's `config.json` declares a
/// `quantization_config`: then it is an error, as a quantized weight whose scale is missing.
pub fn scales<'a>(
    ck: &Checkpoint,
    selected: impl IntoIterator<Item = (&'a TensorLayout, &'a str)>,
) -> Result<HashMap<String, BlockScale>> {
    let mut out = HashMap::new();
    let mut block = None;
    for (t, name) in selected {
        if t.dtype != DType::F8E4M3 {
            continue;
        }
        let block = match block {
            Some(b) => b,
            None => *block.insert(block_size(ck)?),
        };
        let sname = scale_name(&t.name);
        let Some(s) = ck.tensor(&sname) else {
            if config(ck).is_none() {
                continue; // a plain FP8 tensor: nothing says how to dequantize it
            }
            return Err(Error::format(
                file_of(ck, t),
                format!(
                    "{} is F8_E4M3 with no scale tensor {sname} beside it: it cannot be dequantized",
                    t.name
                ),
            ));
        };
        let bs = BlockScale::of(t, s, block)
            .map_err(|m| Error::format(file_of(ck, s), format!("{sname} {m}")))?;
        out.insert(name.to_string(), bs);
    }
    Ok(out)
}

/// `config.json` (bytes) without its `quantization_config`; other bytes unchanged.
pub fn strip_config(bytes: &[u8]) -> Vec<u8> {
    let Ok(serde_json::Value::Object(mut v)) = serde_json::from_slice(bytes) else {
        return bytes.to_vec();
    };
    if v.remove("quantization_config").is_none() {
        return bytes.to_vec();
    }
    let mut text = serde_json::to_vec_pretty(&v).unwrap_or_else(|_| bytes.to_vec());
    text.push(b'\n');
    text
}
