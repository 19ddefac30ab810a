"""Where each trainer puts its checkpoints: ONE `Layout` row per trainer in `LAYOUTS`.

A row says how a step folder is recognised, which model sub-folders it holds (tried in order),
which formats they are in, which key names they use, where optimizer and trainer state live,
and what an error says was looked for. `layouts.catalog.scan` reads the rows once per run
folder; the merge, `inspect`, `--all_steps` and training's resume all ask that catalog. Adding
a trainer is adding a row (and, for an unusual scan, a finder function).

Torch-free: finding a checkpoint runs before torch is imported.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardforge.errors import CheckpointError
from shardforge.formats.lightning_meta import read_lightning_meta
from shardforge.formats.registry import (
    ACCELERATE_BIN,
    DCP,
    DCP_RANKS,
    DCP_SAFETENSORS,
    RANK_FILES,
    detect,
)
from shardforge.keymap.keys import TORCHTITAN
from shardforge.layouts.trainer_state import STATE_FILE

log = logging.getLogger("shardforge")

CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
GLOBAL_STEP_DIR = re.compile(r"^global_step_(\d+)$")
TITAN_STEP_DIR = re.compile(r"^step-(\d+)$")
LIGHTNING_STEP = re.compile(r"step=(\d+)")
# HF Trainer's checkpoint-N and accelerate's automatic naming (checkpoints/checkpoint_N)
ANY_CHECKPOINT_DIR = re.compile(r"^checkpoint[-_](\d+)$")
# a step folder of a trainer of one's own: checkpoint-N, checkpoint_N or step-N
OWN_STEP_DIR = re.compile(r"^(?:checkpoint[-_]|step-)(\d+)$")
# a Lightning `last*.ckpt` sorts after every numbered step
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


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint found under a root: its layout, step and model directory.

    `kind` names its format (a row of `formats.registry`), `adapter` which key names it uses
    (None: Hugging Face names; `TORCHTITAN`), `hf_dir` a folder beside it with the HF config
    and tokenizer (verl's `huggingface/`), when there is one.
    """

    layout: str
    step: int
    model_dir: Path
    kind: str = DCP
    adapter: str | None = None
    hf_dir: Path | None = None


Finder = Callable[["Layout", Path, "str | None"], list[Candidate]]


@dataclass(frozen=True)
class Layout:
    """One trainer's checkpoint layout (see the module docstring).

    `steps` matches a step folder (its first group is the step); None: the model folders sit
    in the run folder itself (accelerate), or the row is for a folder given directly
    (`direct`). `state_shared`: optimizer or trainer state lives in the model's own shard
    files (removing them would delete it); `state_beside` says where it lives, in words.
    """

    name: str
    steps: re.Pattern[str] | None
    model_dirs: tuple[str, ...]  # tried in order ("." is the step folder itself)
    formats: tuple[str, ...]
    looked_for: str
    state_beside: str
    state_shared: bool = False
    key_names: str | None = None  # None: Hugging Face names
    marker: str | None = None  # a file the step folder must hold
    direct: bool = False  # only for a model folder given directly
    finder: Finder | None = None  # a scan of its own (Lightning)


# where a model folder given directly may hold its format's files ("." is the folder itself)
DIRECT_FOLDERS = (".", "model", "pytorch_model_fsdp_0", "actor")


def _direct(fmt: str, looked_for: str, state_beside: str) -> Layout:
    """The row of a model folder of format `fmt` given directly (`--checkpoint DIR`)."""
    return Layout(fmt, None, DIRECT_FOLDERS, (fmt,), looked_for, state_beside, direct=True)


def hf_dir(model_dir: Path) -> Path | None:
    d = model_dir / HF_FOLDER
    return d if (d / "config.json").is_file() else None


def format_of(folder: Path) -> str | None:
    """The name of the sharded format `folder` holds, or None."""
    fmt = detect(folder)
    return fmt.name if fmt is not None else None


def find_steps(layout: Layout, root: Path, dirname: str | None) -> list[Candidate]:
    """The row's complete checkpoints under `root` (the model folder in each step is
    `dirname` when given)."""
    folders: list[tuple[Path, int]] = []
    if layout.steps is None:
        folders = [(root, -1)]
    else:
        for d in root.iterdir():
            m = layout.steps.match(d.name)
            if m and d.is_dir() and (layout.marker is None or (d / layout.marker).is_file()):
                folders.append((d, int(m.group(1))))
    out = []
    for folder, step in folders:
        for sub in (dirname,) if dirname else layout.model_dirs:
            model_dir = folder if sub == "." else folder / sub
            kind = format_of(model_dir)
            if kind in layout.formats:
                out.append(
                    Candidate(
                        layout.name, step, model_dir, kind, layout.key_names, hf_dir(model_dir)
                    )
                )
                break
    return out


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


def is_lightning_last(name: str) -> bool:
    """`last.ckpt`, `last-v1.ckpt`, ...: what ModelCheckpoint(save_last=True) writes."""
    return name.startswith("last")


def find_lightning(layout: Layout, root: Path, dirname: str | None) -> list[Candidate]:
    """`*.ckpt/` DCP folders with a `meta.pt`, in the root or any `checkpoints/` below it."""
    out = []
    for parent in [root, *(p for p in root.glob("**/checkpoints") if p.is_dir())]:
        for d in parent.glob("*.ckpt"):
            if d.is_dir() and (d / "meta.pt").is_file() and format_of(d) == DCP:
                if is_lightning_last(d.name):
                    step = LAST
                else:
                    m = LIGHTNING_STEP.search(d.name)
                    step = int(m.group(1)) if m else lightning_step(d / "meta.pt")
                out.append(Candidate(layout.name, step, d))
    return out


