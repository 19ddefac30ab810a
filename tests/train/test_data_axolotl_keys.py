"""The data keys of Axolotl's SFT configs: each changes the rows, tokens or labels as in Axolotl
(in process, a tiny tokenizer; no ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from helpers.tiny import CHAT_TEMPLATE, make_tokenizer, write_jsonl
from shardforge.config import validate_cfg
from shardforge.config.schema import DatasetConfig
from shardforge.errors import ConfigError
from shardforge.train.chat import chat_sample
from shardforge.train.data import load_samples, load_tokenizer, tokenizer_kwargs
from shardforge.train.readers import read_rows
from shardforge.train.rows import IGNORE_INDEX, RowError, Sample, TokenizeOptions

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples" / "tiny-llama" / "base"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "The cat sees the moon."},
]
ROWS = [{"text": f"row {i} text"} for i in range(10)]


@pytest.fixture(scope="module")
def tok() -> Any:
    t = make_tokenizer(320)
    t.chat_template = CHAT_TEMPLATE
    return t


def _chat(tok: Any, row: dict[str, Any], opts: TokenizeOptions | None = None, **ds: Any) -> Sample:
    entry = DatasetConfig(path="x", type="chat_template", **ds)
    return chat_sample(row, entry, tok, opts or TokenizeOptions())


def _text(tok: Any, s: Sample) -> str:
    return str(tok.decode(s.input_ids))


def _trained(tok: Any, s: Sample) -> str:
    pairs = zip(s.input_ids, s.labels, strict=True)
    return str(tok.decode([t for t, lab in pairs if lab != IGNORE_INDEX]))


def _texts(rows: list[dict[str, Any]]) -> list[str]:
    return [r["text"] for r in rows]


def test_data_files_name_shards_and_weight_select_rows(tmp_path: Path) -> None:
    from datasets import Dataset

    folder = tmp_path / "set"
    write_jsonl(folder / "a.jsonl", ROWS[:4])
    write_jsonl(folder / "b.jsonl", ROWS[4:])
    write_jsonl(folder / "small" / "s.jsonl", ROWS[:2])
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: small\n  data_files: small/*.jsonl\n---\n# set\n"
    )
    entry = {"path": str(folder)}
    assert _texts(read_rows(DatasetConfig(**entry), "d")) == _texts(ROWS)
    only_b = DatasetConfig(**entry, data_files=["b.jsonl"])
    assert _texts(read_rows(only_b, "d")) == _texts(ROWS[4:])
    assert _texts(read_rows(DatasetConfig(**entry, name="small"), "d")) == _texts(ROWS[:2])
    with pytest.raises(ConfigError, match=r"d\.name: 'big' is not a configuration .*small"):
        read_rows(DatasetConfig(**entry, name="big"), "d")
    sharded = read_rows(DatasetConfig(**entry, shards=3, shards_idx=1), "d", seed=7)
    expected = Dataset.from_list(ROWS).shuffle(seed=7).shard(num_shards=3, index=1)
    assert _texts(sharded) == list(expected["text"])
    cfg = {"base_model": "unused", "sequence_len": 64, "shuffle_merged_datasets": False}
    tok = make_tokenizer(320)
    plain = load_samples(validate_cfg({**cfg, "datasets": [entry]}), tok)
    twice = load_samples(validate_cfg({**cfg, "datasets": [{**entry, "weight": 2}]}), tok)
    half = load_samples(validate_cfg({**cfg, "datasets": [{**entry, "weight": 0.5}]}), tok)
    assert twice == plain + plain and len(half) == 5 and all(s in plain for s in half)


def test_top_level_keys_merge_filter_and_shard_samples(tmp_path: Path) -> None:
    tok = make_tokenizer(320)
    short = {"text": "a"}
    long = {"text": " ".join(["word"] * 60)}
    rows = [*ROWS, ROWS[0], short, long]
    entry = {"path": str(write_jsonl(tmp_path / "d.jsonl", rows))}
    other = {"path": str(write_jsonl(tmp_path / "e.jsonl", ROWS[:3]))}
    base = {"base_model": "unused", "sequence_len": 16, "datasets": [entry]}

    def samples(**extra: Any) -> list[Sample]:
        return load_samples(validate_cfg({**base, "shuffle_merged_datasets": False, **extra}), tok)

    plain = samples()
    n = len(rows)
    assert len(plain) == n and len(samples(min_sample_len=6)) < n
    assert len(samples(dataset_exact_deduplication=True)) == n - 1
    assert len(samples(excess_length_strategy="drop")) == n - 1
    assert max(len(s.input_ids) for s in samples(excess_length_strategy="truncate")) == 16
    with pytest.raises(ConfigError, match="excess_length_strategy: sample 13 of datasets"):
        samples(excess_length_strategy="raise")
    assert samples(dataset_shard_num=4, dataset_shard_idx=0) == plain[:4]
    shuffled = load_samples(validate_cfg(base), tok)  # shuffle_merged_datasets: true
    assert sorted(map(str, shuffled)) == sorted(map(str, plain)) and shuffled != plain
    two = {"datasets": [entry, other]}
    kept = samples(**two)
    before = samples(**two, shuffle_before_merging_datasets=True)
    assert before[n:] != kept[n:] and sorted(map(str, before)) == sorted(map(str, kept))


def test_chat_entry_keys_change_the_rendering(tok: Any) -> None:
    row = {"messages": CONVERSATION}
    plain = _text(tok, _chat(tok, row))
    assert "<|im_start|>" in _text(tok, _chat(tok, row, chat_template="chatml"))
    jinja = "{% for m in messages %}#{{ m['content'] }}{% endfor %}"
    assert _text(tok, _chat(tok, row, chat_template_jinja=jinja)).startswith("#Be brief.")
    assert "Be brief." in plain
    assert "Be brief." not in _text(tok, _chat(tok, row, drop_system_message=True))
    show = "{% for m in messages %}[{{ m.get('why', '') }}]{{ m['content'] }}{% endfor %}"
    thinking = [{"role": "user", "content": "Q", "reason": "R1"}]
    assert "[R1]Q" in _text(
        tok,
        _chat(
            tok,
            {"messages": thinking},
            chat_template_jinja=show,
            field_thinking="reason",
            template_thinking_key="why",
        ),
    )
    split = [{"role": "assistant", "content": "<think>R2</think>Answer"}]
    splitting = {"chat_template_jinja": show, "template_thinking_key": "why"}
    assert "[R2]Answer" in _text(
        tok, _chat(tok, {"messages": split}, **splitting, split_thinking=True)
    )
    assert "[]<think>" in _text(tok, _chat(tok, {"messages": split}, **splitting))
    tools = "{% if tools %}T{{ tools | length }}{% endif %}{{ messages[0]['content'] }}{{ v }}"
    with_tools = {"messages": CONVERSATION, "fns": [{"name": "f"}, {"name": "g"}]}
    opts = TokenizeOptions(template_kwargs={"v": "KW"})
    assert _text(
        tok, _chat(tok, with_tools, opts, chat_template_jinja=tools, field_tools="fns")
    ) == ("T2Be brief.KW")


def test_tool_json_text_is_parsed_for_the_template(tok: Any) -> None:
    """Tool-call arguments and tool parameters given as JSON text reach the template as
    mappings; bad JSON is the row's error, naming the entry's key at fault."""
    show = (
        "{% for t in tools %}{{ t.function.parameters.type }}{% endfor %}"
        "{% for m in messages %}{% for c in m.get('tool_calls', []) %}"
        "{{ c.function.arguments.x }}{% endfor %}{{ m['content'] }}{% endfor %}"
    )

    def row(arguments: str, parameters: str) -> dict[str, Any]:
        call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        answer = {"role": "assistant", "content": "A", "tool_calls": [call]}
        return {"messages": [{"role": "user", "content": "Q"}, answer], "tools": [tool]}

    good = _chat(tok, row('{"x": "ARG"}', '{"type": "object"}'), chat_template_jinja=show)
    assert _text(tok, good).startswith("objectQARGA")
    for bad, field, what in (
        (row("{x", "{}"), "field_messages", "tool call arguments"),
        (row("{}", "{x"), "field_tools", "tool parameters"),
    ):
        with pytest.raises(RowError, match=what) as caught:
            _chat(tok, bad, chat_template_jinja=show)
        assert caught.value.field == field


def test_per_message_training_flags_and_details(tok: Any) -> None:
    flagged = [
        {"role": "user", "content": "Tell me a story.", "train": True},
        {"role": "assistant", "content": "The cat sees the moon.", "train": False},
    ]
    trained = _trained(tok, _chat(tok, {"messages": flagged}, message_field_training="train"))
    assert "Tell me a story." in trained and "moon" not in trained
    detail = [
        {"role": "user", "content": "Tell me a story."},
        {
            "role": "assistant",
            "content": "The cat sees the moon.",
            "d": [{"begin_offset": 0, "end_offset": 6, "train": True}],
        },
    ]
    part = _trained(tok, _chat(tok, {"messages": detail}, message_field_training_detail="d"))
    assert "The cat" in part and "moon" not in part


def test_train_on_eos_and_eot_choose_the_end_tokens(tok: Any) -> None:
    row = {"messages": [*CONVERSATION[1:], {"role": "user", "content": "More?"}]}
    row["messages"].append({"role": "assistant", "content": "A dog finds a ball."})

    def ends(**ds: Any) -> int:
        s = _chat(tok, row, **ds)
        return sum(1 for t, lab in zip(s.input_ids, s.labels, strict=True) if lab == t == 2)

    eos = tok.convert_tokens_to_ids("</s>")
    assert eos == 2
    assert ends() == 2  # turn: the EOS after each trained (assistant) turn
    assert ends(train_on_eos="none") == 0
    assert ends(train_on_eos="all") == 4
    assert ends(train_on_eos="last") == 1
    assert ends(train_on_eos="all", train_on_eot="all") == 4
    with pytest.raises(Exception, match=r"train_on_eos .* and train_on_eot .* differ"):
        _chat(tok, row, train_on_eos="all", train_on_eot="none")


def test_tokenizer_keys_and_the_default_system_message() -> None:
    cfg = validate_cfg(
        {
            "base_model": str(BASE),
            "chat_template": "qwen2_vl",
            "default_system_message": "You are a pirate.",
        }
    )
    template = load_tokenizer(cfg).chat_template
    assert "You are a pirate." in template and "helpful assistant" not in template
    kwargs = tokenizer_kwargs(
        validate_cfg({"base_model": "m", "tokenizer_use_fast": False, "tokenizer_legacy": False})
    )
    assert kwargs["use_fast"] is False and kwargs["legacy"] is False
    assert tokenizer_kwargs(validate_cfg({"base_model": "m"}))["use_fast"] is True
