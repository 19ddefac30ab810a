"""Where the model's DCP directory is, for each trainer's checkpoint layout.

Each layout is a row of `LAYOUTS`: a name and a function listing its complete checkpoints
under a root directory (step, model DCP directory). Adding a layout is adding a row.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.metadata import METADATA_FILE
from shardforge.formats.kinds import DCP, RANK_FILES
from shardforge.formats.lightning_meta import read_lightning_meta
from shardforge.keymap.keys import TORCHTITAN, is_optimizer_key

log = logging.getLogger("shardforge")

_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_GLOBAL_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TITAN_STEP_DIR = re.compile(r"^step-(\d+)$")
_LIGHTNING_STEP = re.compile(r"step=(\d+)")
_RANK_FILE = re.compile(r"^model_world_size_\d+_rank_\d+\.pt$")
# a Lightning `last.ckpt` sorts after every numbered step
LAST = 1 << 62

# verl keeps the HF config and tokenizer in this folder beside the rank files
HF_FOLDER = "huggingface"
# verl names its latest step in this file of the run's root
LATEST_FILE = "latest_checkpointed_iteration.txt"

# DCP directories that hold optimizer state -> the model directory usually beside them
OPTIMIZER_DIRS: dict[str, tuple[str, ...]] = {
    "optimizer_0": ("pytorch_model_fsdp_0",),
    "optimizer": ("model",),
    "pytorch_optimizer_fsdp_0": ("pytorch_model_fsdp_0",),
}


# top-level DCP keys of training state that is not optimizer state (torchtitan)
TRAINING_STATE_ROOTS: frozenset[str] = frozenset({"lr_scheduler", "dataloader", "train_state"})


@dataclass(frozen=True)
class ShardFiles:
    """Which files of a model directory are its model shards: what the merge reads and what
    `--remove_checkpoint_dir` may delete (nothing else in the folder is ever removed)."""

    described: str
    pattern: re.Pattern[str] | None  # the shard file names; None: the files `.metadata` names


# model directory kind -> its shard files
SHARD_FILES: dict[str, ShardFiles] = {
    DCP: ShardFiles("the .metadata file and the .distcp files it names", None),
    RANK_FILES: ShardFiles("the model_world_size_W_rank_R.pt files", _RANK_FILE),
}


@dataclass(frozen=True)
class LayoutState:
    """Where a layout keeps optimizer and trainer state: in the model's own shard files
    (`shared`: removing the shards would delete it), or in files of its own (`beside`, never
    removed)."""

    shared: bool
    beside: str  # in words, for messages and docs


# layout (Candidate.layout) -> where its training state lives
LAYOUT_STATE: dict[str, LayoutState] = {
    "shardforge": LayoutState(False, "optimizer/, trainer_state.json, rng_state_R.pt"),
    "hf-trainer": LayoutState(
        False, "optimizer_0/, scheduler.pt, rng_state_R.pth, trainer_state.json"
    ),
    "accelerate": LayoutState(False, "optimizer_0/, scheduler.bin, random_states_R.pkl"),
    "lmms-engine": LayoutState(False, "optimizer and EMA folders beside the model folder"),
    "verl": LayoutState(
        False,
        "optim_world_size_W_rank_R.pt, extra_state_world_size_W_rank_R.pt, huggingface/, "
        "fsdp_config.json",
    ),
    "torchtitan": LayoutState(True, "optimizer, lr_scheduler, dataloader, train_state entries"),
    "lightning": LayoutState(True, "optimizer entries in the .ckpt/ DCP, meta.pt"),
    # a model directory given directly: its entries (DCP) or file names (rank files) decide
    DCP: LayoutState(False, "optimizer/ or optimizer_0/ beside it"),
    RANK_FILES: LayoutState(False, "optim_world_size_W_rank_R.pt beside the rank files"),
}


def state_kind(path: tuple[str, ...]) -> str:
    """What a checkpoint entry is: "optimizer", "training" (other training state) or "model"."""
    if is_optimizer_key(path):
        return "optimizer"
    first = path[0].split(".", 1)[0] if path else ""
    return "training" if first in TRAINING_STATE_ROOTS else "model"


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint found under a root: its layout, step and model directory.

    `kind` says what the model directory holds (`DCP`: a DCP `.metadata` + data files;
    `RANK_FILES`: `model_world_size_W_rank_R.pt` files), `adapter` which key names it uses
    (None: Hugging Face names; `TORCHTITAN`), `hf_dir` a folder beside it with the HF config
    and tokenizer (verl's `huggingface/`), when there is one.
    """

    layout: str
    step: int
    model_dir: Path
    kind: str = DCP
    adapter: str | None = None
    hf_dir: Path | None = None


