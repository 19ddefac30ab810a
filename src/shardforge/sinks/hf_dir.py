"""The safetensors outputs: a Hugging Face model directory, a PEFT adapter directory, one
safetensors file. Each is one `Sink`; all three fill their planned files with
`safetensors_files.write_plan` and verify through the `safetensors` library (`sinks.verify`).
The two directories carry an integrity manifest (`sinks.manifest`), written last."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from shardforge.io.copy import FileSlab
from shardforge.io.publish import atomic_directory, atomic_file
from shardforge.sinks.base import Companions, Output, Progress, Sink, WriteOptions, verified_line
from shardforge.sinks.companions import write_config, write_generation_config, write_tokenizer
from shardforge.sinks.manifest import new_hashes, write_manifest
from shardforge.sinks.plan import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from shardforge.sinks.progress import progress
from shardforge.sinks.resume import Fingerprint, LocalJournal, fingerprint, pinned_inputs
from shardforge.sinks.safetensors_files import Hashes, finish_plan, write_index, write_plan
from shardforge.sinks.verify import verify_output

log = logging.getLogger("shardforge")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
GENERATION_CONFIG = "generation_config.json"
CONFIG = "config.json"

# moves the files an early copy already wrote into the directory; the slabs it copied and the
# hashes of those files so far (None: not hashed)
Prefill = Callable[[Path], tuple[Mapping[str, list[FileSlab]], Hashes | None]]


def _verified(output: Output, directory: Path, quiet: bool) -> None:
    with progress(output.plan.total_bytes, "verifying", quiet) as update:
        n = verify_output(output.plan, output.sources, directory, update, output.tied)
    log.info("%s", verified_line(n, output))


def resume_fingerprint(output: Output) -> Fingerprint:
    """The fingerprint of `output` (`sinks.resume`): its plan and its inputs' identities."""
    return fingerprint(output.plan, pinned_inputs(output.sources.values()))


def write_companions(companions: Companions, dtype: object, directory: Path) -> None:
    """config.json (with the output dtype), generation_config.json, the tokenizer."""
    write_config(companions.config, dtype, directory)  # type: ignore[arg-type]
    if not write_generation_config(list(companions.generation), directory):
        (directory / GENERATION_CONFIG).unlink(missing_ok=True)
    _tokenizer(companions, directory)


def _tokenizer(companions: Companions | None, directory: Path) -> None:
    if companions is not None and companions.tokenizer is not None:
        write_tokenizer(
            companions.tokenizer,
            directory,
            companions.trust_remote_code,
            companions.chat_template,
            companions.chat_template_jinja,
        )


def _weight_files(output: Output) -> list[tuple[str, int | None, int | None]]:
    rows: list[tuple[str, int | None, int | None]] = [
        (f.name, len(f.tensors), f.size) for f in output.plan.files
    ]
    if output.plan.index is not None:
        rows.append((SAFE_WEIGHTS_INDEX_NAME, None, None))
    return rows


class HfDirectorySink(Sink):
    """A complete Hugging Face model directory: safetensors weights (+ index), config.json,
    generation_config.json, the tokenizer. What training's full-model save writes too."""

    name = "hf"

    def write(
        self, output: Output, out: Path, options: WriteOptions, prefill: Prefill | None = None
    ) -> None:
        """`prefill`: an accepted early copy that holds part of the weights already."""
        with atomic_directory(out, options.overwrite, options.resume, options.model_only) as tmp:
            journal = LocalJournal(tmp, resume_fingerprint(output), options.resume)
            with progress(output.plan.total_bytes, "merging", options.quiet) as update:
                if prefill is not None:
                    copied, hashes = prefill(tmp)
                    finish_plan(output.plan, output.sources, tmp, copied, update, journal, hashes)
                    write_index(output.plan, tmp)
                else:
                    hashes = new_hashes(options.manifest_hash)
                    write_plan(output.plan, output.sources, tmp, update, journal, hashes)
            journal.close()
            if output.companions is not None:
                write_companions(output.companions, output.dtype, tmp)
            if options.verify:
                _verified(output, tmp, options.quiet)
            write_manifest(tmp, hashes, output.sources.values())

    def verify(self, output: Output, location: Path, progress: Progress | None = None) -> int:
        return verify_output(output.plan, output.sources, location, progress, output.tied)

    def files(self, output: Output, out: Path) -> list[tuple[str, int | None, int | None]]:
        rows = _weight_files(output)
        if output.companions is not None:
            rows += [(CONFIG, None, None), (GENERATION_CONFIG, None, None)]
            if output.companions.tokenizer is not None:
                rows.append(("tokenizer files", None, None))
        return rows


class AdapterDirectorySink(Sink):
    """A PEFT adapter directory: adapter_model.safetensors, adapter_config.json, the tokenizer."""

    name = "adapter"
    single_file = True  # the adapter's weights are one file, whatever their size

    def write(self, output: Output, out: Path, options: WriteOptions) -> None:
        assert output.adapter_config is not None
        hashes = new_hashes(options.manifest_hash)
        with atomic_directory(out, options.overwrite, model_only=options.model_only) as tmp:
            with progress(output.plan.total_bytes, "merging", options.quiet) as update:
                write_plan(output.plan, output.sources, tmp, update, hashes=hashes)
            if options.verify:
                _verified(output, tmp, options.quiet)
            os.replace(tmp / SAFE_WEIGHTS_NAME, tmp / ADAPTER_WEIGHTS)
            if hashes is not None:
                hashes[ADAPTER_WEIGHTS] = hashes.pop(SAFE_WEIGHTS_NAME)
            text = json.dumps(output.adapter_config, indent=2, sort_keys=True) + "\n"
            (tmp / ADAPTER_CONFIG).write_text(text)
            _tokenizer(output.companions, tmp)
            write_manifest(tmp, hashes, output.sources.values())

    def verify(self, output: Output, location: Path, progress: Progress | None = None) -> int:
        return verify_output(output.plan, output.sources, location, progress, output.tied)

    def files(self, output: Output, out: Path) -> list[tuple[str, int | None, int | None]]:
        (f,) = output.plan.files
        rows: list[tuple[str, int | None, int | None]] = [
            (ADAPTER_WEIGHTS, len(f.tensors), f.size),
            (ADAPTER_CONFIG, None, None),
        ]
        if output.companions is not None and output.companions.tokenizer is not None:
            rows.append(("tokenizer files", None, None))
        return rows


class SafetensorsFileSink(Sink):
    """One `model.safetensors`-format file (no index, config or tokenizer)."""

    name = "safetensors"
    single_file = True

    def write(self, output: Output, out: Path, options: WriteOptions) -> None:
        with atomic_file(out, options.overwrite) as tmp:
            with progress(output.plan.total_bytes, "merging", options.quiet) as update:
                write_plan(output.plan, output.sources, tmp, update)
            if options.verify:
                _verified(output, tmp, options.quiet)
            os.replace(tmp / SAFE_WEIGHTS_NAME, tmp / out.name)

    def verify(self, output: Output, location: Path, progress: Progress | None = None) -> int:
        return verify_output(output.plan, output.sources, location, progress, output.tied)

    def files(self, output: Output, out: Path) -> list[tuple[str, int | None, int | None]]:
        (f,) = output.plan.files
        return [(out.name, len(f.tensors), f.size)]
