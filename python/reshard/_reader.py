"""``reshard.torch.StorageReader``: a ``torch.distributed.checkpoint.StorageReader`` over any
checkpoint reshard reads, so ``dcp.load`` (and any planner) loads DCP folders of any torch
version, ``torch.save`` files, safetensors files and folders, Hugging Face sharded folders
and Lightning Fabric folders alike.

The metadata it gives torch holds one entry per checkpoint entry, under reshard's flat name
(a DCP ``.metadata`` key, or the flattened key of a ``torch.save`` / safetensors entry):
each tensor as one chunk covering the whole tensor, since reshard reads any region of it;
each non-tensor value as bytes. Reads of one plan go to the Rust library in one batch, with
the GIL released, straight into the target tensors' memory where that memory fits.

Its protocol is that of torch's ``FileSystemReader``: the checkpoint is opened by
``read_metadata`` (not by the constructor), ``reset`` starts a new read, ``validate_checkpoint_id``
answers as torch's does (and True for the URLs reshard reads), the metadata's
``storage_meta`` is the one saved with the checkpoint. A local DCP folder whose items were
saved through a stream transform reshard does not decode (torch's ``_extensions`` other than
zstd) is read by torch's own ``FileSystemReader`` with the ``_extension_registry`` given.
"""

import io
import os
import pathlib
import pickle
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader as _TorchFileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader as _TorchStorageReader
from torch.futures import Future

from . import Checkpoint, CheckpointError, RequestError, _dtypes, _reshard, _values
from . import open as _open
from ._fill import Fill

try:  # torch >= 2.4
    from torch.distributed.checkpoint.metadata import StorageMeta as _StorageMeta
except ImportError:  # pragma: no cover - older torch
    _StorageMeta = None

if TYPE_CHECKING:  # torch >= 2.7
    from torch.distributed.checkpoint._extension import ExtensionRegistry

__all__ = ["StorageReader"]

PathOrCheckpoint = Union[str, "os.PathLike[str]", Checkpoint]

_METADATA = ".metadata"
# The stream transform the native reader decodes itself (torch's ZStandard extension).
_NATIVE_TRANSFORMS = {(), ("stream.zstd/1",)}


def _torch_dtype(name: str, tensor: str) -> torch.dtype:
    """The torch dtype of reshard's dtype ``name``, or a RequestError naming the tensor."""
    try:
        return _dtypes.torch_dtype(name)
    except (KeyError, AttributeError):
        raise RequestError(
            f"tensor `{tensor}`: dtype {name} has no counterpart in torch {torch.__version__}"
        ) from None


def _metadata_file(path: str, rank: Optional[int]) -> Optional[str]:
    """The DCP metadata file torch's reader reads for ``rank`` (``.metadata``, else
    ``__<rank>.metadata``, rank 0's without one) if ``path`` is a local folder holding it."""
    names = [_METADATA] + ([f"__{rank}{_METADATA}"] if rank is not None else []) + [f"__0{_METADATA}"]
    for name in names:
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return f
    return None


