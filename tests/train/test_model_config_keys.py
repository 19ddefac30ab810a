"""Axolotl's model_config (overrides_of_model_config): values set on the model's config before
the model is built, e.g. rope_scaling (in process, the tiny example model's config)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardforge.config import validate_cfg
from shardforge.train.model import load_model_config

BASE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama" / "base"
LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("key", ["model_config", "overrides_of_model_config"])
def test_model_config_changes_the_built_model(key: str) -> None:
    from transformers import AutoModelForCausalLM

    plain = load_model_config(validate_cfg({"base_model": str(BASE)}, command="train"))
    config = load_model_config(
        validate_cfg({"base_model": str(BASE), key: {"rope_scaling": LINEAR}}, command="train")
    )
    assert config.to_dict()["rope_parameters"] == {**plain.to_dict()["rope_parameters"], **LINEAR}
    scaled = AutoModelForCausalLM.from_config(config).model.rotary_emb.inv_freq
    base = AutoModelForCausalLM.from_config(plain).model.rotary_emb.inv_freq
    assert torch.allclose(scaled, base / 2)
