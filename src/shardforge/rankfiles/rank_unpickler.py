"""Allow-list unpickler for the ``data.pkl`` of a per-rank DTensor state dict (``torch.save``).

A rank file's pickle references, as torch 2.13 writes it (checked with ``pickletools.dis``):
``collections.OrderedDict``; ``torch._tensor._rebuild_from_type_v2`` with
``torch._utils._rebuild_wrapper_subclass`` and ``torch.distributed.tensor.DTensor``;
``torch._utils._rebuild_tensor_v2`` with typed storages (``torch.FloatStorage``, ...) as
persistent ids; ``torch.distributed.tensor._dtensor_spec.{DTensorSpec, TensorMeta,
ShardOrderEntry}``; ``torch.distributed.tensor.placement_types.{Shard, Replicate}``;
``torch.distributed.device_mesh.DeviceMesh`` with ``torch.distributed._mesh_layout.
{_MeshLayout, _FlatLayout}``; ``torch.Size``, ``torch.device``, torch dtypes and
``torch.serialization._get_layout``.

Every allowed global resolves to a plain record class or function defined *here*: no torch
constructor, rebuild function or ``__setstate__`` of torch's runs, and no storage is loaded.
Anything else is refused with a CheckpointError naming the file and the global.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import torch

from shardforge.checkpoint.safe_pickle import STORAGE_DTYPES
from shardforge.errors import CheckpointError

_DTYPES: dict[str, torch.dtype] = {
    name: value
    for name in dir(torch)
    if isinstance(value := getattr(torch, name, None), torch.dtype)
}

_STORAGE_KEY = re.compile(r"^[A-Za-z0-9_]{1,64}$")


@dataclass(frozen=True)
class StorageRef:
    """A persistent reference to one storage record (``data/<key>`` in the zip)."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class LocalTensor:
    """A plain tensor's description: which storage, and the view into it."""

    storage: StorageRef
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """How a DTensor is laid out along one mesh dimension: Shard(dim) or Replicate()."""

    kind: str  # "shard" | "replicate"
    dim: int | None = None

    def __str__(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else "Replicate()"


@dataclass(frozen=True)
class DTensorRecord:
    """A DTensor as saved by one rank: global metadata plus its local tensor."""

    dtype: torch.dtype
    global_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    mesh_shape: tuple[int, ...] | None
    coordinate: tuple[int, ...] | None
    local: LocalTensor


class _Stateful:
    """Record for an object pickled as NEWOBJ + BUILD(state): keeps the state as a dict."""

    state: Mapping[str, Any] = MappingProxyType({})  # until BUILD sets it

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            merged: dict[str, Any] = {}
            for part in state:
                if isinstance(part, dict):
                    merged.update(part)
            state = merged
        if not isinstance(state, dict):
            raise CheckpointError(f"unexpected pickled state of type {type(state).__name__}")
        self.state = state


class _Spec(_Stateful):
    pass


class _Mesh(_Stateful):
    pass


class _Layout(_Stateful):
    pass


class _Shard(_Stateful):
    pass


class _Replicate(_Stateful):
    pass


class _TensorMeta(NamedTuple):
    shape: Any
    stride: Any
    dtype: Any


class _ShardOrderEntry(NamedTuple):
    tensor_dim: Any
    mesh_dims: Any


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


class _DTensorClass:
    """Stands for ``torch.distributed.tensor.DTensor`` inside the pickle."""


_DTENSOR = _DTensorClass()


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise CheckpointError(f"{what} is not a tuple of integers")
    return tuple(int(v) for v in value)


def _rebuild_tensor(
    storage: Any, storage_offset: Any, size: Any, stride: Any, *_rest: Any
) -> LocalTensor:
    if not isinstance(storage, StorageRef):
        raise CheckpointError("a tensor record does not reference a storage")
    if not isinstance(storage_offset, int):
        raise CheckpointError("a tensor record has a non-integer storage offset")
    return LocalTensor(storage, int(storage_offset), _ints(size, "size"), _ints(stride, "stride"))


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


def _rebuild_wrapper_subclass(*args: Any) -> Any:
    raise CheckpointError("a tensor subclass record outside _rebuild_from_type_v2")


def _torch_size(value: Any = ()) -> tuple[int, ...]:
    return _ints(value, "torch.Size")


def _torch_device(*args: Any) -> str:
    return ":".join(str(a) for a in args)


def _get_layout(name: Any) -> str:
    if name != "torch.strided":
        raise CheckpointError(f"tensor layout {name!r} is not supported (only torch.strided)")
    return str(name)


def _flat_prod(shape: Any) -> int:
    if isinstance(shape, int):
        return shape
    return math.prod(_flat_prod(s) for s in shape)


def _placement(p: Any) -> Placement:
    if isinstance(p, _Shard):
        dim = p.state.get("dim")
        if not isinstance(dim, int):
            raise CheckpointError("a Shard placement without a dimension")
        return Placement("shard", dim)
    if isinstance(p, _Replicate):
        return Placement("replicate")
    raise CheckpointError(f"unexpected placement {type(p).__name__}")


def _mesh_shape(mesh: _Mesh) -> tuple[int, ...] | None:
    layout = mesh.state.get("_layout")
    if isinstance(layout, _Layout):  # torch >= 2.9: _MeshLayout(axes=(_FlatLayout, ...))
        axes = layout.state.get("axes")
        if isinstance(axes, tuple) and all(isinstance(a, _Layout) for a in axes):
            return tuple(_flat_prod(a.state.get("shape", ())) for a in axes)
    old = mesh.state.get("mesh")  # older torch: the mesh tensor itself
    if isinstance(old, LocalTensor):
        return old.size
    return None


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> DTensorRecord:
    if func is not _rebuild_wrapper_subclass or new_type is not _DTENSOR:
        raise CheckpointError("a tensor subclass other than DTensor")
    if not isinstance(args, tuple) or len(args) < 3:
        raise CheckpointError("a DTensor record with unexpected arguments")
    dtype, size = args[1], args[2]
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError("a DTensor record without a dtype")
    attrs: dict[str, Any] = {}
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, dict):
            attrs.update(part)
    local, spec = attrs.get("_local_tensor"), attrs.get("_spec")
    if not isinstance(local, LocalTensor) or not isinstance(spec, _Spec):
        raise CheckpointError("a DTensor record without its local tensor or spec")
    mesh = spec.state.get("mesh")
    if not isinstance(mesh, _Mesh):
        raise CheckpointError("a DTensor spec without a device mesh")
    placements = spec.state.get("placements")
    if not isinstance(placements, tuple):
        raise CheckpointError("a DTensor spec without placements")
    coordinate = mesh.state.get("_coordinate_on_dim")
    return DTensorRecord(
        dtype=dtype,
        global_shape=_ints(size, "DTensor size"),
        placements=tuple(_placement(p) for p in placements),
        mesh_shape=_mesh_shape(mesh),
        coordinate=None if coordinate is None else _ints(coordinate, "mesh coordinate"),
        local=local,
    )


