"""Locate: the checkpoint(s) a merge reads and where its config and tokenizer come from.

Torch-free (finding files and reading folder names only), so that the merge's head start
(`merge.overlap`) can run it before torch is imported.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import CheckpointError, MergeError
from shardforge.io.mirror import staging
from shardforge.io.readahead import prefetch
from shardforge.io.remote import is_remote
from shardforge.layouts.catalog import LAST, Candidate, list_checkpoints, resolve_checkpoint
from shardforge.layouts.trainer_state import read_state
from shardforge.merge.options import one_error
from shardforge.merge.request import MergeRequest
from shardforge.sinks.companions import has_tokenizer

log = logging.getLogger("shardforge")


@dataclass(frozen=True)
class MergeSources:
    """Where the merge reads each part from (`inputs`: several when averaging)."""

    checkpoint: Candidate
    config: str
    tokenizer: str
    generation: list[str]
    inputs: tuple[Candidate, ...] = ()
    recorded_dtype: str | None = None  # the base model's stored dtype, recorded by train


def recorded_dtype(candidate: Candidate) -> str | None:
    """The base model's stored dtype that `shardforge train` recorded in the checkpoint
    (`base_dtype` of the trainer_state.json beside its model folder), None when there is none
    (another trainer's checkpoint, a run of an older shardforge)."""
    try:
        value = read_state(candidate.model_dir.parent).get("base_dtype")
    except (CheckpointError, OSError):
        return None
    return value if isinstance(value, str) else None


# what `locate` finds: the checkpoint(s), oldest first, and the sources of the rest
Located = tuple[list[Candidate], MergeSources]


def merge_sources(cfg: ShardforgeConfig, candidates: list[Candidate]) -> MergeSources:
    """Config and tokenizer: base_model_config / tokenizer_config, else the run's output_dir,
    else the checkpoint's own `huggingface/` folder (verl), else base_model."""
    candidate = candidates[-1]
    out_dir = Path(cfg.output_dir)
    hf_dir = str(candidate.hf_dir) if candidate.hf_dir is not None else None
    if cfg.base_model_config:
        config = cfg.base_model_config
    elif (out_dir / "config.json").is_file():
        config = str(out_dir)
    else:
        config = hf_dir or cfg.base_model
    if cfg.tokenizer_config:
        tokenizer = cfg.tokenizer_config
    elif has_tokenizer(out_dir):
        tokenizer = str(out_dir)
    elif candidate.hf_dir is not None and has_tokenizer(candidate.hf_dir):
        tokenizer = str(candidate.hf_dir)
    else:
        tokenizer = cfg.base_model
    generation = list(dict.fromkeys([config, cfg.base_model]))
    recorded = recorded_dtype(candidate)
    return MergeSources(candidate, config, tokenizer, generation, tuple(candidates), recorded)


def label(c: Candidate) -> str:
    return f"step {c.step}" if 0 <= c.step < LAST else str(c.model_dir)


def pick_inputs(root: str | Path, request: MergeRequest) -> list[Candidate]:
    """The checkpoint to merge, or the checkpoints to average (oldest first)."""
    step, state_dict_dirname = request.step, request.state_dict_dirname
    average_last, average_steps = request.average_last, request.average_steps
    if not request.averaging:
        return [resolve_checkpoint(root, step, state_dict_dirname)]
    found = list_checkpoints(root, state_dict_dirname)
    have = [c.step for c in found]
    if average_last is not None:
        if average_last > len(found):
            raise MergeError(
                f"--average_last {average_last}: {root} has only {len(found)} complete "
                f"checkpoint(s) (steps {have or 'none'})"
            )
        return found[-average_last:]
    by_step = {c.step: c for c in found}
    missing = [s for s in average_steps if s not in by_step]
    if missing:
        raise MergeError(
            f"--average_steps: {root} has no complete checkpoint for step(s) "
            f"{', '.join(map(str, missing))}; steps found: {have or 'none'}"
        )
    return [by_step[s] for s in average_steps]


def checkpoint_root(cfg: ShardforgeConfig, request: MergeRequest) -> str | Path:
    """Where the merge looks for checkpoints: `--checkpoint`, else the run's output_dir."""
    return request.checkpoint if request.checkpoint is not None else cfg.output_dir


def locate(cfg: ShardforgeConfig, request: MergeRequest) -> Located:
    """The checkpoint(s) to read and where config and tokenizer come from (no transformers
    needed yet)."""
    inputs = pick_inputs(checkpoint_root(cfg, request), request)
    for c in inputs:
        where = f" (step {c.step})" if 0 <= c.step < LAST else ""
        log.info("checkpoint: %s [%s layout, %s]%s", c.model_dir, c.layout, c.kind, where)
    # The disk starts reading the data files while transformers imports and the architecture
    # is checked (a hint to the kernel; nothing is held in this process).
    prefetch(sorted(p for c in inputs for p in c.model_dir.iterdir() if p.is_file()))
    return inputs, merge_sources(cfg, inputs)


def remote_problems(request: MergeRequest, remote_input: bool, remote_output: bool) -> list[str]:
    """What a merge from or to object storage does not do (all reported at once)."""
    checks = [
        (
            remote_output and request.output_format != "hf",
            "an s3:// --output_path is a Hugging "
            f"Face directory: drop --format {request.output_format}",
        ),
        (
            remote_output and request.engine != "stream",
            "an s3:// --output_path is written by the stream engine: drop --engine transformers",
        ),
        (
            remote_output and (request.distributed or request.group is not None),
            "a distributed merge writes to a shared file system, not s3://: merge on one rank",
        ),
        (
            remote_output and request.per_step,
            "--all_steps / --steps write local step-N folders: "
            "merge each step to its own s3:// prefix with --step",
        ),
        (
            remote_input and request.remove_checkpoint_dir,
            "--remove_checkpoint_dir does not "
            "delete objects in a store: remove the shards with the store's own tools",
        ),
        (
            remote_input and request.output_path is None,
            "a checkpoint in s3:// has no local folder to write beside: give --output_path",
        ),
    ]
    return [text for bad, text in checks if bad]


@contextlib.contextmanager
def remote_paths(
    cfg: ShardforgeConfig, request: MergeRequest, output_path: str | Path | None
) -> Iterator[tuple[ShardforgeConfig, MergeRequest]]:
    """A merge whose checkpoint (--checkpoint, else output_dir) or --output_path is an s3://
    URI, as a local merge: the checkpoint's prefix mirrored in a staging area (`io.mirror`:
    small files downloaded, data files read by ranged requests), the output a local path that
    the object-store sink publishes to (`sinks.object_store`). Messages name the URIs."""
    root = request.checkpoint if request.checkpoint is not None else cfg.output_dir
    remote_input, remote_output = is_remote(str(root)), is_remote(output_path)
    if not (remote_input or remote_output):
        yield cfg, request
        return
    problems = remote_problems(request, remote_input, remote_output)
    if problems:
        raise one_error(problems, "options an s3:// path does not support")
    options = cfg.storage_options
    with staging() as area:
        changes: dict[str, object] = {}
        if remote_output:
            from shardforge.sinks.object_store import check_target

            changes["output_path"] = out = area.output(str(output_path), options)
            check_target(
                area.targets[out], request.overwrite, request.resume, request.overwrite_non_model
            )
        if remote_input and request.checkpoint is not None:
            changes["checkpoint"] = area.mirror(str(root), options)
        elif remote_input:
            cfg = cfg.model_copy(update={"output_dir": str(area.mirror(str(root), options))})
        yield cfg, replace(request, **changes)  # type: ignore[arg-type]
