"""Which trained weights to use, and loading them: a Hugging Face directory, the base model with a
PEFT adapter (peft), or a sharded checkpoint merged on the fly by the merge itself.

    pick(cfg, request)      the weights the options (or the run's output_dir) name, checked
                            without loading them
    load_model(cfg, picked) the model (on the GPU when there is one) and its tokenizer

Without an option the run's own weights are used: for a run with `adapter`, the adapter
(lora_model_dir, else output_dir when it holds one); otherwise the full-model save in
output_dir (FULL_STATE_DICT); else the latest complete checkpoint under output_dir, merged into
a temporary directory (`merge_fsdp_weights`, the adapter fused for a LoRA run) that is removed
once the model is loaded.

A full fine-tune's `base_model` names the model instead, as in Axolotl (`axolotl inference
cfg.yml --base-model ./completed-model`), when the user named it on the command line
(`named_base`) or when it is a model merged from this run's own checkpoints (its manifest's
source lies under output_dir): output_dir is then not looked at.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from shardforge.config.chat_templates import resolve_chat_template
from shardforge.config.peft import ADAPTER_CONFIG
from shardforge.config.schema import ShardforgeConfig, names_object_storage
from shardforge.errors import CheckpointError, ShardforgeError
from shardforge.io.files import read_json
from shardforge.io.publish import sigterm_as_interrupt
from shardforge.layouts.catalog import FULL_WEIGHTS, LAST, resolve_checkpoint
from shardforge.merge.api import merge_fsdp_weights
from shardforge.merge.lora import read_adapter
from shardforge.sinks.companions import has_tokenizer
from shardforge.sinks.manifest import MANIFEST
from shardforge.train.data import load_tokenizer
from shardforge.train.model import compute_dtypes, require_local_or_hub_id
from shardforge.use.request import ModelRequest

log = logging.getLogger("shardforge")

# the weight files a Hugging Face directory is loaded from (safetensors only: no pickle)
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
NAME_ONE = "or name the model: --model_dir DIR, --lora_model_dir DIR or --checkpoint PATH"


@dataclass(frozen=True)
class Picked:
    """The weights to use: a model directory, an adapter directory (on the config's
    base_model) or a checkpoint root with its step (None: the latest) to merge first."""

    kind: Literal["model", "adapter", "checkpoint", "base"]
    path: Path
    how: str  # why these weights, for the log line
    step: int | None = None  # the step asked for (a checkpoint root: None is the latest)
    found: str = ""  # the checkpoint the merge will read

    def describe(self) -> str:
        if self.kind == "adapter":
            return f"base_model + adapter {self.path} ({self.how})"
        if self.kind == "checkpoint":
            return f"{self.found}, merged on the fly ({self.how})"
        if self.kind == "base":
            return f"{self.found} ({self.how})"
        return f"{self.path} ({self.how})"


@dataclass(frozen=True)
class Loaded:
    """A model ready to run (eval mode, on its device) and the tokenizer that goes with it."""

    model: Any
    tokenizer: Any
    device: torch.device


def _model_dir(path: Path, how: str) -> Picked:
    if not path.is_dir():
        raise CheckpointError(f"{path}: model directory not found ({how}); check the path")
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path}: no config.json, so not a Hugging Face model directory ({how}); give a "
            "merge's output_path"
        )
    if not any((path / name).is_file() for name in SAFETENSORS_WEIGHTS):
        raise CheckpointError(
            f"{path}: no model.safetensors (or its index) ({how}); shardforge loads safetensors "
            "weights only"
        )
    return Picked("model", path, how)


def _adapter(path: Path, how: str) -> Picked:
    read_adapter(path)  # a PEFT directory with safetensors weights, or a CheckpointError
    return Picked("adapter", path, how)


def _checkpoint(root: Path, step: int | None, how: str, named: bool = True) -> Picked:
    """Checkpoint `step` (None: the latest) under `root`; `named`: the options named it (else
    the error says how to name a model)."""
    hint = [] if named else [NAME_ONE]
    if not root.exists() or (root.is_dir() and not any(root.iterdir())):
        what = "no such directory" if not root.exists() else "an empty directory"
        why = "no checkpoint" if named else "the run has no checkpoint yet (train first)"
        raise CheckpointError(f"{root}: {what}: {why}", hint)
    try:
        found = resolve_checkpoint(root, step)
    except CheckpointError as exc:
        raise CheckpointError(exc.message, [*exc.details, *hint]) from None
    where = f" (step {found.step})" if 0 <= found.step < LAST else ""
    return Picked("checkpoint", root, how, step, f"{found.model_dir}{where}")


def _local(where: str, what: str) -> None:
    """Refuse an object-storage run (the options refuse theirs as they are parsed)."""
    if names_object_storage(where):
        raise CheckpointError(
            f"{where} ({what}): the model is loaded from local files; merge it from the store "
            "first (shardforge merge-sharded-fsdp-weights CFG --output_path DIR), then pass "
            "--model_dir DIR"
        )


def merged_from_run(cfg: ShardforgeConfig) -> bool:
    """Whether `base_model` is a local model merged from a checkpoint under this run's
    output_dir (its manifest's source says so): the run's result, named by the config."""
    base = Path(cfg.base_model)
    if names_object_storage(cfg.output_dir) or not (base / MANIFEST).is_file():
        return False
    try:  # read as untrusted JSON: its size capped, its nesting bounded
        sources = read_json(base / MANIFEST).get("source") or []
        out = Path(cfg.output_dir).resolve()
        return any(Path(s["location"]).resolve().is_relative_to(out) for s in sources)
    except (CheckpointError, OSError, ValueError, TypeError, KeyError, AttributeError):
        return False  # not a manifest this reads: the run's own weights, as without one


def _base_model(cfg: ShardforgeConfig, how: str) -> Picked:
    """The config's base_model as the model to load: a local model directory (checked), else
    a hub id that transformers fetches."""
    base = Path(cfg.base_model)
    if base.exists():
        return Picked("base", _model_dir(base, how).path, how, found=str(base))
    require_local_or_hub_id("base_model", cfg.base_model)
    return Picked("base", base, how, found=cfg.base_model)


def pick(cfg: ShardforgeConfig, request: ModelRequest, named_base: bool = False) -> Picked:
    """The weights `request` names, else `base_model` where it names the model (`named_base`:
    the user gave --base_model on the command line), else the run's own (see the module's
    doc)."""
    named = (request.model_dir, request.lora_model_dir, request.checkpoint)  # local (parsed)
    other = (
        request.model_dir is not None or request.checkpoint is not None or request.step is not None
    )
    if named_base and other:  # --lora_model_dir goes with it: the adapter's base
        raise ShardforgeError(
            "--base_model and --model_dir/--checkpoint/--step each name the model; give one of "
            "them (--base_model with --lora_model_dir: that adapter over that base)"
        )
    base_named = cfg.adapter is None and all(p is None for p in named) and request.step is None
    if base_named and named_base:
        return _base_model(cfg, "--base_model")
    if base_named and merged_from_run(cfg):
        return _base_model(cfg, "the config's base_model, merged from this run")
    if all(p is None for p in named):
        _local(cfg.output_dir, "the config's output_dir")
    if request.model_dir is not None:
        return _model_dir(request.model_dir, "--model_dir")
    if request.lora_model_dir is not None:
        return _adapter(request.lora_model_dir, "--lora_model_dir")
    if request.checkpoint is not None or request.step is not None:
        root = request.checkpoint or Path(cfg.output_dir)
        return _checkpoint(root, request.step, "--checkpoint" if request.checkpoint else "--step")
    out = Path(cfg.output_dir)
    if cfg.adapter is not None:
        if cfg.lora_model_dir:
            return _adapter(Path(cfg.lora_model_dir), "the config's lora_model_dir")
        if (out / ADAPTER_CONFIG).is_file():
            return _adapter(out, "the adapter in output_dir")
    elif any((out / name).is_file() for name in FULL_WEIGHTS):
        return _model_dir(out, "the full-model save in output_dir")
    return _checkpoint(out, None, "the run's latest", named=False)


def _model_kwargs(cfg: ShardforgeConfig) -> dict[str, Any]:
    """from_pretrained's keywords: training's compute dtype (float32 unless the config
    trains in bf16/fp16), its attention, remote code only where the config allows it."""
    param_dtype, _ = compute_dtypes(cfg)
    out: dict[str, Any] = {
        "dtype": param_dtype or torch.float32,
        "trust_remote_code": cfg.trust_remote_code,
        "use_safetensors": True,
    }
    # varlen_attention (training's packed batches) has no KV cache: sdpa generates
    if cfg.attn_implementation not in (None, "varlen_attention"):
        out["attn_implementation"] = cfg.attn_implementation
    return out


def _from_pretrained(cfg: ShardforgeConfig, source: str | Path, key: str | None = None) -> Any:
    """The model at `source` (`key`: the config key naming it, for the error)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source, **_model_kwargs(cfg))
    except (OSError, ValueError, SafetensorError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        where = f"{key} {source}" if key else str(source)
        raise ShardforgeError(f"{where}: cannot load the model ({first})") from None


def tokenizer_of(cfg: ShardforgeConfig, directory: Path) -> Any:
    """The tokenizer saved with the weights (else training's, from the config), with the
    config's chat template when it names one."""
    if not has_tokenizer(directory):
        return load_tokenizer(cfg)  # training's: the chat template and added tokens applied
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, trust_remote_code=cfg.trust_remote_code)
    if cfg.chat_template is not None:
        own = tok.chat_template if isinstance(tok.chat_template, str) else None
        tok.chat_template = resolve_chat_template(cfg.chat_template, cfg.chat_template_jinja, own)
    return tok


