"""`merge_fsdp_weights`: a sharded FSDP/DCP checkpoint -> a complete, verified Hugging Face model
directory, streamed with memory bounded by about one tensor.

    from shardforge.config import load_cfg
    from shardforge.merge.api import merge_fsdp_weights
    merge_fsdp_weights(load_cfg("cfg.yml"), "out/merged", verify=True)
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardforge.config import coerce_cfg
from shardforge.config.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError, ShardforgeError
from shardforge.formats.base import NamedSource
from shardforge.formats.dcp.source import DcpSource
from shardforge.formats.registry import DCP, open_checkpoint
from shardforge.formats.sources import FusedLoraSource, TensorSource, average
from shardforge.io.copy import ReadCache, fact_session
from shardforge.io.publish import (
    atomic_directory,
    atomic_file,
    check_free_space,
    check_output_file,
    check_output_path,
    sigterm_as_interrupt,
)
from shardforge.keymap.keys import KeyMap, check_tied_copies, is_optimizer_key, map_keys
from shardforge.keymap.lora import has_lora
from shardforge.keymap.names import adapt_names
from shardforge.layouts.catalog import (
    Candidate,
    check_model_keys,
    list_checkpoints,
    resolve_checkpoint,
)
from shardforge.merge.check import ExpectedModel, build_expected, check_against
from shardforge.merge.check import load_config as load_model_config
from shardforge.merge.companions import (
    write_config,
    write_generation_config,
    write_tokenizer,
)
from shardforge.merge.dtypes import (
    config_dtype,
    dtype_choice_name,
    main_dtype,
    output_dtype,
    parse_dtype,
    progress,
)
from shardforge.merge.locate import Located, MergeSources, checkpoint_root, label, locate
from shardforge.merge.lora_checkpoint import adapter_sources, open_lora
from shardforge.merge.overlap import EarlyCopy, early_copy, eligible, finish_plan
from shardforge.merge.plan import (
    SAFE_WEIGHTS_NAME,
    OutputPlan,
    TensorSpec,
    default_max_shard_size,
    plan_output,
)
from shardforge.merge.plan_report import describe_plan
from shardforge.merge.remove import RemovalPlan, plan_removal, remove_shards
from shardforge.merge.request import OUTPUT_FORMATS, MergeRequest, merge_keywords
from shardforge.merge.sinks.hf_dir import write_index, write_plan
from shardforge.merge.sinks.torch_file import verify_torch_file, write_torch_file
from shardforge.merge.verify import verify_output

log = logging.getLogger("shardforge")


@dataclass(frozen=True)
class _Prepared:
    sources: MergeSources
    expected: ExpectedModel
    keymap: KeyMap  # of the (last) input: checkpoint key -> HF name
    by_name: dict[str, TensorSource]
    plan: OutputPlan
    dtype: torch.dtype | None
    plain_dcp: bool  # one DCP checkpoint with HF names (what --engine transformers reads)
    adapter_config: dict[str, Any] | None = None  # a PEFT adapter directory is written


def _open_named(candidate: Candidate, config: Any) -> dict[str, NamedSource]:
    """The candidate's tensors by checkpoint key, with their original paths."""
    opened = open_checkpoint(candidate.kind, candidate.model_dir)
    if candidate.kind == DCP:
        check_model_keys(candidate.model_dir, list(opened))
    return adapt_names(candidate.adapter, candidate.model_dir, opened, config)


def _hf_sources(
    candidate: Candidate,
    named: dict[str, NamedSource],
    expected: ExpectedModel,
    source: str,
) -> tuple[KeyMap, dict[str, TensorSource]]:
    """The candidate's tensors under HF names, checked against the architecture."""
    keymap = map_keys({k: n.path for k, n in named.items()}, expected.shapes)
    try:
        check_against(expected, named, keymap.to_hf, list(keymap.unexpected), source)
    except MergeError as exc:
        raise MergeError(f"{candidate.model_dir}: {exc.message}", exc.details) from None
    if keymap.skipped_optimizer:
        log.info("skipped %d optimizer entries", len(keymap.skipped_optimizer))
    by_hf = {hf: named[key].source for key, hf in keymap.to_hf.items()}
    with ReadCache() as reader:
        check_tied_copies(expected.tied, by_hf, lambda s: s.read(reader), str(candidate.model_dir))
    return keymap, by_hf


