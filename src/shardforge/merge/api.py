"""`merge_fsdp_weights`: a sharded FSDP/DCP checkpoint -> a complete, verified Hugging Face model
directory, streamed with memory bounded by about one tensor.

    from shardforge.config import load_cfg
    from shardforge.merge.api import merge_fsdp_weights
    merge_fsdp_weights(load_cfg("cfg.yml"), "out/merged", verify=True)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shardforge.config import coerce_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError
from shardforge.io.copy import fact_session
from shardforge.io.files import check_resolvable
from shardforge.io.mirror import public_path
from shardforge.io.pins import pin_session
from shardforge.io.publish import check_output_path
from shardforge.io.remote import is_remote
from shardforge.layouts.catalog import list_checkpoints
from shardforge.merge.locate import checkpoint_root, remote_paths
from shardforge.merge.request import MergeRequest, merge_keywords
from shardforge.merge.run import run_merge

log = logging.getLogger("shardforge")


@merge_keywords  # its keywords, signature and docstring: MergeRequest's fields
def merge_fsdp_weights(
    cfg: Any,
    output_path: str | Path | None = None,
    save_tokenizer: bool = True,
    **options: Any,
) -> Path | str:
    # every option conflict is refused here, before anything is read
    out = Path(output_path) if output_path is not None else None
    request = MergeRequest(output_path=out, save_tokenizer=save_tokenizer, **options)
    if out is not None and not is_remote(str(output_path)):
        check_resolvable(out)  # a symlink loop: one line now, not a traceback after the merge
    config = coerce_cfg(cfg, command="merge")
    # the run is scanned, and each .metadata and record parsed, once (head start included);
    # every input is pinned from the plan to the last byte (`io.pins`); s3:// paths are
    # staged as local ones for the merge (`merge.locate.remote_paths`)
    with (
        fact_session(),
        pin_session(),
        remote_paths(config, request, output_path) as (config, request),
    ):
        return public_path(_dispatch(config, request))  # an s3:// output: its URI


def _dispatch(config: ShardforgeConfig, request: MergeRequest) -> Path:
    on_ranks = _in_process_group(request)
    if request.per_step:
        return _merge_steps(config, request)
    if on_ranks:
        from shardforge.merge.on_ranks import merge_on_ranks

        return merge_on_ranks(config, request)
    if request.distributed:
        from shardforge.merge.launch import launch_merge

        return launch_merge(config, request)
    return run_merge(config, request)


def _merge_steps(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """--all_steps / --steps: each checkpoint of the run to <output_path>/step-N (the
    architecture is built once; every step's output is checked before the first is written)."""
    from dataclasses import replace

    root = checkpoint_root(config, request)
    found = {c.step: c for c in list_checkpoints(root, request.state_dict_dirname)}
    wanted = list(request.steps) or sorted(found)
    missing = [s for s in wanted if s not in found]
    if missing or not wanted:
        raise MergeError(
            f"--steps: {root} has no complete checkpoint for step(s) "
            f"{', '.join(map(str, missing)) or '(none found)'}; steps found: "
            f"{sorted(found) or 'none'}"
        )
    out = request.output_path
    assert out is not None  # the request requires it for --format hf
    requests = [
        replace(request, step=s, all_steps=False, steps=(), output_path=out / f"step-{s}")
        for s in wanted
    ]
    for r in requests:
        assert r.output_path is not None
        check_output_path(r.output_path, r.overwrite, [], r.overwrite_non_model)
    if not request.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    log.info("merging %d steps to %s: %s", len(wanted), out, ", ".join(map(str, wanted)))
    on_ranks = _in_process_group(request)
    for r in requests:
        if on_ranks:
            from shardforge.merge.on_ranks import merge_on_ranks

            merge_on_ranks(config, r)
        elif r.distributed:
            from shardforge.merge.launch import launch_merge

            launch_merge(config, r)
        else:
            run_merge(config, r)
    return out


def _in_process_group(request: MergeRequest) -> bool:
    """Whether the merge runs on the ranks of the caller's process group: only when asked
    (`group=`). A process group alone is no such request: a merge called on the main process
    only (`if is_main_process: merge_fsdp_weights(...)`) merges there, instead of waiting for
    the other ranks until the group's timeout."""
    if request.group is None:
        return False
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise MergeError(
            "group=: no torch.distributed process group is initialised; call "
            "dist.init_process_group first, or leave group out to merge in this process"
        )
    if request.group is not dist.group.WORLD:
        raise MergeError(
            "group=: a merge runs on the default process group (torch.distributed.group.WORLD) "
            "only; leave group out to merge in this process"
        )
    return True
