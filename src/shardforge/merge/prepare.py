"""Prepare a merge: everything decided and checked before a byte is written.

    prep = prepare(cfg, request)          # locate -> open -> map keys -> check -> plan
    output, sink = deliverable(prep, request, cfg)

The pipeline reads as its steps: the checkpoint(s) are located (`merge.locate`, the layout
catalog), opened through their format's registry row (metadata only), their keys mapped to the
model's names (`keymap`), checked against the architecture built on the meta device
(`merge.check`), and planned; one path serves plain, averaged and LoRA checkpoints. The output
is a `Sink` (`shardforge.sinks`) handed an `Output`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardforge.config.schema import ShardforgeConfig
from shardforge.errors import MergeError
from shardforge.formats.base import NamedSource
from shardforge.formats.dcp.source import DcpSource
from shardforge.formats.registry import DCP, open_checkpoint
from shardforge.formats.sources import LoraFusedSource, TensorSource, average
from shardforge.io.copy import ReadCache
from shardforge.io.mirror import remote_target
from shardforge.keymap.keys import KeyMap, check_tied_copies, is_optimizer_key, map_keys
from shardforge.keymap.lora import has_lora
from shardforge.keymap.names import adapt_names
from shardforge.layouts.catalog import Candidate, check_model_keys
from shardforge.merge.check import ExpectedModel, build_expected, check_against
from shardforge.merge.check import load_config as load_model_config
from shardforge.merge.dtypes import main_dtype, output_rules, output_target, planned_specs
from shardforge.merge.locate import Located, MergeSources, label, locate
from shardforge.merge.lora_checkpoint import adapter_sources, open_lora
from shardforge.merge.request import MergeRequest
from shardforge.sinks.base import Companions, Output, Sink
from shardforge.sinks.cast import CastRules, Decision, cast_rules
from shardforge.sinks.hf_dir import AdapterDirectorySink
from shardforge.sinks.object_store import ObjectStoreSink
from shardforge.sinks.plan import OutputPlan, default_max_shard_size, plan_output
from shardforge.sinks.registry import SINKS

log = logging.getLogger("shardforge")


@dataclass(frozen=True)
class Prepared:
    sources: MergeSources
    expected: ExpectedModel
    keymap: KeyMap  # of the (last) input: checkpoint key -> HF name
    by_name: dict[str, TensorSource]
    plan: OutputPlan
    dtype: torch.dtype | None
    plain_dcp: bool  # one DCP checkpoint with HF names (what --engine transformers reads)
    adapter_config: dict[str, Any] | None = None  # a PEFT adapter directory is written
    casts: Mapping[str, Decision] = field(default_factory=dict)  # what --dtype casts and keeps
    dtype_line: str = ""  # the output dtype and why ('output dtype: bfloat16 (--dtype)')


def _open_named(candidate: Candidate, config: Any) -> dict[str, NamedSource]:
    """The candidate's tensors by checkpoint key, with their original paths."""
    opened = open_checkpoint(candidate.kind, candidate.model_dir)
    check_model_keys(candidate.model_dir, list(opened))
    return adapt_names(candidate.adapter, candidate.model_dir, opened, config)


def _hf_sources(
    candidate: Candidate,
    named: dict[str, NamedSource],
    expected: ExpectedModel,
    source: str,
) -> tuple[KeyMap, dict[str, TensorSource]]:
    """The candidate's tensors under HF names, checked against the architecture."""
    keymap = map_keys({k: n.path for k, n in named.items()}, expected.accepted)
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


def prepare(
    cfg: ShardforgeConfig,
    request: MergeRequest,
    located: Located | None = None,
) -> Prepared:
    """Everything decided and checked before a byte is written."""
    inputs, sources = located if located is not None else locate(cfg, request)
    config, expected = _architecture(sources.config, cfg.trust_remote_code)
    opened = [_open_named(c, config) for c in inputs]
    if any(has_lora(list(named)) for named in opened):
        return prepare_lora(cfg, request, sources, config, expected, opened)
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
    plain = len(inputs) == 1 and all(
        isinstance(src, DcpSource) and src.fmt == DCP and src.entry.key == key
        for key, src in ((k, by_name[hf]) for k, hf in keymap.to_hf.items())
    )
    by_name = expected.to_saved(by_name)  # under the names save_pretrained writes
    rules, line = _rules(request, config, expected, sources)
    specs, casts = planned_specs(
        ((n, by_name[n].dtype, by_name[n].shape) for n in expected.saved_names), rules
    )
    shard = None if request.single_file else request.max_shard_size or default_max_shard_size()
    plan = plan_output(specs, shard, expected.total_parameters)
    dtype = main_dtype(specs)
    return Prepared(
        sources, expected, keymap, by_name, plan, dtype, plain, casts=casts, dtype_line=line
    )


