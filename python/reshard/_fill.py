"""Filling torch tensors from a checkpoint in one native read: the one buffer fill of
:func:`reshard.torch.load` and :class:`reshard.torch.StorageReader`.

A target that can take the bytes in place (a contiguous CPU tensor of the dtype read, not
empty) is read into directly; any other (on CUDA, strided, of another dtype) through a
temporary CPU tensor of the dtype read (pinned for a CUDA target) and ``copy_`` after the
read. Targets that share memory are resolved by the caller's rule, ``shared``:

- ``"last"`` (``reshard.torch.load``): a tensor added again under another name (the same
  address and size; FSDP1 shares one ``step`` among parameters) is read once, for the last
  name, as ``dcp.load``'s writes in turn leave it. Partial overlaps are refused by the
  native read.
- ``"each"`` (the StorageReader): every target is written. Of targets that overlap, the
  lowest in memory (of those not overlapping one before it) is read in place, the others
  through temporaries, copied in the order added (tied parameters resolve to one tensor).
"""

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from . import Checkpoint, _dtypes

Parts = List[Tuple[List[int], List[int], List[int]]]


class Fill:
    """Targets gathered for one native read of ``ck``, filled by :meth:`run`."""

    def __init__(self, ck: Checkpoint, *, shared: str, views: Optional[Dict[str, str]] = None,
                 progress: Any = None) -> None:
        if shared not in ("last", "each"):
            raise ValueError(f'shared must be "last" or "each", not {shared!r}')
        self.ck = ck
        # a callable (done_bytes, total_bytes), called while the read runs
        self.progress = progress
        self.shared = shared
        # names read through a recipe's view (JSON) of the checkpoint's tensors, when given
        self.views = views
        # (checkpoint name, dtype read, target, parts)
        self.items: List[Tuple[str, str, torch.Tensor, Parts]] = []

    def add(self, name: str, target: torch.Tensor, parts: Parts, dtype: Optional[str] = None) -> None:
        """Read the ``parts`` (``(offsets, sizes, at)``: the global region at ``offsets`` of
        checkpoint tensor ``name`` placed at ``at`` of the target) into ``target``, read as
        reshard dtype ``dtype`` (default: the target's own, the native read casting
        floating types), then cast by ``copy_`` where the target's dtype differs."""
        dt = _dtypes.name_of(target.dtype) if dtype is None else dtype
        self.items.append((name, dt, target, parts))

    def _direct(self, target: torch.Tensor, dt: str) -> bool:
        return (
            target.device.type == "cpu"
            and target.is_contiguous()
            and target.dtype == _dtypes.torch_dtype(dt)
            and target.numel() > 0
        )

    def _in_place(self) -> Set[int]:
        """The items read straight into their targets (indices)."""
        spans = []  # (address, nbytes, index) of the items that could be
        for i, (_n, dt, target, _p) in enumerate(self.items):
            if self._direct(target, dt):
                spans.append((target.data_ptr(), target.numel() * target.element_size(), i))
        if self.shared == "last":
            return {i for _a, _n, i in spans}
        in_place: Set[int] = set()
        end = 0
        for addr, n, i in sorted(spans):
            if addr >= end:
                in_place.add(i)
                end = addr + n
        return in_place

    def run(self) -> None:
        """Read every target, then copy the temporaries into theirs."""
        in_place = self._in_place()
        dests: List[Tuple[Any, ...]] = []
        alias: Dict[Tuple[int, int], int] = {}  # (address, nbytes) -> its entry in dests
        copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
        keep: List[torch.Tensor] = []  # the buffers read into, alive until the read ends
        for i, (name, dt, target, parts) in enumerate(self.items):
            if i in in_place:
                buf = target
            else:
                pin = target.device.type == "cuda" and torch.cuda.is_available()
                buf = torch.empty(tuple(target.shape), dtype=_dtypes.torch_dtype(dt), pin_memory=pin)
                copies.append((target, buf))
            keep.append(buf)
            nbytes = buf.numel() * buf.element_size()
            entry = (name, dt, list(buf.shape), parts, buf.data_ptr() if nbytes else 0, nbytes)
            if i in in_place and self.shared == "last":
                same = alias.setdefault((buf.data_ptr(), nbytes), len(dests))
                if same != len(dests):
                    dests[same] = entry  # the same tensor again: the last name wins
                    continue
            dests.append(entry)
        if dests and self.views is not None:
            self.ck._ck.read_views_into(dests, [self.views[d[0]] for d in dests], self.progress)
        elif dests:
            self.ck._read_into(dests, self.progress)
        for target, buf in copies:
            target.copy_(buf, non_blocking=buf.is_pinned())
        if any(t.device.type == "cuda" for t, _ in copies):
            torch.cuda.synchronize()
