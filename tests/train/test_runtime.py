"""The device mesh: FULL_SHARD over all ranks, or HSDP's (replicate, shard) mesh."""

from __future__ import annotations

from typing import Any

import pytest

from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.runtime import mesh_shape


def _cfg(**extra: Any) -> Any:
    return validate_cfg({"base_model": "unused", **extra})


@pytest.mark.parametrize(
    "extra,world,local,want",
    [
        ({}, 4, 4, (4,)),
        ({"dp_shard_size": 2}, 4, 4, (2, 2)),
        ({"dp_replicate_size": 2}, 8, 8, (2, 4)),
        ({"dp_replicate_size": 2, "dp_shard_size": 3}, 6, 6, (2, 3)),
        ({"fsdp": {"hybrid_shard": True}}, 8, 4, (2, 4)),  # shard within each machine
        ({"fsdp": {"hybrid_shard": True}}, 4, 4, (4,)),  # one machine: plain FULL_SHARD
        ({"fsdp": {"hybrid_shard": True}, "dp_shard_size": 2}, 8, 8, (4, 2)),
        ({"dp_shard_size": 4}, 4, 4, (4,)),
    ],
)
def test_mesh_shape(extra: dict[str, Any], world: int, local: int, want: tuple[int, ...]) -> None:
    assert mesh_shape(_cfg(**extra), world, local) == want


@pytest.mark.parametrize(
    "extra,world,local,key,text",
    [
        ({"dp_shard_size": 3}, 4, 4, "dp_shard_size", "3 does not divide the world size 4"),
        ({"dp_replicate_size": 3}, 4, 4, "dp_replicate_size", "does not divide"),
        (
            {"dp_replicate_size": 2, "dp_shard_size": 4},
            4,
            4,
            "dp_replicate_size",
            "2 x 4 = 8, but the world size is 4",
        ),
        ({"fsdp": {"hybrid_shard": True}}, 6, 4, "fsdp.hybrid_shard", "set dp_shard_size"),
    ],
)
def test_sizes_that_do_not_fit_name_their_key(
    extra: dict[str, Any], world: int, local: int, key: str, text: str
) -> None:
    with pytest.raises(ConfigError) as info:
        mesh_shape(_cfg(**extra), world, local)
    assert info.value.source == key and text in str(info.value)