@functools.lru_cache(maxsize=4)
def _architecture(config_source: str, trust_remote_code: bool) -> tuple[Any, ExpectedModel]:
    """The model config and the meta-device architecture of `config_source` (built once per
    process: --all_steps merges many checkpoints of one architecture)."""
    config = load_model_config(config_source, trust_remote_code)
    return config, build_expected(config, trust_remote_code)


def _prepare(
    cfg: ShardforgeConfig,
    request: MergeRequest,
    located: Located | None = None,
) -> _Prepared:
    """Everything decided and checked before a byte is written."""
    inputs, sources = located if located is not None else locate(cfg, request)
    config, expected = _architecture(sources.config, cfg.trust_remote_code)
    opened = [_open_named(c, config) for c in inputs]
    if any(has_lora(list(named)) for named in opened):
        return _prepare_lora(cfg, request, sources, config, expected, opened)
    per_input = [
        _hf_sources(c, named, expected, sources.config)
        for c, named in zip(inputs, opened, strict=True)
    ]
    keymap = per_input[-1][0]
    if len(inputs) > 1:
        by_name = average([p[1] for p in per_input], [label(c) for c in inputs])
        log.info("averaging %d checkpoints: %s", len(inputs), ", ".join(map(label, inputs)))
    else:
        by_name = per_input[0][1]
    wanted = parse_dtype(request.dtype)
    target = config_dtype(config) if wanted == "config" else wanted
    assert target != "config"
    specs = [
        TensorSpec(n, output_dtype(by_name[n].dtype, target), by_name[n].shape)
        for n in expected.saved_names
    ]
    shard = None if request.single_file else request.max_shard_size or default_max_shard_size()
    try:
        plan = plan_output(specs, shard, expected.total_parameters)
    except ValueError as exc:
        if isinstance(exc, MergeError):
            raise
        raise MergeError(f"--max_shard_size {shard!r}: {exc}") from None
    plain = len(inputs) == 1 and all(
        isinstance(src, DcpSource) and src.entry.key == key
        for key, src in ((k, by_name[hf]) for k, hf in keymap.to_hf.items())
    )
    return _Prepared(sources, expected, keymap, by_name, plan, main_dtype(specs), plain)


def _prepare_lora(
    cfg: ShardforgeConfig,
    request: MergeRequest,
    sources: MergeSources,
    config: Any,
    expected: ExpectedModel,
    opened: list[dict[str, NamedSource]],
) -> _Prepared:
    """A LoRA checkpoint: a PEFT adapter directory, or with --merge_lora the fused model
    (`shardforge.merge.lora_checkpoint`)."""
    from shardforge.merge.lora import base_directory, base_sources, fuse_sources

    if len(opened) > 1:
        raise MergeError("averaging LoRA checkpoints is not supported; merge one step")
    model_dir = sources.checkpoint.model_dir
    named = {k: n.source for k, n in opened[0].items() if not is_optimizer_key(n.path)}
    lora = open_lora(named, model_dir, cfg, expected)
    log.info(
        "LoRA checkpoint: %d adapted modules, %d modules_to_save tensors%s (settings from %s)",
        len(lora.names.pairs),
        len(lora.names.replacements),
        ", base weights included" if lora.holds_base else "",
        lora.config_source,
    )
    base: dict[str, TensorSource] = {}
    if not lora.holds_base:
        base = base_sources(base_directory(cfg.base_model), expected, sources.config)
    fused = fuse_sources(base, lora.names, lora.tensors, lora.settings, expected, str(model_dir))
    wanted = parse_dtype(request.dtype)
    target = config_dtype(config) if wanted == "config" else wanted
    assert target != "config"
    empty = KeyMap({}, "", (), ())
    if request.merge_lora:
        specs = [
            TensorSpec(n, output_dtype(_stored_dtype(fused[n]), target), fused[n].shape)
            for n in expected.saved_names
        ]
        shard = None if request.single_file else request.max_shard_size or default_max_shard_size()
        plan = plan_output(specs, shard, expected.total_parameters)
        return _Prepared(sources, expected, empty, fused, plan, main_dtype(specs), False)
    if request.single_file:
        raise MergeError(
            f"{model_dir}: a LoRA checkpoint merges to a PEFT adapter directory (--format hf), "
            "or with --merge_lora to a complete model in any format"
        )
    by_name = adapter_sources(lora)
    specs = [
        TensorSpec(
            n,
            src.dtype if wanted is None or wanted == "config" else output_dtype(src.dtype, wanted),
            src.shape,
        )
        for n, src in by_name.items()
    ]
    plan = plan_output(specs, None, sum(math.prod(s.shape) for s in specs))
    return _Prepared(
        sources, expected, empty, by_name, plan, main_dtype(specs), False, lora.adapter_config
    )


