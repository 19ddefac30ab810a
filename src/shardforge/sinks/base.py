"""The protocol every output of shardforge implements: a `Sink` (plan, write, verify, describe).

    sink = SINKS["hf"]                               # or AdapterDirectorySink(), TransformersSink(...)
    plan = sink.plan(specs, max_shard_size, parameters)
    output = Output(plan, sources, tied, parameters, dtype, companions)
    sink.describe(output, out)                        # what --dry_run prints
    sink.write(output, out, options)                  # atomic: a hidden sibling, then renamed
    sink.verify(output, directory)                    # re-read, compared with the sources

The merge and training's full-model save hand a sink the same `Output`: named tensor sources
(`formats.base.TensorSource`), planned. Writers never ask which format the sources come from,
and callers never branch on the output format: adding an output is adding a `Sink` class.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from shardforge.io.digest import DEFAULT
from shardforge.sinks.plan import OutputPlan, TensorSpec, plan_output

if TYPE_CHECKING:
    import torch

    from shardforge.formats.base import TensorSource

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Companions:
    """The files beside the weights of a Hugging Face directory: the model config (written
    with the output dtype), a generation config (the first of `generation` that has one), the
    tokenizer of `tokenizer` with the config's chat template."""

    config: Any
    generation: Sequence[str] = ()
    tokenizer: str | None = None  # None: no tokenizer written
    trust_remote_code: bool = False
    chat_template: str | None = None
    chat_template_jinja: str | None = None


@dataclass(frozen=True)
class Output:
    """What a sink writes: the planned tensors and where each comes from."""

    plan: OutputPlan
    sources: Mapping[str, TensorSource]  # every tensor by output name (tied copies too)
    tied: Mapping[str, str] = field(default_factory=dict)  # tied name -> the name stored
    parameters: int = 0  # for describe
    dtype: torch.dtype | None = None  # the main dtype (config.json's)
    companions: Companions | None = None
    adapter_config: dict[str, Any] | None = None  # a PEFT adapter's adapter_config.json
    names: tuple[str, ...] = ()  # the model's state-dict order (a torch file keeps it)
    # what --verify compares the written tensors with, for its line
    reference: str = "the checkpoint"


def verified_line(n: int, output: Output) -> str:
    """What --verify reports once every tensor matched."""
    return f"verified {n} tensors: identical to {output.reference}"


@dataclass(frozen=True)
class WriteOptions:
    overwrite: bool = False
    verify: bool = False
    quiet: bool = False
    resume: bool = False  # continue an interrupted write to the same output
    overwrite_non_model: bool = False  # overwrite also an output holding more than a model
    manifest_hash: str = DEFAULT  # the integrity manifest's hash (`io.digest.ALGORITHMS`)

    @property
    def model_only(self) -> bool:
        """Whether an output replaced must hold a model and nothing else (`io.model_files`)."""
        return not self.overwrite_non_model


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def free_space(path: Path) -> int:
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    return shutil.disk_usage(parent).free


class Sink(ABC):
    """One kind of output (see the module docstring)."""

    # the --format value that selects it (None: chosen by the input, e.g. a LoRA adapter)
    name: ClassVar[str]
    # whether the output path is one file (else a directory)
    single_file: ClassVar[bool] = False

    def plan(
        self, specs: list[TensorSpec], max_shard_size: int | str | None, parameters: int
    ) -> OutputPlan:
        """The output files and every tensor's byte range (one file unless sharded)."""
        return plan_output(specs, None if self.single_file else max_shard_size, parameters)

    @abstractmethod
    def write(self, output: Output, out: Path, options: WriteOptions) -> None:
        """Write `output` at `out`, published atomically; verified first when asked."""

    @abstractmethod
    def verify(self, output: Output, location: Path, progress: Progress | None = None) -> int:
        """Re-read what was written at `location` (another reader than the write) and compare
        every tensor bit for bit with the sources; the number compared."""

    @abstractmethod
    def files(self, output: Output, out: Path) -> list[tuple[str, int | None, int | None]]:
        """(file name, tensors, bytes) of every file written at `out` (None: not counted)."""

    def describe(self, output: Output, out: Path) -> list[str]:
        """What `--dry_run` prints about the output (nothing is written)."""
        lines = [f"output: {out} (format {self.name})"]
        for name, count, size in self.files(output, out):
            what = [f"{count} tensors" if count is not None else "", human(size) if size else ""]
            detail = ", ".join(w for w in what if w)
            lines.append(f"  {name}: {detail}" if detail else f"  {name}")
        total = self.total_bytes(output)
        lines.append(f"parameters: {output.parameters:,}")
        lines.append(f"total bytes: {total:,} ({human(total)})")
        free = free_space(out)
        verdict = "enough" if free >= total else "NOT ENOUGH"
        lines.append(f"free disk at {out.parent}: {human(free)} ({verdict})")
        return lines

    def total_bytes(self, output: Output) -> int:
        return output.plan.total_bytes
