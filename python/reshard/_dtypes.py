"""reshard's dtype names (as safetensors names them) and torch's and numpy's dtypes."""

from typing import Any

_TORCH = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "C32": "complex32",
    "BC32": "bcomplex32",
    "C64": "complex64",
    "C128": "complex128",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4_E2M1FN_X2": "float4_e2m1fn_x2",
}

# numpy names the same types as torch; it has no bfloat16, complex32, bcomplex32, float8 or float4.
_NO_NUMPY = ("BF16", "C32", "BC32", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "F4_E2M1FN_X2")
_NUMPY = {k: v for k, v in _TORCH.items() if k not in _NO_NUMPY}

_ALIASES = {
    "bf16": "BF16", "bfloat16": "BF16", "f16": "F16", "fp16": "F16", "half": "F16",
    "float16": "F16", "f32": "F32", "fp32": "F32", "float": "F32", "float32": "F32",
    "f64": "F64", "fp64": "F64", "double": "F64", "float64": "F64", "bool": "BOOL",
    "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "c32": "C32", "complex32": "C32", "chalf": "C32", "c64": "C64",
    "complex64": "C64", "cfloat": "C64", "c128": "C128", "complex128": "C128",
    "cdouble": "C128", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0", "f8_e8m0": "F8_E8M0", "float4_e2m1fn_x2": "F4_E2M1FN_X2",
    "bcomplex32": "BC32",
}


def name_of(dtype: Any) -> str:
    """reshard's name of ``dtype``: a torch or numpy dtype, or a name such as ``"bf16"``."""
    from ._reshard import RequestError

    if isinstance(dtype, str):
        key = dtype if dtype in _TORCH else _ALIASES.get(dtype.lower())
        if key is None:
            raise RequestError(f"unknown dtype `{dtype}`")
        return key
    text = str(dtype)
    if text.startswith("torch."):
        text = text[len("torch."):]
    for k, v in _TORCH.items():
        if v == text:
            return k
    for k, v in _NUMPY.items():
        if v == text:
            return k
    raise RequestError(f"dtype {dtype} has no counterpart in checkpoints reshard reads")


def torch_dtype(name: str) -> Any:
    """The torch dtype of reshard's dtype ``name``."""
    import torch

    return getattr(torch, _TORCH[name])


def numpy_dtype(name: str) -> Any:
    """The numpy dtype of reshard's dtype ``name`` (bfloat16, complex32, float8 and float4
    have none)."""
    import numpy as np
    from ._reshard import RequestError

    if name not in _NUMPY:
        raise RequestError(
            f"{name} has no numpy dtype; use framework=\"pt\" or pass dtype= to convert it"
        )
    return np.dtype(_NUMPY[name])
