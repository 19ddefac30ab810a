"""`merge_fsdp_weights`: a sharded FSDP/DCP checkpoint -> a complete, verified Hugging Face model
directory, streamed with memory bounded by about one tensor.

    from shardforge.config import load_cfg
    from shardforge.merge import merge_fsdp_weights
    merge_fsdp_weights(load_cfg("cfg.yml"), "out/merged", verify=True)
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from shardforge.checkpoint.architecture import ExpectedModel, build_expected, check_against
from shardforge.checkpoint.architecture import load_config as load_model_config
from shardforge.checkpoint.companions import (
    has_tokenizer,
    write_config,
    write_generation_config,
    write_tokenizer,
)
from shardforge.checkpoint.keys import KeyMap, map_keys
from shardforge.checkpoint.layouts import LAST, Candidate, check_model_keys, resolve_checkpoint
from shardforge.checkpoint.metadata import CheckpointMetadata, TensorEntry, read_metadata
from shardforge.checkpoint.output import (
    atomic_directory,
    check_free_space,
    check_output_path,
    sigterm_as_interrupt,
)
from shardforge.checkpoint.plan import OutputPlan, TensorSpec, default_max_shard_size, plan_output
from shardforge.checkpoint.stream import write_plan
from shardforge.checkpoint.verify import verify_output
from shardforge.config import coerce_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError

log = logging.getLogger("shardforge")

Engine = Literal["stream", "transformers"]
ENGINES: tuple[str, ...] = ("stream", "transformers")

# --dtype spellings -> torch dtype (None: keep each tensor's stored dtype)
DTYPES: dict[str, torch.dtype | None] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "as_saved": None,
    "as-saved": None,
}


@dataclass(frozen=True)
class MergeSources:
    """Where the merge reads each part from."""

    checkpoint: Candidate
    config: str
    tokenizer: str
    generation: list[str]


def _sources(cfg: ShardforgeConfig, candidate: Candidate) -> MergeSources:
    out_dir = Path(cfg.output_dir)
    if cfg.base_model_config:
        config = cfg.base_model_config
    elif (out_dir / "config.json").is_file():
        config = str(out_dir)
    else:
        config = cfg.base_model
    if cfg.tokenizer_config:
        tokenizer = cfg.tokenizer_config
    elif has_tokenizer(out_dir):
        tokenizer = str(out_dir)
    else:
        tokenizer = cfg.base_model
    generation = list(dict.fromkeys([config, cfg.base_model]))
    return MergeSources(candidate, config, tokenizer, generation)


def _parse_dtype(value: str | torch.dtype | None) -> torch.dtype | Literal["config"] | None:
    if value is None:
        return "config"
    if isinstance(value, torch.dtype):
        return value
    key = value.strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise MergeError(f"--dtype {value!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[key]


def _config_dtype(config: Any) -> torch.dtype | None:
    raw = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(raw, str):
        raw = DTYPES.get(raw.lower().removeprefix("torch."))
    return raw if isinstance(raw, torch.dtype) and raw.is_floating_point else None


def _output_dtype(saved: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    return target if target is not None and saved.is_floating_point else saved


def _main_dtype(specs: list[TensorSpec]) -> torch.dtype | None:
    sizes: dict[torch.dtype, int] = {}
    for s in specs:
        if s.dtype.is_floating_point:
            sizes[s.dtype] = sizes.get(s.dtype, 0) + s.nbytes
    return max(sizes, key=lambda d: sizes[d]) if sizes else None


@contextmanager
def _progress(total: int, desc: str, quiet: bool) -> Iterator[Callable[[int], None]]:
    from tqdm import tqdm

    disable = quiet or not sys.stderr.isatty()
    with tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=disable
    ) as bar:
        yield bar.update


@dataclass(frozen=True)
class _Prepared:
    sources: MergeSources
    metadata: CheckpointMetadata
    expected: ExpectedModel
    keymap: KeyMap
    by_name: dict[str, TensorEntry]
    plan: OutputPlan
    dtype: torch.dtype | None


def _prepare(
    cfg: ShardforgeConfig,
    checkpoint: str | Path | None,
    step: int | None,
    dtype: str | torch.dtype | None,
    max_shard_size: int | str | None,
) -> _Prepared:
    """Everything decided and checked before a byte is written."""
    candidate = resolve_checkpoint(checkpoint if checkpoint is not None else cfg.output_dir, step)
    where = f" (step {candidate.step})" if 0 <= candidate.step < LAST else ""
    log.info("checkpoint: %s [%s layout]%s", candidate.model_dir, candidate.layout, where)
    meta = read_metadata(candidate.model_dir)
    check_model_keys(candidate.model_dir, list(meta.tensors))
    sources = _sources(cfg, candidate)
    config = load_model_config(sources.config, cfg.trust_remote_code)
    expected = build_expected(config, cfg.trust_remote_code)
    keymap = map_keys({k: e.path for k, e in meta.tensors.items()}, expected.shapes)
    check_against(expected, meta.tensors, keymap.to_hf, list(keymap.unexpected), sources.config)
    if keymap.skipped_optimizer:
        log.info("skipped %d optimizer entries", len(keymap.skipped_optimizer))
    by_name = {hf: meta.tensors[key] for key, hf in keymap.to_hf.items()}
    wanted = _parse_dtype(dtype)
    target = _config_dtype(config) if wanted == "config" else wanted
    assert target != "config"
    specs = [
        TensorSpec(n, _output_dtype(by_name[n].dtype, target), by_name[n].shape)
        for n in expected.saved_names
    ]
    shard = max_shard_size if max_shard_size is not None else default_max_shard_size()
    try:
        plan = plan_output(specs, shard, expected.total_parameters)
    except ValueError as exc:
        if isinstance(exc, MergeError):
            raise
        raise MergeError(f"--max_shard_size {shard!r}: {exc}") from None
    return _Prepared(sources, meta, expected, keymap, by_name, plan, _main_dtype(specs))


def merge_fsdp_weights(
    cfg: Any,
    output_path: str | Path,
    save_tokenizer: bool = True,
    *,
    checkpoint: str | Path | None = None,
    step: int | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    verify: bool = False,
    remove_checkpoint_dir: bool = False,
    overwrite: bool = False,
    engine: Engine = "stream",
    quiet: bool = False,
) -> Path:
    """Merge a sharded FSDP (DCP) checkpoint into a Hugging Face model directory.

    Args:
        cfg: the config (``load_cfg`` result, path, mapping or ``ShardforgeConfig``); its
            ``output_dir`` is searched for the latest complete checkpoint and its
            ``base_model`` / ``base_model_config`` / ``tokenizer_config`` give the architecture,
            config and tokenizer.
        output_path: directory to create (written as a temporary sibling, renamed at the end).
        save_tokenizer: also write the tokenizer (with its chat template).
        checkpoint: a DCP directory or a checkpoint root to use instead of ``cfg.output_dir``.
        step: pick this step instead of the latest.
        dtype: output dtype of floating tensors (``bfloat16``, ``float16``, ``float32`` or
            ``as_saved``); default the config's ``dtype``/``torch_dtype``, else as saved.
        max_shard_size: largest safetensors file (``"5GB"``, bytes); default as save_pretrained.
        verify: re-read the output and compare every tensor with the checkpoint.
        remove_checkpoint_dir: delete the model DCP directory after a passed verification
            (implies ``verify``).
        overwrite: replace an existing non-empty output directory.
        engine: ``stream`` (bounded memory) or ``transformers`` (meta model, ``dcp.load``,
            ``save_pretrained``; holds the whole model in memory).
        quiet: no progress bar.

    Returns:
        The output directory.

    Raises:
        CheckpointError: the checkpoint cannot be found, read or trusted.
        MergeError: mismatch with the architecture, existing output, no disk space, failed
            verification.
    """
    config = coerce_cfg(cfg)
    if engine not in ENGINES:
        raise MergeError(f"--engine {engine!r}: expected one of {', '.join(ENGINES)}")
    verify = verify or remove_checkpoint_dir
    out = Path(output_path).absolute()
    check_output_path(out, overwrite, [])  # fail fast, before reading anything
    prep = _prepare(config, checkpoint, step, dtype, max_shard_size)
    model_dir = prep.sources.checkpoint.model_dir
    check_output_path(out, overwrite, [model_dir])
    check_free_space(out, prep.plan.total_bytes)

    if engine == "stream" and prep.expected.renamed_on_save:
        raise MergeError(
            f"{prep.sources.config}: this architecture is saved under other names than it uses "
            "in memory (transformers weight conversion); merge it with --engine transformers"
        )
    with sigterm_as_interrupt(), atomic_directory(out) as tmp:
        if engine == "stream":
            with _progress(prep.plan.total_bytes, "merging", quiet) as update:
                write_plan(prep.plan, prep.by_name, tmp, update)
        else:
            from shardforge.checkpoint.hf_engine import merge_with_transformers

            shard = max_shard_size if max_shard_size is not None else default_max_shard_size()
            main = prep.dtype or torch.float32
            merge_with_transformers(
                prep.expected.config,
                model_dir,
                prep.keymap.to_hf,
                main,
                tmp,
                shard,
                config.trust_remote_code,
            )
        write_config(prep.expected.config, prep.dtype, tmp)
        if not write_generation_config(prep.sources.generation, tmp):
            (tmp / "generation_config.json").unlink(missing_ok=True)
        if save_tokenizer:
            write_tokenizer(
                prep.sources.tokenizer, tmp, config.trust_remote_code, config.chat_template
            )
        if verify:
            with _progress(prep.plan.total_bytes, "verifying", quiet) as update:
                n = verify_output(prep.plan, prep.by_name, tmp, update)
            log.info("verified %d tensors: identical to the checkpoint", n)
    log.info("wrote %s (%.1f MB)", out, prep.plan.total_bytes / 1e6)
    if remove_checkpoint_dir:
        shutil.rmtree(model_dir)
        log.info("removed the sharded checkpoint %s", model_dir)
    return out