def _load(cfg: ShardforgeConfig, picked: Picked) -> tuple[Any, Any]:
    if picked.kind == "adapter":
        from peft import PeftModel

        require_local_or_hub_id("base_model", cfg.base_model)
        base = _from_pretrained(cfg, cfg.base_model, "base_model")
        model = PeftModel.from_pretrained(base, str(picked.path), is_trainable=False)
        return model, tokenizer_of(cfg, picked.path)
    if picked.kind == "model":
        return _from_pretrained(cfg, picked.path), tokenizer_of(cfg, picked.path)
    if picked.kind == "base":
        model = _from_pretrained(cfg, cfg.base_model, "base_model")
        local = picked.path.is_dir()
        return model, tokenizer_of(cfg, picked.path) if local else load_tokenizer(cfg)
    with merged_checkpoint(cfg, picked) as merged:
        # read into memory here: the directory goes when this block ends
        return _from_pretrained(cfg, merged), tokenizer_of(cfg, merged)


@contextlib.contextmanager
def merged_checkpoint(cfg: ShardforgeConfig, picked: Picked) -> Iterator[Path]:
    """The picked checkpoint merged (the adapter of a LoRA run fused) into a temporary
    directory, removed when the block ends (SIGTERM too ends in the cleanup)."""
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="shardforge-merged-") as tmp:
        merged = Path(tmp) / "model"  # a local output: the path it returns
        merge_fsdp_weights(
            cfg,
            merged,
            checkpoint=picked.path,
            step=picked.step,
            merge_lora=cfg.adapter is not None,
            dtype="as_saved",  # the weights as trained; the model is cast as training casts
            quiet=True,
        )
        yield merged


def load_model(cfg: ShardforgeConfig, picked: Picked) -> Loaded:
    """The picked weights as a model in eval mode on the GPU (if any), and its tokenizer."""
    log.info("model: %s", picked.describe())
    model, tokenizer = _load(cfg, picked)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    model.eval()
    return Loaded(model, tokenizer, device)
