"""`merge_lora`: fuse a PEFT LoRA adapter directory into its base model and write a complete
Hugging Face model directory, streamed one tensor at a time.

    from shardforge.config import load_cfg
    from shardforge.merge.lora import merge_lora
    merge_lora(load_cfg("cfg.yml", command="merge-lora"), "out/merged", verify=True)

Every output tensor is a source (`shardforge.formats.sources`): an untouched base tensor is
copied file to file from the base model's safetensors; an adapted weight is a
`FusedLoraSource` (``W + scale * B @ A`` in float32, peft's operations in peft's order, cast to
the output dtype by the writer); a modules_to_save module's tensor is the adapter's copy.
Memory: one tensor, its float32 delta, and the two LoRA factors.

Before a byte is written the adapter is checked against the base model's architecture (built
on the meta device): every adapted module exists and is targeted by the adapter's config, A is
(r, in) and B is (out, r) with the module's own r, every modules_to_save copy has its module's
shape, and the base model's files hold every tensor the architecture needs.

The fuse itself (`merge.lora_fuse.fuse_sources`) is shared with the merge of a LoRA training
checkpoint.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardforge.config import coerce_cfg
from shardforge.config.schema import ShardforgeConfig, names_object_storage
from shardforge.errors import CheckpointError, MergeError, shown
from shardforge.formats.safetensors.reader import (
    open_safetensors_dir,
    open_safetensors_file,
)
from shardforge.formats.sources import TensorSource
from shardforge.io.copy import ReadCache, fact_session
from shardforge.io.files import check_resolvable, read_json
from shardforge.io.lock import lock_beside, output_lock
from shardforge.io.pins import pin, pin_session
from shardforge.io.publish import (
    check_free_space,
    check_output_path,
    output_error,
    sigterm_as_interrupt,
)
from shardforge.io.readahead import prefetch
from shardforge.keymap.keys import check_tied_copies
from shardforge.keymap.lora import LoraNames, split_adapter_names
from shardforge.keymap.lora_settings import LoraSettings
from shardforge.merge.check import ExpectedModel, build_expected, check_against
from shardforge.merge.check import load_config as load_model_config
from shardforge.merge.dtypes import main_dtype, output_rules, planned_specs
from shardforge.merge.lora_fuse import fuse_sources, unties
from shardforge.merge.lora_params import fuse_params, peft_settings, split_param_pairs
from shardforge.sinks.base import Companions, Output, WriteOptions
from shardforge.sinks.companions import has_tokenizer
from shardforge.sinks.hf_dir import HfDirectorySink
from shardforge.sinks.plan import OutputPlan, default_max_shard_size, plan_output
from shardforge.sinks.resume import pinned_inputs

log = logging.getLogger("shardforge")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# the pickle peft writes with safe_serialization=False (never read)
ADAPTER_PICKLE = "adapter_model.bin"
# Axolotl's merge-lora writes <output_dir>/merged
MERGED_DIRNAME = "merged"
# the largest adapter_config.json read
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
# the writer a merge-lora's lock file names, and how a user takes another host's lock over
LORA_COMMAND = "shardforge merge-lora"
TAKE_OVER = "--take_over_lock"


# ----------------------------------------------------------------------------- the adapter


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter directory: its settings, its tensors' names split by role, and a
    source per tensor (by the name in the adapter file)."""

    directory: Path
    settings: LoraSettings
    names: LoraNames
    tensors: dict[str, TensorSource]
    base_model_name: str | None
    config_data: Mapping[str, Any] = field(default_factory=dict)  # adapter_config.json


