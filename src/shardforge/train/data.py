"""Training data: local files -> token rows -> fixed-length sequences -> a deterministic order.

    read_rows(ds)                          rows of one data set (json/jsonl/parquet/text)
    tokenize_row(row, ds, tokenizer, ...)  (input_ids, labels) of one row, by data set type
    to_sequences(samples, seq_len, ...)    packed or padded [N, seq_len] tensors
    GlobalOrder(n, seed)                   which sequence sits at each global position

Every rank builds the same sequences and the same order; an optimizer step consumes the next
`global_batch` positions and each rank takes its own slice of them (see `rank_slice`). The data
position saved in checkpoints is the number of positions consumed, so a resumed run continues
exactly, at any world size with the same global batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.config.schema import DatasetConfig, ShardforgeConfig
from shardforge.errors import ConfigError, ShardforgeError

IGNORE_INDEX = -100

# file extension -> ds_type
EXTENSIONS: dict[str, str] = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}

Row = dict[str, Any]


def _read_json(path: Path) -> Iterator[Row]:
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        yield from json.loads(text)
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ShardforgeError(f"{path}:{number}: invalid JSON line ({exc.msg})") from None


def _read_parquet(path: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    yield from pq.read_table(path).to_pylist()


def _read_text(path: Path) -> Iterator[Row]:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            yield {"text": line}


READERS: dict[str, Callable[[Path], Iterator[Row]]] = {
    "json": _read_json,
    "parquet": _read_parquet,
    "text": _read_text,
}


def data_files(ds: DatasetConfig, key: str) -> list[tuple[Path, str]]:
    """(file, ds_type) of a data set entry; a missing path or unknown format names `key`."""
    path = Path(ds.path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in EXTENSIONS and p.is_file())
        if not files:
            raise ConfigError(
                f"{key}.path", [f"directory {path} holds no {'/'.join(EXTENSIONS)} files"]
            )
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"{key}.path", [f"data file {path} not found; check the path"])
    out = []
    for file in files:
        ds_type = ds.ds_type or EXTENSIONS.get(file.suffix)
        if ds_type is None:
            raise ConfigError(
                f"{key}.ds_type",
                [f"cannot infer the format of {file}; set ds_type (json, parquet or text)"],
            )
        out.append((file, ds_type))
    return out


def read_rows(ds: DatasetConfig, key: str) -> list[Row]:
    return [row for file, ds_type in data_files(ds, key) for row in READERS[ds_type](file)]


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    labels: list[int]


def _completion(row: Row, ds: DatasetConfig, tok: Any, chat_template: str | None) -> Sample:
    text = row.get(ds.field)
    if not isinstance(text, str):
        raise ShardforgeError(f"{ds.path}: a row has no text field {ds.field!r} (set `field`)")
    ids = list(tok(text)["input_ids"])
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return Sample(ids, list(ids))


def _render(tok: Any, messages: list[Any], chat_template: str | None, prompt: bool) -> str:
    return str(
        tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt, chat_template=chat_template
        )
    )


def _chat(row: Row, ds: DatasetConfig, tok: Any, chat_template: str | None) -> Sample:
    """Render with the chat template; only assistant turns are trained on.

    Assistant spans are found by rendering growing prefixes of the conversation; when the template
    does not render prefix-consistently, the whole conversation is trained on.
    """
    messages = row.get(ds.field_messages)
    if not isinstance(messages, list) or not messages:
        raise ShardforgeError(
            f"{ds.path}: a row has no message list {ds.field_messages!r} (set `field_messages`)"
        )
    text = _render(tok, messages, chat_template, prompt=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(_render(tok, messages[:i], chat_template, prompt=True)) if i else 0
        end = len(_render(tok, messages[: i + 1], chat_template, prompt=False))
        spans.append((start, end))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    prefix_consistent = all(
        text.startswith(_render(tok, messages[: i + 1], chat_template, prompt=False))
        for i in range(len(messages))
    )
    if not spans or not prefix_consistent:
        return Sample(ids, list(ids))
    labels = [
        tid if any(s <= a < e for s, e in spans) else IGNORE_INDEX
        for tid, (a, _b) in zip(ids, enc["offset_mapping"], strict=True)
    ]
    return Sample(ids, labels)


TOKENIZERS: dict[str, Callable[[Row, DatasetConfig, Any, str | None], Sample]] = {
    "completion": _completion,
    "chat_template": _chat,
}


def tokenize_row(row: Row, ds: DatasetConfig, tokenizer: Any, chat_template: str | None) -> Sample:
    """One row as (input_ids, labels), the way its data set's `type` says."""
    return TOKENIZERS[ds.type](row, ds, tokenizer, chat_template)


