"""Quantized weights a checkpoint stores under other names than the architecture built on the
meta device has (a key table and pure functions).

FP8 checkpoints (``quant_method: fp8``, ``weight`` in ``float8_e4m3fn`` beside a float32
``weight_scale_inv``) are described by transformers' own quantizer on the meta device
(`merge.check`). MXFP4 ones (gpt-oss: ``quant_method: mxfp4``) cannot be: transformers builds
their modules only with its Triton kernels. Their table is here: each packed expert parameter
``P`` of shape [E, in, out] (as the model holds it dequantized) is stored as ``P_blocks``
[E, out, in / 32, 16] (two 4-bit values a byte, 32 values a block) and ``P_scales``
[E, out, in / 32] (one exponent byte a block), both uint8, which transformers dequantizes on
load.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

MXFP4 = "mxfp4"
# quant methods whose stored layout transformers' own quantizer builds on the meta device (other
# methods' configs are checked against the plain architecture, as saved before quantization)
META_QUANTIZED: frozenset[str] = frozenset({"fp8"})
# parameters of an experts module that MXFP4 stores packed
MXFP4_PACKED: tuple[str, ...] = ("gate_up_proj", "down_proj")
MXFP4_BLOCK = 32  # values per block (per scale byte)
MXFP4_BLOCK_BYTES = MXFP4_BLOCK // 2


def quant_method(config: Any) -> str | None:
    """The config's ``quantization_config.quant_method``, None when it has none."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = (
        qc.get("quant_method") if isinstance(qc, Mapping) else getattr(qc, "quant_method", None)
    )
    return str(getattr(method, "value", method)) if method is not None else None


def _not_converted(config: Any) -> list[str]:
    qc = getattr(config, "quantization_config", None)
    found = qc.get("modules_to_not_convert") if isinstance(qc, Mapping) else None
    if found is None and qc is not None and not isinstance(qc, Mapping):
        found = getattr(qc, "modules_to_not_convert", None)
    return [str(p) for p in found or ()]


def mxfp4_packed(name: str, shape: tuple[int, ...], config: Any) -> dict[str, tuple[int, ...]]:
    """The packed tensors (name -> shape) an MXFP4 checkpoint stores for the in-memory tensor
    `name`; empty when it is stored as it is."""
    module, _, param = name.rpartition(".")
    if param not in MXFP4_PACKED or not module.endswith(".experts") or len(shape) != 3:
        return {}
    if any(fnmatch.fnmatch(module, p) or module.startswith(p) for p in _not_converted(config)):
        return {}
    experts, size_in, size_out = shape
    if size_in % MXFP4_BLOCK:
        return {}
    groups = size_in // MXFP4_BLOCK
    return {
        f"{name}_blocks": (experts, size_out, groups, MXFP4_BLOCK_BYTES),
        f"{name}_scales": (experts, size_out, groups),
    }


def scale_names(weight: str) -> tuple[str, ...]:
    """The names a quantized weight's scales are saved under, beside it: fine-grained FP8's
    ``weight_scale_inv`` (``<fused expert>_scale_inv`` for fused experts), MXFP4's
    ``_scales`` beside ``_blocks``."""
    if weight.endswith("_blocks"):
        return (weight.removesuffix("_blocks") + "_scales",)
    return (f"{weight}_scale_inv", f"{weight}_scale")


def kept_as_stored(dtypes: Mapping[str, Any]) -> set[str]:
    """The tensors of quantized weights (name -> dtype of every tensor saved): float8 and
    packed float4 weights, MXFP4 blocks, and the scales saved beside them. They keep their
    stored dtype whatever the output dtype: a cast would change what the scales mean."""
    from shardforge.io.dtypes import dtype_info

    def quantized(name: str, dtype: Any) -> bool:
        row = dtype_info(dtype)
        return name.endswith("_blocks") or (row is not None and row.kind in ("float8", "float4"))

    weights = {n for n, d in dtypes.items() if quantized(n, d)}
    return weights | {s for w in weights for s in scale_names(w) if s in dtypes}
