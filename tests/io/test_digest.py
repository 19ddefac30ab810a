"""`FileHash`: the BLAKE3 (or SHA-256) of an output file, read back from the file behind its
writers, whatever order they write in; `hash_file` of a whole file."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from pathlib import Path

import blake3
import pytest

import shardforge.io.digest as digest
from shardforge.errors import MergeError
from shardforge.io.digest import FileHash, hash_file, hash_of, hashing

DATA = os.urandom(1 << 16)
WANT = {"blake3": blake3.blake3(DATA).hexdigest(), "sha256": hashlib.sha256(DATA).hexdigest()}


def pieces(n: int, seed: int = 0) -> list[tuple[int, bytes]]:
    """`DATA` cut into `n` pieces of random sizes, each (offset, bytes)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(DATA)), n - 1))
    bounds = [0, *cuts, len(DATA)]
    return [(a, DATA[a:b]) for a, b in itertools.pairwise(bounds)]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catch-ups every 1000 bytes, mappings of 5000: many background turns on 64 KB."""
    monkeypatch.setattr(digest, "CHUNK", 1000)
    monkeypatch.setattr(digest, "HASH_SLICE", 5000)


@pytest.mark.parametrize("algo", ["blake3", "sha256"])
def test_pieces_written_in_any_order_give_the_files_digest(
    tmp_path: Path, algo: str, small_chunks: None
) -> None:
    for seed in range(3):
        path = tmp_path / f"out{seed}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            h = FileHash(path, algo)
            shuffled = pieces(40, seed)
            random.Random(seed).shuffle(shuffled)
            for offset, data in shuffled:
                os.pwrite(fd, data, offset)
                h.written(offset, len(data))
            assert h.hexdigest(len(DATA)) == WANT[algo]
            assert h.hexdigest(len(DATA)) == WANT[algo]  # asked again (journal and manifest)
        finally:
            os.close(fd)
        assert hash_file(path, algo) == WANT[algo]


def test_the_digest_is_of_the_bytes_in_the_output(tmp_path: Path, small_chunks: None) -> None:
    """What the hash reads is the output file itself: bytes changed there before the hash
    reached them are what it hashes (the manifest describes the file, not a separate read
    of the input)."""
    path = tmp_path / "out"
    path.write_bytes(DATA)
    h = FileHash(path)
    h.written(10, len(DATA) - 10)
    with path.open("r+b") as f:
        f.seek(20)
        f.write(b"\0" * 10)
    h.written(0, 10)
    changed = DATA[:20] + b"\0" * 10 + DATA[30:]
    assert h.hexdigest(len(DATA)) == blake3.blake3(changed).hexdigest()


def test_an_incomplete_or_overlapping_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "out"
    path.write_bytes(DATA)
    h = FileHash(path)
    (a, first), (b, second), *_ = pieces(4)
    h.written(b, len(second))
    with pytest.raises(MergeError, match="out of order"):
        h.hexdigest(len(DATA))
    with pytest.raises(MergeError, match="written twice"):
        h.written(b, len(second))
    h.written(a, len(first))
    with pytest.raises(MergeError, match="written twice"):
        h.written(a, len(first))
    with pytest.raises(MergeError, match=f"{len(first) + len(second)} of {len(DATA)} bytes"):
        h.hexdigest(len(DATA))
    h.close()


def test_the_hash_follows_the_writes_in_the_background(tmp_path: Path, small_chunks: None) -> None:
    """Once `CHUNK` contiguous bytes are written the hash catches up on its own thread;
    `wait_hashed` returns once the bytes before it are hashed (a staging file may then drop
    them)."""
    path = tmp_path / "out"
    path.write_bytes(DATA)
    h = FileHash(path)
    h.written(0, 30000)
    h.wait_hashed(30000)
    assert h.hashed == 30000
    with pytest.raises(MergeError, match="internal error: 40000 bytes to hash, 30000 written"):
        h.wait_hashed(40000)
    h.written(30000, len(DATA) - 30000)
    assert h.hexdigest(len(DATA)) == WANT["blake3"]


def test_a_read_error_is_raised_to_whoever_asks_for_the_digest(tmp_path: Path) -> None:
    path = tmp_path / "out"
    path.write_bytes(DATA[:100])  # shorter than what is said to be written: no mapping
    h = FileHash(path)
    h.written(0, len(DATA))
    with pytest.raises(MergeError, match="could not be hashed"):
        h.hexdigest(len(DATA))


def test_hashing_registers_a_descriptor_for_the_block_only(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        h = FileHash(path)
        with hashing(fd, h):
            assert hash_of(fd) is h
            with pytest.raises(MergeError, match="hashed twice"), hashing(fd, FileHash(path)):
                pass
        assert hash_of(fd) is None
        with hashing(fd, None):
            assert hash_of(fd) is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("algo", ["blake3", "sha256"])
def test_absorb_hashes_from_memory_only_what_comes_next(
    tmp_path: Path, algo: str, small_chunks: None
) -> None:
    """`absorb` takes bytes from memory when every byte before them is written (those not
    hashed yet read back first, in order); out of order it does nothing and says so, and the
    writer's `written` covers them; pieces told ahead join once the gap is absorbed."""
    path = tmp_path / "out"
    path.write_bytes(DATA)  # what the writers wrote (read back where they tell `written`)
    h = FileHash(path, algo)
    parts = pieces(12, seed=7)
    h.written(parts[0][0], len(parts[0][1]))  # written: read back
    h.written(parts[3][0], len(parts[3][1]))  # ahead of the frontier
    assert not h.absorb(parts[2][0], memoryview(parts[2][1]))  # not next: nothing done
    assert h.absorb(parts[1][0], memoryview(parts[1][1]))
    assert h.frontier == parts[2][0]
    h.written(parts[2][0], len(parts[2][1]))
    for offset, data in parts[4:]:
        assert h.absorb(offset, memoryview(data))
    assert h.hexdigest(len(DATA)) == WANT[algo]
