"""Low-bit optimizer states (torchao's 8/4-bit AdamW, bitsandbytes' 8-bit AdamW) under FSDP2 and
in DCP checkpoints.

- bitsandbytes' kernels take plain tensors: under FSDP2 its update runs on each parameter's
  local shard (`LocalShards`), its state a plain tensor of the shard's shape.
- torchao's states are tensor subclasses (inside a DTensor under FSDP2); its step is compiled,
  which on CPU means an inductor C++ build per shape (minutes here) and fails for the 4-bit
  state of a sharded parameter (torch 2.13): on CPU the step runs eagerly (`EagerOnCpu`).
- A checkpoint holds each low-bit state twice (`plain_state`): dequantized to a float32 DTensor
  of the parameter's shape and placement (DCP reshards it to any world size; it is quantized
  again on load), and the rank's raw quantized tensors (`raw.<key>.<part>.rank<R>`), loaded
  when the world and mesh are the same, so such a resume continues bit for bit.

`optim_state` dispatches to `saved_state` / `load_state` here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardforge.train.dtensors import _dtensor_type, _like, _local

RAW = "raw"
_BNB = {"exp_avg": ("state1", "absmax1", "qmap1"), "exp_avg_sq": ("state2", "absmax2", "qmap2")}
_BNB_BLOCK = 256


class LocalShards:
    """Mixin for a bitsandbytes 8-bit optimizer: each update on the parameter's local shard."""

    state: Any

    def _swap(self, p: Any) -> Iterator[torch.Tensor]:
        if not isinstance(p, _dtensor_type()):
            yield p
            return
        local = p.to_local()
        local.grad = None if p.grad is None else _local(p.grad)
        if p in self.state:
            self.state[local] = self.state.pop(p)
        try:
            yield local
        finally:
            self.state[p] = self.state.pop(local)
            local.grad = None

    def init_state(self, group: dict[str, Any], p: torch.Tensor, gi: int, pi: int) -> None:
        for local in self._swap(p):
            super().init_state(group, local, gi, pi)  # type: ignore[misc]

    def update_step(self, group: dict[str, Any], p: torch.Tensor, gi: int, pi: int) -> None:
        for local in self._swap(p):
            super().update_step(group, local, gi, pi)  # type: ignore[misc]


class EagerOnCpu:
    """Mixin for a torchao low-bit optimizer: on CPU its step runs without torch.compile."""

    param_groups: list[dict[str, Any]]

    def step(self, closure: Any = None) -> Any:
        first = next(p for g in self.param_groups for p in g["params"])
        if first.device.type != "cpu":
            return super().step(closure)  # type: ignore[misc]
        with torch.compiler.set_stance("force_eager"):
            return super().step(closure)  # type: ignore[misc]


def is_low_bit(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, LocalShards | EagerOnCpu)


def _parts(value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The plain tensors a torchao state's local tensor subclass is made of."""
    local = _local(value)
    names, _ = local.__tensor_flatten__()  # type: ignore[attr-defined]
    return {name: getattr(local, name) for name in names}


def _subclass(value: Any) -> bool:
    """A quantized state: a tensor subclass (torchao's) that flattens into plain tensors."""
    if not isinstance(value, torch.Tensor):
        return False
    local = _local(value)
    return type(local) is not torch.Tensor and hasattr(local, "__tensor_flatten__")


def _bnb_value(state: dict[str, Any], key: str) -> torch.Tensor:
    import bitsandbytes.functional as F

    codes, absmax, qmap = (state.get(k) for k in _BNB[key])
    assert codes is not None
    if codes.dtype != torch.uint8:  # a parameter below min_8bit_size: float32 states
        return codes
    return F.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=_BNB_BLOCK)


def _raw_name(key: str, part: str) -> str:
    return f"{RAW}.{key}.{part}.rank{dist.get_rank() if dist.is_initialized() else 0}"


