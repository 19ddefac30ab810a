"""Per-rank DTensor state-dict files (``model_world_size_W_rank_R.pt``, LMMs-Engine FSDP2, verl):
safe reading and assembly planning of full tensors (step discovery: shardforge.layouts)."""

from shardforge.formats.rankfiles.pickles import Placement
from shardforge.formats.rankfiles.rank_file import RankFile, TensorRecord, read_rank_file
from shardforge.formats.rankfiles.rank_plan import Piece, TensorPlan, plan_rank_files

__all__ = [
    "Piece",
    "Placement",
    "RankFile",
    "TensorPlan",
    "TensorRecord",
    "plan_rank_files",
    "read_rank_file",
]
