"""Data set types (alpaca, input_output, chat_template mappings) and `split` slices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.tiny import make_tokenizer, write_jsonl
from shardforge.config import validate_cfg
from shardforge.config.chat_templates import CHAT_TEMPLATES
from shardforge.config.schema import DatasetConfig
from shardforge.errors import ConfigError
from shardforge.train.data import (
    IGNORE_INDEX,
    Sample,
    TokenizeOptions,
    load_samples,
    read_rows,
    tokenize_row,
)

TRAIN_ALL = TokenizeOptions(train_on_inputs=True)


@pytest.fixture(scope="module")
def tok() -> Any:
    """The tiny tokenizer with the ChatML template; like most, it adds no BOS by itself."""
    tok = make_tokenizer(320)
    tok.chat_template = CHAT_TEMPLATES["chatml"]
    return tok


@pytest.fixture(scope="module")
def bos_tok() -> Any:
    """The tiny tokenizer made to put BOS in front of every text, as Llama's does."""
    from tokenizers.processors import TemplateProcessing

    tok = make_tokenizer(320)
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
    )
    assert tok("The cat")["input_ids"][0] == tok.bos_token_id
    return tok


def _trained(tok: Any, sample: Sample, trained: bool = True) -> str:
    """The decoded target tokens of `sample` (or, with trained=False, the masked ones)."""
    pairs = zip(sample.input_ids, sample.labels, strict=True)
    return str(tok.decode([t for t, lab in pairs if (lab != IGNORE_INDEX) == trained]))


ALPACA = DatasetConfig(path="x", type="alpaca")


def test_alpaca_prompt_with_input_masked_response_and_eos_trained(bos_tok: Any) -> None:
    row = {"instruction": "Name a colour.", "input": "The sky.", "output": "Blue."}
    sample = tokenize_row(row, ALPACA, bos_tok, TokenizeOptions())
    ids = sample.input_ids
    assert ids[0] == bos_tok.bos_token_id and bos_tok.bos_token_id not in ids[1:]
    assert ids[-1] == bos_tok.eos_token_id
    assert bos_tok.decode(ids[1:]) == (
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nName a colour.\n\n### Input:\nThe sky.\n\n### Response:\nBlue.</s>"
    )
    assert _trained(bos_tok, sample) == "Blue.</s>"
    assert sample.labels[0] == IGNORE_INDEX
    everything = tokenize_row(row, ALPACA, bos_tok, TRAIN_ALL)
    assert everything.input_ids == ids and everything.labels == ids


@pytest.mark.parametrize("row_input", [{}, {"input": ""}, {"input": None}])
def test_alpaca_without_input_uses_the_no_input_prompt(tok: Any, row_input: dict[str, Any]) -> None:
    row = {"instruction": "Say hi.", "output": "Hi.", **row_input}
    sample = tokenize_row(row, ALPACA, tok, TokenizeOptions())
    assert tok.decode(sample.input_ids) == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nSay hi.\n\n### Response:\nHi.</s>"
    )
    assert _trained(tok, sample) == "Hi.</s>"


def test_alpaca_row_without_output_names_the_key(tok: Any) -> None:
    with pytest.raises(ConfigError, match=r"datasets\[2\]\.type: .*'output'"):
        tokenize_row({"instruction": "x"}, ALPACA, tok, TokenizeOptions(), "datasets[2]")


IO = DatasetConfig(path="x", type="input_output")
SEGMENTS = [
    {"text": "<s>Hello\n", "label": True},
    {"text": "the cat sees ", "label": False},
    {"text": "the moon.</s>", "label": True},
]


@pytest.mark.parametrize("which", ["tok", "bos_tok"])
def test_input_output_concatenates_segments_and_adds_no_bos_or_eos(
    which: str, request: pytest.FixtureRequest
) -> None:
    tok = request.getfixturevalue(which)
    sample = tokenize_row({"segments": SEGMENTS}, IO, tok, TokenizeOptions())
    ids = sample.input_ids
    assert tok.decode(ids) == "<s>Hello\nthe cat sees the moon.</s>"
    # BOS and EOS come from the text only, even with a tokenizer that adds BOS by itself
    assert ids.count(tok.bos_token_id) == 1 and ids.count(tok.eos_token_id) == 1
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert _trained(tok, sample, trained=False) == "the cat sees "
    assert _trained(tok, sample) == "<s>Hello\nthe moon.</s>"
    everything = tokenize_row({"segments": SEGMENTS}, IO, tok, TRAIN_ALL)
    assert everything.labels == ids


def test_input_output_bad_segment_names_the_key(tok: Any) -> None:
    row = {"segments": [{"text": "a", "label": "yes"}]}
    with pytest.raises(ConfigError, match=r"datasets\[1\]\.type: .*segments\[0\]\.label"):
        tokenize_row(row, IO, tok, TokenizeOptions(), "datasets[1]")


SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Tell me a story."},
    {"from": "gpt", "value": "The cat sees the moon."},
    {"from": "human", "value": "More?"},
    {"from": "gpt", "value": "A dog finds a red ball."},
]