# --- the saved StorageMeta, as the native reader read it ----------------------------------
# ``pathlib`` path classes by the name a pickle gives them (the pure one where the concrete
# one cannot be made on this system).
_PATH_CLASSES = {
    "PosixPath": pathlib.PurePosixPath if os.name != "posix" else pathlib.PosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath if os.name != "nt" else pathlib.WindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
# ... by the flavour the native reader names (``checkpoint_id_path``)
_PATH_FLAVORS = {"posix": _PATH_CLASSES["PosixPath"], "windows": _PATH_CLASSES["WindowsPath"]}


def _saved_storage_meta(ck: Checkpoint) -> Optional[Any]:
    """torch's ``StorageMeta`` saved with ``ck`` (what torch's reader returns, before it sets
    ``load_id``), or None (none saved: torch < 2.4, another format). The native reader read it
    from the DCP metadata (rank 0's, of per-rank metadata) with its allow-list, calling
    nothing; ``checkpoint_id`` is rebuilt as the path object it was saved as, or its str."""
    saved = ck._storage_meta()
    if saved is None or _StorageMeta is None:
        return None
    cid: Any = saved.get("checkpoint_id")
    flavor = _PATH_FLAVORS.get(saved.get("checkpoint_id_path") or "")
    if cid is not None and flavor is not None:
        cid = flavor(cid)
    fields = {"checkpoint_id": cid, "save_id": saved.get("save_id"), "modules": list(saved.get("modules") or [])}
    known = getattr(_StorageMeta, "__dataclass_fields__", fields)  # torch 2.4 has no modules
    return _StorageMeta(**{k: v for k, v in fields.items() if k in known})


# --- DCP metadata for torch's own reader (items with stream transforms reshard lacks) --------
_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = {
    (_DCP_META, n)
    for n in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "TensorProperties", "_MEM_FORMAT_ENCODING", "StorageMeta",
    )
} | {
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` naming only the globals reshard's native reader allows
    there (torch's metadata classes, ``torch.Size``, dtypes, paths); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "pathlib" and name in _PATH_CLASSES:
            return _PATH_CLASSES[name]
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def _load_dcp_metadata(f: str) -> Metadata:
    """The DCP metadata in file ``f``, through :class:`_MetadataUnpickler`."""
    with open(f, "rb") as fh:
        md = _MetadataUnpickler(fh).load()
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{f}: holds a {type(md).__name__}, not DCP Metadata")
    return md


class StorageReader(_TorchStorageReader):
    """A ``torch.distributed.checkpoint.StorageReader`` reading the checkpoint at ``path``
    (any format :func:`reshard.open` reads, or an open :class:`reshard.Checkpoint`), whatever
    the world size it was saved at: ``dcp.load(sd, storage_reader=StorageReader(path))``.

    As torch's ``FileSystemReader``, nothing is opened here: each load opens the checkpoint
    in :meth:`read_metadata` (so a missing or corrupt checkpoint raises a
    :class:`reshard.ReshardError` there), and a reader can be made before the checkpoint
    exists and used for several loads. ``_extension_registry`` (torch's
    ``ExtensionRegistry``, EXPERIMENTAL as in torch) decodes the items of a local DCP folder
    saved through a stream transform reshard does not decode itself (zstd it does)."""

    def __init__(self, path: PathOrCheckpoint, _extension_registry: Optional["ExtensionRegistry"] = None) -> None:
        super().__init__()
        self._ck: Optional[Checkpoint] = None
        self._given: Optional[Checkpoint] = None  # an open Checkpoint the caller gave
        self._format: Optional[str] = None
        self._extension_registry = _extension_registry
        self._set(path)
        self.load_id = str(uuid.uuid4())
        self._clear()

    def _set(self, path: PathOrCheckpoint) -> None:
        """Read ``path`` from now on (opened by the next :meth:`read_metadata`)."""
        if isinstance(path, Checkpoint):
            self._ck = self._given = path
            self._format = path.format
            self.path = path.path
        else:
            self.path = os.fspath(path)
            self._ck = self._given = None
            self._format = None

    def _clear(self) -> None:
        """Forget what the last load read."""
        # the non-tensor values by name once the metadata is read: (raw, pickled) once read
        self._extras: Optional[Dict[str, Optional[Tuple[Optional[bytes], Optional[bytes]]]]] = None
        self._dtypes: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
        # torch's reader, for a DCP folder with stream transforms reshard does not decode
        self._torch_reader: Optional[_TorchFileSystemReader] = None
        # a load has read from the open checkpoint: the next read_metadata opens it again
        self._used = False

    @property
    def checkpoint(self) -> Checkpoint:
        """The open checkpoint (opened now when no load has opened it yet)."""
        if self._ck is None:
            self._ck = _open(self.path, format=self._format)
        return self._ck

    @property
    def checkpoint_id(self) -> str:
        """The path of the checkpoint it reads."""
        return self.path

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        """Start a new read (a new ``load_id``): of ``checkpoint_id`` when given, else of the
        same path; either is opened by the next :meth:`read_metadata`, so files written since
        are seen (an open :class:`reshard.Checkpoint` given is read again as it is)."""
        if checkpoint_id:
            self._set(checkpoint_id)  # type: ignore[arg-type]
        elif self._given is None:
            self._ck = None
        self._clear()
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """torch's ``Metadata`` of the checkpoint: one ``TensorStorageMetadata`` per tensor
        (its dtype and global shape, one chunk covering it) and one
        ``BytesStorageMetadata`` per non-tensor value, by reshard's flat names. Its
        ``storage_meta`` is, as torch's reader gives it, the one saved in a DCP checkpoint's
        metadata (``checkpoint_id``, ``save_id``, ``modules``; rank 0's of per-rank
        metadata), else one with the path read, and this reader's ``load_id``. Other arguments (torch's ``rank=``) are ignored: every
        rank sees the whole checkpoint. The checkpoint is opened here (again once a load has
        read from it), so a missing or corrupt one raises its ReshardError here."""
        if self._given is None and self._used:
            self._ck = None
        self._clear()
        try:
            ck = self.checkpoint
        except CheckpointError as e:
            md = self._transformed_metadata(e, kwargs.get("rank"))
            if md is None:
                raise
            return md
        sdm: Dict[str, Any] = {}
        for name, dt, shape, _layout in ck.tensors():
            size = torch.Size(shape)
            sdm[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_torch_dtype(dt, name)),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
            self._dtypes[name] = (dt, tuple(shape))
        extras: Dict[str, Optional[Tuple[Optional[bytes], Optional[bytes]]]] = {}
        for name in ck._extra_names():  # the values are read when a plan asks for them
            sdm[name] = BytesStorageMetadata()
            extras[name] = None
        self._extras = extras
        planner_data = {name: tuple(parts) for name, parts in ck.paths().items() if name in sdm}
        md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data={})
        if _StorageMeta is not None and hasattr(md, "storage_meta"):
            sm = _saved_storage_meta(ck)
            md.storage_meta = sm or _StorageMeta(checkpoint_id=self.path)
            md.storage_meta.load_id = self.load_id
        return md

    def _transformed_metadata(self, error: CheckpointError, rank: Optional[int]) -> Optional[Metadata]:
        """When ``error`` (the native open's) is a local DCP folder's items saved through
        stream transforms reshard does not decode and ``_extension_registry`` knows them: its
        metadata, the reads left to torch's ``FileSystemReader`` with that registry. None
        when that is not the case; a CheckpointError when the registry lacks a transform."""
        registry = self._extension_registry
        f = _metadata_file(self.path, rank)
        if registry is None or f is None:
            return None
        try:
            md = _load_dcp_metadata(f)
        except (pickle.UnpicklingError, OSError, EOFError, AttributeError, ImportError, CheckpointError):
            return None
        infos = (md.storage_data or {}).values()
        chains = {tuple(getattr(info, "transform_descriptors", None) or ()) for info in infos}
        if chains <= _NATIVE_TRANSFORMS:
            return None  # the native error stands: transforms are not what it is about
        for chain in sorted(chains - _NATIVE_TRANSFORMS):
            try:
                registry.from_descriptor_list(list(chain))
            except ValueError as ve:
                raise CheckpointError(f"{error} (nor does the _extension_registry given: {ve})") from None
        self._torch_reader = _TorchFileSystemReader(self.path, _extension_registry=registry)
        self._torch_reader.load_id = self.load_id
        if getattr(md, "storage_meta", None) is None and _StorageMeta is not None:
            md.storage_meta = _StorageMeta()
        if getattr(md, "storage_meta", None) is not None:
            md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up once :meth:`read_metadata` opened the checkpoint (torch's reader
        takes the metadata, when it reads)."""
        if self._torch_reader is not None:
            self._torch_reader.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        elif self._extras is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan unchanged: any region of any tensor can be read."""
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """The plans unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Read every item of ``plan``: tensor regions in one native read (straight into each
        target that is a contiguous CPU tensor of the checkpoint's dtype, else through a
        temporary and ``copy_``), then ``planner.commit_tensor``; non-tensor values through
        ``planner.load_bytes``. Returns a completed future. (Items of stream transforms
        reshard does not decode: torch's ``FileSystemReader.read_data``.)"""
        if self._torch_reader is not None:
            self._used = True
            return self._torch_reader.read_data(plan, planner)
        if self._extras is None:
            self.read_metadata()
        self._used = True
        extras = self._extras or {}
        ck = self.checkpoint
        tensor_items = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
        byte_items = [i for i in plan.items if i.type == LoadItemType.BYTE_IO]
        # The values the plan asks for, read before any target is written.
        unread = {n for n in (i.storage_index.fqn for i in byte_items) if n in extras and extras[n] is None}
        if unread:
            for name, raw, pickled, _opaque in ck._extras(sorted(unread)):
                extras[name] = (raw, pickled)

        # Resolve every target first, then read all regions in one native call: straight into
        # a target that is a contiguous CPU tensor of the checkpoint's dtype, else through a
        # temporary; targets that share memory (tied parameters resolve to one tensor) are
        # each written.
        fill = Fill(ck, shared="each")
        resolved: List[Tuple[Any, torch.Tensor]] = []
        for item in tensor_items:
            name = item.storage_index.fqn
            if name not in self._dtypes:
                raise RequestError(f"{self.path}: no tensor `{name}`")
            dt, shape = self._dtypes[name]
            base = item.storage_index.offset or [0] * len(shape)
            offsets = [int(b) + int(o) for b, o in zip(base, item.storage_offsets)]
            sizes = [int(n) for n in item.lengths]
            target = planner.resolve_tensor(item).detach()
            if list(target.shape) != sizes:
                raise RequestError(
                    f"tensor `{name}`: the planner's target is {tuple(target.shape)}, the region "
                    f"read {tuple(sizes)}"
                )
            fill.add(name, target, [(offsets, sizes, [0] * len(sizes))], dtype=dt)
            resolved.append((item, target))
        fill.run()
        for item, target in resolved:
            planner.commit_tensor(item, target)

        for item in byte_items:
            name = item.storage_index.fqn
            if name not in extras:
                raise RequestError(f"{self.path}: no non-tensor value `{name}`")
            planner.load_bytes(item, self._value_bytes(name, *extras[name]))

        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _value_bytes(self, name: str, raw: Optional[bytes], pickled: Optional[bytes]) -> io.BytesIO:
        """A non-tensor value as the ``torch.save`` stream ``planner.load_bytes`` expects: the
        stored one for DCP items (opaque ones too: torch unpickles them, as its own reader
        would), else the decoded value saved again."""
        if raw is not None:
            return io.BytesIO(raw)
        buf = io.BytesIO()
        try:
            torch.save(_values.decode(self.path, name, None, pickled, None), buf)
        except Exception as e:
            raise CheckpointError(f"non-tensor value `{name}` cannot be decoded: {e}") from None
        buf.seek(0)
        return buf

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        """What torch's ``FileSystemReader.validate_checkpoint_id`` says (any ``Path``; a local
        path, existing or not, under a writable folder), and True for the object-store URLs
        reshard reads (reshard detects the format when it opens the checkpoint)."""
        try:
            if _reshard.is_url(os.fspath(checkpoint_id)):
                return True
            return bool(_TorchFileSystemReader.validate_checkpoint_id(checkpoint_id))
        except TypeError:
            return False