def read_adapter(directory: str | Path) -> Adapter:
    """Open a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
    without loading a tensor; CheckpointError naming the file for anything missing, unsafe or
    not fusable."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(
            f"{root}: adapter directory not found; set lora_model_dir or pass --lora_model_dir"
        )
    config_path = root / ADAPTER_CONFIG
    if not config_path.exists():
        raise CheckpointError(
            f"{root}: no {ADAPTER_CONFIG}, so not a PEFT adapter directory; set lora_model_dir "
            "or pass --lora_model_dir"
        )
    weights = root / ADAPTER_WEIGHTS
    if not weights.exists():
        if (root / ADAPTER_PICKLE).exists():
            raise CheckpointError(
                f"{root / ADAPTER_PICKLE}: a pickle, which shardforge never loads; convert it "
                "to adapter_model.safetensors where you trust it (load it with peft and "
                "save_pretrained(..., safe_serialization=True))"
            )
        raise CheckpointError(f"{root}: no {ADAPTER_WEIGHTS}; the adapter has no weights")
    data = read_json(config_path, root, MAX_ADAPTER_CONFIG_BYTES)
    settings = LoraSettings.from_adapter_config(data, str(config_path))
    tensors: dict[str, TensorSource] = dict(open_safetensors_file(weights, root))
    names = split_adapter_names(tensors, str(weights))
    base = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    return Adapter(root, settings, names, tensors, base if isinstance(base, str) else None, data)


# ------------------------------------------------------------------------------ the merge


def base_directory(base_model: str | None) -> Path:
    """base_model as a local directory: the path, else its snapshot in the Hugging Face cache
    (nothing is downloaded)."""
    if not base_model:
        raise MergeError("base_model is not set; merge-lora needs the base model's directory")
    path = Path(base_model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(base_model, local_files_only=True))
    except Exception:
        raise MergeError(
            f"base_model {shown(base_model)}: neither a local directory nor a model in the "
            "Hugging Face cache; download it first or set base_model to its directory"
        ) from None


@dataclass(frozen=True)
class LoraMerge:
    """Everything decided and checked before a byte is written."""

    adapter: Adapter
    base_dir: Path
    config_source: str
    tokenizer_source: str
    expected: ExpectedModel
    by_name: dict[str, TensorSource]
    plan: OutputPlan
    dtype: torch.dtype | None  # the main output dtype (config.json)


def base_sources(
    base_dir: Path,
    expected: ExpectedModel,
    source: str,
    untied: Mapping[str, str] | None = None,
) -> dict[str, TensorSource]:
    """The base model's tensors, checked: unexpected ones dropped (as from_pretrained drops
    them), tied copies compared then dropped, every stored name present with its shape.

    `untied`: target -> source of the tied pairs the adapter unties (`unties`): the base
    model's target is its source's tensor, as from_pretrained ties it."""
    opened: dict[str, TensorSource] = dict(open_safetensors_dir(base_dir))
    unexpected = sorted(n for n in opened if n not in expected.shapes)
    if unexpected:
        log.warning(
            "%s: %d tensor(s) the architecture does not have are not written: %s",
            base_dir,
            len(unexpected),
            ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else ""),
        )
    base = {n: s for n, s in opened.items() if n in expected.shapes}
    tied = {**expected.tied, **(untied or {})}
    with ReadCache() as reader:
        check_tied_copies(tied, base, lambda s: s.read(reader), str(base_dir))
    for target, kept in (untied or {}).items():
        if kept in base:
            base[target] = base[kept]
    try:
        check_against(expected, base, {n: n for n in base}, [], source)
    except MergeError as exc:
        raise MergeError(f"{base_dir}: {exc.message}", exc.details) from None
    return {n: s for n, s in base.items() if n not in expected.tied}


def _log_adapter(adapter: Adapter) -> None:
    s = adapter.settings
    saved = len(adapter.names.replacements)  # modules_to_save: trained in full
    log.info(
        "adapter: %s (r=%d, lora_alpha=%g%s, %d adapted modules%s)",
        adapter.directory,
        s.r,
        s.lora_alpha,
        ", rsLoRA" if s.use_rslora else "",
        len(adapter.names.pairs),
        f", {saved} tensors trained in full (modules_to_save)" if saved else "",
    )


def _tokenizer_source(cfg: ShardforgeConfig, adapter_dir: Path, base_dir: Path) -> str:
    """The config's tokenizer_config, else the adapter's own tokenizer, else the base model's."""
    if cfg.tokenizer_config:
        return cfg.tokenizer_config
    return str(adapter_dir if has_tokenizer(adapter_dir) else base_dir)


