"""`chat_template` values: names, the tokenizer's own, fallbacks, Jinja text or file; per command,
an unknown name is an error for train (with the list), a notice for load_cfg, unread elsewhere."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from shardforge.config import load_cfg
from shardforge.config.chat_templates import (
    CHAT_TEMPLATE_NAMES,
    CHAT_TEMPLATES,
    resolve_chat_template,
    template_problem,
)
from shardforge.errors import ConfigError

OWN = "{{ messages }}"


def test_names_and_the_tokenizers_own() -> None:
    assert resolve_chat_template(None, None, OWN) == OWN
    assert resolve_chat_template(None, None, None) is None
    assert resolve_chat_template("tokenizer_default", None, OWN) == OWN
    assert resolve_chat_template("gemma3", None, OWN) == CHAT_TEMPLATES["gemma3"]
    assert resolve_chat_template("{{ 'text' }}", None, OWN) == "{{ 'text' }}"
    with pytest.raises(ConfigError, match="chat_template: tokenizer_default: the tokenizer has no"):
        resolve_chat_template("tokenizer_default", None, None)


def test_fallback_names_take_the_tokenizers_own_first() -> None:
    assert resolve_chat_template("tokenizer_default_fallback_chatml", None, OWN) == OWN
    fallback = resolve_chat_template("tokenizer_default_fallback_chatml", None, None)
    assert fallback == CHAT_TEMPLATES["chatml"]
    assert "unknown template name" in str(template_problem("tokenizer_default_fallback_x", None))


def test_jinja_text_or_file_as_axolotl_reads_it(tmp_path: Path) -> None:
    """`chat_template_jinja` alone means `jinja`; it may name a file holding the template."""
    text = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert resolve_chat_template("jinja", text, OWN) == text
    assert resolve_chat_template(None, text, OWN) == text
    path = tmp_path / "t.jinja"
    path.write_text(text)
    assert resolve_chat_template("jinja", str(path), OWN) == text
    assert template_problem("jinja", None) == (
        "chat_template: jinja needs the template in chat_template_jinja"
    )


def test_an_unknown_name_lists_every_name() -> None:
    with pytest.raises(ConfigError) as err:
        resolve_chat_template("gemma9", None, OWN)
    first, *names = err.value.problems[0].splitlines()
    assert first == "unknown template name 'gemma9' (did you mean 'gemma'?); use one of"
    listed = " ".join(names).replace(",", " ").split()
    assert set(CHAT_TEMPLATE_NAMES) | {"tokenizer_default_fallback_<name>"} <= set(listed)
    assert all(len(line) < 120 for line in names)  # detail lines of an error, each short
    assert len(CHAT_TEMPLATE_NAMES) == 39  # Axolotl's 37, phi_4 and shardforge's mistral


def write(tmp_path: Path, **keys: object) -> Path:
    p = tmp_path / "cfg.yml"
    p.write_text(yaml.safe_dump({"base_model": "m", **keys}))
    return p


def test_train_refuses_an_unknown_name_with_the_list(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_cfg(write(tmp_path, chat_template="gemma9"), command="train")
    [problem] = err.value.problems
    assert problem.startswith("chat_template: unknown template name 'gemma9' (did you mean")
    assert "gemma3" in problem
    with pytest.raises(ConfigError, match="jinja needs the template in chat_template_jinja"):
        load_cfg(write(tmp_path, chat_template="jinja"), command="train")


def test_every_axolotl_name_loads_for_train(tmp_path: Path) -> None:
    for name in CHAT_TEMPLATE_NAMES:
        if name != "jinja":
            assert load_cfg(write(tmp_path, chat_template=name), command="train").chat_template


def test_the_other_commands_do_not_fail_on_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """load_cfg (all commands): a notice; merge and inspect: the value is not checked here (the
    merge keeps the tokenizer's own template when it writes one)."""
    p = write(tmp_path, chat_template="gemma9")
    with caplog.at_level(logging.WARNING, logger="shardforge"):
        assert load_cfg(p).chat_template == "gemma9"
    assert "unknown template name 'gemma9'" in caplog.text and "train refuses it" in caplog.text
    assert load_cfg(p, command="merge").chat_template == "gemma9"
    assert load_cfg(p, command="inspect").base_model == "m"


def test_docs_list_every_name() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    table = docs[docs.index("### Chat template names") :]
    table = table[: table.index("\n\n", table.index("| name | format |"))]
    for name in CHAT_TEMPLATE_NAMES:
        assert f"`{name}`" in table, name
