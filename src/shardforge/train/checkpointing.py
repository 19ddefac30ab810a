"""Resumable sharded checkpoints under output_dir (the layout the merge reads; see docs/train.md).

    output_dir/checkpoint-<step>/
      model/                DCP of get_model_state_dict(model): plain HF keys
      optimizer/            DCP of get_optimizer_state_dict(model, optimizer) (low-bit: optim_lowbit;
                            not with save_only_model: trainer_state.json's `optimizer` is false)
      trainer_state.json    step, world size, versions, scheduler, data position
      rng_state_<rank>.pt   tensors and ints only (torch.load(weights_only=True))

A checkpoint is written into `checkpoint-<step>.tmp` and renamed once every rank has finished,
so a crash mid-save leaves the previous complete checkpoint as the latest one. In object storage
(`output_dir: s3://...`, `train.remote_run`) there is no rename: the shards are written by DCP's
fsspec writer into `checkpoint-<step>/` and trainer_state.json, which the layouts catalog needs
to list a checkpoint, is written last. With
`async_save` the shards are written by background threads (`start_async_save`) and the rename
happens once they are done (`complete_async_save`). Before resuming,
a checkpoint is checked as the merge checks one (`checkpoint_problem`); `auto` falls back past a
damaged one to the previous complete checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist

from shardforge.errors import CheckpointError
from shardforge.io.fs import fsync_dir
from shardforge.io.mirror import mirrored, staging
from shardforge.io.remote import is_remote
from shardforge.layouts.catalog import scan
from shardforge.layouts.layout import Candidate, layout_named
from shardforge.layouts.trainer_state import FORMAT, FORMAT_VERSION, STATE_FILE, read_state
from shardforge.train.optim_state import load_optimizer, optimizer_state
from shardforge.train.remote_run import RemoteOutput

log = logging.getLogger("shardforge")

LAYOUT = "shardforge"  # our row of the layouts table
MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
RNG_FILE = "rng_state_{rank}.pt"


@dataclass
class TrainerState:
    """trainer_state.json of one checkpoint."""

    step: int
    world_size: int
    consumed: int
    global_batch_size: int
    total_steps: int
    seed: int
    scheduler: dict[str, Any] = field(default_factory=dict)
    mesh_shape: list[int] = field(default_factory=list)  # [world] or [replicate, shard] (HSDP)
    # the base model's stored dtype, recorded when the run started: a merge's default output
    # dtype (`sinks.cast.choose_target`); None when the base config names none
    base_dtype: str | None = None
    # false: written with save_only_model, no optimizer/ folder (a resume starts it afresh)
    optimizer: bool = True
    # streamed data: the block of the stream the data position lies in (`train.streaming`)
    stream: dict[str, int] | None = None
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    torch_version: str = ""
    transformers_version: str = ""
    shardforge_version: str = ""

    @classmethod
    def read(cls, path: Path) -> TrainerState:
        data = read_state(path)  # its size capped; one line when it is not one
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def versions() -> dict[str, Any]:
    import transformers

    from shardforge.version import __version__

    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "shardforge_version": __version__,
    }


def stamped(state: TrainerState) -> TrainerState:
    """`state` with the torch, transformers and shardforge versions filled in."""
    return replace(state, **versions())


# what this module writes is what the layouts table's row reads
assert layout_named(LAYOUT).marker == STATE_FILE and MODEL_DIR in layout_named(LAYOUT).model_dirs


def is_complete(path: Path) -> bool:
    """`path` is a checkpoint-<step> folder the layouts table's `shardforge` row accepts (the
    one table the merge and `inspect` read too): trainer_state.json and model/.metadata."""
    return path.is_dir() and any(c.model_dir.parent == path for c in _ours(path.parent))


def _ours(output_dir: Path) -> list[Candidate]:
    if not output_dir.is_dir():
        return []
    return [c for c in scan(output_dir).candidates if c.layout == LAYOUT]


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints under output_dir, oldest first (by step), as the layouts table's
    `shardforge` row finds them."""
    return [c.model_dir.parent for c in sorted(_ours(output_dir), key=lambda c: c.step)]


