"""The allow-list unpicklers refuse code-execution payloads (and the payload never runs)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.checkpoint.safe_pickle import (
    UnsupportedRecord,
    load_metadata_pickle,
    parse_tensor_record,
)
from shardforge.errors import CheckpointError


class Payload:
    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


def payloads(marker: Path) -> dict[str, Any]:
    return {
        "os.system": Payload(os.system, f"touch {marker}"),
        "builtins.eval": Payload(eval, f"open({str(marker)!r}, 'w').close()"),
        "builtins.exec": Payload(exec, f"open({str(marker)!r}, 'w').close()"),
        "subprocess": Payload(__import__("subprocess").call, ["touch", str(marker)]),
    }


@pytest.mark.parametrize("as_torch", [False, True])
@pytest.mark.parametrize("kind", ["os.system", "builtins.eval", "builtins.exec", "subprocess"])
def test_metadata_payload_is_refused_and_never_runs(
    tmp_path: Path, kind: str, as_torch: bool
) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"x": payloads(marker)[kind]}))
    with pytest.raises(CheckpointError, match="refused"):
        load_metadata_pickle(path, as_torch=as_torch)
    assert not marker.exists()


def test_metadata_classes_dtypes_and_paths_are_allowed(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    meta = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                torch.Size([2]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
            )
        },
        planner_data={"w": ("w",), "p": Path("/x")},
    )
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(meta))
    plain = load_metadata_pickle(path)  # plain records: no torch class is instantiated
    assert type(plain).__module__ == "shardforge.checkpoint.safe_pickle"
    w = plain.state_dict_metadata["w"]
    assert w.properties.dtype == torch.bfloat16
    assert w.size == (2,) and w.chunks[0].offsets == (0,) and w.chunks[0].sizes == (2,)
    assert plain.planner_data["p"] == "/x"
    real = load_metadata_pickle(path, as_torch=True)  # torch's own classes, for its reader
    assert isinstance(real, Metadata)
    assert real.state_dict_metadata["w"].properties.dtype == torch.bfloat16


def test_not_a_pickle(tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"not a readable DCP \.metadata"):
        load_metadata_pickle(path)


def test_tensor_record_is_described_not_loaded() -> None:
    import zipfile

    buf = io.BytesIO()
    torch.save(torch.arange(6, dtype=torch.int32).view(2, 3)[:, 1:], buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    st = parse_tensor_record(pkl)
    assert (st.dtype, st.size, st.stride, st.storage_offset) == (torch.int32, (2, 2), (3, 1), 1)


def test_tensor_record_payload_is_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with pytest.raises(UnsupportedRecord):
        parse_tensor_record(pickle.dumps(payloads(marker)["os.system"]))
    assert not marker.exists()
