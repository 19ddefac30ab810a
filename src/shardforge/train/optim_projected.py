"""GaLore and APOLLO (low-rank projected gradients) under FSDP2 and in DCP checkpoints.

transformers' (and so Axolotl's) `galore_*` / `apollo_adamw` optimizers: the weights of the
`optim_target_modules` linear layers in a group of their own that carries the projection's
settings (`rank`, `update_proj_gap`, `scale`, `proj_type`; APOLLO also `proj`, `scale_type`),
every other parameter in a plain group of the same optimizer class.

- Under FSDP2 a rank holds a slice of each weight's rows; GaLore's SVD (APOLLO's channel norms
  and norm limiter) of that slice is not GaLore's. So each projected weight steps on its full
  matrix (`FullMatrices`): its gradient and value gathered from the shards, the update computed
  the same way on every rank, each rank keeping its own slice of the result. The low-rank states
  and the projection are whole (replicated) on every rank; they are small (rank x side).
- The other parameters of an AdamW form step on their local shard (its update is elementwise);
  Adafactor's (factored second moments, update clipped by its RMS) steps every parameter on the
  full matrix.
- A checkpoint holds each parameter's state as plain values: a local-shard state as a DTensor of
  the parameter's shape and placement (DCP reshards it), a whole one as a plain tensor (the same
  on every rank), the projector's tensors and counters (`projector.<attr>`), rebuilt on load.
  Nothing of it depends on the world size, so a resume at another one continues exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from shardforge.train.dtensors import _dtensor_type, _like, _local
from shardforge.train.optim_lowbit import plain_entry, write_entry

PROJECTOR = "projector"


class FullMatrices:
    """Mixin for a GaLore/APOLLO optimizer: one parameter at a time, a projected weight (or, with
    `full_all`, every parameter) on its full matrix, any other on its local shard."""

    param_groups: list[dict[str, Any]]
    state: Any
    full_all = False
    syncs_cuda = False  # galore-torch's 8-bit step calls torch.cuda.synchronize()

    def whole(self, group: dict[str, Any]) -> bool:
        return self.full_all or "rank" in group

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        groups = self.param_groups
        try:
            for group in groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._step_one(group, p)
        finally:
            self.param_groups = groups
        return loss

    def _step_one(self, group: dict[str, Any], p: torch.Tensor) -> None:
        for t in self._swap(p, self.whole(group)):
            self.param_groups = [{**group, "params": [t]}]
            with _no_cuda_sync(self.syncs_cuda and not torch.cuda.is_available()):
                super().step()  # type: ignore[misc]

    def _swap(self, p: Any, whole: bool) -> Iterator[torch.Tensor]:
        """`p` as the plain tensor its update runs on (its state moved to it meanwhile)."""
        if not isinstance(p, _dtensor_type()):
            yield p
            return
        t = p.full_tensor() if whole else p.to_local()
        t.grad = p.grad.full_tensor() if whole else _local(p.grad)
        if p in self.state:
            self.state[t] = self.state.pop(p)
        try:
            yield t
        finally:
            self.state[p] = self.state.pop(t, {})
            t.grad = None
        if whole:
            from torch.distributed.tensor import distribute_tensor

            mine = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(mine.to_local())


@contextlib.contextmanager
def _no_cuda_sync(active: bool) -> Iterator[None]:
    """Without CUDA (a CPU run) torch.cuda.synchronize() has nothing to wait for but raises:
    a no-op while `active`."""
    if not active:
        yield
        return
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


def is_projected(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, FullMatrices)


def _fqns(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name as DCP's state dicts name it (without wrapper prefixes)."""
    out = {}
    for name, p in model.named_parameters():
        out[id(p)] = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
    return out


