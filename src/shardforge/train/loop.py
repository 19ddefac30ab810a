"""One training rank from start to finish: a small trainer whose loop reads in `Trainer.fit`.

    setup()      data, model, optimizer, resume, outputs (False: nothing left to train)
    step()       one optimizer step over the next global batch -> its metrics record
    evaluate()   the evaluation of this step (when due; before the save, so a checkpoint's step
                 has its evaluation)
    save()       the save due after this step: periodic checkpoint, or the final save

A feature hooks in as a `Callback` (`on_step`, `on_evaluate`, `before_save`, `on_end`) given to
`Trainer` / `run_training`; logging, the progress bar and the experiment trackers are callbacks
themselves. The step itself (loss over the global batch, clipping) is `train/step.py`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import ShardforgeError
from shardforge.io.dist import finish_together
from shardforge.io.mirror import public_name
from shardforge.sinks.cast import config_dtype_name
from shardforge.train import checkpointing as ckpt
from shardforge.train.attention import use_packed_attention
from shardforge.train.best import BestModel, Plateau
from shardforge.train.compile import CompileWatch
from shardforge.train.data import (
    GlobalOrder,
    Order,
    SequenceSource,
    load_tokenizer,
    short_of_a_batch,
)
from shardforge.train.diagnostics import StepMemory, report_sharding
from shardforge.train.eval import Evaluator
from shardforge.train.full_save import save_full_model
from shardforge.train.hooks import Callback
from shardforge.train.kernels import apply_kernels
from shardforge.train.lora import prepare_lora, save_adapter
from shardforge.train.loss import describe as describe_loss
from shardforge.train.model import (
    build_meta_model,
    load_model_config,
    materialize_and_load,
    model_config_source,
    shard_model,
)
from shardforge.train.optim import build_optimizer
from shardforge.train.options import (
    QatDelay,
    after_load,
    before_lora,
    before_shard,
    determinism,
)
from shardforge.train.packing import check_packing
from shardforge.train.prepared import prepared_datasets
from shardforge.train.quant import quant_kind, quantize_base, unsharded
from shardforge.train.remote_run import (
    RemoteOutput,
    RunFiles,
    checkpoint_folder,
    checkpoint_name,
    local_folder,
)
from shardforge.train.runtime import (
    Runtime,
    device_mesh,
    init_distributed,
    local_world_size,
    mesh_shape,
    output_dir_lock,
)
from shardforge.train.saving import Saver
from shardforge.train.schedules import (
    Continuation,
    build_scheduler,
    continuation,
    continues,
    load_scheduler,
    scheduler_state,
)
from shardforge.train.step import micro_batches, train_step
from shardforge.train.streaming import Stream, StreamOrder, streamed_datasets
from shardforge.train.tracking import Trackers, open_trackers
from shardforge.train.vocab import grow_vocab_size

log = logging.getLogger("shardforge")


@dataclass
class TrainResult:
    """What a finished run reports (rank 0 has the metrics of the steps it ran)."""

    steps: int
    output_dir: Path | str  # str: an s3:// URI
    metrics: list[dict[str, Any]] = field(default_factory=list)
    resumed_from: Path | str | None = None
    saver: Saver | None = None  # its merges (merge_on_save) outlive the process group


class Tracking(Callback):
    """Every record to metrics.jsonl, TensorBoard and W&B (`tracking.py`), flushed before a
    save."""

    def __init__(self, trackers: Trackers) -> None:
        self.trackers = trackers

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.trackers.log(record)

    def on_evaluate(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.trackers.log(record)

    def before_save(self, trainer: Trainer) -> None:
        self.trackers.flush()

    def on_end(self, trainer: Trainer, failed: bool) -> None:
        self.trackers.close(failed)


class StepLog(Callback):
    """Rank 0: keeps the step records (`TrainResult.metrics`), logs every `logging_steps` and
    the last step, and shows a tqdm bar when stderr is a TTY."""

    def __init__(self, trainer: Trainer) -> None:
        self.bar: Any = None
        if trainer.rt.is_main and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=trainer.total_steps, initial=trainer.global_step, desc="train", unit="step"
            )

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        step = record["step"]
        if trainer.rt.is_main:
            trainer.result.metrics.append(record)
            if step % trainer.cfg.logging_steps == 0 or trainer.final:
                log.info(
                    "step %d/%d  loss %.4f  lr %.3g  grad_norm %.4f  tokens/s %.0f",
                    step,
                    trainer.total_steps,
                    record["loss"],
                    record["lr"],
                    record["grad_norm"],
                    record["tokens_per_s"],
                )
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}")
            self.bar.update(1)

    def on_end(self, trainer: Trainer, failed: bool) -> None:
        if self.bar is not None:
            self.bar.close()


def run_training(
    cfg: ShardforgeConfig, callbacks: Sequence[Callback] = (), *, keep_group: bool = False
) -> TrainResult:
    """Train on this rank (joining or creating the process group); destroy the group after.
    `keep_group`: after a complete run the group is left as it is, for a caller that leaves its
    process at once (a rank of `shardforge train`: `cli.train_rank`): gloo's teardown, or the
    interpreter's with a group alive, can abort a rank after its last checkpoint ("terminate
    called without an active exception"), which fails a run that is complete."""
    rt = init_distributed()
    with contextlib.ExitStack() as held:  # rank 0: output_dir's lock, for the whole run
        finished = False
        try:
            held.enter_context(output_dir_lock(cfg, rt))
            result = Trainer(cfg, rt, callbacks).fit()
            # every rank is done with its last collective before any rank tears the group down
            # (gloo can abort a rank whose peer closes its connections while it still talks)
            finish_together()
            finished = True
        finally:
            if not (finished and keep_group):
                dist.destroy_process_group()
        if result.saver is not None:
            result.saver.finish()  # merge_on_save: the run ends when its merges have
    return result


