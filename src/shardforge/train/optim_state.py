"""What checkpointing saves and loads of any optimizer: torch's sharded optimizer state dict, a
low-bit optimizer's plain states (`optim_lowbit`), GaLore's / APOLLO's (`optim_projected`)."""

from __future__ import annotations

from typing import Any

import torch

from shardforge.train import optim_lowbit, optim_projected


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's sharded state dict as DCP saves it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if optim_lowbit.is_low_bit(optimizer):
        return optim_lowbit.saved_state(model, optimizer)
    if optim_projected.is_projected(optimizer):
        return optim_projected.saved_state(model, optimizer)
    return get_optimizer_state_dict(model, optimizer)


def load_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    folder: Any,
    world_size: int,
    mesh_shape: list[int],
) -> None:
    """Load a checkpoint's optimizer/ folder (resharded by DCP) into `optimizer`."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from shardforge.formats.dcp.reader import load_checked

    same = optim_lowbit.same_layout(model, world_size, mesh_shape)
    if optim_lowbit.is_low_bit(optimizer):
        optim_lowbit.load_state(model, optimizer, folder, same)
        return
    if optim_projected.is_projected(optimizer):
        optim_projected.load_state(model, optimizer, folder, same)
        return
    optim_sd = get_optimizer_state_dict(model, optimizer)
    load_checked(optim_sd, folder)
    set_optimizer_state_dict(model, optimizer, optim_sd)
