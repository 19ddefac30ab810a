"""One training rank from start to finish: set up, (resume,) step, log, checkpoint.

The loss of an optimizer step is the mean over every target token of the whole global batch
(all micro-batches on all ranks), so a run at any world size with the same global batch computes
the same loss and the same gradients.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.io.dist import finish_together
from shardforge.train import checkpointing as ckpt
from shardforge.train.data import (
    IGNORE_INDEX,
    GlobalOrder,
    Sequences,
    load_tokenizer,
    model_inputs,
    rank_slice,
)
from shardforge.train.diagnostics import StepMemory, report_sharding
from shardforge.train.eval import Evaluator, build_datasets
from shardforge.train.full_save import save_full_model
from shardforge.train.lora import prepare_lora, save_adapter
from shardforge.train.model import (
    build_meta_model,
    load_model_config,
    materialize_and_load,
    model_config_source,
    shard_model,
)
from shardforge.train.optim import (
    Continuation,
    build_optimizer,
    build_scheduler,
    continuation,
    scheduler_state,
)
from shardforge.train.packing import check_packing
from shardforge.train.runtime import (
    Runtime,
    device_mesh,
    init_distributed,
    local_world_size,
    mesh_shape,
)
from shardforge.train.saving import Saver
from shardforge.train.tracking import open_trackers
from shardforge.train.vocab import grow_vocab_size

log = logging.getLogger("shardforge")


@dataclass
class TrainResult:
    """What a finished run reports (rank 0 has the metrics of the steps it ran)."""

    steps: int
    output_dir: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: Path | None = None
    saver: Saver | None = None  # its merges (merge_on_save) outlive the process group


def write_output_metadata(cfg: ShardforgeConfig, model_config: Any, tokenizer: Any) -> None:
    """config.json, generation_config.json (if the base has one) and the tokenizer (rank 0)."""
    from transformers import GenerationConfig

    out = Path(cfg.output_dir)
    model_config.save_pretrained(out)
    with contextlib.suppress(OSError):
        GenerationConfig.from_pretrained(model_config_source(cfg)).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _micro_batches(
    seqs: Sequences, order: GlobalOrder, consumed: int, cfg: ShardforgeConfig, rt: Runtime
) -> list[Sequences]:
    out = []
    for micro in range(cfg.gradient_accumulation_steps):
        start, count = rank_slice(consumed, micro, rt.rank, rt.world_size, cfg.micro_batch_size)
        out.append(seqs.select(order.indices(start, count)))
    return out


def _loss_sum(model: torch.nn.Module, batch: Sequences, device: torch.device) -> torch.Tensor:
    logits = model(**model_inputs(batch, device)).logits
    labels = batch.labels.to(device)[:, 1:]
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _grad_norm_and_clip(model: torch.nn.Module, max_norm: float | None) -> float:
    """Clip by the global L2 norm over all shards; return that norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_norm if max_norm else math.inf
    norm = torch.nn.utils.clip_grad_norm_(params, limit, foreach=True)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


