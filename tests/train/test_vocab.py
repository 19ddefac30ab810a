"""Added tokens: the tokenizer, the grown vocab_size, the new embedding rows, a real run."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.tiny import make_config, make_model, make_tokenizer
from shardforge.config import validate_cfg
from shardforge.errors import ConfigError
from shardforge.train.loop import run_training
from shardforge.train.model import build_meta_model, read_full_state_dict
from shardforge.train.vocab import add_config_tokens, grow_vocab_size, mean_rows

ADDED = {"tokens": ["<x1>", "<x2>"], "special_tokens": {"pad_token": "<|pad|>"}}


def _cfg(**keys: Any) -> Any:
    return validate_cfg({"base_model": "unused", **keys})


def test_config_tokens_are_added_once_and_encode_to_one_token() -> None:
    tok = make_tokenizer(320)
    n = len(tok)
    cfg = _cfg(
        special_tokens={"pad_token": "<|pad|>", "eos_token": "</s>"},  # </s> is already there
        tokens=["<x1>", "<x2>"],
        eot_tokens=["<|im_end|>", "</s>"],
    )
    assert add_config_tokens(tok, cfg) == 4
    assert len(tok) == n + 4
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id == n
    assert tok.eos_token == "</s>" and tok.eos_token_id == 2
    for text in ["<|pad|>", "<x1>", "<x2>", "<|im_end|>"]:
        ids = tok("a" + text + "b", add_special_tokens=False)["input_ids"]
        assert tok.convert_tokens_to_ids(text) in ids and len(tok(text)["input_ids"]) == 1
    assert add_config_tokens(tok, cfg) == 0  # idempotent: every rank, every run the same ids


def test_unknown_special_token_role_names_its_key() -> None:
    with pytest.raises(ConfigError, match=r"special_tokens\.end_token: not a special-token role"):
        add_config_tokens(make_tokenizer(320), _cfg(special_tokens={"end_token": "<e>"}))


def test_new_rows_are_the_mean_as_transformers_mean_resizing() -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama", 320))
    old = {k: v.clone() for k, v in model.state_dict().items()}
    model.resize_token_embeddings(323, mean_resizing=True)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        ours = mean_rows(old[key], 323)
        assert ours.shape == (323, 64) and torch.equal(ours[:320], old[key])
        # transformers samples around the mean with 1e-9 x the covariance: equal up to that noise
        torch.testing.assert_close(ours, model.state_dict()[key], rtol=0, atol=1e-5)
        assert not torch.allclose(ours[320:], torch.zeros(3, 64), atol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # untied and tied embeddings
def test_grown_config_builds_and_loads_the_new_rows(model_type: str, tmp_path: Path) -> None:
    base = make_model(tmp_path / "base", model_type, vocab_size=320)
    cfg = _cfg(**ADDED)
    tok = make_tokenizer(320)
    add_config_tokens(tok, cfg)
    model_config = make_config(model_type, 320)
    assert grow_vocab_size(model_config, tok) == 323 == model_config.vocab_size
    assert grow_vocab_size(make_config(model_type, 400), tok) == 400  # never shrunk
    model = build_meta_model(cfg, model_config)
    assert model.get_input_embeddings().weight.shape == (323, 64)
    assert model.get_output_embeddings().weight.shape == (323, 64)
    weights = read_full_state_dict(str(base), model)
    from safetensors.torch import load_file

    stored = load_file(str(base / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        source = stored.get(key, stored["model.embed_tokens.weight"])  # tied: stored once
        assert weights[key].shape == (323, 64)
        assert torch.equal(weights[key][:320], source)
        assert torch.equal(weights[key][320:], source.mean(0, keepdim=True).expand(3, 64))


def test_training_with_added_tokens_saves_the_grown_vocab(
    base_cfg: dict[str, Any], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    cfg = {**base_cfg, **ADDED, "output_dir": str(out), "max_steps": 2, "save_steps": None}
    run_training(validate_cfg(cfg))  # one rank, in this process (gloo)
    assert not torch.distributed.is_initialized()  # a caller's process: the group is destroyed

    assert json.loads((out / "config.json").read_text())["vocab_size"] == 323
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 323 and tok.pad_token == "<|pad|>"
    ids = [tok.convert_tokens_to_ids(t) for t in ("<x1>", "<x2>", "<|pad|>")]
    assert sorted(ids) == [320, 321, 322]

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    state = model.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(out / "checkpoint-2" / "model"), no_dist=True)
    base = load_file(str(Path(base_cfg["base_model"]) / "model.safetensors"))
    embed = state["model.embed_tokens.weight"]
    assert embed.shape == state["lm_head.weight"].shape == (323, 64)
    assert not torch.equal(embed[:320], base["model.embed_tokens.weight"])  # it trained
    # <x1> and <x2> never occur in the data: their input rows got no gradient (AdamW, no decay)
    # and are still the mean of the base rows, filled in when the base weights were read
    mean = base["model.embed_tokens.weight"].mean(0)
    for row in (ids[0], ids[1]):
        torch.testing.assert_close(embed[row], mean, rtol=0, atol=1e-7)
