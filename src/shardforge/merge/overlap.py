"""Overlap: copy the checkpoint's bytes while the merge is still starting up.

Before a byte can be written, the merge needs the architecture: transformers imported, the
config read, the model built on the meta device. On a small machine that takes seconds, and the
byte copy (which runs at disk speed) waited for it. `EarlyCopy` starts instead from what the
checkpoint alone tells:

1. at once, before torch is imported when the merge runs from the command line (`head_start`;
   every module it uses is torch-free, and a dtype read then is a `DtypeName`), else before
   transformers is imported, it reads the DCP metadata (the same checked reader as the
   merge), guesses the output names (the checkpoint keys without their common
   wrapper prefix), the output dtype (`--dtype`, else the base dtype train recorded in the
   checkpoint, else `dtype`/`torch_dtype` of the local `config.json`, else as stored:
   `sinks.cast.choose_target`) and the shard size (`--max_shard_size`, else the installed
   transformers' default), and plans the output files as the merge's planner does;
2. on a thread, it creates a hidden sibling of the output path (named after this process, so a
   killed merge's is removed by the next one) and copies every tensor that is a file-to-file
   slab without a cast into its planned byte range (`io.direct`: through aligned windows,
   written with O_DIRECT, in the order of the output's bytes);
3. meanwhile the merge prepares as always: architecture, every check, the real plan.

Then `accept` compares: the same files, headers and byte ranges as the real plan (a wrong
guess is stopped at once), and, once the copy is done, for every
copied tensor the same source slabs the real sources give. Only then are the files moved into
the merge's output directory, and the merge writes what is left (casts, other chunk shapes),
fsyncs, writes the index and companions, verifies and publishes as it always does. With the
integrity manifest (`sinks.manifest`) each file's hash reads back what the early copy wrote,
up to the first tensor left to the merge, and goes on once the merge has written it (the
bytes of the output, never of a separate read of the input: `io.digest.FileHash`). Any
difference (a wrong guess) discards the copy and the merge writes everything itself; any error
of the merge (a bad input) discards it too, so a refused merge leaves nothing behind. A guess
never fails a merge: its own errors only mean no early copy.

The head start's thread parses the data files' records while the main thread imports torch:
a dtype read before that import has finished is a `DtypeName`, one read after it torch's own,
so everything here compares dtypes by name (`io.dtypes.dtype_name`).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from shardforge.config.schema import ShardforgeConfig
from shardforge.formats.dcp.chunks import entry_slabs
from shardforge.formats.dcp.metadata import TensorEntry, read_metadata
from shardforge.formats.registry import DCP
from shardforge.io.copy import (
    CopyJob,
    FileSlab,
    ReadCache,
    copy_jobs,
    copy_range,
    fact_session,
    pwrite_all,
)
from shardforge.io.digest import DEFAULT, Digests
from shardforge.io.direct import writes_to
from shardforge.io.dtypes import dtype_name, lookup_dtype
from shardforge.io.fs import preallocate
from shardforge.io.pins import pin_session
from shardforge.io.publish import (
    _fresh_temp_sibling,
    check_free_space,
    check_output_path,
    sigterm_as_interrupt,
)
from shardforge.io.remote import is_remote
from shardforge.keymap.keys import clean_name, is_optimizer_key, looks_like_torchtitan
from shardforge.keymap.lora import has_lora
from shardforge.layouts.catalog import Candidate
from shardforge.merge.dtypes import dtype_choice_name
from shardforge.merge.locate import checkpoint_root, merge_sources, pick_inputs, recorded_dtype
from shardforge.merge.request import OPTION_NAMES, MergeRequest
from shardforge.sinks.cast import (
    CONFIG_DTYPE_KEYS,
    cast_rules,
    choose_target,
    config_dtype_name,
    decide_all,
)
from shardforge.sinks.manifest import new_hashes
from shardforge.sinks.plan import OutputPlan, PlannedFile, TensorSpec, layout_files

if TYPE_CHECKING:
    from shardforge.formats.sources import TensorSource

log = logging.getLogger("shardforge")

Progress = Callable[[int], None]

# Turned off, the merge never copies early (tests compare both ways).
ENABLED = True
# how long `discard` waits for a copy thread whose start was interrupted to begin
START_WAIT_S = 5.0
# config.json larger than this is not read by the guess (transformers reads it later anyway)
CONFIG_JSON_LIMIT = 16 << 20


def default_shard_size_guess() -> str | None:
    """`save_pretrained`'s default max_shard_size, from the installed transformers' version
    alone (importing transformers is what the overlap hides): 50GB from 5.0, else 5GB."""
    try:
        major = int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None
    return "50GB" if major >= 5 else "5GB"


def natural_key(name: str) -> list[tuple[Any, ...]]:
    """The order transformers 5 saves tensors in (dotted parts; numbers numerically)."""
    parts: list[tuple[Any, ...]] = []
    for part in name.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            digits = part[len(text) :]
            parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def guess_plan(specs: list[TensorSpec], max_shard_size: int | str | None) -> OutputPlan:
    """The plan `plan_output` makes for transformers 5 (its index is not needed here)."""
    ordered = {s.name: s for s in sorted(specs, key=lambda s: natural_key(s.name))}
    return OutputPlan(layout_files(ordered, max_shard_size)[0], None)


def _common_prefix(names: list[str]) -> str:
    """The longest run of whole leading segments every name shares (never a whole name)."""
    split = [n.split(".") for n in names]
    depth = 0
    shortest = min(len(p) for p in split)
    while depth < shortest - 1 and len({p[depth] for p in split}) == 1:
        depth += 1
    return "".join(p + "." for p in split[0][:depth])


def _read_config_json(config_source: str) -> dict[str, Any] | None:
    path = Path(config_source) / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > CONFIG_JSON_LIMIT:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Guess:
    """What the early copy assumes about the output (all of it is checked in `accept`)."""

    plan: OutputPlan
    entries: dict[str, TensorEntry]  # guessed output name -> the checkpoint's tensor


DtypeChoice = str | None  # a dtype name, "config" (the config's dtype) or None (as stored)


def _guess(
    candidate: Candidate,
    config_source: str,
    dtype: DtypeChoice,
    max_shard_size: int | str | None,
    keep: Sequence[str] = (),
) -> Guess | None:
    """The output plan from the checkpoint's metadata and config.json alone; None when the
    checkpoint is not a plain one this guess covers (the merge then copies as always)."""
    config = _read_config_json(config_source)
    if config is None:
        return None
    # chosen as the merge chooses it (a wrong guess is caught in `accept`)
    configured = config_dtype_name(SimpleNamespace(**{k: config.get(k) for k in CONFIG_DTYPE_KEYS}))
    dtype = choose_target(dtype, recorded_dtype(candidate), configured)[0]
    target = lookup_dtype(dtype) if dtype is not None else None
    tied = config.get("tie_word_embeddings")
    if not isinstance(tied, bool) or (dtype is not None and target is None):
        return None
    shard = max_shard_size if max_shard_size is not None else default_shard_size_guess()
    if shard is None:
        return None
    tensors = read_metadata(candidate.model_dir).tensors
    if looks_like_torchtitan([".".join(e.path) for e in tensors.values()]) or has_lora(
        list(tensors)
    ):
        return None  # torchtitan's names, a LoRA checkpoint: not guessed
    model = [e for e in tensors.values() if not is_optimizer_key(e.path)]
    cleaned = {clean_name(".".join(e.path)): e for e in model}
    if not cleaned or len(cleaned) != len(model):
        return None
    prefix = _common_prefix(list(cleaned))
    entries = {name[len(prefix) :]: e for name, e in cleaned.items()}
    if tied:
        if "lm_head.weight" not in entries:
            return None  # the prefix cannot be told apart from the model's own names
        del entries["lm_head.weight"]  # stored once, under the embedding
    # the merge's own cast rules; the model class's keep list is not known before transformers
    # is imported (a model that has one makes this guess wrong: `accept` finds it)
    decided = decide_all(((n, e.dtype) for n, e in entries.items()), cast_rules(target, keep))
    specs = [TensorSpec(n, decided[n].dtype, e.shape) for n, e in entries.items()]
    return Guess(guess_plan(specs, shard), entries)


@dataclass(frozen=True)
class CopyTarget:
    """What one early copy is for: a head start is taken over only by the merge of an equal
    target."""

    candidate: Candidate
    config_source: str
    out: Path
    overwrite: bool
    dtype: DtypeChoice
    max_shard_size: int | str | None
    keep: tuple[str, ...] = ()  # --keep_dtype
    manifest_hash: str = DEFAULT  # --manifest_hash


class EarlyCopy:
    """The early copy of one merge: planned at once, copied on a thread; `accept` or
    `discard` it."""

    def __init__(self, target: CopyTarget) -> None:
        self.target = target
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.directory: Path | None = None  # the hidden directory, once created
        self.planned: OutputPlan | None = None  # the guessed plan (None: no early copy)
        self.guess: Guess | None = None  # set once every early byte is copied
        self.copied: dict[str, list[FileSlab]] = {}  # output name -> the slabs copied
        # file name -> its hash so far (None: no manifest; `io.digest`)
        self.hashes: Digests | None = new_hashes(target.manifest_hash)
        self.outcome = "running"
        self.started = False  # `start` was called
        self._began = threading.Event()  # the copy's thread runs
        # The plan is made here, on the merge's thread, before transformers is imported: it
        # takes tens of milliseconds alone, and about a second on a thread that competes with
        # the imports for the GIL (the copy itself runs in the kernel, the GIL released).
        guess = self._plan()
        self._thread: threading.Thread | None = None  # the copy's (none without a plan)
        if guess is not None:
            # in a copy of this context: the merge's pins and facts (`io.pins`, `io.copy`)
            self._thread = threading.Thread(
                target=contextvars.copy_context().run,
                args=(self._run, guess),
                name="shardforge-early",
                daemon=True,
            )

    def start(self) -> None:
        """Start the copy (when there is a plan). Apart from `__init__`, so that whoever holds
        this copy already holds it when the thread runs: an interrupt (SIGTERM) arriving while
        the thread starts still finds it to `discard`."""
        if self._thread is not None:
            self.started = True
            self._thread.start()

    def _gave_up(self, exc: Exception) -> None:
        # a guess never fails the merge; it only copies nothing
        self.outcome = f"gave up: {str(exc).splitlines()[0][:200] if str(exc) else exc!r}"
        log.debug("early copy %s", self.outcome)

    def _plan(self) -> Guess | None:
        t = self.target
        candidate = t.candidate
        if candidate.kind != DCP or candidate.adapter is not None or not t.out.parent.is_dir():
            self.outcome = "not a plain DCP checkpoint (or no output folder yet)"
            return None
        try:
            guess = _guess(candidate, t.config_source, t.dtype, t.max_shard_size, t.keep)
        except Exception as exc:
            self._gave_up(exc)
            return None
        if guess is None:
            self.outcome = "not guessed"
            return None
        self.planned = guess.plan
        return guess

    def _run(self, guess: Guess) -> None:
        self._began.set()
        try:
            self._copy(guess)
        except Exception as exc:
            self._gave_up(exc)

    def _copy(self, guess: Guess) -> None:
        out = self.target.out
        # the merge's own checks, before anything is created beside the output
        check_output_path(out, self.target.overwrite, [self.target.candidate.model_dir])
        check_free_space(out, guess.plan.total_bytes)
        with self._lock:
            if self._stop.is_set():
                return
            self.directory = _fresh_temp_sibling(out)
        copied: dict[str, list[FileSlab]] = {}
        with ReadCache() as reader:
            for pf in guess.plan.files:
                done = self._copy_file(pf, guess.entries, reader)
                if done is None:
                    return  # discarded meanwhile
                copied.update(done)
        self.copied = copied
        self.guess = guess
        self.outcome = "copied"

    def _copy_file(
        self, pf: PlannedFile, entries: Mapping[str, TensorEntry], reader: ReadCache
    ) -> dict[str, list[FileSlab]] | None:
        """Copy what `pf` can take file to file; the slabs copied per tensor, None when the
        copy was discarded before it ended. With a manifest, the file's hash follows the copy,
        reading the written bytes back (`io.digest`); it stops at the first tensor left to the
        merge and goes on once the merge has written it."""
        assert self.directory is not None
        copied: dict[str, list[FileSlab]] = {}
        path = self.directory / pf.name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        h = self.hashes.start(pf.name, path) if self.hashes is not None else None
        try:
            preallocate(fd, pf.size)
            jobs: list[CopyJob] = []
            for planned in pf.tensors:
                entry = entries[planned.spec.name]
                same = dtype_name(entry.dtype) == dtype_name(planned.spec.dtype)
                slabs = entry_slabs(entry, reader) if same else None
                if slabs is None:
                    continue  # left to the merge
                copied[planned.spec.name] = slabs
                jobs.extend(
                    CopyJob(s.path, s.src_offset, fd, planned.offset + s.dst_offset, s.nbytes)
                    for s in slabs
                )
            with writes_to(fd, pf.size, h):
                pwrite_all(fd, memoryview(pf.header), 0)
                if not copy_jobs(jobs, copy_range, stop=self._stop.is_set):
                    return None
        finally:
            os.close(fd)
        return copied

    def accept(self, plan: OutputPlan, sources: Mapping[str, TensorSource]) -> bool:
        """True when the copy wrote exactly what the merge would (then the files are the
        merge's to finish, with `move_into`); else it is discarded. A plan that differs is
        found at once; an equal one waits for the copy to end."""
        reason = _other_layout(plan, self.planned) if self.planned is not None else self.outcome
        if reason is None:
            assert self._thread is not None  # a plan was made, so its copy was started
            self._thread.join()
            reason = self._difference(plan, sources)
        if reason is None:
            log.debug("early copy accepted: %d tensors copied", len(self.copied))
            self.outcome = "accepted"
            return True
        log.debug("early copy discarded: %s", reason)
        self.discard()
        self.outcome = f"discarded: {reason}"
        return False

    def _difference(self, plan: OutputPlan, sources: Mapping[str, TensorSource]) -> str | None:
        """Why the finished copy is not what the merge writes (None: it is)."""
        guess = self.guess
        if guess is None or self.directory is None:
            return self.outcome
        reason = _other_layout(plan, guess.plan)
        if reason is not None:
            return reason
        specs = {t.spec.name: t.spec for _, t in plan.tensors()}
        with ReadCache() as reader:
            for name, slabs in self.copied.items():
                src = sources.get(name)
                if src is None or src.dtype != specs[name].dtype or src.slabs(reader) != slabs:
                    return f"another source for {name}"
        return None

    def take(self, directory: Path) -> tuple[dict[str, list[FileSlab]], Digests | None]:
        """Move the accepted files into the merge's hidden output directory; the slabs they
        hold and their hashes so far (the sink writes the rest:
        `sinks.safetensors_files.finish_plan`)."""
        assert self.guess is not None and self.directory is not None
        for pf in self.guess.plan.files:
            os.rename(self.directory / pf.name, directory / pf.name)
        os.rmdir(self.directory)
        self.directory = None
        return self.copied, self.hashes

    def discard(self) -> None:
        """Stop the copy and remove what it wrote (safe to call at any time, more than once)."""
        with self._lock:
            self._stop.set()  # from here on the thread creates nothing
        if self._thread is not None and self.started:
            # an interrupted `start` may leave the thread starting: wait until it runs (or,
            # if it never began, a bounded while) so that it ends before its directory goes
            self._began.wait(START_WAIT_S)
            if self._began.is_set():
                self._thread.join()
        if self.hashes is not None and self.directory is not None:
            self.hashes.close()  # the files' hashes let them go
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            log.debug("early copy removed (%s)", self.outcome)
            self.directory = None


def _other_layout(real: OutputPlan, early: OutputPlan) -> str | None:
    """How two plans' files differ (None: same names, headers and byte ranges). The header
    holds every tensor's name, dtype, shape and byte range; the early plan's dtypes may be
    `DtypeName`s, so tensors are compared by name and offset beside it."""
    if [f.name for f in real.files] != [f.name for f in early.files]:
        return "other output files"
    for a, b in zip(real.files, early.files, strict=True):
        places = [(t.spec.name, t.offset) for t in a.tensors]
        if a.header != b.header or places != [(t.spec.name, t.offset) for t in b.tensors]:
            return f"another layout of {a.name}"
    return None


def eligible(request: MergeRequest, inputs: Sequence[Candidate]) -> bool:
    """Whether the merge of `request` may copy early: one checkpoint into a Hugging Face
    directory, streamed and written (not a dry run)."""
    return (
        request.output_path is not None
        and request.output_format == "hf"
        and request.engine == "stream"
        and not request.dry_run
        and not request.resume
        and len(inputs) == 1
    )


# the head start waiting for its merge to take it over (`early_copy`); at most one
_HEAD_START: list[EarlyCopy] = []


def _take_head_start(target: CopyTarget) -> EarlyCopy | None:
    """The waiting head start when it was started for the same merge, else None (a head start
    for another merge is discarded)."""
    if not _HEAD_START:
        return None
    early = _HEAD_START.pop()
    if early.target == target:
        return early
    early.discard()
    return None


@contextlib.contextmanager
def early_copy(
    candidate: Candidate,
    config_source: str,
    out: Path,
    overwrite: bool,
    dtype: DtypeChoice,
    max_shard_size: int | str | None,
    keep: Sequence[str] = (),
    manifest_hash: str = DEFAULT,
) -> Iterator[EarlyCopy | None]:
    """An `EarlyCopy` for the block (the head start's, when it was started for this merge), or
    None when turned off; whatever it wrote and was not moved into the output is removed when
    the block ends, however it ends."""
    target = CopyTarget(
        candidate, config_source, out, overwrite, dtype, max_shard_size, tuple(keep), manifest_hash
    )
    early = _take_head_start(target)
    if not ENABLED:
        if early is not None:
            early.discard()
        yield None
        return
    if early is None:
        early = EarlyCopy(target)
    try:
        if not early.started:
            early.start()
        yield early
    finally:
        early.discard()


def _head_start_copy(
    cfg: ShardforgeConfig, output_path: str | Path | None, options: Mapping[str, Any]
) -> EarlyCopy | None:
    """The early copy of the merge `options` ask for, started; None when it would not copy
    early or anything is amiss (the merge itself then finds and reports it)."""
    if is_remote(output_path) or is_remote(options.get("checkpoint")) or is_remote(cfg.output_dir):
        return None  # object storage: the merge stages it first (`merge.locate.remote_paths`)
    try:
        values = {k: v for k, v in options.items() if k in OPTION_NAMES and k != "output_path"}
        out = Path(output_path) if output_path is not None else None
        request = MergeRequest(output_path=out, **values)
        if request.per_step or request.distributed:
            return None
        inputs = pick_inputs(checkpoint_root(cfg, request), request)
        if not eligible(request, inputs) or request.output_path is None:
            return None
        config_source = merge_sources(cfg, inputs).config
        dtype = dtype_choice_name(request.dtype)
    except Exception as exc:
        log.debug("no head start: %s", str(exc).splitlines()[0][:200] if str(exc) else exc)
        return None
    return EarlyCopy(
        CopyTarget(
            inputs[0],
            config_source,
            request.output_path,
            request.overwrite,
            dtype,
            request.max_shard_size,
            tuple(request.keep_dtype),
            request.manifest_hash,
        )
    )


@contextlib.contextmanager
def head_start(
    cfg: ShardforgeConfig, output_path: str | Path | None, options: Mapping[str, Any]
) -> Iterator[None]:
    """The command line's head start, entered before torch is imported: the checkpoint is
    located and the early copy started at once, so bytes move while torch, transformers and
    the architecture load. The merge run inside the block takes it over (`early_copy`, when
    it was started for that same merge); whatever was not taken is removed when the block
    ends, however it ends."""
    early: EarlyCopy | None = None
    # what the head start scans and parses is the merge's too (`io.copy.fact_session`), and
    # the files it opens are pinned as it first opened them (`io.pins`)
    with fact_session(), pin_session(), sigterm_as_interrupt():  # SIGTERM: the copy removed
        try:
            early = _head_start_copy(cfg, output_path, options) if ENABLED else None
            if early is not None:
                _HEAD_START[:] = [early]
                early.start()
            yield
        finally:
            if early is not None:
                if early in _HEAD_START:
                    _HEAD_START.remove(early)
                early.discard()
