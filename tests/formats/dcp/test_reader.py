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


# -- CheckedFileSystemReader: resume and --engine transformers -----------------------------------


def _checked_load(directory: Path, state: dict[str, object]) -> None:
    from shardforge.formats.dcp.reader import load_checked

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_checked(state, directory, no_dist=True)


def test_checked_reader_round_trips_tensors_and_plain_values(tmp_path: Path) -> None:
    """Optimizer settings are stored as non-tensor entries; torch's default planner would
    unpickle them with weights_only=False, the checked reader reads them as plain values."""
    saved = {
        "w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "groups": {"lr": 0.001, "betas": (0.9, 0.999), "params": ["a.b", "c"], "fused": None},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(saved, checkpoint_id=str(tmp_path / "ckpt"))
    state: dict[str, object] = {
        "w": torch.zeros(3, 4, dtype=torch.bfloat16),
        "groups": {"lr": 0.0, "betas": (0.0, 0.0), "params": [], "fused": 1},
    }
    _checked_load(tmp_path / "ckpt", state)
    assert torch.equal(state["w"], saved["w"])  # type: ignore[arg-type]
    assert state["groups"] == saved["groups"]


def test_checked_reader_refuses_a_hostile_non_tensor_entry(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.ones(4), "x": _Evil(marker)}, checkpoint_id=str(tmp_path / "ckpt"))
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp \(record at \d+\).*mkdir"):
        _checked_load(tmp_path / "ckpt", {"w": torch.zeros(4), "x": None})
    assert not marker.exists()


def test_checked_reader_checks_every_record_crc(tmp_path: Path) -> None:
    """A flipped payload byte: torch's reader loads it silently, the checked reader refuses."""
    saved = _save(tmp_path / "ckpt")
    data_file = tmp_path / "ckpt" / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    pos = data.find(saved["b"].numpy().tobytes())  # the stored ones of "b"
    assert pos > 0
    data[pos + 1] ^= 0x40
    data_file.write_bytes(bytes(data))
    unchecked = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            unchecked, storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")), no_dist=True
        )
    assert not torch.equal(unchecked["b"], saved["b"])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: .*CRC-32"):
        _checked_load(
            tmp_path / "ckpt", {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)}
        )
