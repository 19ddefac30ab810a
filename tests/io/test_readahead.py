"""Reading ahead: `prefetch` within its budget; `ReadAhead` asks for each piece once, in order,
`depth` pieces ahead of the one starting (the kernel's page cache is real; the advice given is
recorded on its way to the real `posix_fadvise`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardforge.io.readahead import READ_AHEAD_PIECES, ReadAhead, prefetch, read_ahead_depth


def _files(tmp_path: Path, n: int, size: int) -> list[Path]:
    out = []
    for i in range(n):
        p = tmp_path / f"src{i}.bin"
        p.write_bytes(os.urandom(size))
        out.append(p)
    return out


def test_prefetch_respects_its_budget(tmp_path: Path) -> None:
    files = _files(tmp_path, 3, 10_000)
    assert prefetch(files, budget=25_000) == 25_000
    assert prefetch(files, budget=10**9) == 30_000
    assert prefetch([tmp_path / "missing"], budget=100) == 0


@dataclass(frozen=True)
class _Piece:
    src: Path
    src_offset: int
    nbytes: int


def test_read_ahead_asks_each_piece_once_depth_pieces_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _files(tmp_path, 2, 40_000)
    pieces = [_Piece(a, at, 4096) for at in range(0, 20_000, 4096)]
    pieces += [_Piece(tmp_path / "missing.bin", 0, 10), _Piece(b, 100, 4096)]
    asked: list[tuple[str, int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, n: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        asked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))
        real(fd, offset, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    ahead = ReadAhead(pieces, depth=2)
    try:
        ahead.started(0)
        assert asked == [(str(a), 0, 4096), (str(a), 4096, 4096), (str(a), 8192, 4096)]
        ahead.started(1)  # one more: piece 3
        ahead.started(1)  # asked already: nothing
        assert [o for _, o, _ in asked] == [0, 4096, 8192, 12288]
        ahead.started(4)  # up to the end; the missing file is skipped, not an error
        assert asked[4:] == [(str(a), 16384, 4096), (str(b), 100, 4096)]
    finally:
        ahead.close()
    assert read_ahead_depth(1) == READ_AHEAD_PIECES and read_ahead_depth(20) == 40
