"""Training data: local files -> token rows -> fixed-length sequences -> a deterministic order.

    read_rows(ds)                          rows of one data set (json/jsonl/parquet/text), split
                                           (see readers.py)
    tokenize_row(row, ds, tokenizer, ...)  (input_ids, labels) of one row, by data set type:
                                           completion, alpaca, input_output, chat_template
    to_sequences(samples, seq_len, ...)    packed (samples isolated, see packing.py) or padded
                                           [N, seq_len] tensors
    GlobalOrder(n, seed)                   which sequence sits at each global position
    short_of_a_batch(n, global_batch, ...) data smaller than one global batch: a warning
                                           (an error under dataloader_drop_last)

Every rank builds the same sequences and the same order; an optimizer step consumes the next
`global_batch` positions and each rank takes its own slice of them (see `rank_slice`). The data
position saved in checkpoints is the number of positions consumed, so a resumed run continues
exactly, at any world size with the same global batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardforge.config.chat_templates import resolve_chat_template
from shardforge.config.schema import DatasetConfig, ShardforgeConfig
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.train import mixing, packing
from shardforge.train.chat import chat_sample
from shardforge.train.readers import Row, read_rows
from shardforge.train.rows import IGNORE_INDEX, RowError, Sample, TokenizeOptions
from shardforge.train.vocab import add_config_tokens

log = logging.getLogger("shardforge")


def _text(row: Row, name: str, field: str, optional: bool = False) -> str:
    value = row.get(name)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        found = ", ".join(sorted(map(str, row))) or "none"
        raise RowError(field, f"no text in {name!r} (the row's keys: {found})")
    return value


def _masked(ids: list[int], trained: bool) -> list[int]:
    return list(ids) if trained else [IGNORE_INDEX] * len(ids)


def _completion(row: Row, ds: DatasetConfig, tok: Any, opts: TokenizeOptions) -> Sample:
    """All of `field`, plus EOS; every token is a target."""
    ids = list(tok(_text(row, ds.field, "field"))["input_ids"])
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    return Sample(ids, list(ids))


ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def _alpaca(row: Row, ds: DatasetConfig, tok: Any, opts: TokenizeOptions) -> Sample:
    """The Alpaca prompt (with or without input), then the output and EOS.

    As Axolotl's `type: alpaca`: the prompt is tokenized with the tokenizer's usual special
    tokens (BOS), the response on its own without BOS, EOS appended; the prompt is a target
    only with train_on_inputs.
    """
    instruction = _text(row, "instruction", "type")
    context = _text(row, "input", "type", optional=True)
    output = _text(row, "output", "type")
    if context:
        prompt = ALPACA_PROMPT.format(instruction=instruction, input=context)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    prompt_ids = list(tok(prompt)["input_ids"])
    response = list(tok(output)["input_ids"])
    if response and tok.bos_token_id is not None and response[0] == tok.bos_token_id:
        response = response[1:]
    if tok.eos_token_id is not None and (not response or response[-1] != tok.eos_token_id):
        response.append(tok.eos_token_id)
    labels = _masked(prompt_ids, opts.train_on_inputs) + response
    return Sample(prompt_ids + response, labels)


def _input_output(row: Row, ds: DatasetConfig, tok: Any, opts: TokenizeOptions) -> Sample:
    """`segments` concatenated as they are; a segment with `label: false` is not a target.

    As Axolotl's `type: input_output`: no template and no BOS or EOS added; the text brings
    whatever special tokens it needs (special tokens in the text are recognised).
    """
    segments = row.get("segments")
    if not isinstance(segments, list) or not segments:
        raise RowError("type", "input_output rows need a non-empty list `segments`")
    ids: list[int] = []
    labels: list[int] = []
    for j, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
            raise RowError("type", f"segments[{j}] needs a `text` string and a `label`")
        if not isinstance(seg.get("label"), bool):
            raise RowError("type", f"segments[{j}].label must be true or false")
        part = list(tok(seg["text"], add_special_tokens=False)["input_ids"])
        ids += part
        labels += _masked(part, seg["label"] or opts.train_on_inputs)
    return Sample(ids, labels)


TOKENIZERS: dict[str, Callable[[Row, DatasetConfig, Any, TokenizeOptions], Sample]] = {
    "completion": _completion,
    "chat_template": chat_sample,
    "alpaca": _alpaca,
    "input_output": _input_output,
}


def tokenize_row(
    row: Row,
    ds: DatasetConfig,
    tokenizer: Any,
    opts: TokenizeOptions,
    key: str = "datasets[0]",
    where: str = "a row",
) -> Sample:
    """One row as (input_ids, labels), the way its data set's `type` says.

    A row the type cannot use is a ConfigError naming the entry's key (`key`.field).
    """
    try:
        return TOKENIZERS[ds.type](row, ds, tokenizer, opts)
    except RowError as exc:
        raise ConfigError(f"{key}.{exc.field}", [f"{where} of {ds.path}: {exc}"]) from None


def load_samples(
    cfg: ShardforgeConfig,
    tokenizer: Any,
    datasets: list[DatasetConfig] | None = None,
    key: str = "datasets",
) -> list[Sample]:
    """All rows of all data sets, tokenized and merged (`mixing.merge`): `cfg.datasets`, or
    the entries given (`test_datasets`), whose errors name `key`[i]."""
    opts = TokenizeOptions.of(cfg)
    parts: list[list[Sample]] = []
    for i, ds in enumerate(cfg.datasets if datasets is None else datasets):
        entry = f"{key}[{i}]"
        rows = mixing.weighted(read_rows(ds, entry, cfg.seed), ds.weight, cfg.seed)
        parts.append(
            [
                tokenize_row(row, ds, tokenizer, opts, entry, f"row {n}")
                for n, row in enumerate(rows, 1)
            ]
        )
    return mixing.merge(parts, cfg, key)


@dataclass(frozen=True)
class Sequences:
    """Fixed-length training sequences: input_ids, labels, attention_mask, each [N, seq_len].

    attention_mask is 1 for tokens and 0 for padding. Packed sequences also have position_ids
    (restarting at 0 for every sample, see `shardforge.train.packing`); the model gets those
    instead of the attention mask (`model_inputs`)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, index: list[int]) -> Sequences:
        idx = torch.tensor(index, dtype=torch.long)
        positions = None if self.position_ids is None else self.position_ids[idx]
        return Sequences(self.input_ids[idx], self.labels[idx], self.attention_mask[idx], positions)


