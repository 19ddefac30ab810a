"""One merge's options as a typed value, checked for conflicts when it is made: before the
merge reads or writes anything."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from shardforge.errors import MergeError

if TYPE_CHECKING:
    import torch

Engine = Literal["stream", "transformers"]
ENGINES: tuple[str, ...] = ("stream", "transformers")
# --format values; each names a writer in `merge.api.FORMATS`
OUTPUT_FORMATS: tuple[str, ...] = ("hf", "safetensors", "torch")


@dataclass(frozen=True)
class MergeRequest:
    """What to merge and how (see `merge_fsdp_weights` for each option's meaning)."""

    output_path: Path | None = None
    save_tokenizer: bool = True
    checkpoint: str | Path | None = None
    step: int | None = None
    dtype: str | torch.dtype | None = None
    max_shard_size: int | str | None = None
    verify: bool = False
    remove_checkpoint_dir: bool = False
    overwrite: bool = False
    engine: Engine = "stream"
    quiet: bool = False
    state_dict_dirname: str | None = None
    average_last: int | None = None
    average_steps: tuple[int, ...] = ()
    output_format: str = "hf"
    dry_run: bool = False
    merge_lora: bool = False
    # every step of the run (or these steps), each to <output_path>/step-N
    all_steps: bool = False
    steps: tuple[int, ...] = ()
    # a distributed merge: torchrun's options, passed through (gloo, CPU ranks)
    nproc_per_node: int | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.output_path is not None:
            object.__setattr__(self, "output_path", Path(self.output_path).absolute())
        object.__setattr__(self, "average_steps", tuple(self.average_steps or ()))
        object.__setattr__(self, "steps", tuple(self.steps or ()))
        if self.per_step:
            clash = [
                flag
                for flag, on in (
                    ("--step", self.step is not None),
                    ("averaging", self.averaging),
                    ("--remove_checkpoint_dir", self.remove_checkpoint_dir),
                    (f"--format {self.output_format}", self.single_file),
                    ("--all_steps with --steps", self.all_steps and bool(self.steps)),
                )
                if on
            ]
            if clash:
                raise MergeError(
                    f"--all_steps / --steps merge each step to <output_path>/step-N; they "
                    f"cannot be combined with {', '.join(clash)}"
                )
            if len(set(self.steps)) != len(self.steps):
                raise MergeError("--steps: a step is listed twice")
        if self.engine not in ENGINES:
            raise MergeError(f"--engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.output_format not in OUTPUT_FORMATS:
            raise MergeError(
                f"--format {self.output_format!r}: expected one of {', '.join(OUTPUT_FORMATS)}"
            )
        if self.engine != "stream" and (self.output_format != "hf" or self.averaging):
            raise MergeError("--engine transformers writes --format hf of one checkpoint only")
        if self.remove_checkpoint_dir and self.averaging:
            raise MergeError("--remove_checkpoint_dir cannot be combined with averaging")
        if self.single_file and self.max_shard_size is not None:
            raise MergeError(f"--max_shard_size does not apply to --format {self.output_format}")
        if self.output_path is None and self.output_format != "torch":
            raise MergeError(f"--output_path is required with --format {self.output_format}")
        if self.average_last is not None and self.average_last < 1:
            raise MergeError(f"--average_last {self.average_last}: expected a count of at least 1")
        if self.average_last is not None and self.average_steps:
            raise MergeError("give --average_last or --average_steps, not both")
        if len(set(self.average_steps)) != len(self.average_steps):
            raise MergeError("--average_steps: a step is listed twice")
        if self.distributed:
            if self.nproc_per_node is not None and self.nproc_per_node < 1:
                raise MergeError(f"--nproc_per_node {self.nproc_per_node}: expected 1 or more")
            what = [
                flag
                for flag, on in (
                    ("--engine transformers", self.engine != "stream"),
                    (f"--format {self.output_format}", self.single_file),
                    ("--remove_checkpoint_dir", self.remove_checkpoint_dir),
                    ("--dry_run", self.dry_run),
                )
                if on
            ]
            if what:
                raise MergeError(
                    f"a distributed merge (--nproc_per_node/--nnodes) writes --format hf with "
                    f"the stream engine; drop {', '.join(what)} or merge on one rank"
                )
        if self.step is not None and self.averaging:
            raise MergeError("--step picks one checkpoint; with averaging list --average_steps")

    @property
    def per_step(self) -> bool:
        """Several steps, each merged to its own `step-N` folder."""
        return self.all_steps or bool(self.steps)

    @property
    def distributed(self) -> bool:
        """More than one rank asked for (the launcher starts them with torchrun)."""
        return (self.nproc_per_node or 1) > 1 or self.nnodes not in (None, "1")

    @property
    def averaging(self) -> bool:
        return self.average_last is not None or bool(self.average_steps)

    @property
    def single_file(self) -> bool:
        """The weights go to one file (safetensors or torch), whatever its size."""
        return self.output_format != "hf"

    @property
    def verifies(self) -> bool:
        """`--verify`, also implied by `--remove_checkpoint_dir` (nothing goes unverified)."""
        return self.verify or self.remove_checkpoint_dir


# the option names the CLI and `merge_fsdp_weights` pass through (besides the config)
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(MergeRequest))
