//! The allow-lists of globals a pickle may name: [`Globals`], and the two torch uses.

use crate::torch::dtype;
use std::collections::HashSet;

/// Allow-list of globals (`module.name`) that a pickle may reference.
#[derive(Debug, Clone, Default)]
pub struct Globals {
    exact: HashSet<(String, String)>,
    modules: HashSet<String>,
}

impl Globals {
    /// An empty allow-list: no global is accepted.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allow exactly these `(module, name)` pairs.
    pub fn from_pairs(pairs: &[(&str, &str)]) -> Self {
        let mut g = Self::new();
        for (m, n) in pairs {
            g.allow(m, n);
        }
        g
    }

    /// Allow `module.name`.
    pub fn allow(&mut self, module: &str, name: &str) -> &mut Self {
        self.exact.insert((module.to_owned(), name.to_owned()));
        self
    }

    /// Allow every name of `module` (exact module name, not its submodules).
    pub fn allow_module(&mut self, module: &str) -> &mut Self {
        self.modules.insert(module.to_owned());
        self
    }

    /// Add every entry of `other`.
    #[cfg(any(test, feature = "internals"))]
    pub fn extend(&mut self, other: &Globals) -> &mut Self {
        self.exact.extend(other.exact.iter().cloned());
        self.modules.extend(other.modules.iter().cloned());
        self
    }

    /// Whether `module.name` is on the list (its module whole, or the name itself).
    pub fn is_allowed(&self, module: &str, name: &str) -> bool {
        self.modules.contains(module) || self.exact.contains(&(module.to_owned(), name.to_owned()))
    }

    /// Allow every `torch.<dtype>` name, aliases included ([`dtype::global_names`]).
    fn allow_torch_dtypes(&mut self) -> &mut Self {
        for d in dtype::global_names() {
            self.allow("torch", d);
        }
        self
    }
}

/// Allow-list for DCP `.metadata` files written by torch 2.1 … 2.15
/// (`docs/pytorch-formats.md` §2.2), plus `collections.OrderedDict`.
pub fn dcp_metadata_globals() -> Globals {
    const CKPT_META: &str = "torch.distributed.checkpoint.metadata";
    const SHARDED_META: &str = "torch.distributed._shard.sharded_tensor.metadata";
    const PLANNER: &str = "torch.distributed.checkpoint.planner";
    const MCORE_TORCH: &str = "megatron.core.dist_checkpointing.strategies.torch";
    let mut g = Globals::from_pairs(&[
        (CKPT_META, "Metadata"),
        (CKPT_META, "TensorStorageMetadata"),
        (CKPT_META, "ChunkStorageMetadata"),
        (CKPT_META, "BytesStorageMetadata"),
        (CKPT_META, "MetadataIndex"),
        (CKPT_META, "TensorProperties"),
        (CKPT_META, "_MEM_FORMAT_ENCODING"),
        (CKPT_META, "StorageMeta"),
        (SHARDED_META, "TensorProperties"),
        (SHARDED_META, "MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        // megatron-core's `torch_dist` metadata: its `Metadata` subclass (with `mcore_data`,
        // 0.15) and the save plans it records in `all_local_plans` (0.16), read as values
        (MCORE_TORCH, "MCoreMetadata"),
        (MCORE_TORCH, "MCoreSavePlan"),
        (PLANNER, "SavePlan"),
        (PLANNER, "WriteItem"),
        (PLANNER, "WriteItemType"),
        (PLANNER, "TensorWriteData"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    ]);
    g.allow_torch_dtypes();
    g
}

/// Allow-list for `torch.save` files of plain values beside a checkpoint (Lightning's
/// `meta.pt`, megatron-core's `common.pt`): [`torch_save_globals`] plus `argparse.Namespace`,
/// which Megatron-LM saves its arguments as (read as an object with its `__dict__`), and the
/// enums of megatron-core those arguments hold (`AttnBackend.auto`: a call of the class with
/// its value, read as such, never made), and `signal.Signals` (Megatron-LM's `exit_signal`).
pub fn pickled_dict_globals() -> Globals {
    let mut g = torch_save_globals();
    g.allow("argparse", "Namespace");
    g.allow("signal", "Signals");
    g.allow_module("megatron.core.enums");
    g.allow_module("megatron.core.transformer.enums");
    g
}

/// Allow-list for Megatron-LM's per-rank `model_optim_rng.pt` files (`--ckpt-format torch`):
/// [`pickled_dict_globals`] (its `args`) plus the numpy names its RNG state pickles (numpy's
/// `get_state()`: an array rebuilt by `_reconstruct`, its `dtype`, scalars), read as values
/// and never called.
pub fn megatron_legacy_globals() -> Globals {
    let mut g = pickled_dict_globals();
    for m in ["numpy.core.multiarray", "numpy._core.multiarray"] {
        g.allow(m, "_reconstruct");
        g.allow(m, "scalar");
    }
    g.allow("numpy", "ndarray");
    g.allow("numpy", "dtype");
    g.allow_module("numpy.dtypes");
    g
}

/// Allow-list for `data.pkl` of `torch.save` archives: what `torch.load(weights_only=True)`
/// accepts (`docs/pytorch-formats.md` §8.1) plus torch dtypes, `_rebuild_parameter`, and
/// `_io.BytesIO`, the buffer trainers keep state in (read as an object whose state is its
/// bytes, position and `__dict__`; nothing is called).
pub fn torch_save_globals() -> Globals {
    let mut g = Globals::from_pairs(&[
        ("collections", "OrderedDict"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_tensor_v3"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        // the plain tensor class `_rebuild_from_type_v2` names for a tensor saved with Python
        // attributes
        ("torch", "Tensor"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.serialization", "_get_layout"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("builtins", "bytearray"),
        // `b''` in protocol < 3 is `__builtin__.bytes()`.
        ("builtins", "bytes"),
        ("_codecs", "encode"),
        ("_io", "BytesIO"),
    ]);
    for s in dtype::storage_classes() {
        g.allow("torch", s);
    }
    g.allow_torch_dtypes();
    g
}
