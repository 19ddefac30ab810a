"""A parameter's local shard and back, for optimizers whose states live per shard
(`optim_lowbit`, `optim_projected`)."""

from __future__ import annotations

from typing import Any

import torch


def _dtensor_type() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if isinstance(t, _dtensor_type()) else t


def _like(p: Any, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's shard of `p`, any shape of as many elements) as a tensor like `p`."""
    if not isinstance(p, _dtensor_type()):
        return local.reshape(p.shape)
    from torch.distributed.tensor import DTensor

    local = local.reshape(p.to_local().shape)
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