def _stored_dtype(source: TensorSource) -> torch.dtype:
    """The dtype a fused weight's base is stored in (the fuse itself computes in float32)."""
    return source.base.dtype if isinstance(source, FusedLoraSource) else source.dtype


def _write_hf(prep: _Prepared, out: Path, opts: _Options, early: EarlyCopy | None = None) -> None:
    """The full Hugging Face directory: weights (+ index), config, generation config,
    tokenizer. `early`: an accepted early copy holding part of the weights already."""
    with atomic_directory(out, opts.overwrite) as tmp:
        if early is not None:
            early.move_into(tmp)
            with progress(prep.plan.total_bytes, "merging", opts.quiet) as update:
                finish_plan(prep.plan, prep.by_name, tmp, early.copied, update)
            write_index(prep.plan, tmp)
        elif opts.engine == "stream":
            with progress(prep.plan.total_bytes, "merging", opts.quiet) as update:
                write_plan(prep.plan, prep.by_name, tmp, update)
        else:
            from shardforge.merge.sinks.engine import merge_with_transformers

            merge_with_transformers(
                prep.expected.config,
                prep.sources.checkpoint.model_dir,
                prep.keymap.to_hf,
                prep.dtype or torch.float32,
                tmp,
                opts.max_shard_size,
                opts.trust_remote_code,
            )
        _write_companions(prep, tmp, opts)
        if opts.verify:
            _verify(prep, tmp, opts.quiet)


def _write_companions(prep: _Prepared, tmp: Path, opts: _Options) -> None:
    """config.json (with the output dtype), generation_config.json, the tokenizer."""
    write_config(prep.expected.config, prep.dtype, tmp)
    if not write_generation_config(prep.sources.generation, tmp):
        (tmp / "generation_config.json").unlink(missing_ok=True)
    if opts.save_tokenizer:
        write_tokenizer(
            prep.sources.tokenizer,
            tmp,
            opts.trust_remote_code,
            opts.chat_template,
            opts.chat_template_jinja,
        )