def load_samples(cfg: ShardforgeConfig, tokenizer: Any) -> list[Sample]:
    """All rows of all data sets, tokenized, in file order."""
    out: list[Sample] = []
    for i, ds in enumerate(cfg.datasets):
        tokenize = TOKENIZERS[ds.type]
        out += [
            tokenize(row, ds, tokenizer, cfg.chat_template)
            for row in read_rows(ds, f"datasets[{i}]")
        ]
    return out


@dataclass(frozen=True)
class Sequences:
    """Fixed-length training sequences: input_ids, labels, attention_mask, each [N, seq_len]."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: list[int]) -> Sequences:
        idx = torch.tensor(index, dtype=torch.long)
        return Sequences(self.input_ids[idx], self.labels[idx], self.attention_mask[idx])


def _pad_rows(rows: list[Sample], seq_len: int, pad_id: int) -> Sequences:
    n = len(rows)
    ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((n, seq_len), dtype=torch.long)
    for i, s in enumerate(rows):
        k = min(len(s.input_ids), seq_len)
        ids[i, :k] = torch.tensor(s.input_ids[:k])
        labels[i, :k] = torch.tensor(s.labels[:k])
        mask[i, :k] = 1
    return Sequences(ids, labels, mask)


def to_sequences(samples: list[Sample], seq_len: int, packing: bool, pad_id: int) -> Sequences:
    """Packed: all samples concatenated and cut into seq_len windows (the last one padded).
    Padded: each sample truncated or padded to seq_len; padding has label -100 and mask 0."""
    if not packing:
        return _pad_rows(samples, seq_len, pad_id)
    flat_ids = [t for s in samples for t in s.input_ids]
    flat_labels = [t for s in samples for t in s.labels]
    windows = [
        Sample(flat_ids[i : i + seq_len], flat_labels[i : i + seq_len])
        for i in range(0, len(flat_ids), seq_len)
    ]
    return _pad_rows(windows, seq_len, pad_id)


class GlobalOrder:
    """Position -> sequence index: a fresh permutation of all N sequences for every epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=gen).tolist()}
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        return [self._perm(p // self.n)[p % self.n] for p in range(start, start + count)]


def rank_slice(
    consumed: int, micro_step: int, rank: int, world_size: int, micro_batch_size: int
) -> tuple[int, int]:
    """(start position, count) of one rank's micro-batch in the global batch beginning at
    `consumed`: micro-step a, rank r takes slot a * world_size + r."""
    slot = micro_step * world_size + rank
    return consumed + slot * micro_batch_size, micro_batch_size


def load_tokenizer(cfg: ShardforgeConfig) -> Any:
    from transformers import AutoTokenizer

    from shardforge.train.model import require_local_or_hub_id

    source = cfg.tokenizer_config or cfg.base_model
    key = "tokenizer_config" if cfg.tokenizer_config else "base_model"
    require_local_or_hub_id(key, source)
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(key, [f"cannot load a tokenizer from {source!r} ({exc})"]) from None
    if cfg.chat_template:
        tok.chat_template = cfg.chat_template
    return tok


def pad_token_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tid is not None:
            return int(tid)
    return 0


def build_sequences(cfg: ShardforgeConfig, tokenizer: Any) -> Sequences:
    samples = load_samples(cfg, tokenizer)
    if not samples:
        raise ShardforgeError("datasets: the data files hold no rows")
    return to_sequences(samples, cfg.sequence_len, cfg.sample_packing, pad_token_id(tokenizer))
