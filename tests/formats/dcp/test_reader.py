"""Resume and --engine transformers read DCP metadata through an allow-list: real metadata loads, a hostile pickle fails."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardforge.errors import CheckpointError
from shardforge.formats.dcp.reader import SafeFileSystemReader, read_dcp_metadata


def _save(directory: Path) -> dict[str, torch.Tensor]:
    state = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(directory))
    return state


def test_real_metadata_loads_and_data_round_trips(tmp_path: Path) -> None:
    saved = _save(tmp_path / "ckpt")
    meta = read_dcp_metadata(tmp_path / "ckpt")
    assert meta.state_dict_metadata["w"].size == torch.Size([3, 4])
    assert meta.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    loaded = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.mkdir, (str(self.marker),))


def test_hostile_metadata_is_refused_without_running(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match=r"posix.mkdir is not allowed|mkdir"):
        read_dcp_metadata(tmp_path / "ckpt")
    assert not marker.exists()


def test_missing_or_wrong_metadata(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        read_dcp_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CheckpointError, match="not DCP Metadata"):
        read_dcp_metadata(tmp_path)
