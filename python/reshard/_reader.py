"""``reshard.torch.StorageReader``: a ``torch.distributed.checkpoint.StorageReader`` over any
checkpoint reshard reads, so ``dcp.load`` (and any planner) loads DCP folders of any torch
version, ``torch.save`` files, safetensors files and folders, Hugging Face sharded folders
and Lightning Fabric folders alike.

The metadata it gives torch holds one entry per checkpoint entry, under reshard's flat name
(a DCP ``.metadata`` key, or the flattened key of a ``torch.save`` / safetensors entry):
each tensor as one chunk covering the whole tensor, since reshard reads any region of it;
each non-tensor value as bytes. Reads of one plan go to the Rust library in one batch, with
the GIL released, straight into the target tensors' memory where that memory fits.
"""

import io
import os
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
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

__all__ = ["StorageReader"]

PathOrCheckpoint = Union[str, "os.PathLike[str]", Checkpoint]


def _torch_dtype(name: str, tensor: str) -> torch.dtype:
    """The torch dtype of reshard's dtype ``name``, or a RequestError naming the tensor."""
    try:
        return _dtypes.torch_dtype(name)
    except (KeyError, AttributeError):
        raise RequestError(
            f"tensor `{tensor}`: dtype {name} has no counterpart in torch {torch.__version__}"
        ) from None


class StorageReader(_TorchStorageReader):
    """A ``torch.distributed.checkpoint.StorageReader`` reading the checkpoint at ``path``
    (any format :func:`reshard.open` reads, or an open :class:`reshard.Checkpoint`), whatever
    the world size it was saved at: ``dcp.load(sd, storage_reader=StorageReader(path))``.
    The checkpoint is opened (and validated) here, so a missing or corrupt checkpoint
    raises a :class:`reshard.ReshardError` at once."""

    def __init__(self, path: PathOrCheckpoint) -> None:
        super().__init__()
        self._ck: Optional[Checkpoint] = None
        self._format: Optional[str] = None
        self._set(path)
        self.load_id = uuid.uuid4().hex
        # the non-tensor values by name once the metadata is read: (raw, pickled) once read
        self._extras: Optional[Dict[str, Optional[Tuple[Optional[bytes], bytes]]]] = None
        self._dtypes: Dict[str, Tuple[str, Tuple[int, ...]]] = {}

    def _set(self, path: PathOrCheckpoint) -> None:
        if isinstance(path, Checkpoint):
            self._ck = path
            self._format = path.format
            self.path = path.path
        else:
            self.path = os.fspath(path)
            self._format = None
            self._ck = _open(self.path)

    @property
    def checkpoint(self) -> Checkpoint:
        """The open checkpoint (opened again after :meth:`reset` once it was read)."""
        if self._ck is None:
            self._ck = _open(self.path, format=self._format)
        return self._ck

    @property
    def checkpoint_id(self) -> str:
        """The path of the checkpoint it reads."""
        return self.path

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        """Start a new read: of ``checkpoint_id`` when given (opened at once), else of the
        same path, opened again so that files written since are seen."""
        if checkpoint_id:
            self._set(checkpoint_id)  # type: ignore[arg-type]
        elif self._extras is not None:
            self._ck = None
        self._extras = None
        self._dtypes = {}
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """torch's ``Metadata`` of the checkpoint: one ``TensorStorageMetadata`` per tensor
        (its dtype and global shape, one chunk covering it) and one
        ``BytesStorageMetadata`` per non-tensor value, by reshard's flat names. Other
        arguments (torch's ``rank=``) are ignored: every rank sees the whole checkpoint."""
        ck = self.checkpoint
        sdm: Dict[str, Any] = {}
        self._dtypes = {}
        for name, dt, shape, _layout in ck.tensors():
            size = torch.Size(shape)
            sdm[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_torch_dtype(dt, name)),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
            self._dtypes[name] = (dt, tuple(shape))
        self._extras = {}
        for name in ck._extra_names():  # the values are read when a plan asks for them
            sdm[name] = BytesStorageMetadata()
            self._extras[name] = None
        planner_data = {name: tuple(parts) for name, parts in ck.paths().items() if name in sdm}
        md = Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data={})
        if _StorageMeta is not None and hasattr(md, "storage_meta"):
            md.storage_meta = _StorageMeta(checkpoint_id=self.path, load_id=self.load_id)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the checkpoint was opened already."""
        if self._extras is None:
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
        ``planner.load_bytes``. Returns a completed future."""
        if self._extras is None:
            self.read_metadata()
        extras = self._extras or {}
        ck = self.checkpoint
        tensor_items = [i for i in plan.items if i.type != LoadItemType.BYTE_IO]
        byte_items = [i for i in plan.items if i.type == LoadItemType.BYTE_IO]
        # The values the plan asks for, read before any target is written.
        unread = {n for n in (i.storage_index.fqn for i in byte_items) if n in extras and extras[n] is None}
        if unread:
            for name, raw, pickled in ck._extras(sorted(unread)):
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

    @staticmethod
    def _value_bytes(name: str, raw: Optional[bytes], pickled: bytes) -> io.BytesIO:
        """A non-tensor value as the ``torch.save`` stream ``planner.load_bytes`` expects: the
        stored one for DCP items, else the decoded value saved again."""
        if raw is not None:
            return io.BytesIO(raw)
        buf = io.BytesIO()
        try:
            torch.save(_values.decode(None, pickled), buf)
        except Exception as e:
            raise CheckpointError(f"non-tensor value `{name}` cannot be decoded: {e}") from None
        buf.seek(0)
        return buf

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        """Whether ``checkpoint_id`` is a path that exists or an object-store URL (reshard
        detects its format when it opens it)."""
        try:
            text = os.fspath(checkpoint_id)
            return _reshard.is_url(text) or os.path.exists(text)
        except TypeError:
            return False