def plain_entry(state: dict[str, Any], p: torch.Tensor, raw: bool) -> dict[str, Any]:
    """One parameter's optimizer state as DCP saves it (`raw`: with copies of the rank's raw
    tensors, which a load fills before they replace the requantized live ones)."""
    out: dict[str, Any] = {}
    if "state1" in state:  # bitsandbytes
        out["step"] = state["step"]
        for key, names in _BNB.items():
            out[key] = _like(p, _bnb_value(state, key).float())
            for name in names[:2] if raw and state[names[0]].dtype == torch.uint8 else ():
                out[_raw_name(key, name)] = state[name].clone()
        return out
    for key, value in state.items():
        if not _subclass(value):
            out[key] = value
            continue
        out[key] = _like(p, _local(value).dequantize().float())
        for name, part in _parts(value).items() if raw else ():
            out[_raw_name(key, name)] = part.clone()
    return out


def _write_bnb(state: dict[str, Any], key: str, value: torch.Tensor) -> None:
    import bitsandbytes.functional as F

    codes, qmap = state[_BNB[key][0]], state.get(_BNB[key][2])
    local = _local(value).reshape(codes.shape)
    if codes.dtype != torch.uint8:
        codes.copy_(local)
        return
    new, quant = F.quantize_blockwise(local.contiguous(), code=qmap, blocksize=_BNB_BLOCK)
    codes.copy_(new)
    state[_BNB[key][1]].copy_(quant.absmax)


def write_entry(state: dict[str, Any], entry: dict[str, Any]) -> None:
    """Load a `plain_entry` into a parameter's live optimizer state: the raw tensors where the
    entry has them, else the float32 values quantized again."""
    raw = {k: v for k, v in entry.items() if k.startswith(RAW + ".")}
    bnb = "state1" in state
    for key, value in entry.items():
        if key in raw:
            continue
        if bnb and key in _BNB:
            _write_bnb(state, key, value)
        elif isinstance(state.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
            state[key].copy_(value)
        else:
            state[key] = value
    for name, value in raw.items():
        _, key, part, _rank = name.split(".")
        target = state[part] if bnb else _parts(state[key])[part]
        target.copy_(value)


def _params_by_fqn(sd: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """FQN -> parameter, from get_optimizer_state_dict's groups (same order as the optimizer's)."""
    return {
        fqn: p
        for saved, group in zip(sd["param_groups"], optimizer.param_groups, strict=True)
        for fqn, p in zip(saved["params"], group["params"], strict=True)
    }


def saved_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, raw: bool = True
) -> dict[str, Any]:
    """What DCP saves of a low-bit optimizer (`plain_entry` of every parameter, the groups)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer)
    params = _params_by_fqn(sd, optimizer)
    return {
        "state": {fqn: plain_entry(optimizer.state[p], p, raw) for fqn, p in params.items()},
        "param_groups": sd["param_groups"],
    }


def load_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Any, same_layout: bool
) -> None:
    """Load a low-bit optimizer's DCP folder: its raw tensors when the checkpoint has this
    rank's (`same_layout`), else its float32 states quantized again for this sharding."""
    from shardforge.formats.dcp.reader import load_checked

    template = saved_state(model, optimizer, raw=same_layout)
    load_checked(template, folder)
    params = _params_by_fqn(template, optimizer)
    for fqn, entry in template["state"].items():
        write_entry(optimizer.state[params[fqn]], entry)
    for group, saved in zip(optimizer.param_groups, template["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


def same_layout(model: torch.nn.Module, world_size: int, mesh_shape: list[int]) -> bool:
    """A checkpoint of `world_size` ranks in a `mesh_shape` mesh was sharded as this run is."""
    dtensor = _dtensor_type()
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, dtensor)), None)
    shape = list(mesh.mesh.shape) if mesh is not None else []
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world_size == world and (not mesh_shape or mesh_shape == shape)
