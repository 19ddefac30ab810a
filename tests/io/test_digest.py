"""`FileHash`: the SHA-256 of a file from its pieces in any order, never read back."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import threading
from pathlib import Path

import pytest

from shardforge.errors import MergeError
from shardforge.io.digest import FileHash, hash_of, hashing

DATA = os.urandom(1 << 16)


def pieces(n: int, seed: int = 0) -> list[tuple[int, bytes]]:
    """`DATA` cut into `n` pieces of random sizes, each (offset, bytes)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(DATA)), n - 1))
    bounds = [0, *cuts, len(DATA)]
    return [(a, DATA[a:b]) for a, b in itertools.pairwise(bounds)]


def test_pieces_in_any_order_give_hashlibs_digest() -> None:
    for seed in range(5):
        h = FileHash()
        shuffled = pieces(40, seed)
        random.Random(seed).shuffle(shuffled)
        for offset, data in shuffled:
            h.feed(offset, data)
        assert h.hexdigest(len(DATA)) == hashlib.sha256(DATA).hexdigest()


def test_an_incomplete_or_overlapping_file_is_refused() -> None:
    h = FileHash()
    (a, first), (b, second), *_ = pieces(4)
    h.feed(b, second)
    with pytest.raises(MergeError, match="out of order"):
        h.hexdigest(len(DATA))
    with pytest.raises(MergeError, match="written twice"):
        h.feed(b, second)
    h.feed(a, first)
    with pytest.raises(MergeError, match="written twice"):
        h.feed(a, first)
    with pytest.raises(MergeError, match=f"{len(first) + len(second)} of {len(DATA)} bytes"):
        h.hexdigest(len(DATA))


def test_threads_hand_their_blocks_over_in_turn() -> None:
    """Eight threads, each with one block, started in reverse: each waits for its turn."""
    h = FileHash()
    blocks = pieces(8, seed=3)
    threads = [threading.Thread(target=h.feed_in_turn, args=p) for p in reversed(blocks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert h.hexdigest(len(DATA)) == hashlib.sha256(DATA).hexdigest()


def test_abort_releases_every_waiting_thread() -> None:
    h = FileHash()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            h.feed_in_turn(100, b"x")
        except MergeError as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    h.abort("a copy failed")
    t.join(timeout=10)
    assert not t.is_alive()
    assert [str(e) for e in errors] == ["the output's hash was abandoned: a copy failed"]
    with pytest.raises(MergeError, match="abandoned"):
        h.feed(0, b"y")


def test_deferred_bytes_are_read_from_their_source_in_turn(tmp_path: Path) -> None:
    """Bytes copied in the kernel after a gap: hashed from the source once the gap is filled."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"\0" * 100 + DATA[3000:])
    h = FileHash()
    h.feed(0, DATA[:1000])
    h.defer(3000, src, 100, len(DATA) - 3000)
    assert h.frontier == 1000  # the gap [1000, 3000) is not written yet
    h.feed(1000, DATA[1000:3000])
    assert h.frontier == len(DATA)
    assert h.hexdigest(len(DATA)) == hashlib.sha256(DATA).hexdigest()


def test_written_bytes_out_of_turn_are_read_back_from_the_output(tmp_path: Path) -> None:
    """`feed_written`: a piece in turn is hashed from memory; one out of turn is kept as its
    place in the output only, and read back from the output file when the hash reaches it."""
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        h = FileHash()
        shuffled = pieces(30, seed=7)
        random.Random(7).shuffle(shuffled)
        for offset, data in shuffled:
            os.pwrite(fd, data, offset)
            h.feed_written(fd, offset, data)
            assert not any(isinstance(p, bytes) for p in h._pending.values())
        assert h.hexdigest(len(DATA)) == hashlib.sha256(DATA).hexdigest()
        # what is hashed out of turn is the output's bytes when the hash reaches them
        h = FileHash()
        h.feed_written(fd, 10, DATA[10:])
        os.pwrite(fd, b"\0" * 10, 20)
        h.feed_written(fd, 0, DATA[:10])
        changed = DATA[:20] + b"\0" * 10 + DATA[30:]
        assert h.hexdigest(len(DATA)) == hashlib.sha256(changed).hexdigest()
    finally:
        os.close(fd)


def test_hashing_registers_a_descriptor_for_the_block_only(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        h = FileHash()
        with hashing(fd, h):
            assert hash_of(fd) is h
            with pytest.raises(MergeError, match="hashed twice"), hashing(fd, FileHash()):
                pass
        assert hash_of(fd) is None
        with hashing(fd, None):
            assert hash_of(fd) is None
    finally:
        os.close(fd)
