"""Lightning Fabric's ``load``, at any world size and with no collectives.

:func:`load` keeps ``Fabric.load``'s contract — modules and optimizers in ``state`` are
filled in place, the other keys of ``state`` get their values from the checkpoint, and what
was not asked for is returned — but each rank reads only what it holds, from a checkpoint
saved at any world size, whatever the other ranks are doing (a separate process with no
process group works as well as a rank of a running job). It reads what Fabric writes:
sharded folders (DCP + ``meta.pt``) of the FSDP and ModelParallel strategies, and
single-file checkpoints (``torch.save`` of the whole dict: single device, or FSDP /
ModelParallel with full state dicts).
"""

import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple, Union

import torch

from . import Checkpoint, RequestError
from . import open as _open
from . import torch as _rt

__all__ = ["load"]

_METADATA_FILENAME = "meta.pt"


def _strategy_kind(fabric: Any) -> str:
    """``fsdp``, ``model_parallel`` or ``single`` (anything else: loaded as one device)."""
    strategy = getattr(fabric, "strategy", None) if fabric is not None else None
    if strategy is None:
        return "single"
    try:
        from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
    except ImportError:  # pragma: no cover - lightning without these strategies
        return "single"
    if isinstance(strategy, FSDPStrategy):
        return "fsdp"
    if isinstance(strategy, ModelParallelStrategy):
        return "model_parallel"
    return "single"


