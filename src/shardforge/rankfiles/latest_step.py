"""Find checkpoint steps the way each trainer names them, and the rank files inside a step.

A table of rules; adding a trainer's naming is adding a row.

=============  ======================  ===============================================
trainer        step folder             how "latest" is decided
=============  ======================  ===============================================
verl           ``global_step_N``       ``latest_checkpointed_iteration.txt`` (an
                                       integer) when present, else the highest N
LMMs-Engine    ``checkpoint-N``        the highest N (HF Trainer naming)
=============  ======================  ===============================================

Inside a step, rank files live in ``actor/`` (verl), ``pytorch_model_fsdp_0/`` (LMMs-Engine;
``pytorch_ema_model_fsdp_0/`` for EMA weights, picked with `state_dict_dirname`) or the step
folder itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from shardforge.errors import CheckpointError
from shardforge.rankfiles.rank_file import parse_rank_name


@dataclass(frozen=True)
class StepRule:
    """How one trainer names its step folders."""

    trainer: str
    folder: str  # the folder name, for messages
    pattern: re.Pattern[str]
    latest_file: str | None  # a file in the root naming the latest step, if the trainer writes one


STEP_RULES: Final[tuple[StepRule, ...]] = (
    StepRule(
        "verl",
        "global_step_N",
        re.compile(r"^global_step_(\d+)$"),
        "latest_checkpointed_iteration.txt",
    ),
    StepRule("lmms-engine", "checkpoint-N", re.compile(r"^checkpoint-(\d+)$"), None),
)

# sub-folders of a step that hold rank files, tried in order
RANK_DIRS: Final[tuple[str, ...]] = ("actor", "pytorch_model_fsdp_0", ".")


@dataclass(frozen=True)
class Step:
    """One step folder found under a checkpoint root."""

    number: int
    path: Path
    trainer: str


def list_steps(root: str | Path) -> list[Step]:
    """All step folders directly under `root`, sorted by step; error if two namings mix."""
    r = Path(root)
    if not r.is_dir():
        raise CheckpointError(f"{r}: not a directory")
    steps: list[Step] = []
    for child in r.iterdir():
        if not child.is_dir():
            continue
        for rule in STEP_RULES:
            m = rule.pattern.match(child.name)
            if m:
                steps.append(Step(int(m.group(1)), child, rule.trainer))
    trainers = sorted({s.trainer for s in steps})
    if len(trainers) > 1:
        raise CheckpointError(
            f"{r}: holds step folders of several trainers ({', '.join(trainers)}); "
            "point at one run's folder"
        )
    return sorted(steps, key=lambda s: s.number)


def find_step(root: str | Path, step: int | None = None) -> Step:
    """Step `step`, or the latest one (per the trainer's rule) when `step` is None."""
    r = Path(root)
    steps = list_steps(r)
    if not steps:
        names = " or ".join(rule.folder for rule in STEP_RULES)
        raise CheckpointError(f"{r}: no step folders (expected {names})")
    by_number = {s.number: s for s in steps}
    if step is not None:
        if step not in by_number:
            have = ", ".join(str(n) for n in by_number)
            raise CheckpointError(f"{r}: no step {step}; available: {have}")
        return by_number[step]
    rule = next(rule for rule in STEP_RULES if rule.trainer == steps[0].trainer)
    if rule.latest_file is not None and (r / rule.latest_file).is_file():
        text = (r / rule.latest_file).read_text(encoding="utf-8", errors="replace").strip()
        if not text.isdigit():
            raise CheckpointError(f"{r / rule.latest_file}: expected a step number, got {text!r}")
        latest = int(text)
        if latest not in by_number:
            raise CheckpointError(
                f"{r / rule.latest_file}: names step {latest}, but {r} has no "
                f"{rule.folder.replace('N', str(latest))} folder"
            )
        return by_number[latest]
    return steps[-1]


def find_latest_step(root: str | Path) -> Step:
    """The latest step under `root` (see the table in this module's docstring)."""
    return find_step(root, None)


def find_rank_dir(step_dir: str | Path, state_dict_dirname: str | None = None) -> Path:
    """The folder inside a step that holds the rank files."""
    d = Path(step_dir)
    candidates = (state_dict_dirname,) if state_dict_dirname else RANK_DIRS
    for name in candidates:
        sub = (d / name).resolve()
        if not sub.is_relative_to(d.resolve()):
            raise CheckpointError(f"{name!r}: must be a folder inside {d}")
        if sub.is_dir() and any(parse_rank_name(p) for p in sub.iterdir()):
            return sub if name != "." else d
    tried = ", ".join(f"{d / n}" for n in candidates)
    raise CheckpointError(f"no model_world_size_<W>_rank_<R>.pt files in {tried}")
