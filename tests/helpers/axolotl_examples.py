"""Axolotl's own FSDP example configs (tests/config/axolotl_examples, verbatim below a header
naming their source), pointed at tiny local models and data of the same architecture and kind.

Each file starts with ``# source: ...`` and ``# tiny: <model_type>`` (a key of
`helpers.tiny.TINY_CONFIGS`). `materialize` rewrites four things only, in the text, so every
other key stays as written: ``base_model`` (the tiny model of that type), each dataset's
``path`` (a local file of the rows its ``type`` reads), ``output_dir`` and a set
``dataset_prepared_path`` (inside the test's folder).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from helpers.tiny import make_model, tiny_conversations, tiny_texts, write_jsonl

EXAMPLES = Path(__file__).resolve().parents[1] / "config" / "axolotl_examples"

# data file -> what its rows hold (as the Hub data sets the examples name lay them out)
DATA = {
    "alpaca": "alpaca.jsonl",  # tatsu-lab/alpaca: instruction, input, output
    "sharegpt": "sharegpt.jsonl",  # mlabonne/FineTome-100k: conversations [{from, value}]
    "messages": "messages.jsonl",  # messages [{role, content}]
    "text": "text.jsonl",  # pretraining text
}


def examples() -> list[Path]:
    return sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".yml", ".yaml"))


def tiny_type(path: Path) -> str:
    """The model type of the `# tiny:` header line."""
    m = re.search(r"^# tiny: (\w+)$", path.read_text(), re.M)
    assert m, f"{path.name}: no '# tiny: <model_type>' header line"
    return m.group(1)


def data_kind(entry: dict[str, Any]) -> str:
    """Which of `DATA` a dataset entry of an example reads (by its type and fields)."""
    kind = str(entry.get("type") or "")
    if kind == "alpaca":
        return "alpaca"
    if kind in ("pretrain", "completion"):
        return "text"
    assert kind == "chat_template", f"no tiny data for dataset type {kind!r}"
    mapped = (entry.get("message_property_mappings") or {}).get("role") == "from"
    return "sharegpt" if entry.get("field_messages") == "conversations" and mapped else "messages"


def write_data(root: Path, rows: int = 256) -> None:
    """The files of `DATA` under `root` (tiny, deterministic)."""
    texts = tiny_texts(rows, seed=3)
    chats = tiny_conversations(rows, seed=3)
    write_jsonl(
        root / DATA["alpaca"],
        [
            {"instruction": "Tell me a story.", "input": t[:20] if i % 2 else "", "output": t}
            for i, t in enumerate(texts)
        ],
    )
    roles = {"user": "human", "assistant": "gpt"}
    write_jsonl(
        root / DATA["sharegpt"],
        [
            {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in c]}
            for c in chats
        ],
    )
    write_jsonl(root / DATA["messages"], [{"messages": c} for c in chats])
    write_jsonl(root / DATA["text"], [{"text": t} for t in texts])


def make_models(root: Path, paths: list[Path]) -> None:
    """A tiny random model (save_pretrained: MoE experts per expert) of each examples' type."""
    for model_type in sorted({tiny_type(p) for p in paths}):
        make_model(root / model_type, model_type, vocab_size=320, seed=0)


def _set_top(text: str, key: str, value: str, name: str) -> str:
    new, n = re.subn(rf"^{key}:[^\n]*$", f"{key}: {value}", text, flags=re.M)
    assert n == 1, f"{name}: {key} is not set once at the top level"
    return new


def materialize(path: Path, into: Path, models: Path, data: Path, runs: Path) -> Path:
    """The example with base_model, datasets' paths, output_dir and a set dataset_prepared_path
    pointed into the test's folders, written to `into`; nothing else changes."""
    text = path.read_text()
    cfg = yaml.safe_load(text)
    text = _set_top(text, "base_model", str(models / tiny_type(path)), path.name)
    text = _set_top(text, "output_dir", str(runs / path.stem), path.name)
    if cfg.get("dataset_prepared_path"):
        prepared = str(runs / f"{path.stem}-prepared")
        text = _set_top(text, "dataset_prepared_path", prepared, path.name)
    entries = [*(cfg.get("datasets") or []), *(cfg.get("pretraining_dataset") or [])]
    for entry in entries:  # every dataset path of an example is a Hub name, each set once
        local = str(data / DATA[data_kind(entry)])
        text, n = re.subn(
            rf"^(\s*-?\s*path: ){re.escape(entry['path'])}$", rf"\g<1>{local}", text, flags=re.M
        )
        assert n == 1, f"{path.name}: dataset path {entry['path']} is not written once"
    into.mkdir(parents=True, exist_ok=True)
    out = into / path.name
    out.write_text(text)
    return out
