"""The pickle of a per-rank DTensor state dict (verl, LMMs-Engine): its allow-list profile.

`RANK_STATE_DICT` is the profile of a rank file's ``data.pkl`` for the allow-list unpickler
(`shardforge.io.unpickler`); `load_rank_pickle` gives plain per-key records: a `LocalTensor`
for a plain tensor, a `DTensorRecord` (global shape, placements, mesh, this rank's coordinate,
its local tensor) for a DTensor. Placements are read as plain `Placement`s: ``Shard(d)``,
``_StridedShard(d, split_factor)`` (FSDP2 over a tensor-parallel dimension), ``Replicate()``,
and the ones the merge does not model (``Partial``: a pending reduction) kept by name so that
the planner can refuse them naming the tensor. Old module paths (torch < 2.5 kept DTensor under
``torch.distributed._tensor``) map onto the same records; as torch 2.13 writes it (checked with
``pickletools.dis``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from shardforge.errors import CheckpointError
from shardforge.formats.torchsave import TENSOR_GLOBALS, LocalTensor, storage_ref
from shardforge.io.dtypes import is_dtype
from shardforge.io.unpickler import (
    Problem,
    Profile,
    Record,
    ints,
    record_class,
    sanitize,
    torch_size,
    unpickle,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "RANK_STATE_DICT",
    "DTensorRecord",
    "LocalTensor",
    "Placement",
    "load_rank_pickle",
]

RANK_STATE_DICT_MAX_BYTES = 256 << 20  # a rank file's state dict: ~400 bytes per tensor


# the kinds of `Placement` the planner models; any other is refused naming the tensor
SHARD, STRIDED, REPLICATE = "shard", "strided", "replicate"


@dataclass(frozen=True)
class Placement:
    """How a DTensor is laid out along one mesh dimension, as torch prints it: ``Shard(d)``,
    ``_StridedShard(dim=d, sf=k)``, ``Replicate()``, or a placement the merge does not model
    (kind "unmodelled", `label` says which: ``Partial(sum)``)."""

    kind: str  # SHARD | STRIDED | REPLICATE | "unmodelled"
    dim: int | None = None
    split_factor: int = 1  # _StridedShard: the shards made along `dim` before this one
    label: str = ""  # an unmodelled placement's name

    @property
    def shards(self) -> bool:
        return self.kind in (SHARD, STRIDED)

    def __str__(self) -> str:
        if self.kind == SHARD:
            return f"Shard({self.dim})"
        if self.kind == STRIDED:
            return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"
        return "Replicate()" if self.kind == REPLICATE else self.label


@dataclass(frozen=True)
class DTensorRecord:
    """A DTensor as saved by one rank: global metadata plus its local tensor."""

    dtype: torch.dtype
    global_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh_shape: tuple[int, ...] | None
    coordinate: tuple[int, ...] | None
    local: LocalTensor
    # the order mesh dims shard each tensor dim, when the spec names one: ((tensor dim,
    # (mesh dims...)), ...); None: left to right (what every placement above assumes)
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    mesh_rank: int | None = None  # the global rank that saved it, as its mesh recorded


# DTensorSpec, DeviceMesh, _MeshLayout / _FlatLayout, Shard, _StridedShard, Replicate as records
_Spec, _Mesh, _Layout, _Shard, _Strided, _Replicate = (
    record_class(name, __name__)
    for name in ("_Spec", "_Mesh", "_Layout", "_Shard", "_Strided", "_Replicate")
)

# placements torch may save that the merge does not model (a pending reduction: the saved
# values are not the tensor's) -> the modules torch keeps them in; read as records keeping their
# name, refused by the planner naming the tensor
_DT_MODULES = (
    "torch.distributed.tensor.placement_types",
    "torch.distributed._tensor.placement_types",
)
UNMODELLED_PLACEMENTS: dict[str, tuple[str, ...]] = {
    "Partial": _DT_MODULES,
    "_MaskPartial": (*_DT_MODULES, "torch.distributed.tensor._ops._embedding_ops"),
    "MaskPartial": _DT_MODULES,
    "_NormPartial": ("torch.distributed.tensor._ops._math_ops",),
}
_UNMODELLED = {name: record_class(name, __name__) for name in UNMODELLED_PLACEMENTS}


class _TensorMeta(NamedTuple):
    shape: Any
    stride: Any
    dtype: Any


class _ShardOrderEntry(NamedTuple):
    tensor_dim: Any
    mesh_dims: Any


class _DTensorClass:
    """Stands for ``torch.distributed.tensor.DTensor`` inside the pickle."""


_DTENSOR = _DTensorClass()


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


def _rebuild_wrapper_subclass(*_: Any) -> Any:
    raise Problem("has a tensor subclass record outside _rebuild_from_type_v2")


def _torch_device(*args: Any) -> str:
    if not all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args):
        raise Problem("has a malformed torch.device")
    return ":".join(str(a) for a in args)


def _get_layout(name: Any) -> str:
    if name != "torch.strided":
        raise Problem(
            f"has tensor layout {sanitize(name)!r}, which is not supported (only strided)"
        )
    return "torch.strided"


def _flat_prod(shape: Any) -> int:
    """The size of a (possibly nested) shape; nesting is bounded by `MAX_NESTING`."""
    if type(shape) is int:
        return shape
    if not isinstance(shape, tuple):
        raise Problem("has a malformed mesh layout")
    return math.prod(_flat_prod(s) for s in shape)


def _placement(p: Any) -> Placement:
    if isinstance(p, (_Shard, _Strided)):
        dim = p.get("dim")
        if type(dim) is not int:
            raise Problem("has a Shard placement without a dimension")
        if isinstance(p, _Shard):
            return Placement(SHARD, dim)
        factor = p.get("split_factor")
        if type(factor) is not int or factor < 1:
            raise Problem("has a _StridedShard placement without a split factor")
        return Placement(STRIDED, dim, factor)
    if isinstance(p, _Replicate):
        return Placement(REPLICATE)
    name = type(p).__name__
    if _UNMODELLED.get(name) is type(p):
        op = p.get("reduce_op", p.get("norm_type", ""))
        shown = sanitize(op) if isinstance(op, (str, int, float)) else ""
        return Placement("unmodelled", label=f"{name}({shown})")
    raise Problem(f"has an unexpected placement {sanitize(p)}")


def _shard_order(spec: Record) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """The spec's `shard_order` (torch >= 2.10), None when it names none."""
    order = spec.get("shard_order")
    if order is None:
        return None
    if not isinstance(order, tuple) or not all(isinstance(e, _ShardOrderEntry) for e in order):
        raise Problem("has a DTensor spec with a malformed shard order")
    return tuple(
        (ints((e.tensor_dim,), "shard order")[0], ints(e.mesh_dims, "shard order")) for e in order
    )