def _write_adapter(prep: _Prepared, out: Path, opts: _Options) -> None:
    """A PEFT adapter directory: adapter_model.safetensors, adapter_config.json, tokenizer."""
    assert prep.adapter_config is not None
    with atomic_directory(out, opts.overwrite) as tmp:
        with progress(prep.plan.total_bytes, "merging", opts.quiet) as update:
            write_plan(prep.plan, prep.by_name, tmp, update)
        if opts.verify:
            _verify(prep, tmp, opts.quiet)
        os.replace(tmp / SAFE_WEIGHTS_NAME, tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(
            json.dumps(prep.adapter_config, indent=2, sort_keys=True) + "\n"
        )
        if opts.save_tokenizer:
            write_tokenizer(
                prep.sources.tokenizer,
                tmp,
                opts.trust_remote_code,
                opts.chat_template,
                opts.chat_template_jinja,
            )


def _verify(prep: _Prepared, directory: Path, quiet: bool) -> None:
    with progress(prep.plan.total_bytes, "verifying", quiet) as update:
        n = verify_output(prep.plan, prep.by_name, directory, update, prep.expected.tied)
    log.info("verified %d tensors: identical to the checkpoint", n)


def _write_safetensors(prep: _Prepared, out: Path, opts: _Options) -> None:
    """One `model.safetensors`-format file at `out` (no index, config or tokenizer)."""
    with atomic_file(out, opts.overwrite) as tmp:
        with progress(prep.plan.total_bytes, "merging", opts.quiet) as update:
            write_plan(prep.plan, prep.by_name, tmp, update)
        if opts.verify:
            _verify(prep, tmp, opts.quiet)
        os.replace(tmp / SAFE_WEIGHTS_NAME, tmp / out.name)


def _write_torch(prep: _Prepared, out: Path, opts: _Options) -> None:
    """One torch.save-format file ``{"state_dict": ...}`` at `out`, one tensor at a time."""
    specs = [t.spec for _, t in prep.plan.tensors()]
    specs = [s for n in prep.expected.saved_names for s in specs if s.name == n]
    with atomic_file(out, opts.overwrite) as tmp:
        with progress(sum(s.nbytes for s in specs), "merging", opts.quiet) as update:
            write_torch_file(specs, prep.by_name, tmp / out.name, update)
        if opts.verify:
            n = verify_torch_file(specs, prep.by_name, tmp / out.name, prep.expected.tied)
            log.info("verified %d tensors: identical to the checkpoint", n)


@dataclass(frozen=True)
class _Options:
    engine: str
    quiet: bool
    verify: bool
    save_tokenizer: bool
    trust_remote_code: bool
    chat_template: str | None
    chat_template_jinja: str | None
    max_shard_size: int | str
    overwrite: bool = False


# --format -> writer of the output
FORMATS: dict[str, Callable[[_Prepared, Path, _Options], None]] = {
    "hf": _write_hf,
    "safetensors": _write_safetensors,
    "torch": _write_torch,
}
assert tuple(FORMATS) == OUTPUT_FORMATS  # the request checks --format against the same names
# suffix of the default output path of --format torch (as Lightning's consolidate_checkpoint)
CONSOLIDATED_SUFFIX = ".consolidated"


def _default_output(prep: _Prepared) -> Path:
    """--format torch without --output_path: beside the model folder (the request makes sure
    the other formats name one)."""
    model_dir = prep.sources.checkpoint.model_dir
    return Path(str(model_dir) + CONSOLIDATED_SUFFIX).absolute()


@merge_keywords  # its keywords, signature and docstring: MergeRequest's fields
def merge_fsdp_weights(
    cfg: Any,
    output_path: str | Path | None = None,
    save_tokenizer: bool = True,
    **options: Any,
) -> Path:
    # every option conflict is refused here, before anything is read
    out = Path(output_path) if output_path is not None else None
    request = MergeRequest(output_path=out, save_tokenizer=save_tokenizer, **options)
    config = coerce_cfg(cfg, command="merge")
    # the run is scanned, and each .metadata and record parsed, once (head start included)
    with fact_session():
        return _dispatch(config, request)


def _dispatch(config: ShardforgeConfig, request: MergeRequest) -> Path:
    on_ranks = _in_process_group(request)
    if request.per_step:
        return _merge_steps(config, request)
    if on_ranks:
        return merge_on_ranks(config, request)
    if request.distributed:
        from shardforge.merge.launch import launch_merge

        return launch_merge(config, request)
    return run_merge(config, request)


def _merge_steps(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """--all_steps / --steps: each checkpoint of the run to <output_path>/step-N (the
    architecture is built once; every step's output is checked before the first is written)."""
    from dataclasses import replace

    root = checkpoint_root(config, request)
    found = {c.step: c for c in list_checkpoints(root, request.state_dict_dirname)}
    wanted = list(request.steps) or sorted(found)
    missing = [s for s in wanted if s not in found]
    if missing or not wanted:
        raise MergeError(
            f"--steps: {root} has no complete checkpoint for step(s) "
            f"{', '.join(map(str, missing)) or '(none found)'}; steps found: "
            f"{sorted(found) or 'none'}"
        )
    out = request.output_path
    assert out is not None  # the request requires it for --format hf
    requests = [
        replace(request, step=s, all_steps=False, steps=(), output_path=out / f"step-{s}")
        for s in wanted
    ]
    for r in requests:
        assert r.output_path is not None
        check_output_path(r.output_path, r.overwrite, [])
    if not request.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    log.info("merging %d steps to %s: %s", len(wanted), out, ", ".join(map(str, wanted)))
    on_ranks = _in_process_group(request)
    for r in requests:
        if on_ranks:
            merge_on_ranks(config, r)
        elif r.distributed:
            from shardforge.merge.launch import launch_merge

            launch_merge(config, r)
        else:
            run_merge(config, r)
    return out


def _in_process_group(request: MergeRequest) -> bool:
    """Whether the merge runs on the ranks of the caller's process group: only when asked
    (`group=`). A process group alone is no such request: a merge called on the main process
    only (`if is_main_process: merge_fsdp_weights(...)`) merges there, instead of waiting for
    the other ranks until the group's timeout."""
    if request.group is None:
        return False
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise MergeError(
            "group=: no torch.distributed process group is initialised; call "
            "dist.init_process_group first, or leave group out to merge in this process"
        )
    if request.group is not dist.group.WORLD:
        raise MergeError(
            "group=: a merge runs on the default process group (torch.distributed.group.WORLD) "
            "only; leave group out to merge in this process"
        )
    return True


def merge_on_ranks(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """This rank's part of a distributed merge (see `shardforge.merge.distributed`); every rank
    returns the output path or raises the same MergeError."""
    import torch.distributed as dist

    from shardforge.merge.distributed import (
        broadcast,
        create_files,
        gather_status,
        owner,
        raise_failures,
        shares,
        write_shares,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    error: BaseException | None = None
    prep: _Prepared | None = None
    out = request.output_path
    assert out is not None  # the request requires it for --format hf
    try:
        if rank == 0:
            check_output_path(out, request.overwrite, [])
        prep = _prepare(config, request)
        if prep.adapter_config is not None or prep.expected.renamed_on_save:
            raise MergeError(
                "a distributed merge writes complete models of the stream engine; merge this "
                "checkpoint on one rank"
            )
        if rank == 0:
            check_output_path(out, request.overwrite, [c.model_dir for c in prep.sources.inputs])
            check_free_space(out, prep.plan.total_bytes)
    except (ShardforgeError, OSError) as exc:
        error = exc
    raise_failures(gather_status(error))
    assert prep is not None
    opts = _Options(
        "stream",
        request.quiet or rank != 0,
        request.verifies,
        request.save_tokenizer,
        config.trust_remote_code,
        config.chat_template,
        config.chat_template_jinja,
        default_max_shard_size(),
        request.overwrite,
    )
    mine = shares(prep.plan, rank, world)
    if rank == 0:
        log.info(
            "distributed merge on %d ranks: %s bytes each",
            world,
            f"{prep.plan.total_bytes // world:,}",
        )
    published: BaseException | None = None
    try:
        with atomic_directory(out, request.overwrite) if rank == 0 else _no_directory() as tmp:
            directory = Path(broadcast(str(tmp) if rank == 0 else None))
            _on_every_rank(lambda: create_files(prep.plan, directory) if rank == 0 else None)
            mine_bytes = sum(
                (s.rows[1] - s.rows[0]) * (s.tensor.spec.nbytes // max(1, _rows(s.tensor)))
                for s in mine
            )
            with progress(mine_bytes, "merging", opts.quiet) as update:
                _on_every_rank(lambda: write_shares(mine, prep.by_name, directory, update))
            if opts.verify:
                owners = owner(prep.plan, world)
                _on_every_rank(
                    lambda: verify_output(
                        prep.plan,
                        prep.by_name,
                        directory,
                        tied=prep.expected.tied,
                        only=lambda name: owners[name] == rank,
                    )
                )
            if rank == 0:
                write_index(prep.plan, directory)
                _write_companions(prep, directory, opts)
    except (ShardforgeError, OSError) as exc:
        published = exc
    raise_failures(gather_status(published))
    if rank == 0:
        log.info("wrote %s (%.1f MB) on %d ranks", out, prep.plan.total_bytes / 1e6, world)
    return out


def _rows(t: Any) -> int:
    return t.spec.shape[0] if t.spec.shape else 1


@contextmanager
def _no_directory() -> Iterator[None]:
    yield None


def _on_every_rank(step: Callable[[], object]) -> None:
    """Run `step` here, then stop every rank with the first failure any rank had."""
    from shardforge.merge.distributed import gather_status, raise_failures

    error: BaseException | None = None
    try:
        step()
    except (ShardforgeError, OSError) as exc:
        error = exc
    raise_failures(gather_status(error))


def run_merge(config: ShardforgeConfig, request: MergeRequest) -> Path:
    """`merge_fsdp_weights` of a checked request."""
    check = check_output_file if request.single_file else check_output_path
    out = request.output_path
    if out is not None:
        check(out, request.overwrite, [])  # fail fast, before reading anything
    removal = None
    if request.remove_checkpoint_dir:  # refused here, before the merge reads or writes
        root = checkpoint_root(config, request)
        found = resolve_checkpoint(root, request.step, request.state_dict_dirname)
        removal = plan_removal(found, root)
    located = locate(config, request)
    # the bytes start moving while transformers imports and the architecture is built; the
    # early copy is used only if it is exactly what the merge would write, else removed
    with sigterm_as_interrupt(), _early_copy(config, request, located) as early:
        return _run_prepared(config, request, located, removal, early)


def _early_copy(
    config: ShardforgeConfig,
    request: MergeRequest,
    located: Located,
) -> contextlib.AbstractContextManager[EarlyCopy | None]:
    inputs, sources = located
    out = request.output_path
    if out is None or not eligible(request, inputs):
        return contextlib.nullcontext(None)
    return early_copy(
        inputs[0],
        sources.config,
        out,
        request.overwrite,
        dtype_choice_name(request.dtype),
        request.max_shard_size,
    )


def _run_prepared(
    config: ShardforgeConfig,
    request: MergeRequest,
    located: Located,
    removal: RemovalPlan | None,
    early: EarlyCopy | None,
) -> Path:
    check = check_output_file if request.single_file else check_output_path
    out = request.output_path
    prep = _prepare(config, request, located)
    if out is None:
        out = _default_output(prep)
    check(out, request.overwrite, [c.model_dir for c in prep.sources.inputs])
    if request.engine == "stream" and prep.expected.renamed_on_save:
        raise MergeError(
            f"{prep.sources.config}: this architecture is saved under other names than it uses "
            "in memory (transformers weight conversion); merge it with --engine transformers"
        )
    if request.engine != "stream" and not prep.plain_dcp:
        raise MergeError("--engine transformers reads plain DCP checkpoints only")
    if removal is not None and removal.model_dir != prep.sources.checkpoint.model_dir.absolute():
        raise MergeError(
            f"{removal.model_dir}: the checkpoint changed while the merge started (now "
            f"{prep.sources.checkpoint.model_dir}); run it again"
        )
    if request.dry_run:
        report = describe_plan(prep, out, request.output_format, request.save_tokenizer, removal)
        sys.stdout.write(report + "\n")
        return out
    used = (
        early is not None and prep.adapter_config is None and early.accept(prep.plan, prep.by_name)
    )
    if not used:  # (an accepted early copy has its space allocated already)
        check_free_space(out, prep.plan.total_bytes)
    opts = _Options(
        request.engine,
        request.quiet,
        request.verifies,
        request.save_tokenizer,
        config.trust_remote_code,
        config.chat_template,
        config.chat_template_jinja,
        request.max_shard_size if request.max_shard_size is not None else default_max_shard_size(),
        request.overwrite,
    )
    writer = _write_adapter if prep.adapter_config is not None else FORMATS[request.output_format]
    if used:
        assert early is not None
        _write_hf(prep, out, opts, early)
    else:
        writer(prep, out, opts)
    log.info("wrote %s (%.1f MB)", out, prep.plan.total_bytes / 1e6)
    if removal is not None:  # the output is verified and published
        removed = remove_shards(removal)
        log.info("removed %d shard files of %s", len(removed.files), removal.model_dir)
    return out
