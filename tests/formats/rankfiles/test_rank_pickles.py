"""A rank file's pickle (`shardforge.formats.rankfiles.pickles`): plain tensors are described,
not loaded; layouts shardforge cannot merge are named; the hostile corpus is refused.
(DTensor records from real ranks: test_rank_file.py and test_rank_plan.py.)"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from helpers.hostile import refuses_the_corpus
from shardforge.errors import CheckpointError
from shardforge.formats.rankfiles import Placement
from shardforge.formats.rankfiles.pickles import RANK_STATE_DICT, LocalTensor, load_rank_pickle


def test_rank_state_dict_plain_entries() -> None:
    buf = io.BytesIO()
    base = torch.arange(12, dtype=torch.float16).view(3, 4)
    torch.save({"a": base.t(), "b": base[1:]}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    out = load_rank_pickle(pkl, "r.pt")
    a, b = out["a"], out["b"]
    assert isinstance(a, LocalTensor) and isinstance(b, LocalTensor)
    assert (a.size, a.stride, a.storage_offset, a.storage.dtype) == (
        (4, 3),
        (1, 4),
        0,
        torch.float16,
    )
    assert (b.size, b.stride, b.storage_offset, b.storage.numel) == ((2, 4), (4, 1), 4, 12)
    for data, message in (
        (pickle.dumps([1, 2], protocol=2), "holds a list, not a state dict"),
        (pickle.dumps({"k": 3}, protocol=2), "entry 'k' holds int, not a tensor"),
        (pickle.dumps({3: 3}, protocol=2), "a state dict key is a int, not a string"),
    ):
        with pytest.raises(CheckpointError, match=message):
            load_rank_pickle(data, "r.pt")


@pytest.mark.parametrize(
    ("module", "name", "message"),
    [
        ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor", "FSDP1 ShardedTensor"),
        ("torch.distributed.tensor", "Whatever", "not on the allow-list"),
    ],
)
def test_layouts_that_cannot_be_merged_are_named(module: str, name: str, message: str) -> None:
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(CheckpointError, match=f"^r.pt: .*{message}"):
        load_rank_pickle(data, "r.pt")


def test_placements_read_as_torch_prints_them() -> None:
    shown = [
        Placement("shard", 1),
        Placement("replicate"),
        Placement("strided", 0, 2),
        Placement("unmodelled", label="Partial(sum)"),
    ]
    assert list(map(str, shown)) == [
        "Shard(1)",
        "Replicate()",
        "_StridedShard(dim=0, sf=2)",
        "Partial(sum)",
    ]


def test_rank_profile_refuses_the_corpus(tmp_path: Path) -> None:
    refuses_the_corpus(RANK_STATE_DICT, tmp_path)
