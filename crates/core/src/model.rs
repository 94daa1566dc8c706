//! The format-neutral pieces of a checkpoint that every floor above may name: the nesting of
//! flat keys ([`KeyPart`]), non-tensor entries ([`Extra`], holding a Python [`Value`]), the
//! CRC-32s files record of their own bytes ([`RecordCrc`]), and which copy of the parameters
//! a format keeps two of ([`Weights`]). The checkpoint itself, which holds its codec and its
//! storage, lives with the formats.

use crate::value::Value;
use serde::Serialize;

/// One element of a key's path in the nested state dict: a dict key or a list index
/// (DCP's `planner_data`), or an int dict key (`optimizer.state_dict()["state"]` is keyed by
/// parameter number; DCP turns such keys into strings, `torch.save` files keep them).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum KeyPart {
    /// A dict key.
    Key(String),
    /// A list index.
    Index(i64),
    /// An int dict key (JSON: `{"int": 3}`).
    IntKey {
        /// The key.
        int: i64,
    },
}

impl KeyPart {
    /// The text this part adds to a flat name (Python's `str` of the key or index).
    pub fn text(&self) -> String {
        match self {
            KeyPart::Key(k) => k.clone(),
            KeyPart::Index(i) | KeyPart::IntKey { int: i } => i.to_string(),
        }
    }
}

/// A non-tensor entry of a checkpoint: a DCP `BYTE_IO` item (step counters, `param_groups`,
/// scheduler state) or a key of Lightning's `meta.pt`.
#[derive(Clone, Debug, Serialize)]
pub struct Extra {
    /// The flat key (`optimizer.param_groups.0.lr`, `step`).
    pub name: String,
    /// The decoded value, JSON-ified for display (tuples become lists, None null; values JSON
    /// cannot hold exactly are shown as strings such as `"<bytes: 12>"`).
    pub value: serde_json::Value,
    /// The decoded Python value, for writers that re-emit it.
    #[serde(skip)]
    pub pickle: Option<Value>,
    /// Where the original serialized item lives: (file index, offset, length).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub raw: Option<(u32, u64, u64)>,
    /// Where it came from (`dcp`, `meta.pt`).
    pub origin: &'static str,
    /// Set when the value is kept only as its stored bytes ([`Opaque`]); `pickle` is then
    /// `None` and `value` a placeholder naming the global.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub opaque: Option<Opaque>,
}

/// A non-tensor value whose pickle names a global outside the reader's allow-list (a class
/// of the training script, or anything hostile): nothing of it is imported or called, it is
/// kept as the stored `torch.save` stream, which DCP outputs copy unchanged and which torch
/// itself unpickles when a caller asks it to.
#[derive(Clone, Debug, Serialize)]
pub struct Opaque {
    /// The first global outside the allow-list, dotted (`mymod.TrainState`).
    pub global: String,
    /// The stored bytes (a DCP `BYTE_IO` item: a whole `torch.save` stream).
    #[serde(skip)]
    pub bytes: std::sync::Arc<[u8]>,
}

impl Extra {
    /// The one-line reason its value cannot be given as a Python value, when it is opaque:
    /// `` `obj` is a pickle of `mymod.TrainState`, which reshard does not import``.
    pub fn opaque_reason(&self) -> Option<String> {
        self.opaque.as_ref().map(|o| {
            format!(
                "non-tensor value `{}` is a pickle naming `{}`, which reshard does not import or call",
                self.name, o.global
            )
        })
    }
}

/// Where parameter values come from, for formats that keep more than one copy of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Weights {
    /// The fp32 master weights an optimizer keeps (DeepSpeed's optim files, as
    /// `zero_to_fp32` reads them): the default.
    Master,
    /// The model's own weights in its training dtype (DeepSpeed's `module`, bf16 for a bf16
    /// job; ZeRO stages 1 and 2).
    Model,
}

impl std::fmt::Display for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Weights::Master => "master",
            Weights::Model => "model",
        })
    }
}

impl std::str::FromStr for Weights {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "master" | "fp32" => Ok(Weights::Master),
            "model" | "module" => Ok(Weights::Model),
            _ => Err(format!("unknown weights `{s}` (expected master or model)")),
        }
    }
}

/// A byte range of a checkpoint file and the CRC-32 the file records for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordCrc {
    /// Index into the checkpoint's files.
    pub file: u32,
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The recorded CRC-32.
    pub crc: u32,
    /// What the range holds, for messages (`record archive/data/3`, `tensor w`).
    pub what: std::sync::Arc<str>,
    /// The file to name in messages when it is not `file` (the `.distcp` file a
    /// zstd-compressed item came from, whose decoded bytes `file` holds).
    pub shown: Option<u32>,
}
