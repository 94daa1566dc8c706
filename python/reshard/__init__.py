"""reshard: move distributed-training checkpoints between world sizes.

Open any checkpoint reshard reads (PyTorch DCP of torch 2.1-2.15 incl. Lightning Fabric
folders, ``torch.save`` files, safetensors files and folders, Hugging Face sharded folders)
and read whole tensors, slices or one rank's shards of any world size, with no process
group; convert, verify and compare checkpoints as the ``reshard`` command does.
Loading into a model of any world size is :mod:`reshard.torch`; Lightning Fabric's
``load`` is :mod:`reshard.lightning`.

Everything runs in the Rust library (the native module ``reshard._reshard``); torch and
numpy are imported when a tensor is made, never linked.
"""

import json as _json
import os as _os
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from . import _dtypes, _values
from ._reshard import (
    CheckpointError,
    InternalError,
    RequestError,
    ReshardError,
    ReshardIOError,
    __version__,
)
from . import _reshard

__all__ = [
    "open",
    "Checkpoint",
    "TensorInfo",
    "LocalShard",
    "Slice",
    "convert",
    "commit",
    "verify",
    "diff",
    "formats",
    "fetch_stats",
    "ReshardError",
    "CheckpointError",
    "RequestError",
    "ReshardIOError",
    "InternalError",
    "__version__",
]

PathLike = Union[str, "_os.PathLike[str]"]


class TensorInfo(NamedTuple):
    """One tensor of a checkpoint: its flat name, dtype name, global shape and layout."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    layout: str


class LocalShard(NamedTuple):
    """One region of one tensor held by a rank: the tensor's name and global shape, the
    region's offsets in it, and its data."""

    name: str
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    tensor: Any


def _layout_json(layout: Any) -> Optional[str]:
    """A layout given as a dict, a JSON text or the path of a JSON file, as JSON text."""
    if layout is None:
        return None
    if isinstance(layout, dict):
        return _json.dumps(layout)
    if isinstance(layout, (str, _os.PathLike)):
        text = _os.fspath(layout)
        if text.lstrip().startswith("{"):
            return text
        try:
            with builtins_open(text, "rb") as f:
                return f.read().decode()
        except OSError as e:
            raise ReshardIOError(f"{text}: {e.strerror or e}") from None
    raise RequestError(f"layout must be a dict, JSON text or a path, not {type(layout).__name__}")


import builtins as _builtins

builtins_open = _builtins.open


def _empty(shape: Sequence[int], dtype: str, framework: str) -> Tuple[Any, int, int]:
    """A new contiguous CPU array of ``shape`` and reshard dtype ``dtype``: (array, address,
    nbytes)."""
    if framework in ("pt", "torch"):
        import torch

        t = torch.empty(tuple(shape), dtype=_dtypes.torch_dtype(dtype))
        return t, t.data_ptr(), t.numel() * t.element_size()
    if framework in ("np", "numpy"):
        import numpy as np

        a = np.empty(tuple(shape), dtype=_dtypes.numpy_dtype(dtype))
        return a, a.ctypes.data, a.nbytes
    raise RequestError(f'framework must be "pt" or "numpy", not "{framework}"')


