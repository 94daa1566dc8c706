"""Loading checkpoints into PyTorch state dicts and models at any world size, with no
collectives.

- :func:`load` fills a state dict in place, like ``torch.distributed.checkpoint.load``:
  ``DTensor`` s (any mesh and placements), ``ShardedTensor`` s and plain tensors get
  exactly the region they hold, read from the files straight into their memory.
- :func:`load_model` / :func:`load_optimizer`: the usual resume, through
  ``torch.distributed.checkpoint.state_dict`` (FSDP2, FSDP1 and plain modules).
- :class:`StorageReader`: a ``torch.distributed.checkpoint.StorageReader``, so
  ``dcp.load(sd, storage_reader=reshard.torch.StorageReader(path), no_dist=True)`` reads
  every format reshard reads.

No function here calls a collective or needs a process group (``load_model`` of an FSDP1
module needs the one FSDP1 itself needs to build its state dict): each rank reads what it
holds, whatever the other ranks do. The shard each rank holds is computed by the Rust
library from the tensor's mesh coordinate and placements.
"""

import inspect
import re
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import Checkpoint, RequestError, _reshard
from . import open as _open
from ._fill import Fill, Parts

__all__ = ["load", "load_model", "load_optimizer", "LoadResult", "StorageReader"]


class LoadResult(NamedTuple):
    """What :func:`load` could not match: state-dict keys the checkpoint lacks, and
    checkpoint entries under the state dict's top-level keys that it has no place for."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def _checkpoint(path: Any) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else _open(path)


def _is_stateful(v: Any) -> bool:
    return (
        not isinstance(v, (torch.Tensor, Mapping, list, tuple))
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


class _Leaf(NamedTuple):
    path: Tuple[Any, ...]
    container: Any
    key: Any
    value: Any


def _walk(obj: Any, path: Tuple[Any, ...], leaves: List[_Leaf], nodes: Dict[str, Tuple[Any, Any, Tuple[Any, ...]]], parent: Any, key: Any) -> None:
    """Collect the leaves (tensors and other values) of a nested state dict, and every inner
    node by flat name (a checkpoint value may replace a whole node)."""
    if path:
        nodes[_flat(path)] = (parent, key, path)
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _walk(v, path + (k,), leaves, nodes, obj, k)
    elif isinstance(obj, list) and any(isinstance(v, (Mapping, list, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            _walk(v, path + (i,), leaves, nodes, obj, i)
    else:
        leaves.append(_Leaf(path, parent, key, obj))


def _flat(path: Sequence[Any]) -> str:
    return ".".join(str(p) for p in path)


def _placement(p: Any, name: str) -> str:
    """A DTensor placement as the Rust layout algebra names it."""
    cls = type(p).__name__
    if cls == "_StridedShard":
        return f"StridedShard({p.dim}, {p.split_factor})"
    if cls == "Shard" or (hasattr(p, "is_shard") and p.is_shard() and hasattr(p, "dim")):
        return f"Shard({p.dim})"
    if cls == "Replicate" or (hasattr(p, "is_replicate") and p.is_replicate()):
        return "Replicate"
    raise RequestError(f"tensor `{name}`: placement {p} cannot be loaded (only Shard, _StridedShard and Replicate can)")


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "device_mesh") and hasattr(t, "placements")


def _is_sharded_tensor(t: Any) -> bool:
    return type(t).__name__ == "ShardedTensor" and hasattr(t, "local_shards")


def _add(fill: Fill, src: str, dest: torch.Tensor, parts: Parts, what: str) -> None:
    """Add target ``dest`` of checkpoint tensor ``src`` to ``fill``."""
    if dest.device.type == "meta":
        raise RequestError(f"{what}: is on the meta device; allocate it (to_empty) before loading")
    if dest.numel() == 0:
        return  # an empty shard (chunks past a dim's end): nothing to read, its offsets unused
    fill.add(src, dest, parts)


def _check_shape(what: str, want: Sequence[int], have: Sequence[int]) -> None:
    if tuple(want) != tuple(have):
        raise RequestError(
            f"{what}: the checkpoint's shape is {list(have)}, the state dict's {list(want)}"
        )


def _plan_tensor(fill: Fill, src: str, shape: Tuple[int, ...], t: torch.Tensor, what: str) -> None:
    """Add the destinations of target tensor ``t`` for checkpoint tensor ``src``."""
    if _is_dtensor(t):
        _check_shape(what, t.shape, shape)
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            return  # this rank is not in the tensor's mesh: it holds nothing
        placements = [_placement(p, what) for p in t.placements]
        local = t._local_tensor if hasattr(t, "_local_tensor") else t.to_local()
        lshape, parts = _reshard.local_tensor(list(shape), list(mesh.mesh.shape), placements, list(coord))
        _check_shape(f"{what} (local shard)", local.shape, lshape)
        _add(fill, src, local, [(list(o), list(s), list(a)) for (o, s, a) in parts], what)
    elif _is_sharded_tensor(t):
        _check_shape(what, t.size(), shape)
        for shard in t.local_shards():
            offs = list(shard.metadata.shard_offsets)
            sizes = list(shard.metadata.shard_sizes)
            _check_shape(f"{what} (local shard at {offs})", shard.tensor.shape, sizes)
            _add(fill, src, shard.tensor, [(offs, sizes, [0] * len(sizes))], what)
    else:
        _check_shape(what, t.shape, shape)
        _add(fill, src, t, [([0] * len(shape), list(shape), [0] * len(shape))], what)


# megatron-core's sharded state dict (`model.sharded_state_dict()`): each entry a
# `ShardedTensor` whose `key` is the checkpoint's name and whose `data` (a parameter, or a view
# of one) is the block at `global_offset` of the global tensor, behind `prepend_axis_num`
# stacked axes of size 1; a `ShardedTensorFactory` builds such entries over views of its
# parameter (SwiGLU's `[gate_r; up_r]` as two blocks); `ShardedObject`s hold no tensor.
_MegatronParts = Dict[str, List[Tuple[torch.Tensor, List[int], List[int], Tuple[int, ...]]]]


def _megatron_kind(v: Any) -> Optional[str]:
    """The class name of a megatron-core dist_checkpointing entry, else None."""
    if type(v).__module__.startswith("megatron.core.dist_checkpointing"):
        return type(v).__name__
    return None


def _split_megatron(sd: Dict[str, Any]) -> Tuple[Dict[str, Any], _MegatronParts]:
    """``sd`` without its megatron-core sharded entries (dicts holding none are kept as
    they are), and those entries' blocks by checkpoint key."""
    parts: _MegatronParts = {}

    def add(st: Any) -> None:
        kind = _megatron_kind(st)
        if kind == "ShardedTensorFactory":
            built = st.build()
            for x in (built.values() if isinstance(built, Mapping) else built if isinstance(built, (list, tuple)) else [built]):
                add(x)
            return
        if kind != "ShardedTensor":
            return  # ShardedObject (TransformerEngine's _extra_state, RNG state): no tensor to fill
        if getattr(st, "flattened_range", None) is not None:
            raise RequestError(f"tensor `{st.key}`: a flattened range (the distributed optimizer's layout) is not loaded; load the model's parameters")
        n = int(st.prepend_axis_num)
        data = st.data[(None,) * n] if n else st.data
        parts.setdefault(st.key, []).append((data, list(st.global_offset), list(data.shape), tuple(st.global_shape)))

    def visit(d: Mapping) -> Tuple[Dict[str, Any], bool]:
        out: Dict[str, Any] = {}
        found = False
        for k, v in d.items():
            if _megatron_kind(v) is not None:
                add(v)
                found = True
            elif isinstance(v, Mapping):
                inner, f = visit(v)
                out[k] = inner if f else v
                found = found or f
            else:
                out[k] = v
        return out, found

    rest, _found = visit(sd)
    return rest, parts


