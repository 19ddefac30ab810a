"""Checkpoint formats: open a model folder as named `TensorSource`s (metadata only).

`registry.FORMATS` maps each kind to its opener: `dcp/` (torch.distributed.checkpoint `.metadata`
+ `.distcp` records) and `rankfiles/` (per-rank DTensor `torch.save` files of verl and
LMMs-Engine). Every byte is read through `shardforge.io`.
"""
