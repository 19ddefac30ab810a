"""`shardforge merge-sharded-fsdp-weights CONFIG --output_path DIR`: merge a sharded FSDP (DCP)
checkpoint into a complete Hugging Face model directory, streaming with bounded memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from shardforge.cli._common import (
    OVERRIDE_CONTEXT,
    OVERRIDES_HELP,
    check_options,
    debug_option,
    fire_overrides,
    run_guarded,
    setup_logging,
    spelled_option,
    split_debug,
)

EPILOG = """\b
Examples:
  # latest complete checkpoint under the config's output_dir
  shardforge merge-sharded-fsdp-weights examples/tiny-llama.yml --output_path outputs/merged
  # a given step, cast to bf16, verified, 5GB shards
  shardforge merge-sharded-fsdp-weights cfg.yml --output-path out --step 200 \\
      --dtype bfloat16 --verify --max_shard_size 5GB
  # an HF Trainer / accelerate checkpoint
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out \\
      --checkpoint runs/checkpoint-500/pytorch_model_fsdp_0
  # a Lightning sharded checkpoint
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out \\
      --checkpoint lightning_logs/version_0/checkpoints/last.ckpt
  # verl / LMMs-Engine per-rank files (model_world_size_W_rank_R.pt), latest step
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --checkpoint checkpoints/
  # the EMA weights of step 500
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --step 500 \\
      --state_dict_dirname pytorch_ema_model_fsdp_0
  # a torchtitan step-N/ checkpoint (names mapped by the config's model_type)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --checkpoint outputs/checkpoint
  # every checkpoint of the run, each to out/step-N (or --steps 100,200)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --all_steps
  # on 4 CPU ranks of this machine (2 machines: --nnodes 2 --node_rank R --rdzv_endpoint H:P)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --nproc_per_node 4
  # a LoRA run (adapter: lora): a PEFT adapter directory, or the fused model
  shardforge merge-sharded-fsdp-weights lora.yml --output_path out/adapter
  shardforge merge-sharded-fsdp-weights lora.yml --output_path out/merged --merge_lora
  # the mean of the last 3 checkpoints (or --average_steps 100,200,300)
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --average_last 3
  # one safetensors file; one torch file {"state_dict": ...} (default <ckpt>.consolidated)
  shardforge merge-sharded-fsdp-weights cfg.yml --format safetensors --output_path m.safetensors
  shardforge merge-sharded-fsdp-weights cfg.yml --format torch
  # print the plan (inputs, files, dtypes, bytes, free disk) and write nothing
  shardforge merge-sharded-fsdp-weights cfg.yml --output_path out --dry_run
  python -m shardforge.cli.merge_sharded_fsdp_weights cfg.yml --output_path out
