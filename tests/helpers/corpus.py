"""The corpus of Axolotl-shaped configs (tests/config/axolotl_corpus): each file's expectation
(its first line), its placeholders filled in, and the tiny data files its datasets name."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.tiny import tiny_conversations, tiny_texts, write_jsonl

CORPUS = Path(__file__).resolve().parents[1] / "config" / "axolotl_corpus"


def corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.yml"))


def expectation(path: Path) -> tuple[str, list[str]]:
    """("ok", []) for `# expect: train-ok`, ("unsupported", keys) for
    `# expect: train-unsupported: key, key`."""
    first = path.read_text().splitlines()[0]
    m = re.match(r"#\s*expect:\s*(train-ok|train-unsupported:\s*(.*))$", first)
    assert m, f"{path.name}: first line must be '# expect: ...'"
    if m.group(1) == "train-ok":
        return "ok", []
    return "unsupported", [k.strip() for k in (m.group(2) or "").split(",") if k.strip()]


def materialize(
    path: Path,
    into: Path,
    base: Path | None = None,
    output_dir: Path | None = None,
    chat_template: str = "chatml",
    data: Path | None = None,
    tiny_llama: bool = False,
) -> Path:
    """The corpus file with its placeholders filled in, written to `into`. `tiny_llama`: for
    the tiny Llama on a CPU (its block class; an attention kernel CPUs have)."""
    text = path.read_text()
    text = text.replace("TINY_MODEL", str(base or into / "base"))
    text = text.replace("OUTPUT_DIR", str(output_dir or into / "out"))
    text = text.replace("DATA_DIR", str(data or into)).replace("CHAT_TEMPLATE", chat_template)
    if tiny_llama:
        text = re.sub(r"\b\w+DecoderLayer\b", "LlamaDecoderLayer", text)
        text = text.replace("flash_attention: true", "sdp_attention: true")
        text = text.replace("attn_implementation: flash_attention_2", "attn_implementation: sdpa")
    into.mkdir(parents=True, exist_ok=True)
    out = into / path.name
    out.write_text(text)
    return out


def write_data(root: Path) -> None:
    """The five data files the corpus configs name (tiny, deterministic)."""
    texts = tiny_texts(24, seed=3)
    chats = tiny_conversations(12, seed=3)
    write_jsonl(root / "stories.jsonl", [{"text": t} for t in texts])
    write_jsonl(root / "chats.jsonl", [{"messages": m, "thinking": ""} for m in chats])
    sharegpt = [
        {
            "conversations": [
                {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                for m in conv
            ]
        }
        for conv in chats
    ]
    write_jsonl(root / "sharegpt.jsonl", sharegpt)
    write_jsonl(
        root / "alpaca.jsonl",
        [
            {"instruction": "Tell me a story.", "input": t[:20] if i % 2 else "", "output": t}
            for i, t in enumerate(texts)
        ],
    )
    write_jsonl(
        root / "segments.jsonl",
        [
            {"segments": [{"text": "Q: story? ", "label": False}, {"text": t, "label": True}]}
            for t in texts
        ],
    )