class Checkpoint:
    """An open checkpoint: its tensors' layouts and byte locations, and its non-tensor
    entries. Reading is lazy: each call reads only the bytes it returns. Use
    :func:`reshard.open` to make one; it is also a context manager."""

    def __init__(self, native: Any, framework: str = "pt") -> None:
        self._ck = native
        self._framework = framework
        self._tensors: Optional[Dict[str, TensorInfo]] = None

    # --- what it holds -------------------------------------------------------------------
    @property
    def format(self) -> str:
        """The format's name: ``dcp``, ``pt``, ``safetensors``, ``hf`` or ``hf-storage``."""
        return self._ck.format

    @property
    def world_size(self) -> int:
        """The world size it was saved at."""
        return self._ck.world_size

    @property
    def path(self) -> str:
        """The path it was opened from."""
        return _os.fspath(self._ck.path)

    @property
    def files(self) -> List[str]:
        """The data files it reads."""
        return [_os.fspath(p) for p in self._ck.files]

    @property
    def producer(self) -> Optional[str]:
        """What wrote it, when the files say."""
        return self._ck.producer

    @property
    def metadata(self) -> Dict[str, str]:
        """String metadata (a safetensors header's ``__metadata__``)."""
        return dict(self._ck.metadata)

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors."""
        return self._ck.nbytes

    def _infos(self) -> Dict[str, TensorInfo]:
        if self._tensors is None:
            self._tensors = {
                n: TensorInfo(n, d, tuple(s), l) for (n, d, s, l) in self._ck.tensors()
            }
        return self._tensors

    def tensors(self) -> List[TensorInfo]:
        """Every tensor: name, dtype, global shape and a summary of its layout."""
        return list(self._infos().values())

    def keys(self) -> List[str]:
        """The names of every entry: tensors first, then non-tensor values (listed without
        reading the values)."""
        return list(self._infos()) + self._extra_names()

    def values(self) -> Dict[str, Any]:
        """The non-tensor entries (step counters, ``param_groups`` leaves, scheduler state,
        Lightning's ``meta.pt`` keys) as Python objects, by flat name."""
        return {name: _values.decode(self.path, name, *stored) for (name, *stored) in self._extras()}

    def value_bytes(self, name: str) -> bytes:
        """The non-tensor entry ``name`` as stored: a DCP item's ``torch.save`` stream. For a
        value reshard keeps opaque (its pickle names a class reshard does not import), this is
        what there is; ``torch.load(io.BytesIO(b), weights_only=False)`` makes the object,
        running whatever its pickle names: only for a checkpoint you trust."""
        items = self._ck.extras([name])
        if not items:
            raise RequestError(f"{self.path}: no non-tensor value `{name}`")
        raw = items[0][2]
        if raw is None:
            raise RequestError(
                f"{self.path}: non-tensor value `{name}` is not stored as bytes of its own; values() gives it"
            )
        return bytes(raw)

    def paths(self) -> Dict[str, List[Union[str, int]]]:
        """The nested path of each flat name that has one (``["optimizer", "state", 0]``)."""
        return self._ck.paths()

    def tied_names(self) -> List[List[str]]:
        """Groups of tied tensors (same dtype, shape and bytes), by name."""
        return self._ck.tied_names()

    def __contains__(self, name: object) -> bool:
        return name in self._infos()

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos())

    def __len__(self) -> int:
        return len(self._infos())

    def info(self, name: str) -> TensorInfo:
        """The tensor ``name``'s :class:`TensorInfo`."""
        try:
            return self._infos()[name]
        except KeyError:
            raise RequestError(f"{self.path}: no tensor `{name}`") from None

    # --- for the package's other modules (reshard.torch, its StorageReader) ------------------
    def _extra_names(self) -> List[str]:
        """The names of the non-tensor entries, in the checkpoint's order; nothing is read."""
        return self._ck.extra_names()

    def _storage_meta(self) -> Optional[Dict[str, Any]]:
        """What the writer recorded of the save (DCP's ``Metadata.storage_meta``, torch >= 2.4)
        as the native reader gives it (``checkpoint_id``, ``checkpoint_id_path``, ``save_id``,
        ``modules``), or None; nothing is read."""
        return self._ck.storage_meta

    def _extras(
        self, names: Optional[Sequence[str]] = None
    ) -> List[Tuple[str, Optional[bytes], Optional[bytes], Optional[str]]]:
        """The non-tensor entries (those in ``names`` when given), in the checkpoint's order, as
        ``(name, raw, pickled, opaque)`` for :func:`reshard._values.decode` (after its ``where``):
        each stored item is read (fetched, from object storage) now."""
        items = self._ck.extras(None if names is None else list(names))
        return [(name, raw, pickled, opaque) for (name, _origin, raw, pickled, opaque) in items]

    def _keeps(
        self, names: Sequence[str], include: Optional[Sequence[str]], exclude: Optional[Sequence[str]]
    ) -> List[bool]:
        """Which of ``names`` the ``include`` and ``exclude`` globs keep."""
        return self._ck.keeps(
            list(names), include=list(include) if include else None, exclude=list(exclude) if exclude else None
        )

    def _read_into(self, dests: List[Tuple[Any, ...]], progress: Any = None) -> None:
        """Fill destinations ``(name, dtype, shape, parts, address, nbytes)`` in one native
        read (see ``NativeCheckpoint.read_into``); the caller keeps their memory alive.
        ``progress``: a callable ``(done_bytes, total_bytes)``."""
        self._ck.read_into(dests, progress)

    def _with_framework(self, framework: str) -> "Checkpoint":
        """The same open checkpoint, making its arrays with ``framework``."""
        return self if framework == self._framework else Checkpoint(self._ck, framework)

    # --- reading -------------------------------------------------------------------------
    def _read(self, name: str, offsets: Sequence[int], sizes: Sequence[int], dtype: Optional[Any]) -> Any:
        info = self.info(name)
        dt = info.dtype if dtype is None else _dtypes.name_of(dtype)
        arr, addr, nbytes = _empty(sizes, dt, self._framework)
        at = [0] * len(sizes)
        self._read_into([(name, dt, list(sizes), [(list(offsets), list(sizes), at)], addr, nbytes)])
        return arr

    def get_tensor(self, name: str, dtype: Optional[Any] = None) -> Any:
        """The whole tensor ``name`` (cast to ``dtype`` if given: floating types only), as a
        ``torch.Tensor`` (a numpy array with ``framework="numpy"``)."""
        shape = self.info(name).shape
        return self._read(name, [0] * len(shape), shape, dtype)

    def get_slice(self, name: str) -> "Slice":
        """A lazy view of tensor ``name``: index it (``[i:j, ...]``) to read only that
        region."""
        return Slice(self, name)

    def local_shards(
        self,
        rank: int,
        world_size: int,
        layout: Any = None,
        *,
        include: Optional[Sequence[str]] = None,
        exclude: Optional[Sequence[str]] = None,
        dtype: Optional[Any] = None,
    ) -> List[LocalShard]:
        """Every region rank ``rank`` of ``world_size`` holds under ``layout`` (a layout
        dict, JSON text or file as for ``reshard convert --layout``; ``Shard(0)`` over
        ``world_size`` ranks when ``None``), read from the files with no process group."""
        regions = self._ck.local_regions(
            rank,
            world_size,
            layout=_layout_json(layout),
            include=list(include) if include else None,
            exclude=list(exclude) if exclude else None,
            dtype=None if dtype is None else _dtypes.name_of(dtype),
        )
        out, dests = [], []
        for name, dt, gshape, offs, sizes in regions:
            arr, addr, nbytes = _empty(sizes, dt, self._framework)
            dests.append((name, dt, list(sizes), [(offs, sizes, [0] * len(sizes))], addr, nbytes))
            out.append(LocalShard(name, tuple(gshape), tuple(offs), arr))
        self._read_into(dests)
        return out

    # --- context manager -----------------------------------------------------------------
    def close(self) -> None:
        """Forget the checkpoint (its files are mapped only while a read runs)."""

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<reshard.Checkpoint {self.format} at {self.path!r}: {self.world_size} rank(s), "
            f"{len(self)} tensor(s)>"
        )


