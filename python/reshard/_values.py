"""Decoding a checkpoint's non-tensor entries into Python objects, without running code
from the checkpoint: a DCP item is a ``torch.save`` stream (loaded with
``torch.load(weights_only=True)`` when torch is present, as ``dcp.load`` does), anything
else the plain pickle the native module emits, read by an unpickler that allows only the
handful of globals that pickle can name. A value whose pickle names a global outside the
native reader's allow-list is opaque: torch decodes it only where ``torch.load(weights_only=True)``
accepts it (a class given to ``torch.serialization.add_safe_globals``), else asking for it is
an error naming the key and the global."""

import io
import pickle
from typing import Any, Optional

_ALLOWED = {
    ("_codecs", "encode"),
    ("_io", "BytesIO"),  # made from its bytes, position and __dict__ by __setstate__
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("collections", "OrderedDict"),
    ("torch", "device"),
    ("torch", "Size"),
}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and _is_torch_dtype(name)):
            if module == "torch":
                import torch

                return getattr(torch, name)
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _is_torch_dtype(name: str) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(getattr(torch, name, None), torch.dtype)


def decode(where: str, name: str, raw: Optional[bytes], pickled: Optional[bytes], opaque: Optional[str]) -> Any:
    """The value of one entry (``where`` the checkpoint, for messages): its stored
    ``torch.save`` bytes when given and torch can load them weights-only, else the plain
    pickle; an opaque entry (``pickled`` None, ``opaque`` the global its pickle names) that
    torch does not load weights-only is a CheckpointError naming the key and the global."""
    if raw is not None:
        try:
            import torch

            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception:
            pass  # no torch, or not a torch.save stream: the plain pickle says the same
    if pickled is None:
        from ._reshard import CheckpointError

        raise CheckpointError(
            f"{where}: non-tensor value `{name}` is a pickle naming `{opaque}`, which reshard does "
            f"not import or call; dcp.load with reshard.torch.StorageReader hands torch its stored "
            f"bytes, Checkpoint.value_bytes({name!r}) gives them"
        )
    return _PlainUnpickler(io.BytesIO(pickled)).load()
