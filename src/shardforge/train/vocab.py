"""Vocabulary changes from the config: tokens added to the tokenizer, rows added to the model.

    add_config_tokens(tokenizer, cfg)    special_tokens, tokens, eot_tokens -> the tokenizer
    grow_vocab_size(model_config, tok)   config vocab_size raised to len(tokenizer) if smaller
    extend_rows(weights, model)          base embedding matrices given the new rows (their mean),
                                         or cut to the model's (shrink_embeddings)

The model is built (on the meta device, before sharding) from the grown config, so its input
and output embeddings have a row for every token of the tokenizer; the same config is written
to output_dir/config.json, from which the merge builds its model. Only rank 0 reads the base
weights: the rows the base lacks are filled there, deterministically, and broadcast.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError

log = logging.getLogger("shardforge")


def _added(text: str, special: bool) -> Any:
    from tokenizers import AddedToken

    return AddedToken(text, rstrip=False, lstrip=False, normalized=False, special=special)


def _is_single_token(tokenizer: Any, text: str) -> bool:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1


def add_config_tokens(tokenizer: Any, cfg: ShardforgeConfig) -> int:
    """Set `special_tokens`, add `tokens`, make every `eot_tokens` entry one special token.

    Returns how many tokens were added to the vocabulary. A special-token role the tokenizer
    does not have, or an end-of-turn token that still is not one token, names its config key.
    """
    before = len(tokenizer)
    roles = list(getattr(tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", []))
    for role, text in (cfg.special_tokens or {}).items():
        if role not in roles:
            raise ConfigError(
                f"special_tokens.{role}",
                [f"not a special-token role of the tokenizer; use one of {', '.join(roles)}"],
            )
        tokenizer.add_special_tokens({role: _added(text, special=True)})
    if cfg.tokens:
        tokenizer.add_tokens([_added(text, special=False) for text in cfg.tokens])
    for i, text in enumerate(cfg.eot_tokens or []):
        if not _is_single_token(tokenizer, text):
            tokenizer.add_tokens([_added(text, special=True)], special_tokens=True)
        if not _is_single_token(tokenizer, text):
            raise ConfigError(f"eot_tokens[{i}]", [f"{text!r} does not encode to a single token"])
    added = len(tokenizer) - before
    if added:
        log.info("added %d token(s) to the tokenizer (now %d)", added, len(tokenizer))
    return added


def grow_vocab_size(model_config: Any, tokenizer: Any, cfg: ShardforgeConfig | None = None) -> int:
    """Raise the config's vocab_size to len(tokenizer) when the tokenizer is larger.

    The model built from the config then has an embedding row (and an output row) for every
    token; a larger vocab_size is kept (models often pad it), unless `shrink_embeddings`. With
    `resize_token_embeddings_to_32x` the target is len(tokenizer) rounded up to a multiple of
    32 (as Axolotl's resize). Returns the vocab size.
    """
    text_config = model_config.get_text_config()
    wanted = len(tokenizer)
    if cfg is not None and cfg.resize_token_embeddings_to_32x:
        wanted = math.ceil(wanted / 32) * 32
    size = int(text_config.vocab_size)
    if size < wanted or (cfg is not None and cfg.shrink_embeddings and size != wanted):
        log.info("vocab_size %d -> %d (the tokenizer's %d tokens)", size, wanted, len(tokenizer))
        text_config.vocab_size = size = wanted
    return size


def embedding_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the input and output embedding matrices (and an output bias)."""
    wanted = [model.get_input_embeddings(), model.get_output_embeddings()]  # type: ignore[operator]
    keys = set()
    for name, module in model.named_modules():
        if any(module is w for w in wanted if w is not None):
            keys |= {f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)}
    return keys


def mean_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with rows appended up to `rows`, each the mean of the existing rows.

    transformers' `resize_token_embeddings(mean_resizing=True)` draws the new rows from a normal
    distribution around that mean with 1e-9 x the rows' covariance (or uses the mean itself when
    that is not positive definite); the mean is the same up to that noise, and deterministic.
    """
    extra = rows - tensor.shape[0]
    mean = tensor.float().mean(dim=0, keepdim=True).to(tensor.dtype)
    return torch.cat([tensor, mean.expand(extra, *tensor.shape[1:])])


def extend_rows(weights: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Give the embedding matrices in `weights` the rows the model has and they lack (in place)."""
    keys = embedding_keys(model) & weights.keys()
    if not keys:
        return
    shapes = {k: v.shape for k, v in model.state_dict().items() if k in keys}
    for key in sorted(keys):
        rows = int(shapes[key][0])
        if weights[key].shape[0] < rows:
            log.info("%s: %d new row(s), the mean of the others", key, rows - len(weights[key]))
            weights[key] = mean_rows(weights[key], rows)
        elif weights[key].shape[0] > rows:  # shrink_embeddings: rows past the tokenizer's
            weights[key] = weights[key][:rows].clone()
