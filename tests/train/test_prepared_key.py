"""What a prepared data set is keyed on: the config keys the data pipeline reads (all of them, and
no others), the data files' and the tokenizer's contents, and what `changes` says changed."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.tiny import make_tokenizer, tiny_conversations, tiny_texts, write_jsonl
from shardforge.config import validate_cfg
from shardforge.config.schema import ShardforgeConfig
from shardforge.train.data import load_tokenizer
from shardforge.train.eval import build_datasets
from shardforge.train.prepared_key import (
    TOKEN_KEYS,
    TOKENIZER_SOURCE_KEYS,
    changes,
    digest,
    key_inputs,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer folder, completion data and chat data."""
    root = tmp_path_factory.mktemp("key")
    make_tokenizer(320).save_pretrained(root / "tok")
    write_jsonl(root / "texts.jsonl", [{"text": t} for t in tiny_texts(24, seed=2)])
    write_jsonl(root / "held.jsonl", [{"text": t} for t in tiny_texts(6, seed=5)])
    write_jsonl(root / "chats.jsonl", [{"messages": m} for m in tiny_conversations(8, seed=2)])
    return root


def _cfg(root: Path, **extra: Any) -> ShardforgeConfig:
    data = {
        "base_model": str(root / "tok"),
        "datasets": [{"path": str(root / "texts.jsonl"), "type": "completion"}],
        "sequence_len": 32,
        "sample_packing": True,
        **extra,
    }
    return validate_cfg(data)


class _Reads:
    """A config that records which of its keys are read (as attributes, items or `get`)."""

    def __init__(self, cfg: ShardforgeConfig) -> None:
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "keys_read", set())

    def __getattr__(self, name: str) -> Any:
        self.keys_read.add(name)
        return getattr(self._cfg, name)

    def __getitem__(self, name: str) -> Any:
        self.keys_read.add(name)
        return self._cfg[name]

    def get(self, name: str, default: Any = None) -> Any:
        self.keys_read.add(name)
        return self._cfg.get(name, default)


def test_the_data_pipeline_reads_exactly_the_keys_of_the_hash(root: Path) -> None:
    """Tokenizer and data sets built from recording configs: every config key they read is in
    TOKEN_KEYS (or names the tokenizer's folder, whose files are hashed), and every key there is
    read by one of them. A new key the pipeline reads fails here until it is added."""
    chats = {"path": str(root / "chats.jsonl"), "type": "chat_template"}
    configs = [
        _cfg(root, val_set_size=0.25, tokens=["<x1>"], special_tokens={"pad_token": "<pad>"}),
        _cfg(
            root,
            tokenizer_config=str(root / "tok"),
            datasets=[chats],
            test_datasets=[{"path": str(root / "held.jsonl"), "type": "completion"}],
            chat_template="jinja",
            chat_template_jinja="{% for m in messages %}{{ m['content'] }}</s>{% endfor %}",
            eot_tokens=["</s>"],
            eval_sequence_len=48,
            eval_sample_packing=False,
            train_on_inputs=True,
        ),
    ]
    read: set[str] = set()
    for cfg in configs:
        reads = _Reads(cfg)
        tokenizer = load_tokenizer(reads)  # type: ignore[arg-type]
        assert len(build_datasets(reads, tokenizer).train) > 0  # type: ignore[arg-type]
        read |= reads.keys_read
    assert read - set(TOKENIZER_SOURCE_KEYS) == set(TOKEN_KEYS)


def _inputs(cfg: ShardforgeConfig) -> dict[str, Any]:
    return key_inputs(cfg, load_tokenizer(cfg))


def test_each_input_changes_the_hash_and_is_named(root: Path, tmp_path: Path) -> None:
    base = _inputs(_cfg(root))
    cases = {
        "sequence_len: 32 -> 48": _cfg(root, sequence_len=48),
        "sample_packing: True -> False": _cfg(root, sample_packing=False),
        "chat_template: None -> 'chatml'; the tokenizer's chat template changed": _cfg(
            root, chat_template="chatml"
        ),
        "val_set_size: 0.0 -> 0.25": _cfg(root, val_set_size=0.25),
        "seed: 42 -> 3": _cfg(root, seed=3),  # it shuffles the merged samples
        "datasets[0].split: 'train' -> 'train[:50%]'": _cfg(
            root, datasets=[{"path": str(root / "texts.jsonl"), "split": "train[:50%]"}]
        ),
    }
    for said, cfg in cases.items():
        new = _inputs(cfg)
        assert digest(new) != digest(base), said
        assert "; ".join(changes(base, new)) == said


def test_files_count_by_their_contents_not_their_place_or_time(root: Path, tmp_path: Path) -> None:
    """A moved tokenizer folder or touched data file prepares nothing anew; an edited one does,
    and is named."""
    tok = shutil.copytree(root / "tok", tmp_path / "tok")
    data = Path(shutil.copy(root / "texts.jsonl", tmp_path / "texts.jsonl"))
    entry = {"path": str(root / "texts.jsonl"), "type": "completion"}
    here = _inputs(_cfg(root, datasets=[entry]))
    moved = _inputs(_cfg(root, base_model=str(tok), datasets=[entry]))
    assert digest(moved) == digest(here)

    copied = _cfg(root, datasets=[{**entry, "path": str(data)}])
    before = _inputs(copied)
    os.utime(data, (1, 1))
    assert _inputs(copied) == before
    with data.open("a") as f:
        f.write('{"text": "One more."}\n')
    edited = _inputs(copied)
    assert changes(before, edited) == ["datasets[0]: texts.jsonl changed"]

    (tok / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    retemplated = _inputs(_cfg(root, base_model=str(tok)))
    assert changes(moved, retemplated) == [
        "the tokenizer's chat template changed",
        "the tokenizer's chat_template.jinja changed",
    ]


def test_docs_list_the_token_keys() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "preprocess.md").read_text()
    block = text.split("<!-- token-keys:start -->")[1].split("<!-- token-keys:end -->")[0]
    assert list(dict.fromkeys(re.findall(r"`(\w+)`", block))) == list(TOKEN_KEYS)
    for key, needs in TOKEN_KEYS.items():
        if needs is not None:
            assert f"`{key}` (only with `{needs}`" in " ".join(block.split()), key


def test_versions_and_the_format_are_named() -> None:
    old = {"format": 1, "versions": {"transformers": "5.1.0"}, "tokenizer": {"files": {}}}
    new = {"format": 2, "versions": {"transformers": "5.2.0"}, "tokenizer": {"files": {"a": "1"}}}
    assert changes(old, new) == [
        "format changed",
        "the tokenizer's a was added",
        "transformers 5.1.0 -> 5.2.0",
    ]
