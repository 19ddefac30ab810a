"""The checkpoints of one run folder, found once per command: `scan(root)` -> `Catalog`.

    catalog = scan("outputs/run")            # every layout row read once
    catalog.resolve(step=None)               # the latest complete checkpoint (or `step`)
    catalog.numbered()                       # the numbered steps, oldest first (averaging, --all_steps)

The merge (head start included), `inspect`, `--all_steps` and training's resume ask the same
catalog; inside a `io.copy.fact_session` (one command) a folder is scanned once. A choice that
the folder does not settle (two checkpoints of the same step in different layouts, several
Lightning `last*` folders) is an error that lists them, never a pick by table order.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePath

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.metadata import METADATA_FILE
from shardforge.formats.registry import DCP
from shardforge.formats.state import is_optimizer_key
from shardforge.io.copy import session_memo
from shardforge.io.model_files import MERGE_MANIFEST
from shardforge.keymap.keys import TORCHTITAN
from shardforge.layouts.layout import (
    CHECKPOINT_DIR,
    LAST,
    LATEST_FILE,
    LAYOUTS,
    MODEL_SUBDIRS,
    OPTIMIZER_DIRS,
    STEP_DIRS,
    TITAN_STEP_DIR,
    Candidate,
    find,
    format_of,
    hf_dir,
    is_lightning_last,
    layout_named,
    lightning_step,
)

log = logging.getLogger("shardforge")

FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def check_dirname(name: str) -> str:
    """A `--state_dict_dirname` value: a relative folder name that stays inside the step."""
    rel = PurePath(name)
    if not name.strip() or rel.is_absolute() or ".." in rel.parts or name.startswith(("/", "\\")):
        raise CheckpointError(
            f"--state_dict_dirname {name!r}: give a folder name inside the checkpoint "
            "(e.g. pytorch_ema_model_fsdp_0); absolute paths and '..' are refused"
        )
    return name


@dataclass(frozen=True)
class Catalog:
    """Every complete checkpoint directly under `root`, by layout (see the module docstring)."""

    root: Path
    dirname: str | None
    candidates: tuple[Candidate, ...]

    def steps(self) -> list[int]:
        return sorted({c.step for c in self.candidates if 0 <= c.step < LAST})

    def numbered(self) -> list[Candidate]:
        """The numbered checkpoints, oldest first, one per step (an ambiguous step: error)."""
        by_step: dict[int, list[Candidate]] = {}
        for c in self.candidates:
            if 0 <= c.step < LAST:
                by_step.setdefault(c.step, []).append(c)
        return [_one(self.root, by_step[s], f"step {s}") for s in sorted(by_step)]

    def pick(self, step: int | None) -> Candidate:
        """The checkpoint of `step`, or the latest."""
        if step is None:
            return self.latest()
        matching = [c for c in self.candidates if c.step == step]
        if not matching:
            raise CheckpointError(
                f"{self.root}: no complete checkpoint for step {step}; steps found: "
                f"{self.steps() or 'none'}"
            )
        return _one(self.root, matching, f"step {step}")

    def latest(self) -> Candidate:
        cands = list(self.candidates)
        if (self.root / LATEST_FILE).is_file() and any(c.layout == "verl" for c in cands):
            return _verl_latest(self.root, cands)
        top = max(c.step for c in cands)
        tied = [c for c in cands if c.step == top]
        if top == LAST and len(tied) > 1:
            tied = _newest_lightning(tied)
        return _one(self.root, tied, "the latest step" if top != LAST else "the latest (last*)")


def _one(root: Path, cands: list[Candidate], what: str) -> Candidate:
    if len(cands) == 1:
        return cands[0]
    listed = [f"- {c.model_dir} ({c.layout})" for c in cands]
    raise CheckpointError(
        f"{root}: {len(cands)} checkpoints are {what}; give one with --checkpoint "
        "(or --state_dict_dirname for the model folder)",
        listed,
    )


def _newest_lightning(tied: list[Candidate]) -> list[Candidate]:
    """Several Lightning `last*` folders: the one whose meta.pt records the highest
    global_step, when that settles it (else all of them: ambiguous)."""
    steps = {c: lightning_step(c.model_dir / "meta.pt") for c in tied}
    best = max(steps.values())
    newest = [c for c, s in steps.items() if s == best]
    return newest if best >= 0 else tied


def _verl_latest(root: Path, cands: list[Candidate]) -> Candidate:
    text = (root / LATEST_FILE).read_text(encoding="utf-8", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{root / LATEST_FILE}: expected a step number, got {text!r}")
    matching = [c for c in cands if c.step == int(text)]
    if not matching:
        raise CheckpointError(
            f"{root / LATEST_FILE}: names step {text}, but {root} has no complete "
            f"global_step_{text} checkpoint; pass --step"
        )
    return _one(root, matching, f"step {text}")


def _scan(root: Path, dirname: str | None) -> Catalog:
    found: dict[Path, Candidate] = {}
    for row in LAYOUTS:
        if not row.direct:
            for c in find(row, root, dirname):
                found.setdefault(c.model_dir, c)
    return Catalog(root, dirname, tuple(found.values()))


def scan(root: str | Path, state_dict_dirname: str | None = None) -> Catalog:
    """Every complete checkpoint of a known layout directly under `root` (the model folder
    inside each step is `state_dict_dirname` when given); once per folder and command."""
    if state_dict_dirname is not None:
        check_dirname(state_dict_dirname)
    r = Path(root)
    key = ("layouts-scan", os.path.abspath(r), state_dict_dirname)
    return session_memo(key, lambda: _scan(r, state_dict_dirname))


def single(r: Path, dirname: str | None) -> Candidate | None:
    """`r` itself (or its model sub-folder) when it is one checkpoint, not a root of steps."""
    direct = [row for row in LAYOUTS if row.direct]
    for sub in (dirname,) if dirname else direct[0].model_dirs:
        d = r if sub == "." else r / sub
        kind = format_of(d)
        row = next((row for row in direct if kind in row.formats), None)
        if row is not None and kind is not None:
            adapter = TORCHTITAN if TITAN_STEP_DIR.match(r.name) and kind == DCP else None
            return Candidate(row.name, -1, d, kind, adapter, hf_dir(d))
    return None


def _unfinished(folder: Path) -> str | None:
    """Why `folder` holds shards but is not a complete checkpoint (None: it does not)."""
    if not folder.is_dir() or format_of(folder) is not None:
        return None
    if any(folder.glob("*.distcp")):
        return "has .distcp files but no .metadata: the save did not finish"
    return None


def find_unfinished(root: Path) -> list[str]:
    """`<folder> <why>` for each folder under `root` (itself, its step folders and their model
    folders) that holds shards of a save that did not finish, newest step first."""
    steps = [d for d in root.iterdir() if d.is_dir() and any(p.match(d.name) for p in STEP_DIRS)]
    steps.sort(key=lambda d: int(re.sub(r"\D", "", d.name) or 0), reverse=True)
    folders = [root]
    for d in steps:
        folders += [d, *(d / sub for sub in MODEL_SUBDIRS)]
    out = []
    for f in folders:
        why = _unfinished(f)
        if why is not None:
            out.append(f"{f.relative_to(root) if f != root else f} {why}")
    return out


def check_not_optimizer(model_dir: Path) -> None:
    """Refuse an optimizer DCP directory, pointing to the model directory beside it."""
    beside = OPTIMIZER_DIRS.get(model_dir.name)
    if beside is not None:
        hints = [str(model_dir.parent / b) for b in beside if (model_dir.parent / b).exists()]
        where = f"; the model weights are in {hints[0]}" if hints else ""
        raise CheckpointError(
            f"{model_dir}: this is an optimizer checkpoint, not model weights{where}"
        )


def check_model_keys(model_dir: Path, keys: list[str]) -> None:
    """Refuse a DCP whose tensors are all optimizer state."""
    if keys and all(is_optimizer_key((k,)) for k in keys):
        siblings = [
            str(p)
            for p in sorted(model_dir.parent.iterdir())
            if p != model_dir and (p / METADATA_FILE).is_file()
        ]
        where = f"; try {siblings[0]}" if siblings else ""
        raise CheckpointError(f"{model_dir}: holds only optimizer state, not model weights{where}")


def _nothing_found(r: Path, dirname: str | None) -> CheckpointError:
    """Why `r` holds no complete checkpoint, as precisely as the folder tells."""
    if dirname is not None:
        return CheckpointError(
            f"{r}: no checkpoint has a {dirname!r} folder holding a DCP "
            "checkpoint or model_world_size_W_rank_R.pt files; check --state_dict_dirname"
        )
    if not any(r.iterdir()):
        return CheckpointError(f"{r}: directory is empty; no checkpoint to merge")
    if (r / "model.safetensors").is_file() or (r / "model.safetensors.index.json").is_file():
        if (r / MERGE_MANIFEST).is_file():  # a merge's output
            return CheckpointError(
                f"{r}: holds a full Hugging Face model already (merged; no sharded checkpoint "
                f"here): load it with from_pretrained, check it with `shardforge verify {r}`"
            )
        return CheckpointError(
            f"{r}: holds a full Hugging Face model already (a merged or full save; no sharded "
            "checkpoint here): load it with from_pretrained"
        )
    if list(r.glob("*.distcp")):
        return CheckpointError(
            f"{r}: has .distcp files but no .metadata: the save did not finish (or "
            ".metadata was not copied); the checkpoint is incomplete"
        )
    unfinished = find_unfinished(r)
    if unfinished:
        return CheckpointError(f"{r}: no complete checkpoint: {unfinished[0]}", unfinished[1:])
    looked = [f"- {row.looked_for}" for row in LAYOUTS]
    return CheckpointError(f"{r}: no complete checkpoint found; looked for:", looked)


def _checked_root(root: str | Path, state_dict_dirname: str | None) -> Path:
    r = Path(root)
    if state_dict_dirname is not None:
        check_dirname(state_dict_dirname)
    if not r.exists():
        raise CheckpointError(f"{r}: checkpoint path does not exist")
    if not r.is_dir():
        raise CheckpointError(f"{r}: not a directory; give a checkpoint directory")
    return r


def resolve_checkpoint(
    root: str | Path, step: int | None = None, state_dict_dirname: str | None = None
) -> Candidate:
    """The model directory to merge: `root` itself when it is a DCP directory or a folder of
    rank files, else the latest (or `step`) complete checkpoint of a known layout under it;
    `state_dict_dirname` names the model folder inside a step (e.g. pytorch_ema_model_fsdp_0)."""
    r = _checked_root(root, state_dict_dirname)
    if state_dict_dirname is None and format_of(r) is not None:
        if (r / METADATA_FILE).is_file():
            check_not_optimizer(r)
        if step is not None:
            log.warning("--step %d ignored: %s is a single checkpoint", step, r)
        found = single(r, None)
        assert found is not None  # r itself holds a sharded format
        return found
    if r.name in OPTIMIZER_DIRS:
        check_not_optimizer(r)
    catalog = scan(r, state_dict_dirname)
    if not catalog.candidates:
        found = single(r, state_dict_dirname)
        if found is not None:
            return found
        raise _nothing_found(r, state_dict_dirname)
    picked = catalog.pick(step)
    if step is None:
        check_no_newer_full_save(r, picked)
    return picked


def list_checkpoints(root: str | Path, state_dict_dirname: str | None = None) -> list[Candidate]:
    """The numbered checkpoints under `root`, by step (for averaging and --all_steps)."""
    r = Path(root)
    if not r.is_dir():
        raise CheckpointError(f"{r}: not a directory; give the run's checkpoint root")
    return scan(r, state_dict_dirname).numbered()


def _full_weights(folder: Path) -> Path | None:
    return next((folder / n for n in FULL_WEIGHTS if (folder / n).is_file()), None)


def _written(c: Candidate) -> float:
    """When a checkpoint was completed: the newest file time in its model folder."""
    times = [c.model_dir.stat().st_mtime]
    times += [p.stat().st_mtime for p in c.model_dir.iterdir() if p.is_file()]
    return max(times)


def check_no_newer_full_save(root: Path, picked: Candidate) -> None:
    """The latest sharded checkpoint is not the run's latest state when a full-model save
    (FULL_STATE_DICT, HF Trainer's final save) is newer: say so instead of merging older
    weights. `--step` merges the sharded checkpoint anyway."""
    newer: list[str] = []
    top = _full_weights(root)
    if top is not None and top.stat().st_mtime > _written(picked):
        newer.append(f"{top.name} in {root.name}/")
    for sub in root.iterdir() if root.is_dir() else ():
        m = CHECKPOINT_DIR.match(sub.name)
        weights = _full_weights(sub) if m and sub.is_dir() else None
        if m and weights is not None and int(m.group(1)) > picked.step:
            newer.append(f"{sub.name}/{weights.name}")
    if newer:
        label = picked.model_dir.relative_to(root) if picked.model_dir != root else root.name
        raise CheckpointError(
            f"{root}: a full-model save ({', '.join(newer)}) is newer than the latest sharded "
            f"checkpoint {label}; that save already is the run's latest model. To merge the "
            f"older sharded checkpoint anyway, pass --step {picked.step}"
        )


def state_of(candidate: Candidate) -> tuple[bool, str]:
    """(optimizer or trainer state shares the model's shard files, where it lives in words)."""
    row = layout_named(candidate.layout)
    return row.state_shared, row.state_beside


__all__ = [
    "LAST",
    "Candidate",
    "Catalog",
    "check_model_keys",
    "check_not_optimizer",
    "is_lightning_last",
    "list_checkpoints",
    "resolve_checkpoint",
    "scan",
]


def step_folder(path: PurePath) -> tuple[str, int, PurePath] | None:
    """The step folder among `path` and its ancestors (nearest first): its name, its step and
    the path below it (`run/checkpoint-60/model` -> checkpoint-60, 60, model); None when none
    of them is named like a step of a known layout."""
    parts = path.parts
    for i in range(len(parts) - 1, -1, -1):
        for pattern in STEP_DIRS:
            if m := pattern.match(parts[i]):
                return parts[i], int(m.group(1)), PurePath(*parts[i + 1 :])
    return None


def recorded_checkpoint(given: Path, recorded: str) -> Path:
    """The folder that stands, under `given` (a run folder, a step folder or the model folder
    inside it, as the merge and `inspect` take them), for the checkpoint a merge recorded as
    read (`recorded`, its location then: `run/checkpoint-60/model`): the step it names, found
    by the catalog in a run folder. `given` itself where the recorded location names no step.
    Another step than the recorded one is an error saying which was merged."""
    named = step_folder(PurePath(recorded))
    if named is None or not given.is_dir():
        return given
    name, step, below = named
    for folder in (given, given.parent):
        m = next((m for p in STEP_DIRS if (m := p.match(folder.name))), None)
        if m is None or (folder != given and format_of(given) is None):
            continue  # not a step folder, nor the model folder inside one
        if int(m.group(1)) != step:
            raise CheckpointError(
                f"{given}: the output was merged from {name}, not {folder.name}; give that "
                "checkpoint (or the run folder)",
                [f"merged from {recorded}"],
            )
        inside = folder / below
        return given if folder != given or not inside.is_dir() else inside
    catalog = scan(given)
    if not catalog.candidates:
        return given  # checked as given
    matching = [c for c in catalog.candidates if c.step == step]
    if not matching:
        raise CheckpointError(
            f"{given}: the output was merged from {name}, which this folder does not hold "
            f"(steps found: {catalog.steps() or 'none'})",
            [f"merged from {recorded}"],
        )
    exact = [c for c in matching if c.model_dir.relative_to(given) == PurePath(name) / below]
    return _one(given, exact or matching, f"step {step}").model_dir
