"""Tied weights (a tied-embedding Qwen2 whose checkpoint stores both `lm_head.weight` and
`model.embed_tokens.weight`): equal copies are stored once, as save_pretrained does, and
verified; copies that differ are an error naming both keys. The training FULL_STATE_DICT save
and the merge apply the same rule (`keys.stored_once`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.tiny import make_model
from shardforge.errors import CheckpointError
from shardforge.keymap.keys import check_tied_copies, stored_once, tied_pairs
from shardforge.merge.api import merge_fsdp_weights
from shardforge.merge.check import build_expected, load_config

TARGET, SOURCE = "lm_head.weight", "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny tied Qwen2 and its full state dict (both tied names, one tensor)."""
    from transformers import AutoModelForCausalLM

    base = make_model(tmp_path_factory.mktemp("tied") / "base", "qwen2", seed=3)
    model = AutoModelForCausalLM.from_pretrained(base)
    assert model.config.tie_word_embeddings
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert TARGET in state and SOURCE in state
    return base, state


def _save(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=directory, no_dist=True)
    return directory


def _cfg(base: Path, tmp_path: Path) -> dict[str, Any]:
    return {"base_model": str(base), "output_dir": str(tmp_path / "run")}


def test_the_architecture_names_the_tied_pair(qwen2: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from transformers import AutoModelForCausalLM

    base, _ = qwen2
    config = load_config(str(base), False)
    expected = build_expected(config, False)
    assert expected.tied == {TARGET: SOURCE}
    assert TARGET not in expected.saved_names and SOURCE in expected.saved_names
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert tied_pairs(model, config) == expected.tied


def test_equal_copies_are_stored_once_and_verified(
    qwen2: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    from safetensors import safe_open

    base, state = qwen2
    ckpt = _save(tmp_path / "dcp", state)  # both names stored, as without dedup
    out = merge_fsdp_weights(
        _cfg(base, tmp_path), tmp_path / "out", checkpoint=ckpt, verify=True, quiet=True
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_tensor(SOURCE)
    assert TARGET not in names and SOURCE in names
    assert torch.equal(embed, state[SOURCE])


def test_copies_that_differ_are_an_error_naming_both(
    qwen2: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    base, state = qwen2
    changed = {**state, TARGET: state[TARGET].clone()}
    changed[TARGET][5, 7] += 1.0
    ckpt = _save(tmp_path / "dcp", changed)
    with pytest.raises(CheckpointError) as err:
        merge_fsdp_weights(_cfg(base, tmp_path), tmp_path / "out", checkpoint=ckpt, quiet=True)
    message = str(err.value)
    assert f"tied weights {TARGET} and {SOURCE} with different values" in message
    assert str(ckpt) in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_the_rule_on_tensors_as_training_saves_them(
    qwen2: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """What `train.checkpointing.save_full_model` runs on the gathered state dict."""
    _, state = qwen2
    tied = {TARGET: SOURCE}
    assert check_tied_copies(tied, state, lambda t: t, "the model") == [TARGET]
    assert stored_once(state, tied) == [k for k in state if k != TARGET]
    negzero = {**state, TARGET: state[SOURCE].clone()}
    negzero[TARGET][0, 0] = -0.0 if state[SOURCE][0, 0] == 0.0 else -state[SOURCE][0, 0]
    with pytest.raises(CheckpointError, match="tied weights"):
        check_tied_copies(tied, negzero, lambda t: t, "the model")