def _untie(
    adapter: Adapter, config: Any, expected: ExpectedModel, trust_remote_code: bool
) -> tuple[ExpectedModel, dict[str, str]]:
    """The architecture with the tied pairs the adapter's modules_to_save copies untie
    (`unties`) untied, as peft's merge_and_unload: the saved copy on one side, the original
    on the other. Returns the architecture and target -> source of the untied pairs."""
    untied = {
        name: expected.tied[name] for name in unties(adapter.names, adapter.settings, expected)
    }
    if not untied:
        return expected, untied
    config.tie_word_embeddings = False
    expected = build_expected(config, trust_remote_code)
    if any(t in expected.tied for t in untied):
        raise MergeError(
            f"{adapter.directory}: a modules_to_save copy of a tied weight "
            f"({', '.join(untied)}) needs the weights untied, and setting "
            "tie_word_embeddings false does not untie them for this architecture"
        )
    log.warning(
        "%s: a modules_to_save copy of one of the tied weights %s: the merged model unties "
        "them (tie_word_embeddings: false), as peft's merge_and_unload does; train with "
        "ensure_weight_tying to keep them tied",
        adapter.directory,
        ", ".join(f"{t} / {s}" for t, s in untied.items()),
    )
    return expected, untied


def _as_saved(expected: ExpectedModel, names: LoraNames, source: str) -> ExpectedModel:
    """An architecture saved under other names than it has in memory (transformers' weight
    conversion: MoE experts fused in memory, saved per expert): the adapter is fused into the
    base files' tensors as they are saved, which holds while it changes none of the renamed
    ones (LoRA on the attention and linear layers, as lora_target_linear adapts them; a LoRA
    on the fused experts themselves is `merge.lora_params`')."""
    if not expected.renamed_on_save:
        return expected
    view = expected.as_saved()
    changed = [*names.fused_names(), *names.replacements]
    renamed = sorted(n for n in changed if n not in view.shapes)
    if renamed:
        raise MergeError(
            f"{source}: the adapter changes {renamed[0]}, which this architecture saves under "
            "other names (transformers weight conversion); merge-lora does not fuse it yet"
        )
    return view


def prepare_lora(
    cfg: ShardforgeConfig,
    lora_model_dir: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str | None = None,
    keep_dtype: Sequence[str] = (),
) -> LoraMerge:
    """Read and check the adapter and the base model, choose the sources and plan the files."""
    adapter_dir = Path(lora_model_dir or getattr(cfg, "lora_model_dir", None) or cfg.output_dir)
    adapter = read_adapter(adapter_dir)
    _log_adapter(adapter)
    base_dir = base_directory(cfg.base_model)
    log.info("base model: %s", base_dir)
    prefetch(sorted(p for p in base_dir.iterdir() if p.suffix == ".safetensors"))
    config_source = cfg.base_model_config or str(base_dir)
    config = load_model_config(config_source, cfg.trust_remote_code)
    expected = build_expected(config, cfg.trust_remote_code)
    expected, untied = _untie(adapter, config, expected, cfg.trust_remote_code)
    settings = peft_settings(
        adapter.settings,
        adapter.config_data,
        config,
        cfg.trust_remote_code,
        str(adapter_dir / ADAPTER_CONFIG),
    )
    # LoRAs on parameters (peft's ParamWrapper: fused MoE experts), checked in memory
    names, params = split_param_pairs(
        adapter.names, settings, expected, adapter.tensors, str(adapter_dir)
    )
    in_memory, expected = expected, _as_saved(expected, names, config_source)
    base = base_sources(base_dir, expected, config_source, untied)
    by_name = fuse_sources(base, names, adapter.tensors, settings, expected, str(adapter_dir))
    by_name.update(fuse_params(by_name, params, adapter.tensors, in_memory))
    rules = output_rules(dtype, config, keep_dtype, expected.keep)
    specs, _ = planned_specs(
        ((n, base[n].dtype, by_name[n].shape) for n in expected.saved_names), rules
    )
    plan = plan_output(specs, max_shard_size or default_max_shard_size(), expected.total_parameters)
    tokenizer_source = _tokenizer_source(cfg, adapter_dir, base_dir)
    return LoraMerge(
        adapter,
        base_dir,
        config_source,
        tokenizer_source,
        expected,
        by_name,
        plan,
        main_dtype(specs),
    )