def _mesh_shape(mesh: Record) -> tuple[int, ...] | None:
    layout = mesh.get("_layout")
    if isinstance(layout, _Layout):  # torch >= 2.9: _MeshLayout(axes=(_FlatLayout, ...))
        axes = layout.get("axes")
        if isinstance(axes, tuple) and all(isinstance(a, _Layout) for a in axes):
            return tuple(_flat_prod(a.get("shape", ())) for a in axes)
    old = mesh.get("mesh")  # older torch: the mesh tensor itself
    if isinstance(old, LocalTensor):
        return old.size
    return None


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> DTensorRecord:
    if func is not _rebuild_wrapper_subclass or new_type is not _DTENSOR:
        raise Problem("has a tensor subclass other than DTensor")
    if not isinstance(args, tuple) or len(args) < 3:
        raise Problem("has a DTensor record with unexpected arguments")
    dtype, size = args[1], args[2]
    if not is_dtype(dtype):
        raise Problem("has a DTensor record without a dtype")
    attrs: dict[str, Any] = {}
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict):
            attrs.update(part)
    local, spec = attrs.get("_local_tensor"), attrs.get("_spec")
    if not isinstance(local, LocalTensor) or not isinstance(spec, _Spec):
        raise Problem("has a DTensor record without its local tensor or spec")
    mesh = spec.get("mesh")
    if not isinstance(mesh, _Mesh):
        raise Problem("has a DTensor spec without a device mesh")
    placements = spec.get("placements")
    if not isinstance(placements, tuple):
        raise Problem("has a DTensor spec without placements")
    coordinate = mesh.get("_coordinate_on_dim")
    rank = mesh.get("_rank")
    return DTensorRecord(
        dtype=dtype,
        global_shape=ints(size, "DTensor size"),
        placements=tuple(_placement(p) for p in placements),
        mesh_shape=_mesh_shape(mesh),
        coordinate=None if coordinate is None else ints(coordinate, "mesh coordinate"),
        local=local,
        shard_order=_shard_order(spec),
        mesh_rank=rank if type(rank) is int else None,
    )


