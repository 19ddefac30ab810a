"""Everything about a training config that can be checked before any process group starts.

Each check is a function `(cfg) -> list of (config key, problem)`; `preflight` runs them all and
raises one ConfigError that names every failing key. The model check builds the architecture on
the meta device only (no weights are read).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from shardforge.config.schema import ShardforgeConfig
from shardforge.config.schema_data import DatasetConfig, PretrainingDataset
from shardforge.errors import ConfigError, ShardforgeError, StorageError
from shardforge.io.remote import is_remote
from shardforge.train import checkpointing as ckpt
from shardforge.train.eval import check_eval
from shardforge.train.kernels import plan as kernel_plan
from shardforge.train.loss import loss_chunks
from shardforge.train.model import (
    WEIGHT_FILES,
    WEIGHT_INDEX_FILES,
    build_meta_model,
    compute_dtypes,
    load_model_config,
    wrap_classes,
)
from shardforge.train.optim import optimizer_problem
from shardforge.train.options import before_lora, before_shard
from shardforge.train.packing import check_packing
from shardforge.train.quant import check_quant
from shardforge.train.readers import data_files
from shardforge.train.remote_run import checkpoint_folder
from shardforge.train.remote_run import problems as remote_problems
from shardforge.train.runtime import mesh_shape
from shardforge.train.schedules import schedule_problem
from shardforge.train.tracking import check_trackers

log = logging.getLogger("shardforge")

Problem = tuple[str, str]


def _problems_of(exc: ShardforgeError) -> list[Problem]:
    if isinstance(exc, ConfigError):
        return [(exc.source, p) for p in exc.problems]
    return [("", str(exc))]


def check_datasets(cfg: ShardforgeConfig) -> list[Problem]:
    entries: list[DatasetConfig | PretrainingDataset] = [*(cfg.pretraining_dataset or cfg.datasets)]
    name = "pretraining_dataset" if cfg.pretraining_dataset else "datasets"
    if not entries:
        return [("datasets", "no training data; add at least one entry with a local `path`")]
    out: list[Problem] = []
    for i, ds in enumerate(entries):
        try:
            data_files(ds, f"{name}[{i}]")
        except ConfigError as exc:
            out += _problems_of(exc)
    return out


def check_model(cfg: ShardforgeConfig) -> list[Problem]:
    """The base config loads, local weights exist and the wrap classes are in the model."""
    try:
        model_config = load_model_config(cfg)
        base = Path(cfg.base_model)
        if base.is_dir() and not any(
            (base / n).is_file() for n in (*WEIGHT_FILES, *WEIGHT_INDEX_FILES)
        ):
            return [("base_model", f"no model.safetensors (or its index) in {base}")]
        model = build_meta_model(cfg, model_config)
        wrap_classes(model, cfg.fsdp.transformer_layer_cls_to_wrap)
        before_lora(model, cfg, announce=False)  # qat builds
        before_shard(model, cfg, announce=False)  # unfrozen_parameters match, fp8 runs here
        check_packing(cfg, model)
        loss_chunks(cfg, model)  # chunked_cross_entropy: true needs a model it is exact for
        kernel_plan(cfg)  # plugins: one fused loss at most
    except ConfigError as exc:
        return _problems_of(exc)
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and cfg.sequence_len > max_pos:
        log.warning(
            "warning: sequence_len %d is longer than the model's max_position_embeddings %d",
            cfg.sequence_len,
            max_pos,
        )
    return []


def check_tokenizer(cfg: ShardforgeConfig) -> list[Problem]:
    from shardforge.train.data import load_tokenizer

    try:
        tok = load_tokenizer(cfg)
    except ConfigError as exc:
        return _problems_of(exc)
    out: list[Problem] = []
    for i, ds in enumerate(cfg.datasets):
        if ds.type == "chat_template" and not getattr(tok, "chat_template", None):
            out.append(
                (f"datasets[{i}].type", "the tokenizer has no chat template; set `chat_template`")
            )
    return out


def check_resume(cfg: ShardforgeConfig) -> list[Problem]:
    """A resume path is a complete checkpoint; a fresh start does not mix with old checkpoints
    (an s3:// output_dir: the checkpoints stored there)."""
    problems = remote_problems(cfg)
    if problems:
        return problems
    try:
        with checkpoint_folder(cfg) as out:
            resume, options = cfg.resume_from_checkpoint, cfg.storage_options
            ckpt.resolve_resume(resume, out, False, options)  # the ranks announce
            existing = ckpt.complete_checkpoints(out)
            saved = _saved_model(out) if cfg.resume_from_checkpoint is None else []
    except StorageError as exc:  # the store cannot be listed
        return [("output_dir", exc.message)]
    except ShardforgeError as exc:
        return [("resume_from_checkpoint", str(exc).removeprefix("resume_from_checkpoint: "))]
    if cfg.resume_from_checkpoint is None and existing:
        return [
            (
                "output_dir",
                f"{cfg.output_dir} already holds checkpoints "
                f"({', '.join(p.name for p in existing)}); set "
                "resume_from_checkpoint: auto to continue, or use an empty output_dir",
            )
        ]
    if saved and is_remote(cfg.output_dir):  # a local output_dir: `check_output`
        return [("output_dir", _overwrites(cfg.output_dir, saved))]
    return []


# a full Hugging Face model save (FULL_STATE_DICT's final save, or any save_pretrained)
FULL_MODEL_PATTERNS = (*WEIGHT_FILES, *WEIGHT_INDEX_FILES, "pytorch_model*.bin")


def _saved_model(out: Path) -> list[str]:
    if not out.is_dir():
        return []
    return sorted({p.name for pattern in FULL_MODEL_PATTERNS for p in out.glob(pattern)})


def _overwrites(out: str | Path, saved: list[str]) -> str:
    return (
        f"{out} already holds a saved model ({', '.join(saved)}) that a fresh run would "
        "overwrite; use an empty output_dir"
    )


def check_output(cfg: ShardforgeConfig) -> list[Problem]:
    """output_dir is not (inside) the base model, and a fresh run overwrites no saved model
    (an s3:// output_dir: `check_resume` looks at what is stored there)."""
    if is_remote(cfg.output_dir):
        return []
    out = Path(cfg.output_dir).resolve()
    base = Path(cfg.base_model)
    if base.is_dir():
        base = base.resolve()
        if out == base or base in out.parents:
            where = "is" if out == base else "is inside"
            return [
                (
                    "output_dir",
                    f"{cfg.output_dir} {where} the base model directory {cfg.base_model}; "
                    "training would write over the base model: use another output_dir",
                )
            ]
    saved = _saved_model(out) if cfg.resume_from_checkpoint is None else []
    return [("output_dir", _overwrites(out, saved))] if saved else []


def check_attention(cfg: ShardforgeConfig) -> list[Problem]:
    """attn_implementation is one transformers knows."""
    impl = cfg.attn_implementation
    if impl is None:
        return []
    known = attention_implementations()
    if impl not in known and "/" not in impl:  # org/name: a kernel from the hub
        return [
            (
                "attn_implementation",
                f"unknown value {impl!r}; transformers accepts {', '.join(known)}",
            )
        ]
    # one that cannot run here (flash or flex without a GPU, one the model lacks) is replaced
    # when the model is built, with a notice (train.model.runnable_attention)
    return []


def attention_implementations() -> list[str]:
    """The attn_implementation values this transformers accepts (with shardforge's own:
    varlen_attention, registered by train.attention)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import shardforge.train.attention  # noqa: F401

    return ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]


def check_mesh(cfg: ShardforgeConfig, world: tuple[int, int]) -> list[Problem]:
    """dp_shard_size / dp_replicate_size / fsdp.hybrid_shard fit the world size."""
    try:
        mesh_shape(cfg, *world)
    except ConfigError as exc:
        return _problems_of(exc)
    return []


def check_device(cfg: ShardforgeConfig) -> list[Problem]:
    """Settings that only mean something with a GPU."""
    import torch

    if torch.cuda.is_available():
        if cfg.fp16:
            log.warning("warning: fp16 trains without loss scaling; prefer bf16 where supported")
        return []
    out: list[Problem] = []
    if cfg.fp16:
        out.append(("fp16", "float16 training needs a GPU; use bf16 or float32 on CPU"))
    if cfg.fsdp.offload_params:  # Axolotl's FSDP examples set it: the same run, nothing to move
        log.warning(
            "notice: fsdp.offload_params: no GPU here; the parameters stay on the CPU as they "
            "are (no offload policy needed)"
        )
    return out


def check_quantized(cfg: ShardforgeConfig) -> list[Problem]:
    """load_in_4bit / load_in_8bit: torchao installed, the compute dtype agreed (`quant`)."""
    return check_quant(cfg, compute_dtypes(cfg)[0])


def check_optimizer(cfg: ShardforgeConfig) -> list[Problem]:
    """The optimizer's package and arguments; the schedule's arguments."""
    problems = [p for p in (optimizer_problem(cfg),) if p is not None]
    schedule = schedule_problem(cfg)
    return problems + ([("lr_scheduler_kwargs", schedule)] if schedule else [])


Check = Callable[[ShardforgeConfig], list[Problem]]

CHECKS: tuple[Check, ...] = (
    check_datasets,
    check_eval,
    check_trackers,
    check_attention,
    check_model,
    check_tokenizer,
    check_output,
    check_resume,
    check_device,
    check_quantized,
    check_optimizer,
)
# what preparing the data sets needs (`shardforge preprocess`): data files and the tokenizer
DATA_CHECKS: tuple[Check, ...] = (check_datasets, check_eval, check_tokenizer)


def preflight(
    cfg: ShardforgeConfig,
    source: str = "config",
    world: tuple[int, int] | None = None,
    checks: tuple[Check, ...] | None = None,
) -> None:
    """Run every check (of `checks`, default CHECKS); raise one ConfigError listing all
    problems, each with its key. `world` is (world size, ranks per machine) when known: then the
    HSDP mesh sizes are checked."""
    problems: list[Problem] = []
    todo = list(CHECKS if checks is None else checks)
    if world is not None:
        todo.append(lambda c: check_mesh(c, world))
    for check in todo:
        seen = {key for key, _ in problems}
        problems += [p for p in check(cfg) if p[0] not in seen]  # one problem per key
    if problems:
        raise ConfigError(source, [f"{key}: {text}" if key else text for key, text in problems])
