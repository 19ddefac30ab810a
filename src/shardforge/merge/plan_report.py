"""The plan of a merge as text (`--dry_run`): inputs, output files, tensors, dtypes, bytes and
the free disk space where the output goes."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from shardforge.layouts.catalog import LAST
from shardforge.merge.remove import RemovalPlan

# the files the hf format writes beside the weights
HF_COMPANIONS = ("config.json", "generation_config.json")
LISTED = 20  # shard files listed by name; the rest counted


def _size(n: float) -> str:
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


def describe_plan(
    prep: Any, out: Path, fmt: str, save_tokenizer: bool, removal: RemovalPlan | None = None
) -> str:
    """Human-readable plan of a prepared merge (`merge._Prepared`); nothing is written."""
    lines = ["dry run: nothing is written", "input:"]
    for c in prep.sources.inputs:
        step = f"step {c.step}" if 0 <= c.step < LAST else "single checkpoint"
        adapter = f", {c.adapter} names" if c.adapter else ""
        lines.append(f"  {c.model_dir} [{c.layout} layout, {c.kind}{adapter}, {step}]")
    if len(prep.sources.inputs) > 1:
        lines.append(f"  element-wise mean of {len(prep.sources.inputs)} checkpoints (fp32)")
    lines.append(f"config: {prep.sources.config}")
    lines.append(f"output: {out} (format {fmt})")
    tensors = [t.spec for _, t in prep.plan.tensors()]
    if fmt == "torch":
        total = sum(s.nbytes for s in tensors)
        lines.append(f"  {out.name}: {len(tensors)} tensors, {_size(total)}")
    else:
        total = prep.plan.total_bytes
        for f in prep.plan.files:
            name = out.name if fmt == "safetensors" else f.name
            lines.append(f"  {name}: {len(f.tensors)} tensors, {_size(f.size)}")
        if fmt == "hf" and prep.plan.index is not None:
            lines.append("  model.safetensors.index.json")
    if fmt == "hf":
        extra = [*HF_COMPANIONS, *(["tokenizer files"] if save_tokenizer else [])]
        lines.append(f"  + {', '.join(extra)}")
    dtypes = Counter(str(s.dtype).removeprefix("torch.") for s in tensors)
    lines.append("dtypes: " + ", ".join(f"{d} ({n} tensors)" for d, n in sorted(dtypes.items())))
    lines.append(f"parameters: {prep.expected.total_parameters:,}")
    lines.append(f"total bytes: {total:,} ({_size(total)})")
    free = free_space(out)
    verdict = "enough" if free >= total else "NOT ENOUGH"
    lines.append(f"free disk at {out.parent}: {_size(free)} ({verdict})")
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