class Trainer:
    """One rank's run: `fit()` is the loop, its methods the seams (see the module's doc)."""

    def __init__(
        self, cfg: ShardforgeConfig, rt: Runtime, callbacks: Sequence[Callback] = ()
    ) -> None:
        self.cfg, self.rt = cfg, rt
        self.out = Path(cfg.output_dir)
        # output_dir in a store: checkpoints go there directly, the other files of the run are
        # written in a local folder and uploaded (rank 0; `train.remote_run`)
        self.remote = RemoteOutput.of(cfg)
        self.files: RunFiles | None = None
        if self.remote is not None:
            self.out = local_folder()
            self.files = RunFiles(self.remote, self.out) if rt.is_main else None
        self.extra = list(callbacks)
        self.callbacks: list[Callback] = []  # made by setup: built-in, then `callbacks`
        self.global_step = 0  # optimizer steps done (a resumed run starts at its checkpoint's)
        self.consumed = 0  # sequences of the global order used so far
        self.stop = False  # set by a callback: end after this step, with the final save

    @property
    def final(self) -> bool:
        """This step is the run's last."""
        return self.global_step >= self.total_steps or self.stop

    def fit(self) -> TrainResult:
        try:
            return self._fit()
        finally:
            if self.remote is not None:
                shutil.rmtree(self.out, ignore_errors=True)

    def _fit(self) -> TrainResult:
        if not self.setup():
            return self.result
        failed = True
        try:
            if self.resume is None and self.evaluator.at_start:
                self.evaluate()
            while not self.final:
                self._emit("on_step", self.step())
                if self.evaluator.due(self.global_step, last=self.final):
                    self.evaluate()  # before the save: a checkpoint's step has its evaluation
                self._emit("before_save")
                self.saver.poll()  # a background save finished: publish it; merges
                self.save()
            self.saver.close()  # the last checkpoint is complete before the run ends
            failed = False
        finally:
            if failed:
                self.saver.abort()
            for callback in reversed(self.callbacks):
                callback.on_end(self, failed)
            self._upload(failed)
        self.result.steps = self.global_step
        return self.result

    def _upload(self, failed: bool = False) -> None:
        """Rank 0, output_dir in a store: upload the run's new and changed files (after a
        failure as far as the store lets it: the failure is what is reported)."""
        if self.files is None:
            return
        if not failed:
            self.files.sync()
            return
        with contextlib.suppress(ShardforgeError):
            self.files.sync()

    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    # -- setup ----------------------------------------------------------------------------------

    def setup(self) -> bool:
        """Everything before the first step. False: the checkpoint to resume from already
        reached the total number of steps (nothing to do; nothing is written)."""
        cfg, rt = self.cfg, self.rt
        torch.manual_seed(cfg.seed)
        determinism(cfg)  # full_determinism
        self.mesh = mesh_shape(cfg, rt.world_size, local_world_size())  # before any write
        if cfg.tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self._setup_data()
        with checkpoint_folder(cfg) as folder:  # an s3:// output_dir: its mirror
            self.resume = ckpt.resolve_resume(
                cfg.resume_from_checkpoint, folder, rt.is_main, cfg.storage_options
            )
            return self._setup_from(self.resume)

    def _setup_from(self, resume: Path | None) -> bool:
        """`setup` once the checkpoint to resume from (if any) is found."""
        cfg, rt = self.cfg, self.rt
        saved = ckpt.TrainerState.read(resume) if resume is not None else None
        shown = checkpoint_name(resume) if resume and self.remote else resume
        output = cfg.output_dir if self.remote is not None else self.out
        self.result = TrainResult(steps=0, output_dir=output, resumed_from=shown)
        if saved is not None and saved.step >= self.total_steps:
            if rt.is_main:
                log.info(
                    "nothing to do: %s already reached max_steps=%d (set a larger max_steps to "
                    "train further)",
                    shown,
                    self.total_steps,
                )
            self.result.steps = saved.step
            return False
        self._setup_model()
        self._setup_optimizer(saved)
        self._setup_outputs()
        return True

    def _setup_data(self) -> None:
        """Tokenizer, model config (grown for added tokens), data sets and the step counts."""
        cfg, rt = self.cfg, self.rt
        self.tokenizer = load_tokenizer(cfg)
        self.model_config = load_model_config(cfg)
        # the base model's stored dtype: the run's config.json keeps it (the model is built in
        # float32 from a copy) and each checkpoint records it, the merge's default output dtype
        self.base_dtype = config_dtype_name(self.model_config)
        self.base_rows = int(self.model_config.get_text_config().vocab_size)
        grow_vocab_size(self.model_config, self.tokenizer, cfg)  # before the model is built
        self.global_batch = cfg.micro_batch_size * rt.world_size * cfg.gradient_accumulation_steps
        self.stream: Stream | None = None  # streaming / pretraining_dataset (`train.streaming`)
        self.seqs: SequenceSource
        if cfg.streamed:
            self.data, self.stream = streamed_datasets(cfg, self.tokenizer, self.global_batch)
            self.seqs = self.stream
        else:  # training (and held-out / test) ones; through dataset_prepared_path when set
            self.data = prepared_datasets(cfg, self.tokenizer, rt)
            self.seqs = self.data.train
        if len(self.seqs) < self.global_batch:
            short_of_a_batch(len(self.seqs), self.global_batch, cfg, rt.is_main)
        # dataloader_drop_last: each epoch only its whole global batches
        per_epoch = len(self.seqs) // self.global_batch * self.global_batch
        used = per_epoch if cfg.dataloader_drop_last else len(self.seqs)
        self.total_steps = cfg.max_steps or math.ceil(cfg.num_epochs * used / self.global_batch)
        self.every = save_interval(cfg, len(self.seqs), self.global_batch)
        self.order: Order = (
            StreamOrder()
            if self.stream is not None
            else GlobalOrder(len(self.seqs), cfg.seed, used)
        )

    def _setup_model(self) -> None:
        """The sharded model with its weights (and LoRA); rank 0 writes the run's config and
        tokenizer into output_dir."""
        cfg, rt = self.cfg, self.rt
        model = build_meta_model(cfg, self.model_config, announce=rt.is_main)
        apply_kernels(model, cfg, announce=rt.is_main)  # plugins: Liger, Cut Cross Entropy, ...
        check_packing(cfg, model)  # sample_packing needs attention that keeps samples apart
        use_packed_attention(model, cfg, rt.device, rt.is_main)  # packed: no dense mask
        before_lora(model, cfg, rt.is_main)  # qat
        weights = prepare_lora(model, cfg, rt.is_main) if cfg.adapter else None
        frozen_rows = before_shard(model, cfg, rt.is_main)  # fp8, unfrozen_parameters, bfloat16
        quantized = quantize_base(model, cfg, self.mesh) if quant_kind(cfg) else set()
        shard_model(model, cfg, device_mesh(rt, self.mesh), unsharded(model, quantized, self.mesh))
        materialize_and_load(model, cfg, rt.device, rt.rank, weights, quantized)
        del weights
        self.after_backward = after_load(model, cfg, frozen_rows, self.base_rows, self._ids)
        report_sharding(model, cfg, rt, self.mesh)
        if rt.is_main:
            log.info("%s", describe_loss(cfg, model))
            self.out.mkdir(parents=True, exist_ok=True)
            write_output_metadata(self.out, cfg, self.model_config, self.tokenizer)
            self._upload()
        dist.barrier()
        model.train()
        self.model = model

    def _ids(self) -> set[int]:
        """The token ids of the training sequences (fix_untrained_tokens: true)."""
        return set(self.data.train.input_ids.unique().tolist())

    def _setup_optimizer(self, saved: ckpt.TrainerState | None) -> None:
        """Optimizer and lr schedule; resuming: their states, the RNGs and the data position."""
        cfg, rt = self.cfg, self.rt
        self.optimizer = build_optimizer(self.model, cfg)
        resumed = _continuation(saved, self.total_steps, cfg, rt)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps, resumed)
        if self.resume is not None:
            self.global_step, self.consumed = _resume(
                self.resume, self.model, self.optimizer, self.scheduler, cfg, rt, self.global_batch
            )
            if self.stream is not None:  # continue the stream from the checkpoint's block
                self.stream.resume(saved.stream if saved else None, self.consumed)
        elif cfg.resume_from_checkpoint == "auto" and rt.is_main:
            log.info(
                "resume_from_checkpoint: auto found no checkpoint in %s; starting fresh",
                cfg.output_dir,
            )
        self.result.steps = self.global_step

    def _setup_outputs(self) -> None:
        """Trackers, evaluation, memory diagnostics, the saver and the callbacks."""
        cfg, rt = self.cfg, self.rt
        resumed_step = self.global_step if self.resume is not None else None
        if self.files is not None and resumed_step is not None:
            self.files.fetch_continued()  # metrics.jsonl (and W&B's run id) to continue
        trackers = open_trackers(cfg, self.out, rt.is_main, resumed_step)
        steps_per_epoch = math.ceil(len(self.seqs) / self.global_batch)
        self.evaluator = Evaluator.of(cfg, self.data, rt, steps_per_epoch, self.total_steps)
        self.memory = StepMemory.of(cfg, rt)
        self.compiled = CompileWatch.of(cfg, rt)  # torch_compile: compile time, recompiles
        # async, rotation, merges
        self.saver = self.result.saver = Saver(cfg, self.remote or self.out, rt)
        self.callbacks = [Tracking(trackers), StepLog(self), *self.extra]
        if cfg.load_best_model_at_end or cfg.early_stopping_patience:
            self.callbacks.insert(2, BestModel(self))
        if cfg.lr_scheduler == "reduce_lr_on_plateau":
            self.callbacks.insert(2, Plateau(self))
        if cfg.qat is not None and cfg.qat.fake_quant_after_n_steps is not None:
            self.callbacks.insert(2, QatDelay(self))
        if rt.is_main:
            log.info(
                "training: %d sequences, %d steps, global batch %d on %d rank(s) (%s)",
                len(self.seqs),
                self.total_steps,
                self.global_batch,
                rt.world_size,
                rt.device.type,
            )
            if len(self.mesh) == 2:
                log.info("HSDP: %d replicas of %d-rank shard groups", *self.mesh)

    # -- the loop's seams -----------------------------------------------------------------------

    def step(self) -> dict[str, Any]:
        """One optimizer step over the next global batch; its metrics record."""
        started = time.perf_counter()
        batches = micro_batches(self.seqs, self.order, self.consumed, self.cfg, self.rt)
        self.memory.start()
        self.compiled.before_step()
        record = train_step(
            self.model,
            self.optimizer,
            self.scheduler,
            batches,
            self.cfg,
            self.rt,
            self.memory.mark,
            self.after_backward,
        )
        self.global_step += 1
        self.compiled.after_step(self.global_step)
        self.consumed += self.global_batch
        record = {
            "step": self.global_step,
            **record,
            "tokens_per_s": record["tokens"] / max(time.perf_counter() - started, 1e-9),
            "epoch": self.consumed / len(self.seqs),
        }
        record["peak_memory_mib"] = self.memory.finish(self.global_step)
        return record

    def evaluate(self) -> None:
        """Evaluate the model at this step; the record goes to the callbacks."""
        with self.compiled.evaluation():  # torch_compile: the first one compiles
            record = self.evaluator.run(self.model, self.global_step)
        self._emit("on_evaluate", record)

    def save(self) -> None:
        """The save due after this step: at the end the PEFT adapter directory (LoRA) and,
        with FULL_STATE_DICT, the Hugging Face weights; else a checkpoint every `every` steps
        and at the end. `save_strategy: no`: nothing."""
        cfg, final = self.cfg, self.final
        if cfg.save_strategy == "no":
            if final and self.rt.is_main:
                log.info("save_strategy: no: the trained model is not saved")
            return
        if final and cfg.adapter:
            save_adapter(self.out, self.model, cfg)  # the PEFT adapter directory in output_dir
        if final and cfg.fsdp.state_dict_type == "FULL_STATE_DICT":
            if not cfg.adapter:
                save_full_model(self.out, self.model, self.model_config)
            dist.barrier()
        elif final or self.save_due():
            self.saver.save(ckpt.stamped(self.trainer_state()), self.model, self.optimizer, final)
            self._upload()  # the metrics up to this checkpoint

    def save_due(self) -> bool:
        """A checkpoint is due after this step (every `every` steps; save_first_step: also
        after the first)."""
        if self.cfg.save_first_step and self.global_step == 1:
            return True
        return self.every is not None and self.global_step % self.every == 0

    def trainer_state(self) -> ckpt.TrainerState:
        """What a checkpoint of this step records beside the model and optimizer."""
        return ckpt.TrainerState(
            step=self.global_step,
            world_size=self.rt.world_size,
            consumed=self.consumed,
            global_batch_size=self.global_batch,
            total_steps=self.total_steps,
            seed=self.cfg.seed,
            scheduler=scheduler_state(self.scheduler),
            mesh_shape=list(self.mesh),
            base_dtype=self.base_dtype,
            optimizer=not self.cfg.save_only_model,
            stream=self.stream.state() if self.stream is not None else None,
        )