def model_inputs(batch: Sequences, device: torch.device) -> dict[str, Any]:
    """The forward arguments of a batch: packed windows by position ids alone (transformers
    then keeps their samples apart), padded rows by attention mask. No KV cache either way."""
    inputs: dict[str, Any] = {"input_ids": batch.input_ids.to(device), "use_cache": False}
    if batch.position_ids is not None:
        inputs["position_ids"] = batch.position_ids.to(device)
    else:
        inputs["attention_mask"] = batch.attention_mask.to(device)
    return inputs


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
    """Packed: whole samples in seq_len windows, isolated from each other (`pack`).
    Padded: each sample truncated or padded to seq_len; padding has label -100 and mask 0."""
    if not packing:
        return _pad_rows(samples, seq_len, pad_id)
    return pack(samples, seq_len, pad_id)


def pack(samples: list[Sample], seq_len: int, pad_id: int) -> Sequences:
    """Samples packed into seq_len windows without cross-talk (see `shardforge.train.packing`).

    A sample longer than seq_len is cut into seq_len pieces, each packed as a sample of its
    own; `packing.plan_windows` places them (best fit, in data order). Each sample's first
    label is -100 (it would be predicted from the previous sample), the position ids restart
    at 0 for every sample and for the trailing padding (label -100, attention_mask 0)."""
    parts = [
        Sample(s.input_ids[a:b], [IGNORE_INDEX, *s.labels[a + 1 : b]])
        for s in samples
        for a, b in packing.pieces(len(s.input_ids), seq_len)
    ]
    windows = packing.plan_windows([len(p.input_ids) for p in parts], seq_len)
    rows = [
        Sample([t for i in w for t in parts[i].input_ids], [t for i in w for t in parts[i].labels])
        for w in windows
    ]
    out = _pad_rows(rows, seq_len, pad_id)
    positions = [
        packing.position_ids([len(parts[i].input_ids) for i in w], seq_len) for w in windows
    ]
    return Sequences(
        out.input_ids,
        out.labels,
        out.attention_mask,
        torch.tensor(positions, dtype=torch.long).reshape(len(windows), seq_len),
    )