def _is_dcp(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def has_rank_files(path: Path) -> bool:
    return path.is_dir() and any(_RANK_FILE.match(p.name) for p in path.iterdir())


def kind_of(path: Path) -> str | None:
    """`DCP`, `RANK_FILES` or None (not a model directory)."""
    if _is_dcp(path):
        return DCP
    return RANK_FILES if has_rank_files(path) else None


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
class StepLayout:
    """A trainer that writes one folder per step holding the model in a sub-folder."""

    pattern: re.Pattern[str]
    subdirs: tuple[str, ...]  # tried in order ("." is the step folder itself)
    kinds: tuple[str, ...]
    adapter: str | None = None
    marker: str | None = None  # a file the step folder must hold


STEP_LAYOUTS: dict[str, StepLayout] = {
    "shardforge": StepLayout(_CHECKPOINT_DIR, ("model",), (DCP,), marker="trainer_state.json"),
    "hf-trainer": StepLayout(_CHECKPOINT_DIR, ("pytorch_model_fsdp_0",), (DCP,)),
    "lmms-engine": StepLayout(_CHECKPOINT_DIR, ("pytorch_model_fsdp_0", "."), (RANK_FILES,)),
    "verl": StepLayout(_GLOBAL_STEP_DIR, ("actor", "."), (RANK_FILES,)),
    "torchtitan": StepLayout(_TITAN_STEP_DIR, (".",), (DCP,), adapter=TORCHTITAN),
}


def _hf_dir(model_dir: Path) -> Path | None:
    d = model_dir / HF_FOLDER
    return d if (d / "config.json").is_file() else None


def _step_rule(name: str, rule: StepLayout) -> Callable[[Path, str | None], list[Candidate]]:
    def find(root: Path, dirname: str | None) -> list[Candidate]:
        out = []
        for d in root.iterdir():
            m = rule.pattern.match(d.name)
            if not m or not d.is_dir() or (rule.marker and not (d / rule.marker).is_file()):
                continue
            for sub in (dirname,) if dirname else rule.subdirs:
                model_dir = d if sub == "." else d / sub
                kind = kind_of(model_dir)
                if kind in rule.kinds:
                    out.append(
                        Candidate(
                            name,
                            int(m.group(1)),
                            model_dir,
                            kind,
                            rule.adapter,
                            _hf_dir(model_dir),
                        )
                    )
                    break
        return out

    return find


def _accelerate(root: Path, dirname: str | None) -> list[Candidate]:
    model_dir = root / (dirname or "pytorch_model_fsdp_0")
    kind = kind_of(model_dir)
    return [Candidate("accelerate", -1, model_dir, kind)] if kind is not None else []


def lightning_step(meta_pt: Path) -> int:
    """`global_step` from a Lightning meta.pt, read through the allow-list unpickler
    (`formats.lightning_meta`); -1 when it cannot be read safely."""
    try:
        meta = read_lightning_meta(meta_pt)
    except CheckpointError as exc:
        reason = str(exc).removeprefix(f"{meta_pt}: ")[:200]  # the message names the file too
        log.warning("%s: not read (%s); step unknown", meta_pt, reason)
        return -1
    step = meta.get("global_step")
    return int(step) if isinstance(step, int) else -1


def _lightning(root: Path, dirname: str | None) -> list[Candidate]:
    out = []
    dirs = [root, *(p for p in root.glob("**/checkpoints") if p.is_dir())]
    for parent in dirs:
        for d in parent.glob("*.ckpt"):
            if d.is_dir() and (d / "meta.pt").is_file() and _is_dcp(d):
                if d.name == "last.ckpt" or d.name.startswith("last"):
                    step = LAST
                else:
                    m = _LIGHTNING_STEP.search(d.name)
                    step = int(m.group(1)) if m else lightning_step(d / "meta.pt")
                out.append(Candidate("lightning", step, d))
    return out


LAYOUTS: dict[str, Callable[[Path, str | None], list[Candidate]]] = {
    **{name: _step_rule(name, rule) for name, rule in STEP_LAYOUTS.items()},
    "accelerate": _accelerate,
    "lightning": _lightning,
}

LOOKED_FOR: tuple[str, ...] = (
    "checkpoint-N/model/ (shardforge)",
    "checkpoint-N/pytorch_model_fsdp_0/ or pytorch_model_fsdp_0/ (HF Trainer / accelerate DCP, "
    "LMMs-Engine rank files)",
    "global_step_N/actor/ (verl rank files)",
    "step-N/ (torchtitan DCP)",
    "*.ckpt/ with meta.pt (Lightning)",
    "a DCP directory with .metadata, or a folder of model_world_size_W_rank_R.pt files",
)
# step folders of every layout (where an unfinished save is looked for)
_STEP_DIRS = (_CHECKPOINT_DIR, _GLOBAL_STEP_DIR, _TITAN_STEP_DIR)


def _unfinished(folder: Path) -> str | None:
    """Why `folder` holds shards but is not a complete checkpoint (None: it does not)."""
    if _is_dcp(folder) or not folder.is_dir():
        return None
    if any(folder.glob("*.distcp")):
        if any(folder.glob("__*.metadata")):
            return (
                "has per-rank metadata from use_collectives=False and no global .metadata; "
                "this layout is not supported"
            )
        return "has .distcp files but no .metadata: the save did not finish"
    return None


def find_unfinished(root: Path) -> list[str]:
    """`<folder> <why>` for each folder under `root` (itself, its step folders and their model
    folders) that holds shards of a save that did not finish, newest step first."""
    folders = [root]
    steps = [d for d in root.iterdir() if d.is_dir() and any(p.match(d.name) for p in _STEP_DIRS)]
    steps.sort(key=lambda d: int(re.sub(r"\D", "", d.name) or 0), reverse=True)
    subs = {sub for rule in STEP_LAYOUTS.values() for sub in rule.subdirs if sub != "."}
    for d in steps:
        folders += [d, *(d / sub for sub in sorted(subs))]
    out = []
    for f in folders:
        why = _unfinished(f)
        if why is not None:
            label = f.relative_to(root) if f != root else f
            out.append(f"{label} {why}")
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
            str(p) for p in sorted(model_dir.parent.iterdir()) if p != model_dir and _is_dcp(p)
        ]
        where = f"; try {siblings[0]}" if siblings else ""
        raise CheckpointError(f"{model_dir}: holds only optimizer state, not model weights{where}")