class Slice:
    """A lazy view of one tensor; indexing it reads only the region asked for. Integers,
    slices (any step; the bounding rows are read), ``...`` and negative indices work as
    in numpy; an integer drops its dimension."""

    def __init__(self, ck: Checkpoint, name: str) -> None:
        self._ck = ck
        self._name = name
        self._info = ck.info(name)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The tensor's global shape."""
        return self._info.shape

    @property
    def dtype(self) -> str:
        """The tensor's dtype name."""
        return self._info.dtype

    def get_shape(self) -> List[int]:
        """The tensor's global shape (as safetensors' slices say it)."""
        return list(self._info.shape)

    def __getitem__(self, index: Any) -> Any:
        shape = self._info.shape
        if not isinstance(index, tuple):
            index = (index,)
        if sum(1 for i in index if i is Ellipsis) > 1:
            raise RequestError("an index can have only one ellipsis (...)")
        if Ellipsis in index:
            k = index.index(Ellipsis)
            fill = len(shape) - (len(index) - 1)
            index = index[:k] + (slice(None),) * fill + index[k + 1:]
        if len(index) > len(shape):
            raise RequestError(
                f"tensor `{self._name}`: {len(index)} indices for {len(shape)} dimension(s)"
            )
        index = index + (slice(None),) * (len(shape) - len(index))
        offsets, sizes, post, drop = [], [], [], []
        for d, (ix, n) in enumerate(zip(index, shape)):
            if isinstance(ix, slice):
                a, b, step = ix.indices(n)
                if step < 0:
                    raise RequestError("negative slice steps are not supported")
                b = max(a, b)
                count = len(range(a, b, step))
                offsets.append(a)
                sizes.append(0 if count == 0 else (count - 1) * step + 1)
                post.append(slice(None, None, step) if step != 1 else slice(None))
            elif isinstance(ix, int) or hasattr(ix, "__index__"):
                i = ix.__index__()
                if i < -n or i >= n:
                    raise RequestError(
                        f"tensor `{self._name}`: index {i} is out of range for dimension {d} of size {n}"
                    )
                offsets.append(i % n)
                sizes.append(1)
                post.append(slice(None))
                drop.append(d)
            else:
                raise RequestError(f"unsupported index {ix!r}")
        arr = self._ck._read(self._name, offsets, sizes, None)
        if any(p.step not in (None, 1) for p in post):
            arr = arr[tuple(post)]
            arr = arr.contiguous() if hasattr(arr, "contiguous") else arr.copy()
        if drop:
            keep = [s for d, s in enumerate(arr.shape) if d not in drop]
            arr = arr.reshape(tuple(keep))
        return arr


