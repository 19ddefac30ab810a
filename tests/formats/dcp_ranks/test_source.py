"""The collective-free DCP source (`formats.dcp_ranks.source`) on the contract checkpoint that
``dcp.save(..., use_collectives=False)`` wrote on 2 gloo ranks (`helpers.shared.saved_formats`):
a tensor every rank saved whole is read from rank 0, after rank 1's copy has been compared with
it byte for byte; a copy that differs stops every use of the tensor with one line naming it
and both ranks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers.shared import REPLICATED, contract_tensors
from shardforge.errors import CheckpointError
from shardforge.formats.base import Destination
from shardforge.formats.dcp.chunks import locate
from shardforge.formats.dcp_ranks import source as rank_source
from shardforge.formats.dcp_ranks.rank_metadata import read_rank_copies
from shardforge.formats.registry import format_named
from shardforge.io.copy import ReadCache

pytestmark = pytest.mark.slow  # the checkpoints are written by 2 gloo ranks


def _flip_copy(folder: Path, key: str) -> None:
    """Change the last byte of rank 1's copy of `key` (rank 0's is the one read)."""
    (copy,) = read_rank_copies(folder)[key]
    assert (copy.rank, copy.kept_rank) == (1, 0)
    with ReadCache() as reader:
        _, raw = locate(reader, copy.chunk)
    assert raw is not None
    last = raw.data_offset + copy.chunk.numel * raw.dtype.itemsize - 1
    with copy.chunk.file.open("r+b") as f:
        f.seek(last)
        byte = f.read(1)[0]
        f.seek(last)
        f.write(bytes([byte ^ 0x01]))


def test_copies_of_a_replica_are_compared_before_use(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equal copies read as saved; a copy that differs in its last byte (compared in blocks of
    4 bytes here, so in the last block) stops every use of the tensor with one line."""
    folder = Path(shutil.copytree(saved / "contract" / "dcp-ranks", tmp_path / "ckpt"))
    monkeypatch.setattr(rank_source, "COMPARE_BLOCK", 4)
    with ReadCache() as reader:
        source = format_named("dcp-ranks").open(folder)[REPLICATED].source
        assert torch.equal(source.read(reader), contract_tensors()[REPLICATED])
    _flip_copy(folder, REPLICATED)
    source = format_named("dcp-ranks").open(folder)[REPLICATED].source
    uses = [
        lambda r: source.read(r),
        lambda r: source.slabs(r),
        lambda r: source.write(r, Destination(-1, 0, source.dtype, lambda n: None)),
    ]
    for use in uses:
        with ReadCache() as reader, pytest.raises(CheckpointError) as info:
            use(reader)
        message = info.value.message
        assert "\n" not in message and len(message) <= 300, message
        assert f"tensor {REPLICATED!r} differs between ranks 0 and 1" in message
    other = format_named("dcp-ranks").open(folder)["model.embed.weight"].source
    with ReadCache() as reader:  # a tensor without copies is not concerned
        assert torch.equal(other.read(reader), contract_tensors()["model.embed.weight"])