def _has_dtensor_modules(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and any(_rt._is_dtensor(p) for p in obj.parameters())


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _validate_keys_for_strict_loading(requested: Any, available: Any, strict: bool) -> None:
    """Fabric's check: a requested key the checkpoint lacks is a ``KeyError`` when strict."""
    invalid = [k for k in requested if k not in available]
    if strict and invalid:
        raise KeyError(
            f"The requested state contains a key '{invalid[0]}' that does not exist in the loaded checkpoint."
            f" To disable strict loading, set `strict=False`."
        )


_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _clean_fqn(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def _owner(optimizer: torch.optim.Optimizer, modules: Dict[str, torch.nn.Module]) -> Tuple[str, torch.nn.Module]:
    """The module whose parameters ``optimizer`` updates."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for key, module in modules.items():
        if any(id(p) in ids for p in module.parameters()):
            return key, module
    if len(modules) == 1:
        return next(iter(modules.items()))
    raise RequestError("no module in the state holds the parameters of the optimizer")


def _int_keyed(ck: Checkpoint, prefix: str) -> bool:
    """Whether the checkpoint's optimizer state under ``prefix`` is keyed by parameter index
    (``optimizer.state_dict()`` of a plain optimizer) rather than by parameter name."""
    head = prefix.rstrip(".")
    for parts in ck.paths().values():
        if len(parts) >= 3 and parts[0] == head and parts[1] == "state":
            return isinstance(parts[2], int)
    return False


def _load_optimizer_by_index(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, ck: Checkpoint, prefix: str, strict: bool
) -> None:
    """Load an optimizer state keyed by parameter index into ``optimizer`` through its
    name-keyed state dict (``get_optimizer_state_dict``), so that any sharding works."""
    names = {id(p): _clean_fqn(n) for n, p in module.named_parameters(remove_duplicate=False)}
    index: Dict[int, str] = {}
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise RequestError(f"{ck.path}: the optimizer updates a parameter the module does not have")
            index[i] = names[id(p)]
            i += 1
    paths = ck.paths()
    head = prefix.rstrip(".")

    def rename(name: str) -> Optional[str]:
        parts = paths.get(name)
        if not parts or parts[0] != head:
            return None
        rest = list(parts[1:])
        if len(rest) >= 2 and rest[0] == "state" and isinstance(rest[1], int):
            if rest[1] not in index:
                return ".".join(str(p) for p in rest)  # unexpected: no such parameter
            return ".".join(["state", index[rest[1]]] + [str(p) for p in rest[2:]])
        if len(rest) >= 3 and rest[0] == "param_groups" and rest[2] == "params":
            return None  # indices here, names in the target: the target's own are kept
        return ".".join(str(p) for p in rest)

    res = _rt._load_optimizer_state(module, optimizer, ck, False, rename)
    missing = [k for k in res.missing_keys if not (k.startswith("param_groups.") and k.endswith(".params"))]
    _finish_optimizer(optimizer, ck, prefix, _rt.LoadResult(missing, res.unexpected_keys), strict)


def _finish_optimizer(optimizer: torch.optim.Optimizer, ck: Checkpoint, prefix: str, res: "_rt.LoadResult", strict: bool) -> None:
    """After a non-strict optimizer load: ``param_groups`` entries the optimizer lacks (such
    as a scheduler's ``initial_lr``) are set, as ``Optimizer.load_state_dict`` sets them;
    any other mismatch is an error when ``strict``."""
    values = None
    other: List[str] = []
    for name in res.unexpected_keys:
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "param_groups" and parts[1].isdigit() and int(parts[1]) < len(optimizer.param_groups):
            if values is None:
                values = ck.values()
            if prefix + name in values:
                optimizer.param_groups[int(parts[1])][parts[2]] = values[prefix + name]
                continue
        other.append(name)
    if strict and (res.missing_keys or other):
        msg = []
        if res.missing_keys:
            msg.append(f"{len(res.missing_keys)} key(s) of the optimizer are not in it: {_rt._few(res.missing_keys)}")
        if other:
            msg.append(f"{len(other)} of its entries have no place in the optimizer: {_rt._few(other)}")
        raise RequestError(f"{ck.path}: `{prefix.rstrip('.')}`: " + "; ".join(msg) + " (pass strict=False to load the rest)")


def load(fabric: Any, path: Union[str, "os.PathLike[str]"], state: Optional[Dict[str, Any]], strict: bool = True) -> Dict[str, Any]:
    """``fabric.load(path, state, strict)`` without collectives, for a checkpoint of any
    world size: each module of ``state`` gets the parameters and buffers it holds
    (:func:`reshard.torch.load_model` from the entries ``<key>.*``), each optimizer its state
    (:func:`reshard.torch.load_optimizer`; index-keyed states of single-device checkpoints are
    mapped to parameter names), and every other key of ``state`` its value from the
    checkpoint (objects with ``load_state_dict`` loaded through it, for single files, as
    Fabric does). ``_FabricModule`` / ``_FabricOptimizer`` wrappers are unwrapped.

    Returns what was not asked for: the rest of ``meta.pt`` for a sharded folder, the rest of
    the checkpoint for a single file. ``strict``: a key of ``state`` the checkpoint lacks is a
    ``KeyError`` (modules and optimizers: :class:`reshard.RequestError`), and module and
    optimizer keys must match exactly. ``fabric`` is only inspected (its strategy decides
    which modules count as the model, as in Fabric); it may be ``None`` (one device).
    """
    from lightning.fabric.wrappers import (
        _FabricDataLoader,
        _FabricModule,
        _FabricOptimizer,
        _unwrap_compiled,
        _unwrap_objects,
    )

    path = Path(os.fspath(path))
    kind = _strategy_kind(fabric)
    if not state:
        if kind != "single":
            raise ValueError(
                f"Got reshard.lightning.load(..., state={state!r}) but a state with at least a model instance"
                " to reload is required. Pass it in like so: load(fabric, path, {'model': model, ...})"
            )
        if path.is_file():
            return torch.load(path, mmap=True, map_location="cpu", weights_only=True)
        raise ValueError(f"{path}: a sharded checkpoint needs a state with the model to load into")

    unwrapped = _unwrap_objects(state)
    if isinstance(unwrapped, torch.nn.Module):
        _rt.load_model(unwrapped, path, strict=strict, prefix="")
        return {}
    if isinstance(unwrapped, torch.optim.Optimizer):
        raise NotImplementedError("Loading a single optimizer object from a checkpoint is not supported.")
    remainder = _load_dict(path, unwrapped, strict, kind)
    # Fabric.load: values set in the unwrapped dict are copied back into the caller's.
    for k in list(unwrapped.keys()):
        obj, _ = _unwrap_compiled(state[k])
        if isinstance(obj, (_FabricModule, _FabricOptimizer, _FabricDataLoader)):
            continue
        state[k] = unwrapped[k]
    return remainder


def _load_dict(path: Path, state: Dict[str, Any], strict: bool, kind: str) -> Dict[str, Any]:
    if kind == "fsdp":
        modules = {k: v for k, v in state.items() if _rt._has_fsdp1(v)}
    elif kind == "model_parallel":
        modules = {k: v for k, v in state.items() if _has_dtensor_modules(v)}
    else:
        modules = {k: v for k, v in state.items() if isinstance(v, torch.nn.Module)}
    optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
    if kind != "single":
        if not modules:
            raise ValueError(
                "Could not find a distributed model in the provided checkpoint state. Please provide the model as"
                " part of the state like so: `load(fabric, path, {'model': model, ...})`."
            )
        if len(modules) > 1:
            raise ValueError("Found multiple distributed models in the given state; load one model per checkpoint.")

    sharded = path.is_dir() and (path / _METADATA_FILENAME).is_file()
    if not sharded and not path.is_file():
        if path.is_dir():
            # a bare DCP folder (no meta.pt): no metadata to return
            pass
        else:
            raise ValueError(
                f"The path {str(path)!r} does not point to a valid checkpoint. Make sure the path points to either a"
                " directory with distributed checkpoint shards, or a single file with a full checkpoint."
            )
    ck = _open(path)
    requested = [k for k in state if k not in modules and k not in optimizers]

    if not sharded and path.is_file():
        tops = _top_keys(ck)
        _validate_keys_for_strict_loading(state.keys(), tops, strict=strict)

    for key, module in modules.items():
        if not strict and not _has_prefix(ck, f"{key}."):
            continue
        _rt.load_model(module, ck, strict=strict, prefix=f"{key}.")
    for key, optimizer in optimizers.items():
        if not strict and not _has_prefix(ck, f"{key}."):
            continue
        _mkey, module = _owner(optimizer, modules)
        if _int_keyed(ck, f"{key}."):
            _load_optimizer_by_index(module, optimizer, ck, f"{key}.", strict)
        else:
            res = _rt.load_optimizer(module, optimizer, ck, strict=False, prefix=f"{key}.")
            _finish_optimizer(optimizer, ck, f"{key}.", res, strict)

    if path.is_dir():
        # Fabric's own read of meta.pt: the values not asked for are the remainder.
        metadata: Dict[str, Any] = (
            torch.load(path / _METADATA_FILENAME, map_location="cpu", weights_only=True) if sharded else {}
        )
        _validate_keys_for_strict_loading(requested, metadata.keys(), strict=strict)
        for key in requested:
            if key in metadata:
                state[key] = metadata.pop(key)
        return metadata

    # One file: the remainder is the checkpoint without what was loaded; mmap keeps the
    # tensors on disk until used.
    checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
    for key in list(modules) + list(optimizers):
        checkpoint.pop(key, None)
    for key in requested:
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if _is_stateful(state[key]) and not isinstance(state[key], (torch.nn.Module, torch.optim.Optimizer)):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


def _top_keys(ck: Checkpoint) -> Set[str]:
    """The top-level keys of a checkpoint's state dict."""
    paths = ck.paths()
    out: Set[str] = set()
    for name in ck.keys():
        parts = paths.get(name)
        out.add(str(parts[0]) if parts else name.split(".", 1)[0])
    return out


def _has_prefix(ck: Checkpoint, prefix: str) -> bool:
    return any(n.startswith(prefix) for n in ck.keys())