_DT = "torch.distributed.tensor"
_SPEC_MODULES = (f"{_DT}._dtensor_spec", "torch.distributed._tensor.placement_types")
_PLACEMENT_MODULES = (f"{_DT}.placement_types", "torch.distributed._tensor.placement_types")

# (module, name) -> what the pickle gets instead. Old module paths (torch < 2.5 kept DTensor
# under torch.distributed._tensor) map onto the same records.
ALLOWED_GLOBALS: dict[tuple[str, str], Callable[..., Any] | object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): _torch_size,
    ("torch", "device"): _torch_device,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
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
    **{(m, "Replicate"): _Replicate for m in _PLACEMENT_MODULES},
    ("torch.distributed.device_mesh", "DeviceMesh"): _Mesh,
    ("torch.distributed._mesh_layout", "_MeshLayout"): _Layout,
    ("torch.distributed._mesh_layout", "_FlatLayout"): _Layout,
    **{("torch", name): _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}

# globals that are legitimate in DTensor pickles but describe layouts this reader cannot merge
UNSUPPORTED_GLOBALS: dict[str, str] = {
    "_StridedShard": "strided sharding (FSDP2 combined with tensor parallelism)",
    "Partial": "a Partial (pending reduction) placement",
    "_NormPartial": "a Partial (pending reduction) placement",
}


