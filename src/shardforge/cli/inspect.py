"""`shardforge inspect PATH_OR_CFG`: what a sharded checkpoint holds (layout, steps, world size,
writer versions, tensors, parameter count, optimizer state), from its metadata alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from shardforge.cli._common import fire_entry, shardforge_command, spelled

EPILOG = """\b
Examples:
  # the latest checkpoint under the config's output_dir, and every step found
  shardforge inspect examples/tiny-llama.yml
  # a run folder, one step, every tensor
  shardforge inspect outputs/tiny-llama --step 100 --all
  # one checkpoint: a step folder, a DCP directory, a Lightning .ckpt/, a rank-file folder
  shardforge inspect outputs/tiny-llama/checkpoint-100
  shardforge inspect runs/checkpoint-500/pytorch_model_fsdp_0
  shardforge inspect checkpoints/global_step_100/actor
  # in object storage (credentials from AWS_* or the config's storage_options)
  shardforge inspect s3://bucket/runs/tiny-llama
  # LMMs-Engine EMA weights instead of the model
  shardforge inspect runs --state_dict_dirname pytorch_ema_model_fsdp_0
  # what --dtype bfloat16 would cast, and what it keeps (and why); --all lists every tensor
  shardforge inspect examples/tiny-llama.yml --dtype bfloat16 --keep_dtype norm
  # for scripts: one JSON document on stdout
  shardforge inspect outputs/tiny-llama --json | jq .model.parameter_count
  python -m shardforge.cli.inspect outputs/tiny-llama --json
"""

# tensors shown at each end of the table unless --all
TABLE_ENDS = 10
UNITS: tuple[str, ...] = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in UNITS:
        if abs(value) < 1024 or unit == UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(n: int, noun: str) -> str:
    """count(1, 'tensor') -> '1 tensor'; count(3, 'tensor') -> '3 tensors'."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _state_line(s: dict[str, Any]) -> str:
    parts = []
    if s["tensor_count"] is not None:
        parts.append(f"{count(s['tensor_count'], 'tensor')}, {human_bytes(s['total_bytes'])}")
    if s["non_tensor_count"]:
        parts.append(count(s["non_tensor_count"], "non-tensor entry").replace("ys", "ies"))
    if s["location"] == "mixed":
        parts.append("in the same DCP as the model")
    elif s["location"] == "beside":
        parts.append(f"in {s['path']}")
    if s["files"]:
        read = "" if s["tensor_count"] is not None else ", not read"
        parts.append(f"{count(s['files'], 'file')}, {human_bytes(s['files_bytes'])} on disk{read}")
    return "; ".join(parts)


def _steps_line(d: dict[str, Any]) -> str:
    by_layout: dict[str, list[str]] = {}
    for s in d["steps"]:
        by_layout.setdefault(s["layout"], []).append(s["step_label"])
    return "; ".join(f"{', '.join(labels)} ({layout})" for layout, labels in by_layout.items())


