"""Evaluation: which sequences are evaluated, when, and the eval loss over all ranks.

    held_out(n, val_set_size)           indices of the samples `val_set_size` holds out
    build_datasets(cfg, tokenizer)      training sequences, and evaluation sequences (held out
                                        of the training samples, or `test_datasets`)
    eval_interval(cfg, ...)             steps between evaluations (eval_steps, evals_per_epoch)
    eval_batch_size(cfg)                sequences per forward pass of an evaluation
    evaluate(model, seqs, size, rt)     the eval loss: a global token mean over all ranks (also
                                        `shardforge evaluate`'s, on one process)

The eval loss is the sum of the token losses of all evaluation sequences divided by their number
of target tokens. The sequences are cut into chunks of `eval_batch_size`; chunk k is one forward
pass on rank k mod world size, so every chunk is computed as the same batch at any world size.
Each sequence's loss is summed in float64 into its own slot of a vector that one all-reduce
completes (the other ranks add zeros, which is exact), and the vector is summed in slot order:
for the same weights the eval loss is the same number, bit for bit, at any world size (with the
same number of CPU threads per rank: see docs/train.md).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.train.data import (
    IGNORE_INDEX,
    Sample,
    Sequences,
    load_samples,
    model_inputs,
    pad_token_id,
    to_sequences,
)
from shardforge.train.loss import loss_chunks, token_losses
from shardforge.train.readers import data_files
from shardforge.train.runtime import Runtime

log = logging.getLogger("shardforge")


@dataclass(frozen=True)
class Datasets:
    """The training sequences and the evaluation sequences (None: no evaluation)."""

    train: Sequences
    eval: Sequences | None = None
    eval_key: str = ""  # the config key the evaluation data come from


def held_out(n: int, val_set_size: float) -> list[int]:
    """Indices of the samples held out of `n`, as Axolotl holds them out (datasets'
    `train_test_split(shuffle=False)` of the merged samples, which `shuffle_merged_datasets`
    has shuffled with `seed`): the last ceil(fraction x n) for a fraction below 1, else the last
    `val_set_size`; the same at every rank and world size."""
    if not val_set_size:
        return []
    count = math.ceil(val_set_size * n) if val_set_size < 1 else int(val_set_size)
    if count >= n:
        raise ConfigError(
            "val_set_size",
            [
                f"holding out {count} of the {n} training samples leaves none to train on; "
                "lower val_set_size"
            ],
        )
    return list(range(n - count, n))


def _target_tokens(seqs: Sequences) -> int:
    return int((seqs.labels[:, 1:] != IGNORE_INDEX).sum())


def build_datasets(cfg: ShardforgeConfig, tokenizer: Any) -> Datasets:
    """Tokenize `datasets` (and `test_datasets`); hold out `val_set_size` samples before
    packing; pack or pad each side on its own (eval: eval_sequence_len, eval_sample_packing)."""
    samples = load_samples(cfg, tokenizer)
    if not samples:
        raise ShardforgeError("datasets: the data files hold no rows")
    pad = pad_token_id(tokenizer)
    held: list[Sample] = []
    key = ""
    if cfg.val_set_size:
        key = "val_set_size"
        out = set(held_out(len(samples), cfg.val_set_size))
        held = [s for i, s in enumerate(samples) if i in out]
        samples = [s for i, s in enumerate(samples) if i not in out]
    elif cfg.test_datasets:
        key = "test_datasets"
        held = load_samples(cfg, tokenizer, cfg.test_datasets, key)
        if not held:
            raise ShardforgeError("test_datasets: the data files hold no rows")
    train = to_sequences(samples, cfg.sequence_len, cfg.sample_packing, pad)
    if _target_tokens(train) == 0:  # nothing to learn: every step's loss would be 0
        raise ConfigError(
            "datasets",
            [
                f"the training samples hold no target tokens within sequence_len "
                f"{cfg.sequence_len} (every label is masked); raise sequence_len or check "
                "the data's type and train_on_inputs"
            ],
        )
    if not held:
        return Datasets(train)
    packing = cfg.sample_packing if cfg.eval_sample_packing is None else cfg.eval_sample_packing
    evals = to_sequences(held, cfg.eval_sequence_len or cfg.sequence_len, packing, pad)
    if _target_tokens(evals) == 0:
        raise ConfigError(
            key, ["the evaluation samples hold no target tokens (every label is masked)"]
        )
    return Datasets(train, evals, key)


def eval_interval(cfg: ShardforgeConfig, steps_per_epoch: int, total_steps: int) -> int | None:
    """Steps between evaluations: `eval_steps` (below 1: that fraction of all steps, rounded
    up), or `evals_per_epoch` evenly spaced per epoch; None: only at the end."""
    if cfg.eval_steps is not None:
        if cfg.eval_steps < 1:
            return max(1, math.ceil(cfg.eval_steps * total_steps))
        return int(cfg.eval_steps)
    if cfg.evals_per_epoch:
        return max(1, steps_per_epoch // cfg.evals_per_epoch)
    return None


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    tokens: int

    def record(self, step: int) -> dict[str, Any]:
        """The metrics row of an evaluation at `step`."""
        return {
            "step": step,
            "eval_loss": self.loss,
            "eval_perplexity": self.perplexity,
            "eval_tokens": self.tokens,
        }


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def _sequence_losses(
    model: torch.nn.Module, batch: Sequences, device: torch.device, chunks: int = 0
) -> tuple[torch.Tensor, int]:
    """Each sequence's summed token loss (float64) and the batch's number of target tokens."""
    labels = batch.labels.to(device)
    token = token_losses(model, model_inputs(batch, device), labels, chunks)
    per_sequence = token.double().sum(dim=1)
    return per_sequence.cpu(), int((labels[:, 1:] != IGNORE_INDEX).sum())


def eval_batch_size(cfg: ShardforgeConfig) -> int:
    """Sequences per forward pass of an evaluation: eval_batch_size, else micro_batch_size."""
    return cfg.eval_batch_size or cfg.micro_batch_size


def evaluate(
    model: torch.nn.Module, seqs: Sequences, batch_size: int, rt: Runtime, chunks: int = 0
) -> EvalResult:
    """The global eval loss over all of `seqs` (every rank calls this with the same `seqs`; a
    single process without a process group is world size 1). `chunks` > 0: the chunked loss
    (`train.loss`), without the full logits."""
    n = len(seqs)
    rounds = math.ceil(math.ceil(n / batch_size) / rt.world_size)
    slots = torch.zeros(n + 1, dtype=torch.float64)  # a loss per sequence, then the tokens
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for r in range(rounds):
                start = (r * rt.world_size + rt.rank) * batch_size
                index = list(range(start, min(start + batch_size, n)))
                # a rank without a chunk in this round still runs a forward pass: FSDP's
                # all-gathers are collectives; its result is dropped
                batch = seqs.select(index or [0])
                losses, tokens = _sequence_losses(model, batch, rt.device, chunks)
                if index:
                    slots[index] = losses
                    slots[n] += tokens
    finally:
        model.train(was_training)
    total = slots
    if rt.world_size > 1:
        total = slots.to(rt.device)
        dist.all_reduce(total)
        total = total.cpu()
    tokens = int(total[n].item())
    loss = float(total[:n].sum().item()) / max(tokens, 1)
    return EvalResult(loss, perplexity(loss), tokens)


class Evaluator:
    """When to evaluate, and the evaluation itself (a metrics row; logged on rank 0)."""

    def __init__(
        self,
        cfg: ShardforgeConfig,
        seqs: Sequences | None,
        rt: Runtime,
        every: int | None,
        total_steps: int,
    ) -> None:
        self.cfg = cfg
        self.seqs = seqs
        self.rt = rt
        self.every = every
        self.total_steps = total_steps
        self.batch_size = eval_batch_size(cfg)

    @classmethod
    def of(
        cls,
        cfg: ShardforgeConfig,
        data: Datasets,
        rt: Runtime,
        steps_per_epoch: int,
        total_steps: int,
    ) -> Evaluator:
        every = eval_interval(cfg, steps_per_epoch, total_steps)
        if data.eval is None and (cfg.eval_steps is not None or cfg.evals_per_epoch):
            if rt.is_main:
                key = "eval_steps" if cfg.eval_steps is not None else "evals_per_epoch"
                log.warning(
                    "warning: %s is set, but there is no evaluation data (set val_set_size or "
                    "test_datasets); no evaluation",
                    key,
                )
        elif data.eval is not None and rt.is_main:
            log.info(
                "evaluation: %d sequences (%s), %s",
                len(data.eval),
                data.eval_key,
                f"before the first step, every {every} steps and after the last step"
                if every
                else "after the last step",
            )
        return cls(cfg, data.eval, rt, every, total_steps)

    @property
    def at_start(self) -> bool:
        """A periodic evaluation also runs before the first step (a fresh run's step 0)."""
        return self.seqs is not None and self.every is not None

    def due(self, step: int, last: bool = False) -> bool:
        """Evaluate after `step`: every `every` steps and after the last step (`last`: the run
        ends at `step`, also when a callback stopped it early)."""
        if self.seqs is None:
            return False
        if last or step == self.total_steps:
            return True
        return self.every is not None and step % self.every == 0

    def run(self, model: torch.nn.Module, step: int) -> dict[str, Any]:
        assert self.seqs is not None
        chunks = loss_chunks(self.cfg, model)
        result = evaluate(model, self.seqs, self.batch_size, self.rt, chunks)
        if self.rt.is_main:
            log.info(
                "eval at step %d  loss %.4f  perplexity %.4g  (%d tokens)",
                step,
                result.loss,
                result.perplexity,
                result.tokens,
            )
        return result.record(step)


def check_eval(cfg: ShardforgeConfig) -> list[tuple[str, str]]:
    """Before launch: every test_datasets entry names existing files of a known format."""
    out: list[tuple[str, str]] = []
    for i, ds in enumerate(cfg.test_datasets):
        try:
            data_files(ds, f"test_datasets[{i}]")
        except ConfigError as exc:
            out += [(exc.source, p) for p in exc.problems]
    return out
