"""A DCP checkpoint's pickles (`shardforge.formats.dcp.pickles`): real `.metadata` files and
chunk records parse exactly, torch's classes are built from checked fields, and every DCP
profile refuses the hostile corpus."""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from helpers.hostile import refuses_the_corpus
from shardforge.errors import CheckpointError
from shardforge.formats.dcp.pickles import (
    METADATA,
    TENSOR_RECORD,
    VALUES,
    Metadata,
    UnsupportedRecord,
    load_metadata_pickle,
    parse_tensor_record,
    to_torch_metadata,
)
from shardforge.io.unpickler import unpickle


def _dcp_save(directory: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**state, "step": 3}, checkpoint_id=str(directory), no_dist=True)
    return state


def test_real_metadata_plain_and_as_torch(tmp_path: Path) -> None:
    _dcp_save(tmp_path)
    path = tmp_path / ".metadata"
    plain = load_metadata_pickle(path)  # plain records: no torch class is instantiated
    assert type(plain) is Metadata
    w = plain.state_dict_metadata["w"]
    assert w.properties.dtype == torch.bfloat16
    assert w.size == (3, 4) and w.chunks[0].offsets == (0, 0) and w.chunks[0].sizes == (3, 4)
    assert getattr(plain, "no_such_field", None) is None
    # torch's classes, built by their constructors: equal to what torch's own pickle.load gives
    with path.open("rb") as f:
        expected = pickle.load(f)  # our own test file, written by dcp.save just now
    expected.storage_meta.checkpoint_id = str(expected.storage_meta.checkpoint_id)  # paths: str
    assert load_metadata_pickle(path, as_torch=True) == expected


def test_a_many_rank_metadata_reads_as_torch_writes_it(tmp_path: Path) -> None:
    """A `.metadata` of 64 FSDP2 ranks with Adam states, pickled as `dcp.save` does (torch's
    own Metadata, no tensor behind it): read as torch reads it, every chunk tiling its tensor,
    within the unpickler's budget by the file's size."""
    from helpers.dcp_metadata import fsdp_metadata
    from shardforge.formats.dcp.metadata import read_entries

    meta = fsdp_metadata(layers=1, ranks=64, hidden=256)
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(meta))
    assert load_metadata_pickle(path, as_torch=True) == meta
    entries = read_entries(tmp_path, path, tile=True)
    assert len(entries.tensors) == 3 * 12 and len(entries.non_tensor_keys) == 12
    q = entries.tensors["model.model.layers.0.self_attn.q_proj.weight"]
    assert len(q.chunks) == 64 and q.chunks[1].file == tmp_path / "__1_0.distcp"
    assert q.path == ("model", "model.layers.0.self_attn.q_proj.weight")


def test_paths_and_old_pickles(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.metadata import Metadata as TorchMetadata

    meta = TorchMetadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float16),
                torch.Size([2]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
            )
        },
        planner_data={"w": ("w",), "p": Path("/x")},
    )
    path = tmp_path / ".metadata"
    for protocol in (2, 5):
        path.write_bytes(pickle.dumps(meta, protocol=protocol))
        plain = load_metadata_pickle(path)
        assert plain.planner_data["p"] == "/x", protocol
        assert plain.state_dict_metadata["w"].properties.dtype == torch.float16
        real = load_metadata_pickle(path, as_torch=True)
        assert real.state_dict_metadata == meta.state_dict_metadata
        assert real.planner_data == {"w": ("w",), "p": "/x"}


def test_metadata_that_is_not_metadata(tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    for data, message in (
        (b"garbage", r"\.metadata: not a readable pickle .* the file is damaged"),
        (b"\xffgarbage", r"\.metadata: the pickle has an unknown opcode 0xff"),
    ):
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=message):
            load_metadata_pickle(path)
    path.write_bytes(pickle.dumps({"not": "metadata"}))
    assert load_metadata_pickle(path) == {"not": "metadata"}  # plain data is fine...
    with pytest.raises(CheckpointError, match="not DCP Metadata"):
        load_metadata_pickle(path, as_torch=True)  # ...but not for torch's reader
    os.mkfifo(tmp_path / "fifo")  # never blocks
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_metadata_pickle(tmp_path / "fifo")


