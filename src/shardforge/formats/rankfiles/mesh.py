"""Where each rank's local tensor lies in the full tensor, as torch's DTensor places it.

For every tensor dimension, a rank's local tensor holds some global indices, in order; they are
kept as runs ``(first global index, count)``. The placements are applied left to right over
the mesh dimensions, each on the indices the earlier ones left (torch's
``compute_local_shape_and_global_offset``):

* ``Shard(d)`` over a mesh dimension of size n: coordinate c keeps the c-th ``torch.chunk``
  piece (``ceil(len / n)`` indices each, the last ones shorter or empty);
* ``_StridedShard(d, sf)`` (FSDP2 over a tensor-parallel dimension: the later mesh dimensions
  sharded d first): the indices are cut into ``sf`` equal parts, each part into n equal
  pieces, and coordinate c keeps the c-th piece of every part, in order. Only the even case is
  modelled (``len`` divisible by ``sf * n``): there torch's placement and the order FSDP2
  really sharded in provably agree; an uneven one is refused;
* ``Replicate()`` keeps every index (the ranks along that mesh dimension hold copies).

Anything else (``Partial``, a shard order other than left to right) is refused naming the
tensor and the placement, never guessed. `check_tiling` proves, per tensor dimension, that
the pieces of all mesh coordinates cover every index exactly once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from shardforge.formats.rankfiles.pickles import REPLICATE, SHARD, STRIDED, Placement

Run = tuple[int, int]  # (first global index, count)
Runs = tuple[Run, ...]


class Unmodelled(Exception):
    """A layout the planner does not model (the caller names the tensor)."""


def chunk_span(length: int, n: int, c: int) -> tuple[int, int]:
    """(start, count) of piece `c` of `length` indices cut as ``torch.chunk(.., n)`` does."""
    size = -(-length // n) if n else 0
    start = min(c * size, length)
    return start, min(length, start + size) - start


def take(runs: Runs, start: int, count: int) -> Runs:
    """Indices [start, start + count) of the concatenation of `runs`, as runs."""
    out: list[Run] = []
    for first, n in runs:
        if count <= 0:
            break
        if start >= n:
            start -= n
            continue
        k = min(n - start, count)
        if out and out[-1][0] + out[-1][1] == first + start:
            out[-1] = (out[-1][0], out[-1][1] + k)
        else:
            out.append((first + start, k))
        count -= k
        start = 0
    return tuple(out)


def _join(parts: Sequence[Runs]) -> Runs:
    out: list[Run] = []
    for first, n in itertools.chain.from_iterable(parts):
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((first, n))
    return tuple(out)


def length(runs: Runs) -> int:
    return sum(n for _, n in runs)


def shard(runs: Runs, p: Placement, n: int, c: int) -> Runs:
    """The indices coordinate `c` keeps of `runs` under `p` over a mesh dimension of size n."""
    total = length(runs)
    if p.kind == SHARD:
        return take(runs, *chunk_span(total, n, c))
    if total % (p.split_factor * n):
        raise Unmodelled(
            f"{p} over {n} ranks of a dimension of {total} is uneven; where each rank's "
            "indices belong cannot be proven"
        )
    part, piece = total // p.split_factor, total // (p.split_factor * n)
    return _join([take(runs, j * part + c * piece, piece) for j in range(p.split_factor)])


def check_modelled(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] | None,
) -> None:
    """Unmodelled for a placement or shard order the planner does not model."""
    for p in placements:
        if p.kind not in (SHARD, STRIDED, REPLICATE):
            raise Unmodelled(f"placement {p} (a pending reduction) is not modelled")
        if p.shards and not (p.dim is not None and 0 <= p.dim < len(shape)):
            raise Unmodelled(f"placement {p} on a {len(shape)}-D tensor")
    for dim, mesh_dims in shard_order or ():
        if list(mesh_dims) != sorted(set(mesh_dims)):
            raise Unmodelled(
                f"shard order {list(mesh_dims)} of dim {dim} (not left to right) is not modelled"
            )


def local_runs(
    shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coordinate: tuple[int, ...],
) -> tuple[Runs, ...]:
    """Per tensor dimension, the global indices the local tensor at `coordinate` holds."""
    runs: list[Runs] = [((0, size),) if size else () for size in shape]
    for mesh_dim, p in enumerate(placements):
        if p.shards:
            assert p.dim is not None
            runs[p.dim] = shard(runs[p.dim], p, mesh_shape[mesh_dim], coordinate[mesh_dim])
    return tuple(runs)


def check_tiling(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...]
) -> None:
    """Unmodelled unless, for every tensor dimension, the indices of all coordinates of the
    mesh dimensions sharding it cover that dimension exactly once (then the pieces of all
    ranks tile the tensor: each dimension is cut independently of the others)."""
    for dim, size in enumerate(shape):
        mesh_dims = [m for m, p in enumerate(placements) if p.shards and p.dim == dim]
        if not mesh_dims:
            continue
        seen: list[Run] = []
        for coords in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims)):
            runs: Runs = ((0, size),) if size else ()
            for m, c in zip(mesh_dims, coords, strict=True):
                runs = shard(runs, placements[m], mesh_shape[m], c)
            seen.extend(runs)
        seen.sort()
        end = 0
        for first, n in seen:
            if first != end:
                raise Unmodelled(f"the placements do not tile dim {dim} of {list(shape)}")
            end = first + n
        if end != size:
            raise Unmodelled(f"the placements do not tile dim {dim} of {list(shape)}")


def blocks(
    runs: tuple[Runs, ...],
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The local tensor as boxes: (global offsets, local offsets, sizes), one per combination
    of one run in every dimension (a single box for an ordinary shard)."""
    per_dim = []
    for dim_runs in runs:
        local, items = 0, []
        for first, n in dim_runs:
            items.append((first, local, n))
            local += n
        per_dim.append(items)
    out = []
    for combo in itertools.product(*per_dim):
        out.append(
            (
                tuple(g for g, _, _ in combo),
                tuple(lo for _, lo, _ in combo),
                tuple(n for _, _, n in combo),
            )
        )
    return [b for b in out if math.prod(b[2])] if runs else out
