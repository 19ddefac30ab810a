"""The merge on one process, as its pipeline: locate -> (head start) -> prepare (open, map
keys, check against the meta-device model, plan) -> write through the sink -> verify ->
publish -> remove the shards when asked."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError
from shardforge.io.mirror import public_name, remote_target
from shardforge.io.publish import (
    check_free_space,
    check_output_file,
    check_output_path,
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

log = logging.getLogger("shardforge")

# suffix of the default output path of --format torch (as Lightning's consolidate_checkpoint)
CONSOLIDATED_SUFFIX = ".consolidated"


def default_output(model_dir: Path) -> Path:
    """--format torch without --output_path: beside the model folder (the request makes sure
    the other formats name one)."""
    return Path(str(model_dir) + CONSOLIDATED_SUFFIX).absolute()


def run_merge(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """`merge_fsdp_weights` of a checked request."""
    check = check_output_file if request.single_file else check_output_path
    out = request.output_path
    if out is not None:
        check(out, request.overwrite, [])  # fail fast, before reading anything
    removal = None
    if request.remove_checkpoint_dir:  # refused here, before the merge reads or writes
        root = checkpoint_root(config, request)
        found = resolve_checkpoint(root, request.step, request.state_dict_dirname)
        removal = plan_removal(found, root)
    located = locate(config, request)
    # the bytes start moving while transformers imports and the architecture is built; the
    # early copy is used only if it is exactly what the merge would write, else removed
    with sigterm_as_interrupt(), _early_copy(config, request, located) as early:
        return _run_prepared(config, request, located, removal, early)


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
    )


def _checked(
    config: ShardforgeConfig, request: MergeRequest, prep: Prepared, removal: RemovalPlan | None
) -> Path:
    """The output path, once every check that needs the prepared merge has passed."""
    check = check_output_file if request.single_file else check_output_path
    out = request.output_path or default_output(prep.sources.checkpoint.model_dir)
    check(out, request.overwrite, [c.model_dir for c in prep.sources.inputs])
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
) -> Path:
    """prepare -> check -> (dry run: describe) -> write (sink) -> verify -> publish -> remove."""
    prep = prepare(config, request, located)
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
    options = WriteOptions(request.overwrite, request.verifies, request.quiet, request.resume)
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
