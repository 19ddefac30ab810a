"""DCP keys -> Hugging Face names: wrapper prefixes, wrapper segments, optimizer entries."""

from __future__ import annotations

import pytest

from shardforge.keymap.keys import clean_name, map_keys

HF = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"]


def _paths(keys: list[str]) -> dict[str, tuple[str, ...]]:
    return {k: tuple(k.split(".", 1)) if k.startswith("model.") else (k,) for k in keys}


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("_orig_mod.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
        (
            "model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ),
        ("module.lm_head.weight", "lm_head.weight"),
        ("model.module_list.weight", "model.module_list.weight"),  # a real name is kept
    ],
)
def test_clean_name(raw: str, clean: str) -> None:
    assert clean_name(raw) == clean


@pytest.mark.parametrize(
    "prefix",
    ["", "model.", "state_dict.", "model.model.", "model._orig_mod.", "module.", "model.module."],
)
def test_wrapper_prefix_is_found_by_matching_the_expected_names(prefix: str) -> None:
    keys = [prefix + n for n in HF]
    km = map_keys({k: tuple(k.split(".")) for k in keys}, HF)
    assert sorted(km.to_hf.values()) == sorted(HF)
    assert km.unexpected == ()


def test_lightning_attribute_prefix_with_optimizer_entries() -> None:
    keys = {f"model.model.{n}": ("model", f"model.{n}") for n in HF}
    keys["optimizer_0.state.model.lm_head.weight.exp_avg"] = ("optimizer_0", "state", "x")
    keys["optim.param_groups.0.lr"] = ("optim", "param_groups")
    km = map_keys(keys, HF)
    assert km.prefix == "model.model."
    assert set(km.to_hf.values()) == set(HF)
    assert len(km.skipped_optimizer) == 2


def test_unknown_leftovers_are_listed() -> None:
    keys = [*HF, "model.extra_head.weight", "value_head.bias"]
    km = map_keys({k: (k,) for k in keys}, HF)
    assert km.unexpected == ("model.extra_head.weight", "value_head.bias")