def _projector_entry(projector: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attr, value in vars(projector).items():
        if isinstance(value, list | tuple):
            out |= {f"{PROJECTOR}.{attr}.{i}": v for i, v in enumerate(value)}
        elif isinstance(value, torch.Tensor | int | float | str | bool):
            out[f"{PROJECTOR}.{attr}"] = value
    return out


def _entry(state: dict[str, Any], p: torch.Tensor, whole: bool, raw: bool) -> dict[str, Any]:
    if "state1" in state and not whole:  # bitsandbytes' block states of a shard: optim_lowbit's
        return plain_entry(state, p, raw)
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key == PROJECTOR:
            out |= _projector_entry(value)
        elif isinstance(value, torch.Tensor) and not whole and value.dim() > 0:
            out[key] = _like(p, value)
        else:
            out[key] = value
    return out


def _write(state: dict[str, Any], entry: dict[str, Any]) -> None:
    if "state1" in state and "exp_avg" in entry:  # `plain_entry`'s of bitsandbytes' states
        write_entry(state, entry)
        return
    for key, value in entry.items():
        if key.startswith(PROJECTOR + "."):
            _, attr, *index = key.split(".")
            target = vars(state[PROJECTOR])
            if index:
                target[attr][int(index[0])] = value
            else:
                target[attr] = value
        elif isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
            state[key].copy_(_local(value))
        else:
            state[key] = value


def saved_state(model: torch.nn.Module, optimizer: Any, raw: bool = True) -> dict[str, Any]:
    """What DCP saves of a GaLore/APOLLO optimizer: each parameter's entry, the groups (`raw`:
    with each rank's raw 8-bit block states of a shard, as `optim_lowbit` saves them)."""
    names = _fqns(model)
    state: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                whole = optimizer.whole(group)
                state[names[id(p)]] = _entry(optimizer.state[p], p, whole, raw)
        groups.append({**group, "params": [names[id(p)] for p in group["params"]]})
    return {"state": state, "param_groups": groups}


def _first_state(optimizer: Any) -> None:
    """Create every state (a step of zero gradients at lr 0), as torch's own state dict does,
    so that a checkpoint has tensors of the right shapes to load into."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def load_state(model: torch.nn.Module, optimizer: Any, folder: Any, same_layout: bool) -> None:
    """Load a GaLore/APOLLO optimizer's DCP folder (any world size: see the module docstring;
    8-bit block states of a shard: the raw ones when the checkpoint has this rank's)."""
    from shardforge.formats.dcp.reader import load_checked

    if not any("step" in state for state in optimizer.state.values()):
        _first_state(optimizer)
    template = saved_state(model, optimizer, raw=same_layout)
    load_checked(template, folder)
    names = _fqns(model)
    by_name = {names[id(p)]: p for p in model.parameters()}
    for name, entry in template["state"].items():
        _write(optimizer.state[by_name[name]], entry)
    for group, saved in zip(optimizer.param_groups, template["param_groups"], strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})


# optim_args each family reads (transformers' `_get_galore_optimizer` / `_get_apollo_optimizer`):
# name -> (its default, the type transformers casts it to)
GALORE_ARGS: dict[str, tuple[Any, type]] = {
    "rank": (128, int),
    "update_proj_gap": (200, int),
    "scale": (0.25, float),
    "proj_type": ("std", str),
}
APOLLO_ARGS: dict[str, tuple[Any, type]] = {
    "rank": (128, int),
    "proj": ("random", str),
    "scale_type": ("channel", str),
    "update_proj_gap": (200, int),
    "scale": (1.0, float),
    "proj_type": ("std", str),
}


def projection_settings(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The target group's settings from `optim_args`, defaults and casts as transformers'."""
    table = APOLLO_ARGS if name.startswith("apollo") else GALORE_ARGS
    unknown = sorted(set(extra) - set(table))
    if unknown:
        raise ValueError(
            f"{name} reads only {', '.join(table)} from optim_args (as transformers); "
            f"not {', '.join(map(repr, unknown))}"
        )
    return {key: cast(extra.get(key, default)) for key, (default, cast) in table.items()}


def target_names(model: torch.nn.Module, targets: list[str] | str) -> set[str]:
    """The weights of the linear layers that `optim_target_modules` names (transformers'
    `_setup_low_rank_optimizer`: names, substrings or regexes; 'all-linear': every linear)."""
    from transformers.trainer_utils import check_target_module_exists

    all_linear = isinstance(targets, str) and targets.replace("_", "-") == "all-linear"
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (
            all_linear or check_target_module_exists(targets, name)
        ):
            out.add(f"{name}.weight")
    return out


def projected_groups(
    model: torch.nn.Module, targets: list[str] | str, settings: dict[str, Any]
) -> list[dict[str, Any]]:
    """transformers' two groups: the other trainable parameters, the target weights with the
    projection's settings."""
    names = target_names(model, targets)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    chosen = [p for n, p in params if n in names]
    if not chosen:
        raise ValueError(f"no trainable linear layer matches {targets!r}")
    rest = [p for n, p in params if n not in names]
    return [{"params": rest}, {"params": chosen, **settings}]