def open(
    path: PathLike,
    *,
    format: Optional[str] = None,
    framework: str = "pt",
    tag: Optional[str] = None,
    weights: Optional[str] = None,
    step: Optional[int] = None,
) -> Checkpoint:
    """Open a checkpoint of any format reshard reads (detected from ``path``, or ``format``
    by name) and validate it: every tensor covered exactly, every item inside its file. The
    header of each DCP item is read (and checked) only when a read needs that item, so a rank
    loading its shards touches the ``.metadata`` and its own items. Tensors come back as ``torch.Tensor`` (``framework="numpy"``: numpy arrays).

    ``tag``: the checkpoint in that sub-folder of ``path`` (a DeepSpeed tag such as
    ``"global_step100"``; default: the one DeepSpeed's ``latest`` names, or the newest step
    folder of a torchtitan ``checkpoint/`` folder, or the iteration a Megatron-LM save
    directory's ``latest_checkpointed_iteration.txt`` names); ``step=N``: the step folder
    ``step-N`` (torchtitan) or ``iter_000000N`` (Megatron-LM).
    ``weights`` (DeepSpeed): ``"master"`` (the fp32 master weights, the default) or
    ``"model"`` (the model-dtype weights of ZeRO stages 1 and 2)."""
    if framework not in ("pt", "torch", "np", "numpy"):
        raise RequestError(f'framework must be "pt" or "numpy", not "{framework}"')
    native = _reshard.open(
        _os.fspath(path), format=format, tag=tag, step=_step(tag, step), weights=weights
    )
    return Checkpoint(native, framework)


def _step(tag: Optional[str], step: Optional[int]) -> Optional[int]:
    """The step to open (``step-N``, ``iter_000000N``), checked: not with a ``tag``."""
    if step is None:
        return None
    if tag is not None:
        raise RequestError("give tag or step, not both")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RequestError(f"step must be a non-negative int, not {step!r}")
    return step


def _progress(progress: Any) -> Optional[Callable[[int, int], None]]:
    """A callback ``(done_bytes, total_bytes)`` for ``progress``: a callable, a tqdm-like
    object (``update``/``total``), or ``True`` for a tqdm bar when tqdm is installed (the
    ``progress`` extra), else a line on stderr updated in place."""
    if progress is None or progress is False:
        return None
    if progress is True:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return _StderrProgress()
        progress = tqdm(unit="B", unit_scale=True, desc="reshard")
    if hasattr(progress, "update") and hasattr(progress, "total"):
        bar = progress
        seen = [0]

        def cb(done: int, total: int) -> None:
            if bar.total != total:
                bar.total = total
                bar.refresh()
            bar.update(done - seen[0])
            seen[0] = done
            if done >= total:
                bar.close()

        return cb
    if callable(progress):
        return progress
    raise RequestError("progress must be a callable (done, total), a tqdm bar or True")