def find_candidates(root: Path, state_dict_dirname: str | None = None) -> list[Candidate]:
    """Every complete checkpoint of a known layout directly under `root` (the model folder
    inside each step is `state_dict_dirname` when given)."""
    if state_dict_dirname is not None:
        check_dirname(state_dict_dirname)
    found: dict[Path, Candidate] = {}
    for rule in LAYOUTS.values():
        for c in rule(root, state_dict_dirname):
            found.setdefault(c.model_dir, c)
    return list(found.values())


def _latest(cands: list[Candidate], root: Path) -> Candidate:
    if (root / LATEST_FILE).is_file() and any(c.layout == "verl" for c in cands):
        text = (root / LATEST_FILE).read_text(encoding="utf-8", errors="replace").strip()
        if not text.isdigit():
            raise CheckpointError(f"{root / LATEST_FILE}: expected a step number, got {text!r}")
        for c in cands:
            if c.step == int(text):
                return c
        raise CheckpointError(
            f"{root / LATEST_FILE}: names step {text}, but {root} has no complete "
            f"global_step_{text} checkpoint; pass --step"
        )
    return max(cands, key=lambda c: c.step)


def _pick(cands: list[Candidate], root: Path, step: int | None) -> Candidate:
    if step is not None:
        matching = [c for c in cands if c.step == step]
        if not matching:
            steps = sorted({c.step for c in cands if 0 <= c.step < LAST})
            raise CheckpointError(
                f"{root}: no complete checkpoint for step {step}; steps found: {steps or 'none'}"
            )
        return matching[0]
    return _latest(cands, root)


