"""Quantized frozen base weights under a LoRA adapter (QLoRA, 8-bit LoRA), sharded by FSDP2.

    quant_kind(cfg)                      "nf4" (load_in_4bit), "int8" (load_in_8bit) or None
    quantize_base(model, cfg, shards)    every frozen linear weight (not the output layer, not
                                         llm_int8_skip_modules) becomes a torchao tensor
                                         subclass, still on the meta device; their names
    load_quantized(model, full, mesh)    rank 0's full weights, broadcast one at a time,
                                         quantized whole and cut into this rank's rows

The weights are torchao tensor subclasses that implement FSDP2's all-gather extension
(`fsdp_pre_all_gather` / `fsdp_post_all_gather`): each rank keeps its rows of the packed data
and scales, an all-gather moves the packed bytes, and `F.linear` dequantizes in the activations'
dtype. NF4 (`NF4Tensor`, what torchtune's QLoRA uses): blocks of 64 weights with one absmax
scale each, the scales themselves quantized to int8 per 256 blocks (bitsandbytes' defaults for
NF4 with double quantization). int8 (`Int8QuantizedTrainingLinearWeight`): one absmax scale per
row. bitsandbytes' own `Params4bit` is not used: under FSDP2 it needs torch's `FSDPParam`
patched (bitsandbytes issue #1945), which these subclasses do not.

A weight is quantized whole and then cut into FSDP2's row shards, so every world size trains on
the same quantized values (a resume at another world size gives the same losses). NF4 needs
the shards to hold whole blocks and whole groups of scales: a weight whose shape does not allow
that stays in float (one log line counts them).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError

log = logging.getLogger("shardforge")

NF4_BLOCK = 64  # weights per absmax scale (bitsandbytes' NF4 blocksize)
NF4_SCALER_BLOCK = 256  # scales per int8 group of the double quantization (bitsandbytes')
EXTRA = "quant"  # the pyproject extra that installs torchao


def quant_kind(cfg: ShardforgeConfig) -> str | None:
    if cfg.load_in_4bit:
        return "nf4"
    if cfg.load_in_8bit:
        return "int8"
    return None


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao's import logs a warning per CUDA kernel library it cannot load (none on a CPU
    build) and torch's pytree one per enum it registers: none of it is about the run."""
    names = ("torchao", "torch.utils._pytree")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


def _subclasses() -> tuple[type[Any], type[Any]]:
    """(NF4Tensor, Int8QuantizedTrainingLinearWeight); a ConfigError naming the extra when
    torchao is not installed."""
    try:
        with _quiet_import():
            from torchao.prototype.quantized_training.int8 import (
                Int8QuantizedTrainingLinearWeight,
            )
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor
    except ImportError as exc:
        raise ConfigError(
            "load_in_4bit / load_in_8bit",
            [f"needs torchao ({exc.name}): pip install 'shardforge[{EXTRA}]'"],
        ) from None
    _register_int8_empty_like(Int8QuantizedTrainingLinearWeight)
    return NF4Tensor, Int8QuantizedTrainingLinearWeight


def check_quant(cfg: ShardforgeConfig, compute: torch.dtype | None) -> list[tuple[str, str]]:
    """Preflight: the package a quantized run needs is installed; bnb_4bit_compute_dtype, if
    set, is `compute`, the dtype the run computes in (the dequantized weight meets the
    activations in it: `bf16` / `fp16` / fsdp.mixed_precision; None: float32)."""
    from shardforge.config.schema_lora import bnb_dtype

    if quant_kind(cfg) is None:
        return []
    key = "load_in_4bit" if cfg.load_in_4bit else "load_in_8bit"
    try:
        _subclasses()
    except ConfigError as exc:
        return [(key, exc.problems[0])]
    wanted = (cfg.bnb_config_kwargs or {}).get("bnb_4bit_compute_dtype")
    runs = compute or torch.float32
    if wanted is not None and bnb_dtype(wanted) != str(runs).removeprefix("torch."):
        return [
            (
                "bnb_config_kwargs.bnb_4bit_compute_dtype",
                f"{wanted}, but the run computes in {runs} (bf16 / fp16 / "
                "fsdp.mixed_precision.param_dtype); make them agree",
            )
        ]
    return []


_REGISTERED: set[type[Any]] = set()