def _plan_megatron(fill: Fill, src: str, shape: Tuple[int, ...], blocks: List[Any], what: str) -> None:
    """Add the blocks of a megatron-core sharded entry of checkpoint tensor ``src``."""
    for data, offs, sizes, global_shape in blocks:
        _check_shape(what, global_shape, shape)
        _add(fill, src, data, [(offs, sizes, [0] * len(sizes))], what)


def _rename_fn(rename: Any) -> Callable[[str], Optional[str]]:
    if rename is None:
        return lambda n: n
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda n: table.get(n, n)
    if callable(rename):
        return rename
    raise RequestError("rename must be a dict {checkpoint name: state-dict name} or a callable")


def load(
    state_dict: Dict[str, Any],
    path: Any,
    *,
    strict: bool = True,
    include: Optional[Sequence[str]] = None,
    exclude: Optional[Sequence[str]] = None,
    rename: Any = None,
    recipe: Optional[str] = None,
    params: Optional[Mapping[str, Any]] = None,
    progress: Any = None,
) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` (any world size, any
    format reshard reads; an open :class:`reshard.Checkpoint` works too), like
    ``torch.distributed.checkpoint.load``.

    Across frameworks: with ``recipe`` (a built-in's name, a recipe file, or ``"auto"`` for
    the one the checkpoint's configuration calls for) and optional ``params``, the
    checkpoint's tensors are read as the other framework's (a megatron-core checkpoint as a
    Hugging Face model's state dict: ``q_proj`` out of the fused QKV, the vocabulary without
    its padding), each target read through its view from the files, nothing materialised
    and no file written; ``include``/``exclude``/``rename`` then apply to the target names.
    See docs/recipes.md.

    Each tensor gets exactly what it holds: a ``DTensor`` its local shard (from its mesh
    coordinate and placements: ``Shard``, ``_StridedShard``, ``Replicate``, uneven and empty
    shards), a ``ShardedTensor`` its local shards, a plain tensor all of it — read from the
    files into the tensor's memory (CUDA tensors through a pinned host buffer and
    ``copy_``), cast to its dtype where they differ (floating types). Nested dicts and
    lists are matched by their flattened names (``optimizer.state.w.exp_avg``); objects
    with ``state_dict``/``load_state_dict`` are loaded through them; non-tensor entries
    replace the state dict's values.

    A megatron-core model's ``sharded_state_dict()`` loads too: each ``ShardedTensor``
    its block of the checkpoint tensor its ``key`` names (a ``ShardedTensorFactory``'s
    blocks, SwiGLU's ``[gate_r; up_r]``, through views of the parameter), filled in place;
    ``ShardedObject`` entries are left as they are. With a recipe, a Hugging Face folder
    fills a megatron-core model at any TP, PP and EP (``params={"tp": TP}`` for the
    vocabulary's padding).

    ``progress``: ``True`` (a tqdm bar, else a line on stderr), a tqdm bar, or a callable
    ``(done_bytes, total_bytes)`` called about ten times a second while the tensors are read,
    as :func:`reshard.convert` takes it.

    ``include``/``exclude``: globs of checkpoint names to consider. ``rename``: a dict or a
    callable mapping a checkpoint name to its state-dict name (``None``: skip it).
    ``strict``: raise :class:`reshard.RequestError` when a state-dict key is missing from
    the checkpoint, or the checkpoint has entries under the state dict's top-level keys
    that the state dict lacks. Returns the :class:`LoadResult` either way (when not raised).
    No collective is called.
    """
    ck = _checkpoint(path)
    if not isinstance(state_dict, Mapping):
        raise RequestError(f"state_dict must be a dict, not {type(state_dict).__name__}")
    from . import _progress

    report = _progress(progress)
    if recipe is not None or params is not None:
        return _load_through_recipe(state_dict, ck, recipe, params, strict, include, exclude, rename, report)
    plain, mc = _split_megatron(state_dict)
    # Stateful objects are loaded through their own state dicts.
    stateful: List[Tuple[Any, Any]] = []
    view: Dict[str, Any] = {}
    for k, v in plain.items():
        if _is_stateful(v):
            sd = v.state_dict()
            stateful.append((v, sd))
            view[k] = sd
        else:
            view[k] = v
    leaves: List[_Leaf] = []
    nodes: Dict[str, Tuple[Any, Any, Tuple[Any, ...]]] = {}
    _walk(view, (), leaves, nodes, None, None)
    by_name = {_flat(l.path): l for l in leaves}

    infos = {t.name: t for t in ck.tensors()}
    names = list(infos) + ck._extra_names()
    keep = ck._keeps(names, include, exclude)
    ren = _rename_fn(rename)
    # "Under the state dict's top-level keys": by first name component, so that a flat
    # dict ({"model.w": ...}) and a nested one ({"model": {"w": ...}}) behave the same.
    tops = {str(k).split(".", 1)[0] for k in view}

    # One tensor under two names (FSDP1 shares one `step` among parameters) gets the last
    # name's values, as with dcp.load's writes in turn.
    fill = Fill(ck, shared="last", progress=report)
    matched: set = set()
    unexpected: List[str] = []
    replace: List[Tuple[Any, Any, Any]] = []
    for name, kept in zip(names, keep):
        if not kept:
            continue
        target = ren(name)
        if target is None:
            continue
        if target in mc and name in infos:
            _plan_megatron(fill, name, infos[name].shape, mc[target], f"tensor `{target}`")
            matched.add(target)
            continue
        leaf = by_name.get(target)
        if name in infos:
            info = infos[name]
            if leaf is not None and isinstance(leaf.value, torch.Tensor):
                _plan_tensor(fill, name, info.shape, leaf.value, f"tensor `{target}`")
                matched.add(target)
                continue
            if leaf is not None:
                # A tensor where the state dict has a plain value: the tensor replaces it.
                replace.append((leaf.container, leaf.key, ("tensor", name)))
                matched.add(target)
                continue
        else:
            if leaf is not None:
                replace.append((leaf.container, leaf.key, ("value", name)))
                matched.add(target)
                continue
            node = nodes.get(target)
            if node is not None:
                # A value stored whole where the state dict has a container (a list of
                # strings, a dict): the value replaces it, as dcp.load does.
                parent, key, npath = node
                replace.append((parent, key, ("value", name)))
                prefix = target + "."
                matched.update(n for n in by_name if n == target or n.startswith(prefix))
                continue
        if target.split(".", 1)[0] in tops:
            unexpected.append(target)

    missing = [n for n in list(by_name) + list(mc) if n not in matched]
    if strict:
        _check_strict(ck, missing, unexpected, "in it", "of its entries")

    # The non-tensor values that replace the state dict's: only these are read (fetched from
    # object storage), and before any tensor is written.
    wanted = [name for _c, _k, (kind, name) in replace if kind == "value"]
    values_raw = {name: stored for (name, *stored) in ck._extras(wanted)} if wanted else {}
    fill.run()
    from . import _values

    for container, key, (kind, name) in replace:
        if kind == "tensor":
            value = ck._with_framework("pt").get_tensor(name)
        else:
            value = _values.decode(ck.path, name, *values_raw[name])
        if container is None or container is view:
            # a top-level entry: ``view`` is a copy of the caller's dict
            state_dict[key] = value
        else:
            container[key] = value
    for obj, sd in stateful:
        obj.load_state_dict(sd)
    return LoadResult(missing, unexpected)


def _load_through_recipe(
    state_dict: Dict[str, Any],
    ck: Checkpoint,
    recipe: Optional[str],
    params: Optional[Mapping[str, Any]],
    strict: bool,
    include: Optional[Sequence[str]],
    exclude: Optional[Sequence[str]],
    rename: Any,
    report: Any = None,
) -> LoadResult:
    """:func:`load` of the tensors a recipe reads ``ck`` as (the other framework's)."""
    import json

    name = None if recipe in (None, "auto") else _os_fspath(recipe)
    given = None if params is None else json.dumps(dict(params))
    _name, _why, targets = ck._ck.recipe_targets(name, given)
    plain, mc = _split_megatron(state_dict)
    leaves: List[_Leaf] = []
    nodes: Dict[str, Tuple[Any, Any, Tuple[Any, ...]]] = {}
    _walk(dict(plain), (), leaves, nodes, None, None)
    by_name = {_flat(l.path): l for l in leaves}
    # a model whose modules hold other names than its files (transformers 5's fused experts,
    # `mlp.experts.gate_up_proj`): the recipe's in-memory names, where the state dict has them
    _n, _w, in_memory = ck._ck.recipe_targets(name, given, True)
    files = {t[0] for t in targets}
    if any(t[0] not in files and t[0] in by_name for t in in_memory):
        targets = in_memory
    names = [t[0] for t in targets]
    keep = ck._keeps(names, include, exclude)
    ren = _rename_fn(rename)
    fill = Fill(ck, shared="last", views={}, progress=report)
    matched: set = set()
    unexpected: List[str] = []
    for (name, _dtype, shape, view), kept in zip(targets, keep):
        target = ren(name) if kept else None
        if target is None:
            continue
        if target in mc:
            fill.views[name] = view
            _plan_megatron(fill, name, tuple(shape), mc[target], f"tensor `{target}`")
            matched.add(target)
            continue
        leaf = by_name.get(target)
        if leaf is None or not isinstance(leaf.value, torch.Tensor):
            unexpected.append(target)
            continue
        fill.views[name] = view
        _plan_tensor(fill, name, tuple(shape), leaf.value, f"tensor `{target}`")
        matched.add(target)
    missing = [n for n in list(by_name) + list(mc) if n not in matched]
    if strict:
        _check_strict(ck, missing, unexpected, "among the recipe's tensors", "of the recipe's tensors")
    fill.run()
    return LoadResult(missing, unexpected)


def _check_strict(ck: Checkpoint, missing: List[str], unexpected: List[str], among: str, entries: str) -> None:
    """Raise what ``strict`` refuses: state-dict keys the checkpoint lacks (not ``among`` its
    entries), and ``entries`` with no place in the state dict."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) of the state dict are not {among}: {_few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} {entries} have no place in the state dict: {_few(unexpected)}")
    if parts:
        raise RequestError(f"{ck.path}: " + "; ".join(parts) + " (pass strict=False to load the rest)")


def _os_fspath(p: Any) -> str:
    import os

    return os.fspath(p)


def _few(names: List[str], n: int = 5) -> str:
    shown = ", ".join(f"`{x}`" for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _state_dict_api(what: str) -> Any:
    """``torch.distributed.checkpoint.state_dict`` (torch >= 2.2), or a RequestError saying
    what to use instead."""
    try:
        import torch.distributed.checkpoint.state_dict as sdapi
    except ImportError:
        raise RequestError(
            f"{what} needs torch >= 2.2 (torch.distributed.checkpoint.state_dict), this is torch "
            f"{torch.__version__}; reshard.torch.load fills a state dict with any torch"
        ) from None
    return sdapi


def _prefixed(prefix: str) -> Callable[[str], Optional[str]]:
    return lambda n: n[len(prefix):] if n.startswith(prefix) else None


def _own_tensors(model: torch.nn.Module, sd: Mapping[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
    """The module's own parameters and buffers by state-dict name when ``model.state_dict()``
    (``sd``) is a plain module's: every tensor a plain one, no FSDP, DDP or ``torch.compile``
    wrapper renaming or re-sharding keys. ``None`` otherwise: the state-dict API's path."""
    if any(_is_dtensor(v) or _is_sharded_tensor(v) for v in sd.values()):
        return None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or hasattr(model, "_orig_mod"):
        return None
    if _has_fsdp1(model):  # (FSDP2's parameters are DTensors: refused above)
        return None
    own: Dict[str, torch.Tensor] = {}
    for n, t in model.named_parameters(remove_duplicate=False):
        own[n] = t
    for n, t in model.named_buffers(remove_duplicate=False):
        own[n] = t
    return own


def load_model(
    model: torch.nn.Module,
    path: Any,
    *,
    strict: bool = True,
    prefix: Optional[str] = None,
    progress: Any = None,
) -> LoadResult:
    """Load a model's parameters and buffers from the checkpoint at ``path``, whatever the
    world size it was saved at: the model's state dict
    (``torch.distributed.checkpoint.state_dict.get_model_state_dict``: DTensors for FSDP2,
    ShardedTensors or DTensors for FSDP1, plain tensors otherwise) is filled by
    :func:`load` from the checkpoint entries named ``prefix`` + key, then set back with
    ``set_model_state_dict``. A plain module (no FSDP, DDP or ``torch.compile`` wrapper)
    skips that API: its ``state_dict()`` shares its parameters' and buffers' memory, which
    the checkpoint's bytes are read into directly (entries held elsewhere — values, a
    hook's copies — are set with ``load_state_dict``). By default the prefix is the one
    under which the checkpoint holds the model's keys: ``"model."`` where Fabric and most
    trainers put them (``{"model": ...}``), none for a bare model state dict, a DeepSpeed
    ZeRO checkpoint (its fp32 master weights under the module's names) or torchtitan's step
    folders; pass ``prefix`` to choose. ``progress`` as :func:`load` takes it."""
    ck = _checkpoint(path)
    plain = model.state_dict()
    own = _own_tensors(model, plain)
    if own is not None:
        sd = plain
    else:
        sdapi = _state_dict_api("load_model")
        sd = sdapi.get_model_state_dict(model)
    if prefix is None:
        names = set(ck.keys())
        under = sum(("model." + k) in names for k in sd)
        bare = sum(k in names for k in sd)
        prefix = "" if bare > under else "model."
    res = load(sd, ck, strict=strict, rename=_prefixed(prefix), progress=progress)
    if own is not None:
        rest = {
            k: v
            for k, v in sd.items()
            if not (
                k in own
                and isinstance(v, torch.Tensor)
                and v.data_ptr() == own[k].data_ptr()
                and v.shape == own[k].shape
                and v.stride() == own[k].stride()
            )
        }
        if rest:
            model.load_state_dict(rest, strict=False)
    else:
        sdapi.set_model_state_dict(model, sd, options=sdapi.StateDictOptions(strict=strict))
    return res


# Distinct sizes per dimension, so that a probe's state tensor shaped like its parameter is
# told apart from any other shape.
_PROBE_SHAPE = (2, 3, 5, 7, 11, 13, 17, 19)


def _probe_state(cls: type, hyper: Dict[str, Any], ndim: int, dtype: torch.dtype, device: torch.device) -> Optional[Dict[str, Tuple[str, torch.dtype, torch.device]]]:
    """The state an optimizer of class ``cls`` with ``hyper`` makes for a parameter of
    ``ndim`` dimensions at its first step (taken as torch's ``_init_optim_state`` takes it:
    zero gradient, lr 0, on a small probe): per key, "param" (shaped like the parameter) or
    "scalar", with dtype and device. None where that is not all it holds."""
    if ndim == 0 or ndim > len(_PROBE_SHAPE):
        return None
    shape = _PROBE_SHAPE[:ndim]
    try:
        p = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
        p.grad = torch.zeros_like(p)
        opt = cls([p], **hyper)
        for g in opt.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        opt.step()
        state = opt.state.get(p, {})
    except Exception:
        return None
    proto = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            return None
        if tuple(v.shape) == shape:
            proto[k] = ("param", v.dtype, v.device)
        elif v.dim() == 0:
            proto[k] = ("scalar", v.dtype, v.device)
        else:
            return None
    return proto or None


def _make_optimizer_state(optimizer: torch.optim.Optimizer) -> Optional[List[torch.Tensor]]:
    """Give a fresh ``optimizer`` (no state, no gradients) the state tensors its first step
    would make, allocated but not written (``torch.empty``, DTensors like their parameters),
    for the checkpoint's values to be read into. Without this,
    ``get_optimizer_state_dict`` makes them by a step with zero gradients: a gradient per
    parameter held at once, and the step's arithmetic over every element. Returns the
    parameters given state (to undo on error), or None when nothing was done: the optimizer
    has state or gradients already, or its state is not only parameter-shaped and scalar
    tensors (then torch's own way runs)."""
    if optimizer.state:
        return None
    groups = optimizer.param_groups
    if any(p.grad is not None for g in groups for p in g["params"]):
        return None
    cls = type(optimizer)
    try:
        sig = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    anykw = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in sig.values())
    plan = []
    for g in groups:
        hyper = {k: g[k] for k in optimizer.defaults if k in g and (anykw or k in sig)}
        probes: Dict[Any, Any] = {}
        for p in g["params"]:
            if not p.requires_grad:
                continue
            local = p.to_local() if _is_dtensor(p) else p
            key = (p.dim(), local.dtype, local.device)
            if key not in probes:
                probes[key] = _probe_state(cls, hyper, *key)
            if probes[key] is None:
                return None
            plan.append((p, probes[key]))
    if not plan:
        return None
    for p, proto in plan:
        optimizer.state[p] = {
            k: torch.empty_like(p, dtype=dt) if kind == "param" else torch.empty((), dtype=dt, device=dev)
            for k, (kind, dt, dev) in proto.items()
        }
    return [p for p, _ in plan]


def _has_fsdp1(obj: Any) -> bool:
    """Whether ``obj`` is a module with FSDP1 (``FullyShardedDataParallel``) in it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(obj, torch.nn.Module) and any(isinstance(m, FullyShardedDataParallel) for m in obj.modules())


_GROUP_PARAMS = re.compile(r"param_groups\.\d+\.(params|param_names)")


def _flat_param_groups(osd: Dict[str, Any], ck: Checkpoint, rename: Callable[[str], Optional[str]]) -> Optional[Callable[[str], Optional[str]]]:
    """torchtitan's flat optimizer layout: each parameter group's hyperparameters saved per
    parameter, as ``param_groups.<fqn>.<key>`` (torchtitan.components.optimizer.utils), not
    as the list ``param_groups`` torch's ``get_optimizer_state_dict`` holds. Where the
    checkpoint holds them so, a rename that reads group ``i``'s ``key`` from its first
    parameter's entry (as torchtitan's ``load_flat_optim_state_dict`` does) and skips the
    copies of the other parameters and keys the live group lacks; None otherwise."""
    groups = osd.get("param_groups")
    if not isinstance(groups, list) or not groups:
        return None
    where: Dict[str, Tuple[int, bool]] = {}
    keys: List[set] = []
    for i, g in enumerate(groups):
        fqns = g.get("params") if isinstance(g, Mapping) else None
        if not isinstance(fqns, list) or not all(isinstance(f, str) for f in fqns):
            return None
        for j, f in enumerate(fqns):
            where[f] = (i, j == 0)
        keys.append({k for k in g if k not in ("params", "param_names")})
    table: Dict[str, Optional[str]] = {}
    for name in ck.keys():
        target = rename(name)
        if target is None or not target.startswith("param_groups."):
            continue
        fqn, _, key = target[len("param_groups."):].rpartition(".")
        if fqn not in where:
            continue
        i, first = where[fqn]
        table[name] = f"param_groups.{i}.{key}" if first and key in keys[i] else None
    if not table:
        return None
    return lambda n: table[n] if n in table else rename(n)


def _load_optimizer_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ck: Checkpoint,
    strict: bool,
    rename: Any,
) -> LoadResult:
    """``get_optimizer_state_dict``, :func:`load` into it, ``set_optimizer_state_dict``; a
    fresh optimizer's state made first by :func:`_make_optimizer_state`. State made so and
    not in the checkpoint (``strict=False``) is zeroed, as a fresh optimizer's is; on error
    the made state is removed again."""
    sdapi = _state_dict_api("load_optimizer")
    get_optimizer_state_dict, set_optimizer_state_dict = sdapi.get_optimizer_state_dict, sdapi.set_optimizer_state_dict

    # FSDP1 computes over the state while building its state dict (steps compared across
    # ranks, moments gathered), so its state must hold values: torch's way there.
    made = None if _has_fsdp1(model) else _make_optimizer_state(optimizer)
    try:
        fresh = {id(t) for p in made or () for t in optimizer.state[p].values()}
        osd = get_optimizer_state_dict(model, optimizer)
        flat_groups = _flat_param_groups(osd, ck, rename)
        if flat_groups is None:
            res = load(osd, ck, strict=strict, rename=rename)
        else:
            res = load(osd, ck, strict=False, rename=flat_groups)
            # the groups' parameter lists are the live optimizer's, as torchtitan keeps them
            missing = [m for m in res.missing_keys if not _GROUP_PARAMS.fullmatch(m)]
            res = LoadResult(missing, res.unexpected_keys)
            if strict and (missing or res.unexpected_keys):
                parts = []
                if missing:
                    parts.append(f"{len(missing)} key(s) of the state dict are not in it: {_few(missing)}")
                if res.unexpected_keys:
                    parts.append(f"{len(res.unexpected_keys)} of its entries have no place in the state dict: "
                                 f"{_few(res.unexpected_keys)}")
                raise RequestError(f"{ck.path}: " + "; ".join(parts) + " (pass strict=False to load the rest)")
        if fresh and res.missing_keys:
            leaves: List[_Leaf] = []
            _walk(osd, (), leaves, {}, None, None)
            missing = set(res.missing_keys)
            for leaf in leaves:
                if id(leaf.value) in fresh and _flat(leaf.path) in missing:
                    leaf.value.zero_()
        set_optimizer_state_dict(model, optimizer, osd)
    except BaseException:
        for p in made or ():
            optimizer.state.pop(p, None)
        raise
    return res


def load_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Any,
    *,
    strict: bool = True,
    prefix: str = "optimizer.",
) -> LoadResult:
    """Load an optimizer's state (moments, steps, ``param_groups``) for ``model`` from the
    checkpoint at ``path``, whatever the world size it was saved at, through
    ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (state keyed by parameter
    names, as DCP checkpoints of FSDP2, FSDP1 and Fabric hold it).

    A fresh optimizer (no state yet) gets its state tensors allocated and read straight
    from the checkpoint, not made by a step with zero gradients as
    ``get_optimizer_state_dict`` would make them (which holds a gradient for every
    parameter at once), wherever the optimizer's state is parameter-shaped and scalar
    tensors (Adam, AdamW, SGD with momentum, ...) and the model is not FSDP1; otherwise
    torch's way is used. With ``strict=False``, state the checkpoint lacks starts at zero."""
    return _load_optimizer_state(model, optimizer, _checkpoint(path), strict, _prefixed(prefix))


from ._reader import StorageReader  # noqa: E402
