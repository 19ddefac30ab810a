"""The kinds of model folder a layout's candidate holds; each is a row of `formats.registry`
(named here, without the readers, so that finding a checkpoint needs no torch)."""

DCP = "dcp"
RANK_FILES = "rank-files"
