"""GaLore and APOLLO under FSDP2: a sharded model on 2 gloo ranks steps exactly as the package's
own optimizer steps the unsharded model (the projection of the full gradient matrix, not of a
rank's slice of it); optim_target_modules and optim_args choose what is projected and how.
galore_adamw_8bit runs here on CPU (its step's torch.cuda.synchronize() a no-op without CUDA);
the tiny model's states are below bitsandbytes' 4096-value minimum for 8 bits, so float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.dist import run_on_ranks
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.train.optim import build_optimizer, optimizer_problem

NAMES = ["galore_adamw", "galore_adamw_8bit", "galore_adafactor", "apollo_adamw"]
ARGS = {"rank": 2, "update_proj_gap": 2, "scale": 0.5}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8), torch.nn.LayerNorm(8)
    )


def _cfg(name: str, **extra: Any) -> ShardforgeConfig:
    keys = {"optim_target_modules": ["0", "2"], "optim_args": ARGS, "learning_rate": 1e-2, **extra}
    return ShardforgeConfig.model_validate(
        {"base_model": "x", "datasets": [{"path": "d.jsonl"}], "optimizer": name, **keys}
    )


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(6, 16)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _sharded_matches_unsharded(rank: int, world: int) -> None:
    for name in NAMES:
        _compare(name)


def _compare(name: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from shardforge.train.optim import _projected_class
    from shardforge.train.optim_projected import _no_cuda_sync

    sharded = _model()
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer)
    fully_shard(sharded)
    _train(sharded, build_optimizer(sharded, _cfg(name)), 4)

    plain = _model()  # the package's own class, as transformers builds it, unsharded
    base = _projected_class(name).__mro__[2]
    groups = build_optimizer(plain, _cfg(name)).param_groups
    kwargs: dict[str, Any] = {"lr": 1e-2}
    if name == "galore_adafactor":
        kwargs |= {"scale_parameter": False, "relative_step": False}
    if name == "galore_adamw":
        kwargs["no_deprecation_warning"] = True
    with _no_cuda_sync(not torch.cuda.is_available()):  # galore-torch's 8-bit step calls it
        _train(plain, base([{**g} for g in groups], **kwargs), 4)
    theirs = plain.state_dict()
    for key, mine in sharded.state_dict().items():
        torch.testing.assert_close(mine.full_tensor(), theirs[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
def test_a_sharded_model_steps_as_the_unsharded_one() -> None:
    """One launch of 2 ranks compares the three optimizers in turn (4 steps each)."""
    run_on_ranks(_sharded_matches_unsharded, 2)


@pytest.mark.parametrize("name", NAMES)
def test_optim_target_modules_and_optim_args_choose_the_projected_weights(name: str) -> None:
    model = _model()
    optimizer = build_optimizer(model, _cfg(name, optim_target_modules=["2"]))
    projected, other = optimizer.param_groups[1], optimizer.param_groups[0]
    assert projected["params"] == [model[2].weight] and projected["rank"] == 2
    assert projected["update_proj_gap"] == 2 and projected["scale"] == 0.5
    assert len(other["params"]) == 5 and "rank" not in other
    _train(model, optimizer, 1)
    assert optimizer.state[model[2].weight]["projector"].ortho_matrix.shape == (8, 2)
    everything = build_optimizer(_model(), _cfg(name, optim_target_modules="all_linear"))
    assert len(everything.param_groups[1]["params"]) == 2


def test_refusals() -> None:
    for name in ("galore_adamw_layerwise", "apollo_adamw_layerwise", "galore_adafactor_layerwise"):
        problem = optimizer_problem(_cfg(name))
        assert problem is not None and problem[0] == "optimizer", name
    assert "layerwise" not in str(optimizer_problem(_cfg("galore_adamw")))
    bad = optimizer_problem(_cfg("galore_adamw", optim_args={"rank": 2, "betas": 1}))
    assert bad == (
        "optim_args",
        "galore_adamw reads only rank, update_proj_gap, scale, "
        "proj_type from optim_args (as transformers); not 'betas'",
    )
    with pytest.raises(ValueError, match="optim_target_modules: galore_adamw needs"):
        _cfg("galore_adamw", optim_target_modules=None)
    with pytest.raises(ValueError, match="optim_target_modules: read only by"):
        _cfg("adamw_torch", optim_args=None)
    with pytest.raises(ValueError, match="weight_decay: not applied"):
        _cfg("apollo_adamw", weight_decay=0.01)
    with pytest.raises(ConfigError, match="no trainable linear layer matches"):
        build_optimizer(_model(), _cfg("galore_adamw", optim_target_modules=["nothing"]))
