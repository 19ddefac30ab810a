"""One optimizer step of one rank: its micro-batches, the loss over the whole global batch, the
global gradient norm.

The loss of an optimizer step is the mean over every target token of the whole global batch
(all micro-batches on all ranks), so a run at any world size with the same global batch computes
the same loss and the same gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardforge.config.schema import ShardforgeConfig
from shardforge.train.data import (
    IGNORE_INDEX,
    Order,
    Sequences,
    SequenceSource,
    model_inputs,
    rank_slice,
)
from shardforge.train.loss import loss_chunks, token_loss_sum
from shardforge.train.runtime import Runtime


def micro_batches(
    seqs: SequenceSource, order: Order, consumed: int, cfg: ShardforgeConfig, rt: Runtime
) -> list[Sequences]:
    """This rank's micro-batches of the global batch that starts `consumed` sequences in."""
    out = []
    for micro in range(cfg.gradient_accumulation_steps):
        start, count = rank_slice(consumed, micro, rt.rank, rt.world_size, cfg.micro_batch_size)
        out.append(seqs.select(order.indices(start, count)))
    return out


def loss_sum(
    model: torch.nn.Module, batch: Sequences, device: torch.device, chunks: int = 0
) -> torch.Tensor:
    """The sum of the token losses of `batch` (float32); `chunks` > 0: the chunked loss, which
    never holds the full logits (`train.loss`)."""
    return token_loss_sum(model, model_inputs(batch, device), batch.labels.to(device), chunks)


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float | None) -> float:
    """Clip by the global L2 norm over all shards; return that norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: list[Sequences],
    cfg: ShardforgeConfig,
    rt: Runtime,
    mark: Callable[[str], None] = lambda phase: None,
    after_backward: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches; the loss is the global-batch mean.
    `mark(phase)` is called after each forward, backward and the optimizer step (diagnostics);
    `after_backward` once the gradients are complete, before clipping (frozen rows)."""
    counts = torch.tensor(
        [
            float(sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in batches)),
            float(sum(int(b.attention_mask.sum()) for b in batches)),
        ],
        device=rt.device,
    )
    dist.all_reduce(counts)  # target and input tokens of the whole global batch
    targets = max(counts[0].item(), 1.0)
    chunks = loss_chunks(cfg, model)
    loss_total = torch.zeros((), device=rt.device)
    for micro, batch in enumerate(batches):
        model.set_requires_gradient_sync(micro == len(batches) - 1)  # type: ignore[operator]
        loss = loss_sum(model, batch, rt.device, chunks)
        mark("forward")
        # FSDP averages gradients over all ranks (under HSDP: reduce-scatter within a shard
        # group, all-reduce across replicas, divided by both sizes); scale back so they are
        # exact sums / targets
        (loss * (rt.world_size / targets)).backward()
        mark("backward")
        loss_total += loss.detach()
    if after_backward is not None:
        after_backward()
    grad_norm = grad_norm_and_clip(model, cfg.max_grad_norm)
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    # torchao's optimizers keep the lr as a tensor; reduce_lr_on_plateau's is the group's
    lr = float(optimizer.param_groups[0]["lr"] if plateau else scheduler.get_last_lr()[0])
    optimizer.step()
    mark("optimizer")
    if not plateau:  # reduce_lr_on_plateau: stepped by each evaluation (`best.Plateau`)
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_total)
    return {
        "loss": loss_total.item() / targets,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": int(counts[1].item()),
    }
