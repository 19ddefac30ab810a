"""`inference`: greedy generation from the example's merged output is examples/generate.py's;
the run's latest checkpoint (merged on the fly) gives the same; an adapter on the base model
generates what merge-lora's fused model generates; the chat template shapes the prompt;
sampling is seeded."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from transformers import AutoTokenizer

from helpers.runs import ROOT, Runs
from shardforge.config import load_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.use.inference import encode_prompt, generate, inference
from shardforge.use.model import Loaded, load_model, pick, tokenizer_of
from shardforge.use.request import InferenceRequest, ModelRequest

PROMPTS = ("The robot", "A child finds")
BASE = ROOT / "examples" / "tiny-llama" / "base"


def _example_generate() -> Any:
    """examples/generate.py's `generate(model_dir, prompt, max_new_tokens)`."""
    spec = importlib.util.spec_from_file_location("example_generate", ROOT / "examples/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate


def _load(cfg: ShardforgeConfig, **which: Any) -> Loaded:
    return load_model(cfg, pick(cfg, ModelRequest(**which)))


def _greedy(loaded: Loaded, cfg: ShardforgeConfig, prompt: str, **options: Any) -> list[int]:
    request = InferenceRequest(prompt=prompt, max_new_tokens=16, **options)
    return generate(loaded, cfg, request).new_ids


@pytest.mark.slow  # the runs are trained under torchrun
def test_greedy_tokens_are_examples_generate_py_s(
    runs: Runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_cfg(runs.full_cfg)
    merged = _load(cfg, model_dir=runs.merged)
    tok = AutoTokenizer.from_pretrained(runs.merged)
    reference = _example_generate()
    for prompt in PROMPTS:
        out = generate(merged, cfg, InferenceRequest(prompt=prompt, max_new_tokens=16))
        assert len(out.new_ids) > 0 and out.prompt_ids == tok(prompt)["input_ids"]
        expected = reference(str(runs.merged), prompt, max_new_tokens=16)
        assert tok.decode(out.prompt_ids + out.new_ids, skip_special_tokens=True) == expected
        assert out.text == tok.decode(out.new_ids, skip_special_tokens=True)
    # no option: the run's latest checkpoint, merged on the fly (into a temporary directory,
    # gone once the model is loaded); the merged output is that one
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with caplog.at_level("INFO", logger="shardforge"):
        latest = inference(cfg, PROMPTS[0], max_new_tokens=16)
    assert latest.new_ids == _greedy(merged, cfg, PROMPTS[0])
    assert f"wrote {tmp_path}/shardforge-merged-" in caplog.text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # the runs are trained under torchrun
def test_an_adapter_generates_what_the_fused_model_generates(runs: Runs) -> None:
    cfg = load_cfg(runs.lora_cfg)
    fused = _load(cfg, model_dir=runs.fused)
    adapter = _load(cfg, lora_model_dir=runs.root / "lora")
    for prompt in PROMPTS:
        assert _greedy(adapter, cfg, prompt) == _greedy(fused, cfg, prompt)
    # no option: the run's adapter in output_dir
    assert inference(cfg, PROMPTS[0], max_new_tokens=16).new_ids == _greedy(fused, cfg, PROMPTS[0])
    # the adapter changes the output: the base model alone generates something else
    base = _load(cfg, model_dir=BASE)
    assert _greedy(base, cfg, PROMPTS[0]) != _greedy(fused, cfg, PROMPTS[0])


@pytest.mark.slow  # the runs are trained under torchrun
def test_sampling_is_seeded_by_the_config(runs: Runs) -> None:
    cfg = load_cfg(runs.full_cfg)
    merged = _load(cfg, model_dir=runs.merged)

    def sample(seed: int) -> list[int]:
        seeded = load_cfg(runs.full_cfg, seed=seed)
        return _greedy(merged, seeded, "The robot", do_sample=True, temperature=1.5, top_k=50)

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    assert sample(1) != _greedy(merged, cfg, "The robot")


def test_the_chat_template_renders_the_prompt_as_a_user_turn(tmp_path: Path) -> None:
    """With chat_template the prompt is one user turn and the assistant's header, tokenized as
    training tokenizes rendered text; without it the text goes in as it is."""
    chat = tmp_path / "chat.yml"
    chat.write_text(yaml.safe_dump({"base_model": str(BASE), "chat_template": "chatml"}))
    cfg = load_cfg(chat)
    tok = tokenizer_of(cfg, BASE)  # the base's tokenizer, the config's template
    ids = encode_prompt(cfg, tok, "Hi there")["input_ids"][0].tolist()
    text = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    plain = tmp_path / "plain.yml"
    plain.write_text(yaml.safe_dump({"base_model": str(BASE)}))
    ids = encode_prompt(load_cfg(plain), tok, "Hi there")["input_ids"][0].tolist()
    assert ids == tok("Hi there")["input_ids"]


def test_chat_data_without_chat_template_use_the_tokenizers_own(tmp_path: Path) -> None:
    """A run of type chat_template data without a chat_template key trained with the
    tokenizer's own template (examples/tiny-llama-chat.yml): the prompt is rendered with it,
    unless --raw_prompt."""
    chat = tmp_path / "chat.yml"
    data = yaml.safe_load((ROOT / "examples" / "tiny-llama-chat.yml").read_text())
    data["datasets"][0]["path"] = str(ROOT / data["datasets"][0]["path"])
    chat.write_text(yaml.safe_dump({**data, "base_model": str(BASE)}))
    cfg = load_cfg(chat)
    assert cfg.chat_template is None
    tok = tokenizer_of(cfg, BASE)
    ids = encode_prompt(cfg, tok, "Tell me a story.")["input_ids"][0].tolist()
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(tok("Tell me a story.")["input_ids"])  # the template's own tokens
    raw = encode_prompt(cfg, tok, "Tell me a story.", raw=True)["input_ids"][0].tolist()
    assert raw == tok("Tell me a story.")["input_ids"]


def test_eot_tokens_end_the_answer(tmp_path: Path) -> None:
    """A config's eot_tokens stop generation as the model's EOS does: made the first token the
    model answers with, the answer is that token alone."""
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump({"base_model": str(BASE), "output_dir": str(tmp_path)}))
    cfg = load_cfg(path)
    base = _load(cfg, model_dir=BASE)
    free = _greedy(base, cfg, "The robot")
    assert len(free) == 16
    first = base.tokenizer.convert_ids_to_tokens(free[0])
    stopped = load_cfg(path, eot_tokens=[first])
    assert _greedy(base, stopped, "The robot") == free[:1]