def write_output_metadata(
    out: Path, cfg: ShardforgeConfig, model_config: Any, tokenizer: Any
) -> None:
    """config.json, generation_config.json (if the base has one) and the tokenizer into `out`,
    output_dir or the local folder of a run in a store (rank 0)."""
    from transformers import GenerationConfig

    model_config.save_pretrained(out)
    with contextlib.suppress(OSError):
        GenerationConfig.from_pretrained(model_config_source(cfg)).save_pretrained(out)
    tokenizer.save_pretrained(out)


def save_interval(cfg: ShardforgeConfig, num_sequences: int, global_batch: int) -> int | None:
    """Steps between periodic checkpoints: `save_steps`, or `saves_per_epoch` evenly spaced
    checkpoints per epoch (at least one step apart; `save_strategy: epoch`: one); None: only
    the final save."""
    per_epoch = 1 if cfg.save_strategy == "epoch" else cfg.saves_per_epoch
    if per_epoch is None:
        return cfg.save_steps
    steps_per_epoch = math.ceil(num_sequences / global_batch)
    return max(1, steps_per_epoch // per_epoch)


def _continuation(
    saved: ckpt.TrainerState | None, total_steps: int, cfg: ShardforgeConfig, rt: Runtime
) -> Continuation | None:
    """How the lr schedule continues from a checkpoint whose total number of steps differs."""
    if saved is None or saved.total_steps == total_steps:
        return None
    if not continues(cfg):
        if rt.is_main:
            log.info(
                "total steps changed (%d -> %d): the lr follows the %s schedule of %d steps",
                saved.total_steps,
                total_steps,
                cfg.lr_scheduler,
                total_steps,
            )
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
    load_scheduler(scheduler, state.scheduler)
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
        log.info("resumed from %s at step %d", public_name(str(path)), state.step)
    return state.step, state.consumed