def _table(tensors: list[dict[str, Any]], show_all: bool) -> list[str]:
    rows = [("name", "dtype", "shape", "params", "bytes")]
    hidden = 0
    shown = tensors
    if not show_all and len(tensors) > 2 * TABLE_ENDS + 1:
        hidden = len(tensors) - 2 * TABLE_ENDS
        shown = tensors[:TABLE_ENDS] + tensors[-TABLE_ENDS:]
    for t in shown:
        shape = " x ".join(str(n) for n in t["shape"]) or "scalar"
        rows.append((t["name"], t["dtype"], shape, f"{t['numel']:,}", f"{t['bytes']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2])]
        cells += [r[3].rjust(widths[3]), r[4].rjust(widths[4])]
        lines.append("  ".join(cells).rstrip())
        if hidden and i == TABLE_ENDS:
            lines.append(f"... {hidden} more tensors (--all shows every tensor) ...")
    return lines


def format_report(d: dict[str, Any], show_all: bool = False) -> str:
    """The human-readable report of an `Inspection.to_dict()` document."""
    step = "" if d["step"] is None and d["step_label"] == "?" else f", step {d['step_label']}"
    model = d["model"]
    header = [
        ("checkpoint", d["model_dir"]),
        ("layout", f"{d['layout']}{step} ({d['storage']})"),
    ]
    if d["key_names"] != "hugging-face":
        header.append(("key names", f"{d['key_names']} (the merge maps them to Hugging Face)"))
    if d["steps"]:
        header.append(("steps found", _steps_line(d)))
    if d["world_size"] is not None:
        header.append(("world size", f"{d['world_size']} (from {d['world_size_source']})"))
    else:
        header.append(("world size", "unknown"))
    versions = ", ".join(f"{k} {v}" for k, v in d["versions"].items())
    header.append(("written by", versions or "not recorded"))
    by_dtype = ", ".join(f"{k} {human_bytes(v)}" for k, v in model["bytes_by_dtype"].items())
    header.append(
        (
            "model",
            f"{count(model['tensor_count'], 'tensor')}, "
            f"{count(model['parameter_count'], 'parameter')}, "
            f"{human_bytes(model['total_bytes'])} ({model['total_bytes']:,} bytes"
            f"{'; ' + by_dtype if by_dtype else ''})",
        )
    )
    if d["non_tensor_keys"]:
        header.append(("non-tensor", ", ".join(d["non_tensor_keys"])))
    header.append(("optimizer", _state_line(d["optimizer"]) if d["optimizer"] else "none found"))
    if d["other_state"]:
        header.append(("other state", _state_line(d["other_state"])))
    width = max(len(k) for k, _ in header)
    lines = [f"{k.ljust(width)}  {v}" for k, v in header]
    if "dtype_rules" in d:
        lines += ["", *_dtype_rules(d["dtype_rules"], show_all)]
    if model["tensors"]:
        lines += ["", *_table(model["tensors"], show_all)]
    return "\n".join(lines) + "\n"


def _dtype_rules(rules: dict[str, Any], show_all: bool) -> list[str]:
    """What the output dtype would cast and keep: one line per rule (with every tensor and
    its rule under --all)."""
    target = rules["target"] or "none (as saved; give --dtype)"
    lines = [f"dtype rules (output dtype {target}):", *(f"  {r}" for r in rules["rules"])]
    if show_all:
        width = max(len(n) for n in rules["tensors"])
        lines += [f"  {n.ljust(width)}  {t['rule']}" for n, t in rules["tensors"].items()]
    return lines


def do_inspect(
    path_or_config: str | Path,
    step: int | None = None,
    override_args: list[str] | None = None,
    as_json: bool = False,
    show_all: bool = False,
    state_dict_dirname: str | None = None,
    dtype: str | None = None,
    keep_dtype: tuple[str, ...] = (),
) -> str:
    """The report on the checkpoint at `path_or_config` (a path or a YAML config's
    output_dir): one JSON document with `as_json`, else the human-readable text; with
    `dtype` or `keep_dtype`, what the merge would cast and keep, and why."""
    from shardforge.inspection import inspect_path_or_config
    from shardforge.io.mirror import staging

    with staging() as area:  # an s3:// checkpoint is mirrored there; the report names the URI
        facts = inspect_path_or_config(
            path_or_config, step, override_args, state_dict_dirname, dtype, keep_dtype
        ).to_dict()
        text = json.dumps(facts, indent=2) + "\n" if as_json else format_report(facts, show_all)
        return area.rewrite(text)


@shardforge_command(
    "inspect",
    epilog=EPILOG,
    params=[
        click.Argument(["path_or_config"], metavar="PATH_OR_CFG", type=click.Path()),
        click.Option(["--step"], type=int, help="Describe this step instead of the latest."),
        spelled(
            "state_dict_dirname",
            help="The model folder inside each step, e.g. pytorch_ema_model_fsdp_0 for EMA "
            "weights.",
        ),
        click.Option(
            ["--json", "as_json"], is_flag=True, help="Print one JSON document (for scripts)."
        ),
        click.Option(
            ["--all", "show_all"],
            is_flag=True,
            help=f"List every tensor (default: first/last {TABLE_ENDS}).",
        ),
        click.Option(
            ["--dtype"],
            metavar="DTYPE",
            help="Show what the merge's --dtype DTYPE would cast and keep, and why (default "
            "with a config: its base model's dtype).",
        ),
        spelled(
            "keep_dtype",
            multiple=True,
            metavar="PATTERN",
            help="As the merge's --keep_dtype (repeatable): shown among the dtype rules.",
        ),
    ],
)
def command(
    path_or_config: str,
    step: int | None,
    state_dict_dirname: str | None,
    as_json: bool,
    show_all: bool,
    dtype: str | None,
    keep_dtype: tuple[str, ...],
    overrides: list[str],
) -> str:
    """Describe a sharded checkpoint without loading its weights: the layout found, the
    steps available, world size, the versions that wrote it (when recorded), every model
    tensor (name, dtype, global shape, bytes), parameter count and total bytes, and the
    optimizer state beside or inside it. PATH_OR_CFG is a checkpoint root, a step folder, a
    DCP directory, a Lightning .ckpt directory, a folder of model_world_size_W_rank_R.pt
    files, or a YAML config (its output_dir is searched; config overrides may follow).
    With --dtype or --keep_dtype, what the merge would cast and keep, one line per rule (every
    tensor with --all or --json). Nothing is written."""
    return do_inspect(
        path_or_config, step, overrides, as_json, show_all, state_dict_dirname, dtype, keep_dtype
    )


do_cli = fire_entry(command)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