def test_metadata_size_limit(tmp_path: Path) -> None:
    big = tmp_path / ".metadata"  # sparse: refused by its size, before anything is read
    with big.open("wb") as f:
        f.truncate(METADATA.max_bytes + 1)
    with pytest.raises(CheckpointError) as info:
        load_metadata_pickle(big)
    assert str(info.value).endswith(
        f".metadata: refused to load: it is {METADATA.max_bytes + 1} bytes; DCP .metadata "
        "files are at most 32 MiB"
    ), str(info.value)


def test_a_memo_bomb_is_refused_early_naming_the_memo(tmp_path: Path) -> None:
    """The 90 MB .metadata of 30 million memo entries, at test scale: refused once its memo
    outgrows what a file of its size can hold, not after parsing it all as 'not Metadata'."""
    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x04" + b"N\x940" * 200_000 + b"N.")  # 3 bytes per entry
    with pytest.raises(CheckpointError) as info:
        load_metadata_pickle(path)
    assert f"has a memo that exceeds {600_004 // 4} entries for a file of 600004 bytes" in str(
        info.value
    )


def test_malformed_records_are_not_given_to_torch(tmp_path: Path) -> None:
    """Each part of torch's Metadata is built from checked fields; a record of the wrong
    shape is one line naming the file and the part."""
    _dcp_save(tmp_path)
    path = tmp_path / ".metadata"
    for part, value, message in (
        ("storage_meta", "x", "storage_meta is not a StorageMeta"),
        ("storage_data", [], "storage_data is not a dict"),
        ("storage_data", {"k": 1}, "storage_data holds something other than storage records"),
        ("planner_data", {"p": torch.float16}, "planner data holds a dtype"),
        ("version", 3, "the version is a int, not a str"),
        ("state_dict_metadata", {"w": 5}, "entry 'w' is a int"),
        ("state_dict_metadata", {3: 5}, "a state-dict key is not a string"),
    ):
        plain = load_metadata_pickle(path)
        plain._state[part] = value
        with pytest.raises(CheckpointError, match=f"^m: malformed DCP metadata: {message}"):
            to_torch_metadata(plain, "m")
    plain = load_metadata_pickle(path)
    plain.state_dict_metadata["w"]._state["chunks"] = "x"
    with pytest.raises(CheckpointError, match="entry 'w' has no list of chunks"):
        to_torch_metadata(plain, "m")


def _record_pickle(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))


def test_tensor_record_is_described_not_loaded() -> None:
    st = parse_tensor_record(_record_pickle(torch.arange(6, dtype=torch.int32).view(2, 3)[:, 1:]))
    assert (st.dtype, st.size, st.stride, st.storage_offset) == (torch.int32, (2, 2), (3, 1), 1)
    assert (st.storage_key, st.storage_numel) == ("0", 6)
    # float8 (_rebuild_tensor_v3 over an untyped storage of bytes) is described in its dtype
    fp8 = parse_tensor_record(_record_pickle(torch.zeros(2, 3, dtype=torch.float8_e4m3fn)))
    assert (fp8.dtype, fp8.size, fp8.storage_numel) == (torch.float8_e4m3fn, (2, 3), 6)
    # a tensor kind not modelled here (a quantized tensor) is unsupported, for torch's
    # weights-only loader, after the whole pickle was checked
    quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedRecord):
        parse_tensor_record(_record_pickle(quantized))


def test_values_are_plain() -> None:
    value = {"lr": 0.1, "betas": (0.9, 0.99), "names": ["a"], "step": 3}
    assert unpickle(pickle.dumps(value, protocol=2), "v", VALUES) == value
    with pytest.raises(
        CheckpointError, match=r"references pathlib(\._local)?\.PosixPath, which is not on"
    ):
        unpickle(pickle.dumps(Path("/x"), protocol=2), "v", VALUES)


@pytest.mark.parametrize("profile", ["metadata", "tensor record", "values"])
def test_every_dcp_profile_refuses_the_corpus(profile: str, tmp_path: Path) -> None:
    refuses_the_corpus(
        {"metadata": METADATA, "tensor record": TENSOR_RECORD, "values": VALUES}[profile], tmp_path
    )