class _StderrProgress:
    """``progress=True`` without tqdm: ``reshard: 12.5 MiB of 40.0 MiB (31%)`` on stderr,
    rewritten at most ten times a second, and a last line at the end."""

    def __init__(self) -> None:
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        import sys
        import time

        now = time.monotonic()
        end = done >= total
        if not end and now - self._last < 0.1:
            return
        self._last = now
        pct = f" ({100 * done // total}%)" if total else ""
        sys.stderr.write(f"\rreshard: {_mib(done)} of {_mib(total)}{pct}" + ("\n" if end else ""))
        sys.stderr.flush()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def convert(
    src: PathLike,
    dst: PathLike,
    *,
    world_size: int,
    format: Optional[str] = None,
    layout: Any = None,
    include: Optional[Sequence[str]] = None,
    exclude: Optional[Sequence[str]] = None,
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    dtype: Optional[Any] = None,
    max_shard_size: Optional[int] = None,
    threads: Optional[int] = None,
    per_rank_state: Optional[str] = None,
    untie: bool = False,
    overwrite: bool = False,
    verify: bool = True,
    progress: Any = None,
    dry_run: bool = False,
    tag: Optional[str] = None,
    weights: Optional[str] = None,
    zero_stage: Optional[int] = None,
    step: Optional[int] = None,
    config: Optional[PathLike] = None,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    ep: Optional[int] = None,
    save_dir: bool = False,
    part: Any = None,
    staging: Optional[PathLike] = None,
    recipe: Optional[str] = None,
    params: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """Convert checkpoint ``src`` into ``dst`` for ``world_size`` ranks, as ``reshard
    convert`` does: the output format from ``format`` or from ``dst``, the world size and
    the source; the output appears atomically, or not at all. A ``dst`` whose name says
    another output (``x.safetensors`` for the folder of several ranks, ``x.pt`` with
    ``format="dcp"``) raises :class:`RequestError`, saying what to name it. ``max_shard_size``:
    the largest file of an ``hf`` output, in bytes, its header included.

    ``part=(k, n)`` runs only part ``k`` of ``n`` of the conversion, beside workers running
    the others (``reshard convert --part K/N``): the worker that finishes last makes ``dst``
    appear (or :func:`commit`); ``part="env"`` takes ``k`` and ``n`` from the launcher's
    environment (torchrun, Slurm, a Kubernetes indexed job), as the command does. The default,
    ``None``, converts everything in this process even under torchrun, so that a training
    script may call it on one rank. The result's ``"parts"`` says which part ran, which are
    still missing and whether this call committed. Parts of a conversion to an object-store
    URL meet in ``staging``, a folder every worker sees (default: ``RESHARD_STAGING``); the
    worker that commits uploads the output.

    ``src`` and ``dst`` may be object-store URLs (``s3://bucket/prefix``, ``gs://``,
    ``az://``, ...; credentials and endpoint from the ``AWS_*`` etc. environment).

    ``progress``: a callable
    ``(done_bytes, total_bytes)``, a tqdm bar, or ``True``. ``dry_run``: plan only.
    ``tag`` (or ``step``) and ``weights`` choose the source as :func:`open` does;
    ``config``: a ``config.json`` for an ``hf`` output (default: the source's own, which an
    ``hf`` output carries, with ``generation_config.json``, so that ``from_pretrained``
    loads it); ``zero_stage`` the ZeRO
    stage of a ``format="deepspeed"`` output (default: the source's); ``tp``, ``pp`` and ``ep``
    the tensor-, pipeline- and expert-parallel sizes of a ``format="megatron-legacy"`` output
    (Megatron-LM's ``mp_rank_*`` files; default: the source's, from its saved arguments).
    ``save_dir=True`` writes a ``format="megatron"`` output as a Megatron-LM save directory
    (``latest_checkpointed_iteration.txt`` beside ``iter_NNNNNNN/``, what Megatron-LM's
    ``--load`` reads); a source opened from a save directory gives one without it.

    Between frameworks (a megatron-core checkpoint to ``format="hf"``, a Hugging Face folder to
    ``format="megatron"``): ``recipe`` names a built-in recipe (``"llama"``, ``"mistral"``,
    ``"qwen2"``, ``"mixtral"``, ``"qwen2_moe"``) or a recipe file (default: the one the source's configuration calls for;
    ``"none"`` keeps the names), ``params`` sets its parameters over the source's
    configuration (``{"padded_vocab": 256}``, ``{"tp": 2}``); see docs/recipes.md.
    Returns a summary: the format chosen (and why), files and bytes written, entries
    dropped, tied tensors, the recipe applied and its parameters."""
    return _reshard.convert(
        _os.fspath(src),
        _os.fspath(dst),
        world_size=world_size,
        format=format,
        layout=_layout_json(layout),
        include=list(include) if include else None,
        exclude=list(exclude) if exclude else None,
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        dtype=None if dtype is None else _dtypes.name_of(dtype),
        max_shard_size=max_shard_size,
        threads=threads,
        per_rank_state=per_rank_state,
        untie=untie,
        overwrite=overwrite,
        verify=verify,
        progress=_progress(progress),
        dry_run=dry_run,
        tag=tag,
        step=_step(tag, step),
        weights=weights,
        zero_stage=zero_stage,
        tp=tp,
        pp=pp,
        ep=ep,
        save_dir=save_dir,
        config=None if config is None else _os.fspath(config),
        part=_part(part),
        staging=None if staging is None else _os.fspath(staging),
        recipe=None if recipe is None else _os.fspath(recipe),
        params=None if params is None else _json.dumps(dict(params)),
    )


def _part(part: Any) -> Optional[str]:
    """``part=`` as the native module takes it: None, "env" or "K/N"."""
    if part is None or part == "env":
        return part
    if isinstance(part, (str, bytes)):
        raise RequestError(f'part must be (k, n), "env" or None, not {part!r}')
    try:
        k, n = part
        return f"{int(k)}/{int(n)}"
    except (TypeError, ValueError):
        raise RequestError(
            f"part must be (k, n), \"env\" or None, not {part!r}"
        ) from None


def commit(
    dst: PathLike,
    *,
    overwrite: bool = False,
    verify: bool = True,
    staging: Optional[PathLike] = None,
) -> int:
    """Finish a conversion run in parts (``convert(..., part=(k, n))``) into ``dst``: check
    that every part is written, by the same job, and (with ``verify``) that its bytes match
    their CRC-32s, then make ``dst`` appear atomically (replacing it only with
    ``overwrite``). The worker that finishes last does this itself. Raises, naming the
    missing parts, when some are not written. For an object-store URL ``dst``, the parts met
    in ``staging`` (default: ``RESHARD_STAGING``), and the output is uploaded from there.
    Returns the bytes checked."""
    return _reshard.commit(
        _os.fspath(dst),
        overwrite=overwrite,
        verify=verify,
        staging=None if staging is None else _os.fspath(staging),
    )


def verify(path: PathLike) -> Dict[str, Any]:
    """Check a checkpoint's structure and every CRC-32 its files record. Returns a report;
    ``report["ok"]`` is False and ``report["mismatches"]`` lists the damage (one line each)
    when a record is corrupt. A checkpoint that cannot be read raises."""
    report = _reshard.verify(_os.fspath(path))
    report["ok"] = not report["mismatches"]
    return report


def diff(a: PathLike, b: PathLike) -> Dict[str, Any]:
    """Compare two checkpoints tensor by tensor, whatever their formats and world sizes.
    ``result["equal"]`` says whether they hold the same tensors with the same values."""
    d = _reshard.diff(_os.fspath(a), _os.fspath(b))
    d["equal"] = not d.get("differences")
    return d


def formats() -> List[Tuple[str, str]]:
    """The formats reshard reads and writes: ``(name, summary)``."""
    return list(_reshard.formats())


def fetch_stats() -> Dict[str, int]:
    """What this process has fetched from object stores so far: ``{"requests": ranged GETs
    sent, "bytes": bytes they returned}`` (compare two calls around a load)."""
    requests, nbytes = _reshard.fetch_stats()
    return {"requests": requests, "bytes": nbytes}
