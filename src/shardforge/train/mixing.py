"""How the samples of the `datasets:` entries become one list, as Axolotl merges them.

    weighted(items, weight, seed)       an entry's `weight`: every item round(weight) times,
                                        the fraction drawn with seed
    merge(parts, cfg, key)              shuffle_before_merging_datasets, then the entries in
                                        order, shuffle_merged_datasets, the length rules
                                        (min_sample_len, excess_length_strategy),
                                        dataset_exact_deduplication, dataset_shard_num/_idx

Shuffles are `datasets`' Dataset.shuffle(seed) orders (numpy's default_rng), shards its
contiguous Dataset.shard, so a config selects the samples it selects in Axolotl.
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError
from shardforge.train.readers import seeded_permutation, shard_range
from shardforge.train.rows import Sample

T = TypeVar("T")

# Axolotl drops a sample shorter than this when min_sample_len is unset
MIN_SAMPLE_LEN = 2


def shuffled(items: list[T], seed: int) -> list[T]:
    return [items[i] for i in seeded_permutation(len(items), seed)]


def weighted(items: list[T], weight: float | None, seed: int) -> list[T]:
    """round(weight x len) items: whole copies, then the first of a seeded shuffle."""
    if weight is None or weight == 1:
        return items
    whole, fraction = divmod(weight, 1)
    extra = round(fraction * len(items))
    return items * int(whole) + shuffled(items, seed)[:extra]


def by_length(samples: list[Sample], cfg: ShardforgeConfig, key: str) -> list[Sample]:
    """min_sample_len (null: 2) drops short samples; excess_length_strategy the long ones."""
    shortest = MIN_SAMPLE_LEN if cfg.min_sample_len is None else cfg.min_sample_len
    out = [s for s in samples if len(s.input_ids) >= shortest]
    limit = cfg.sequence_len
    strategy = cfg.excess_length_strategy
    if strategy == "drop":
        return [s for s in out if len(s.input_ids) <= limit]
    if strategy == "truncate":
        return [Sample(s.input_ids[:limit], s.labels[:limit]) for s in out]
    if strategy == "raise":
        for n, s in enumerate(out, 1):
            if len(s.input_ids) > limit:
                raise ConfigError(
                    "excess_length_strategy",
                    [
                        f"sample {n} of {key} has {len(s.input_ids)} tokens, over sequence_len "
                        f"({limit}); raise sequence_len or use drop / truncate"
                    ],
                )
    return out


def _deduplicated(samples: list[Sample]) -> list[Sample]:
    seen: set[bytes] = set()
    out = []
    for s in samples:
        digest = hashlib.sha256(repr((s.input_ids, s.labels)).encode()).digest()
        if digest not in seen:
            seen.add(digest)
            out.append(s)
    return out


def _sharded(samples: list[Sample], cfg: ShardforgeConfig) -> list[Sample]:
    shards, index = cfg.dataset_shard_num, cfg.dataset_shard_idx
    if not shards or index is None:
        return samples
    if index >= shards:
        raise ConfigError(
            "dataset_shard_idx", [f"{index} is not below dataset_shard_num ({shards})"]
        )
    start, stop = shard_range(len(samples), shards, index)
    return samples[start:stop]


def merge(parts: list[list[Sample]], cfg: ShardforgeConfig, key: str) -> list[Sample]:
    """The entries' samples as one list (see the module's table)."""
    if cfg.shuffle_before_merging_datasets:
        parts = [shuffled(p, cfg.seed) for p in parts]
    samples = [s for part in parts for s in part]
    if cfg.shuffle_merged_datasets:
        samples = shuffled(samples, cfg.seed)
    samples = by_length(samples, cfg, key)
    if cfg.dataset_exact_deduplication:
        samples = _deduplicated(samples)
    return _sharded(samples, cfg)
