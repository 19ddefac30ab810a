"""The merge: locate -> open -> map keys -> check -> plan -> write -> verify -> publish."""

from shardforge.merge.api import merge_fsdp_weights

__all__ = ["merge_fsdp_weights"]