class SequenceSource(Protocol):
    """Training sequences by position: `Sequences` in memory, or a `streaming.Stream`."""

    def __len__(self) -> int: ...

    def select(self, index: list[int]) -> Sequences: ...


class Order(Protocol):
    """Global position -> sequence index: `GlobalOrder`, or a stream's own order."""

    def indices(self, start: int, count: int) -> list[int]: ...


class GlobalOrder:
    """Position -> sequence index: a fresh permutation of all N sequences for every epoch;
    `used` (dataloader_drop_last: the whole global batches of N) positions per epoch."""

    def __init__(self, n: int, seed: int, used: int | None = None) -> None:
        self.n = n
        self.seed = seed
        self.used = used or n
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=gen).tolist()}
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        per = self.used
        return [self._perm(p // per)[p % per] for p in range(start, start + count)]


def short_of_a_batch(n: int, global_batch: int, cfg: ShardforgeConfig, announce: bool) -> None:
    """Data smaller than one global batch: trained as Axolotl trains it (at least one step), the
    batch filled from the next passes of the data order; with dataloader_drop_last (only whole
    batches) there is nothing to train on."""
    what = (
        f"{n} sequences of sequence_len {cfg.sequence_len}, fewer than one global batch "
        f"({global_batch} = micro_batch_size x world size x gradient_accumulation_steps)"
    )
    if cfg.dataloader_drop_last:
        raise ShardforgeError(
            f"datasets: {what}, and dataloader_drop_last keeps only whole batches; add data, "
            "lower micro_batch_size or unset dataloader_drop_last"
        )
    if announce:
        log.warning("warning: datasets: %s; each step repeats sequences to fill it", what)


def rank_slice(
    consumed: int, micro_step: int, rank: int, world_size: int, micro_batch_size: int
) -> tuple[int, int]:
    """(start position, count) of one rank's micro-batch in the global batch beginning at
    `consumed`: micro-step a, rank r takes slot a * world_size + r."""
    slot = micro_step * world_size + rank
    return consumed + slot * micro_batch_size, micro_batch_size


# the default system message of a chat template that default_system_message replaces
TEMPLATE_SYSTEM_MESSAGE = "You are a helpful assistant."


def tokenizer_kwargs(cfg: ShardforgeConfig) -> dict[str, Any]:
    """AutoTokenizer's arguments: tokenizer_use_fast (null: fast) and tokenizer_legacy (null:
    the tokenizer's own setting), as Axolotl passes them."""
    out: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    out["use_fast"] = True if cfg.tokenizer_use_fast is None else cfg.tokenizer_use_fast
    if cfg.tokenizer_legacy is not None:
        out["legacy"] = cfg.tokenizer_legacy
    return out


def load_tokenizer(cfg: ShardforgeConfig) -> Any:
    """The tokenizer, with the config's chat template and added tokens (special_tokens, tokens,
    eot_tokens); the same on every rank, and the one saved to output_dir."""
    from transformers import AutoTokenizer

    from shardforge.train.model import require_local_or_hub_id

    source = cfg.tokenizer_config or cfg.base_model
    key = "tokenizer_config" if cfg.tokenizer_config else "base_model"
    require_local_or_hub_id(key, source)
    try:
        tok = AutoTokenizer.from_pretrained(source, **tokenizer_kwargs(cfg))
    except (OSError, ValueError) as exc:
        raise ConfigError(key, [f"cannot load a tokenizer from {source!r} ({exc})"]) from None
    own = tok.chat_template if isinstance(tok.chat_template, str) else None
    template = resolve_chat_template(cfg.chat_template, cfg.chat_template_jinja, own)
    if template is not None and cfg.default_system_message:
        template = template.replace(TEMPLATE_SYSTEM_MESSAGE, cfg.default_system_message)
    if template is not None:
        tok.chat_template = template
    add_config_tokens(tok, cfg)
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