def _rules(
    request: MergeRequest, config: Any, expected: ExpectedModel, sources: MergeSources
) -> tuple[CastRules, str]:
    """The cast rules of a merge to a complete model, and its plan line for the output dtype
    (logged): `--dtype`, else the base dtype train recorded, else the config's."""
    target, line = output_target(request.dtype, config, sources.recorded_dtype)
    log.info("%s", line)
    return cast_rules(target, request.keep_dtype, expected.keep), line


def prepare_lora(
    cfg: ShardforgeConfig,
    request: MergeRequest,
    sources: MergeSources,
    config: Any,
    expected: ExpectedModel,
    opened: list[dict[str, NamedSource]],
) -> Prepared:
    """A LoRA checkpoint: a PEFT adapter directory, or with --merge_lora the fused model
    (`shardforge.merge.lora_checkpoint`)."""
    from shardforge.merge.lora import base_directory, base_sources
    from shardforge.merge.lora_fuse import fuse_sources

    if len(opened) > 1:
        raise MergeError("averaging LoRA checkpoints is not supported; merge one step")
    if expected.renamed_on_save:
        raise MergeError(
            f"{sources.config}: this architecture is saved under other names than it uses in "
            "memory (transformers weight conversion); its LoRA checkpoints are not merged yet"
        )
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
    empty = KeyMap({}, "", (), ())
    if request.merge_lora:
        rules, line = _rules(request, config, expected, sources)
        specs, casts = planned_specs(
            ((n, _stored_dtype(fused[n]), fused[n].shape) for n in expected.saved_names), rules
        )
        shard = None if request.single_file else request.max_shard_size or default_max_shard_size()
        plan = plan_output(specs, shard, expected.total_parameters)
        dtype = main_dtype(specs)
        return Prepared(
            sources, expected, empty, fused, plan, dtype, False, casts=casts, dtype_line=line
        )
    if request.single_file:
        raise MergeError(
            f"{model_dir}: a LoRA checkpoint merges to a PEFT adapter directory (--format hf), "
            "or with --merge_lora to a complete model in any format"
        )
    by_name = adapter_sources(lora)
    # an adapter is cast only when --dtype names a dtype (not to the config's)
    asked = output_rules(request.dtype, None, request.keep_dtype, expected.keep)
    specs, casts = planned_specs(((n, s.dtype, s.shape) for n, s in by_name.items()), asked)
    plan = plan_output(specs, None, sum(math.prod(s.shape) for s in specs))
    return Prepared(
        sources,
        expected,
        empty,
        by_name,
        plan,
        main_dtype(specs),
        False,
        lora.adapter_config,
        casts,
    )


def _stored_dtype(source: TensorSource) -> torch.dtype:
    """The dtype a fused weight's base is stored in (the fuse itself computes in float32)."""
    return source.base.dtype if isinstance(source, LoraFusedSource) else source.dtype


def deliverable(
    prep: Prepared, request: MergeRequest, cfg: ShardforgeConfig
) -> tuple[Output, Sink]:
    """What the merge writes and the sink that writes it (the adapter directory for a LoRA
    checkpoint, the transformers engine when asked, else the sink of --format)."""
    tokenizer = prep.sources.tokenizer if request.save_tokenizer else None
    companions = Companions(
        prep.expected.config,
        tuple(prep.sources.generation),
        tokenizer,
        cfg.trust_remote_code,
        cfg.chat_template,
        cfg.chat_template_jinja,
    )
    adapter = prep.adapter_config is not None
    parameters = (
        sum(math.prod(t.spec.shape) for _, t in prep.plan.tensors())
        if adapter
        else prep.expected.total_parameters
    )
    output = Output(
        prep.plan,
        prep.by_name,
        prep.expected.tied,
        parameters,
        prep.dtype,
        companions,
        prep.adapter_config,
        tuple(prep.expected.saved_names),
    )
    sink: Sink
    target = remote_target(request.output_path)
    if target is not None:
        if adapter:
            raise MergeError(
                f"{target.uri}: a LoRA checkpoint's adapter directory is written to local paths "
                "only; merge it with --merge_lora, or to a local --output_path"
            )
        sink = ObjectStoreSink(target)
    elif adapter:
        sink = AdapterDirectorySink()
    elif request.engine != "stream":
        # imported here: it brings torch.distributed.checkpoint, which a streamed merge never uses
        from shardforge.sinks.engine import TransformersSink

        shard = request.max_shard_size or default_max_shard_size()
        sink = TransformersSink(
            prep.sources.checkpoint.model_dir, prep.keymap.to_hf, shard, cfg.trust_remote_code
        )
    else:
        sink = SINKS[request.output_format]
    return output, sink