def _load_rng_file(file: Path) -> dict[str, Any]:
    """A rank's RNG states (tensors and ints: `torch.load(weights_only=True)`)."""
    try:
        state = torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; the checkpoint is incomplete") from None
    except Exception as exc:
        raise CheckpointError(
            f"{file}: unreadable ({type(exc).__name__}); the checkpoint is damaged"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("torch"), torch.Tensor):
        raise CheckpointError(f"{file}: not a shardforge RNG state file")
    return state


def checkpoint_problem(path: Path) -> str | None:
    """What makes `path` unusable for resuming (one line), or None.

    The merge's checks (`read_metadata`: storage paths stay inside, every tensor's chunks tile
    it, every data file exists and is long enough; `check_records`: every record's zip
    structure and tensor view) for the model and the optimizer DCP directories, the trainer
    state, and every saving rank's RNG file. Tensor bytes and their CRC-32s are checked as
    `load_checked` reads them.
    """
    from shardforge.formats.dcp.chunks import check_records
    from shardforge.formats.dcp.metadata import read_metadata

    if not is_complete(path):
        return f"not a complete checkpoint-<step> directory (needs {STATE_FILE} and {MODEL_DIR}/.metadata)"
    try:
        state = TrainerState.read(path)
        for sub in (MODEL_DIR, OPTIMIZER_DIR) if state.optimizer else (MODEL_DIR,):
            check_records(read_metadata(path / sub).tensors.values())
        for rank in range(state.world_size):
            _load_rng_file(path / RNG_FILE.format(rank=rank))
    except CheckpointError as exc:
        return exc.message
    return None


