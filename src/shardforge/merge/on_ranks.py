"""The merge on the ranks of a process group (`--nproc_per_node`, `--nnodes`, or `group=`): every
rank prepares the same plan and writes its share of the bytes (`merge.distributed`; the outputs
made from one value in memory, `keymap.converted.written_together`, on one rank each); rank 0
creates the hidden directory, writes the index, the companions and the integrity manifest (each
weights file hashed by one rank once all have written it), and publishes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError, ShardforgeError
from shardforge.io.copy import ReadCache
from shardforge.io.digest import Digests
from shardforge.io.dist import finish_together
from shardforge.io.pins import pin_session
from shardforge.io.publish import atomic_directory, check_free_space, check_output_path
from shardforge.keymap.converted import written_together
from shardforge.merge.distributed import (
    broadcast,
    create_files,
    gather_status,
    owner,
    raise_failures,
    shares,
    write_shares,
)
from shardforge.merge.prepare import Prepared, deliverable, prepare
from shardforge.merge.request import MergeRequest
from shardforge.merge.run import MERGE_COMMAND, writer_lock
from shardforge.sinks.hf_dir import write_companions
from shardforge.sinks.manifest import hash_files, new_hashes, write_manifest
from shardforge.sinks.progress import progress
from shardforge.sinks.resume import pinned_inputs
from shardforge.sinks.safetensors_files import write_index
from shardforge.sinks.verify import verify_output

log = logging.getLogger("shardforge")


def _rows(t: Any) -> int:
    return t.spec.shape[0] if t.spec.shape else 1


@contextmanager
def _no_directory() -> Iterator[None]:
    yield None


def on_every_rank(step: Callable[[], object]) -> None:
    """Run `step` here, then stop every rank with the first failure any rank had."""
    error: BaseException | None = None
    try:
        step()
    except (ShardforgeError, OSError) as exc:
        error = exc
    raise_failures(gather_status(error))


def _prepared(config: ShardforgeConfig, request: MergeRequest, out: Path) -> Prepared:
    """The same plan on every rank, checked; every rank raises the first failure."""
    rank = dist.get_rank()
    error: BaseException | None = None
    prep: Prepared | None = None
    try:
        if rank == 0:
            check_output_path(out, request.overwrite, [], request.overwrite_non_model)
        prep = prepare(config, request)
        if prep.adapter_config is not None:
            raise MergeError(
                "a distributed merge writes complete models: merge this LoRA checkpoint to its "
                "adapter directory on one rank, or pass --merge_lora"
            )
        if rank == 0:
            inputs = [c.model_dir for c in prep.sources.inputs]
            check_output_path(out, request.overwrite, inputs, request.overwrite_non_model)
            check_free_space(out, prep.plan.total_bytes)
    except (ShardforgeError, OSError) as exc:
        error = exc
    raise_failures(gather_status(error))
    assert prep is not None
    return prep


def _write_share(prep: Prepared, directory: Path, request: MergeRequest) -> None:
    """This rank's bytes, and its share of the verification."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with ReadCache() as reader:  # the outputs made from one value in memory: on one rank
        together = written_together(prep.by_name, reader)
    mine = shares(prep.plan, rank, world, together)
    quiet = request.quiet or rank != 0
    on_every_rank(lambda: create_files(prep.plan, directory) if rank == 0 else None)
    mine_bytes = sum(
        (s.rows[1] - s.rows[0]) * (s.tensor.spec.nbytes // max(1, _rows(s.tensor))) for s in mine
    )
    with progress(mine_bytes, "merging", quiet) as update:
        on_every_rank(lambda: write_shares(mine, prep.by_name, directory, update))
    if request.verifies:
        owners = owner(prep.plan, world, together)
        on_every_rank(
            lambda: verify_output(
                prep.plan,
                prep.by_name,
                directory,
                tied=prep.expected.tied,
                only=lambda name: owners[name] == rank,
            )
        )


def _hashes(prep: Prepared, directory: Path, algo: str) -> Digests | None:
    """The digest of every weights file for the manifest (None: no manifest). Several ranks
    write each file and neither hash is made of parts, so once all have written, each rank
    hashes whole files (every `world`-th; BLAKE3 on every core), read again; every rank gets
    them all."""
    hashes = new_hashes(algo)
    if hashes is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [f.name for f in prep.plan.files][rank::world]
    mine: dict[str, str] = {}
    on_every_rank(lambda: mine.update(hash_files(directory, names, algo)))
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    hashes.update({name: digest for part in parts for name, digest in part.items()})
    return hashes


def merge_on_ranks(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """This rank's part of a distributed merge; every rank returns the output path or raises
    the same MergeError. Rank 0, which publishes, holds the output's lock throughout; every
    rank's inputs are pinned (`io.pins`)."""
    with pin_session():
        return _merge_here(config, request)


def _merge_here(config: ShardforgeConfig, request: MergeRequest) -> Path:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = request.output_path
    assert out is not None  # the request requires it for --format hf
    with contextlib.ExitStack() as held:
        command = f"{MERGE_COMMAND} (rank 0 of {world})"
        on_every_rank(
            lambda: held.enter_context(writer_lock(out, request, command)) if rank == 0 else None
        )
        return _merge_held(config, request, out)


def _merge_held(config: ShardforgeConfig, request: MergeRequest, out: Path) -> Path:
    rank, world = dist.get_rank(), dist.get_world_size()
    prep = _prepared(config, request, out)
    output, _ = deliverable(prep, request, config)
    pinned_inputs(output.sources.values())  # checked at every read and before publishing
    if rank == 0:
        each = f"{prep.plan.total_bytes // world:,}"
        log.info("distributed merge on %d ranks: %s bytes each", world, each)
    published: BaseException | None = None
    try:
        publish = atomic_directory(
            out, request.overwrite, model_only=not request.overwrite_non_model
        )
        with publish if rank == 0 else _no_directory() as tmp:
            directory = Path(broadcast(str(tmp) if rank == 0 else None))
            _write_share(prep, directory, request)
            hashes = _hashes(prep, directory, request.manifest_hash)
            if rank == 0:
                write_index(prep.plan, directory)
                assert output.companions is not None
                write_companions(output.companions, output.dtype, directory)
                write_manifest(directory, hashes, output.sources.values())
    except (ShardforgeError, OSError) as exc:
        published = exc
    statuses = gather_status(published)
    # every rank out of that last collective before any returns: a caller that destroys its
    # group at once (as most do) must not abort a peer still inside it (gloo)
    finish_together()
    raise_failures(statuses)
    if rank == 0:
        log.info("wrote %s (%.1f MB) on %d ranks", out, prep.plan.total_bytes / 1e6, world)
    return out
