"""The merge on one process, as its pipeline: locate -> (head start) -> prepare (open, map
keys, check against the meta-device model, plan) -> write through the sink -> verify ->
publish -> remove the shards when asked."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from pathlib import Path

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError
from shardforge.io.lock import lock_beside, output_lock
from shardforge.io.mirror import public_name, remote_target
from shardforge.io.publish import (
    check_free_space,
    check_output_file,
    check_output_path,
    output_error,
    sigterm_as_interrupt,
)
from shardforge.layouts.catalog import resolve_checkpoint
from shardforge.merge.dtypes import dtype_choice_name
from shardforge.merge.locate import Located, checkpoint_root, locate
from shardforge.merge.overlap import EarlyCopy, early_copy, eligible
from shardforge.merge.plan_report import describe_plan
from shardforge.merge.prepare import Prepared, deliverable, prepare
from shardforge.merge.remove import RemovalPlan, plan_removal, remove_shards
from shardforge.merge.request import MergeRequest
from shardforge.sinks.base import WriteOptions
from shardforge.sinks.hf_dir import HfDirectorySink
from shardforge.sinks.resume import pinned_inputs

log = logging.getLogger("shardforge")

# suffix of the default output path of --format torch (as Lightning's consolidate_checkpoint)
CONSOLIDATED_SUFFIX = ".consolidated"
# the writer a merge's lock file names
MERGE_COMMAND = "shardforge merge-sharded-fsdp-weights"


def default_output(model_dir: Path) -> Path:
    """--format torch without --output_path: beside the model folder (the request makes sure
    the other formats name one)."""
    return Path(str(model_dir) + CONSOLIDATED_SUFFIX).absolute()


def writer_lock(
    out: Path, request: MergeRequest, command: str = MERGE_COMMAND
) -> contextlib.AbstractContextManager[object]:
    """One merge at a time writes `out`: its lock file beside it, held while the merge runs (a
    dry run writes nothing; an s3:// output has no lock: docs/storage.md)."""
    if request.dry_run or remote_target(out) is not None:
        return contextlib.nullcontext()
    lock = lock_beside(out.absolute())
    unusable = functools.partial(output_error, out=out)  # as any write under out's folder
    return output_lock(lock, out, command, request.take_over_lock, "--take_over_lock", unusable)


def run_merge(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """`merge_fsdp_weights` of a checked request."""
    with contextlib.ExitStack() as held:
        out = request.output_path
        if out is not None:  # the output's lock first: nothing is written before it
            held.enter_context(writer_lock(out, request))
        return _run_locked(config, request, held)


def _run_locked(
    config: ShardforgeConfig, request: MergeRequest, held: contextlib.ExitStack
) -> Path:
    out = request.output_path
    if out is not None:
        _check_output(out, request, [])  # fail fast, before reading anything
    removal = None
    if request.remove_checkpoint_dir:  # refused here, before the merge reads or writes
        root = checkpoint_root(config, request)
        found = resolve_checkpoint(root, request.step, request.state_dict_dirname)
        removal = plan_removal(found, root)
    located = locate(config, request)
    # the bytes start moving while transformers imports and the architecture is built; the
    # early copy is used only if it is exactly what the merge would write, else removed
    with sigterm_as_interrupt(), _early_copy(config, request, located) as early:
        return _run_prepared(config, request, located, removal, early, held)


def _check_output(out: Path, request: MergeRequest, inputs: list[Path]) -> None:
    """The output path's checks: a file (`--format safetensors/torch`) or a directory, which
    `--overwrite` replaces only while it holds a model (`io.model_files`)."""
    if request.single_file:
        check_output_file(out, request.overwrite, inputs)
    else:
        check_output_path(out, request.overwrite, inputs, request.overwrite_non_model)


def _early_copy(
    config: ShardforgeConfig,
    request: MergeRequest,
    located: Located,
) -> contextlib.AbstractContextManager[EarlyCopy | None]:
    inputs, sources = located
    out = request.output_path
    if out is None or not eligible(request, inputs) or remote_target(out) is not None:
        return contextlib.nullcontext(None)
    return early_copy(
        inputs[0],
        sources.config,
        out,
        request.overwrite,
        dtype_choice_name(request.dtype),
        request.max_shard_size,
        request.keep_dtype,
        request.manifest_hash,
    )


def _checked(
    config: ShardforgeConfig, request: MergeRequest, prep: Prepared, removal: RemovalPlan | None
) -> Path:
    """The output path, once every check that needs the prepared merge has passed."""
    out = request.output_path or default_output(prep.sources.checkpoint.model_dir)
    _check_output(out, request, [c.model_dir for c in prep.sources.inputs])
    if request.engine != "stream" and not prep.plain_dcp:
        raise MergeError("--engine transformers reads plain DCP checkpoints only")
    if removal is not None and removal.model_dir != prep.sources.checkpoint.model_dir.absolute():
        raise MergeError(
            f"{removal.model_dir}: the checkpoint changed while the merge started (now "
            f"{prep.sources.checkpoint.model_dir}); run it again"
        )
    return out


def _run_prepared(
    config: ShardforgeConfig,
    request: MergeRequest,
    located: Located,
    removal: RemovalPlan | None,
    early: EarlyCopy | None,
    held: contextlib.ExitStack,
) -> Path:
    """prepare -> check -> (dry run: describe) -> write (sink) -> verify -> publish -> remove."""
    prep = prepare(config, request, located)
    if request.output_path is None:  # --format torch beside the model folder: known now
        held.enter_context(writer_lock(default_output(prep.sources.checkpoint.model_dir), request))
    out = _checked(config, request, prep, removal)
    output, sink = deliverable(prep, request, config)
    if request.dry_run:
        plan = describe_plan(prep.sources, sink, output, out, removal, prep.casts, prep.dtype_line)
        sys.stdout.write(public_name(plan) + "\n")  # s3:// inputs as their URIs
        return out
    used = early is not None and isinstance(sink, HfDirectorySink)
    used = used and early is not None and early.accept(prep.plan, prep.by_name)
    if not used and remote_target(out) is None:  # (an early copy has its space already)
        check_free_space(out, prep.plan.total_bytes)
    options = WriteOptions(
        request.overwrite,
        request.verifies,
        request.quiet,
        request.resume,
        request.overwrite_non_model,
        request.manifest_hash,
    )
    # every input pinned as planned (the head start's files as it first opened them), checked
    # at every read and before publishing (`io.pins`); after `accept`: no parse runs beside it
    pinned_inputs(output.sources.values())
    if used:
        assert early is not None and isinstance(sink, HfDirectorySink)
        sink.write(output, out, options, prefill=early.take)
    else:
        sink.write(output, out, options)
    log.info("wrote %s (%.1f MB)", out, prep.plan.total_bytes / 1e6)
    if removal is not None:  # the output is verified and published
        removed = remove_shards(removal)
        log.info("removed %d shard files of %s", len(removed.files), removal.model_dir)
    return out
