"""One merge's options as a typed value, checked for conflicts when it is made: before the
merge reads or writes anything.

`MergeRequest` is the only list of the merge's options: the command line's options and
`--help` (`shardforge.cli.merge_sharded_fsdp_weights`), the keywords, signature and docstring of
`merge_fsdp_weights` and the table of docs/merge-options.md derive from its fields
(`shardforge.merge.options`). Every problem of a request is reported at once, in one error.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shardforge.io.digest import ALGORITHMS
from shardforge.merge.options import (
    TORCHRUN,
    check_keywords,
    docstring_args,
    flag,
    one_error,
    option,
    option_fields,
    option_of,
    optional,
    parse_fields,
    parse_path,
    parse_size,
    parse_steps,
    parse_text,
    parse_texts,
    signature,
)
from shardforge.sinks.cast import keep_pattern

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

Engine = Literal["stream", "transformers"]
ENGINES: tuple[str, ...] = ("stream", "transformers")
# --format values; each names a sink in `sinks.registry.SINKS` (a test checks they agree)
OUTPUT_FORMATS: tuple[str, ...] = ("hf", "safetensors", "torch")


def parse_keep(value: Any, flag: str) -> tuple[str, ...]:
    """`--keep_dtype` patterns, each checked to be one (`sinks.cast.keep_pattern`)."""
    patterns = parse_texts(value, flag)
    for p in patterns:
        keep_pattern(p, flag)
    return patterns


@dataclass(frozen=True)
class MergeRequest:
    """What to merge and how: one field per option (its help text in `option(...)`)."""

    output_path: Path | None = optional(
        "Directory (--format hf) or file (--format safetensors/torch) to create, written as a "
        "temporary sibling and renamed when complete (default: <output_dir>/merged for "
        "--format hf, as Axolotl; <model dir>.consolidated for --format torch; required "
        "for --format safetensors and in Python). An s3://BUCKET/PREFIX (--format hf) is uploaded "
        "there, the index last (credentials: the AWS variables or the config's "
        "storage_options).",
        metavar="PATH",
        parse=parse_path,
        annotation="str | Path | None",
    )
    save_tokenizer: bool = flag(
        "Write the tokenizer with its chat template (default: on; --format hf only).", default=True
    )
    checkpoint: str | Path | None = optional(
        "A checkpoint to merge instead of the config's output_dir: a DCP directory, a folder "
        "of rank files, a step folder or a checkpoint root; local or s3://BUCKET/PREFIX (read "
        "in place with ranged requests).",
        metavar="PATH",
        doc="How the checkpoint is picked: [merge.md](merge.md#which-checkpoint); object "
        "storage: [storage.md](storage.md).",
    )
    step: int | None = optional("Merge this step instead of the latest.", type=int, metavar="N")
    dtype: str | torch.dtype | None = optional(
        "Output dtype of floating tensors: bfloat16, float16, float32 or as_saved (default: "
        "the base model's stored dtype that shardforge train recorded, else the config's "
        "dtype/torch_dtype, else as saved).",
        metavar="DTYPE",
        doc="Also `bf16`, `fp16`, `fp32`. The merge logs which dtype and why (`output dtype: "
        "bfloat16 (the base model's stored dtype, recorded by train)`). Cast while streaming; "
        "integer, bool and FP8/FP4 "
        "tensors are never cast, nor the modules the model class keeps in float32 "
        "(`_keep_in_fp32_modules`, `_keep_in_fp32_modules_strict`) or `--keep_dtype` names: "
        "[merge.md](merge.md#which-tensors---dtype-casts).",
    )
    keep_dtype: Sequence[str] = optional(
        "Keep the tensors whose name matches PATTERN in the dtype they are stored in, "
        "whatever --dtype says: a regular expression searched in the name, * for any "
        "characters (as transformers matches _keep_in_fp32_modules), e.g. router or "
        "layers.*.mlp.gate.weight.",
        metavar="PATTERN",
        multiple=True,
        parse=parse_keep,
        annotation="Sequence[str]",
        doc="In Python a list. `--dry_run` lists what is cast and what is kept, and why.",
        default=(),
    )
    max_shard_size: int | str | None = optional(
        "Largest safetensors file, e.g. 5GB, or bytes (default: as save_pretrained).",
        metavar="SIZE",
        parse=parse_size,
        doc="Decimal units (`5GB`, `500MB`), greedy in the order `save_pretrained` uses, so "
        "files and index are the ones `save_pretrained` writes (its default is 50GB in "
        "transformers 5.x). Refused with `--format safetensors/torch`.",
    )
    verify: bool = flag(
        "Re-read the output and compare every tensor with the checkpoint.",
        doc="Both are read by other code than the merge's: the output by the safetensors "
        "library, the checkpoint by torch (cast the same way); every record's CRC-32 is "
        "checked too (see [merge.md](merge.md#verification-another-reader)).",
    )
    remove_checkpoint_dir: bool = flag(
        "After a passed verification (implies --verify), delete the model shard files the "
        "merge read (never optimizer or trainer state; refused where they share the files).",
        doc="See [merge.md](merge.md#removing-the-shards).",
    )
    overwrite: bool = flag(
        "Replace an existing output (only once the new one is complete) that holds a model "
        "and nothing else.",
        doc="A folder or s3:// prefix holding anything a merge does not write (checkpoints, "
        "optimizer state, trainer_state.json, other files) is refused, naming what it holds. "
        "See [merge.md](merge.md#nothing-lost).",
    )
    overwrite_non_model: bool = flag(
        "With --overwrite: replace the output even if it holds more than a model (everything "
        "in the folder or under the prefix is deleted).",
    )
    resume: bool = flag(
        "Continue an interrupted merge to the same output: what it finished (files of its "
        "hidden directory, or parts uploaded to s3://) is re-checked and kept, the rest written.",
        doc="Finished files are re-checked by size and digest, uploaded parts by size; a merge "
        "of another plan, or of inputs that changed since (another save of the same shapes, "
        "a file replaced or rewritten), is refused, naming what changed. See "
        "[storage.md](storage.md#resume).",
    )
    manifest_hash: str = optional(
        "The hash of shardforge-manifest.json: blake3 (default; b3sum prints it) or sha256 "
        "(sha256sum, and the digests the Hugging Face Hub lists).",
        choices=ALGORITHMS,
        doc="Each weights file is hashed from its written bytes while the copy goes on; "
        "BLAKE3 uses every core and keeps up with the copy, SHA-256 (one core, about 1.5 "
        "GB/s) may add its remainder at the end. `shardforge verify` reads both. See "
        "[verify.md](verify.md).",
        default="blake3",
    )
    take_over_lock: bool = flag(
        "Take over the output's lock file when it names a merge on another host (one that no "
        "longer runs: shardforge cannot tell from here).",
        doc="One merge at a time writes an output: `<output>.shardforge.lock` beside it names "
        "the writer; a second merge is refused, a lock of a merge of this host that has ended "
        "is taken over with a notice. See [merge.md](merge.md#one-writer-at-a-time).",
    )
    engine: Engine = optional(
        "stream (bounded memory, default) or transformers (meta model + dcp.load + "
        "save_pretrained; whole model in memory; plain DCP, --format hf only).",
        choices=ENGINES,
        doc="The literal path: a meta-device model, `to_empty`, `dcp.load` (through the safe "
        "metadata reader), `save_pretrained`; it writes the same tensors.",
        default="stream",
    )
    quiet: bool = flag(
        "No progress bar; on the command line, transformers' bars and the libraries' warnings "
        "are kept off stderr too."
    )
    state_dict_dirname: str | None = optional(
        "The model folder inside each step, e.g. pytorch_ema_model_fsdp_0 (EMA weights).",
        metavar="NAME",
    )
    average_last: int | None = optional(
        "Merge the element-wise mean of the last K checkpoints (fp32 accumulation).",
        type=int,
        metavar="K",
    )
    average_steps: Sequence[int] = optional(
        "Merge the element-wise mean of these steps, e.g. 100,200,300 (in Python a list).",
        metavar="STEPS",
        parse=parse_steps,
        default=(),
    )
    output_format: str = optional(
        "hf: a Hugging Face model directory (default); safetensors: one model.safetensors-"
        'format file; torch: one torch.save file {"state_dict": ...} with CPU tensors, '
        "written one tensor at a time.",
        cli_name="format",
        choices=OUTPUT_FORMATS,
        default="hf",
    )
    dry_run: bool = flag(
        "Print the plan (inputs, output files, dtypes, bytes, free disk) and write nothing."
    )
    merge_lora: bool = flag(
        "For a LoRA checkpoint: write the complete model with the adapter fused in "
        "(W + scale * B @ A, streamed) instead of a PEFT adapter directory.",
        doc="See [lora.md](lora.md).",
    )
    # every step of the run (or these steps), each to <output_path>/step-N
    all_steps: bool = flag(
        "Merge every checkpoint of the run, each to OUTPUT_PATH/step-N.",
        doc="See [merge.md](merge.md#every-step-of-a-run---all_steps----steps).",
    )
    steps: Sequence[int] = optional(
        "Merge these steps, e.g. 100,200 (in Python a list), each to OUTPUT_PATH/step-N as "
        "--all_steps does with every step.",
        metavar="STEPS",
        parse=parse_steps,
        default=(),
    )
    # a distributed merge: torchrun's options, passed through (gloo, CPU ranks)
    nproc_per_node: int | None = optional(
        "Merge on N CPU ranks of this machine (gloo): the output bytes are split evenly "
        "between them.",
        type=int,
        metavar="N",
        group=TORCHRUN,
        doc="See [merge.md](merge.md#on-several-ranks-and-machines---nproc_per_node); "
        "with the options below, a merge over several machines on a shared file system.",
    )
    nnodes: str | None = optional(
        "Machines of a distributed merge.",
        metavar="N",
        parse=parse_text,
        group=TORCHRUN,
    )
    node_rank: int | None = optional("This machine's rank.", type=int, metavar="R", group=TORCHRUN)
    rdzv_endpoint: str | None = optional(
        "host:port of the rendezvous.", metavar="HOST:PORT", group=TORCHRUN
    )
    rdzv_backend: str | None = optional(
        "Rendezvous backend (default c10d).", metavar="BACKEND", group=TORCHRUN
    )
    rdzv_id: str | None = optional("Rendezvous id.", metavar="ID", group=TORCHRUN)
    master_addr: str | None = optional("Address of node 0.", metavar="HOST", group=TORCHRUN)
    master_port: int | None = optional("Port on node 0.", type=int, metavar="PORT", group=TORCHRUN)
    max_restarts: int | None = optional(
        "Restarts torchrun may make.", type=int, metavar="N", group=TORCHRUN
    )
    group: ProcessGroup | None = field(
        default=None,
        compare=False,
        metadata=option(
            "Merge on the ranks of this initialised torch.distributed process group (the default "
            "group, torch.distributed.group.WORLD), every rank of it calling merge_fsdp_weights. "
            "Without it the merge runs in this process alone, also inside a process group (as "
            "`if is_main_process: merge_fsdp_weights(...)` does).",
            cli=False,
        ),
    )

    def __post_init__(self) -> None:
        problems = parse_fields(self)
        problems += self._value_problems()
        problems += self._step_problems()
        problems += self._rank_problems()
        if problems:
            raise one_error(problems, "conflicting merge options")

    def _value_problems(self) -> list[str]:
        """Each value alone, and the output's options together."""
        problems = []
        if self.engine not in ENGINES:
            problems.append(f"--engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.output_format not in OUTPUT_FORMATS:
            problems.append(
                f"--format {self.output_format!r}: expected one of {', '.join(OUTPUT_FORMATS)}"
            )
        elif self.output_path is None and self.output_format != "torch":
            problems.append(f"--output_path is required with --format {self.output_format}")
        if self.engine == "transformers" and (self.output_format != "hf" or self.averaging):
            problems.append("--engine transformers writes --format hf of one checkpoint only")
        if self.single_file and self.max_shard_size is not None:
            problems.append(f"--max_shard_size does not apply to --format {self.output_format}")
        if self.resume and (self.single_file or self.engine != "stream"):
            problems.append("--resume continues a --format hf merge of the stream engine")
        if self.overwrite_non_model and not self.overwrite:
            problems.append("--overwrite_non_model goes with --overwrite (it widens it)")
        if self.average_last is not None and self.average_last < 1:
            problems.append(f"--average_last {self.average_last}: expected a count of at least 1")
        return problems

    def _step_problems(self) -> list[str]:
        """Which checkpoints: one step, an average, or every step to its own folder."""
        problems = []
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
                problems.append(
                    f"--all_steps / --steps merge each step to <output_path>/step-N; they "
                    f"cannot be combined with {', '.join(clash)}"
                )
            if len(set(self.steps)) != len(self.steps):
                problems.append("--steps: a step is listed twice")
        if self.remove_checkpoint_dir and self.averaging:
            problems.append("--remove_checkpoint_dir cannot be combined with averaging")
        if self.average_last is not None and self.average_steps:
            problems.append("give --average_last or --average_steps, not both")
        if len(set(self.average_steps)) != len(self.average_steps):
            problems.append("--average_steps: a step is listed twice")
        if self.step is not None and self.averaging:
            problems.append("--step picks one checkpoint; with averaging list --average_steps")
        return problems

    def _rank_problems(self) -> list[str]:
        """A merge on several ranks: started by the launcher, or on the caller's group."""
        problems = []
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            problems.append(f"--nproc_per_node {self.nproc_per_node}: expected 1 or more")
        if self.group is not None and self.distributed:
            problems.append(
                "group= merges on the ranks of a running process group; --nproc_per_node/"
                "--nnodes start new ones: give one or the other"
            )
        if not (self.distributed or self.group is not None):
            return problems
        what = [
            flag
            for flag, on in (
                ("--engine transformers", self.engine != "stream"),
                (f"--format {self.output_format}", self.single_file),
                ("--remove_checkpoint_dir", self.remove_checkpoint_dir),
                ("--dry_run", self.dry_run),
                ("--resume", self.resume),
            )
            if on
        ]
        if what:
            how = "(--nproc_per_node/--nnodes)" if self.distributed else "on a process group"
            problems.append(
                f"a distributed merge {how} writes --format hf with the stream engine; drop "
                f"{', '.join(what)} or merge on one rank"
            )
        return problems

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
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in option_fields(MergeRequest))

