"""Optimizer and schedule tables, in this process: every schedule name and extra changes the lr
curve, every optimizer name builds its optimizer, every grouping key changes the groups' lrs."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.optim import build_optimizer, optimizer_problem
from shardforge.train.optim_lowbit import plain_entry, write_entry
from shardforge.train.schedules import (
    DECAYS,
    build_scheduler,
    lr_multiplier,
    scheduler_state,
    warmup_steps,
)


def _cfg(**extra: object) -> Any:
    return validate_cfg({"base_model": "x", "learning_rate": 1.0, **extra})


def _one() -> torch.nn.Module:
    return torch.nn.Linear(2, 2, bias=False)


def _curve(steps: int = 10, **extra: object) -> list[float]:
    """The lr of each optimizer step of a `steps`-step run with peak lr 1."""
    cfg = _cfg(**extra)
    opt = build_optimizer(_one(), cfg)
    sched = build_scheduler(opt, cfg, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(float(sched.get_last_lr()[0]))
        opt.step()
        sched.step()
    return lrs


def test_warmup_then_decay_as_transformers() -> None:
    """Linear warmup from 0 (transformers' step / warmup), then the decay; `constant` has no
    warmup (transformers' get_constant_schedule)."""
    assert [lr_multiplier(s, 4, 10, "linear") for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert math.isclose(lr_multiplier(10, 3, 10, "cosine"), 0.0, abs_tol=1e-12)
    assert math.isclose(lr_multiplier(6, 2, 10, "linear"), 0.5)
    assert lr_multiplier(0, 3, 10, "constant") == 1.0
    assert set(DECAYS) == {"cosine", "linear", "constant"}
    assert _curve(5, lr_scheduler="constant", warmup_steps=2) == [1.0] * 5
    assert _curve(5, lr_scheduler="constant_with_warmup", warmup_steps=2)[:3] == [0.0, 0.5, 1.0]


NAMES: dict[str, dict[str, Any]] = {
    "linear": {},
    "cosine": {},
    "cosine_with_restarts": {"lr_scheduler_kwargs": {"num_cycles": 2}},
    "polynomial": {"lr_scheduler_kwargs": {"power": 2.0}},
    "constant_with_warmup": {},
    "inverse_sqrt": {},
    "cosine_with_min_lr": {"lr_scheduler_kwargs": {"min_lr_rate": 0.5}},
    "warmup_stable_decay": {"lr_scheduler_kwargs": {"num_decay_steps": 3}},
    "rex": {},
    "one_cycle": {},
}


def test_every_schedule_name_has_its_own_curve() -> None:
    curves = {n: _curve(10, lr_scheduler=n, warmup_steps=2, **x) for n, x in NAMES.items()}
    seen = [tuple(round(v, 9) for v in c) for c in curves.values()]
    assert len(set(seen)) == len(seen), curves
    assert curves["cosine_with_min_lr"][-1] >= 0.5  # its floor
    assert curves["warmup_stable_decay"][2:7] == [1.0] * 5  # stable, then 3 decay steps


@pytest.mark.parametrize(
    "name,kwargs",
    [("cosine", {"num_cycles": 1.0}), ("polynomial", {"lr_end": 0.5}), ("one_cycle", {})],
)
def test_lr_scheduler_kwargs_change_the_curve(name: str, kwargs: dict[str, Any]) -> None:
    plain = _curve(8, lr_scheduler=name, warmup_steps=2)
    kwargs = kwargs or {"div_factor": 5.0}
    assert _curve(8, lr_scheduler=name, warmup_steps=2, lr_scheduler_kwargs=kwargs) != plain


def test_the_default_cosine_is_transformers_bit_for_bit_without_importing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default schedule is built without transformers.optimization (its import of peft,
    bitsandbytes and torch's inductor costs every rank and launcher seconds) and gives
    transformers' cosine-with-warmup lrs exactly."""
    import sys

    import transformers
    from transformers.optimization import get_cosine_schedule_with_warmup

    shapes = [(10, 2), (10, 0), (7, 3), (150, 3), (1, 0), (5, 5)]
    with monkeypatch.context() as m:  # importing it now would fail
        m.setitem(sys.modules, "transformers.optimization", None)
        m.delattr(transformers, "get_scheduler", raising=False)
        ours = [_curve(steps, warmup_steps=warmup) for steps, warmup in shapes]
    for (steps, warmup), curve in zip(shapes, ours, strict=True):
        opt = torch.optim.SGD(_one().parameters(), lr=1.0)
        theirs = get_cosine_schedule_with_warmup(opt, warmup, steps)
        lrs = []
        for _ in range(steps):
            lrs.append(float(theirs.get_last_lr()[0]))
            opt.step()
            theirs.step()
        assert curve == lrs, (steps, warmup)


def test_axolotls_cosine_extras() -> None:
    """cosine_min_lr_ratio: the floor; cosine_constant_lr_ratio: reached at that fraction of
    the steps and held; lr_quadratic_warmup: (step / warmup) ** 2."""
    floor = _curve(10, lr_scheduler="cosine", cosine_min_lr_ratio=0.2)
    assert floor[0] == 1.0 and min(floor) > 0.2 and floor != _curve(10)
    early = _curve(10, cosine_min_lr_ratio=0.2, cosine_constant_lr_ratio=0.5)
    assert [round(v, 12) for v in early[5:]] == [0.2] * 5 and early[4] > 0.2
    quad = _curve(10, lr_quadratic_warmup=True, warmup_steps=4)
    assert quad[:4] == [0.0, 1 / 16, 4 / 16, 9 / 16] and quad[4] == 1.0


def test_rex_and_one_cycle() -> None:
    """rex (Axolotl's RexLR, counted from 1) to cosine_min_lr_ratio; one_cycle starts at
    learning_rate / lr_div_factor (torch's OneCycleLR, default 25)."""
    rex = _curve(10, lr_scheduler="rex", warmup_steps=2)
    assert rex[:2] == [0.5, 1.0] and rex[-1] == 0.0
    assert _curve(10, lr_scheduler="rex", warmup_steps=2, cosine_min_lr_ratio=0.1)[-1] == 0.1
    assert math.isclose(_curve(10, lr_scheduler="one_cycle", warmup_steps=2)[0], 1 / 25)
    assert math.isclose(
        _curve(10, lr_scheduler="one_cycle", warmup_steps=2, lr_div_factor=4)[0], 0.25
    )


def test_warmup_length_as_axolotl_reads_it() -> None:
    """warmup_steps (below 1: a fraction, rounded up, as transformers reads it); warmup_ratio
    rounded down; neither: 3% of the steps up to 100; 1 step becomes 2."""
    assert warmup_steps(_cfg(warmup_steps=4), 100) == 4
    assert warmup_steps(_cfg(warmup_steps=0.1), 95) == 10
    assert warmup_steps(_cfg(warmup_ratio=0.03), 190) == 5
    assert warmup_steps(_cfg(), 1000) == 30 and warmup_steps(_cfg(), 10000) == 100
    assert warmup_steps(_cfg(warmup_steps=1), 100) == 2
    assert _curve(10, lr_scheduler="linear", warmup_steps=0.3)[:4] == [0.0, 1 / 3, 2 / 3, 1.0]


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"warmup_steps": 2.5}, "a whole number of steps"),
        (
            {"lr_scheduler": "linear", "cosine_min_lr_ratio": 0.1},
            "cosine_min_lr_ratio: not supported with lr_scheduler linear .read by cosine or rex",
        ),
        ({"cosine_constant_lr_ratio": 0.5}, "needs cosine_min_lr_ratio"),
        (
            {"lr_div_factor": 4},
            "lr_div_factor: not supported with lr_scheduler cosine .read by one_cycle",
        ),
        ({"embedding_lr": 1e-5, "embedding_lr_scale": 0.5}, "choose one"),
        ({"optimizer": "adamw_anyprecision"}, "optimizer"),
    ],
)
def test_keys_a_schedule_or_optimizer_does_not_read_are_refused(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(**extra)


def test_a_bad_lr_scheduler_kwarg_is_one_problem() -> None:
    from shardforge.train.preflight import check_optimizer

    problems = check_optimizer(_cfg(lr_scheduler_kwargs={"nope": 1}))
    assert len(problems) == 1 and problems[0][0] == "lr_scheduler_kwargs"
    assert "nope" in problems[0][1]


def test_scheduler_state_round_trips_through_json() -> None:
    cfg = _cfg(warmup_steps=2, lr_scheduler="linear", optimizer="adamw_torch_8bit")
    opt = build_optimizer(_one(), cfg)  # torchao keeps the lr as a tensor
    sched = build_scheduler(opt, cfg, 10)
    for _ in range(4):
        opt.step()
        sched.step()
    state = json.loads(json.dumps(scheduler_state(sched)))
    opt2 = build_optimizer(_one(), cfg)
    sched2 = build_scheduler(opt2, cfg, 10)
    sched2.load_state_dict({**sched2.state_dict(), **state})
    opt2.step()
    opt.step()
    sched2.step()
    sched.step()
    assert [float(x) for x in sched2.get_last_lr()] == [float(x) for x in sched.get_last_lr()]


# -- optimizers ---------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(64, 64)
        self.mlp = torch.nn.Linear(64, 64)
        self.attn = torch.nn.Linear(64, 64, bias=False)
        self.norm = torch.nn.LayerNorm(64)
        self.lm_head = torch.nn.Linear(64, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        out: torch.Tensor = self.lm_head(self.norm(self.attn(self.mlp(h))))
        return out


def _lrs(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, tuple[float, Any]]:
    """Each parameter's lr (and weight decay) in `opt`."""
    ids = {id(p): n for n, p in model.named_parameters()}
    return {
        ids[id(p)]: (float(g["lr"]), g["weight_decay"])
        for g in opt.param_groups
        for p in g["params"]
    }


def _types() -> dict[str, str]:
    return {
        "adamw_torch": "AdamW",
        "adamw_torch_8bit": "AdamW8bit",
        "adamw_torch_4bit": "AdamW4bit",
        "adamw_bnb_8bit": "AdamW8bit",
        "adamw_8bit": "AdamW8bit",
        "paged_adamw_8bit": "PagedAdamW8bit",
        "muon": "MuonWithAdamW",
    }


@pytest.mark.parametrize("name,cls", list(_types().items()))
def test_each_optimizer_name_builds_its_optimizer_and_steps(name: str, cls: str) -> None:
    model = Tiny()
    opt = build_optimizer(model, _cfg(optimizer=name, learning_rate=1e-2))
    assert type(opt).__name__ == cls
    before = model.attn.weight.detach().clone()
    model(torch.arange(8)).square().mean().backward()
    opt.step()
    assert not torch.equal(model.attn.weight, before)


def test_low_bit_states_take_a_fraction_of_adamws_memory() -> None:
    def state_bytes(name: str) -> int:
        model = torch.nn.Linear(512, 512, bias=False)
        opt = build_optimizer(model, _cfg(optimizer=name))
        model(torch.ones(1, 512)).sum().backward()
        opt.step()
        flat = [t for s in opt.state.values() for v in s.values() for t in _tensors(v)]
        return sum(t.numel() * t.element_size() for t in flat)

    full = state_bytes("adamw_torch")
    assert state_bytes("adamw_torch_8bit") < full * 0.3
    assert state_bytes("adamw_torch_4bit") < full * 0.2
    assert state_bytes("adamw_bnb_8bit") < full * 0.3


def _tensors(value: Any) -> list[torch.Tensor]:
    if not isinstance(value, torch.Tensor):
        return []
    if type(value) is torch.Tensor:
        return [value]
    names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
    return [getattr(value, n) for n in names]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    model = Tiny()
    opt = build_optimizer(model, _cfg(optimizer="muon", optim_args={"momentum": 0.8}))
    ids = {id(p): n for n, p in model.named_parameters()}
    muon = {ids[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    assert muon == {"mlp.weight", "attn.weight"}
    assert {g["momentum"] for g in opt.param_groups if g["muon"]} == {0.8}  # optim_args


def test_default_groups_decay_weights_not_biases_or_norms() -> None:
    model = Tiny()
    lrs = _lrs(build_optimizer(model, _cfg(weight_decay=0.1)), model)
    assert lrs["mlp.weight"] == (1.0, 0.1) and lrs["mlp.bias"] == (1.0, 0.0)
    assert lrs["norm.weight"] == (1.0, 0.0)


def test_embedding_lr_scale_and_lr_groups() -> None:
    model = Tiny()
    lrs = _lrs(build_optimizer(model, _cfg(embedding_lr=0.5, weight_decay=0.1)), model)
    assert lrs["embed_tokens.weight"] == lrs["lm_head.weight"] == (0.5, 0.0)
    assert lrs["mlp.weight"] == (1.0, 0.1)
    lrs = _lrs(build_optimizer(model, _cfg(embedding_lr_scale=0.25)), model)
    assert lrs["embed_tokens.weight"][0] == 0.25
    groups = [{"name": "a", "modules": ["attn"], "lr": 0.125}]
    lrs = _lrs(build_optimizer(model, _cfg(lr_groups=groups)), model)
    assert lrs["attn.weight"][0] == 0.125 and lrs["mlp.weight"][0] == 1.0


def test_loraplus_lr_ratio_and_embedding() -> None:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, target_modules=["mlp", "embed_tokens"], lora_dropout=0.0)
    model = get_peft_model(Tiny(), lora)
    cfg = _cfg(loraplus_lr_ratio=16, loraplus_lr_embedding=0.01, adapter="lora")
    lrs = _lrs(build_optimizer(model, cfg), model)
    by_kind = {
        (("lora_B" in n) or ("lora_embedding_B" in n), "embed" in n): v[0] for n, v in lrs.items()
    }
    assert by_kind[(True, False)] == 16.0 and by_kind[(False, False)] == 1.0
    assert by_kind[(True, True)] == by_kind[(False, True)] == 0.01


def test_optim_args_mapping_or_string() -> None:
    opt = build_optimizer(Tiny(), _cfg(optim_args="amsgrad=true, eps=0.001"))
    assert opt.defaults["amsgrad"] is True and opt.defaults["eps"] == 0.001
    opt = build_optimizer(Tiny(), _cfg(optim_args={"maximize": True}))
    assert opt.defaults["maximize"] is True
    assert optimizer_problem(_cfg(optim_args={"nope": 1})) == (
        "optim_args",
        "adamw_torch takes no argument 'nope'",
    )


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a)
    )
    assert optimizer_problem(_cfg(optimizer="paged_adamw_8bit")) == (
        "optimizer",
        "paged_adamw_8bit needs bitsandbytes: pip install 'shardforge[quant]'",
    )
    monkeypatch.delattr(torch.optim, "Muon")
    problem = optimizer_problem(_cfg(optimizer="muon"))
    assert problem is not None and "torch >= 2.9" in problem[1]


@pytest.mark.parametrize("name", ["adamw_torch_8bit", "adamw_torch_4bit", "adamw_bnb_8bit"])
def test_a_checkpointed_low_bit_state_is_quantized_again(name: str) -> None:
    """The float32 form of a checkpoint (what another world size loads) quantized again into
    another optimizer: its states are the saved ones up to the quantization step, its step
    count the saved one; with the raw tensors (the same world size) they are the same bits."""
    torch.manual_seed(0)
    cfg = _cfg(optimizer=name, learning_rate=1e-2)
    model, other = torch.nn.Linear(512, 64), torch.nn.Linear(512, 64)
    opts = [build_optimizer(model, cfg), build_optimizer(other, cfg)]
    for m, o in zip((model, other, model, model), (*opts, opts[0], opts[0]), strict=True):
        m(torch.randn(3, 512)).sum().backward()
        o.step()
        o.zero_grad()
    want = opts[0].state[model.weight]
    entry = plain_entry(want, model.weight, raw=False)
    assert entry["exp_avg"].dtype == torch.float32 and entry["exp_avg"].shape == (64, 512)
    got = opts[1].state[other.weight]
    write_entry(got, entry)
    again = plain_entry(got, other.weight, raw=False)
    for key in ("exp_avg", "exp_avg_sq"):
        top = entry[key].abs().max()
        step = 0.3 if "4bit" in name else 0.1  # of the largest value: a few quantization steps
        assert torch.allclose(again[key], entry[key], atol=float(top) * step), key
    assert float(again["step"]) == 3
    write_entry(got, plain_entry(want, model.weight, raw=True))
    for key in want:
        assert all(
            torch.equal(a, b) for a, b in zip(_tensors(want[key]), _tensors(got[key]), strict=True)
        )


def test_a_changed_total_continues_only_the_plain_decays() -> None:
    """Resumed with another total: cosine/linear/constant continue from the checkpoint's lr
    (`Continuation`); a schedule with Axolotl's extras or another name follows its own curve."""
    from shardforge.train.schedules import continues

    assert all(continues(_cfg(lr_scheduler=n)) for n in ("cosine", "linear", "constant"))
    assert not continues(_cfg(cosine_min_lr_ratio=0.1))
    assert not continues(_cfg(lr_scheduler="rex"))
    assert not continues(_cfg(lr_scheduler="constant_with_warmup"))
