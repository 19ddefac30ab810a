"""What a checkpoint entry is: model weights, optimizer state or other training state.

Trainers keep optimizer state (and torchtitan its scheduler, data loader and train state) in the
same DCP as the weights, or beside it. Every reader asks these pure functions (constant tables,
no I/O): the merge skips optimizer entries, `--remove_checkpoint_dir` refuses files that hold
anything but weights, and `inspect` counts each kind.
"""

from __future__ import annotations

from typing import Literal

# first path elements of optimizer state
OPTIMIZER_ROOTS: frozenset[str] = frozenset({"optim", "optimizer", "state", "param_groups"})
# ... and numbered ones (Lightning's optimizer_0)
OPTIMIZER_NUMBERED: tuple[str, ...] = ("optimizer_", "optim_")
# top-level keys of training state that is not optimizer state (torchtitan)
TRAINING_STATE_ROOTS: frozenset[str] = frozenset({"lr_scheduler", "dataloader", "train_state"})

StateKind = Literal["model", "optimizer", "training"]


def _first(path: tuple[str, ...]) -> str:
    return path[0].split(".", 1)[0] if path else ""


def is_optimizer_key(path: tuple[str, ...]) -> bool:
    """Whether a checkpoint entry (its path of keys) is optimizer state."""
    first = _first(path)
    return first in OPTIMIZER_ROOTS or first.startswith(OPTIMIZER_NUMBERED)


def state_kind(path: tuple[str, ...]) -> StateKind:
    """ "optimizer", "training" (other training state) or "model"."""
    if is_optimizer_key(path):
        return "optimizer"
    return "training" if _first(path) in TRAINING_STATE_ROOTS else "model"
