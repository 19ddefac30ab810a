"""`evaluate_model`: the eval loss and perplexity of trained weights on the config's evaluation data,
computed by training's own code, so that they are the numbers `train` logs for the same weights.

    from shardforge.config import load_cfg
    from shardforge.use.evaluate import evaluate_model
    result = evaluate_model(load_cfg("cfg.yml"), step=200)   # result.loss, result.perplexity

The data are `train.eval.build_datasets` (the tokenizer training loads, `val_set_size`'s
held-out samples or `test_datasets`, packed or padded as training packs them) and the loss is
`train.eval.evaluate` (a token mean over every evaluation sequence, in chunks of
`eval_batch_size`) on one process.
"""

from __future__ import annotations

import logging
from typing import Any

from shardforge.config import coerce_cfg
from shardforge.errors import ConfigError
from shardforge.train.data import load_tokenizer
from shardforge.train.eval import EvalResult, build_datasets, eval_batch_size, evaluate
from shardforge.train.runtime import Runtime
from shardforge.use.model import load_model, pick
from shardforge.use.request import ModelRequest

log = logging.getLogger("shardforge")


def evaluate_model(cfg: Any, named_base: bool = False, **options: Any) -> EvalResult:
    """The eval loss, perplexity and target tokens of the weights `options` name
    (`ModelRequest`'s fields: model_dir, lora_model_dir, checkpoint, step; none: the run's
    own, or base_model where it names the model: `named_base`, the user gave --base_model) on
    the config's evaluation data (val_set_size or test_datasets)."""
    config = coerce_cfg(cfg)
    picked = pick(
        config, ModelRequest(**options), named_base
    )  # a wrong path fails before the data work
    if not (config.val_set_size or config.test_datasets):
        raise ConfigError(
            "val_set_size",
            [
                "the config has no evaluation data: set val_set_size (held out of datasets) or "
                "test_datasets"
            ],
        )
    data = build_datasets(config, load_tokenizer(config))
    assert data.eval is not None  # build_datasets refuses evaluation data without targets
    loaded = load_model(config, picked)
    batch = eval_batch_size(config)
    log.info(
        "evaluation: %d sequences (%s), %d per forward pass", len(data.eval), data.eval_key, batch
    )
    result = evaluate(loaded.model, data.eval, batch, Runtime(0, 1, 0, loaded.device))
    log.info(
        "eval loss %.4f  perplexity %.4g  (%d tokens)",
        result.loss,
        result.perplexity,
        result.tokens,
    )
    return result
