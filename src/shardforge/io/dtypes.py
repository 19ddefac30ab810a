"""Dtype tables for names found in checkpoint pickles (no lookup runs code)."""

from __future__ import annotations

import torch

# the torch dtype objects a pickle may name: ``torch.float32``, ``torch.bfloat16``, ...
DTYPES: dict[str, torch.dtype] = {
    name: value
    for name in dir(torch)
    if isinstance(value := getattr(torch, name, None), torch.dtype)
}

# the legacy typed-storage classes ``torch.save`` names -> element dtype
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
