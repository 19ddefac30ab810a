"""Streamed training data (`streaming: true`, `pretraining_dataset`): rows read lazily from
local files, tokenized and packed block by block; memory holds one block, whatever the data size.

    stream_items(cfg, epoch)   (entry, row) of the stream, read lazily (a JSON array file is
                               the exception: read whole; use JSON lines)
    block_sequences(...)       the sequences of one block of rows (streaming_multipack_buffer_size
                               rows, shuffled with seed, epoch and block: shuffle_merged_datasets)
    Stream                     global position -> sequence, a forward cursor over the blocks
    StreamOrder                position p is sequence p of the stream (the order is the stream's)

The stream of sequences is the same on every rank and at every world size: block b holds rows
[b x buffer, (b+1) x buffer) of an epoch, and its sequences follow those of block b-1. An
optimizer step takes the next `global_batch` positions and each rank its own slots of them
(`data.rank_slice`), as for in-memory data; so the ranks train on disjoint sequences covering the
stream, and `consumed` (sequences used) is the data position of a checkpoint, at any world size.
Like Axolotl (accelerate's IterableDatasetShard, dispatch_batches false), every rank reads and
tokenizes the stream and keeps its own slots. The checkpoint also records the block the position
lies in (`Stream.state`): a resume skips the rows before it without tokenizing them.
When the files end, the stream starts again (the next epoch, shuffled anew).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.train import mixing
from shardforge.train.data import (
    Sequences,
    _pad_rows,
    load_samples,
    pack,
    pad_token_id,
    to_sequences,
    tokenize_row,
)
from shardforge.train.eval import Datasets
from shardforge.train.readers import READERS, Row, data_files, seeded_permutation
from shardforge.train.rows import IGNORE_INDEX, Sample, TokenizeOptions

log = logging.getLogger("shardforge")

Item = tuple[int, Row]  # (entry of datasets, row); pretraining_dataset: entry 0


def _entry_rows(ds: Any, key: str) -> Iterator[Row]:
    for file, ds_type in data_files(ds, key):
        yield from READERS[ds_type](file)


def stream_items(cfg: ShardforgeConfig) -> Iterator[Item]:
    """One pass over the stream's rows: pretraining_dataset[0] after its `skip`, or the
    `datasets` entries one after another."""
    if cfg.pretraining_dataset:
        entry = cfg.pretraining_dataset[0]
        rows = _entry_rows(entry, "pretraining_dataset[0]")
        yield from ((0, row) for row in itertools.islice(rows, entry.skip or 0, None))
        return
    for i, ds in enumerate(cfg.datasets):
        yield from ((i, row) for row in _entry_rows(ds, f"datasets[{i}]"))


def _text(row: Row, column: str, n: int) -> str:
    value = row.get(column)
    if not isinstance(value, str):
        found = ", ".join(sorted(map(str, row))) or "none"
        raise ShardforgeError(
            f"pretraining_dataset[0].text_column: row {n} has no text in {column!r} (its keys: "
            f"{found})"
        )
    return value


def pretrain_pieces(text: str, tok: Any, seq_len: int) -> list[Sample]:
    """Axolotl's `type: pretrain`: windows of seq_len - 1 tokens overlapping by
    min(256, (seq_len - 1) // 2), each with the tokenizer's special tokens and EOS appended."""
    stride = min(256, (seq_len - 1) // 2)
    out = tok(
        text,
        truncation=True,
        max_length=seq_len - 1,
        add_special_tokens=True,
        return_overflowing_tokens=True,
        stride=stride,
    )
    pieces = out["input_ids"]
    if pieces and isinstance(pieces[0], int):
        pieces = [pieces]
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    return [Sample(list(p) + eos, list(p) + eos) for p in pieces]


def _concatenated(texts: list[list[int]], tok: Any, seq_len: int, pad: int) -> Sequences:
    """Axolotl's encode_streaming with pretraining_sample_concatenation: each text + EOS + pad
    (the pad not a target, not attended), greedily concatenated into seq_len windows."""
    eos = tok.eos_token_id if tok.eos_token_id is not None else pad
    windows: list[Sample] = []
    ids: list[int] = []
    labels: list[int] = []
    for text in texts:
        more, more_labels = [*text, eos, pad], [*text, eos, IGNORE_INDEX]
        if ids and len(ids) + len(more) > seq_len:
            windows.append(Sample(ids, labels))
            ids, labels = [], []
        ids, labels = ids + more, labels + more_labels
    if ids:
        windows.append(Sample(ids, labels))
    out = _pad_rows(windows, seq_len, pad)
    mask = out.attention_mask.clone()
    mask[out.labels == IGNORE_INDEX] = 0  # the pad after each EOS (the window's padding: 0)
    return Sequences(out.input_ids, out.labels, mask)


def _pretrain_sequences(rows: list[Row], cfg: ShardforgeConfig, tok: Any, pad: int) -> Sequences:
    assert cfg.pretraining_dataset is not None
    column, seq_len = cfg.pretraining_dataset[0].text_column, cfg.sequence_len
    texts = [_text(row, column, n) for n, row in enumerate(rows, 1)]
    if cfg.sample_packing:
        samples = [s for t in texts for s in pretrain_pieces(t, tok, seq_len)]
        samples = mixing.by_length(samples, cfg, "pretraining_dataset[0]")
        seqs = pack(samples, seq_len, pad)
        if cfg.pretrain_multipack_attn:
            return seqs
        return Sequences(seqs.input_ids, seqs.labels, seqs.attention_mask)  # attend across
    ids = [list(tok(t, truncation=True, max_length=seq_len - 2)["input_ids"]) for t in texts]
    if cfg.pretraining_sample_concatenation:
        return _concatenated(ids, tok, seq_len, pad)
    return _pad_rows([Sample(i, list(i)) for i in ids], seq_len, pad)


def block_sequences(items: list[Item], cfg: ShardforgeConfig, tok: Any, seed: int) -> Sequences:
    """The sequences of one block: its rows shuffled with `seed` (shuffle_merged_datasets),
    tokenized by their entry's type (pretraining_dataset: `pretrain_pieces`), then packed or
    padded as the in-memory data would be."""
    if cfg.shuffle_merged_datasets:
        items = [items[i] for i in seeded_permutation(len(items), seed)]
    pad = pad_token_id(tok)
    if cfg.pretraining_dataset:
        return _pretrain_sequences([row for _, row in items], cfg, tok, pad)
    opts = TokenizeOptions.of(cfg)
    samples = [
        tokenize_row(row, cfg.datasets[i], tok, opts, f"datasets[{i}]", "a streamed row")
        for i, row in items
    ]
    samples = mixing.by_length(samples, cfg, "datasets")
    return to_sequences(samples, cfg.sequence_len, cfg.sample_packing, pad)


@dataclass
class Position:
    """A block of the stream: its epoch, its number in the epoch and the stream position of
    its first sequence."""

    epoch: int = 0
    block: int = 0
    base: int = 0


def _empty(seq_len: int) -> Sequences:
    none = torch.zeros((0, seq_len), dtype=torch.long)
    return Sequences(none, none, none)


class Stream:
    """Position -> sequence over the streamed data: a cursor that holds one block and moves
    forward (a position before the block held replays the stream from its start). Its length is
    the run's (max_steps x global batch): for the loop a stream is one epoch, as transformers'
    Trainer counts a stream without length."""

    def __init__(self, cfg: ShardforgeConfig, tokenizer: Any, length: int) -> None:
        self.cfg, self.tokenizer, self.length = cfg, tokenizer, length
        self.buffer = cfg.streaming_multipack_buffer_size
        self.at = Position()
        self.held = _empty(cfg.sequence_len)
        self._rows: Iterator[Item] | None = None
        self._epoch_start = 0  # the position the epoch held began at (-1: resumed within it)

    def __len__(self) -> int:
        return self.length

    def _block_seed(self) -> int:
        return (self.cfg.seed * 1_000_003 + self.at.epoch) * 1_000_003 + self.at.block

    def _load(self) -> None:
        """Read and tokenize the block `self.at` names (its rows come next from `_rows`)."""
        if self._rows is None:
            self._rows = stream_items(self.cfg)
            skip = self.at.block * self.buffer
            next(itertools.islice(self._rows, skip, skip), None)  # read, not tokenized
        items = list(itertools.islice(self._rows, self.buffer))
        if not items:  # the epoch ended: the stream starts again
            if self.at.base == self._epoch_start:
                raise ShardforgeError(
                    "datasets: the streamed files give no training sequences (no rows, or "
                    "every sample dropped by min_sample_len / excess_length_strategy)"
                )
            self.at = Position(self.at.epoch + 1, 0, self.at.base)
            self._rows, self._epoch_start = None, self.at.base
            self._load()
            return
        self.held = block_sequences(items, self.cfg, self.tokenizer, self._block_seed())

    def _next_block(self) -> None:
        self.at = Position(self.at.epoch, self.at.block + 1, self.at.base + len(self.held))
        self._load()

    def _at(self, position: int) -> tuple[Sequences, int]:
        if position < self.at.base:
            self.seek(Position())
        if self._rows is None:
            self._load()
        while position >= self.at.base + len(self.held):
            self._next_block()
        return self.held, position - self.at.base

    def select(self, index: list[int]) -> Sequences:
        """The sequences at these stream positions (ascending)."""
        picked = [self._at(p) for p in index]
        parts = [seqs.select([i]) for seqs, i in picked]
        positions = None
        if parts and all(p.position_ids is not None for p in parts):
            positions = torch.cat([p.position_ids for p in parts if p.position_ids is not None])
        return Sequences(
            torch.cat([p.input_ids for p in parts]),
            torch.cat([p.labels for p in parts]),
            torch.cat([p.attention_mask for p in parts]),
            positions,
        )

    def state(self) -> dict[str, int]:
        """The block held (its first sequence is at or before the position to continue from):
        what a checkpoint records."""
        return {"epoch": self.at.epoch, "block": self.at.block, "base": self.at.base}

    def seek(self, where: Position) -> None:
        """Continue from the start of the block `where` (its rows before are read, not
        tokenized)."""
        self.at, self._rows = Position(where.epoch, where.block, where.base), None
        self._epoch_start = where.base if where.block == 0 else -1
        self.held = _empty(self.cfg.sequence_len)
        self._load()

    def resume(self, saved: dict[str, Any] | None, consumed: int) -> None:
        """Continue a checkpoint's stream: from its block, or (none recorded) from the start."""
        where = Position(**saved) if saved else Position()
        if where.base > consumed:
            where = Position()
        self.seek(where)


class StreamOrder:
    """The global order of a stream: position p is the stream's sequence p."""

    def indices(self, start: int, count: int) -> list[int]:
        return list(range(start, start + count))


def streamed_datasets(
    cfg: ShardforgeConfig, tokenizer: Any, global_batch: int
) -> tuple[Datasets, Stream]:
    """The stream of training sequences, and the evaluation data (test_datasets, loaded whole
    as Axolotl loads them); Datasets.train is the stream's first block."""
    assert cfg.max_steps is not None
    stream = Stream(cfg, tokenizer, cfg.max_steps * global_batch)
    first = stream.select([0])
    if not cfg.test_datasets:
        return Datasets(first), stream
    held = load_samples(cfg, tokenizer, cfg.test_datasets, "test_datasets")
    if not held:
        raise ShardforgeError("test_datasets: the data files hold no rows")
    packing = cfg.sample_packing if cfg.eval_sample_packing is None else cfg.eval_sample_packing
    seq_len = cfg.eval_sequence_len or cfg.sequence_len
    evals = to_sequences(held, seq_len, packing, pad_token_id(tokenizer))
    return Datasets(first, evals, "test_datasets"), stream