def _check_inputs(out: Path, inputs: list[Path]) -> None:
    """The output may lie inside the adapter directory (Axolotl's <output_dir>/merged) but
    must not be an input or contain one (publishing replaces the whole directory)."""
    o = out.resolve()
    for src in inputs:
        s = src.resolve()
        if o == s or s.is_relative_to(o):
            raise MergeError(
                f"{out}: the output path is or contains the input {src}; choose another directory"
            )


def default_output_path(cfg: ShardforgeConfig) -> Path:
    """``<output_dir>/merged``, where Axolotl's merge-lora writes."""
    return Path(cfg.output_dir) / MERGED_DIRNAME


def _local_paths(
    config: ShardforgeConfig, output_path: str | Path | None, lora_model_dir: str | Path | None
) -> None:
    """merge-lora reads and writes local files: an s3:// adapter or output (given, or from an
    s3:// output_dir) is refused, all at once, before anything is read."""
    adapter = lora_model_dir or config.lora_model_dir or config.output_dir
    output = output_path if output_path is not None else config.output_dir
    remote = [
        f"{what} {value}"
        for what, value in (("adapter", adapter), ("output", output))
        if names_object_storage(value)
    ]
    if remote:
        raise MergeError(
            f"{' and '.join(remote)}: merge-lora reads the adapter and writes the model as local "
            "files; copy them down/up, or merge the training checkpoint with "
            "merge-sharded-fsdp-weights --merge_lora, which reads and writes s3://"
        )