"""


def parse_steps(
    value: str | int | list[int] | tuple[int, ...] | None, flag: str = "--average_steps"
) -> list[int] | None:
    """`--average_steps 100,200,300` (or `--steps`) -> [100, 200, 300]."""
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, int):
        return [value]
    if isinstance(value, tuple):
        return list(value)
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        from shardforge.errors import MergeError

        raise MergeError(f"{flag} {value!r}: expected step numbers like 100,200,300")
    return [int(p) for p in parts]


def do_merge_sharded_fsdp_weights(
    config: str | Path,
    output_path: str | Path | None,
    override_args: list[str] | None = None,
    **options: Any,
) -> Path:
    """Load `config` (plus overrides) and run `merge_fsdp_weights` with `options`.

    The merge's byte copy gets a head start: it begins before torch is imported (torch and
    transformers take seconds to load), and the merge takes it over only when it is exactly
    what the merge would write (`shardforge.merge.overlap`)."""
    from shardforge.config import load_cfg, parse_override_args
    from shardforge.merge.overlap import head_start

    for key in ("average_steps", "steps"):
        if key in options:
            options[key] = parse_steps(options[key], f"--{key}")
    overrides = parse_override_args(override_args or [])
    cfg = load_cfg(config, command="merge", **overrides)
    with head_start(cfg, output_path, options):
        from shardforge.merge.api import merge_fsdp_weights

        return merge_fsdp_weights(cfg, output_path, **options)


@click.command(
    "merge-sharded-fsdp-weights",
    context_settings=OVERRIDE_CONTEXT,
    epilog=EPILOG,
    help="Merge the sharded FSDP checkpoint of CONFIG's run (the latest complete one under "
    "output_dir, or --checkpoint: DCP, per-rank DTensor files of verl / LMMs-Engine, torchtitan) "
    "into a complete Hugging Face model directory: safetensors weights + index, config.json, "
    "generation_config.json and tokenizer (or one file with --format). Memory stays at about "
    "one tensor per input; the output appears only when complete. " + OVERRIDES_HELP,
)
@click.argument("config", type=click.Path(dir_okay=False))
@spelled_option(
    "output_path",
    default=None,
    help="Directory (--format hf) or file to create; required except with --format torch "
    "(default <model dir>.consolidated).",
)
@click.option(
    "--checkpoint", default=None, help="A DCP directory or checkpoint root (default: output_dir)."
)
@click.option("--step", type=int, default=None, help="Merge this step instead of the latest.")
@click.option(
    "--dtype",
    default=None,
    help="Output dtype of floating tensors: bfloat16, float16, float32 or as_saved "
    "(default: the config's torch_dtype, else as saved).",
)
@spelled_option(
    "max_shard_size",
    default=None,
    help="Largest weights file, e.g. 5GB (default: as save_pretrained).",
)
@click.option("--verify", is_flag=True, help="Re-read the output and compare every tensor.")
@spelled_option(
    "remove_checkpoint_dir",
    is_flag=True,
    help="After a passed verification (implies --verify), delete the model shard files the "
    "merge read (never optimizer or trainer state; refused where they share the files).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing non-empty output directory.")
@click.option(
    "--save-tokenizer/--no-save-tokenizer",
    "--save_tokenizer/--no_save_tokenizer",
    "save_tokenizer",
    default=True,
    help="Write the tokenizer (default: on).",
)
@click.option(
    "--engine",
    type=click.Choice(["stream", "transformers"]),
    default="stream",
    help="stream (bounded memory, default) or transformers (meta model + dcp.load + "
    "save_pretrained; whole model in memory).",
)
@spelled_option(
    "state_dict_dirname",
    default=None,
    help="The model folder inside each step, e.g. pytorch_ema_model_fsdp_0 (EMA weights).",
)
@spelled_option(
    "average_last",
    type=int,
    default=None,
    help="Merge the element-wise mean of the last K checkpoints (fp32 accumulation).",
)
@spelled_option(
    "average_steps",
    default=None,
    help="Merge the element-wise mean of these steps, e.g. 100,200,300.",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["hf", "safetensors", "torch"]),
    default="hf",
    help="hf: HF model directory (default); safetensors: one model.safetensors-format file; "
    'torch: one torch.save file {"state_dict": ...} with CPU tensors, written one tensor at a '
    "time.",
)
@spelled_option(
    "dry_run",
    is_flag=True,
    help="Print the plan (inputs, output files, dtypes, bytes, free disk) and write nothing.",
)
@spelled_option(
    "merge_lora",
    is_flag=True,
    help="For a LoRA checkpoint: write the complete model with the adapter fused in "
    "(W + scale * B @ A, streamed) instead of a PEFT adapter directory.",
)
@spelled_option(
    "all_steps",
    is_flag=True,
    help="Merge every checkpoint of the run, each to OUTPUT_PATH/step-N.",
)
@click.option(
    "--steps",
    default=None,
    help="Merge these steps, e.g. 100,200, each to OUTPUT_PATH/step-N.",
)
@spelled_option(
    "nproc_per_node",
    type=int,
    default=None,
    help="Merge on N CPU ranks of this machine (torchrun, gloo): the output bytes are split "
    "evenly between them.",
)
@click.option("--nnodes", default=None, help="Machines of a distributed merge (torchrun).")
@spelled_option("node_rank", type=int, default=None, help="This machine's rank (torchrun).")
@spelled_option("rdzv_endpoint", default=None, help="host:port of the rendezvous (torchrun).")
@spelled_option("rdzv_id", default=None, help="Rendezvous id (torchrun).")
@spelled_option("master_addr", default=None, help="Address of node 0 (torchrun).")
@spelled_option("master_port", type=int, default=None, help="Port on node 0 (torchrun).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@debug_option()
@click.pass_context
def command(
    ctx: click.Context,
    config: str,
    output_path: str | None,
    checkpoint: str | None,
    step: int | None,
    dtype: str | None,
    max_shard_size: str | None,
    verify: bool,
    remove_checkpoint_dir: bool,
    overwrite: bool,
    save_tokenizer: bool,
    engine: str,
    state_dict_dirname: str | None,
    average_last: int | None,
    average_steps: str | None,
    output_format: str,
    dry_run: bool,
    merge_lora: bool,
    all_steps: bool,
    steps: str | None,
    quiet: bool,
    debug: bool,
    **launch: Any,
) -> None:
    args, stray_debug = split_debug(list(ctx.args))
    args = check_options(ctx, args)
    setup_logging()  # --quiet hides the progress bar; the chosen checkpoint is still printed
    out = run_guarded(
        lambda: do_merge_sharded_fsdp_weights(
            config,
            output_path,
            args,
            save_tokenizer=save_tokenizer,
            checkpoint=checkpoint,
            step=step,
            dtype=dtype,
            max_shard_size=_shard_size(max_shard_size),
            verify=verify,
            remove_checkpoint_dir=remove_checkpoint_dir,
            overwrite=overwrite,
            engine=engine,
            quiet=quiet,
            state_dict_dirname=state_dict_dirname,
            average_last=average_last,
            average_steps=average_steps,
            output_format=output_format,
            dry_run=dry_run,
            merge_lora=merge_lora,
            all_steps=all_steps,
            steps=steps,
            **launch,
        ),
        debug or stray_debug,
    )
    if not dry_run:
        click.echo(str(out))


def _shard_size(value: str | int | None) -> str | int | None:
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return value


def do_cli(
    config: str,
    output_path: str | None = None,
    debug: bool = False,
    quiet: bool = False,
    **kwargs: Any,
) -> None:
    """fire entry point: python -m shardforge.cli.merge_sharded_fsdp_weights CONFIG --output_path DIR."""
    from shardforge.cli._common import fail

    setup_logging()  # --quiet hides the progress bar; the chosen checkpoint is still printed
    from shardforge.merge.request import OPTION_NAMES

    known = set(OPTION_NAMES) - {"output_path", "quiet"}
    kwargs = {k.replace("-", "_"): v for k, v in kwargs.items()}
    if "format" in kwargs:
        kwargs["output_format"] = kwargs.pop("format")
    out_path = output_path or kwargs.pop("output_path", None)
    if out_path is None and kwargs.get("output_format") != "torch":
        fail("--output_path is required", 2)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in known}
    if "max_shard_size" in options:
        options["max_shard_size"] = _shard_size(options["max_shard_size"])
    out = run_guarded(
        lambda: do_merge_sharded_fsdp_weights(
            config, out_path, fire_overrides(kwargs), quiet=quiet, **options
        ),
        debug,
    )
    if not options.get("dry_run"):
        print(out)


if __name__ == "__main__":
    import fire

    fire.Fire(do_cli)