def resolve_resume(
    resume: str | None,
    output_dir: Path,
    announce: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Path | None:
    """The checkpoint to resume from: None, `auto` or a path (an s3:// one is read through its
    mirror in the active staging area, with `storage_options`).

    `auto`: the latest complete checkpoint that passes `checkpoint_problem`; each damaged
    newer one is skipped with a one-line notice (when `announce`: on one rank only). None when
    there is no checkpoint; CheckpointError when every one is damaged. A named path that does
    not pass is one CheckpointError.
    """
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        for path in reversed(found):
            problem = checkpoint_problem(path)
            if problem is None:
                return path
            if announce:
                log.warning(
                    "resume_from_checkpoint: auto: skipping %s, which is damaged: %s",
                    path.name,
                    problem,
                )
        if found:
            raise CheckpointError(
                f"resume_from_checkpoint: auto: every checkpoint in {output_dir} is damaged "
                "(see above); name one explicitly or remove them to start fresh"
            )
        return None
    path = mirrored(resume, storage_options) if is_remote(resume) else Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"resume_from_checkpoint: {path} is not a directory")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointError(f"resume_from_checkpoint: {path} cannot be resumed: {problem}")
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(path: Path, rank: int, same_world: bool, seed: int, step: int) -> None:
    """Restore this rank's RNG states; at another world size re-seed deterministically instead."""
    file = path / RNG_FILE.format(rank=rank)
    if not same_world or not file.is_file():
        torch.manual_seed(seed + 1_000 * step + rank)
        random.seed(seed + 1_000 * step + rank)
        return
    state = _load_rng_file(file)
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _start_folder(output_dir: Path, step: int) -> tuple[Path, Path]:
    """Every rank: (`checkpoint-<step>.tmp`, `checkpoint-<step>`) once rank 0 has made the
    first one fresh and empty (a `.tmp` left by an interrupted save of that step is removed)."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"checkpoint-{step}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    return tmp, final


def save_checkpoint(
    output_dir: Path | RemoteOutput,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    save_total_limit: int | None,
    adapter_only: bool = False,
) -> PurePath:
    """Write checkpoint-<step> on every rank; complete (renamed) only once all ranks are done.

    `adapter_only` (LoRA): the model folder holds the trainable parameters only (the adapter
    and `lora_modules_to_save`), not the frozen base weights the run starts from."""
    import torch.distributed.checkpoint as dcp

    if isinstance(output_dir, RemoteOutput):
        return _save_remote(output_dir, state, model, optimizer, save_total_limit, adapter_only)
    rank = dist.get_rank()
    tmp, final = _start_folder(output_dir, state.step)
    dcp.save(_model_state(model, adapter_only), checkpoint_id=str(tmp / MODEL_DIR))
    if state.optimizer:  # save_only_model: none
        dcp.save(optimizer_state(model, optimizer), checkpoint_id=str(tmp / OPTIMIZER_DIR))
    torch.save(rng_state(), tmp / RNG_FILE.format(rank=rank))
    dist.barrier()
    if rank == 0:
        _publish(output_dir, tmp, final, state)
        prune(output_dir, save_total_limit)
        log.info("saved %s", final)
    dist.barrier()
    return final


def _save_remote(
    remote: RemoteOutput,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    save_total_limit: int | None,
    adapter_only: bool,
) -> PurePath:
    """`save_checkpoint` into a store: rank 0 removes what an earlier save of this step left
    (its marker first), every rank writes its shards (DCP's fsspec writer) and RNG file, then
    rank 0 writes trainer_state.json, the marker that makes the checkpoint complete."""
    import io

    import torch.distributed.checkpoint as dcp

    rank, name = dist.get_rank(), f"checkpoint-{state.step}"
    if rank == 0:
        remote.remove(name, first=STATE_FILE)
    dist.barrier()
    dcp.save(_model_state(model, adapter_only), storage_writer=remote.writer(f"{name}/{MODEL_DIR}"))
    if state.optimizer:  # save_only_model: none
        dcp.save(
            optimizer_state(model, optimizer),
            storage_writer=remote.writer(f"{name}/{OPTIMIZER_DIR}"),
        )
    rng = io.BytesIO()
    torch.save(rng_state(), rng)
    remote.put(f"{name}/{RNG_FILE.format(rank=rank)}", rng.getvalue())
    dist.barrier()
    if rank == 0:
        remote.put(f"{name}/{STATE_FILE}", (json.dumps(asdict(state), indent=2) + "\n").encode())
        prune(remote, save_total_limit)
        log.info("saved %s", remote.url(name))
    dist.barrier()
    return PurePath(name)


def _publish(output_dir: Path, tmp: Path, final: Path, state: TrainerState) -> None:
    """Rank 0, once every rank's files are in `tmp`: write trainer_state.json, fsync, and
    rename `tmp` to `final` (replacing an older checkpoint of the same step)."""
    _write_json(tmp / STATE_FILE, asdict(state))
    fsync_dir(tmp)
    if final.exists():
        stale = output_dir / f"checkpoint-{state.step}.old"
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        shutil.rmtree(stale)
    tmp.rename(final)
    fsync_dir(output_dir)


# -- async saves (async_save: true) ---------------------------------------------------------------


@dataclass
class PendingSave:
    """A checkpoint whose files are being written in the background (`start_async_save`)."""

    state: TrainerState
    tmp: Path
    final: Path
    futures: list[Any]  # concurrent.futures.Future of dcp.async_save: model/, optimizer/
    started: float
    completed: bool = False  # rank 0 published it

    def done(self) -> bool:
        """Every background write of this rank has finished (successfully or not)."""
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        """Block until this rank's background writes are finished; a failed write raises."""
        for future in self.futures:
            try:
                future.result()
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise CheckpointError(
                    f"saving {self.final.name} in the background failed ({first}); the "
                    "previous complete checkpoint is intact"
                ) from exc


def save_groups() -> tuple[Any, Any]:
    """Two gloo process groups over all ranks (every rank calls this, in the same order) for
    the background writes of model/ and optimizer/: each `dcp.async_save` runs its collectives
    in a thread of its own, so each needs a group of its own, apart from the training's
    collectives on the default group (gloo also where training uses NCCL: async_save needs a
    CPU backend)."""
    return dist.new_group(backend="gloo"), dist.new_group(backend="gloo")


def start_async_save(
    output_dir: Path,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: tuple[Any, Any],
    adapter_only: bool = False,
) -> PendingSave:
    """Begin writing checkpoint-<step>.tmp on every rank and return while it is written.

    The same files as `save_checkpoint`: each rank's RNG file is written first, then the model
    and optimizer shards are copied to CPU memory (`dcp.async_save` stages them before it
    returns, so the next optimizer steps cannot change what is saved) and written by two
    background threads. `complete_async_save` makes the checkpoint complete; nothing here
    touches any earlier checkpoint, so a crash before then leaves only the `.tmp` folder.
    """
    import time

    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    tmp, final = _start_folder(output_dir, state.step)
    started = time.perf_counter()
    # before this rank joins the writes' collectives: rank 0 sees the writes finish (their
    # last collective) only after every rank's RNG file exists
    torch.save(rng_state(), tmp / RNG_FILE.format(rank=rank))
    futures = [
        dcp.async_save(
            _model_state(model, adapter_only),
            checkpoint_id=str(tmp / MODEL_DIR),
            process_group=groups[0],
        )
    ]
    if state.optimizer:  # save_only_model: none
        futures.append(
            dcp.async_save(
                optimizer_state(model, optimizer),
                checkpoint_id=str(tmp / OPTIMIZER_DIR),
                process_group=groups[1],
            )
        )
    return PendingSave(state, tmp, final, futures, started)


def complete_async_save(output_dir: Path, pending: PendingSave) -> Path | None:
    """Wait for this rank's background writes; rank 0 then publishes the checkpoint (once).

    Rank 0's writes finish with a collective every rank takes part in after writing its
    shards (DCP's coordinator writes `.metadata` last), so when they are done every rank's
    files are: rank 0 can rename on its own, without waiting for the other ranks. Returns the
    checkpoint rank 0 just published, else None. Pruning is the caller's (`prune`)."""
    import time

    pending.wait()
    if dist.get_rank() != 0 or pending.completed:
        return None
    _publish(output_dir, pending.tmp, pending.final, pending.state)
    pending.completed = True
    log.info(
        "saved %s (written in the background in %.1f s)",
        pending.final,
        time.perf_counter() - pending.started,
    )
    return pending.final


def prune(
    output_dir: Path | RemoteOutput, limit: int | None, keep: frozenset[Path] = frozenset()
) -> list[PurePath]:
    """Delete the oldest complete checkpoints beyond `limit`; return what was deleted.

    A checkpoint in `keep` (one being merged: merge_on_save) is left for a later call. In a
    store each goes marker first (a half-deleted checkpoint is an incomplete one)."""
    if limit is None:
        return []
    if isinstance(output_dir, RemoteOutput):
        with staging():
            found = complete_checkpoints(mirrored(str(output_dir), output_dir.storage_options))
        doomed = [PurePath(p.name) for p in found[: max(0, len(found) - limit)]]
        for name in doomed:
            output_dir.remove(name.name, first=STATE_FILE)
        return doomed
    found = complete_checkpoints(output_dir)
    busy = {p.name for p in keep}
    doomed_here = [p for p in found[: max(0, len(found) - limit)] if p.name not in busy]
    for path in doomed_here:
        shutil.rmtree(path)
    return list(doomed_here)


def _model_options(adapter_only: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=adapter_only, strict=not adapter_only)


def _model_state(model: torch.nn.Module, adapter_only: bool) -> dict[str, Any]:
    """The model's sharded state dict; with `adapter_only` its trainable parameters only (torch
    keeps a frozen parameter that is tied to another name, e.g. a tied output layer)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_model_options(adapter_only))
    if not adapter_only:
        return state
    trainable = {
        name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
    }
    return {k: v for k, v in state.items() if k in trainable}


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    adapter_only: bool = False,
) -> TrainerState:
    """Load model and optimizer shards (resharding to this world size) and the trainer state.

    Every byte goes through the merge's checks (`shardforge.formats.dcp.reader`
    `CheckedFileSystemReader`): `.metadata` and non-tensor entries through the allow-list
    unpickler, each record's bounds, view and CRC-32 checked before torch sees a tensor.
    """

    state = TrainerState.read(path)
    load_model_weights(path, model, adapter_only)
    if not state.optimizer:
        if dist.get_rank() == 0:
            log.warning(
                "warning: %s was saved with save_only_model and holds no optimizer state: the "
                "optimizer starts afresh (its moments at zero); the model, the lr schedule "
                "and the data position resume",
                path.name,
            )
        return state
    load_optimizer(model, optimizer, path / OPTIMIZER_DIR, state.world_size, state.mesh_shape)
    return state


def load_model_weights(path: Path, model: torch.nn.Module, adapter_only: bool = False) -> None:
    """Load checkpoint `path`'s model shards into `model` (every rank), checked as
    `load_checkpoint` checks them."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from shardforge.formats.dcp.reader import load_checked

    model_sd = _model_state(model, adapter_only)
    load_checked(model_sd, path / MODEL_DIR)
    set_model_state_dict(model, model_sd, options=_model_options(adapter_only))