def merge_lora(
    cfg: Any,
    output_path: str | Path | None = None,
    lora_model_dir: str | Path | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    keep_dtype: Sequence[str] = (),
    max_shard_size: int | str | None = None,
    verify: bool = False,
    overwrite: bool = False,
    overwrite_non_model: bool = False,
    quiet: bool = False,
    save_tokenizer: bool = True,
    take_over_lock: bool = False,
) -> Path:
    """Fuse a PEFT LoRA adapter into its base model; write a Hugging Face model directory.

    Args:
        cfg: the config (``load_cfg`` result, path, mapping or ``ShardforgeConfig``): its
            ``base_model`` (a local directory, or a model in the Hugging Face cache) holds the
            base weights; ``base_model_config`` / ``tokenizer_config`` / ``chat_template`` as
            for the merge; ``lora_model_dir``, else ``output_dir``, the adapter.
        output_path: the directory to create (default ``<output_dir>/merged``), written as a
            temporary sibling and renamed at the end.
        lora_model_dir: the adapter directory (overrides the config's).
        dtype: output dtype of floating tensors (``bfloat16``, ``float16``, ``float32`` or
            ``as_saved``: as the base model stores them); default the config's ``dtype`` /
            ``torch_dtype``, else as saved. Integer, bool and FP8/FP4 tensors and the modules
            the model class keeps in float32 keep their dtype (`shardforge.sinks.cast`).
        keep_dtype: patterns of tensor names that keep their stored dtype too (``--keep_dtype``).
        max_shard_size: largest safetensors file (``"5GB"``, bytes); default as save_pretrained.
        verify: re-read the output and compare every tensor with the base model and the
            adapter read by the ``safetensors`` library, fused again.
        overwrite: replace an existing output directory that holds a model and nothing else.
        overwrite_non_model: with ``overwrite``, replace it even if it holds more (all of it
            is deleted).
        quiet: no progress bar.
        save_tokenizer: also write the tokenizer (with the config's chat template).
        take_over_lock: take over the output's lock file (``<output>.shardforge.lock``) when
            it names a writer on another host (one writer at a time: a second is refused).

    Returns:
        The output directory.

    Raises:
        CheckpointError: the adapter or the base model cannot be found, read or trusted.
        MergeError: the adapter does not fit the base model, the output exists, no disk space,
            failed verification.
        OutputLocked: another writer holds the output.
        CheckpointError: an input file changed while the merge read it.
    """
    config = coerce_cfg(cfg, command="merge-lora")
    _local_paths(config, output_path, lora_model_dir)
    out = Path(output_path if output_path is not None else default_output_path(config))
    out = out.absolute()
    check_resolvable(out)
    # one writer at a time (`io.lock`), the lock taken before anything is read or written; the
    # base model's and the adapter's files are pinned from the plan to the last byte read and
    # checked before publishing (`io.pins`), as every merge's inputs
    unusable = functools.partial(output_error, out=out)
    with (
        output_lock(lock_beside(out), out, LORA_COMMAND, take_over_lock, TAKE_OVER, unusable),
        fact_session(),
        pin_session(),
    ):
        check_output_path(out, overwrite, [], overwrite_non_model)  # before reading anything
        prep = prepare_lora(config, lora_model_dir, dtype, max_shard_size, keep_dtype)
        _write(
            prep,
            config,
            out,
            WriteOptions(overwrite, verify, quiet, overwrite_non_model=overwrite_non_model),
            save_tokenizer,
        )
    log.info("wrote %s (%.1f MB)", out, prep.plan.total_bytes / 1e6)
    return out


def _write(
    prep: LoraMerge,
    config: ShardforgeConfig,
    out: Path,
    options: WriteOptions,
    save_tokenizer: bool,
) -> None:
    """Check the output against the inputs, pin the inputs as planned, write and publish."""
    _check_inputs(out, [prep.adapter.directory, prep.base_dir])
    check_free_space(out, prep.plan.total_bytes)
    companions = Companions(
        prep.expected.config,
        tuple(dict.fromkeys([prep.config_source, str(prep.base_dir)])),
        prep.tokenizer_source if save_tokenizer else None,
        config.trust_remote_code,
        config.chat_template,
        config.chat_template_jinja,
    )
    output = Output(
        prep.plan,
        prep.by_name,
        prep.expected.tied,
        prep.expected.total_parameters,
        prep.dtype,
        companions,
        # what --verify compares with: no checkpoint is involved
        reference="the base model and the adapter, read by safetensors and fused again",
    )
    # every input pinned as planned: the base model's and the adapter's tensor files (as first
    # opened) and their configs; checked at every open and before publishing
    pinned_inputs(output.sources.values())
    for small in _small_inputs(prep):
        pin(small)
    with sigterm_as_interrupt():
        HfDirectorySink().write(output, out, options)


def _small_inputs(prep: LoraMerge) -> list[Path]:
    """The adapter's config and the base model's config and index: read whole before the
    plan, pinned with the tensor files."""
    found = [prep.adapter.directory / ADAPTER_CONFIG]
    found += [prep.base_dir / n for n in ("config.json", "model.safetensors.index.json")]
    return [p for p in found if p.is_file()]


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "Adapter",
    "LoraMerge",
    "default_output_path",
    "merge_lora",
    "prepare_lora",
    "read_adapter",
]
