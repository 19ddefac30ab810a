"""Per-rank DTensor state-dict files (``model_world_size_W_rank_R.pt``, LMMs-Engine FSDP2, verl):
safe reading, assembly planning and streaming of full tensors, and step discovery."""

from shardforge.rankfiles.latest_step import (
    STEP_RULES,
    Step,
    find_latest_step,
    find_rank_dir,
    find_step,
    list_steps,
)
from shardforge.rankfiles.rank_file import RankFile, TensorRecord, read_local_tensor, read_rank_file
from shardforge.rankfiles.rank_plan import Piece, TensorPlan, iter_tensors, plan_rank_files
from shardforge.rankfiles.rank_unpickler import Placement

__all__ = [
    "STEP_RULES",
    "Piece",
    "Placement",
    "RankFile",
    "Step",
    "TensorPlan",
    "TensorRecord",
    "find_latest_step",
    "find_rank_dir",
    "find_step",
    "iter_tensors",
    "list_steps",
    "plan_rank_files",
    "read_local_tensor",
    "read_rank_file",
]
