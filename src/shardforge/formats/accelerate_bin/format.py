"""The accelerate-bin row of the format registry: one ``pytorch_model_fsdp_0_rank<R>.bin`` per
rank, written by accelerate's ``save_fsdp_model(..., use_dcp=False)`` (checked: accelerate 1.15) with
FSDP2 and ``SHARDED_STATE_DICT``: ``torch.save`` of the rank's DTensor state dict.

The names hold no world size: the ranks must be 0 .. R without a gap, and each DTensor's device
mesh must span exactly the files found (a missing last rank is refused by the planner).
``save_fsdp_optimizer(..., use_dcp=False)`` writes ``optimizer_0_rank<R>.bin`` beside them and
``Accelerator.save_state`` ``random_states_<R>.pkl``: counted for `inspect`, never read. Other
models of the same save (``pytorch_model_fsdp_1_rank<R>.bin``) are not this checkpoint's model.
"""

from __future__ import annotations

import re

from shardforge.formats.rankfiles.format import RankFilesFormat
from shardforge.formats.rankfiles.names import RankNames

ACCELERATE_NAMES = RankNames(
    re.compile(r"^pytorch_model_fsdp_0_rank(?P<rank>\d+)\.bin$"),
    "pytorch_model_fsdp_0_rank{rank}.bin",
)


class AccelerateBinFormat(RankFilesFormat):
    name = "accelerate-bin"
    looked_for = (
        "a folder of pytorch_model_fsdp_0_rank<R>.bin files (accelerate save_fsdp_model with "
        "use_dcp=False)"
    )
    shards_described = "the pytorch_model_fsdp_0_rank<R>.bin files"
    names = ACCELERATE_NAMES
    state_files = {  # noqa: RUF012 (a class fact, never mutated)
        "optimizer": re.compile(r"^optimizer_0_rank(\d+)\.bin$"),
        "other": re.compile(r"^random_states_(\d+)\.pkl$"),
    }
