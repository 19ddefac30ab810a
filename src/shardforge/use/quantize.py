"""`quantize_model`: post-training quantization of the trained model with torchao (Axolotl's
`quantize`), written as a Hugging Face folder that transformers loads (`TorchAoConfig` in its
config.json, torchao's tensors in safetensors) and generates from.

    from shardforge.config import load_cfg
    from shardforge.use.quantize import quantize_model
    out = quantize_model(load_cfg("cfg.yml"), base_model="outputs/merged")   # out.path, sizes

The model is quantized as transformers loads it (`from_pretrained(quantization_config=
TorchAoConfig(...))`): the linear layers of the blocks int8 per output channel
(`Int8WeightOnlyConfig`) or int4 in groups (`Int4WeightOnlyConfig`, torchao's CUDA kernels),
the activations too with `activation_dtype: int8`; with `quantize_embedding` the input embedding
(int8 per row, `IntxWeightOnlyConfig`) and the LM head too (transformers keeps both by
default). The output is OUTPUT_DIR/quantized (as Axolotl), written
beside and renamed into place; a previous quantized model there is replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.config import coerce_cfg
from shardforge.config.schema import ShardforgeConfig, names_object_storage
from shardforge.errors import ShardforgeError
from shardforge.io.publish import atomic_directory, check_output_path, current_umask
from shardforge.use.model import Picked, merged_checkpoint, pick, tokenizer_of
from shardforge.use.request import ModelRequest, QuantizeRequest

log = logging.getLogger("shardforge")

# Axolotl's default group size for int4 (its PTQConfig)
DEFAULT_GROUP_SIZE = 32
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Quantized:
    path: Path
    size_before: int  # bytes of the source's weight files
    size_after: int  # bytes of the output's weight files
    method: str  # the torchao config, as its name says it


def weight_bytes(folder: Path) -> int:
    """The bytes of a model folder's weight files."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))


def import_torchao() -> Any:
    try:
        import torchao
    except ImportError:
        raise ShardforgeError(
            "quantize needs torchao, which is not installed: pip install 'shardforge[quant]'"
        ) from None
    return torchao


def linear_config(request: QuantizeRequest) -> Any:
    """torchao's config for the linear layers (Axolotl's weight / activation dtypes)."""
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    group = request.group_size or DEFAULT_GROUP_SIZE
    if request.weight_dtype == "int8":
        if request.activation_dtype == "int8":
            return Int8DynamicActivationInt8WeightConfig()
        return Int8WeightOnlyConfig()
    if request.activation_dtype == "int8":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4,  # type: ignore[attr-defined]
            weight_granularity=PerGroup(group),
        )
    return Int4WeightOnlyConfig(group_size=group)


def _embedding_name(source: Path, trust_remote_code: bool) -> str:
    """The module name of the model's input embedding (from a model built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding)


def torchao_config(request: QuantizeRequest, source: Path, trust_remote_code: bool) -> Any:
    """transformers' TorchAoConfig: the linear layers; with quantize_embedding the input
    embedding (int8 per row) and the LM head (as the linear layers) too."""
    from torchao.quantization import FqnToConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis
    from transformers import TorchAoConfig

    linear = linear_config(request)
    if not request.quantize_embedding:  # transformers' default: both kept as they are
        return TorchAoConfig(linear)
    embedding = _embedding_name(source, trust_remote_code)
    per_row = IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    modules = FqnToConfig({"_default": linear, embedding: per_row})
    return TorchAoConfig(modules, include_input_output_embeddings=True)


def _checks(config: ShardforgeConfig, request: QuantizeRequest, picked: Picked) -> Path:
    """The output folder, once every refusal is past."""
    if picked.kind == "adapter":
        raise ShardforgeError(
            f"{picked.path} is a LoRA adapter: fuse it first (shardforge merge-lora CFG), then "
            "quantize the fused model with --base_model DIR"
        )
    if picked.kind == "base" and not picked.path.is_dir():
        raise ShardforgeError(
            f"base_model {picked.path}: quantize reads a local model folder; give --base_model DIR"
        )
    if request.weight_dtype == "int4" and not torch.cuda.is_available():
        raise ShardforgeError(
            "--weight_dtype int4 needs a CUDA GPU (torchao's int4 kernels); use --weight_dtype "
            "int8 on this machine"
        )
    root = request.output_dir or Path(config.output_dir)
    if names_object_storage(str(root)):
        raise ShardforgeError(
            f"{root}: quantize writes a local folder; give --output_dir DIR (a local path)"
        )
    return root / "quantized"


def _write(config: ShardforgeConfig, request: QuantizeRequest, source: Path, out: Path) -> Any:
    """Load `source` quantized and write it (with its tokenizer) to `out`; torchao's config."""
    from transformers import AutoModelForCausalLM

    # torchao 0.18 calls FqnToConfig's "_default" deprecated; transformers 5 still reads it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Config Deprecation: _default", UserWarning)
        quant = torchao_config(request, source, config.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype="auto",
            quantization_config=quant,
            device_map="cuda" if torch.cuda.is_available() else None,
            trust_remote_code=config.trust_remote_code,
            use_safetensors=True,
        )
    tokenizer = tokenizer_of(config, source)
    with atomic_directory(out, overwrite=True, model_only=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for written in tmp.iterdir():  # transformers writes the weights private (0600)
            os.chmod(written, 0o666 & ~current_umask())
    return quant.quant_type


def settled(config: ShardforgeConfig, request: QuantizeRequest) -> QuantizeRequest:
    """The request with what its flags leave open taken from the config's `quantization:`
    block (Axolotl's: a flag wins), else the defaults (int8 weights, no activations)."""
    block = config.quantization
    if block is None:
        return dataclasses.replace(request, weight_dtype=request.weight_dtype or "int8")
    weight = request.weight_dtype or block.weight_dtype
    return dataclasses.replace(  # checked again as it is made
        request,
        weight_dtype=weight,
        activation_dtype=request.activation_dtype or block.activation_dtype,
        # the block's group size is for int4 (Axolotl writes one for every dtype)
        group_size=request.group_size or (block.group_size if weight == "int4" else None),
        quantize_embedding=request.quantize_embedding or bool(block.quantize_embedding),
    )


def quantize_model(cfg: Any, named_base: bool = False, **options: Any) -> Quantized:
    """Quantize the model `options` name (`QuantizeRequest`'s fields; none: the run's own, or
    base_model where it names the model) into OUTPUT_DIR/quantized."""
    config = coerce_cfg(cfg)
    request = settled(config, QuantizeRequest(**options))
    which = ModelRequest(
        model_dir=request.base_model or request.model_dir,
        lora_model_dir=request.lora_model_dir,
        checkpoint=request.checkpoint,
        step=request.step,
    )
    picked = pick(config, which, named_base)
    out = _checks(config, request, picked)
    check_output_path(out, overwrite=True, inputs=[picked.path])  # before anything is loaded
    import_torchao()
    log.info("model: %s", picked.describe())
    if picked.kind == "checkpoint":
        with merged_checkpoint(config, picked) as merged:
            before = weight_bytes(merged)
            method = _write(config, request, merged, out)
    else:
        before = weight_bytes(picked.path)
        method = _write(config, request, picked.path, out)
    after = weight_bytes(out)
    table = getattr(method, "fqn_to_config", {"linear layers": method})
    names = ", ".join(f"{k}: {type(v).__name__}" for k, v in table.items())
    log.info("quantized (%s): %s", names, out)
    return Quantized(out, before, after, names)
