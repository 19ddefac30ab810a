"""Where the model's DCP directory is, for each trainer's checkpoint layout.

Each layout is a row of `LAYOUTS`: a name and a function listing its complete checkpoints
under a root directory (step, model DCP directory). Adding a layout is adding a row.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardforge.checkpoint.keys import is_optimizer_key
from shardforge.checkpoint.metadata import METADATA_FILE
from shardforge.errors import CheckpointError

log = logging.getLogger("shardforge")

_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_LIGHTNING_STEP = re.compile(r"step=(\d+)")
# a Lightning `last.ckpt` sorts after every numbered step
LAST = 1 << 62

# DCP directories that hold optimizer state -> the model directory usually beside them
OPTIMIZER_DIRS: dict[str, tuple[str, ...]] = {
    "optimizer_0": ("pytorch_model_fsdp_0",),
    "optimizer": ("model",),
    "pytorch_optimizer_fsdp_0": ("pytorch_model_fsdp_0",),
}


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint found under a root: its layout, step and model DCP directory."""

    layout: str
    step: int
    model_dir: Path


def _is_dcp(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def _shardforge(root: Path) -> list[Candidate]:
    out = []
    for d in root.iterdir():
        m = _CHECKPOINT_DIR.match(d.name)
        if m and (d / "trainer_state.json").is_file() and _is_dcp(d / "model"):
            out.append(Candidate("shardforge", int(m.group(1)), d / "model"))
    return out


def _hf_trainer(root: Path) -> list[Candidate]:
    out = []
    for d in root.iterdir():
        m = _CHECKPOINT_DIR.match(d.name)
        if m and _is_dcp(d / "pytorch_model_fsdp_0"):
            out.append(Candidate("hf-trainer", int(m.group(1)), d / "pytorch_model_fsdp_0"))
    if _is_dcp(root / "pytorch_model_fsdp_0"):
        out.append(Candidate("accelerate", -1, root / "pytorch_model_fsdp_0"))
    return out


def lightning_step(meta_pt: Path) -> int:
    """`global_step` from a Lightning meta.pt, read with torch's allow-list unpickler
    (weights_only); -1 when it cannot be read safely."""
    import torch

    try:
        meta = torch.load(meta_pt, weights_only=True, map_location="cpu")
    except Exception as exc:
        log.warning("%s: not read (%s); step unknown", meta_pt, str(exc).splitlines()[0][:200])
        return -1
    step = meta.get("global_step") if isinstance(meta, dict) else None
    return int(step) if isinstance(step, int) else -1


def _lightning(root: Path) -> list[Candidate]:
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


LAYOUTS: dict[str, Callable[[Path], list[Candidate]]] = {
    "shardforge": _shardforge,
    "hf-trainer": _hf_trainer,
    "lightning": _lightning,
}

LOOKED_FOR = (
    "checkpoint-N/model/ (shardforge), checkpoint-N/pytorch_model_fsdp_0/ or "
    "pytorch_model_fsdp_0/ (HF Trainer / accelerate), *.ckpt/ with meta.pt (Lightning), or a "
    "DCP directory with .metadata"
)


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


def find_candidates(root: Path) -> list[Candidate]:
    found: list[Candidate] = []
    for rule in LAYOUTS.values():
        found += rule(root)
    return found


def _pick(cands: list[Candidate], root: Path, step: int | None) -> Candidate:
    if step is not None:
        matching = [c for c in cands if c.step == step]
        if not matching:
            steps = sorted({c.step for c in cands if 0 <= c.step < LAST})
            raise CheckpointError(
                f"{root}: no complete checkpoint for step {step}; steps found: {steps or 'none'}"
            )
        return matching[0]
    return max(cands, key=lambda c: c.step)


def resolve_checkpoint(root: str | Path, step: int | None = None) -> Candidate:
    """The model DCP directory to merge: `root` itself when it is a DCP directory, else the
    latest (or `step`) complete checkpoint of a known layout under it."""
    r = Path(root)
    if not r.exists():
        raise CheckpointError(f"{r}: checkpoint path does not exist")
    if not r.is_dir():
        raise CheckpointError(f"{r}: not a directory; give a checkpoint directory")
    if _is_dcp(r):
        check_not_optimizer(r)
        if step is not None:
            log.warning("--step %d ignored: %s is a single DCP checkpoint", step, r)
        return Candidate("dcp", -1, r)
    for sub in OPTIMIZER_DIRS:
        if r.name == sub:
            check_not_optimizer(r)
    cands = find_candidates(r)
    if not cands:
        # a single checkpoint-N directory, or a dir with its model subdirectory
        for sub in ("model", "pytorch_model_fsdp_0"):
            if _is_dcp(r / sub):
                return Candidate("dcp", -1, r / sub)
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
                f"{r}: has .distcp files but no .metadata; the checkpoint is incomplete "
                "(the save did not finish, or .metadata was not copied)"
            )
        raise CheckpointError(f"{r}: no complete checkpoint found; looked for {LOOKED_FOR}")
    return _pick(cands, r, step)
