"""The placement arithmetic (`formats.rankfiles.mesh`) against torch's own: for every shape,
mesh (1-D to 3-D) and placement mix tried, each coordinate's indices are exactly those torch's
placements cut (``_split_tensor``, what ``distribute_tensor`` uses) and the shape and first
offset ``compute_local_shape_and_global_offset`` gives; uneven strided shards, ``Partial`` and
shard orders other than left to right are refused."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardforge.formats.rankfiles import Placement
from shardforge.formats.rankfiles.mesh import (
    Unmodelled,
    blocks,
    check_modelled,
    check_tiling,
    chunk_span,
    local_runs,
    take,
)


def _ours(p: object) -> Placement:
    if isinstance(p, _StridedShard):
        return Placement("strided", p.dim, p.split_factor)
    if isinstance(p, Shard):
        return Placement("shard", p.dim)
    return Placement("replicate")


def _torch_indices(
    shape: tuple[int, ...], placements: tuple, mesh: tuple[int, ...], coord: tuple[int, ...]
) -> list[list[int]]:
    """Per dimension, the indices torch's placement code gives `coord` (left to right)."""
    index = [torch.arange(n) for n in shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            d = p.dim
            parts, _ = p._split_tensor(
                index[d].view([1] * d + [-1]), mesh[mesh_dim], with_padding=False, contiguous=False
            )
            index[d] = parts[coord[mesh_dim]].reshape(-1)
    return [ix.tolist() for ix in index]


def _expand(runs: tuple[tuple[int, int], ...]) -> list[int]:
    return [i for first, n in runs for i in range(first, first + n)]


def _cases() -> list[tuple[tuple[int, ...], tuple, tuple[int, ...]]]:
    rng = random.Random(7)
    out = []
    for mesh in [(4,), (3,), (2, 2), (2, 3), (3, 2), (2, 2, 2), (1, 4)]:
        for _ in range(30):
            shape = tuple(rng.choice([0, 1, 5, 7, 8, 12, 24]) for _ in range(rng.choice([1, 2, 3])))
            placements = []
            for m in range(len(mesh)):
                d = rng.randrange(len(shape))
                kind = rng.choice(["shard", "shard", "replicate", "strided"])
                later = [mesh[k] for k in range(m + 1, len(mesh))]
                if kind == "strided" and later:
                    placements.append(_StridedShard(d, split_factor=later[0]))
                elif kind == "replicate":
                    placements.append(Replicate())
                else:
                    placements.append(Shard(d))
            out.append((shape, tuple(placements), mesh))
    # FSDP2 + TP: (_StridedShard(0, sf=tp), Shard(0)) over (dp, tp), and the others it writes
    out += [
        ((64, 48), (_StridedShard(0, split_factor=2), Shard(0)), (2, 2)),
        ((96, 8), (_StridedShard(0, split_factor=3), Shard(0)), (2, 3)),
        ((64, 64), (Shard(0), Shard(1)), (2, 2)),
        ((331, 64), (Replicate(), Shard(0)), (2, 2)),
        ((10, 6), (Shard(0), Replicate()), (2, 2)),
        ((8, 8), (Shard(0), Shard(0)), (2, 2)),
    ]
    return out


def _even(shape: tuple[int, ...], placements: tuple, mesh: tuple[int, ...]) -> bool:
    """Whether every strided placement divides what it cuts evenly (else it is refused)."""
    for coord in itertools.product(*(range(n) for n in mesh)):
        lengths = list(shape)
        for m, p in enumerate(placements):
            if isinstance(p, _StridedShard):
                if lengths[p.dim] % (p.split_factor * mesh[m]):
                    return False
                lengths[p.dim] //= mesh[m]
            elif isinstance(p, Shard):
                lengths[p.dim] = chunk_span(lengths[p.dim], mesh[m], coord[m])[1]
    return True


def test_local_runs_are_torchs_placement() -> None:
    compared = refused = 0
    for shape, placements, mesh in _cases():
        ours = tuple(_ours(p) for p in placements)
        if not _even(shape, placements, mesh):
            with pytest.raises(Unmodelled, match="uneven"):
                for coord in itertools.product(*(range(n) for n in mesh)):
                    local_runs(shape, ours, mesh, coord)
            refused += 1
            continue
        check_tiling(shape, ours, mesh)
        for coord in itertools.product(*(range(n) for n in mesh)):
            runs = local_runs(shape, ours, mesh, coord)
            got = [_expand(r) for r in runs]
            assert got == _torch_indices(shape, placements, mesh, coord), (shape, placements)
            size, offset = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
            assert tuple(len(g) for g in got) == tuple(size)
            assert all(g[0] == o for g, o in zip(got, offset, strict=True) if g)
            compared += 1
    assert compared > 500 and refused > 3


def test_fsdp_tp_pieces_are_whole_rows() -> None:
    """FSDP2 over TP's dim-0 shards: every rank holds one run of whole rows."""
    placements = (Placement("strided", 0, 2), Placement("shard", 0))
    starts = {
        c: local_runs((64, 48), placements, (2, 2), c) for c in itertools.product((0, 1), (0, 1))
    }
    assert starts[(0, 1)] == (((32, 16),), ((0, 48),))
    assert starts[(1, 0)] == (((16, 16),), ((0, 48),))
    # a strided shard alone holds several runs: boxes place each
    runs = local_runs((8, 3), (Placement("strided", 0, 2),), (2,), (1,))
    assert runs == (((2, 2), (6, 2)), ((0, 3),))
    assert blocks(runs) == [((2, 0), (0, 0), (2, 3)), ((6, 0), (2, 0), (2, 3))]


def test_take_and_chunk_span() -> None:
    assert take(((0, 4), (10, 4)), 2, 4) == ((2, 2), (10, 2))
    assert take(((0, 4), (4, 4)), 2, 4) == ((2, 4),)  # adjacent runs merge
    assert [chunk_span(10, 4, c) for c in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert chunk_span(2, 3, 2) == (2, 0)


def test_unmodelled_layouts_are_refused() -> None:
    partial = Placement("unmodelled", label="Partial(sum)")
    with pytest.raises(Unmodelled, match=r"Partial\(sum\)"):
        check_modelled((4,), (Placement("shard", 0), partial), None)
    with pytest.raises(Unmodelled, match="on a 1-D tensor"):
        check_modelled((4,), (Placement("shard", 1),), None)
    with pytest.raises(Unmodelled, match=r"shard order \[1, 0\]"):
        check_modelled((4,), (Placement("shard", 0), Placement("shard", 0)), ((0, (1, 0)),))
    check_modelled((4,), (Placement("shard", 0), Placement("shard", 0)), ((0, (0, 1)),))