# modules whose classes mean a known, legitimate layout this reader does not merge
UNSUPPORTED_MODULES: dict[str, str] = {
    "torch.distributed._shard": (
        "an FSDP1 ShardedTensor state dict (FSDP1 without a device mesh); save with FSDP2 or "
        "with a device mesh (DTensor) instead"
    ),
}


class RankUnpickler(pickle._Unpickler):
    """Unpickles a rank file's data.pkl into plain records; refuses every other global.

    The pure-Python unpickler is used so that BUILD (set an object's state) can be limited to
    this module's record classes: a pickle cannot set attributes on the allowed functions or
    classes themselves.
    """

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source

    def load_build(self) -> None:
        stack: list[Any] = self.stack  # type: ignore[attr-defined]
        state = stack.pop()
        inst = stack[-1]
        if isinstance(inst, collections.OrderedDict):
            return  # a state dict's `_metadata` attribute (module versions): not needed
        if not isinstance(inst, _Stateful):
            raise CheckpointError(
                f"{self.source}: the pickle sets the state of a {type(inst).__name__}, which is "
                "not allowed (the file may be malicious)"
            )
        inst.__setstate__(state)

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        target = ALLOWED_GLOBALS.get((module, name))
        if target is not None:
            return target
        if module.startswith("torch.distributed") and name in UNSUPPORTED_GLOBALS:
            raise CheckpointError(
                f"{self.source}: holds {UNSUPPORTED_GLOBALS[name]} ({module}.{name}), which "
                "shardforge cannot merge; only Shard(dim) and Replicate() placements are supported"
            )
        for prefix, what in UNSUPPORTED_MODULES.items():
            if module == prefix or module.startswith(prefix + "."):
                raise CheckpointError(
                    f"{self.source}: holds {what} ({module}.{name}); shardforge cannot merge it"
                )
        raise CheckpointError(
            f"{self.source}: refused to load: the pickle references {module}.{name}, which is "
            "not on the allow-list for per-rank DTensor state dicts (the file may be malicious)"
        )

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"{self.source}: unexpected persistent id in the pickle")
        stype, key, numel = pid[1], pid[2], pid[4]
        if not isinstance(stype, _StorageType):
            raise CheckpointError(f"{self.source}: unexpected storage type {stype!r}")
        if not isinstance(key, str) or not _STORAGE_KEY.match(key) or not isinstance(numel, int):
            raise CheckpointError(f"{self.source}: malformed storage reference {key!r}")
        return StorageRef(key, stype.dtype, numel)


def load_rank_pickle(data: bytes, source: str) -> dict[str, LocalTensor | DTensorRecord]:
    """Parse a rank file's data.pkl into key -> record (plain tensors or DTensors)."""
    try:
        obj = RankUnpickler(data, source).load()
    except CheckpointError as exc:
        msg = str(exc)
        raise CheckpointError(msg if msg.startswith(source) else f"{source}: {msg}") from None
    except Exception as exc:
        raise CheckpointError(
            f"{source}: data.pkl is damaged or not a state dict ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: holds a {type(obj).__name__}, not a state dict")
    out: dict[str, LocalTensor | DTensorRecord] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: state dict key {key!r} is not a string")
        if not isinstance(value, (LocalTensor, DTensorRecord)):
            raise CheckpointError(
                f"{source}: entry {key!r} holds {type(value).__name__}, not a tensor"
            )
        out[key] = value
    return out