def _single(r: Path, dirname: str | None) -> Candidate | None:
    """`r` itself (or its model sub-folder) when it is one checkpoint, not a root of steps."""
    subs = (dirname,) if dirname else (".", "model", "pytorch_model_fsdp_0", "actor")
    for sub in subs:
        d = r if sub == "." else r / sub
        kind = kind_of(d)
        if kind is not None:
            adapter = TORCHTITAN if _TITAN_STEP_DIR.match(r.name) and kind == DCP else None
            return Candidate(kind, -1, d, kind, adapter, _hf_dir(d))
    return None


def resolve_checkpoint(
    root: str | Path, step: int | None = None, state_dict_dirname: str | None = None
) -> Candidate:
    """The model directory to merge: `root` itself when it is a DCP directory or a folder of
    rank files, else the latest (or `step`) complete checkpoint of a known layout under it;
    `state_dict_dirname` names the model folder inside a step (e.g. pytorch_ema_model_fsdp_0)."""
    r = Path(root)
    if state_dict_dirname is not None:
        check_dirname(state_dict_dirname)
    if not r.exists():
        raise CheckpointError(f"{r}: checkpoint path does not exist")
    if not r.is_dir():
        raise CheckpointError(f"{r}: not a directory; give a checkpoint directory")
    if state_dict_dirname is None and kind_of(r) is not None:
        if _is_dcp(r):
            check_not_optimizer(r)
        if step is not None:
            log.warning("--step %d ignored: %s is a single checkpoint", step, r)
        return _single(r, None) or Candidate(DCP, -1, r)
    for sub in OPTIMIZER_DIRS:
        if r.name == sub:
            check_not_optimizer(r)
    cands = find_candidates(r, state_dict_dirname)
    if not cands:
        single = _single(r, state_dict_dirname)
        if single is not None:
            return single
        if state_dict_dirname is not None:
            raise CheckpointError(
                f"{r}: no checkpoint has a {state_dict_dirname!r} folder holding a DCP "
                "checkpoint or model_world_size_W_rank_R.pt files; check --state_dict_dirname"
            )
        if not any(r.iterdir()):
            raise CheckpointError(f"{r}: directory is empty; no checkpoint to merge")
        if list(r.glob("__*.metadata")):
            raise CheckpointError(
                f"{r}: has per-rank metadata from use_collectives=False and no global .metadata; "
                "this layout is not supported"
            )
        if (r / "model.safetensors").is_file() or (r / "model.safetensors.index.json").is_file():
            raise CheckpointError(
                f"{r}: holds a full Hugging Face model already (FULL_STATE_DICT save) and no "
                "sharded checkpoint; load it directly, there is nothing to merge"
            )
        if list(r.glob("*.distcp")):
            raise CheckpointError(
                f"{r}: has .distcp files but no .metadata: the save did not finish (or "
                ".metadata was not copied); the checkpoint is incomplete"
            )
        unfinished = find_unfinished(r)
        if unfinished:
            raise CheckpointError(f"{r}: no complete checkpoint: {unfinished[0]}", unfinished[1:])
        raise CheckpointError(
            f"{r}: no complete checkpoint found; looked for:", [f"- {w}" for w in LOOKED_FOR]
        )
    picked = _pick(cands, r, step)
    if step is None:
        check_no_newer_full_save(r, picked)
    return picked


FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


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
        m = _CHECKPOINT_DIR.match(sub.name)
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


def list_checkpoints(root: str | Path, state_dict_dirname: str | None = None) -> list[Candidate]:
    """The numbered checkpoints under `root`, by step (for averaging)."""
    r = Path(root)
    if not r.is_dir():
        raise CheckpointError(f"{r}: not a directory; give the run's checkpoint root")
    cands = [c for c in find_candidates(r, state_dict_dirname) if 0 <= c.step < LAST]
    by_step: dict[int, Candidate] = {}
    for c in sorted(cands, key=lambda c: c.step):
        by_step.setdefault(c.step, c)
    return list(by_step.values())