def _register_int8_empty_like(cls: type[Any]) -> None:
    """`nn.Module.to_empty` (how the sharded model gets its memory) calls `empty_like`, which
    torchao's int8 training weight does not implement: an empty int8 weight of the same rows."""
    if cls in _REGISTERED:
        return

    @cls.implements(torch.ops.aten.empty_like.default)
    def _empty_like(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        device = (kwargs or {}).get("device")
        weight = args[0]
        return cls(
            torch.empty_like(weight.int_data, device=device),
            torch.empty_like(weight.scale, device=device),
        )

    _REGISTERED.add(cls)


def nf4_scaler_block(shape: torch.Size, shards: int) -> int | None:
    """The NF4 scaler block for a weight of `shape` cut into `shards` row shards: the largest
    power of two up to 256 that lets every shard hold whole blocks and whole scaler groups
    (None: the weight cannot be sharded in NF4)."""
    if len(shape) != 2 or shape[0] % shards or (shape[0] * shape[1]) % NF4_BLOCK:
        return None
    blocks = shape[0] * shape[1] // NF4_BLOCK
    size = NF4_SCALER_BLOCK
    while size >= 1:
        if blocks % size == 0 and (blocks // size) % shards == 0:
            return size
        size //= 2
    return None


# the parts of a lora_modules_to_save wrapper: the frozen original and the trained copy
_WRAPPED = re.compile(r"(^|\.)(original_module|modules_to_save)(\.|$)")


def _skipped(name: str, skip: list[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def _frozen_linears(model: nn.Module, skip: list[str]) -> Iterator[tuple[str, nn.Linear]]:
    """Every nn.Linear whose weight is frozen (a LoRA layer's base layer, an unadapted linear),
    except the output layer (and a `lora_modules_to_save` copy of it), a weight tied to an
    embedding and the `skip` names (a LoRA layer's base layer counts as the LoRA layer's
    name)."""
    get_output: Any = getattr(model, "get_output_embeddings", None)
    output = get_output() if get_output is not None else None
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is output or _WRAPPED.search(name):
            continue
        weight = module.weight
        if weight.requires_grad or weight.dim() != 2 or id(weight) in embedded:  # tied
            continue
        if _skipped(name.removesuffix(".base_layer"), skip):
            continue
        yield name, module


def quantize_base(model: nn.Module, cfg: ShardforgeConfig, mesh: tuple[int, ...]) -> set[str]:
    """Replace the frozen linear weights of the meta-device `model` by quantized ones (meta
    too), before FSDP2 shards it over a mesh of shape `mesh`; return their parameter names."""
    kind = quant_kind(cfg)
    if len(mesh) != 1:
        raise ConfigError(
            "load_in_4bit" if kind == "nf4" else "load_in_8bit",
            [
                "quantized base weights are sharded over one mesh dimension: HSDP "
                "(dp_replicate_size, fsdp.hybrid_shard) is not supported with them yet"
            ],
        )
    shards = mesh[0]
    nf4, int8 = _subclasses()
    skip = list((cfg.bnb_config_kwargs or {}).get("llm_int8_skip_modules") or [])
    names: set[str] = set()
    kept: list[str] = []
    for name, module in _frozen_linears(model, skip):
        weight = module.weight
        if kind == "nf4":
            scaler = nf4_scaler_block(weight.shape, shards)
            if scaler is None:
                kept.append(name)
                continue
            quantized = nf4.from_tensor(weight.detach(), NF4_BLOCK, scaler)
        else:
            quantized = int8.from_float(weight.detach())
        module.weight = nn.Parameter(quantized, requires_grad=False)
        names.add(f"{name}.weight")
    log.info(
        "%s base weights: %d linear layers quantized%s",
        "NF4 (4-bit)" if kind == "nf4" else "int8 (8-bit)",
        len(names),
        f"; {len(kept)} kept in float (their shape does not split into NF4 blocks over "
        f"{shards} ranks: {', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''})"
        if kept
        else "",
    )
    return names


def unsharded(model: nn.Module, names: set[str], mesh: tuple[int, ...]) -> set[nn.Parameter]:
    """The quantized parameters FSDP2 must leave alone: all of them on one rank, where torch's
    FSDP2 takes a shortcut (`FSDPParamGroup.wait_for_unshard` at world size 1) that copies only
    the first of the tensors a tensor subclass all-gathers (NF4 has three, int8 two); one rank
    holds them whole anyway. None elsewhere."""
    if mesh != (1,):
        return set()
    return {p for n, p in model.named_parameters() if n in names}


def load_quantized(
    model: nn.Module, full: dict[str, torch.Tensor], names: set[str], device: torch.device
) -> None:
    """Fill the quantized parameters `names` of the sharded `model`: rank 0 (holding `full`)
    broadcasts each weight, every rank quantizes it whole and keeps its rows."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    nf4, _ = _subclasses()
    params = dict(model.named_parameters())
    for name in sorted(names):
        param = params[name]
        if isinstance(param, DTensor):
            mesh = param.device_mesh  # 1-D (quantize_base)
            index, shards, local = mesh.get_local_rank(), mesh.size(), param._local_tensor
        else:  # left out of FSDP2 (`unsharded`)
            index, shards, local = 0, 1, param
        local = cast(Any, local)  # a torchao subclass
        if dist.get_rank() == 0:
            whole = full.pop(name).to(device=device, dtype=torch.float32).contiguous()
        else:
            whole = torch.empty(param.shape, dtype=torch.float32, device=device)
        dist.broadcast(whole, src=0)
        if isinstance(local, nf4):
            quantized = nf4.from_tensor(whole, local.block_size, local.scaler_block_size)
        else:
            quantized = type(local).from_float(whole)
        del whole
        chunk: Any = torch.chunk(quantized, shards, dim=0)[index]
        with torch.no_grad():
            local.copy_(chunk)
        if isinstance(local, nf4):  # not inner tensors: left on the meta device by to_empty
            local.scaler_mean = chunk.scaler_mean.clone()
            local.nf4 = chunk.nf4.clone()
