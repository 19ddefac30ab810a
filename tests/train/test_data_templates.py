"""Chat templates by name: resolution, the config's `chat_template`, and how each one trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.tiny import CHAT_TEMPLATE, make_tokenizer
from shardforge.config import load_cfg
from shardforge.config.chat_templates import (
    CHAT_TEMPLATE_NAMES,
    CHAT_TEMPLATES,
    SPECIAL_NAMES,
    resolve_chat_template,
)
from shardforge.config.schema import DatasetConfig
from shardforge.errors import ConfigError
from shardforge.train.data import IGNORE_INDEX, TokenizeOptions, load_tokenizer, tokenize_row

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "tiny-llama" / "base"  # ships a tokenizer with its own template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "The cat sees the moon."},
    {"role": "user", "content": "More?"},
    {"role": "assistant", "content": "A dog finds a red ball."},
]

# what each template writes around an assistant turn (its published format)
MARKERS = {
    "chatml": "<|im_start|>assistant\nThe cat sees the moon.<|im_end|>\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\nThe cat sees the moon.<|eot_id|>",
    "mistral": "[INST] Be brief.\n\nTell me a story. [/INST]The cat sees the moon.</s>[INST]",
    # gemma3: Gemma's format with the system message in the first turn (gemma has no system)
    "gemma3": "<start_of_turn>model\nThe cat sees the moon.<end_of_turn>\n",
    "qwen_25": "<|im_start|>assistant\nThe cat sees the moon.<|im_end|>\n",
    "phi_3": "<|assistant|>\nThe cat sees the moon.<|end|>\n",
    "alpaca": "### Instruction:\nTell me a story.\n\n### Response:\nThe cat sees the moon.</s>",
}


def test_every_name_has_a_template() -> None:
    """Every name's text: tests/config/test_chat_formats.py; here, how some of them train."""
    assert set(CHAT_TEMPLATES) == set(CHAT_TEMPLATE_NAMES) - set(SPECIAL_NAMES) >= set(MARKERS)


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_named_template_renders_its_format_and_trains_assistant_turns(name: str) -> None:
    tok = make_tokenizer(320)
    tok.chat_template = CHAT_TEMPLATES[name]
    ds = DatasetConfig(path="x", type="chat_template")
    sample = tokenize_row({"messages": CONVERSATION}, ds, tok, TokenizeOptions())
    assert MARKERS[name] in tok.decode(sample.input_ids)
    pairs = zip(sample.input_ids, sample.labels, strict=True)
    trained = tok.decode([t for t, lab in pairs if lab != IGNORE_INDEX])
    # prefix-consistent: each assistant turn (and what ends it) is a target, nothing else is
    assert trained.startswith("The cat sees the moon.")
    assert "A dog finds a red ball." in trained
    for prompt_text in ("Be brief.", "Tell me a story.", "More?", "user", "<s>"):
        assert prompt_text not in trained, (name, trained)


def test_resolve_chat_template() -> None:
    own = "{{ messages }}"
    assert resolve_chat_template(None, None, own) == own
    assert resolve_chat_template(None, None, None) is None
    assert resolve_chat_template("tokenizer_default", None, own) == own
    assert resolve_chat_template("jinja", "{% x %}", own) == "{% x %}"
    assert resolve_chat_template("{{ 'text' }}", None, own) == "{{ 'text' }}"
    assert resolve_chat_template("llama3", None, own) == CHAT_TEMPLATES["llama3"]
    with pytest.raises(ConfigError, match="chat_template: tokenizer_default: the tokenizer has no"):
        resolve_chat_template("tokenizer_default", None, None)
    with pytest.raises(ConfigError, match="chat_template: unknown template name 'llama9'"):
        resolve_chat_template("llama9", None, own)


def _load(tmp_path: Path, **keys: Any) -> Any:
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump({"base_model": str(BASE), **keys}))
    return load_cfg(path).to_model()


def test_chat_template_name_in_the_config_sets_the_tokenizer_template(tmp_path: Path) -> None:
    tok = load_tokenizer(_load(tmp_path, chat_template="chatml"))
    assert tok.chat_template == CHAT_TEMPLATES["chatml"]  # the template, not the word "chatml"
    text = tok.apply_chat_template(CONVERSATION[1:3], tokenize=False)
    assert text == (
        "<|im_start|>user\nTell me a story.<|im_end|>\n"
        "<|im_start|>assistant\nThe cat sees the moon.<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # null and tokenizer_default keep the tokenizer's own; jinja takes chat_template_jinja
    assert load_tokenizer(_load(tmp_path)).chat_template == CHAT_TEMPLATE
    assert load_tokenizer(_load(tmp_path, chat_template="tokenizer_default")).chat_template == (
        CHAT_TEMPLATE
    )
    custom = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    jinja = _load(tmp_path, chat_template="jinja", chat_template_jinja=custom)
    assert load_tokenizer(jinja).chat_template == custom


def test_unknown_template_name_is_rejected_by_load_cfg_for_train(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yml"
    path.write_text(yaml.safe_dump({"base_model": str(BASE), "chat_template": "llama9"}))
    with pytest.raises(ConfigError, match=r"chat_template.*unknown template name 'llama9'"):
        load_cfg(path, command="train")
