"""Decoding a checkpoint's non-tensor entries into Python objects, without running code
from the checkpoint: a DCP item is a ``torch.save`` stream (loaded with
``torch.load(weights_only=True)`` when torch is present, as ``dcp.load`` does), anything
else the plain pickle the native module emits, read by an unpickler that allows only the
handful of globals that pickle can name."""

import io
import pickle
from typing import Any, Optional

_ALLOWED = {
    ("_codecs", "encode"),
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


def decode(raw: Optional[bytes], pickled: bytes) -> Any:
    """The value of one entry: its stored ``torch.save`` bytes when given and torch can load
    them weights-only, else the plain pickle."""
    if raw is not None:
        try:
            import torch

            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception:
            pass  # no torch, or not a torch.save stream: the plain pickle says the same
    return _PlainUnpickler(io.BytesIO(pickled)).load()