class _Progress:
    """tqdm bar on rank 0 when stderr is a TTY; otherwise nothing."""

    def __init__(self, rt: Runtime, total: int, initial: int) -> None:
        self.bar: Any = None
        if rt.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step")

    def update(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_training(cfg: ShardforgeConfig) -> TrainResult:
    """Train on this rank (joining or creating the process group); destroy the group after."""
    rt = init_distributed()
    try:
        result = _train(cfg, rt)
        # every rank is done with its last collective before any rank tears the group down
        # (gloo can abort a rank whose peer closes its connections while it still talks)
        finish_together()
    finally:
        dist.destroy_process_group()
    if result.saver is not None:
        result.saver.finish()  # merge_on_save: the run ends when its merges have
    return result


def _train(cfg: ShardforgeConfig, rt: Runtime) -> TrainResult:
    torch.manual_seed(cfg.seed)
    mesh = mesh_shape(cfg, rt.world_size, local_world_size())  # a bad size stops before any write
    if cfg.tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(cfg.output_dir)
    tokenizer = load_tokenizer(cfg)
    model_config = load_model_config(cfg)
    grow_vocab_size(model_config, tokenizer)  # a row per added token, before the model is built

    data = build_datasets(cfg, tokenizer)  # training sequences (and held-out / test ones)
    seqs = data.train
    global_batch = cfg.micro_batch_size * rt.world_size * cfg.gradient_accumulation_steps
    if len(seqs) < global_batch:
        raise ShardforgeError(
            f"datasets: {len(seqs)} sequences of sequence_len {cfg.sequence_len}, fewer than one "
            f"global batch ({global_batch} = micro_batch_size x world size x "
            "gradient_accumulation_steps); add data or lower micro_batch_size"
        )
    total_steps = cfg.max_steps or math.ceil(cfg.num_epochs * len(seqs) / global_batch)
    every = save_interval(cfg, len(seqs), global_batch)

    resume = ckpt.resolve_resume(cfg.resume_from_checkpoint, out, announce=rt.is_main)
    saved = ckpt.TrainerState.read(resume) if resume is not None else None
    if resume is not None and saved is not None and saved.step >= total_steps:
        if rt.is_main:
            log.info(
                "nothing to do: %s already reached max_steps=%d (set a larger max_steps to "
                "train further)",
                resume,
                total_steps,
            )
        return TrainResult(steps=saved.step, output_dir=out, resumed_from=resume)

    model = build_meta_model(cfg, model_config)
    check_packing(cfg, model)  # sample_packing needs attention that keeps samples apart
    weights = prepare_lora(model, cfg, rt.is_main) if cfg.adapter else None
    shard_model(model, cfg, device_mesh(rt, mesh))
    materialize_and_load(model, cfg, rt.device, rt.rank, weights)
    del weights
    report_sharding(model, cfg, rt, mesh)
    if rt.is_main:
        out.mkdir(parents=True, exist_ok=True)
        write_output_metadata(cfg, model_config, tokenizer)
    dist.barrier()
    model.train()
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg)
    scheduler = build_scheduler(
        optimizer, cfg, total_steps, _continuation(saved, total_steps, cfg, rt)
    )

    step, consumed = 0, 0
    if resume is not None:
        step, consumed = _resume(resume, model, optimizer, scheduler, cfg, rt, global_batch)
    elif cfg.resume_from_checkpoint == "auto" and rt.is_main:
        log.info("resume_from_checkpoint: auto found no checkpoint in %s; starting fresh", out)

    order = GlobalOrder(len(seqs), cfg.seed)
    result = TrainResult(steps=step, output_dir=out, resumed_from=resume)
    trackers = open_trackers(cfg, out, rt.is_main, step if resume is not None else None)
    evaluator = Evaluator.of(cfg, data, rt, math.ceil(len(seqs) / global_batch), total_steps)
    memory = StepMemory.of(cfg, rt)
    saver = result.saver = Saver(cfg, out, rt)  # async_save, save_total_limit, merge_on_save
    failed = True
    progress = _Progress(rt, total_steps, step)
    if rt.is_main:
        log.info(
            "training: %d sequences, %d steps, global batch %d on %d rank(s) (%s)",
            len(seqs),
            total_steps,
            global_batch,
            rt.world_size,
            rt.device.type,
        )
        if len(mesh) == 2:
            log.info("HSDP: %d replicas of %d-rank shard groups", *mesh)
    try:
        if resume is None and evaluator.at_start:
            trackers.log(evaluator.run(model, 0))
        while step < total_steps:
            started = time.perf_counter()
            batches = _micro_batches(seqs, order, consumed, cfg, rt)
            memory.start()
            record = _train_step(model, optimizer, scheduler, batches, cfg, rt, memory.mark)
            step += 1
            consumed += global_batch
            record = {
                "step": step,
                **record,
                "tokens_per_s": record["tokens"] / max(time.perf_counter() - started, 1e-9),
                "epoch": consumed / len(seqs),
            }
            record["peak_memory_mib"] = memory.finish(step)
            trackers.log(record)
            if rt.is_main:
                result.metrics.append(record)
                if step % cfg.logging_steps == 0 or step == total_steps:
                    log.info(
                        "step %d/%d  loss %.4f  lr %.3g  grad_norm %.4f  tokens/s %.0f",
                        step,
                        total_steps,
                        record["loss"],
                        record["lr"],
                        record["grad_norm"],
                        record["tokens_per_s"],
                    )
            progress.update(record["loss"])
            if evaluator.due(step):  # before the save: a checkpoint's step has its evaluation
                trackers.log(evaluator.run(model, step))
            trackers.flush()
            saver.poll()  # a background save finished: publish it; merges
            final = step == total_steps
            if final and cfg.adapter:
                save_adapter(out, model, cfg)  # the PEFT adapter directory in output_dir
            if final and cfg.fsdp.state_dict_type == "FULL_STATE_DICT":
                if not cfg.adapter:
                    save_full_model(out, model, model_config)
                dist.barrier()
            elif final or (every is not None and step % every == 0):
                state = ckpt.TrainerState(
                    step=step,
                    world_size=rt.world_size,
                    consumed=consumed,
                    global_batch_size=global_batch,
                    total_steps=total_steps,
                    seed=cfg.seed,
                    scheduler=scheduler_state(scheduler),
                    mesh_shape=list(mesh),
                )
                saver.save(ckpt.stamped(state), model, optimizer, final)
        saver.close()  # the last checkpoint is complete before the run ends
        failed = False
    finally:
        if failed:
            saver.abort()
        progress.close()
        trackers.close(failed)
    result.steps = step
    return result


