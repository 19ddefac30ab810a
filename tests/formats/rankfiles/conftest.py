"""Rank-file fixtures: written once per test run by real gloo ranks (`rank_helpers`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_helpers import shared_rank_files

from helpers.meshes import mesh_rank_files


@pytest.fixture(scope="session")
def ranks_2_fp32(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model_dir, rank_dir): 2 ranks, float32."""
    return shared_rank_files(tmp_path_factory, "ranks_2_fp32")


@pytest.fixture(scope="session")
def shard_dim_1(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model_dir, rank_dir): 2 ranks, float32, matrices sharded along dim 1."""
    return shared_rank_files(tmp_path_factory, "shard_dim_1")


@pytest.fixture(scope="session")
def ranks_3_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model_dir, rank_dir): 3 ranks, bfloat16."""
    return shared_rank_files(tmp_path_factory, "ranks_3_bf16")


@pytest.fixture(scope="session")
def mesh_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rank files over a 2x2 mesh (FSDP2 + TP, HSDP, every placement mix): `helpers.meshes`."""
    return mesh_rank_files(tmp_path_factory)