LAYOUTS: tuple[Layout, ...] = (
    Layout(
        "shardforge",
        CHECKPOINT_DIR,
        ("model",),
        (DCP,),
        "checkpoint-N/model/ (shardforge)",
        "optimizer/, trainer_state.json, rng_state_R.pt",
        marker=STATE_FILE,
    ),
    Layout(
        "hf-trainer",
        CHECKPOINT_DIR,
        ("pytorch_model_fsdp_0",),
        (DCP,),
        "checkpoint-N/pytorch_model_fsdp_0/ (HF Trainer DCP)",
        "optimizer_0/, scheduler.pt, rng_state_R.pth, trainer_state.json",
    ),
    Layout(
        "lmms-engine",
        CHECKPOINT_DIR,
        ("pytorch_model_fsdp_0", "."),
        (RANK_FILES,),
        "checkpoint-N/pytorch_model_fsdp_0/ (LMMs-Engine rank files)",
        "optimizer and EMA folders beside the model folder",
    ),
    Layout(
        "verl",
        GLOBAL_STEP_DIR,
        ("actor", "."),
        (RANK_FILES,),
        "global_step_N/actor/ (verl rank files)",
        "optim_world_size_W_rank_R.pt, extra_state_world_size_W_rank_R.pt, huggingface/, "
        "fsdp_config.json",
    ),
    Layout(
        "torchtitan",
        TITAN_STEP_DIR,
        (".",),
        (DCP,),
        "step-N/ (torchtitan DCP)",
        "optimizer, lr_scheduler, dataloader, train_state entries",
        state_shared=True,
        key_names=TORCHTITAN,
    ),
    Layout(
        "accelerate",
        None,
        ("pytorch_model_fsdp_0",),
        (DCP,),
        "pytorch_model_fsdp_0/ (accelerate DCP)",
        "optimizer_0/, scheduler.bin, random_states_R.pkl",
    ),
    Layout(
        "accelerate-per-rank",
        ANY_CHECKPOINT_DIR,
        (".",),
        (ACCELERATE_BIN,),
        "checkpoint-N/ or checkpoint_N/ with pytorch_model_fsdp_0_rank<R>.bin (accelerate "
        "save_fsdp_model with use_dcp=False)",
        "optimizer_0_rank<R>.bin, scheduler.bin, random_states_<R>.pkl",
    ),
    Layout(
        "collective-free-dcp",
        OWN_STEP_DIR,
        (".", "model", "pytorch_model_fsdp_0"),
        (DCP_RANKS,),
        "checkpoint-N/, checkpoint_N/ or step-N/ with __<R>.metadata (DCP saved with "
        "use_collectives=False)",
        "optimizer entries in the same files, or a folder beside it",
    ),
    Layout(
        "torchtitan-hf",
        TITAN_STEP_DIR,
        (".",),
        (DCP_SAFETENSORS,),
        "step-N/ with sharded/shard-<S>-model-<K>-of-<N>.safetensors (torchtitan last_save_in_hf)",
        "none: torchtitan saves only the model in its last, Hugging Face save",
    ),
    Layout(
        "lightning",
        None,
        (".",),
        (DCP,),
        "*.ckpt/ with meta.pt (Lightning)",
        "optimizer entries in the .ckpt/ DCP, meta.pt",
        state_shared=True,
        finder=find_lightning,
    ),
    # a model folder given directly: its format (`formats.registry.detect`) decides
    _direct(DCP, "a DCP directory with .metadata", "optimizer/ or optimizer_0/ beside it"),
    _direct(
        RANK_FILES,
        "a folder of model_world_size_W_rank_R.pt files",
        "optim_world_size_W_rank_R.pt beside the rank files",
    ),
    _direct(
        ACCELERATE_BIN,
        "a folder of pytorch_model_fsdp_0_rank<R>.bin files",
        "optimizer_0_rank<R>.bin beside them",
    ),
    _direct(
        DCP_RANKS,
        "a DCP directory with __<R>.metadata per rank (use_collectives=False)",
        "optimizer entries in the same files, or a folder beside it",
    ),
    _direct(
        DCP_SAFETENSORS,
        "a folder of shard-<S>-model-<K>-of-<N>.safetensors files (or sharded/ with them)",
        "none: DCP's safetensors storage holds tensors only",
    ),
)
_BY_NAME = {row.name: row for row in LAYOUTS}
assert len(_BY_NAME) == len(LAYOUTS), "two layouts share a name"


def layout_named(name: str) -> Layout:
    return _BY_NAME[name]


def find(layout: Layout, root: Path, dirname: str | None) -> list[Candidate]:
    """The row's complete checkpoints under `root`."""
    return (layout.finder or find_steps)(layout, root, dirname)


# step folders of every layout (where an unfinished save is looked for)
STEP_DIRS: tuple[re.Pattern[str], ...] = tuple(
    dict.fromkeys(row.steps for row in LAYOUTS if row.steps is not None)
)
# model sub-folders of every step layout
MODEL_SUBDIRS: tuple[str, ...] = tuple(
    sorted({s for row in LAYOUTS if row.steps is not None for s in row.model_dirs if s != "."})
)


def is_step_folder(path: Path) -> bool:
    """A step folder of a known layout (checkpoint-N, global_step_N, step-N)."""
    return any(p.match(path.name) for p in STEP_DIRS)
