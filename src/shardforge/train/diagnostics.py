"""What FSDP made of the model (logged when every run starts) and per-phase peak memory.

    settings_line(cfg, model, mesh)      the resolved sharding and precision settings, once
    RankShards.of(model, rank)           per rank: FSDP units, activation-checkpointed blocks,
                                         local parameter MiB (uneven shards show here)
    sharding_warnings(model, cfg)        the wrap matched no block; trainable parameters not
                                         stored as mixed precision implies; a unit without the
                                         configured mixed-precision policy
    report_sharding(model, cfg, rt, mesh)  all of the above, logged by rank 0
    MemoryMeter(device)                  peak memory since the last reset: the CUDA allocator's
                                         peak on a GPU, the resident set's high-water mark on CPU
    StepMemory(cfg, rt)                  each step's peak (max over ranks, for the metrics) and,
                                         with fsdp_diagnostics, the peak of each phase (forward,
                                         backward, optimizer step) of the first steps

These catch the failures FSDP users hit most (the xlm-core FSDP guide): the wrap policy matched
no block (the model is one unit, gathered at once), the dtype settings did not apply, one
phase's memory dominates.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.config.normalize import SHARDING_STRATEGIES
from shardforge.config.schema import ShardforgeConfig
from shardforge.train.model import compute_dtypes
from shardforge.train.runtime import Runtime

log = logging.getLogger("shardforge")

MIB = 2**20
# parameters FSDP keeps (the optimizer's master weights); mixed precision only casts for compute
MASTER_DTYPE = torch.float32
PHASES = ("forward", "backward", "optimizer")
PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else str(dtype).removeprefix("torch.")


def strategy_name(hybrid: bool, reshard_after_forward: bool) -> str:
    """The FSDP1 / Axolotl name of these settings (config.normalize's table, read backwards)."""
    for name, settings in SHARDING_STRATEGIES.items():
        if (
            not name.startswith("_")
            and settings.get("hybrid_shard", False) == hybrid
            and settings["reshard_after_forward"] == reshard_after_forward
        ):
            return name
    return "custom"


def _fsdp_module_type() -> type[Any]:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _class_names(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def original_class(module: nn.Module) -> str:
    """The class fully_shard wrapped (it makes FSDP<Name> subclasses)."""
    name = type(module).__name__
    return name.removeprefix("FSDP") if isinstance(module, _fsdp_module_type()) else name


def is_checkpointed(module: nn.Module) -> bool:
    """An activation-checkpointed block: a transformers GradientCheckpointingLayer with
    checkpointing on, or a torch CheckpointWrapper."""
    names = _class_names(module)
    if "CheckpointWrapper" in names:
        return True
    return "GradientCheckpointingLayer" in names and bool(
        getattr(module, "gradient_checkpointing", False)
    )


def _local(param: torch.Tensor) -> torch.Tensor:
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the class it wraps and the parameters it manages itself."""

    name: str
    root: bool
    params: int  # elements (full, not the local shard)


def fsdp_units(model: nn.Module) -> list[Unit]:
    """The FSDP units of `model`, each with the parameters it manages (those not inside a
    nested unit), root first."""
    fsdp = _fsdp_module_type()
    prefixes: dict[str, nn.Module] = {
        name: module for name, module in model.named_modules() if isinstance(module, fsdp)
    }
    counts: Counter[str] = Counter()
    for pname, param in model.named_parameters():
        owners = [p for p in prefixes if p == "" or pname.startswith(p + ".")]
        if owners:
            counts[max(owners, key=len)] += param.numel()
    return [
        Unit(original_class(module), name == "", counts[name]) for name, module in prefixes.items()
    ]


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor holds: a tensor subclass (a quantized weight: packed data and scales)
    the bytes of its inner tensors, not numel x the dtype it dequantizes to."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, nn.Parameter):
        return tensor.numel() * tensor.element_size()
    return sum(stored_bytes(getattr(tensor, name)) for name in flatten()[0])


def _bytes_per_element(local: torch.Tensor) -> float:
    return stored_bytes(local) / local.numel() if local.numel() else local.element_size()


@dataclass(frozen=True)
class RankShards:
    """What one rank holds after sharding (picklable: gathered to rank 0)."""

    rank: int
    units: int
    wrapped: dict[str, int]  # class -> number of non-root units
    checkpointed: int
    local_mib: float
    full_mib: float

    @classmethod
    def of(cls, model: nn.Module, rank: int) -> RankShards:
        units = fsdp_units(model)
        params = list(model.parameters())
        return cls(
            rank=rank,
            units=len(units),
            wrapped=dict(Counter(u.name for u in units if not u.root)),
            checkpointed=sum(1 for m in model.modules() if is_checkpointed(m)),
            local_mib=sum(stored_bytes(_local(p)) for p in params) / MIB,
            full_mib=sum(p.numel() * _bytes_per_element(_local(p)) for p in params) / MIB,
        )

    def line(self) -> str:
        wrapped = " + ".join(f"{n} {name}" for name, n in self.wrapped.items())
        share = 100 * self.local_mib / self.full_mib if self.full_mib else 0.0
        return (
            f"fsdp rank {self.rank}: {self.units} FSDP units ({wrapped + ' + ' if wrapped else ''}"
            f"root), {self.checkpointed} activation-checkpointed blocks, local parameters "
            f"{self.local_mib:.2f} MiB of {self.full_mib:.2f} MiB ({share:.1f}%)"
        )


def settings_line(cfg: ShardforgeConfig, model: nn.Module, mesh: tuple[int, ...]) -> str:
    """The sharding and precision settings as resolved from the config and the model."""
    fsdp = cfg.fsdp
    hybrid = len(mesh) == 2
    where = f"{mesh[0]} replicas x {mesh[1]} ranks" if hybrid else f"{mesh[0]} rank(s)"
    configured = fsdp.transformer_layer_cls_to_wrap
    wrap = ", ".join(configured or _block_classes(model)) or "nothing"
    source = "configured" if configured else "the model's _no_split_modules"
    param, reduce = compute_dtypes(cfg)
    checkpointing = fsdp.activation_checkpointing or cfg.gradient_checkpointing
    stored = sorted({_dtype_name(p.dtype) for p in model.parameters() if p.requires_grad})
    return (
        f"fsdp: {strategy_name(hybrid, fsdp.reshard_after_forward)} on {where} "
        f"(reshard_after_forward {str(fsdp.reshard_after_forward).lower()}, offload_params "
        f"{str(fsdp.offload_params).lower()}); wrap {wrap} ({source}); activation "
        f"checkpointing {'on' if checkpointing else 'off'}; mixed precision param_dtype "
        f"{_dtype_name(param)}, reduce_dtype {_dtype_name(reduce)} (trainable parameters "
        f"stored in {', '.join(stored) or 'none'}); state_dict_type {fsdp.state_dict_type}"
    )


def _block_classes(model: nn.Module) -> list[str]:
    present = {type(m).__name__ for m in model.modules()} | {
        original_class(m) for m in model.modules()
    }
    return [n for n in getattr(model, "_no_split_modules", None) or [] if n in present]


def wrap_warning(model: nn.Module) -> str | None:
    """A warning when the wrap matched no transformer block: no unit besides the root holds a
    parameter, or the model names its block classes (_no_split_modules) and none is a unit."""
    units = fsdp_units(model)
    inner = [u for u in units if not u.root]
    total = sum(u.params for u in units)
    root = sum(u.params for u in units if u.root)
    share = f"{100 * root / total:.0f}%" if total else "all"
    wrapped = ", ".join(f"{name} x{n}" for name, n in Counter(u.name for u in inner).items())
    blocks = _block_classes(model)
    hint = (
        f"set fsdp.transformer_layer_cls_to_wrap to the transformer block class "
        f"({', '.join(blocks) or 'see the model'})"
    )
    if not any(u.params for u in inner):
        return (
            f"fsdp: the wrap matched no block: the wrapped modules ({wrapped or 'none'}) hold "
            "no parameters, so the whole model is one FSDP unit, gathered at once; " + hint
        )
    if blocks and not {u.name for u in inner} & set(blocks):
        return (
            f"fsdp: the wrap matched no transformer block ({', '.join(blocks)}): the units are "
            f"{wrapped}, and the root unit, gathered as one, holds {share} of the parameters; "
            + hint
        )
    return None


def dtype_warnings(model: nn.Module, cfg: ShardforgeConfig) -> list[str]:
    """Warnings when the dtypes FSDP holds are not what the mixed-precision settings imply:
    trainable parameters not stored in float32 (the master weights), or units whose policy is
    not the configured one (the setting did not reach them)."""
    param_dtype, reduce_dtype = compute_dtypes(cfg)
    out = []
    stored: Counter[torch.dtype] = Counter()
    for param in model.parameters():
        if param.requires_grad and param.dtype != MASTER_DTYPE:
            stored[param.dtype] += param.numel()
    for dtype, numel in stored.items():
        implied = (
            f"mixed precision (param_dtype {_dtype_name(param_dtype)}) implies"
            if param_dtype is not None
            else "without mixed precision, training expects"
        )
        out.append(
            f"fsdp: {numel} trainable parameter elements are stored in {_dtype_name(dtype)}; "
            f"{implied} {_dtype_name(MASTER_DTYPE)} master weights, so the optimizer updates "
            f"them in {_dtype_name(dtype)}"
        )
    fsdp = _fsdp_module_type()
    units = [m for m in model.modules() if isinstance(m, fsdp)]
    wrong: Counter[tuple[str, str]] = Counter()
    for unit in units:
        state = getattr(unit, "_get_fsdp_state", None)
        policy = getattr(state(), "_mp_policy", None) if state is not None else None
        if policy is None:
            continue
        if (policy.param_dtype, policy.reduce_dtype) != (param_dtype, reduce_dtype):
            wrong[(_dtype_name(policy.param_dtype), _dtype_name(policy.reduce_dtype))] += 1
    for (theirs, reduced), n in wrong.items():
        out.append(
            f"fsdp: mixed precision did not apply to {n} of {len(units)} FSDP units (their "
            f"param_dtype {theirs}, reduce_dtype {reduced}; configured "
            f"{_dtype_name(param_dtype)}, {_dtype_name(reduce_dtype)})"
        )
    return out


def sharding_warnings(model: nn.Module, cfg: ShardforgeConfig) -> list[str]:
    wrap = wrap_warning(model)
    return [*([wrap] if wrap else []), *dtype_warnings(model, cfg)]


def report_sharding(
    model: nn.Module, cfg: ShardforgeConfig, rt: Runtime, mesh: tuple[int, ...]
) -> list[RankShards]:
    """Log (rank 0) the settings, one line per rank and any warning; every rank must call it
    (the per-rank summaries are gathered). Returns the summaries (on every rank)."""
    mine = RankShards.of(model, rt.rank)
    gathered: list[Any] = [None] * rt.world_size
    dist.all_gather_object(gathered, mine)
    if rt.is_main:
        log.info("%s", settings_line(cfg, model, mesh))
        for shards in gathered:
            log.info("%s", shards.line())
        for warning in sharding_warnings(model, cfg):
            log.warning("warning: %s", warning)
    return gathered


def _vm_hwm_kib() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


class MemoryMeter:
    """Peak memory (MiB) since the last `reset`: on a GPU the CUDA allocator's peak; on CPU the
    process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs), or the
    current RSS (psutil) where that mark cannot be reset."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.resettable = not self.cuda and _vm_hwm_kib() is not None
        self.kind = "device memory" if self.cuda else "RSS"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            try:
                PROC_CLEAR_REFS.write_text("5")  # 5: reset the peak RSS to the current RSS
            except OSError:
                self.resettable = False

    def peak_mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / MIB
        hwm = _vm_hwm_kib() if self.resettable else None
        if hwm is not None:
            return hwm / 1024
        import psutil

        return float(psutil.Process().memory_info().rss) / MIB


@dataclass
class StepMemory:
    """A step's peak memory (the largest over all ranks; every rank calls `finish`) and, for the
    first `detail_steps` steps, the peak of each phase, logged by rank 0."""

    meter: MemoryMeter
    rt: Runtime
    detail_steps: int = 0
    detailed: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    peak: float = 0.0

    @classmethod
    def of(cls, cfg: ShardforgeConfig, rt: Runtime) -> StepMemory:
        steps = cfg.fsdp_diagnostics_steps if cfg.fsdp_diagnostics else 0
        return cls(MemoryMeter(rt.device), rt, steps)

    @property
    def detail(self) -> bool:
        return self.detailed < self.detail_steps

    def start(self) -> None:
        self.phases = {}
        self.peak = 0.0
        self.meter.reset()

    def mark(self, phase: str) -> None:
        """The end of a phase: its peak (the largest over micro-batches) when in detail."""
        if not self.detail:
            return
        value = self.meter.peak_mib()
        self.phases[phase] = max(self.phases.get(phase, 0.0), value)
        self.peak = max(self.peak, value)
        self.meter.reset()

    def finish(self, step: int) -> float:
        """The step's peak (MiB, max over ranks); logs the phases of a detailed step."""
        self.peak = max(self.peak, self.meter.peak_mib())
        peak = torch.tensor([self.peak], dtype=torch.float64, device=self.rt.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if self.detail:
            gathered: list[Any] = [None] * self.rt.world_size
            dist.all_gather_object(gathered, self.phases)
            if self.rt.is_main:
                log.info("%s", self.phase_line(step, gathered))
            self.detailed += 1
        return float(peak.item())

    def phase_line(self, step: int, per_rank: list[dict[str, float]]) -> str:
        ranks = "; ".join(
            f"rank {r}: " + " / ".join(f"{phases.get(p, 0.0):.0f}" for p in PHASES)
            for r, phases in enumerate(per_rank)
        )
        return (
            f"fsdp memory step {step}: peak {self.meter.kind} MiB after "
            f"{' / '.join(PHASES)} step: {ranks}"
        )
