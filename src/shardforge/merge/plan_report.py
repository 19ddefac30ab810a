"""The plan of a merge as text (`--dry_run`): inputs, then what the sink says it would write
(files, tensors, bytes, parameters, free disk space), the dtypes and the rule that gave each
tensor its dtype (`sinks.cast`), and what removal would delete. Nothing is written."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from shardforge.layouts.catalog import LAST
from shardforge.merge.locate import MergeSources
from shardforge.merge.remove import RemovalPlan
from shardforge.sinks.base import Output, Sink
from shardforge.sinks.cast import Decision, describe

LISTED = 20  # shard files to remove listed by name; the rest counted


def describe_plan(
    sources: MergeSources,
    sink: Sink,
    output: Output,
    out: Path,
    removal: RemovalPlan | None = None,
    casts: Mapping[str, Decision] | None = None,
    dtype_line: str = "",
) -> str:
    """Human-readable plan of a prepared merge; nothing is written. `casts`: what the output
    dtype casts and keeps (one line per rule, with examples); `dtype_line`: the output dtype
    and why (`merge.dtypes.output_target`)."""
    lines = ["dry run: nothing is written", "input:"]
    for c in sources.inputs:
        step = f"step {c.step}" if 0 <= c.step < LAST else "single checkpoint"
        adapter = f", {c.adapter} names" if c.adapter else ""
        lines.append(f"  {c.model_dir} [{c.layout} layout, {c.kind}{adapter}, {step}]")
    if len(sources.inputs) > 1:
        lines.append(f"  element-wise mean of {len(sources.inputs)} checkpoints (fp32)")
    lines.append(f"config: {sources.config}")
    described = sink.describe(output, out)
    dtypes = Counter(str(t.spec.dtype).removeprefix("torch.") for _, t in output.plan.tensors())
    at = next(i for i, line in enumerate(described) if line.startswith("parameters:"))
    dtypes_line = "dtypes: " + ", ".join(f"{d} ({n} tensors)" for d, n in sorted(dtypes.items()))
    lines += [*described[:at], *([dtype_line] if dtype_line else []), dtypes_line]
    if casts:
        lines += ["dtype rules:", *(f"  {line}" for line in describe(casts))]
    lines += described[at:]
    if removal is not None:
        lines.append(
            f"--remove_checkpoint_dir: after verification, would remove {len(removal.files)} "
            f"shard files of {removal.model_dir} (and the folder if then empty):"
        )
        shown = removal.files[:LISTED]
        lines += [f"  {f.relative}" for f in shown]
        if len(removal.files) > len(shown):
            lines.append(f"  (+{len(removal.files) - len(shown)} more)")
    return "\n".join(lines)