def _sharegpt(**extra: Any) -> DatasetConfig:
    return DatasetConfig(
        path="x",
        type="chat_template",
        field_messages="conversations",
        message_property_mappings={"role": "from", "content": "value"},
        **extra,
    )


@pytest.mark.parametrize("roles", [None, {"user": ["human"], "assistant": ["gpt"]}])
def test_chat_sharegpt_rows_mapped_to_template_roles(tok: Any, roles: Any) -> None:
    sample = tokenize_row(
        {"conversations": SHAREGPT}, _sharegpt(roles=roles), tok, TokenizeOptions()
    )
    text = tok.decode(sample.input_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell")
    assert "<|im_start|>assistant\nThe cat sees the moon.<|im_end|>" in text
    assert "human" not in text and "gpt" not in text
    assert _trained(tok, sample) == (
        "The cat sees the moon.<|im_end|>\nA dog finds a red ball.<|im_end|>\n"
    )


def test_chat_roles_to_train_and_train_on_inputs(tok: Any) -> None:
    row = {"conversations": SHAREGPT}
    users = tokenize_row(row, _sharegpt(roles_to_train=["user"]), tok, TokenizeOptions())
    trained = _trained(tok, users)
    assert "Tell me a story." in trained and "More?" in trained
    assert "moon" not in trained and "Be brief" not in trained
    everything = tokenize_row(row, _sharegpt(), tok, TRAIN_ALL)
    assert everything.labels == everything.input_ids


def test_chat_eot_tokens_end_the_trained_turn() -> None:
    tok = make_tokenizer(320)
    tok.chat_template = CHAT_TEMPLATES["chatml"]
    tok.add_tokens(["<|im_end|>"], special_tokens=True)
    opts = TokenizeOptions(eot_tokens=("<|im_end|>",))
    sample = tokenize_row({"conversations": SHAREGPT}, _sharegpt(), tok, opts)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (
        _trained(tok, sample) == "The cat sees the moon.<|im_end|>A dog finds a red ball.<|im_end|>"
    )
    assert sample.labels.count(end) == 2  # the assistant turns' end-of-turn tokens are targets


@pytest.mark.parametrize(
    "message,key",
    [
        ({"from": "human"}, "'value'"),
        ({"speaker": "human", "value": "hi"}, "'from'"),
    ],
)
def test_chat_row_missing_a_mapped_key_names_it(tok: Any, message: Any, key: str) -> None:
    row = {"conversations": [message]}
    with pytest.raises(ConfigError, match=rf"datasets\[0\]\.message_property_mappings: .*{key}"):
        tokenize_row(row, _sharegpt(), tok, TokenizeOptions())
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.field_messages: .*'messages'"):
        tokenize_row(row, DatasetConfig(path="x", type="chat_template"), tok, TokenizeOptions())


@pytest.fixture(scope="module")
def ten_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("split") / "d.jsonl", [{"n": i} for i in range(10)])


@pytest.mark.parametrize(
    "split,expected",
    [
        ("train", list(range(10))),
        ("train[:20%]", [0, 1]),
        ("train[2:5]", [2, 3, 4]),
        ("train[50%:]", [5, 6, 7, 8, 9]),
        ("train[-3:]", [7, 8, 9]),
        ("train[:2]+train[8:]", [0, 1, 8, 9]),
    ],
)
def test_split_slices_local_rows(ten_rows: Path, split: str, expected: list[int]) -> None:
    rows = read_rows(DatasetConfig(path=str(ten_rows), split=split), "datasets[0]")
    assert [r["n"] for r in rows] == expected


@pytest.mark.parametrize("split", ["validation", "train[abc]", "train[:10%]+test"])
def test_split_other_than_train_names_the_key(ten_rows: Path, split: str) -> None:
    with pytest.raises(ConfigError, match=r"datasets\[1\]\.split: .*split `train`"):
        read_rows(DatasetConfig(path=str(ten_rows), split=split), "datasets[1]")


def test_load_samples_mixes_types_and_names_the_bad_row(tmp_path: Path, tok: Any) -> None:
    files = {
        "completion": [{"text": "The cat."}],
        "alpaca": [{"instruction": "Hi.", "output": "Hello."}],
        "input_output": [{"segments": SEGMENTS}],
        "chat_template": [{"messages": [{"role": "user", "content": "Hi."}]}],
    }
    datasets = [
        {"path": str(write_jsonl(tmp_path / f"{t}.jsonl", rows)), "type": t}
        for t, rows in files.items()
    ]
    cfg = validate_cfg(
        {"base_model": "unused", "datasets": datasets, "shuffle_merged_datasets": False}
    )
    samples = load_samples(cfg, tok)
    assert len(samples) == 4
    assert _trained(tok, samples[1]) == "Hello.</s>"
    assert _trained(tok, samples[3]) == ""  # no assistant turn: nothing to train on

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"body": "no text"}])
    cfg = validate_cfg({"base_model": "unused", "datasets": [*datasets, {"path": str(bad)}]})
    with pytest.raises(ConfigError, match=r"datasets\[4\]\.field: row 2 of .*'text'"):
        load_samples(cfg, tok)