MERGE_DOC = """Merge a sharded FSDP checkpoint (DCP, per-rank DTensor files, torchtitan) into a
Hugging Face model directory, or one safetensors / torch file.

    merge_fsdp_weights(load_cfg("cfg.yml"), "out/merged", verify=True, dtype="bfloat16")

The keywords are the options of `shardforge merge-sharded-fsdp-weights`; every conflict
between them is reported at once, before anything is read.

Args:
    cfg: the config (``load_cfg`` result, path, mapping or ``ShardforgeConfig``); its
        ``output_dir`` is searched for the latest complete checkpoint and its ``base_model`` /
        ``base_model_config`` / ``tokenizer_config`` give the architecture, config and
        tokenizer.
{args}

Returns:
    The output path (for an ``s3://`` output, its URI as a str).

Raises:
    CheckpointError: the checkpoint cannot be found, read or trusted.
    MergeError: conflicting options, mismatch with the architecture, existing output, no disk
        space, failed verification.
    TypeError: an unknown keyword (with the option it resembles).
"""


def merge_keywords(merge: Callable[..., Path | str]) -> Callable[..., Path | str]:
    """`merge(cfg, output_path=None, save_tokenizer=True, **options)` with MergeRequest's
    fields as its keywords: an unknown one is a TypeError naming it (and the option it
    resembles), and `help()` and IDEs show every option with its default and help text."""

    @functools.wraps(merge)
    def checked(cfg: Any, *args: Any, **options: Any) -> Path | str:
        check_keywords(MergeRequest, options, merge.__name__)
        return merge(cfg, *args, **options)

    positional = ("output_path", "save_tokenizer")
    cfg = inspect.Parameter("cfg", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Any")
    checked.__signature__ = signature(MergeRequest, [cfg], positional, "Path | str")  # type: ignore[attr-defined]
    checked.__doc__ = MERGE_DOC.format(args=docstring_args(MergeRequest, indent="    "))
    return checked


def _as_merge(name: str, **changes: Any) -> Any:
    """The metadata of MergeRequest's option `name`: the same option, in the same words but
    for `changes` (Option's fields)."""
    same = option_of(MergeRequest.__dataclass_fields__[name])
    return option(**{**dataclasses.asdict(same), "doc": "", **changes})


@dataclass(frozen=True)
class LoraMergeRequest:
    """The options of `shardforge merge-lora`: `shardforge.merge.lora.merge_lora`'s keywords."""

    lora_model_dir: str | Path | None = optional(
        "The PEFT adapter directory (default: the config's lora_model_dir, else output_dir).",
        metavar="DIR",
    )
    output_path: str | Path | None = field(
        default=None,
        metadata=_as_merge(
            "output_path", help="Directory to create (default <output_dir>/merged, as Axolotl)."
        ),
    )
    dtype: str | torch.dtype | None = field(
        default=None,
        metadata=_as_merge(
            "dtype",
            help="Output dtype of floating tensors: bfloat16, float16, float32 or as_saved "
            "(default: the base config's dtype, else as the base model stores them).",
        ),
    )
    keep_dtype: Sequence[str] = field(default=(), metadata=_as_merge("keep_dtype"))
    max_shard_size: int | str | None = field(default=None, metadata=_as_merge("max_shard_size"))
    verify: bool = flag(
        "Re-read the output and compare every tensor with the base model and adapter read "
        "by the safetensors library and fused again."
    )
    overwrite: bool = field(default=False, metadata=_as_merge("overwrite"))
    overwrite_non_model: bool = field(default=False, metadata=_as_merge("overwrite_non_model"))
    save_tokenizer: bool = flag("Write the tokenizer (default: on).", default=True)
    quiet: bool = field(default=False, metadata=_as_merge("quiet"))
    take_over_lock: bool = field(default=False, metadata=_as_merge("take_over_lock"))

    def __post_init__(self) -> None:
        problems = parse_fields(self)
        if self.overwrite_non_model and not self.overwrite:
            problems.append("--overwrite_non_model goes with --overwrite (it widens it)")
        if problems:
            raise one_error(problems, "conflicting merge-lora options")