_DT = "torch.distributed.tensor"
_SPEC_MODULES = (f"{_DT}._dtensor_spec", "torch.distributed._tensor.placement_types")
_PLACEMENT_MODULES = (f"{_DT}.placement_types", "torch.distributed._tensor.placement_types")

# modules whose classes mean a known, legitimate layout this reader does not merge
UNSUPPORTED_MODULES: dict[str, str] = {
    "torch.distributed._shard": (
        "an FSDP1 ShardedTensor state dict (FSDP1 without a device mesh); save with FSDP2 or "
        "with a device mesh (DTensor) instead"
    ),
}


def _unsupported_rank_global(module: str, name: str) -> Any:
    """Known layouts of other kinds are refused naming them; anything else is left to the
    allow-list's refusal."""
    shown = f"{sanitize(module)}.{sanitize(name)}"
    for prefix, what in UNSUPPORTED_MODULES.items():
        if module == prefix or module.startswith(prefix + "."):
            raise Problem(f"holds {what} ({shown}); shardforge cannot merge it")
    return None


RANK_STATE_DICT = Profile(
    what="per-rank DTensor state dicts",
    globals={
        **TENSOR_GLOBALS,
        ("torch", "Size"): torch_size,
        ("torch", "device"): _torch_device,
        ("torch.serialization", "_get_layout"): _get_layout,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
        (_DT, "DTensor"): _DTENSOR,
        (f"{_DT}._api", "DTensor"): _DTENSOR,
        ("torch.distributed._tensor.api", "DTensor"): _DTENSOR,
        **{(m, "DTensorSpec"): _Spec for m in _SPEC_MODULES},
        **{(m, "TensorMeta"): _TensorMeta for m in _SPEC_MODULES},
        (f"{_DT}._dtensor_spec", "ShardOrderEntry"): _ShardOrderEntry,
        **{(m, "Shard"): _Shard for m in _PLACEMENT_MODULES},
        **{(m, "_StridedShard"): _Strided for m in _PLACEMENT_MODULES},
        **{(m, n): _UNMODELLED[n] for n, ms in UNMODELLED_PLACEMENTS.items() for m in ms},
        **{(m, "Replicate"): _Replicate for m in _PLACEMENT_MODULES},
        ("torch.distributed.device_mesh", "DeviceMesh"): _Mesh,
        ("torch.distributed._mesh_layout", "_MeshLayout"): _Layout,
        ("torch.distributed._mesh_layout", "_FlatLayout"): _Layout,
    },
    max_bytes=RANK_STATE_DICT_MAX_BYTES,
    max_memo=1 << 24,
    persistent=storage_ref,
    other_global=_unsupported_rank_global,
)


def load_rank_pickle(data: bytes, source: str) -> dict[str, LocalTensor | DTensorRecord]:
    """Parse a rank file's data.pkl into key -> record (plain tensors or DTensors)."""
    obj = unpickle(data, source, RANK_STATE_DICT)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: holds a {sanitize(obj)}, not a state dict")
    out: dict[str, LocalTensor | DTensorRecord] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: a state dict key is a {sanitize(key)}, not a string")
        if not isinstance(value, (LocalTensor, DTensorRecord)):
            raise CheckpointError(
                f"{source}: entry {sanitize(key)!r} holds {sanitize(value)}, not a tensor"
            )
        out[key] = value
    return out