def save_interval(cfg: ShardforgeConfig, num_sequences: int, global_batch: int) -> int | None:
    """Steps between periodic checkpoints: `save_steps`, or `saves_per_epoch` evenly spaced
    checkpoints per epoch (at least one step apart); None: only the final save."""
    if cfg.saves_per_epoch is None:
        return cfg.save_steps
    steps_per_epoch = math.ceil(num_sequences / global_batch)
    return max(1, steps_per_epoch // cfg.saves_per_epoch)


def _continuation(
    saved: ckpt.TrainerState | None, total_steps: int, cfg: ShardforgeConfig, rt: Runtime
) -> Continuation | None:
    """How the lr schedule continues from a checkpoint whose total number of steps differs."""
    if saved is None or saved.total_steps == total_steps:
        return None
    resumed = continuation(cfg, saved.step, saved.total_steps, saved.scheduler)
    if rt.is_main:
        if resumed.multiplier == 0.0:
            log.warning(
                "warning: the checkpoint at step %d ended its learning-rate schedule (lr 0); the "
                "remaining %d steps train at lr 0. To train further, merge it and start a new run "
                "from the merged weights (base_model)",
                saved.step,
                total_steps - saved.step,
            )
        else:
            log.info(
                "total steps changed (%d -> %d): the lr continues from the checkpoint's and "
                "decays (%s) over the remaining %d steps",
                saved.total_steps,
                total_steps,
                cfg.lr_scheduler,
                total_steps - saved.step,
            )
    return resumed


def _resume(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: ShardforgeConfig,
    rt: Runtime,
    global_batch: int,
) -> tuple[int, int]:
    """Load a checkpoint into model, optimizer, scheduler and RNGs; return (step, consumed)."""
    state = ckpt.load_checkpoint(path, model, optimizer, adapter_only=cfg.adapter is not None)
    scheduler.load_state_dict({**scheduler.state_dict(), **state.scheduler})
    if state.global_batch_size != global_batch:
        log.warning(
            "resuming with a global batch of %d sequences (checkpoint: %d); the data order "
            "continues from sample %d",
            global_batch,
            state.global_batch_size,
            state.consumed,
        )
    ckpt.restore_rng(path, rt.rank, state.world_size == rt.world_size, cfg.seed, state.step)
    if rt.is_main:
        log.info("resumed from %s at step %d", path, state.step)
    return state.step, state.consumed


def _train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batches: list[Sequences],
    cfg: ShardforgeConfig,
    rt: Runtime,
    mark: Callable[[str], None] = lambda phase: None,
) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches; the loss is the global-batch mean.
    `mark(phase)` is called after each forward, backward and the optimizer step (diagnostics)."""
    counts = torch.tensor(
        [
            float(sum(int((b.labels[:, 1:] != IGNORE_INDEX).sum()) for b in batches)),
            float(sum(int(b.attention_mask.sum()) for b in batches)),
        ],
        device=rt.device,
    )
    dist.all_reduce(counts)  # target and input tokens of the whole global batch
    targets = max(counts[0].item(), 1.0)
    loss_total = torch.zeros((), device=rt.device)
    for micro, batch in enumerate(batches):
        model.set_requires_gradient_sync(micro == len(batches) - 1)  # type: ignore[operator]
        loss_sum = _loss_sum(model, batch, rt.device)
        mark("forward")
        # FSDP averages gradients over all ranks (under HSDP: reduce-scatter within a shard
        # group, all-reduce across replicas, divided by both sizes); scale back so they are
        # exact sums / targets
        (loss_sum * (rt.world_size / targets)).backward()
        mark("backward")
        loss_total += loss_sum.detach()
    grad_norm = _grad_norm_and_clip(model, cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    mark("optimizer")
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_total)
    return {
        "loss": loss_total.item() / targets,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": int(counts[1].item()),
    }
